//! The tcp transport: a full mesh of TCP connections, non-blocking, driven with `poll(2)`.
//!
//! Each message travels in one frame, `magic u32 | kind u32 | value u64` followed by `value` payload bytes. Besides
//! data frames there is `BYE` (a clean shutdown) and `ABORT` (value = the rank the sender lost), so a connection
//! that closes without `BYE` means a dead process, and a rank that gives up tells everyone whom it lost.
//! While waiting, every idle connection is watched for a peer hang-up, so all survivors notice a dead rank, not
//! only its neighbours.

use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::reduce::reduce_into;
use crate::transport::{RecvOp, SendOp, Transport};

const MAGIC: u32 = 0x3144_5648; // "HVD1"
const DATA: u32 = 1;
const BYE: u32 = 2;
const ABORT: u32 = 3;
const HELLO: u32 = 4;
/// Fruitless rounds a waiting rank spins before it blocks in `poll(2)`.
const SPIN_ROUNDS: u32 = 32;
const SCRATCH: usize = 256 << 10;

fn frame(kind: u32, value: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&MAGIC.to_ne_bytes());
    b[4..8].copy_from_slice(&kind.to_ne_bytes());
    b[8..16].copy_from_slice(&value.to_ne_bytes());
    b
}

fn parse(b: &[u8]) -> Option<(u32, u64)> {
    let magic = u32::from_ne_bytes(b.get(0..4)?.try_into().ok()?);
    (magic == MAGIC).then_some(())?;
    Some((
        u32::from_ne_bytes(b[4..8].try_into().ok()?),
        u64::from_ne_bytes(b[8..16].try_into().ok()?),
    ))
}

struct Peer {
    stream: TcpStream,
    /// Bytes read ahead while checking a hung-up idle peer, consumed before the socket.
    pending: Vec<u8>,
    pending_pos: usize,
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

impl TcpTransport {
    /// Connects to every other rank. `addrs[r]` is rank `r`'s listening address; `listener` is this rank's own.
    /// Lower ranks accept, higher ranks connect, so no pair dials twice.
    pub fn connect(
        rank: usize,
        listener: &TcpListener,
        addrs: &[SocketAddr],
        timeout: Duration,
    ) -> Result<Self> {
        let addrs: Vec<Option<SocketAddr>> = addrs.iter().copied().map(Some).collect();
        Self::connect_subset(rank, listener, &addrs, timeout)
    }

    /// Like [`connect`](Self::connect), but only to the ranks whose address is `Some` (the others are reached by
    /// another transport). Every rank must pass the same pattern of `Some`s for each pair.
    pub fn connect_subset(
        rank: usize,
        listener: &TcpListener,
        addrs: &[Option<SocketAddr>],
        timeout: Duration,
    ) -> Result<Self> {
        let size = addrs.len();
        let deadline = Instant::now() + timeout;
        let mut peers: Vec<Option<Peer>> = (0..size).map(|_| None).collect();
        for (j, addr) in addrs.iter().enumerate().take(rank) {
            let Some(addr) = addr else { continue };
            let stream = loop {
                match TcpStream::connect_timeout(addr, Duration::from_secs(2)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(peer = j, %addr, error = %e, "retrying connect");
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(Error::io(format!("connect to rank {j} at `{addr}`"), e)),
                }
            };
            let mut hello = frame(HELLO, rank as u64).to_vec();
            hello.extend_from_slice(&(size as u64).to_ne_bytes());
            (&stream)
                .write_all(&hello)
                .map_err(|e| Error::io(format!("greet rank {j} at `{addr}`"), e))?;
            peers[j] = Some(new_peer(stream, j)?);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("make the listener non-blocking", e))?;
        let expected =
            |j: usize, peers: &[Option<Peer>]| j > rank && addrs[j].is_some() && peers[j].is_none();
        while (0..size).any(|j| expected(j, &peers)) {
            match listener.accept() {
                Ok((stream, from)) => {
                    stream
                        .set_nonblocking(false)
                        .map_err(|e| Error::io("configure an accepted socket", e))?;
                    stream
                        .set_read_timeout(Some(
                            deadline
                                .saturating_duration_since(Instant::now())
                                .max(Duration::from_millis(100)),
                        ))
                        .map_err(|e| Error::io("configure an accepted socket", e))?;
                    let mut hello = [0u8; 24];
                    (&stream)
                        .read_exact(&mut hello)
                        .map_err(|e| Error::io(format!("read greeting from `{from}`"), e))?;
                    let (kind, peer_rank) = parse(&hello[..16]).unwrap_or((0, 0));
                    let peer_size = u64::from_ne_bytes(hello[16..24].try_into().unwrap_or([0; 8]));
                    let j = peer_rank as usize;
                    if kind != HELLO
                        || peer_size != size as u64
                        || j >= size
                        || !expected(j, &peers)
                    {
                        return Err(Error::Bootstrap(format!(
                            "`{from}` sent an unexpected greeting (rank {peer_rank} of {peer_size}); is another job \
                             using the same addresses?"
                        )));
                    }
                    peers[j] = Some(new_peer(stream, j)?);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> =
                            (0..size).filter(|j| expected(*j, &peers)).collect();
                        return Err(Error::Timeout {
                            op: "connect",
                            ranks: missing,
                            waited: timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(Error::io("accept a connection", e)),
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
        let p = self.peer(j)?;
        let mut eof = false;
        let mut chunk = [0u8; 64 << 10];
        loop {
            match p.stream.read(&mut chunk) {
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
        let mut at = p.pending_pos;
        while let Some(h) = p.pending.get(at..at + 16) {
            match parse(h) {
                Some((DATA, len)) => at += 16 + len as usize,
                Some((BYE, _)) => {
                    p.departed = true;
                    return Ok(());
                }
                Some((ABORT, culprit)) => return Err(lost_via(culprit as usize, j)),
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
        Ok(())
    }
}

fn lost_via(culprit: usize, reporter: usize) -> Error {
    Error::PeerLost {
        rank: culprit,
        reason: format!("rank {reporter} lost it and aborted"),
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
        departed: false,
        send_partial: false,
        send_remaining: 0,
        closed: false,
    })
}

/// Checks a data frame's header against the message this rank expects.
fn check_frame(hdr: &[u8; 16], expected: usize, j: usize, me: usize, p: &mut Peer) -> Result<()> {
    match parse(hdr) {
        Some((DATA, len)) if len as usize == expected => Ok(()),
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
        Some((ABORT, culprit)) => Err(lost_via(culprit as usize, j)),
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
                        check_frame(&op.hdr, op.buf.len(), j, me, p)?;
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
            } else {
                events |= libc::POLLRDHUP;
            }
            if send_peers.contains(&j) {
                events |= libc::POLLOUT;
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
