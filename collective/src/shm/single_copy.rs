//! The single-copy allreduce: ranks read one another's buffers straight out of each other's address space with
//! Linux cross-memory attach (`process_vm_readv`), so each byte crosses once instead of twice through the segment.
//!
//! Protocol, for one allreduce of `len` bytes on every rank (the header check came first, so `len`, dtype and op
//! agree), all steps counted on the arena progress words like the arena allreduce's:
//! 1. *posted*: each rank stores its buffer's address and length in its control line and publishes a step. From
//!    then until 3. completes, the buffer stays where it is and only its owner writes it, and only its own block.
//! 2. *reduced*: rank `r` reads block `r` of every peer's buffer (a piece at a time, into a scratch piece that
//!    stays in cache) and reduces it into its own block `r`; then publishes a step. Peers read only their own
//!    blocks of this rank's buffer, which this rank leaves alone until everyone has published 2.
//! 3. *done*: once every rank has published 2, rank `r` reads every peer `p`'s reduced block `p` into its own
//!    buffer, then publishes a step and waits for everyone's. Only then does it return, so a peer never reads a
//!    buffer its owner has already given back.
//!
//! The first time (and only then) step 1 carries each rank's vote (`HVD_SHM_CMA`, and whether it reads its peers
//! at all) and a probe step follows it: every rank reads 8 bytes of each peer's posted buffer, publishes whether
//! that worked, and all ranks go on with the single copy only when all of them could; otherwise every rank
//! returns `false` and the caller uses the ring from then on. So ranks under different users, a sandbox without
//! `ptrace` rights (Yama scope 2-3, seccomp) or a rank with `HVD_SHM_CMA=0` switch everyone to the ring together.
//!
//! A peer that dies mid-exchange: `process_vm_readv` fails with ESRCH (the process is gone) or the next wait
//! finds it dead; either way the survivors get `PeerLost`. A peer that gives up (timeout, abort) may free its
//! buffer while a rank still reads it: the read fails (EFAULT) or copies garbage into the reader's own buffer, and
//! the reader's next wait sees the abort, so the garbage is never returned as a result.

use std::io;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::ShmTransport;
use crate::config::env_usize;
use crate::env_vars;
use crate::error::{Error, Result};
use crate::reduce::reduce_into;
use crate::transport::even_counts;
use crate::types::{DType, ReduceOp};

/// The smallest allreduce that goes through the single copy (below, the ring's pipelining wins).
pub(crate) const SINGLE_COPY_MIN_BYTES: usize = 1 << 20;

/// The bytes of a peer's block read and reduced at a time in step 2 (stays in L2 between read and reduce).
const PIECE: usize = 256 << 10;

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

/// `HVD_SHM_CMA`: unset or non-zero lets this rank vote for the single copy; `0` votes against it.
fn enabled_by_env() -> bool {
    env_usize(env_vars::HVD_SHM_CMA) != Some(0)
}

impl ShmTransport {
    /// Allreduces `buf` (the same length, dtype and op on every rank of the segment) by the single copy; `false`
    /// (on every rank alike) when the ranks cannot or will not read one another's memory, and nothing was done.
    pub(super) fn single_copy_allreduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool> {
        if self.single_copy == SingleCopy::Off {
            return Ok(false);
        }
        let n = self.seg.ranks;
        let me = self.rank;
        let len = buf.len();
        self.seg
            .copy_addr(me)
            .store(buf.as_ptr() as u64, Ordering::Relaxed);
        self.seg.copy_len(me).store(len as u64, Ordering::Relaxed);
        let deciding = self.single_copy == SingleCopy::Undecided;
        if deciding {
            let vote = if enabled_by_env() {
                VOTE_WILLING
            } else {
                VOTE_UNWILLING
            };
            self.seg.copy_vote(me).store(vote, Ordering::Relaxed);
        }
        // 1. posted (the release store publishes the words above).
        self.step(timeout)?;
        let peers: Vec<(usize, u32, u64)> = (0..n)
            .filter(|p| *p != me)
            .map(|p| {
                (
                    p,
                    self.seg.pid(p).load(Ordering::Relaxed),
                    self.seg.copy_addr(p).load(Ordering::Relaxed),
                )
            })
            .collect();
        for &(p, _, _) in &peers {
            let theirs = self.seg.copy_len(p).load(Ordering::Relaxed);
            if theirs != len as u64 {
                return Err(Error::Broken(format!(
                    "rank {} posted a {theirs}-byte single-copy allreduce, this rank {len} bytes",
                    self.global[p]
                )));
            }
        }
        if deciding && !self.decide(&peers, timeout)? {
            return Ok(false);
        }
        let esize = dtype.size();
        let counts = even_counts(len / esize, n);
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        for c in &counts {
            offsets.push(offsets.last().copied().unwrap_or(0) + c * esize);
        }
        // 2. reduce-scatter: this rank's block from every peer, a piece at a time.
        let mut piece = std::mem::take(&mut self.copy_piece);
        let per_piece = (PIECE / esize).max(1) * esize;
        piece.resize(per_piece, 0);
        let mine = offsets[me]..offsets[me + 1];
        let mut at = mine.start;
        let result = (|| {
            while at < mine.end {
                let plen = per_piece.min(mine.end - at);
                for &(p, pid, addr) in &peers {
                    self.read_peer(p, pid, addr + at as u64, &mut piece[..plen])?;
                    reduce_into(&mut buf[at..at + plen], &piece[..plen], dtype, op);
                }
                at += plen;
            }
            Ok(())
        })();
        self.copy_piece = piece;
        result?;
        self.step(timeout)?;
        // 3. allgather: every peer's reduced block straight into this rank's buffer.
        for &(p, pid, addr) in &peers {
            let block = offsets[p]..offsets[p + 1];
            self.read_peer(p, pid, addr + block.start as u64, &mut buf[block])?;
        }
        self.step(timeout)?;
        Ok(true)
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
    fn decide(&mut self, peers: &[(usize, u32, u64)], timeout: Duration) -> Result<bool> {
        let me = self.rank;
        let all_willing = peers
            .iter()
            .all(|(p, _, _)| self.seg.copy_vote(*p).load(Ordering::Relaxed) == VOTE_WILLING)
            && self.seg.copy_vote(me).load(Ordering::Relaxed) == VOTE_WILLING;
        let mut failure = None;
        if all_willing {
            for &(p, pid, addr) in peers {
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
            .all(|(p, _, _)| self.seg.copy_probe(*p).load(Ordering::Relaxed) == VOTE_PROBE_OK)
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
                "shm: a rank set HVD_SHM_CMA=0 or could not read a peer; large allreduces use the ring"
            ),
        }
        Ok(on)
    }

    /// Reads `dst.len()` bytes at `addr` in peer `p`'s process `pid`; a peer that is gone is `PeerLost`.
    fn read_peer(&mut self, p: usize, pid: u32, addr: u64, dst: &mut [u8]) -> Result<()> {
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
            iov_base: (addr as usize + done) as *mut libc::c_void,
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
