//! The `Communicator` trait: what every backend offers.

use crate::error::{Error, Result};
use crate::types::{DType, ReduceOp, Topology};

/// A member of a group of ranks that run collectives together.
///
/// Buffers are raw bytes (any tensor memory); `dtype` says how to read them and every count is in elements.
/// Every rank of the job must call the same operations in the same order with matching arguments; when they do not,
/// every rank gets [`Error::Mismatch`] (backends that cannot check, such as MPI, say so in their docs).
/// A communicator is `Send`, so it can live on a background thread; it is not `Sync`: one thread drives it.
pub trait Communicator: Send {
    /// Where this rank sits in the job.
    fn topology(&self) -> Topology;

    /// The backend's name (`tcp`, `shm`, `hierarchical`, `mpi`, `nccl`).
    fn backend(&self) -> &'static str;

    /// Global rank.
    fn rank(&self) -> usize {
        self.topology().rank
    }
    /// Number of ranks.
    fn size(&self) -> usize {
        self.topology().size
    }
    /// Rank on this host.
    fn local_rank(&self) -> usize {
        self.topology().local_rank
    }
    /// Ranks on this host.
    fn local_size(&self) -> usize {
        self.topology().local_size
    }
    /// Index of this host.
    fn cross_rank(&self) -> usize {
        self.topology().cross_rank
    }
    /// Number of hosts.
    fn cross_size(&self) -> usize {
        self.topology().cross_size
    }

    /// Reduces `data` elementwise over all ranks; every rank ends with the result.
    fn allreduce_in_place(&mut self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;

    /// Out-of-place allreduce: `recv` (same length as `send`) gets the reduction of every rank's `send`.
    fn allreduce(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if send.len() != recv.len() {
            return Err(invalid(
                "allreduce",
                format!("send has {} bytes but recv {}", send.len(), recv.len()),
            ));
        }
        recv.copy_from_slice(send);
        self.allreduce_in_place(recv, dtype, op)
    }

    /// Gathers every rank's block (the same element count everywhere) into `recv`, ordered by rank.
    /// `recv.len() == send.len() * size`.
    fn allgather(&mut self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
        let counts = vec![send.len() / dtype.size(); self.size()];
        self.allgatherv(send, recv, &counts, dtype)
    }

    /// In-place allgather: this rank's block is already at `buf[rank * block..]`, `block = buf.len() / size`.
    fn allgather_in_place(&mut self, buf: &mut [u8], dtype: DType) -> Result<()> {
        let size = self.size();
        if !buf.len().is_multiple_of(size * dtype.size()) {
            return Err(invalid(
                "allgather",
                format!(
                    "{} bytes do not split into {size} {dtype} blocks",
                    buf.len()
                ),
            ));
        }
        let counts = vec![buf.len() / size / dtype.size(); size];
        self.allgatherv_in_place(buf, &counts, dtype)
    }

    /// Gathers blocks of different sizes: rank `r` contributes `counts[r]` elements; `counts` is the same on every
    /// rank and `recv` holds their sum.
    fn allgatherv(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
    ) -> Result<()>;

    /// In-place allgatherv: this rank's block is already in place at its offset in `buf`.
    fn allgatherv_in_place(&mut self, buf: &mut [u8], counts: &[usize], dtype: DType)
    -> Result<()>;

    /// Copies `root`'s `buf` into every other rank's `buf`.
    fn broadcast(&mut self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()>;

    /// Out-of-place broadcast: every rank's `recv` gets `root`'s `send` (other ranks' `send` is not read).
    fn broadcast_out_of_place(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        if self.rank() == root {
            if send.len() != recv.len() {
                return Err(invalid(
                    "broadcast",
                    format!("send has {} bytes but recv {}", send.len(), recv.len()),
                ));
            }
            recv.copy_from_slice(send);
        }
        self.broadcast(recv, dtype, root)
    }

    /// Block `j` of `send` goes to rank `j`; block `i` of `recv` comes from rank `i`. Blocks are `len / size`.
    fn alltoall(&mut self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
        let size = self.size();
        let counts = vec![send.len() / dtype.size() / size.max(1); size];
        if !send.len().is_multiple_of(size * dtype.size()) {
            return Err(invalid(
                "alltoall",
                format!(
                    "{} bytes do not split into {size} {dtype} blocks",
                    send.len()
                ),
            ));
        }
        self.alltoallv(send, &counts, recv, &counts, dtype)
    }

    /// In-place alltoall.
    fn alltoall_in_place(&mut self, buf: &mut [u8], dtype: DType) -> Result<()> {
        let send = buf.to_vec();
        self.alltoall(&send, buf, dtype)
    }

    /// Alltoall with per-peer counts: `send_counts[j]` elements go to rank `j`, `recv_counts[i]` come from rank `i`
    /// (blocks packed in rank order). Rank `i`'s `send_counts[j]` must equal rank `j`'s `recv_counts[i]`.
    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()>;

    /// Reduces `send` over all ranks and scatters the result: rank `r` gets `counts[r]` elements (the block at
    /// offset `counts[..r].sum()`) in `recv`. `counts` is the same on every rank and sums to `send`'s length.
    fn reducescatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()>;

    /// In-place reducescatter: this rank's reduced block ends at the start of `buf`.
    fn reducescatter_in_place(
        &mut self,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let send = buf.to_vec();
        let r = self.rank();
        let mine = counts.get(r).copied().unwrap_or(0) * dtype.size();
        if mine > buf.len() {
            return Err(invalid(
                "reducescatter",
                format!("counts[{r}] does not fit into {} bytes", buf.len()),
            ));
        }
        self.reducescatter(&send, &mut buf[..mine], counts, dtype, op)
    }

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<()>;
}

pub(crate) fn invalid(op: &'static str, detail: String) -> Error {
    Error::InvalidArgument { op, detail }
}
