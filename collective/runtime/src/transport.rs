//! What the engine adds to `hvd-collective`'s communicators at the level of bytes (variable-size control messages,
//! the fusion limit, the timeline's name), and [`LocalTransport`], a communicator of in-process ranks for the
//! engine's own tests and for a job of one rank. All buffers are little-endian element arrays; counts are in bytes
//! unless the name says elements; the engine's control messages and byte payloads travel as `u8` elements.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use hvd_collective::reduce::reduce_into;
use hvd_collective::{
    Allgatherv, Alltoallv, Communicator, DType, Error, ReduceOp, Reducescatter, Result,
};

pub use hvd_collective::Topology;

/// Allreduces of this many bytes or more run alone, in place: from this size on, the two copies through the fusion
/// buffer cost more than the per-collective latency that fusing saves. Shared memory moves 4 KiB in a few
/// microseconds: copying a 64 KiB tensor into the fusion buffer and out again already costs about what a collective
/// of its own does (measured with `bench/engine.py`: a fused 15 MB buffer of 4 KiB..1 MiB tensors spent 6 ms in the
/// two copies and saved nothing in the collective).
pub fn fusion_max_tensor_bytes(comm: &dyn Communicator) -> usize {
    if comm.in_shared_memory() {
        64 << 10
    } else {
        1 << 20
    }
}

/// The communicator's name in upper case, as the timeline and `hvd_backend` show it (`SHM`, `TCP`, `LOCAL`...).
pub fn display_name(comm: &dyn Communicator) -> String {
    comm.backend().to_uppercase()
}

/// Variable-size control message exchange: every rank receives every rank's bytes. Used by negotiation.
pub fn allgather_bytes(comm: &mut dyn Communicator, send: &[u8]) -> Result<Vec<Vec<u8>>> {
    let size = comm.topology().size;
    let mut lens = vec![0u8; 8 * size];
    comm.allgatherv(Allgatherv {
        send: &(send.len() as u64).to_le_bytes(),
        recv: &mut lens,
        counts: &vec![8; size],
        dtype: DType::U8,
    })?;
    let counts: Vec<usize> = lens
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
        .collect();
    let mut all = vec![0u8; counts.iter().sum()];
    comm.allgatherv(Allgatherv {
        send,
        recv: &mut all,
        counts: &counts,
        dtype: DType::U8,
    })?;
    let mut out = Vec::with_capacity(size);
    let mut at = 0;
    for c in counts {
        out.push(all[at..at + c].to_vec());
        at += c;
    }
    Ok(out)
}

/// Variable-size broadcast of a control message from `root`.
pub fn broadcast_bytes(comm: &mut dyn Communicator, data: Vec<u8>, root: usize) -> Result<Vec<u8>> {
    let mut len = (data.len() as u64).to_le_bytes();
    comm.broadcast(&mut len, DType::U8, root)?;
    let mut buf = if comm.topology().rank == root {
        data
    } else {
        vec![0u8; u64::from_le_bytes(len) as usize]
    };
    comm.broadcast(&mut buf, DType::U8, root)?;
    Ok(buf)
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

    fn exchange(&self, data: Vec<u8>) -> Result<Arc<Vec<Vec<u8>>>> {
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
        let deadline = hvd_collective::time::saturating_add(Instant::now(), ex.timeout);
        while st.generation == generation {
            if let Some(dead) = st.dead {
                return Err(died(dead));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    (0..ex.size).filter(|r| st.deposits[*r].is_none()).collect();
                return Err(Error::Timeout {
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
fn died(rank: usize) -> Error {
    Error::PeerLost {
        rank,
        reason: "killed".into(),
    }
}

/// Rank `rank` passed `op` another `what` (size, count) than rank `reference` expected.
fn mismatch(op: &str, what: &str, rank: usize, reference: usize) -> Error {
    Error::Mismatch {
        rank,
        reference,
        detail: format!("rank {rank} passed {op} another {what} than rank {reference}"),
    }
}

/// Counts of elements of `dtype` as byte counts.
fn byte_counts(counts: &[usize], dtype: DType) -> Vec<usize> {
    counts.iter().map(|c| c * dtype.size()).collect()
}

impl Communicator for LocalTransport {
    fn backend(&self) -> &'static str {
        "local"
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn allreduce_in_place(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
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

    fn allgatherv(&mut self, call: Allgatherv<'_>) -> Result<()> {
        let all = self.exchange(call.send.to_vec())?;
        let mut at = 0;
        for (rank, (piece, count)) in all
            .iter()
            .zip(byte_counts(call.counts, call.dtype))
            .enumerate()
        {
            if piece.len() != count {
                return Err(mismatch("allgatherv", "count", rank, self.topology.rank));
            }
            call.recv[at..at + count].copy_from_slice(piece);
            at += count;
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [u8], _dtype: DType, root: usize) -> Result<()> {
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

    fn alltoallv(&mut self, call: Alltoallv<'_>) -> Result<()> {
        let send_bytes = byte_counts(call.send_counts, call.dtype);
        let recv_bytes = byte_counts(call.recv_counts, call.dtype);
        let mut msg = Vec::with_capacity(8 * send_bytes.len() + call.send.len());
        for c in &send_bytes {
            msg.extend_from_slice(&(*c as u64).to_le_bytes());
        }
        msg.extend_from_slice(call.send);
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
            if counts[me] != recv_bytes[sender] {
                return Err(mismatch("alltoallv", "count", sender, me));
            }
            call.recv[at..at + counts[me]].copy_from_slice(&piece[offset..offset + counts[me]]);
            at += counts[me];
        }
        Ok(())
    }

    /// Reduces everything and keeps this rank's block.
    fn reducescatter(&mut self, call: Reducescatter<'_>) -> Result<()> {
        let mut all = call.send.to_vec();
        self.allreduce_in_place(&mut all, call.dtype, call.op)?;
        let start: usize =
            call.counts[..self.topology.rank].iter().sum::<usize>() * call.dtype.size();
        call.recv
            .copy_from_slice(&all[start..start + call.recv.len()]);
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        self.exchange(Vec::new()).map(|_| ())
    }
}
