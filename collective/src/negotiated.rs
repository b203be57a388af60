//! The backends whose library runs the collectives (mpi, nccl): the header exchange before every operation,
//! written once for both ([`Negotiated`] over a [`Native`] backend).

use crate::communicator::{Allgatherv, Alltoallv, Communicator, Reducescatter};
use crate::error::Result;
use crate::header::{self, Call, Header, Kind};
use crate::types::{DType, ReduceOp, Topology};

/// What a backend over a collective library provides: an all-gather of every rank's encoded header, and the
/// operations themselves, called only once every rank's header agreed (the arguments are checked and match).
pub trait Native: Send {
    /// The backend's name (`mpi`, `nccl`).
    const NAME: &'static str;

    fn topology(&self) -> Topology;

    /// Every rank's header bytes (this rank's are `mine`), in rank order.
    fn all_gather_headers(&mut self, mine: &[u8]) -> Result<Vec<u8>>;

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;

    fn allgatherv(&mut self, call: Allgatherv<'_>) -> Result<()>;

    /// Copies `root`'s bytes into every other rank's `buf`.
    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()>;

    fn alltoallv(&mut self, call: Alltoallv<'_>) -> Result<()>;

    fn reducescatter(&mut self, call: Reducescatter<'_>) -> Result<()>;

    /// Returns once every rank is here (the header exchange before it already made every rank join).
    fn barrier(&mut self) -> Result<()>;
}

/// A [`Native`] backend as a [`Communicator`]: every operation first all-gathers its header (with this rank's own
/// verdict on its arguments) and runs only when every rank's header agrees, so mismatched calls fail on every rank
/// like on the other backends.
pub struct Negotiated<N> {
    native: N,
    seq: u64,
}

impl<N: Native> Negotiated<N> {
    pub(crate) fn over(native: N) -> Negotiated<N> {
        Negotiated { native, seq: 0 }
    }

    /// Gathers every rank's header and checks them (the mismatch check of the other backends).
    fn negotiate(&mut self, (mut h, local): Call) -> Result<()> {
        self.seq += 1;
        h.seq = self.seq;
        h.invalid = local.is_some();
        let all = self.native.all_gather_headers(&h.encode())?;
        header::settle(&all, local)
    }
}

impl<N: Native> Communicator for Negotiated<N> {
    fn topology(&self) -> Topology {
        self.native.topology()
    }

    fn backend(&self) -> &'static str {
        N::NAME
    }

    fn allreduce_in_place(&mut self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.negotiate(Header::allreduce(data.len(), dtype, op))?;
        self.native.allreduce(data, dtype, op)
    }

    fn allgatherv(&mut self, call: Allgatherv<'_>) -> Result<()> {
        let t = self.topology();
        self.negotiate(Header::allgatherv(&call, t.size, t.rank))?;
        self.native.allgatherv(call)
    }

    fn broadcast(&mut self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        let size = self.topology().size;
        self.negotiate(Header::broadcast(buf.len(), root, size, dtype))?;
        self.native.broadcast(buf, root)
    }

    fn alltoallv(&mut self, call: Alltoallv<'_>) -> Result<()> {
        let size = self.topology().size;
        self.negotiate(Header::alltoallv(&call, size))?;
        self.native.alltoallv(call)
    }

    fn reducescatter(&mut self, call: Reducescatter<'_>) -> Result<()> {
        let t = self.topology();
        self.negotiate(Header::reducescatter(&call, t.size, t.rank))?;
        self.native.reducescatter(call)
    }

    fn barrier(&mut self) -> Result<()> {
        self.negotiate((Header::new(0, Kind::Barrier, DType::U8), None))?;
        self.native.barrier()
    }
}
