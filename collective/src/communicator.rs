//! The `Communicator` trait: what every backend offers.

use crate::error::{Error, Result};
use crate::types::{DType, ReduceOp, Topology};

/// Where a staged allreduce ([`Communicator::allreduce_staged`]) gets its input and leaves its result. Ranges are
/// whole elements, and each range is read before any of it is written; the backend decides their sizes and order,
/// and may read a range again before writing it (the input stays what it was until written).
pub trait Staged {
    /// Copies bytes `offset..offset + dst.len()` of this rank's input into `dst`.
    fn read(&mut self, offset: usize, dst: &mut [u8]);
    /// Takes bytes `offset..offset + src.len()` of the reduced result.
    fn write(&mut self, offset: usize, src: &[u8]);
}

/// A buffer in one piece as [`Staged`] input and output (in place).
pub struct InPlace<'a>(pub &'a mut [u8]);

impl Staged for InPlace<'_> {
    fn read(&mut self, offset: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self.0[offset..offset + dst.len()]);
    }

    fn write(&mut self, offset: usize, src: &[u8]) {
        self.0[offset..offset + src.len()].copy_from_slice(src);
    }
}

/// A staged allreduce through one buffer: all of `io` read into `scratch`, `allreduce` on it, all of it written.
pub fn staged_through<E>(
    len: usize,
    io: &mut dyn Staged,
    scratch: &mut Vec<u8>,
    allreduce: impl FnOnce(&mut [u8]) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    if scratch.len() < len {
        scratch.resize(len, 0);
    }
    let buf = &mut scratch[..len];
    io.read(0, buf);
    allreduce(buf)?;
    io.write(0, buf);
    Ok(())
}

/// The arguments of [`Communicator::allreduce_staged`]: an allreduce of `len` bytes of `dtype` with `op` whose input
/// `io` reads and whose result `io` takes, range by range, with `scratch` for backends that need the whole buffer.
pub struct StagedAllreduce<'a> {
    pub len: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    pub io: &'a mut dyn Staged,
    pub scratch: &'a mut Vec<u8>,
}

/// The arguments of [`Communicator::allgatherv`]: rank `r` contributes `counts[r]` elements of `dtype` (its
/// `send`); `counts` is the same on every rank and `recv` holds their sum, in rank order.
pub struct Allgatherv<'a> {
    pub send: &'a [u8],
    pub recv: &'a mut [u8],
    pub counts: &'a [usize],
    pub dtype: DType,
}

/// The arguments of [`Communicator::alltoallv`]: `send_counts[j]` elements of `dtype` go to rank `j`,
/// `recv_counts[i]` come from rank `i` (blocks packed in rank order). Rank `i`'s `send_counts[j]` must equal rank
/// `j`'s `recv_counts[i]`.
pub struct Alltoallv<'a> {
    pub send: &'a [u8],
    pub send_counts: &'a [usize],
    pub recv: &'a mut [u8],
    pub recv_counts: &'a [usize],
    pub dtype: DType,
}

/// The arguments of [`Communicator::reducescatter`]: `send` (`counts` elements of `dtype` per rank, in rank order)
/// is reduced with `op` over all ranks, and rank `r`'s `recv` gets its block, `counts[r]` elements. `counts` is the
/// same on every rank.
pub struct Reducescatter<'a> {
    pub send: &'a [u8],
    pub recv: &'a mut [u8],
    pub counts: &'a [usize],
    pub dtype: DType,
    pub op: ReduceOp,
}

/// A member of a group of ranks that run collectives together.
///
/// Buffers are raw bytes (any tensor memory); `dtype` says how to read them and every count is in elements.
/// Every rank of the job must call the same operations in the same order with matching arguments; when they do not,
/// every rank gets [`Error::Mismatch`] (every backend, MPI and NCCL too, exchanges each operation's header first).
/// A communicator is `Send`, so it can live on a background thread; it is not `Sync`: one thread drives it.
pub trait Communicator: Send {
    /// Where this rank sits in the job.
    fn topology(&self) -> Topology;

    /// The backend's name (`tcp`, `shm`, `hierarchical`, `mpi`, `nccl`), for people: decide on
    /// [`in_shared_memory`](Self::in_shared_memory) and the like, not on this text.
    fn backend(&self) -> &'static str;

    /// Whether every rank of the job is reached through shared memory (the shm backend): moving bytes between
    /// ranks then costs about what copying them within a rank does.
    fn in_shared_memory(&self) -> bool {
        false
    }

    /// Global rank.
    fn rank(&self) -> usize {
        self.topology().rank
    }
    /// Number of ranks.
    fn size(&self) -> usize {
        self.topology().size
    }

    /// Reduces `data` elementwise over all ranks; every rank ends with the result.
    fn allreduce_in_place(&mut self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;

    /// Allreduce of `len` bytes that the caller never holds in one piece (a fused group of tensors in their own
    /// memory): `io` reads this rank's input and takes the result, range by range. Backends that can read
    /// straight into their shared buffers and write out of them do (shm: the arenas, see `docs/collective.md`);
    /// the default goes through `scratch`: read it all, allreduce in place, write it all. Ranks must call it for
    /// the same operations (not `allreduce_in_place` on one rank and this on another).
    fn allreduce_staged(&mut self, call: StagedAllreduce<'_>) -> Result<()> {
        let (dtype, op) = (call.dtype, call.op);
        staged_through(call.len, call.io, call.scratch, |buf| {
            self.allreduce_in_place(buf, dtype, op)
        })
    }

    /// Out-of-place allreduce: `recv` (same length as `send`) gets the reduction of every rank's `send`.
    fn allreduce(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        copy_in(self, "allreduce", send, recv, dtype)?;
        self.allreduce_in_place(recv, dtype, op)
    }

    /// Gathers every rank's block (the same element count everywhere) into `recv`, ordered by rank.
    /// `recv.len() == send.len() * size`.
    fn allgather(&mut self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
        let size = self.size();
        check::allgather(send.len(), recv.len(), size, dtype)
            .map_err(|e| self.refuse("allgather", dtype, e))?;
        let counts = vec![send.len() / dtype.size(); size];
        self.allgatherv(Allgatherv {
            send,
            recv,
            counts: &counts,
            dtype,
        })
    }

    /// In-place allgather: this rank's block is already at `buf[rank * block..]`, `block = buf.len() / size`.
    fn allgather_in_place(&mut self, buf: &mut [u8], dtype: DType) -> Result<()> {
        let size = self.size();
        check::splits("allgather", buf.len(), size, dtype)
            .map_err(|e| self.refuse("allgather", dtype, e))?;
        let counts = vec![buf.len() / size / dtype.size(); size];
        self.allgatherv_in_place(buf, &counts, dtype)
    }

    /// Gathers blocks of different sizes (see [`Allgatherv`]).
    fn allgatherv(&mut self, call: Allgatherv<'_>) -> Result<()>;

    /// In-place allgatherv: this rank's block is already in place at its offset in `buf`. The default copies that
    /// block out and runs [`allgatherv`](Self::allgatherv) from the copy.
    fn allgatherv_in_place(
        &mut self,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let send = check::own_block(buf, counts, self.rank(), dtype.size());
        self.allgatherv(Allgatherv {
            send: &send,
            recv: buf,
            counts,
            dtype,
        })
    }

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
            copy_in(self, "broadcast", send, recv, dtype)?;
        }
        self.broadcast(recv, dtype, root)
    }

    /// Block `j` of `send` goes to rank `j`; block `i` of `recv` comes from rank `i`. Blocks are `len / size`.
    fn alltoall(&mut self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
        let size = self.size();
        check::alltoall(send.len(), recv.len(), size, dtype)
            .map_err(|e| self.refuse("alltoall", dtype, e))?;
        let counts = vec![send.len() / dtype.size() / size.max(1); size];
        self.alltoallv(Alltoallv {
            send,
            send_counts: &counts,
            recv,
            recv_counts: &counts,
            dtype,
        })
    }

    /// In-place alltoall.
    fn alltoall_in_place(&mut self, buf: &mut [u8], dtype: DType) -> Result<()> {
        let send = buf.to_vec();
        self.alltoall(&send, buf, dtype)
    }

    /// Alltoall with per-peer counts (see [`Alltoallv`]).
    fn alltoallv(&mut self, call: Alltoallv<'_>) -> Result<()>;

    /// Reduces `send` over all ranks and scatters the result: rank `r` gets `counts[r]` elements (the block at
    /// offset `counts[..r].sum()`) in `recv`; `counts` sums to `send`'s length (see [`Reducescatter`]).
    fn reducescatter(&mut self, call: Reducescatter<'_>) -> Result<()>;

    /// In-place reducescatter: this rank's reduced block ends at the start of `buf`.
    fn reducescatter_in_place(
        &mut self,
        buf: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let mine = check::own_fits(counts, self.rank(), buf.len(), dtype)
            .map_err(|e| self.refuse("reducescatter", dtype, e))?;
        let send = buf.to_vec();
        self.reducescatter(Reducescatter {
            send: &send,
            recv: &mut buf[..mine],
            counts,
            dtype,
            op,
        })
    }

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<()>;

    /// The error for a call of `op` whose arguments this rank's checks refused with `error` (the provided methods
    /// above check before they delegate). The default is `error` itself; a backend that checks every call across
    /// ranks (p2p) first takes part in the operation's header exchange, marked invalid, so the other ranks fail
    /// with a mismatch instead of waiting for this one.
    fn refuse(&mut self, op: &'static str, dtype: DType, error: Error) -> Error {
        let _ = (op, dtype);
        error
    }
}

/// The first step of an out-of-place `op` that works in place: `recv` gets `send`'s bytes, unless their lengths
/// differ (then `comm` refuses the call).
fn copy_in<C: Communicator + ?Sized>(
    comm: &mut C,
    op: &'static str,
    send: &[u8],
    recv: &mut [u8],
    dtype: DType,
) -> Result<()> {
    check::same_len(op, send.len(), recv.len()).map_err(|e| comm.refuse(op, dtype, e))?;
    recv.copy_from_slice(send);
    Ok(())
}

pub(crate) fn invalid(op: &'static str, detail: String) -> Error {
    Error::InvalidArgument { op, detail }
}

/// Argument checks and block arithmetic shared by every backend (p2p, mpi, nccl), so that the same bad call gets
/// the same [`Error::InvalidArgument`] everywhere. A backend reports the error to its peers through its header
/// exchange (they get a mismatch) and returns it to its own caller. Nothing here panics, whatever the counts.
pub(crate) mod check {
    use std::ops::Range;

    use super::{Allgatherv, Reducescatter, invalid};
    use crate::error::Result;
    use crate::types::DType;

    /// `bytes` holds a whole number of `dtype` elements.
    pub(crate) fn whole(op: &'static str, bytes: usize, dtype: DType) -> Result<()> {
        if bytes.is_multiple_of(dtype.size()) {
            Ok(())
        } else {
            Err(invalid(
                op,
                format!("{bytes} bytes is not a whole number of {dtype}"),
            ))
        }
    }

    /// Out-of-place buffers of equal length.
    pub(crate) fn same_len(op: &'static str, send: usize, recv: usize) -> Result<()> {
        if send == recv {
            Ok(())
        } else {
            Err(invalid(
                op,
                format!("send has {send} bytes but recv {recv}"),
            ))
        }
    }

    /// `bytes` splits into `n` equal blocks of whole `dtype` elements.
    pub(crate) fn splits(op: &'static str, bytes: usize, n: usize, dtype: DType) -> Result<()> {
        if bytes.is_multiple_of(n.max(1) * dtype.size()) {
            Ok(())
        } else {
            Err(invalid(
                op,
                format!("{bytes} bytes do not split into {n} {dtype} blocks"),
            ))
        }
    }

    /// allgather: whole elements in `send`, and `recv` is `n` times as long.
    pub(crate) fn allgather(send: usize, recv: usize, n: usize, dtype: DType) -> Result<()> {
        if send.is_multiple_of(dtype.size()) && send.checked_mul(n) == Some(recv) {
            Ok(())
        } else {
            Err(invalid(
                "allgather",
                format!("send has {send} bytes, recv {recv} for {n} ranks"),
            ))
        }
    }

    /// alltoall: `send` and `recv` are equal and split into `n` blocks.
    pub(crate) fn alltoall(send: usize, recv: usize, n: usize, dtype: DType) -> Result<()> {
        if send == recv && send.is_multiple_of(n.max(1) * dtype.size()) {
            Ok(())
        } else {
            Err(invalid(
                "alltoall",
                format!(
                    "send ({send} bytes) and recv ({recv} bytes) must be equal and split into {n} {dtype} blocks"
                ),
            ))
        }
    }

    /// In-place reducescatter: this rank's block (`counts[me]` elements) fits at the start of the buffer; returns
    /// its length in bytes.
    pub(crate) fn own_fits(
        counts: &[usize],
        me: usize,
        bytes: usize,
        dtype: DType,
    ) -> Result<usize> {
        match counts.get(me).and_then(|c| c.checked_mul(dtype.size())) {
            Some(mine) if mine <= bytes => Ok(mine),
            _ => Err(invalid(
                "reducescatter",
                format!("counts[{me}] does not fit into {bytes} bytes"),
            )),
        }
    }

    /// `counts` has one entry per rank and its elements fill exactly `bytes`.
    pub(crate) fn counts(
        op: &'static str,
        counts: &[usize],
        n: usize,
        bytes: usize,
        dtype: DType,
    ) -> Result<()> {
        if counts.len() != n {
            return Err(invalid(
                op,
                format!("{} counts given for {n} ranks", counts.len()),
            ));
        }
        let total = counts
            .iter()
            .try_fold(0usize, |acc, c| acc.checked_add(*c))
            .and_then(|t| t.checked_mul(dtype.size()).map(|b| (t, b)));
        match total {
            Some((_, b)) if b == bytes => Ok(()),
            Some((t, _)) => Err(invalid(
                op,
                format!("counts sum to {t} {dtype} elements but the buffer has {bytes} bytes"),
            )),
            None => Err(invalid(op, "counts overflow the address space".into())),
        }
    }

    /// allgatherv: `counts` describes `recv`, and this rank's `send` is its `counts[me]` elements.
    pub(crate) fn allgatherv(call: &Allgatherv<'_>, n: usize, me: usize) -> Result<()> {
        let (send, recv) = (call.send.len(), call.recv.len());
        counts_and_mine(
            ("allgather", recv),
            ("send", send),
            call.counts,
            n,
            me,
            call.dtype,
        )
    }

    /// reducescatter: `counts` describes `send`, and `recv` holds this rank's `counts[me]` elements.
    pub(crate) fn reducescatter(call: &Reducescatter<'_>, n: usize, me: usize) -> Result<()> {
        let (send, recv) = (call.send.len(), call.recv.len());
        counts_and_mine(
            ("reducescatter", send),
            ("recv", recv),
            call.counts,
            n,
            me,
            call.dtype,
        )
    }

    /// `counts` describes the whole buffer of `op` (`whole` bytes); this rank's buffer `mine` (named `which`) holds
    /// its `counts[me]` elements.
    fn counts_and_mine(
        (op, whole): (&'static str, usize),
        (which, mine): (&str, usize),
        counts_: &[usize],
        n: usize,
        me: usize,
        dtype: DType,
    ) -> Result<()> {
        counts(op, counts_, n, whole, dtype)?;
        if mine != counts_[me] * dtype.size() {
            return Err(invalid(
                op,
                format!(
                    "{which} has {mine} bytes but counts[{me}] = {} {dtype} elements",
                    counts_[me]
                ),
            ));
        }
        Ok(())
    }

    /// broadcast: `root` is a rank and the buffer holds whole elements.
    pub(crate) fn broadcast(bytes: usize, root: usize, n: usize, dtype: DType) -> Result<()> {
        if root >= n {
            return Err(invalid(
                "broadcast",
                format!("root {root} is not a rank of this {n}-rank job"),
            ));
        }
        whole("broadcast", bytes, dtype)
    }

    /// Byte range of block `i` of consecutive blocks of `counts` elements (empty when `i` or the sums are out of
    /// range; callers check `counts` first where it matters).
    pub(crate) fn block(counts: &[usize], i: usize, esize: usize) -> Range<usize> {
        let start = counts
            .iter()
            .take(i)
            .try_fold(0usize, |acc, c| acc.checked_add(c.checked_mul(esize)?));
        let len = counts.get(i).and_then(|c| c.checked_mul(esize));
        match (start, len) {
            (Some(s), Some(l)) => s..s.saturating_add(l),
            _ => 0..0,
        }
    }

    /// Byte offsets of consecutive blocks: `offsets[i]..offsets[i + 1]` is block `i`.
    pub(crate) fn offsets(counts: &[usize], esize: usize) -> Vec<usize> {
        let mut v = Vec::with_capacity(counts.len() + 1);
        let mut acc = 0usize;
        v.push(0);
        for c in counts {
            acc = acc.saturating_add(c.saturating_mul(esize));
            v.push(acc);
        }
        v
    }

    /// This rank's own block of an in-place allgatherv buffer, copied out (empty when it does not fit; the
    /// allgatherv check then reports the bad counts).
    pub(crate) fn own_block(buf: &[u8], counts: &[usize], me: usize, esize: usize) -> Vec<u8> {
        buf.get(block(counts, me, esize))
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    }
}
