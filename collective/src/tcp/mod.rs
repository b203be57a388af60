//! The tcp transport: a full mesh of TCP connections, non-blocking, driven with `poll(2)` ([`TcpTransport`]: its
//! frames and the [`Transport`] it offers; the handshake that admits a connection is in `handshake`, the sockets
//! themselves in `socket`).
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

mod handshake;
mod socket;

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::reduce::reduce_into;
use crate::transport::{RecvOp, SendOp, Transport};

pub use handshake::{
    HANDSHAKE_STAGE, JobKey, MAX_CLAIMS, MAX_PENDING, MAX_PER_SOURCE, constant_time_eq,
};
pub use socket::{connect_from, interface_address, listen};

const MAGIC: u32 = 0x3144_5648; // "HVD1"
const DATA: u32 = 1;
const BYE: u32 = 2;
const ABORT: u32 = 3;
/// Fruitless rounds a waiting rank spins before it blocks in `poll(2)`.
const SPIN_ROUNDS: u32 = 32;
const SCRATCH: usize = 256 << 10;
/// A data frame up to this size (header included) is staged, not written at once: the frames staged for a peer in
/// one round of an exchange leave in one `write` (an operation's header and its eager data, one segment).
const STAGE_FRAME_MAX: usize = 4 << 10;
/// Most bytes staged for one peer before they are written.
const STAGE_MAX: usize = 64 << 10;
/// A read that wants fewer bytes than this reads up to this many into the peer's receive buffer instead, so a small
/// frame's header, its payload and the frames behind it cost one system call.
const RECV_BATCH: usize = 16 << 10;
/// Most bytes read ahead from an idle peer that hung up (to find its `BYE` or `ABORT` behind data it sent); beyond
/// that the rest waits in the socket for the operation that reads it.
const READAHEAD_MAX: usize = 64 << 20;

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

struct Peer {
    stream: TcpStream,
    /// Bytes read ahead while checking a hung-up idle peer, consumed first.
    pending: Vec<u8>,
    pending_pos: usize,
    /// Bytes of a batched read (see [`RECV_BATCH`]), consumed after `pending` and before the socket.
    inbuf: Box<[u8]>,
    in_pos: usize,
    in_end: usize,
    /// Small frames staged for this peer (see [`STAGE_FRAME_MAX`]), whole frames only; `out_pos` of them written.
    out: Vec<u8>,
    out_pos: usize,
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
        if self.in_pos == self.in_end && dst.len() < RECV_BATCH {
            let n = self.stream.read(&mut self.inbuf)?;
            (self.in_pos, self.in_end) = (0, n);
        }
        if self.in_pos < self.in_end {
            let n = dst.len().min(self.in_end - self.in_pos);
            dst[..n].copy_from_slice(&self.inbuf[self.in_pos..self.in_pos + n]);
            self.in_pos += n;
            return Ok(n);
        }
        self.stream.read(dst)
    }

    /// Whether bytes this peer sent wait in this process (read ahead or batched), not in the socket.
    fn buffered(&self) -> bool {
        self.pending_pos < self.pending.len() || self.in_pos < self.in_end
    }

    /// Writes what is staged for this peer without blocking; returns (whether anything moved, whether all is out).
    fn flush(&mut self, j: usize) -> Result<(bool, bool)> {
        let mut moved = false;
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(eof_error(j)),
                Ok(n) => {
                    self.out_pos += n;
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok((moved, false)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::PeerLost {
                        rank: j,
                        reason: format!("sending to it failed: {e}"),
                    });
                }
            }
        }
        self.out.clear();
        self.out_pos = 0;
        Ok((moved, true))
    }

    /// Writes what is staged for this peer, blocking for at most a second (before an abort or goodbye notice,
    /// which must follow whole frames); returns whether all of it went out.
    fn flush_blocking(&mut self) -> bool {
        if self.out_pos < self.out.len() {
            let _ = self.stream.set_nonblocking(false);
            let _ = self.stream.set_write_timeout(Some(Duration::from_secs(1)));
            if self.stream.write_all(&self.out[self.out_pos..]).is_err() {
                return false;
            }
        }
        self.out.clear();
        self.out_pos = 0;
        true
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

impl TcpTransport {
    /// The transport over the authenticated connections `peers` (`None` for this rank and for ranks that another
    /// transport reaches).
    fn from_peers(rank: usize, peers: Vec<Option<Peer>>) -> TcpTransport {
        TcpTransport {
            rank,
            poll_ms: 50,
            peers,
            scratch: vec![0; SCRATCH + 8],
        }
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
        // Batched bytes came after `pending` and before the socket: keep that order.
        p.pending.extend_from_slice(&p.inbuf[p.in_pos..p.in_end]);
        (p.in_pos, p.in_end) = (0, 0);
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
        inbuf: vec![0; RECV_BATCH].into_boxed_slice(),
        in_pos: 0,
        in_end: 0,
        out: Vec::new(),
        out_pos: 0,
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
        if op.pos == 0 && total <= STAGE_FRAME_MAX && p.out.len() + total <= STAGE_MAX {
            p.out.extend_from_slice(&hdr);
            p.out.extend_from_slice(op.data);
            op.pos = total;
            op.finished = true;
            return Ok(true);
        }
        // Frames staged earlier go first; a frame is staged or written whole, never both.
        let (mut moved, flushed) = p.flush(j)?;
        if !flushed {
            return Ok(moved);
        }
        if op.pos == 0 && total <= STAGE_FRAME_MAX {
            p.out.extend_from_slice(&hdr);
            p.out.extend_from_slice(op.data);
            op.pos = total;
            op.finished = true;
            return Ok(true);
        }
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

    fn flush(&mut self) -> Result<bool> {
        let mut done = true;
        for (j, p) in self.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            if p.out_pos < p.out.len() && !p.closed {
                done &= p.flush(j)?.1;
            }
        }
        Ok(done)
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
            if p.closed || (p.departed && !p.buffered()) {
                continue;
            }
            let mut events: libc::c_short = 0;
            if recv_peers.contains(&j) {
                events |= libc::POLLIN;
            } else if !p.readahead_full {
                events |= libc::POLLRDHUP;
            }
            if send_peers.contains(&j) || p.out_pos < p.out.len() {
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
            if !p.flush_blocking() {
                // A staged frame is half written: the stream cannot carry a notice any more.
                let _ = p.stream.shutdown(Shutdown::Write);
                drain(&mut p.stream);
                p.closed = true;
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
            if p.closed || p.send_partial || !p.flush_blocking() {
                continue;
            }
            let _ = p.stream.set_nonblocking(false);
            let _ = p.stream.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = p.stream.write_all(&frame(BYE, 0));
            let _ = p.stream.shutdown(Shutdown::Write);
        }
    }
}
