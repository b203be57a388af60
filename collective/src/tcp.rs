//! The tcp transport: a full mesh of TCP connections, non-blocking, driven with `poll(2)`.
//!
//! Each message travels in one frame, `magic u32 | kind u32 | value u64` followed by `value` payload bytes. Besides
//! data frames there is `BYE` (a clean shutdown) and `ABORT` (value = the rank the sender lost), so a connection
//! that closes without `BYE` means a dead process, and a rank that gives up tells everyone whom it lost.
//! While waiting, every idle connection is watched for a peer hang-up, so all survivors notice a dead rank, not
//! only its neighbours.
//!
//! # Who may join
//!
//! A connection becomes rank `j`'s only after a mutual challenge-response on the job's secret ([`JobKey`]: the
//! job token, else a random key shared through the rendezvous). The secret never crosses the wire:
//!
//! 1. the dialling (higher) rank `c` sends `HELLO(c) | size | nonce_c`;
//! 2. the accepting rank `a` answers `CHALLENGE(a) | nonce_a | HMAC-SHA256(key, ctx | "A" | nonce_c | nonce_a | c |
//!    a | size)`;
//! 3. `c` checks that proof and answers `PROOF(c) | HMAC-SHA256(key, ctx | "C" | nonce_c | nonce_a | c | a | size)`.
//!
//! Proofs are compared in constant time. Fresh nonces on both sides make a recorded handshake worthless, and the
//! direction byte keeps one side's proof from being reflected as the other's. The accepting side authenticates any
//! number of connections at once, each with a deadline ([`HANDSHAKE_STAGE`]), and drops (with a warning) every
//! connection that fails, so an impostor can neither take a rank's place nor stall the job; the real rank still joins.
//!
//! # Who may wait
//!
//! A dialling rank connects from the address it published (its listener's), so the acceptor can tell its
//! connection from a flood. A connection that greeted as rank `j` from the address rank `j` published is *vouched*:
//! no other address can displace it (at most [`MAX_CLAIMS`] wait per rank; a newer claim from that same address
//! displaces the oldest). Every other connection counts against two caps: [`MAX_PER_SOURCE`] per source address
//! (a new one displaces that address's oldest) and [`MAX_PENDING`] in all (a new one displaces the oldest of the
//! address with the most waiting, an address no rank published first). A flood from anywhere but a rank's own
//! address therefore only displaces itself; an attacker on a rank's own host (same source address) can still make
//! that rank's handshake a race until the connect deadline.
//!
//! What this does not give: the frames after the handshake are neither encrypted nor authenticated, so an attacker
//! who can rewrite the traffic on the path between two hosts can still read or alter it.

use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::bootstrap::{KeyValueClient, Rendezvous};
use crate::error::{Error, Result};
use crate::reduce::reduce_into;
use crate::transport::{RecvOp, SendOp, Transport};

const MAGIC: u32 = 0x3144_5648; // "HVD1"
const DATA: u32 = 1;
const BYE: u32 = 2;
const ABORT: u32 = 3;
/// Handshake frames; the value is the sender's rank.
const HELLO: u32 = 4;
const CHALLENGE: u32 = 5;
const PROOF: u32 = 6;
/// Fruitless rounds a waiting rank spins before it blocks in `poll(2)`.
const SPIN_ROUNDS: u32 = 32;
const SCRATCH: usize = 256 << 10;
/// Most bytes read ahead from an idle peer that hung up (to find its `BYE` or `ABORT` behind data it sent); beyond
/// that the rest waits in the socket for the operation that reads it.
const READAHEAD_MAX: usize = 64 << 20;

const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const HELLO_LEN: usize = 16 + 8 + NONCE_LEN;
const CHALLENGE_LEN: usize = 16 + NONCE_LEN + MAC_LEN;
const PROOF_LEN: usize = 16 + MAC_LEN;
/// Domain separation of the handshake's proofs.
const CONTEXT: &[u8] = b"hvd tcp handshake v1\0";
/// The longest an accepted connection may take to prove itself (a real rank needs a round trip).
pub const HANDSHAKE_STAGE: Duration = Duration::from_secs(10);
/// The most accepted, not vouched connections being authenticated at once (see the module documentation); a new
/// one displaces the oldest of the address with the most waiting.
pub const MAX_PENDING: usize = 64;
/// The most accepted, not vouched connections from one source address waiting at once; a new one displaces that
/// address's oldest.
pub const MAX_PER_SOURCE: usize = 16;
/// The most vouched connections (greeted as rank `j` from rank `j`'s published address) waiting per rank; a newer
/// one displaces the oldest.
pub const MAX_CLAIMS: usize = 4;
/// Connections accepted per round before the waiting ones are moved on, so a full backlog cannot starve them.
const ACCEPT_BATCH: usize = 16;
/// The rendezvous key under which rank 0 publishes a random job key when the job has no token.
const KEY_KEY: &str = "tcp.key";

fn frame(kind: u32, value: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&MAGIC.to_ne_bytes());
    b[4..8].copy_from_slice(&kind.to_ne_bytes());
    b[8..16].copy_from_slice(&value.to_ne_bytes());
    b
}

fn parse(b: &[u8; 16]) -> Option<(u32, u64)> {
    let [m0, m1, m2, m3, k0, k1, k2, k3, v @ ..] = *b;
    (u32::from_ne_bytes([m0, m1, m2, m3]) == MAGIC)
        .then(|| (u32::from_ne_bytes([k0, k1, k2, k3]), u64::from_ne_bytes(v)))
}

/// The first 16 bytes of `b` as a frame header (`None` when shorter).
fn parse_at(b: &[u8]) -> Option<(u32, u64)> {
    parse(b.get(..16)?.try_into().ok()?)
}

/// The secret that admits a connection into the job: HMAC-SHA256 key of the tcp handshake. Never printed.
#[derive(Clone)]
pub struct JobKey {
    /// The key padded (or hashed, when longer) to SHA-256's block, as HMAC uses it.
    block: [u8; 64],
}

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobKey(..)")
    }
}

impl JobKey {
    /// A key from a secret shared by every rank (the job token). An empty secret is refused.
    pub fn new(secret: &[u8]) -> Result<JobKey> {
        if secret.is_empty() {
            return Err(Error::Bootstrap(
                "the job key is empty: set `HVD_JOB_TOKEN` to the same non-empty value on every rank".into(),
            ));
        }
        let mut block = [0u8; 64];
        if secret.len() > block.len() {
            block[..32].copy_from_slice(&Sha256::digest(secret));
        } else {
            block[..secret.len()].copy_from_slice(secret);
        }
        Ok(JobKey { block })
    }

    /// A fresh random key (for ranks started in one process, e.g. [`crate::testing::LocalJob`]).
    pub fn random() -> Result<JobKey> {
        JobKey::new(&random_bytes::<32>()?)
    }

    /// The job's key: the rendezvous token when there is one; otherwise rank 0 draws a random key and publishes it
    /// through the rendezvous (key `tcp.key`), so it is as secret as the rendezvous itself (a `file:` directory:
    /// its permissions).
    pub fn for_job(
        rendezvous: &Rendezvous,
        kv: &KeyValueClient,
        rank: usize,
        timeout: Duration,
    ) -> Result<JobKey> {
        if let Rendezvous::Http {
            token: Some(token), ..
        } = rendezvous
        {
            return JobKey::new(token.as_bytes());
        }
        if rank == 0 {
            let hex: String = random_bytes::<32>()?
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            kv.put(KEY_KEY, hex.as_bytes())?;
            return JobKey::new(hex.as_bytes());
        }
        let hex = kv.get(KEY_KEY, timeout)?;
        if hex.len() != 64 || !hex.iter().all(u8::is_ascii_hexdigit) {
            return Err(Error::Bootstrap(format!(
                "the rendezvous key `{KEY_KEY}` is not 64 hex digits; is the rendezvous shared with another job?"
            )));
        }
        JobKey::new(&hex)
    }

    /// HMAC-SHA256 (RFC 2104) of the concatenated `parts`.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; MAC_LEN] {
        let mut inner = Sha256::new();
        inner.update(self.block.map(|b| b ^ 0x36));
        for p in parts {
            inner.update(p);
        }
        let mut outer = Sha256::new();
        outer.update(self.block.map(|b| b ^ 0x5c));
        outer.update(inner.finalize());
        outer.finalize().into()
    }

    /// The proof of one side of the handshake between `connector` and `acceptor` (`side`: `b"A"` or `b"C"`).
    fn proof(
        &self,
        side: &[u8; 1],
        nonces: (&[u8; NONCE_LEN], &[u8; NONCE_LEN]),
        connector: usize,
        acceptor: usize,
        size: usize,
    ) -> [u8; MAC_LEN] {
        self.mac(&[
            CONTEXT,
            side,
            nonces.0,
            nonces.1,
            &(connector as u64).to_le_bytes(),
            &(acceptor as u64).to_le_bytes(),
            &(size as u64).to_le_bytes(),
        ])
    }
}

/// `N` bytes from the kernel's random source.
fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: the pointer and length describe the unfilled tail of `b`.
        let r = unsafe { libc::getrandom(b[filled..].as_mut_ptr().cast(), N - filled, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("read random bytes for the tcp handshake", e));
        }
        filled += r as usize;
    }
    Ok(b)
}

/// Constant-time comparison of a received proof with the expected one.
fn same_proof(expected: &[u8; MAC_LEN], got: &[u8]) -> bool {
    constant_time_eq(expected, got)
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths only (a secret compared with what a peer
/// sent cannot be guessed byte by byte from response times). Also the rendezvous's token check.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

struct Peer {
    stream: TcpStream,
    /// Bytes read ahead while checking a hung-up idle peer, consumed before the socket.
    pending: Vec<u8>,
    pending_pos: usize,
    /// The read-ahead reached [`READAHEAD_MAX`]: stop watching this peer for a hang-up until it is consumed.
    readahead_full: bool,
    /// The peer said `BYE`.
    departed: bool,
    /// A frame to this peer is half written (an abort notice would corrupt the stream): bytes still owed.
    send_partial: bool,
    send_remaining: usize,
    closed: bool,
}

impl Peer {
    fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        if self.pending_pos < self.pending.len() {
            let n = dst.len().min(self.pending.len() - self.pending_pos);
            dst[..n].copy_from_slice(&self.pending[self.pending_pos..self.pending_pos + n]);
            self.pending_pos += n;
            if self.pending_pos == self.pending.len() {
                self.pending.clear();
                self.pending_pos = 0;
                self.readahead_full = false;
            }
            return Ok(n);
        }
        self.stream.read(dst)
    }
}

/// A full mesh of TCP connections between the ranks of a job.
pub struct TcpTransport {
    rank: usize,
    /// Longest single `poll` while waiting (short when another transport also needs attention).
    pub(crate) poll_ms: i32,
    peers: Vec<Option<Peer>>,
    scratch: Vec<u8>,
}

/// Binds a listener on `ip` (port chosen by the kernel) for [`TcpTransport::connect`].
pub fn listen(ip: IpAddr) -> Result<TcpListener> {
    TcpListener::bind((ip, 0)).map_err(|e| Error::io(format!("listen on `{ip}`"), e))
}

/// Where one connection's handshake stands.
enum Stage {
    /// Accepted: reading the peer's `HELLO`.
    Hello,
    /// Accepted: our `CHALLENGE` is (being) sent; reading the peer's `PROOF`.
    Proof {
        peer: usize,
        nonce_c: [u8; NONCE_LEN],
        nonce_a: [u8; NONCE_LEN],
    },
    /// Dialled: our `HELLO` is (being) sent; reading the acceptor's `CHALLENGE`.
    Challenge { nonce_c: [u8; NONCE_LEN] },
    /// Dialled and the acceptor proved itself: our `PROOF` is (being) sent.
    Proved,
}

/// How a handshake went wrong.
enum Failure {
    /// The connection broke or timed out (a dialled one is dialled again).
    Lost(String),
    /// The other side is not a rank of this job (wrong key, wrong rank or size, not the protocol).
    Refused(String),
}

/// One connection being authenticated.
struct Shake {
    stream: TcpStream,
    addr: SocketAddr,
    /// The rank this side dialled; `None` for an accepted connection.
    dialled: Option<usize>,
    stage: Stage,
    inbuf: [u8; CHALLENGE_LEN],
    have: usize,
    out: Vec<u8>,
    out_pos: usize,
    expires: Instant,
}

/// The job-wide facts a handshake checks against.
struct Local<'a> {
    rank: usize,
    size: usize,
    key: &'a JobKey,
    /// The address this rank published (its listener's), which its dialled connections come from.
    source: Option<IpAddr>,
}

impl Shake {
    /// Dials rank `j` at `addr` (retrying a refused connect until `deadline`) and queues our `HELLO`.
    fn dial(me: &Local<'_>, j: usize, addr: SocketAddr, deadline: Instant) -> Result<Shake> {
        let stream = loop {
            match connect_from(me.source, &addr, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(peer = j, %addr, error = %e, "retrying connect");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(Error::io(format!("connect to rank {j} at `{addr}`"), e)),
            }
        };
        let cfg = |e| {
            Error::io(
                format!("configure the connection to rank {j} at `{addr}`"),
                e,
            )
        };
        stream.set_nodelay(true).map_err(cfg)?;
        stream.set_nonblocking(true).map_err(cfg)?;
        let nonce_c = random_bytes::<NONCE_LEN>()?;
        let mut out = Vec::with_capacity(HELLO_LEN);
        out.extend_from_slice(&frame(HELLO, me.rank as u64));
        out.extend_from_slice(&(me.size as u64).to_ne_bytes());
        out.extend_from_slice(&nonce_c);
        Ok(Shake {
            stream,
            addr,
            dialled: Some(j),
            stage: Stage::Challenge { nonce_c },
            inbuf: [0; CHALLENGE_LEN],
            have: 0,
            out,
            out_pos: 0,
            expires: deadline,
        })
    }

    fn accepted(stream: TcpStream, addr: SocketAddr, expires: Instant) -> io::Result<Shake> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        Ok(Shake {
            stream,
            addr,
            dialled: None,
            stage: Stage::Hello,
            inbuf: [0; CHALLENGE_LEN],
            have: 0,
            out: Vec::new(),
            out_pos: 0,
            expires,
        })
    }

    /// The rank an accepted connection greeted as, when it comes from the address that rank published.
    fn vouched(&self, addrs: &[Option<SocketAddr>]) -> Option<usize> {
        match self.stage {
            Stage::Proof { peer, .. }
                if self.dialled.is_none()
                    && addrs
                        .get(peer)
                        .copied()
                        .flatten()
                        .is_some_and(|a| same_ip(a.ip(), self.addr.ip())) =>
            {
                Some(peer)
            }
            _ => None,
        }
    }

    fn wants_write(&self) -> bool {
        self.out_pos < self.out.len()
    }

    /// Moves the handshake on as far as the socket allows: `Ok(Some(rank))` once the peer is authenticated as
    /// `rank`, `Ok(None)` while waiting. `open(j)`: rank `j` may still join through this listener.
    fn advance(
        &mut self,
        me: &Local<'_>,
        open: &dyn Fn(usize) -> bool,
    ) -> Result<Option<usize>, Failure> {
        loop {
            while self.out_pos < self.out.len() {
                match self.stream.write(&self.out[self.out_pos..]) {
                    Ok(0) => return Err(Failure::Lost("the connection closed".into())),
                    Ok(n) => self.out_pos += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Failure::Lost(format!("sending failed: {e}"))),
                }
            }
            let need = match self.stage {
                Stage::Hello => HELLO_LEN,
                Stage::Proof { .. } => PROOF_LEN,
                Stage::Challenge { .. } => CHALLENGE_LEN,
                Stage::Proved => return Ok(self.dialled),
            };
            // Exactly the handshake's bytes: whatever follows belongs to the data stream.
            while self.have < need {
                match self.stream.read(&mut self.inbuf[self.have..need]) {
                    Ok(0) => {
                        return Err(Failure::Lost(
                            "the connection closed during the handshake".into(),
                        ));
                    }
                    Ok(n) => self.have += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Failure::Lost(format!("receiving failed: {e}"))),
                }
            }
            self.have = 0;
            let msg = &self.inbuf[..need];
            let head = parse_at(msg);
            match self.stage {
                Stage::Hello => {
                    let Some((HELLO, c)) = head else {
                        return Err(Failure::Refused(
                            "it did not greet with an hvd HELLO".into(),
                        ));
                    };
                    let size = u64::from_ne_bytes(msg[16..24].try_into().unwrap_or_default());
                    if size != me.size as u64 {
                        return Err(Failure::Refused(format!(
                            "it claims a job of {size} ranks, this job has {}",
                            me.size
                        )));
                    }
                    let peer = usize::try_from(c).unwrap_or(usize::MAX);
                    if peer <= me.rank || peer >= me.size || !open(peer) {
                        return Err(Failure::Refused(format!(
                            "it claims rank {c}, which does not connect to rank {} now",
                            me.rank
                        )));
                    }
                    let nonce_c: [u8; NONCE_LEN] =
                        msg[24..24 + NONCE_LEN].try_into().unwrap_or_default();
                    let nonce_a =
                        random_bytes::<NONCE_LEN>().map_err(|e| Failure::Lost(e.to_string()))?;
                    let proof = me
                        .key
                        .proof(b"A", (&nonce_c, &nonce_a), peer, me.rank, me.size);
                    self.out.clear();
                    self.out_pos = 0;
                    self.out
                        .extend_from_slice(&frame(CHALLENGE, me.rank as u64));
                    self.out.extend_from_slice(&nonce_a);
                    self.out.extend_from_slice(&proof);
                    self.stage = Stage::Proof {
                        peer,
                        nonce_c,
                        nonce_a,
                    };
                }
                Stage::Proof {
                    peer,
                    nonce_c,
                    nonce_a,
                } => {
                    let expected = me
                        .key
                        .proof(b"C", (&nonce_c, &nonce_a), peer, me.rank, me.size);
                    if head != Some((PROOF, peer as u64)) || !same_proof(&expected, &msg[16..]) {
                        return Err(Failure::Refused(format!(
                            "it claimed rank {peer} but did not prove the job token"
                        )));
                    }
                    return Ok(Some(peer));
                }
                Stage::Challenge { nonce_c } => {
                    let j = self.dialled.unwrap_or(usize::MAX);
                    let Some((CHALLENGE, a)) = head else {
                        return Err(Failure::Refused(
                            "it did not answer with an hvd CHALLENGE".into(),
                        ));
                    };
                    let nonce_a: [u8; NONCE_LEN] =
                        msg[16..16 + NONCE_LEN].try_into().unwrap_or_default();
                    let expected = me
                        .key
                        .proof(b"A", (&nonce_c, &nonce_a), me.rank, j, me.size);
                    if a != j as u64 || !same_proof(&expected, &msg[16 + NONCE_LEN..]) {
                        return Err(Failure::Refused(format!(
                            "it did not prove the job token as rank {j}"
                        )));
                    }
                    let proof = me
                        .key
                        .proof(b"C", (&nonce_c, &nonce_a), me.rank, j, me.size);
                    self.out.clear();
                    self.out_pos = 0;
                    self.out.extend_from_slice(&frame(PROOF, me.rank as u64));
                    self.out.extend_from_slice(&proof);
                    self.stage = Stage::Proved;
                }
                Stage::Proved => return Ok(self.dialled),
            }
        }
    }
}

/// Whether `a` and `b` are one address (an IPv4-mapped IPv6 address is its IPv4 address).
fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

/// Which waiting connection to drop before one more from `from` waits (see the module documentation): with
/// [`MAX_PER_SOURCE`] of `from`'s waiting, its oldest; else with [`MAX_PENDING`] waiting, the oldest of the address
/// with the most waiting (of equals, one no rank published). Vouched and dialled connections never go.
fn make_room(shakes: &[Shake], from: IpAddr, addrs: &[Option<SocketAddr>]) -> Option<usize> {
    let waiting: Vec<(usize, &Shake)> = shakes
        .iter()
        .enumerate()
        .filter(|(_, s)| s.dialled.is_none() && s.vouched(addrs).is_none())
        .collect();
    let of = |ip: IpAddr| {
        waiting
            .iter()
            .filter(move |(_, s)| same_ip(s.addr.ip(), ip))
    };
    let oldest = |ip: IpAddr| of(ip).min_by_key(|(_, s)| s.expires).map(|(i, _)| *i);
    if of(from).count() >= MAX_PER_SOURCE {
        return oldest(from);
    }
    if waiting.len() < MAX_PENDING {
        return None;
    }
    let published = |ip: IpAddr| addrs.iter().flatten().any(|a| same_ip(a.ip(), ip));
    let busiest = waiting
        .iter()
        .map(|(_, s)| s.addr.ip())
        .max_by_key(|ip| (of(*ip).count(), !published(*ip)))?;
    oldest(busiest)
}

/// Drops the oldest vouched connections of a rank that has more than [`MAX_CLAIMS`] waiting.
fn cap_claims(shakes: &mut Vec<Shake>, addrs: &[Option<SocketAddr>]) {
    loop {
        let mut claims = vec![0usize; addrs.len()];
        let mut over = None;
        for s in shakes.iter() {
            if let Some(j) = s.vouched(addrs) {
                claims[j] += 1;
                if claims[j] > MAX_CLAIMS {
                    over = Some(j);
                }
            }
        }
        let Some(j) = over else { return };
        let victim = shakes
            .iter()
            .enumerate()
            .filter(|(_, s)| s.vouched(addrs) == Some(j))
            .min_by_key(|(_, s)| s.expires)
            .map(|(i, _)| i);
        let Some(victim) = victim else { return };
        let s = shakes.swap_remove(victim);
        tracing::warn!(from = %s.addr, rank = j, "dropped an unauthenticated tcp connection: too many claim this rank");
    }
}

/// Connects to `to` from `source` (the port chosen by the kernel), so that the peer sees the address this rank
/// published; from whatever address the kernel picks when `source` cannot be bound (unspecified, another family,
/// loopback towards a remote peer).
pub fn connect_from(
    source: Option<IpAddr>,
    to: &SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let usable = source.filter(|s| {
        !s.is_unspecified()
            && s.is_ipv4() == to.is_ipv4()
            && s.is_loopback() == to.ip().is_loopback()
    });
    let Some(fd) = usable.and_then(|s| bound_socket(s).ok()) else {
        return TcpStream::connect_timeout(to, timeout);
    };
    let (sa, len) = sockaddr(*to);
    // SAFETY: `sa` holds a socket address of `len` bytes; `fd` is an open socket.
    if unsafe { libc::connect(fd.as_raw_fd(), (&raw const sa).cast(), len) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let mut pfd = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            };
            let ms = deadline
                .saturating_duration_since(Instant::now())
                .as_millis()
                .min(i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r > 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if r < 0 && e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if r < 0 {
                return Err(e);
            }
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection timed out",
            ));
        }
    }
    let stream = TcpStream::from(fd);
    if let Some(e) = stream.take_error()? {
        return Err(e);
    }
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// A non-blocking TCP socket bound to `ip` (any port).
fn bound_socket(ip: IpAddr) -> io::Result<OwnedFd> {
    let family = if ip.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2) call.
    let raw = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // The port is chosen at connect, per destination, not at bind (saves ephemeral ports); best effort.
    let on: libc::c_int = 1;
    // SAFETY: `on` is a c_int of the given size; the option only changes when the port is chosen.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&raw const on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let (sa, len) = sockaddr(SocketAddr::new(ip, 0));
    // SAFETY: `sa` holds a socket address of `len` bytes.
    if unsafe { libc::bind(fd.as_raw_fd(), (&raw const sa).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// `a` as a C socket address and its length.
fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all zeros is a valid (empty) value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any socket address.
            unsafe { std::ptr::write((&raw mut ss).cast::<libc::sockaddr_in>(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&raw mut ss).cast::<libc::sockaddr_in6>(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

impl TcpTransport {
    /// Connects to every other rank. `addrs[r]` is rank `r`'s listening address; `listener` is this rank's own;
    /// `key` the job's secret, which every connection must prove (see the module documentation).
    /// Lower ranks accept, higher ranks connect, so no pair dials twice.
    pub fn connect(
        rank: usize,
        listener: &TcpListener,
        addrs: &[SocketAddr],
        key: &JobKey,
        timeout: Duration,
    ) -> Result<Self> {
        let addrs: Vec<Option<SocketAddr>> = addrs.iter().copied().map(Some).collect();
        Self::connect_subset(rank, listener, &addrs, key, timeout)
    }

    /// Like [`connect`](Self::connect), but only to the ranks whose address is `Some` (the others are reached by
    /// another transport). Every rank must pass the same pattern of `Some`s for each pair.
    pub fn connect_subset(
        rank: usize,
        listener: &TcpListener,
        addrs: &[Option<SocketAddr>],
        key: &JobKey,
        timeout: Duration,
    ) -> Result<Self> {
        let size = addrs.len();
        if rank >= size {
            return Err(Error::Bootstrap(format!(
                "rank {rank} is not a rank of a job of {size}"
            )));
        }
        let source = listener.local_addr().ok().map(|a| a.ip());
        let me = Local {
            rank,
            size,
            key,
            source,
        };
        let deadline = Instant::now() + timeout;
        let mut peers: Vec<Option<Peer>> = (0..size).map(|_| None).collect();
        let mut shakes: Vec<Shake> = Vec::new();
        for (j, addr) in addrs.iter().enumerate().take(rank) {
            if let Some(addr) = addr {
                shakes.push(Shake::dial(&me, j, *addr, deadline)?);
            }
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("make the listener non-blocking", e))?;
        let missing = |peers: &[Option<Peer>]| -> Vec<usize> {
            (0..size)
                .filter(|j| *j != rank && addrs[*j].is_some() && peers[*j].is_none())
                .collect()
        };
        let mut refused = 0usize;
        let mut last_refusal = String::new();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        loop {
            let now = Instant::now();
            for _ in 0..ACCEPT_BATCH {
                match listener.accept() {
                    Ok((stream, from)) => {
                        if let Some(victim) = make_room(&shakes, from.ip(), addrs) {
                            let s = shakes.swap_remove(victim);
                            tracing::warn!(from = %s.addr, "dropped an unauthenticated tcp connection: too many wait");
                        }
                        let expires = (now + HANDSHAKE_STAGE).min(deadline);
                        match Shake::accepted(stream, from, expires) {
                            Ok(s) => shakes.push(s),
                            Err(e) => {
                                tracing::debug!(%from, error = %e, "dropped an accepted connection")
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                        ) => {}
                    Err(e) => return Err(Error::io("accept a connection", e)),
                }
            }
            let mut i = 0;
            while i < shakes.len() {
                let open = |j: usize| addrs[j].is_some() && peers[j].is_none();
                let step = if shakes[i].expires <= now {
                    Err(Failure::Lost(format!(
                        "it did not finish the handshake within {:?}",
                        HANDSHAKE_STAGE.min(timeout)
                    )))
                } else {
                    shakes[i].advance(&me, &open)
                };
                match step {
                    Ok(None) => i += 1,
                    Ok(Some(j)) => {
                        let s = shakes.swap_remove(i);
                        if peers[j].is_some() {
                            tracing::warn!(from = %s.addr, rank = j, "dropped a second connection for a joined rank");
                        } else {
                            tracing::debug!(from = %s.addr, rank = j, "rank authenticated");
                            peers[j] = Some(new_peer(s.stream, j)?);
                        }
                    }
                    Err(f) => {
                        let s = shakes.swap_remove(i);
                        match (s.dialled, f) {
                            (None, Failure::Lost(why) | Failure::Refused(why)) => {
                                tracing::warn!(from = %s.addr, reason = %why, "refused a tcp connection");
                                refused += 1;
                                last_refusal = format!("`{}`: {why}", s.addr);
                            }
                            (Some(j), Failure::Refused(why)) => {
                                return Err(Error::Bootstrap(format!(
                                    "rank {j} at `{}` is not a rank of this job: {why} (do all ranks share \
                                     `HVD_JOB_TOKEN`? does another process answer at that address?)",
                                    s.addr
                                )));
                            }
                            (Some(j), Failure::Lost(why)) => {
                                if Instant::now() >= deadline {
                                    tracing::debug!(peer = j, addr = %s.addr, reason = %why, "giving up");
                                    return Err(Error::Timeout {
                                        op: "connect",
                                        ranks: missing(&peers),
                                        waited: timeout,
                                    });
                                }
                                tracing::debug!(peer = j, addr = %s.addr, reason = %why, "dialling again");
                                std::thread::sleep(Duration::from_millis(20));
                                shakes.push(Shake::dial(&me, j, s.addr, deadline)?);
                            }
                        }
                    }
                }
            }
            cap_claims(&mut shakes, addrs);
            let missing_now = missing(&peers);
            if missing_now.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                if refused > 0 {
                    return Err(Error::Bootstrap(format!(
                        "rank(s) {missing_now:?} did not join within {timeout:?}; {refused} connection(s) were \
                         refused, the last from {last_refusal} (do all ranks share `HVD_JOB_TOKEN`?)"
                    )));
                }
                return Err(Error::Timeout {
                    op: "connect",
                    ranks: missing_now,
                    waited: timeout,
                });
            }
            fds.clear();
            fds.push(libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            for s in &shakes {
                let mut events = libc::POLLIN;
                if s.wants_write() {
                    events |= libc::POLLOUT;
                }
                fds.push(libc::pollfd {
                    fd: s.stream.as_raw_fd(),
                    events,
                    revents: 0,
                });
            }
            let next = shakes
                .iter()
                .map(|s| s.expires)
                .fold(deadline, Instant::min);
            let wait_ms = next
                .saturating_duration_since(Instant::now())
                .as_millis()
                .clamp(1, 50) as i32;
            // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfd structs.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(Error::io("wait for connections with poll", e));
                }
            }
        }
        Ok(TcpTransport {
            rank,
            poll_ms: 50,
            peers,
            scratch: vec![0; SCRATCH + 8],
        })
    }

    fn peer(&mut self, j: usize) -> Result<&mut Peer> {
        match self.peers.get_mut(j) {
            Some(Some(p)) if !p.closed => Ok(p),
            _ => Err(Error::Broken(format!("no open connection to rank {j}"))),
        }
    }

    /// Reads everything a hung-up idle peer sent and decides whether it left cleanly or died.
    fn inspect_hangup(&mut self, j: usize) -> Result<()> {
        let size = self.peers.len();
        let p = self.peer(j)?;
        if p.pending_pos > 0 {
            p.pending.drain(..p.pending_pos);
            p.pending_pos = 0;
        }
        let mut eof = false;
        let mut chunk = [0u8; 64 << 10];
        while p.pending.len() < READAHEAD_MAX {
            let room = (READAHEAD_MAX - p.pending.len()).min(chunk.len());
            match p.stream.read(&mut chunk[..room]) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => p.pending.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::PeerLost {
                        rank: j,
                        reason: format!("its connection failed: {e}"),
                    });
                }
            }
        }
        // Walk the frames read so far (lengths from the wire: checked, never allocated).
        let mut at = 0usize;
        while let Some(head) = parse_at(p.pending.get(at..).unwrap_or_default()) {
            match head {
                (DATA, len) => {
                    match usize::try_from(len)
                        .ok()
                        .and_then(|len| at.checked_add(16)?.checked_add(len))
                    {
                        Some(next) => at = next,
                        None => break,
                    }
                }
                (BYE, _) => {
                    p.departed = true;
                    return Ok(());
                }
                (ABORT, culprit) => return Err(lost_via(culprit, j, size)),
                _ => break,
            }
        }
        if eof {
            return Err(Error::PeerLost {
                rank: j,
                reason: "its connection closed without a goodbye (the process died or was killed)"
                    .into(),
            });
        }
        // Not decided yet; with the read-ahead full, the rest waits for the operation that reads it.
        p.readahead_full = p.pending.len() >= READAHEAD_MAX;
        Ok(())
    }
}

/// The error for rank `reporter`'s abort notice naming `culprit` (a number from the wire).
fn lost_via(culprit: u64, reporter: usize, size: usize) -> Error {
    match usize::try_from(culprit) {
        Ok(rank) if rank < size => Error::PeerLost {
            rank,
            reason: format!("rank {reporter} lost it and aborted"),
        },
        _ => Error::PeerLost {
            rank: reporter,
            reason: format!("it aborted naming rank {culprit}, which is not a rank of this job"),
        },
    }
}

fn new_peer(stream: TcpStream, j: usize) -> Result<Peer> {
    let cfg = |e| Error::io(format!("configure the connection to rank {j}"), e);
    stream.set_nodelay(true).map_err(cfg)?;
    stream.set_read_timeout(None).map_err(cfg)?;
    stream.set_nonblocking(true).map_err(cfg)?;
    Ok(Peer {
        stream,
        pending: Vec::new(),
        pending_pos: 0,
        readahead_full: false,
        departed: false,
        send_partial: false,
        send_remaining: 0,
        closed: false,
    })
}

/// Checks a data frame's header against the message this rank expects.
fn check_frame(
    hdr: &[u8; 16],
    expected: usize,
    j: usize,
    me: usize,
    size: usize,
    p: &mut Peer,
) -> Result<()> {
    match parse(hdr) {
        Some((DATA, len)) if len == expected as u64 => Ok(()),
        Some((DATA, len)) => Err(Error::Mismatch {
            rank: j,
            reference: me,
            detail: format!(
                "rank {j} sent a {len}-byte message where rank {me} expected {expected} bytes"
            ),
        }),
        Some((BYE, _)) => {
            p.departed = true;
            Err(Error::PeerLost {
                rank: j,
                reason: "it shut its communicator down while this rank still expected data".into(),
            })
        }
        Some((ABORT, culprit)) => Err(lost_via(culprit, j, size)),
        _ => Err(Error::PeerLost {
            rank: j,
            reason: "it sent bytes that are not an hvd frame".into(),
        }),
    }
}

fn eof_error(j: usize) -> Error {
    Error::PeerLost {
        rank: j,
        reason:
            "its connection closed in the middle of an operation (the process died or was killed)"
                .into(),
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.peers.len()
    }

    fn progress_send(&mut self, op: &mut SendOp<'_>) -> Result<bool> {
        let j = op.peer;
        let p = self.peer(j)?;
        let hdr = frame(DATA, op.data.len() as u64);
        let total = 16 + op.data.len();
        let mut moved = false;
        while op.pos < total {
            let r = if op.pos < 16 {
                p.stream
                    .write_vectored(&[IoSlice::new(&hdr[op.pos..]), IoSlice::new(op.data)])
            } else {
                p.stream.write(&op.data[op.pos - 16..])
            };
            match r {
                Ok(0) => return Err(eof_error(j)),
                Ok(n) => {
                    op.pos += n;
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::PeerLost {
                        rank: j,
                        reason: format!("sending to it failed: {e}"),
                    });
                }
            }
        }
        op.finished = op.pos == total;
        p.send_partial = op.pos > 0 && !op.finished;
        p.send_remaining = total - op.pos;
        Ok(moved)
    }

    fn progress_recv(&mut self, op: &mut RecvOp<'_>) -> Result<bool> {
        let j = op.peer;
        let me = self.rank;
        let size = self.peers.len();
        let Self { peers, scratch, .. } = self;
        let p = match peers.get_mut(j) {
            Some(Some(p)) if !p.closed => p,
            _ => return Err(Error::Broken(format!("no open connection to rank {j}"))),
        };
        let mut moved = false;
        loop {
            let r = if op.hdr_len < 16 {
                p.read(&mut op.hdr[op.hdr_len..])
                    .inspect(|n| op.hdr_len += n)
            } else {
                let remaining = op.buf.len() - op.pos - op.carry_len;
                if remaining == 0 {
                    op.finished = true;
                    return Ok(true);
                }
                match op.reduce {
                    None => p.read(&mut op.buf[op.pos..]).inspect(|n| op.pos += n),
                    Some((dtype, rop)) => {
                        // Reduce whole elements as they arrive; keep a split element's bytes for the next read.
                        let cap = remaining.min(SCRATCH);
                        scratch[..op.carry_len].copy_from_slice(&op.carry[..op.carry_len]);
                        p.read(&mut scratch[op.carry_len..op.carry_len + cap])
                            .inspect(|&n| {
                                let total = op.carry_len + n;
                                let whole = total / dtype.size() * dtype.size();
                                reduce_into(
                                    &mut op.buf[op.pos..op.pos + whole],
                                    &scratch[..whole],
                                    dtype,
                                    rop,
                                );
                                op.pos += whole;
                                op.carry_len = total - whole;
                                op.carry[..op.carry_len].copy_from_slice(&scratch[whole..total]);
                            })
                    }
                }
            };
            match r {
                Ok(0) => return Err(eof_error(j)),
                Ok(_) => {
                    moved = true;
                    if op.hdr_len == 16 && op.pos == 0 && op.carry_len == 0 {
                        check_frame(&op.hdr, op.buf.len(), j, me, size, p)?;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::PeerLost {
                        rank: j,
                        reason: format!("receiving from it failed: {e}"),
                    });
                }
            }
        }
        if op.hdr_len == 16 && op.pos == op.buf.len() {
            op.finished = true;
        }
        Ok(moved)
    }

    fn spin_rounds(&self) -> u32 {
        SPIN_ROUNDS
    }

    fn wait(&mut self, send_peers: &[usize], recv_peers: &[usize], idle: u32) -> Result<()> {
        if idle < SPIN_ROUNDS {
            std::hint::spin_loop();
            return Ok(());
        }
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut who: Vec<usize> = Vec::new();
        for (j, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            if p.closed || (p.departed && p.pending_pos >= p.pending.len()) {
                continue;
            }
            let mut events: libc::c_short = 0;
            if recv_peers.contains(&j) {
                events |= libc::POLLIN;
            } else if !p.readahead_full {
                events |= libc::POLLRDHUP;
            }
            if send_peers.contains(&j) {
                events |= libc::POLLOUT;
            }
            if events == 0 {
                continue;
            }
            fds.push(libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events,
                revents: 0,
            });
            who.push(j);
        }
        // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfd structs.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, self.poll_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(Error::io("wait for peers with poll", e));
            }
            return Ok(());
        }
        for (fd, j) in fds.iter().zip(who) {
            let hung = fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0;
            if hung && fd.events & libc::POLLIN == 0 {
                self.inspect_hangup(j)?;
            }
        }
        Ok(())
    }

    fn abort(&mut self, culprit: usize, reason: &str) {
        tracing::debug!(culprit, reason, "aborting tcp connections");
        for p in self.peers.iter_mut().flatten() {
            if p.closed {
                continue;
            }
            if p.send_partial && p.send_remaining <= 64 << 20 {
                // Finish the half-written frame with zeros (the peer's operation fails anyway) so that the
                // abort notice after it is read as a frame and names the culprit.
                let _ = p.stream.set_nonblocking(false);
                let _ = p.stream.set_write_timeout(Some(Duration::from_secs(1)));
                let zeros = vec![0u8; p.send_remaining.min(1 << 20)];
                while p.send_remaining > 0 {
                    let n = p.send_remaining.min(zeros.len());
                    if p.stream.write_all(&zeros[..n]).is_err() {
                        break;
                    }
                    p.send_remaining -= n;
                }
                p.send_partial = p.send_remaining > 0;
            }
            if !p.send_partial && !p.departed {
                let _ = p.stream.set_nonblocking(false);
                let _ = p.stream.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = p.stream.write_all(&frame(ABORT, culprit as u64));
            }
            let _ = p.stream.shutdown(Shutdown::Write);
            drain(&mut p.stream);
            p.closed = true;
        }
    }
}

/// Reads and drops what a peer already sent, so that closing the socket sends a FIN rather than a reset (a reset
/// can make the peer drop our abort notice unread).
fn drain(stream: &mut TcpStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(20)));
    let mut sink = [0u8; 64 << 10];
    let deadline = Instant::now() + Duration::from_millis(200);
    while Instant::now() < deadline {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for p in self.peers.iter_mut().flatten() {
            if p.closed || p.send_partial {
                continue;
            }
            let _ = p.stream.set_nonblocking(false);
            let _ = p.stream.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = p.stream.write_all(&frame(BYE, 0));
            let _ = p.stream.shutdown(Shutdown::Write);
        }
    }
}

/// The first IPv4 (else IPv6) address of network interface `name`.
pub fn interface_address(name: &str) -> Result<IpAddr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `list`, freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(Error::io(
            "list network interfaces",
            io::Error::last_os_error(),
        ));
    }
    let mut found: Vec<IpAddr> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let ifname = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points at a sockaddr whose family says which struct it is.
            let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            if ifname == name && family == libc::AF_INET {
                // SAFETY: the family is AF_INET, so this is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                found.insert(
                    0,
                    IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()),
                );
            } else if ifname == name && family == libc::AF_INET6 {
                // SAFETY: the family is AF_INET6, so this is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                found.push(IpAddr::from(sin6.sin6_addr.s6_addr));
            }
        }
        if !names.contains(&ifname) {
            names.push(ifname);
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found.first().copied().ok_or_else(|| {
        Error::Bootstrap(format!(
            "network interface `{name}` has no address (interfaces: {})",
            names.join(", ")
        ))
    })
}
