//! Point-to-point transports under the collective algorithms, and the loop that drives a set of transfers.
//!
//! A transport moves ordered byte messages between pairs of ranks. Both sides know every message's length in
//! advance (the operation header fixes it), so a message is just its bytes. Transfers make progress without
//! blocking, so one rank can send to its right neighbour while receiving from its left one even when the messages
//! are larger than any buffer in between; received data can be reduced into the destination as it arrives.

use std::time::{Duration, Instant};

use crate::board::Board;
use crate::error::{Error, Result};
use crate::types::{DType, ReduceOp};

/// An outgoing message.
pub struct SendOp<'a> {
    pub peer: usize,
    pub data: &'a [u8],
    /// Transport-defined progress (bytes written, including any framing).
    pub pos: usize,
    pub finished: bool,
}

/// An incoming message, copied into `buf` or reduced into it.
pub struct RecvOp<'a> {
    pub peer: usize,
    pub buf: &'a mut [u8],
    pub reduce: Option<(DType, ReduceOp)>,
    /// Bytes of `buf` completed.
    pub pos: usize,
    pub finished: bool,
    /// Transport scratch: framing header bytes read so far, and bytes of a partially received element.
    pub hdr: [u8; 16],
    pub hdr_len: usize,
    pub carry: [u8; 8],
    pub carry_len: usize,
}

impl<'a> SendOp<'a> {
    pub fn new(peer: usize, data: &'a [u8]) -> Self {
        SendOp {
            peer,
            data,
            pos: 0,
            finished: data.is_empty(),
        }
    }
}

impl<'a> RecvOp<'a> {
    pub fn new(peer: usize, buf: &'a mut [u8], reduce: Option<(DType, ReduceOp)>) -> Self {
        let finished = buf.is_empty();
        RecvOp {
            peer,
            buf,
            reduce,
            pos: 0,
            finished,
            hdr: [0; 16],
            hdr_len: 0,
            carry: [0; 8],
            carry_len: 0,
        }
    }
}

/// A point-to-point transport between the ranks of one job.
pub trait Transport: Send {
    /// This rank's global rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Moves `op` forward without blocking; returns whether anything moved. Sets `op.finished` when done.
    fn progress_send(&mut self, op: &mut SendOp<'_>) -> Result<bool>;
    /// Moves `op` forward without blocking; returns whether anything moved. Sets `op.finished` when done.
    fn progress_recv(&mut self, op: &mut RecvOp<'_>) -> Result<bool>;
    /// Writes out what [`progress_send`](Self::progress_send) staged instead of sending at once (small messages to
    /// one peer gathered into one system call); returns whether nothing staged is left. [`exchange`] calls it once
    /// per round, after the sends.
    fn flush(&mut self) -> Result<bool> {
        Ok(true)
    }
    /// Waits a little for progress to become possible; `idle` counts fruitless rounds so far (spin, then yield,
    /// then sleep). Also checks that peers are alive and returns their loss as an error.
    /// `send_peers`/`recv_peers` are the peers of the unfinished transfers.
    fn wait(&mut self, send_peers: &[usize], recv_peers: &[usize], idle: u32) -> Result<()>;
    /// How many fruitless rounds [`wait`](Self::wait) only spins: it neither blocks nor looks at the peer lists
    /// then, so [`exchange`] skips reading the clock and listing the peers (both cost more than a spin).
    fn spin_rounds(&self) -> u32 {
        0
    }
    /// Tells every peer that this rank gives up because of `culprit`, so their pending operations fail at once.
    fn abort(&mut self, culprit: usize, reason: &str);

    /// The board in shared memory on which every rank of the job posts each operation's header (shm, when its
    /// segment holds the whole job, numbered as the job numbers its ranks). The collectives ask once per
    /// operation; the board's own loops run without further dynamic calls.
    fn shared_board(&mut self) -> Option<&mut dyn Board> {
        None
    }

    /// Whether this transport reaches every rank of the job through shared memory (shm, when its segment holds the
    /// whole job): moving bytes between ranks then costs about what copying them within a rank does.
    fn whole_job_in_shared_memory(&self) -> bool {
        false
    }
}

/// Drives `sends` and `recvs` together until all are done; fails when nothing moved for `timeout`.
pub fn exchange<T: Transport + ?Sized>(
    t: &mut T,
    op: &'static str,
    timeout: Duration,
    sends: &mut [SendOp<'_>],
    recvs: &mut [RecvOp<'_>],
) -> Result<()> {
    let mut last_progress: Option<Instant> = None;
    let mut idle = 0u32;
    let (mut send_peers, mut recv_peers) = (Vec::new(), Vec::new());
    let mut busy = PeerSet::default();
    loop {
        let mut moved = false;
        let mut pending = false;
        // Messages to (and from) one peer go in order: a later one waits until the earlier one is done.
        busy.clear();
        for s in sends.iter_mut().filter(|s| !s.finished) {
            if busy.contains(s.peer) {
                pending = true;
                continue;
            }
            moved |= t.progress_send(s)?;
            if !s.finished {
                pending = true;
                busy.insert(s.peer);
            }
        }
        if !t.flush()? {
            pending = true;
        }
        busy.clear();
        for r in recvs.iter_mut().filter(|r| !r.finished) {
            if busy.contains(r.peer) {
                pending = true;
                continue;
            }
            moved |= t.progress_recv(r)?;
            if !r.finished {
                pending = true;
                busy.insert(r.peer);
            }
        }
        if !pending {
            return Ok(());
        }
        if moved {
            idle = 0;
            last_progress = None;
            continue;
        }
        // Reading the clock on every spin costs more than the spin; start it once the transport stops spinning.
        idle = idle.saturating_add(1);
        let spinning = idle < t.spin_rounds();
        if idle > 64 && !spinning {
            // A member of this elastic round that the launcher found frozen never answers nor dies.
            crate::liveness::check()?;
            let since = *last_progress.get_or_insert_with(Instant::now);
            if since.elapsed() > timeout {
                let mut ranks: Vec<usize> = sends
                    .iter()
                    .filter(|s| !s.finished)
                    .map(|s| s.peer)
                    .chain(recvs.iter().filter(|r| !r.finished).map(|r| r.peer))
                    .collect();
                ranks.sort_unstable();
                ranks.dedup();
                return Err(Error::Timeout {
                    op,
                    ranks,
                    waited: timeout,
                });
            }
        }
        if spinning {
            t.wait(&[], &[], idle)?;
            continue;
        }
        send_peers.clear();
        send_peers.extend(sends.iter().filter(|s| !s.finished).map(|s| s.peer));
        recv_peers.clear();
        recv_peers.extend(recvs.iter().filter(|r| !r.finished).map(|r| r.peer));
        t.wait(&send_peers, &recv_peers, idle)?;
    }
}

/// A set of ranks that allocates nothing for ranks below 128 (the hot path of small operations).
#[derive(Default)]
struct PeerSet {
    low: u128,
    high: Vec<usize>,
}

impl PeerSet {
    fn clear(&mut self) {
        self.low = 0;
        self.high.clear();
    }
    fn contains(&self, peer: usize) -> bool {
        if peer < 128 {
            self.low & (1u128 << peer) != 0
        } else {
            self.high.contains(&peer)
        }
    }
    fn insert(&mut self, peer: usize) {
        if peer < 128 {
            self.low |= 1u128 << peer;
        } else {
            self.high.push(peer);
        }
    }
}

/// Splits `buf` at the byte offsets of consecutive blocks of `counts` elements.
pub fn split_blocks<'a>(
    mut buf: &'a mut [u8],
    counts: &[usize],
    esize: usize,
) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(counts.len());
    for &c in counts {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(c * esize);
        out.push(head);
        buf = tail;
    }
    out
}

/// `count` elements in `n` blocks as even as can be (the first `count % n` blocks one element larger).
pub(crate) fn even_counts(count: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| count / n + usize::from(i < count % n))
        .collect()
}

/// Two disjoint ranges of one buffer: the first shared, the second mutable.
pub fn disjoint(
    buf: &mut [u8],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty());
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}
