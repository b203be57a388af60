//! What the engine needs from a communicator, at the level of bytes.
//!
//! The engine is written against this small trait rather than directly against `hvd-collective`'s `Communicator`
//! so that (1) its own tests run with in-process ranks ([`LocalTransport`]) and (2) the adapter to the collective
//! crate's communicators (see `collective.rs`) is the only place that calls them. The types are that crate's
//! (`DType`, `ReduceOp`, `Topology`, and its `Error` as [`TransportError`], so a failure keeps its kind up to the
//! caller). All buffers are little-endian element arrays; counts are in bytes unless the name says elements.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use hvd_collective::communicator::staged_through;
use hvd_collective::reduce::reduce_into;
use hvd_collective::{DType, ReduceOp, Staged};

pub use hvd_collective::Topology;

/// A failed collective: the collective crate's own error (a lost peer, a timeout, ranks that disagree, a broken
/// connection), kept as it is so that its kind and [`is_fatal`](hvd_collective::Error::is_fatal) reach the caller.
/// The engine stops and fails every pending operation with it.
pub type TransportError = hvd_collective::Error;

pub type TransportResult<T> = Result<T, TransportError>;

/// Collectives over byte buffers. Every rank calls the same methods in the same order (the engine guarantees it).
pub trait Transport: Send {
    /// A short upper-case name for the timeline (`SHM`, `TCP`, `LOCAL`...).
    fn name(&self) -> &str;
    fn topology(&self) -> Topology;
    /// Allreduces of this many bytes or more run alone, in place: from this size on, the two copies through the
    /// fusion buffer cost more than the per-collective latency that fusing saves.
    fn fusion_max_tensor_bytes(&self) -> usize {
        1 << 20
    }
    /// In-place element-wise reduction of `buf` (elements of `dtype`) across all ranks. The engine never passes
    /// `ReduceOp::Average` (it sums and scales itself).
    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> TransportResult<()>;
    /// An allreduce of `len` bytes that `io` reads and writes range by range (a fused group in its members'
    /// memory). The default goes through `scratch` (the fusion buffer): read it all, [`allreduce`](Self::allreduce),
    /// write it all.
    fn allreduce_staged(
        &mut self,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        io: &mut dyn Staged,
        scratch: &mut Vec<u8>,
    ) -> TransportResult<()> {
        staged_through(len, io, scratch, |buf| self.allreduce(buf, dtype, op))
    }
    /// Concatenation of every rank's `send` in rank order into `recv`; `recv_counts[r]` is rank r's byte count.
    fn allgatherv(
        &mut self,
        send: &[u8],
        recv_counts: &[usize],
        recv: &mut [u8],
    ) -> TransportResult<()>;
    /// `buf` of rank `root` copied into every rank's `buf`.
    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> TransportResult<()>;
    /// Rank r sends `send[piece s]` (piece sizes `send_counts`) to rank s and receives pieces of `recv_counts`.
    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> TransportResult<()>;
    fn barrier(&mut self) -> TransportResult<()>;

    /// Reduces `buf` across ranks and leaves this rank's block (`block_elems[r]` elements each, in rank order) in
    /// `out`. The default reduces everything and keeps a slice; transports with a real reduce-scatter override it.
    fn reducescatter(
        &mut self,
        buf: &mut [u8],
        block_elems: &[usize],
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> TransportResult<()> {
        self.allreduce(buf, dtype, op)?;
        let rank = self.topology().rank;
        let start: usize = block_elems[..rank].iter().sum::<usize>() * dtype.size();
        out.copy_from_slice(&buf[start..start + out.len()]);
        Ok(())
    }

    /// Variable-size control message exchange: every rank receives every rank's bytes. Used by negotiation.
    fn allgather_bytes(&mut self, send: &[u8]) -> TransportResult<Vec<Vec<u8>>> {
        let size = self.topology().size;
        let mut lens = vec![0u8; 8 * size];
        self.allgatherv(
            &(send.len() as u64).to_le_bytes(),
            &vec![8; size],
            &mut lens,
        )?;
        let counts: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect();
        let mut all = vec![0u8; counts.iter().sum()];
        self.allgatherv(send, &counts, &mut all)?;
        let mut out = Vec::with_capacity(size);
        let mut at = 0;
        for c in counts {
            out.push(all[at..at + c].to_vec());
            at += c;
        }
        Ok(out)
    }

    /// Variable-size broadcast of a control message from `root`.
    fn broadcast_bytes(&mut self, data: Vec<u8>, root: usize) -> TransportResult<Vec<u8>> {
        let mut len = (data.len() as u64).to_le_bytes();
        self.broadcast(&mut len, root)?;
        let mut buf = if self.topology().rank == root {
            data
        } else {
            vec![0u8; u64::from_le_bytes(len) as usize]
        };
        self.broadcast(&mut buf, root)?;
        Ok(buf)
    }
}

/// In-process ranks (threads) exchanging through shared memory under a mutex: the reference transport for the
/// engine's own tests. Every operation is one all-to-all exchange of byte vectors followed by local work, which is
/// slow but obviously correct.
pub struct LocalTransport {
    topology: Topology,
    shared: Arc<Exchange>,
}

struct Exchange {
    state: Mutex<Round>,
    cv: Condvar,
    size: usize,
    timeout: Duration,
}

struct Round {
    generation: u64,
    deposits: Vec<Option<Vec<u8>>>,
    arrived: usize,
    result: Arc<Vec<Vec<u8>>>,
    dead: Option<usize>,
}

impl LocalTransport {
    /// `size` connected transports, one per in-process rank. A rank that waits `timeout` for the others fails.
    pub fn group(size: usize, timeout: Duration) -> Vec<LocalTransport> {
        let shared = Arc::new(Exchange {
            state: Mutex::new(Round {
                generation: 0,
                deposits: vec![None; size],
                arrived: 0,
                result: Arc::new(Vec::new()),
                dead: None,
            }),
            cv: Condvar::new(),
            size,
            timeout,
        });
        (0..size)
            .map(|rank| LocalTransport {
                topology: Topology::single_host(rank, size),
                shared: shared.clone(),
            })
            .collect()
    }

    /// Simulates the death of this rank: every rank's pending and future operations fail naming it.
    pub fn kill(&self) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.dead = Some(self.topology.rank);
        self.shared.cv.notify_all();
    }

    fn exchange(&self, data: Vec<u8>) -> TransportResult<Arc<Vec<Vec<u8>>>> {
        let ex = &*self.shared;
        let mut st = ex.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(dead) = st.dead {
            return Err(died(dead));
        }
        let generation = st.generation;
        st.deposits[self.topology.rank] = Some(data);
        st.arrived += 1;
        if st.arrived == ex.size {
            let all: Vec<Vec<u8>> = st
                .deposits
                .iter_mut()
                .map(|d| d.take().unwrap_or_default())
                .collect();
            st.result = Arc::new(all);
            st.arrived = 0;
            st.generation += 1;
            ex.cv.notify_all();
            return Ok(st.result.clone());
        }
        let deadline = Instant::now() + ex.timeout;
        while st.generation == generation {
            if let Some(dead) = st.dead {
                return Err(died(dead));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    (0..ex.size).filter(|r| st.deposits[*r].is_none()).collect();
                return Err(TransportError::Timeout {
                    op: "exchange",
                    ranks: missing,
                    waited: ex.timeout,
                });
            }
            st = ex
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(st.result.clone())
    }
}

/// Rank `rank` of an in-process group has been killed ([`LocalTransport::kill`]).
fn died(rank: usize) -> TransportError {
    TransportError::PeerLost {
        rank,
        reason: "killed".into(),
    }
}

/// Rank `rank` passed `op` another `what` (size, count) than rank `reference` expected.
fn mismatch(op: &str, what: &str, rank: usize, reference: usize) -> TransportError {
    TransportError::Mismatch {
        rank,
        reference,
        detail: format!("rank {rank} passed {op} another {what} than rank {reference}"),
    }
}

impl Transport for LocalTransport {
    fn name(&self) -> &str {
        "LOCAL"
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> TransportResult<()> {
        let all = self.exchange(buf.to_vec())?;
        // Same order on every rank, so floating-point results are identical everywhere.
        buf.copy_from_slice(&all[0]);
        for (rank, other) in all.iter().enumerate().skip(1) {
            if other.len() != buf.len() {
                return Err(mismatch("allreduce", "size", rank, 0));
            }
            reduce_into(buf, other, dtype, op);
        }
        Ok(())
    }

    fn allgatherv(
        &mut self,
        send: &[u8],
        recv_counts: &[usize],
        recv: &mut [u8],
    ) -> TransportResult<()> {
        let all = self.exchange(send.to_vec())?;
        let mut at = 0;
        for (rank, (piece, count)) in all.iter().zip(recv_counts).enumerate() {
            if piece.len() != *count {
                return Err(mismatch("allgatherv", "count", rank, self.topology.rank));
            }
            recv[at..at + count].copy_from_slice(piece);
            at += count;
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> TransportResult<()> {
        let mine = if self.topology.rank == root {
            buf.to_vec()
        } else {
            Vec::new()
        };
        let all = self.exchange(mine)?;
        if all[root].len() != buf.len() {
            return Err(mismatch("broadcast", "size", self.topology.rank, root));
        }
        buf.copy_from_slice(&all[root]);
        Ok(())
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> TransportResult<()> {
        let mut msg = Vec::with_capacity(8 * send_counts.len() + send.len());
        for c in send_counts {
            msg.extend_from_slice(&(*c as u64).to_le_bytes());
        }
        msg.extend_from_slice(send);
        let all = self.exchange(msg)?;
        let me = self.topology.rank;
        let size = self.topology.size;
        let mut at = 0;
        for (sender, piece) in all.iter().enumerate() {
            let counts: Vec<usize> = piece[..8 * size]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
                .collect();
            let offset = 8 * size + counts[..me].iter().sum::<usize>();
            if counts[me] != recv_counts[sender] {
                return Err(mismatch("alltoallv", "count", sender, me));
            }
            recv[at..at + counts[me]].copy_from_slice(&piece[offset..offset + counts[me]]);
            at += counts[me];
        }
        Ok(())
    }

    fn barrier(&mut self) -> TransportResult<()> {
        self.exchange(Vec::new()).map(|_| ())
    }
}
