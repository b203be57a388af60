//! The handshake that admits a connection into the job (see "Who may join" and "Who may wait" in the module
//! above): the job's key, the challenge-response on it, and the caps on connections waiting to prove themselves.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::socket::connect_from;
use super::{Peer, TcpTransport, frame, new_peer, parse_at};
use crate::error::{Error, Result};
use crate::rendezvous::{KeyValueClient, Rendezvous};

/// Handshake frames; the value is the sender's rank.
const HELLO: u32 = 4;
const CHALLENGE: u32 = 5;
const PROOF: u32 = 6;

const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const HELLO_LEN: usize = 16 + 8 + NONCE_LEN;
const CHALLENGE_LEN: usize = 16 + NONCE_LEN + MAC_LEN;
const PROOF_LEN: usize = 16 + MAC_LEN;
/// Domain separation of the handshake's proofs.
const CONTEXT: &[u8] = b"hvd tcp handshake v1\0";
/// What a group's key is derived for (domain separation from the handshake's own MACs).
const GROUP_CONTEXT: &[u8] = b"hvd group key v1\0";
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

    /// A fresh random key (for ranks started in one process, e.g. by `testing::LocalJob`).
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

    /// The key of one join of a group of the job's ranks (a process set), named by `tag` (which carries the set's id
    /// and the join's nonce): HMAC of the tag under the job's key. The handshake's MAC covers rank, size and
    /// direction; under this key it covers the group too, so a rank of another group of the same size, or of an
    /// earlier join of this one, is refused although it holds the job's token.
    pub fn for_group(&self, tag: &str) -> JobKey {
        let derived = self.mac(&[
            GROUP_CONTEXT,
            &(tag.len() as u64).to_le_bytes(),
            tag.as_bytes(),
        ]);
        let mut block = [0u8; 64];
        block[..MAC_LEN].copy_from_slice(&derived);
        JobKey { block }
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
        let deadline = crate::time::saturating_add(Instant::now(), timeout);
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
            // A member of this elastic round the launcher found silent (frozen after the round formed) will never
            // connect: fail now (each pass waits 50 ms at most), not at the deadline.
            crate::liveness::check()?;
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
        Ok(TcpTransport::from_peers(rank, peers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::listen;
    use std::net::Ipv4Addr;

    /// A rank of another process set of the same size, holding the job's token, dials a member of this set: the
    /// handshake fails both ways (the group's key is in its MAC), and neither joins the other's set.
    #[test]
    fn a_rank_of_another_set_of_the_same_size_is_refused() {
        let job = JobKey::new(b"the job token").unwrap();
        let (ours, theirs) = (job.for_group("ps1-5eed"), job.for_group("ps2-5eed"));
        let later = job.for_group("ps1-0the");
        assert_ne!(ours.block, theirs.block);
        assert_ne!(
            ours.block, later.block,
            "another join of the same set has another key"
        );
        assert_eq!(ours.block, job.for_group("ps1-5eed").block);
        let ls: Vec<TcpListener> = (0..2)
            .map(|_| listen(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
        let connect = Duration::from_secs(3);
        let (r0, r1) = std::thread::scope(|s| {
            let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &ours, connect));
            let r1 = s.spawn(|| TcpTransport::connect(1, &ls[1], &addrs, &theirs, connect));
            (r0.join().unwrap(), r1.join().unwrap())
        });
        let e0 = r0
            .err()
            .expect("the member must not accept another set's rank");
        let e1 = r1
            .err()
            .expect("the other set's rank must not accept the member's proof");
        assert!(e0.to_string().contains("refused"), "{e0}");
        assert!(e1.to_string().contains("not a rank of this job"), "{e1}");
        // The same two ranks with the same group's key join.
        let (r0, r1) = std::thread::scope(|s| {
            let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &ours, connect));
            let r1 = s.spawn(|| TcpTransport::connect(1, &ls[1], &addrs, &ours, connect));
            (r0.join().unwrap(), r1.join().unwrap())
        });
        r0.expect("member 0 joins");
        r1.expect("member 1 joins");
    }
}
