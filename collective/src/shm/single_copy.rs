//! The single-copy allreduce: ranks reach one another's buffers straight in each other's memory (plain loads and
//! stores between threads of one process and in shared buffers every rank maps, Linux cross-memory attach
//! `process_vm_readv` between processes), so no byte goes through the segment.
//!
//! Protocol, for one allreduce of `len` bytes on every rank (the header check came first, so `len`, dtype and op
//! agree), all steps counted on the arena progress words like the arena allreduce's:
//! 1. *posted*: each rank stores its buffer's address and length in its control line and publishes a step. From
//!    then until the last step, the buffer stays where it is and its owner leaves it alone: rank `r` alone reads
//!    and writes block `r` of every rank's buffer (the blocks: `len` split evenly by elements).
//! 2. When every peer's buffer is in this address space (*direct*: threads, or mapped shared buffers), rank `r`
//!    does all of its block in one pass, a piece at a time: it reduces piece `k` of every peer's block `r` into its
//!    own (the piece stays in L2), then stores the result into every peer's block `r`. Every byte is read once and
//!    written once per rank's buffer, the least an allreduce can move, with no wait until step 3.
//!    Otherwise (`process_vm_readv`, which can only read), segment by segment (`SEGMENT_BLOCK` bytes per rank): rank
//!    `r` reads block `r` of every peer's buffer, a piece at a time into a scratch piece that stays in cache, reduces
//!    it into its own block `r` and publishes a step; then it reads every peer `p`'s reduced block `p` of that
//!    segment into its own buffer (a peer reads that range of this rank's buffer only before the step), then goes
//!    on with the next segment.
//! 3. *done*: it publishes a step and waits for everyone's. Only then does it return, so a peer never reaches a
//!    buffer its owner has already given back, and every result stored into its buffer is there.
//!
//! Ranks in several processes post (step 1) on every allreduce, as any of them may find every rank's buffer in a
//! shared buffer (`region`): a rank that posts one waits for the others' posts and, only when all posted one,
//! maps theirs and publishes whether it could (one more step: the mapping verdict). A rank that posts none, once
//! the ranks have decided against `process_vm_readv`, already knows that the ring follows: it publishes its post
//! without waiting for anyone's, so ranks with ordinary buffers pay no wait for the single copy.
//!
//! The first time (and only then) step 1 carries each rank's vote (`HVD_SHM_CMA`) and a probe step follows it:
//! every rank reads 8 bytes of each peer's posted buffer, publishes whether that worked, and all ranks go on with
//! the single copy only when all of them could; otherwise every rank returns `false` and the caller uses the ring
//! from then on. So ranks under different users, a sandbox without `ptrace` rights (Yama scope 1-3, seccomp) or a
//! rank with `HVD_SHM_CMA=0` switch everyone to the ring together.
//!
//! A peer that dies mid-exchange: `process_vm_readv` fails with ESRCH (the process is gone) or the next wait
//! finds it dead; either way the survivors get `PeerLost`. A rank that gives up (timeout, abort) writes the abort
//! word and, before it returns (and its caller may free or reuse the buffer), waits up to its timeout for every peer
//! that reaches its buffer with plain loads and stores (threads of this process; peers in other processes when the
//! buffer is a shared buffer it posted) to pass the last step, abort, leave or die (`quiesce`); a peer in the one
//! pass looks at the abort word before each piece, so it stops within one piece. A peer slower than that timeout
//! could still reach the buffer afterwards: a known weakness. Through `process_vm_readv` a read of a buffer given
//! back fails (EFAULT) or copies garbage into the reader's own buffer, and the reader's next wait sees the abort, so
//! the garbage is never returned as a result.
//!
//! Peers store into the parts of this rank's buffer that are theirs while this rank's caller holds it as
//! `&mut [u8]`: this rank touches none of those bytes until the last step's Acquire wait, after every store.

use std::io;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{ShmTransport, region};
use crate::board::Combine;
use crate::env_vars;
use crate::error::{Error, Result};
use crate::reduce::reduce_into;
use crate::transport::even_counts;
use crate::types::{DType, ReduceOp};

/// The smallest allreduce of 2 ranks that goes through the single copy when every peer's buffer is in this address
/// space (below, the board's direct allreduce and recursive doubling win: docs/collective.md, "One pass").
pub(crate) const SINGLE_COPY_MIN_BYTES: usize = 32 << 10;

/// The same for 3 or more ranks on the segment, where the single copy comes before the arenas (after recursive
/// doubling with `HVD_ALLREDUCE_ARENA_RANKS=0`) (4 ranks on 2 cores: 8 KiB in 5.7 against 8.9 µs, 16 KiB 6.3
/// against 10.5; docs/collective.md, "One pass from 4 KiB").
pub(crate) const SINGLE_COPY_MIN_BYTES_MANY: usize = 4 << 10;

/// The smallest allreduce that reads peers with `process_vm_readv` (below, the ring's pipelining wins).
const CMA_MIN_BYTES: usize = 1 << 20;

/// The bytes of a peer's block read and reduced at a time in step 2 (stays in L2 between read and reduce).
const PIECE: usize = 256 << 10;

/// Rounds a rank with more ranks than cores yields at the end of the one pass before it sleeps.
const ONE_PASS_YIELDS: u32 = 64;

/// Each rank's block of one segment (a segment's blocks stay in the L3 between reduce-scatter and allgather).
const SEGMENT_BLOCK: usize = 1 << 20;

/// Votes in the segment's `copy_vote` and `copy_probe` words.
const VOTE_WILLING: u32 = 1;
const VOTE_UNWILLING: u32 = 2;
const VOTE_PROBE_OK: u32 = 3;
const VOTE_PROBE_FAILED: u32 = 4;

/// Whether this transport reads its peers' memory (decided together by all ranks on the first large allreduce).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SingleCopy {
    Undecided,
    On,
    Off,
}

/// `HVD_SHM_CMA`: `0` never, `1` also between processes (`process_vm_readv`), else (`auto`) only when every rank
/// is a thread of this process (then reads are plain loads: `process_vm_readv` copied at about half of memcpy's
/// bandwidth on the 2-core VM it was measured on, which made the single copy slower than the ring there).
fn willing(same_process: bool) -> bool {
    match std::env::var(env_vars::HVD_SHM_CMA)
        .as_deref()
        .map(str::trim)
    {
        Ok("0") => false,
        Ok("1") => true,
        Ok("auto" | "") | Err(_) => same_process,
        Ok(other) => {
            // As the thresholds do: a typo may not stop a job, but it may not pass unnoticed either.
            tracing::warn!(
                variable = env_vars::HVD_SHM_CMA,
                value = other,
                "ignoring a value that is not 0, 1 or auto (auto is used)"
            );
            same_process
        }
    }
}

/// A peer as the single copy reaches it: its local index, its pid (`process_vm_readv`), and where its buffer is:
/// `direct` when this rank reads and writes it with plain loads and stores at `addr` (a thread of this process, or a
/// shared buffer this rank mapped, then `addr` is in that mapping), else `addr` is in the peer's address space.
#[derive(Clone, Copy)]
struct Peer {
    p: usize,
    pid: u32,
    addr: u64,
    direct: bool,
}

impl ShmTransport {
    /// Allreduces `buf` (the same length, dtype and op on every rank of the segment) by the single copy; `false`
    /// (on every rank alike) when the ranks cannot or will not read one another's memory, and nothing was done.
    pub(super) fn single_copy_allreduce(&mut self, buf: &mut [u8], how: Combine) -> Result<bool> {
        let timeout = how.timeout;
        // Threads of one process that said no never read each other; ranks in several processes still post, as
        // every allreduce may find all buffers in shared buffers (`region`).
        if self.single_copy == SingleCopy::Off && self.seg.private {
            return Ok(false);
        }
        let n = self.seg.ranks;
        let me = self.rank;
        let len = buf.len();
        self.seg
            .copy_addr(me)
            .store(buf.as_ptr() as u64, Ordering::Relaxed);
        self.seg.copy_len(me).store(len as u64, Ordering::Relaxed);
        let (token, offset) = match self.seg.private {
            true => (0, 0),
            false => region::lookup(buf.as_ptr(), len).unwrap_or((0, 0)),
        };
        self.seg.copy_token(me).store(token, Ordering::Relaxed);
        self.seg.copy_offset(me).store(offset, Ordering::Relaxed);
        let deciding = self.single_copy == SingleCopy::Undecided;
        if deciding {
            let same_process =
                (0..n).all(|p| self.in_process(self.seg.pid(p).load(Ordering::Relaxed)));
            let vote = if willing(same_process) {
                VOTE_WILLING
            } else {
                VOTE_UNWILLING
            };
            self.seg.copy_vote(me).store(vote, Ordering::Relaxed);
        }
        // A rank whose buffer is not in a shared buffer, once the ranks have decided against reading one another's
        // memory otherwise, already knows the outcome (not every rank posts a shared buffer: all take the ring). It
        // publishes its post for the ranks that wait to learn that, and goes on without waiting for theirs. Its words
        // stay until its next post, which comes after the ring: every peer joins the ring only after reading them,
        // and this rank's ring cannot finish before every peer has joined.
        if token == 0 && !deciding && self.single_copy == SingleCopy::Off {
            self.arena_steps += 1;
            self.publish(self.seg.arena_progress(me), self.arena_steps);
            return Ok(false);
        }
        // 1. posted (the release store publishes the words above). A peer may read this buffer once it has seen
        // everyone's post, so from here on a failure waits for in-process readers (`quiesce`).
        if let Err(e) = self.step(timeout) {
            let peers: Vec<Peer> = (0..n)
                .filter(|p| *p != me)
                .map(|p| Peer {
                    p,
                    pid: self.seg.pid(p).load(Ordering::Relaxed),
                    addr: 0,
                    direct: false,
                })
                .collect();
            self.quiesce(&e, &peers, u64::MAX, timeout);
            return Err(e);
        }
        let mut peers: Vec<Peer> = (0..n)
            .filter(|p| *p != me)
            .map(|p| {
                let pid = self.seg.pid(p).load(Ordering::Relaxed);
                Peer {
                    p,
                    pid,
                    addr: self.seg.copy_addr(p).load(Ordering::Relaxed),
                    direct: self.in_process(pid),
                }
            })
            .collect();
        for peer in &peers {
            let theirs = self.seg.copy_len(peer.p).load(Ordering::Relaxed);
            if theirs != len as u64 {
                let e = Error::Broken(format!(
                    "rank {} posted a {theirs}-byte single-copy allreduce, this rank {len} bytes",
                    self.global[peer.p]
                ));
                self.quiesce(&e, &peers, u64::MAX, timeout);
                return Err(e);
            }
        }
        // Every rank's buffer in a shared buffer (ranks in several processes): map the peers' and read them with
        // plain loads, when every rank could map every peer's.
        let all_shared = !self.seg.private
            && (0..n).all(|p| self.seg.copy_token(p).load(Ordering::Relaxed) != 0);
        if all_shared {
            match self.map_peers(&mut peers, len, timeout) {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(e) => {
                    self.quiesce(&e, &peers, u64::MAX, timeout);
                    return Err(e);
                }
            }
            self.run_single_copy(buf, &peers, how)?;
            return Ok(true);
        }
        let decided = match (deciding, self.single_copy) {
            (true, _) => self.decide(&peers, timeout),
            (false, SingleCopy::On) => Ok(true),
            (false, _) => Ok(false),
        };
        if let Err(e) = &decided {
            self.quiesce(e, &peers, u64::MAX, timeout);
        }
        if !decided? {
            return Ok(false);
        }
        // Reading peers through the kernel pays below 1 MiB (the same on every rank: no peer of a rank in several
        // processes is direct here, every peer of a thread is).
        if len < CMA_MIN_BYTES && !peers.iter().all(|peer| peer.direct) {
            return Ok(false);
        }
        self.run_single_copy(buf, &peers, how)?;
        Ok(true)
    }

    /// Maps every peer's posted shared buffer (cached across allreduces), publishes whether all worked, and
    /// returns whether every rank could (the same on every rank). The first failure is logged once with its
    /// reason; that allreduce and any other that fails to map take the ring.
    fn map_peers(&mut self, peers: &mut [Peer], len: usize, timeout: Duration) -> Result<bool> {
        let me = self.rank;
        let mut failure = None;
        for peer in peers.iter_mut() {
            let token = self.seg.copy_token(peer.p).load(Ordering::Relaxed);
            let offset = self.seg.copy_offset(peer.p).load(Ordering::Relaxed);
            let Some(need) = offset.checked_add(len as u64) else {
                failure = Some((peer.p, io::Error::other("offset past the address space")));
                break;
            };
            match self.peer_region(peer.p, token, need) {
                Ok(base) => {
                    peer.addr = base + offset;
                    peer.direct = true;
                }
                Err(e) => {
                    failure = Some((peer.p, e));
                    break;
                }
            }
        }
        let mine = match failure {
            None => VOTE_PROBE_OK,
            Some(_) => VOTE_PROBE_FAILED,
        };
        self.seg.copy_mapped(me).store(mine, Ordering::Relaxed);
        self.step(timeout)?;
        let all = (0..self.seg.ranks)
            .all(|p| self.seg.copy_mapped(p).load(Ordering::Relaxed) == VOTE_PROBE_OK);
        if let Some((p, e)) = failure
            && !self.map_failure_logged
        {
            self.map_failure_logged = true;
            tracing::warn!(
                peer = self.global[p],
                error = %e,
                "shm: could not map a peer's shared buffer; large allreduces in shared buffers use the ring"
            );
        }
        if all && !self.shared_logged {
            self.shared_logged = true;
            tracing::debug!("shm: large allreduces read peers' shared buffers");
        }
        Ok(all)
    }

    /// The address of peer `p`'s shared buffer `token` in this rank's mapping of it, mapping it on first use and
    /// dropping mappings of that peer's buffers that their owner has freed.
    fn peer_region(&mut self, p: usize, token: u64, need: u64) -> io::Result<u64> {
        let cached = &mut self.peer_regions[p];
        if let Some(r) = cached.iter().find(|r| r.token == token) {
            if r.len as u64 >= need {
                return Ok(r.ptr as u64);
            }
            return Err(io::Error::other(format!(
                "the peer posted {need} bytes of a {}-byte shared buffer",
                r.len
            )));
        }
        cached.retain(|r| r.owner_alive());
        let pid = self.seg.pid(p).load(Ordering::Relaxed);
        let r = region::PeerRegion::open(pid, token, need)?;
        let at = r.ptr as u64;
        cached.push(r);
        Ok(at)
    }

    /// Steps 2 and 3: in one pass when every peer is direct, else segment by segment; on failure, waits for
    /// in-process peers (`quiesce`).
    fn run_single_copy(&mut self, buf: &mut [u8], peers: &[Peer], how: Combine) -> Result<()> {
        if peers.iter().all(|peer| peer.direct) {
            return self.one_pass(buf, peers, how);
        }
        let Combine { dtype, op, timeout } = how;
        let n = self.seg.ranks;
        let len = buf.len();
        // Segment by segment: the allgather of segment k reads blocks the peers reduced moments ago (still in the
        // shared L3), and runs right before the reduce-scatter of segment k + 1, with one wait in between.
        let esize = dtype.size();
        let seg_bytes = (SEGMENT_BLOCK / esize).max(1) * esize * n;
        let last_step = self.arena_steps + len.div_ceil(seg_bytes) as u64 + 1;
        let mut piece = std::mem::take(&mut self.copy_piece);
        let result = (|| {
            let mut prev: Option<Vec<usize>> = None;
            let mut start = 0;
            while start < len {
                let seg_len = seg_bytes.min(len - start);
                let counts = even_counts(seg_len / esize, n);
                let mut offsets = Vec::with_capacity(n + 1);
                offsets.push(start);
                for c in &counts {
                    offsets.push(offsets.last().copied().unwrap_or(start) + c * esize);
                }
                if let Some(o) = prev.take() {
                    self.gather(buf, peers, &o)?;
                }
                self.scatter_reduce(buf, peers, &offsets, dtype, op, &mut piece)?;
                self.step(timeout)?;
                prev = Some(offsets);
                start += seg_len;
            }
            if let Some(o) = prev {
                self.gather(buf, peers, &o)?;
            }
            Ok(())
        })();
        self.copy_piece = piece;
        // Done: nobody reads this rank's buffer any more once everyone has published this.
        let result = result.and_then(|()| self.step(timeout));
        if let Err(e) = &result {
            self.quiesce(e, peers, last_step, timeout);
        }
        result
    }

    /// Steps 2 and 3 when every peer's buffer is in this address space: this rank's block of every buffer, a piece
    /// at a time, reduced into its own and stored into the peers', then *done*.
    fn one_pass(&mut self, buf: &mut [u8], peers: &[Peer], how: Combine) -> Result<()> {
        let Combine { dtype, op, timeout } = how;
        let esize = dtype.size();
        let counts = even_counts(buf.len() / esize, self.seg.ranks);
        let start = counts[..self.rank].iter().sum::<usize>() * esize;
        let end = start + counts[self.rank] * esize;
        let per_piece = (PIECE / esize).max(1) * esize;
        let last_step = self.arena_steps + 1;
        let mut at = start;
        let mut result = Ok(());
        while at < end {
            // A peer that gave up may return and reuse its buffer: stop storing into it (`quiesce` waits for this).
            if let Err(e) = self.check_abort() {
                result = Err(e);
                break;
            }
            let piece = at..end.min(at + per_piece);
            for peer in peers {
                // SAFETY: the peer is a thread of this process, or `addr` is in this rank's mapping of its shared
                // buffer (at least `len` bytes past `addr`: `map_peers`); it posted the buffer (Acquire in the step
                // wait) and leaves it alone until everyone's *done*, and only this rank reaches block `self.rank` of
                // it; `buf` is this rank's own memory, disjoint from it.
                let theirs = unsafe {
                    std::slice::from_raw_parts(
                        peer.addr.wrapping_add(piece.start as u64) as usize as *const u8,
                        piece.len(),
                    )
                };
                reduce_into(&mut buf[piece.clone()], theirs, dtype, op);
            }
            for peer in peers {
                // SAFETY: as above, and the range was read just above, by this rank alone: nobody else reads or
                // writes it before everyone's *done* (a mapped shared buffer is mapped writable).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf[piece.clone()].as_ptr(),
                        peer.addr.wrapping_add(piece.start as u64) as usize as *mut u8,
                        piece.len(),
                    )
                };
            }
            at = piece.end;
        }
        // With more ranks than cores the ranks awaited are still at work (one may be this core's other rank, which a
        // yield runs), and a sleeper costs a wake-up of an idle CPU: yield rounds instead of the 2 µs window (4 ranks
        // on 2 cores, 1 MiB: 78 against 196 µs; docs/collective.md, "One pass").
        let window = (self.yields, self.yield_for);
        if self.oversubscribed && !self.yield_for.is_zero() {
            (self.yields, self.yield_for) = (ONE_PASS_YIELDS, Duration::ZERO);
        }
        if result.is_ok() {
            result = self.step(timeout);
        }
        (self.yields, self.yield_for) = window;
        if let Err(e) = &result {
            self.quiesce(e, peers, last_step, timeout);
        }
        result
    }

    /// Step 2 for one segment (`offsets`: its blocks' bounds in `buf`): block `me` of every peer's buffer, reduced
    /// into this rank's own, a piece at a time (threads of this process: straight out of the peer's memory).
    fn scatter_reduce(
        &mut self,
        buf: &mut [u8],
        peers: &[Peer],
        offsets: &[usize],
        dtype: DType,
        op: ReduceOp,
        piece: &mut Vec<u8>,
    ) -> Result<()> {
        let per_piece = (PIECE / dtype.size()).max(1) * dtype.size();
        let (mut at, end) = (offsets[self.rank], offsets[self.rank + 1]);
        while at < end {
            let plen = per_piece.min(end - at);
            for &Peer {
                p,
                pid,
                addr,
                direct,
            } in peers
            {
                let theirs = addr.wrapping_add(at as u64);
                if direct {
                    // SAFETY: as in `read_peer`: a thread of this process (or a process whose shared buffer this
                    // rank mapped at `addr`) published this range of its buffer and leaves it alone until this rank
                    // publishes the next step; it is not this rank's memory.
                    let theirs =
                        unsafe { std::slice::from_raw_parts(theirs as usize as *const u8, plen) };
                    reduce_into(&mut buf[at..at + plen], theirs, dtype, op);
                } else {
                    piece.resize(per_piece, 0);
                    let from = Peer {
                        p,
                        pid,
                        addr: theirs,
                        direct,
                    };
                    self.read_peer(from, &mut piece[..plen])?;
                    reduce_into(&mut buf[at..at + plen], &piece[..plen], dtype, op);
                }
            }
            at += plen;
        }
        Ok(())
    }

    /// Step 3 for one segment: every peer `p`'s reduced block `p` straight into this rank's buffer.
    fn gather(&mut self, buf: &mut [u8], peers: &[Peer], offsets: &[usize]) -> Result<()> {
        for &peer in peers {
            let block = offsets[peer.p]..offsets[peer.p + 1];
            let at = Peer {
                addr: peer.addr.wrapping_add(block.start as u64),
                ..peer
            };
            self.read_peer(at, &mut buf[block])?;
        }
        Ok(())
    }

    /// After a failed exchange, before the caller may free or reuse the buffer: tells the peers (the abort word) and
    /// waits, at most `timeout`, until every peer that may reach this buffer with plain loads and stores has passed
    /// the last step, aborted, left or died: threads of this process, and, when the buffer lies in a shared buffer
    /// this rank posted, the peers in other processes (they may have mapped it; the rank named lost counts as
    /// settled: it is dead, aborted, or frozen and being stopped). Peers that read through the kernel
    /// (`process_vm_readv`) fail cleanly on freed memory and only read.
    fn quiesce(&mut self, e: &Error, peers: &[Peer], last_step: u64, timeout: Duration) {
        let shared = self.seg.copy_token(self.rank).load(Ordering::Relaxed) != 0;
        let reaches = |t: &Self, peer: &Peer| shared || t.in_process(peer.pid);
        if !peers.iter().any(|peer| reaches(self, peer)) {
            return;
        }
        let lost = match e {
            Error::PeerLost { rank, .. } => Some(*rank),
            _ => None,
        };
        let culprit = match e {
            Error::PeerLost { rank, .. } => *rank,
            Error::Timeout { ranks, .. } => {
                ranks.first().copied().unwrap_or(self.global[self.rank])
            }
            _ => self.global[self.rank],
        };
        crate::transport::Transport::abort(self, culprit, &e.to_string());
        let deadline = crate::time::saturating_add(std::time::Instant::now(), timeout);
        let settled = |t: &Self, peer: &Peer| {
            let p = peer.p;
            t.seg.arena_progress(p).load(Ordering::Acquire) >= last_step
                || matches!(
                    t.seg.state(p).load(Ordering::Acquire),
                    super::STATE_ABORTED | super::STATE_GONE
                )
                || (!t.in_process(peer.pid)
                    && (lost == Some(t.global[p]) || t.check_peer(p, false).is_err()))
        };
        while std::time::Instant::now() < deadline
            && !peers
                .iter()
                .all(|peer| !reaches(self, peer) || settled(self, peer))
        {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Publishes the next arena step and waits for every rank to publish it too.
    fn step(&mut self, timeout: Duration) -> Result<()> {
        self.arena_steps += 1;
        let s = self.arena_steps;
        self.publish(self.seg.arena_progress(self.rank), s);
        self.wait_ranks("allreduce", timeout, |t, r| {
            t.seg.arena_progress(r).load(Ordering::Acquire) >= s
        })
    }

    /// The first single-copy allreduce: every rank probes its peers (when all voted for it) and publishes the
    /// outcome; all ranks then decide alike, and log it once.
    fn decide(&mut self, peers: &[Peer], timeout: Duration) -> Result<bool> {
        let me = self.rank;
        let all_willing = peers
            .iter()
            .all(|peer| self.seg.copy_vote(peer.p).load(Ordering::Relaxed) == VOTE_WILLING)
            && self.seg.copy_vote(me).load(Ordering::Relaxed) == VOTE_WILLING;
        let mut failure = None;
        if all_willing {
            for &Peer { p, pid, addr, .. } in peers {
                let mut probe = [0u8; 8];
                let want = probe
                    .len()
                    .min(self.seg.copy_len(p).load(Ordering::Relaxed) as usize);
                if let Err(e) = cma_read(pid, addr, &mut probe[..want]) {
                    failure = Some((self.global[p], e));
                    break;
                }
            }
        }
        let outcome = match (all_willing, &failure) {
            (true, None) => VOTE_PROBE_OK,
            _ => VOTE_PROBE_FAILED,
        };
        self.seg.copy_probe(me).store(outcome, Ordering::Relaxed);
        self.step(timeout)?;
        let on = peers
            .iter()
            .all(|peer| self.seg.copy_probe(peer.p).load(Ordering::Relaxed) == VOTE_PROBE_OK)
            && outcome == VOTE_PROBE_OK;
        self.single_copy = if on { SingleCopy::On } else { SingleCopy::Off };
        match (on, failure) {
            (true, _) => {
                tracing::debug!("shm: large allreduces read peers' memory (process_vm_readv)")
            }
            (false, Some((rank, e))) => tracing::debug!(
                peer = rank,
                error = %e,
                "shm: process_vm_readv of a peer failed; large allreduces use the ring"
            ),
            (false, None) => tracing::debug!(
                "shm: not every rank reads its peers (HVD_SHM_CMA=0, or ranks in several processes without \
                 HVD_SHM_CMA=1, or a peer could not be read); large allreduces use the ring"
            ),
        }
        Ok(on)
    }

    /// Whether a peer that posted `pid` is a thread of this process, whose posted addresses this rank may
    /// dereference: only on a memfd segment, which no other process maps (on a named one a pid proves nothing:
    /// ranks in another pid namespace sharing `/dev/shm` may post the same number).
    fn in_process(&self, pid: u32) -> bool {
        self.seg.private && pid == self.my_pid
    }

    /// Reads `dst.len()` bytes at `addr` in peer `p`'s process `pid`; a peer that is gone is `PeerLost`.
    fn read_peer(&mut self, peer: Peer, dst: &mut [u8]) -> Result<()> {
        let Peer {
            p,
            pid,
            addr,
            direct,
        } = peer;
        if direct {
            // SAFETY: the peer is a thread of this process, so `addr` is in this address space, or `addr` is in this
            // rank's mapping of the peer's shared buffer (kept in `peer_regions`); it published the buffer (Acquire in the step wait) and keeps it alive and unwritten in this range until this rank
            // publishes the next step (the protocol above); `dst` is this rank's own memory, disjoint from it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    addr as usize as *const u8,
                    dst.as_mut_ptr(),
                    dst.len(),
                )
            };
            return Ok(());
        }
        match cma_read(pid, addr, dst) {
            Ok(()) => Ok(()),
            Err(e) => {
                // An abort or a dead peer explains the failure better than the errno.
                self.check_abort()?;
                self.check_peer(p, true)?;
                if e.raw_os_error() == Some(libc::ESRCH) {
                    return Err(Error::PeerLost {
                        rank: self.global[p],
                        reason: format!("its process {pid} no longer exists"),
                    });
                }
                Err(Error::io(
                    format!(
                        "read rank {}'s buffer (process {pid}) with process_vm_readv",
                        self.global[p]
                    ),
                    e,
                ))
            }
        }
    }
}

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst` (several calls if the kernel copies less).
fn cma_read(pid: u32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        let local = libc::iovec {
            // SAFETY: `done < dst.len()`, so the pointer stays inside `dst`.
            iov_base: unsafe { dst.as_mut_ptr().add(done) }.cast(),
            iov_len: dst.len() - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: the local iovec covers the rest of `dst`, which this function borrows mutably; the kernel checks
        // the remote range against the peer's mappings (EFAULT when it is not mapped) and never writes it.
        let r = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        match r {
            r if r > 0 => done += r as usize,
            0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}
