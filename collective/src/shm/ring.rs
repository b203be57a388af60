//! The rings between pairs of ranks: their capacity, and moving one message's bytes through one (copied or
//! reduced straight out of the ring) plus the wait for ring activity.
//!
//! A ring has a `head` (bytes ever written, owned by the sender) and a `tail` (bytes ever read, owned by the
//! receiver) on their own cache lines, then `capacity` data bytes. Messages start 8-byte aligned in the ring
//! (lengths are padded), so an element never straddles the wrap and the receiver can reduce straight out of the
//! ring while the sender keeps writing: no kernel call on the hot path.
//!
//! The sender keeps its own `head` and the last `tail` it saw, so a small message touches only the data line(s)
//! and the `head` line; the receiver's `tail` line is read again only when the ring looks full.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::ShmTransport;
use super::segment::futex_wait;
use crate::config::env_usize;
use crate::env_vars;
use crate::error::Result;
use crate::reduce::reduce_into;
use crate::transport::{RecvOp, SendOp};

/// Default ring capacity per ordered pair of ranks.
pub const DEFAULT_RING_BYTES: usize = 512 << 10;

/// The most a ring may hold (`HVD_SHM_RING_BYTES` beyond it is taken as this, with a warning).
pub const MAX_RING_BYTES: usize = 1 << 30;

/// Ring capacity from `HVD_SHM_RING_BYTES` (rounded to 4 KiB, 4 KiB to 1 GiB), else the default.
pub fn ring_bytes_from_env() -> usize {
    ring_bytes(env_usize(env_vars::HVD_SHM_RING_BYTES).unwrap_or(DEFAULT_RING_BYTES))
}

/// `v` rounded up to 4 KiB within 4 KiB..=`MAX_RING_BYTES` (a larger value would make the segment, a ring per
/// ordered pair of ranks, larger than memory, or its size wrap).
fn ring_bytes(v: usize) -> usize {
    if v > MAX_RING_BYTES {
        tracing::warn!(
            variable = env_vars::HVD_SHM_RING_BYTES,
            value = v,
            "a ring holds at most {MAX_RING_BYTES} bytes; using that"
        );
    }
    v.clamp(4096, MAX_RING_BYTES).div_ceil(4096) * 4096
}

/// A sender's private view of one outgoing ring, on its own cache line: ranks that are threads of one process
/// write these on every message, and sharing a line with another rank's state would bounce it between cores.
#[repr(align(128))]
#[derive(Clone, Copy)]
pub(super) struct Cursor {
    /// `head` of the ring: only this rank writes it.
    pub(super) head: u64,
    /// Last `tail` seen: the sender re-reads the peer's line only when this stale value says the ring is too
    /// full, so a small message costs no extra line transfer.
    pub(super) tail_seen: u64,
}

fn padded(len: usize) -> usize {
    len.div_ceil(8) * 8
}

impl ShmTransport {
    /// Moves `op` into the ring to its peer as far as the ring has room ([`Transport::progress_send`](crate::transport::Transport::progress_send)).
    #[inline]
    pub(super) fn ring_send(&mut self, op: &mut SendOp<'_>) -> Result<bool> {
        let to = self.local(op.peer)?;
        let me = self.rank;
        let cap = self.seg.ring_bytes as u64;
        let head = self.cursors[to].head;
        let total = padded(op.data.len());
        let mut free = (cap - (head - self.cursors[to].tail_seen)) as usize;
        if free < total - op.pos {
            let tail = self.seg.tail(me, to).load(Ordering::Acquire);
            self.cursors[to].tail_seen = tail;
            free = (cap - (head - tail)) as usize;
        }
        let k = free.min(total - op.pos);
        if k == 0 {
            return Ok(false);
        }
        let data_k = k.min(op.data.len().saturating_sub(op.pos));
        let at = (head % cap) as usize;
        let first = data_k.min(cap as usize - at);
        let ring = self.seg.ring_data(me, to);
        // SAFETY: [at, at+first) and [0, data_k-first) lie in the ring's free region, which only this rank writes
        // until `head` is published below; the source is the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(op.data.as_ptr().add(op.pos), ring.add(at), first);
            std::ptr::copy_nonoverlapping(
                op.data.as_ptr().add(op.pos + first),
                ring,
                data_k - first,
            );
        }
        op.pos += k;
        op.finished = op.pos == total;
        self.cursors[to].head = head + k as u64;
        let head_a = self.seg.head(me, to);
        if self.oversubscribed {
            head_a.store(head + k as u64, Ordering::SeqCst);
            self.seg.wake(to);
        } else {
            head_a.store(head + k as u64, Ordering::Release);
            self.seg.wake_relaxed(to);
        }
        Ok(true)
    }

    /// Copies or reduces what the ring from `op`'s peer holds into `op` ([`Transport::progress_recv`](crate::transport::Transport::progress_recv)).
    #[inline]
    pub(super) fn ring_recv(&mut self, op: &mut RecvOp<'_>) -> Result<bool> {
        let from = self.local(op.peer)?;
        let me = self.rank;
        let cap = self.seg.ring_bytes as u64;
        let tail_a = self.seg.tail(from, me);
        let tail = tail_a.load(Ordering::Relaxed);
        let head = self.seg.head(from, me).load(Ordering::Acquire);
        let avail = (head - tail) as usize;
        let len = op.buf.len();
        let total = padded(len);
        let mut k = avail.min(total - op.pos);
        let mut data_k = k.min(len.saturating_sub(op.pos));
        if let Some((dtype, _)) = op.reduce
            && data_k < len - op.pos.min(len)
        {
            // Reduce whole elements only; the rest arrives with the next write.
            data_k -= data_k % dtype.size();
            k = data_k;
        }
        if k == 0 {
            return Ok(false);
        }
        let at = (tail % cap) as usize;
        let first = data_k.min(cap as usize - at);
        let ring = self.seg.ring_data(from, me);
        // SAFETY: [tail, tail+k) was published by the sender (Acquire on head) and is not written again until
        // `tail` moves past it below.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(ring.add(at), first),
                std::slice::from_raw_parts(ring, data_k - first),
            )
        };
        let dst = &mut op.buf[op.pos.min(len)..];
        match op.reduce {
            None => {
                dst[..first].copy_from_slice(a);
                dst[first..data_k].copy_from_slice(b);
            }
            Some((dtype, rop)) => {
                reduce_into(&mut dst[..first], a, dtype, rop);
                reduce_into(&mut dst[first..data_k], b, dtype, rop);
            }
        }
        op.pos += k;
        op.finished = op.pos == total;
        if self.oversubscribed {
            tail_a.store(tail + k as u64, Ordering::SeqCst);
            self.seg.wake(from);
        } else {
            tail_a.store(tail + k as u64, Ordering::Release);
            self.seg.wake_relaxed(from);
        }
        Ok(true)
    }

    /// Waits for ring activity; `may_sleep` allows the futex sleep (off when another transport needs polling).
    pub(crate) fn wait_inner(
        &mut self,
        send_peers: &[usize],
        recv_peers: &[usize],
        idle: u32,
        may_sleep: bool,
    ) -> Result<()> {
        // Spin (the peer is usually on another core and a few hundred nanoseconds away; one pause per round
        // so its data is seen as soon as it lands), then yield so a peer sharing our core can run, then sleep on
        // the futex. With more ranks than cores, spin only briefly and yield less before sleeping.
        let (spin, yields) = (self.spin, self.yields);
        if idle < spin {
            std::hint::spin_loop();
            if !idle.is_multiple_of(256) {
                return Ok(());
            }
            return self.check_abort();
        }
        self.check_abort()?;
        if idle <= spin.max(1) {
            self.yielding_since = None;
        }
        let yielding = idle < spin + yields || self.yield_longer();
        if yielding || !may_sleep {
            std::thread::yield_now();
            if !idle.is_multiple_of(64) {
                return Ok(());
            }
        }
        if self.last_liveness.elapsed() > Duration::from_millis(20) {
            self.last_liveness = Instant::now();
            for &p in send_peers {
                self.check_peer(self.local(p)?, true)?;
            }
            for &p in recv_peers {
                let from = self.local(p)?;
                let empty = self.seg.head(from, self.rank).load(Ordering::Acquire)
                    == self.seg.tail(from, self.rank).load(Ordering::Acquire);
                // Data still in the ring was sent before the peer went: read it first.
                if empty {
                    self.check_peer(from, true)?;
                }
            }
        }
        // Sleep until a peer publishes something. Announce the sleep first, then re-check, so a peer that
        // publishes in between either is seen here or sees the flag and wakes us.
        if !may_sleep || yielding {
            return Ok(());
        }
        let me = self.rank;
        let flag = self.seg.sleeping(me);
        flag.store(1, Ordering::SeqCst);
        let mut ready = false;
        for &p in send_peers {
            let to = self.local(p)?;
            let used = self.seg.head(me, to).load(Ordering::SeqCst)
                - self.seg.tail(me, to).load(Ordering::SeqCst);
            ready |= used < self.seg.ring_bytes as u64;
        }
        for &p in recv_peers {
            let from = self.local(p)?;
            ready |= self.seg.head(from, me).load(Ordering::SeqCst)
                != self.seg.tail(from, me).load(Ordering::SeqCst);
        }
        if !ready && self.seg.abort_word().load(Ordering::SeqCst) == 0 {
            futex_wait(flag, 1, Duration::from_millis(2));
        }
        flag.store(0, Ordering::SeqCst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any value, however large, gives a ring of 4 KiB to 1 GiB in whole 4 KiB (no overflow in the rounding).
    #[test]
    fn ring_sizes_are_rounded_and_bounded() {
        for (v, want) in [
            (0, 4096),
            (4097, 8192),
            (DEFAULT_RING_BYTES, DEFAULT_RING_BYTES),
            (MAX_RING_BYTES + 1, MAX_RING_BYTES),
            (usize::MAX, MAX_RING_BYTES),
        ] {
            assert_eq!(ring_bytes(v), want, "{v}");
        }
    }
}
