//! The `mpi` backend (cargo feature `mpi`): collectives through the system MPI library via the `mpi` crate.
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE` requested, and every MPI call is made from one dedicated thread
//! that this module owns, whatever thread drives the communicator; calls are handed over with a channel and the
//! caller blocks until its call is done (so borrowed buffers outlive their use). Each operation first gathers
//! every rank's header, so mismatched calls fail on every rank like on the other backends. A dead peer is MPI's
//! business: OpenMPI aborts the whole job, which at least never hangs.

use crate::communicator::Communicator;
#[cfg(feature = "mpi")]
use crate::communicator::check;
use crate::error::{Error, Result};

/// Joins the MPI job this process was started in (`mpirun`, `srun --mpi=pmix`).
#[cfg(not(feature = "mpi"))]
pub fn connect() -> Result<Box<dyn Communicator>> {
    Err(Error::Unavailable {
        backend: "mpi",
        reason: "this build has no MPI support; rebuild with `--features mpi` (needs libopenmpi-dev and libclang-dev)"
            .into(),
    })
}

#[cfg(feature = "mpi")]
pub use imp::{MpiCommunicator, connect};

#[cfg(feature = "mpi")]
mod imp {
    use std::sync::mpsc::{Receiver, Sender, channel};
    use std::thread::JoinHandle;

    use mpi::Threading;
    use mpi::collective::SystemOperation;
    use mpi::datatype::{Partition, PartitionMut};
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::{Communicator as _, CommunicatorCollectives as _, Equivalence, Root as _};

    use super::*;
    use crate::communicator::{Allgatherv, Alltoallv, Reducescatter};
    use crate::header::HEADER_LEN;
    use crate::negotiated::{Native, Negotiated};
    use crate::reduce::finish_average;
    use crate::types::{DType, ReduceOp, Topology, host_indices};

    type Job = Box<dyn FnOnce(&SimpleCommunicator) + Send>;

    /// A communicator over `MPI_COMM_WORLD`.
    pub type MpiCommunicator = Negotiated<Mpi>;

    /// `MPI_COMM_WORLD` through the MPI thread: the [`Native`] side of [`MpiCommunicator`].
    pub struct Mpi {
        jobs: Option<Sender<Job>>,
        thread: Option<JoinHandle<()>>,
        topology: Topology,
    }

    /// A raw buffer handed to the MPI thread; the caller blocks until the job is done, so it stays valid.
    #[derive(Clone, Copy)]
    struct Raw(*mut u8, usize);
    // SAFETY: the pointer is only used by the MPI thread while the owning caller waits for it.
    unsafe impl Send for Raw {}
    /// Stands in for empty buffers: an empty Rust slice's dangling address is 1, which MPI reads as
    /// `MPI_IN_PLACE`.
    static SPARE: [u8; 8] = [0; 8];

    impl Raw {
        fn of(b: &[u8]) -> Raw {
            if b.is_empty() {
                return Raw(SPARE.as_ptr().cast_mut(), 0);
            }
            Raw(b.as_ptr().cast_mut(), b.len())
        }
        fn of_mut(b: &mut [u8]) -> Raw {
            if b.is_empty() {
                return Raw(SPARE.as_ptr().cast_mut(), 0);
            }
            Raw(b.as_mut_ptr(), b.len())
        }
        /// # Safety
        /// The buffer must be alive and not used elsewhere while the returned slice is.
        unsafe fn slice<'a>(self) -> &'a mut [u8] {
            // SAFETY: per the contract above; an empty slice over SPARE is never read or written.
            unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
        }
    }

    /// Initialises MPI (threading `Multiple` requested) on a dedicated thread and joins `MPI_COMM_WORLD`.
    pub fn connect() -> Result<Box<dyn Communicator>> {
        Ok(Box::new(MpiCommunicator::new()?))
    }

    impl MpiCommunicator {
        /// See [`connect`].
        pub fn new() -> Result<MpiCommunicator> {
            Mpi::start().map(Negotiated::over)
        }
    }

    impl Mpi {
        fn start() -> Result<Mpi> {
            let (jobs, rx): (Sender<Job>, Receiver<Job>) = channel();
            let (init_tx, init_rx) = channel::<Result<(usize, Vec<String>)>>();
            let hostname = std::env::var(crate::env_vars::HVD_HOSTNAME)
                .ok()
                .filter(|h| !h.is_empty());
            let thread = std::thread::Builder::new()
                .name("hvd-mpi".into())
                .spawn(move || {
                    let Some((universe, threading)) =
                        mpi::initialize_with_threading(Threading::Multiple)
                    else {
                        let _ = init_tx.send(Err(Error::Unavailable {
                            backend: "mpi",
                            reason: "MPI is already initialised in this process".into(),
                        }));
                        return;
                    };
                    tracing::debug!(?threading, "MPI initialised");
                    let world = universe.world();
                    let n = world.size() as usize;
                    let hostname = hostname
                        .or_else(|| mpi::environment::processor_name().ok())
                        .unwrap_or_default();
                    // Host names, fixed 256 bytes each, to derive local and cross ranks.
                    let mut mine = [0u8; 256];
                    let hb = hostname.as_bytes();
                    mine[..hb.len().min(255)].copy_from_slice(&hb[..hb.len().min(255)]);
                    let mut all = vec![0u8; 256 * n];
                    world.all_gather_into(&mine[..], &mut all[..]);
                    let names = all
                        .chunks(256)
                        .map(|c| {
                            String::from_utf8_lossy(
                                &c[..c.iter().position(|b| *b == 0).unwrap_or(256)],
                            )
                            .into_owned()
                        })
                        .collect();
                    let _ = init_tx.send(Ok((world.rank() as usize, names)));
                    while let Ok(job) = rx.recv() {
                        job(&world);
                    }
                    drop(universe);
                })
                .map_err(|e| Error::io("start the MPI thread", e))?;
            let (rank, names) = init_rx.recv().map_err(|_| {
                Error::Bootstrap("the MPI thread died while initialising MPI".into())
            })??;
            Ok(Mpi {
                jobs: Some(jobs),
                thread: Some(thread),
                topology: Topology::from_hosts(rank, &host_indices(&names)),
            })
        }

        /// Runs `f` on the MPI thread and waits for its result.
        fn call<R: Send + 'static>(
            &self,
            f: impl FnOnce(&SimpleCommunicator) -> R + Send + 'static,
        ) -> Result<R> {
            let (tx, rx) = channel();
            let job: Job = Box::new(move |w| {
                let _ = tx.send(f(w));
            });
            self.jobs
                .as_ref()
                .ok_or_else(|| Error::Broken("the MPI thread is gone".into()))?
                .send(job)
                .map_err(|_| Error::Broken("the MPI thread is gone".into()))?;
            rx.recv()
                .map_err(|_| Error::Broken("the MPI thread died during a call".into()))
        }
    }

    impl Drop for Mpi {
        fn drop(&mut self) {
            self.jobs = None;
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    fn system_op(op: ReduceOp) -> SystemOperation {
        match op {
            ReduceOp::Sum | ReduceOp::Average => SystemOperation::sum(),
            ReduceOp::Product => SystemOperation::product(),
            ReduceOp::Min => SystemOperation::min(),
            ReduceOp::Max => SystemOperation::max(),
        }
    }

    /// Reduces `buf` (unaligned bytes of `T`) over all ranks through an aligned copy.
    fn reduce_typed<T: Equivalence + Copy + Default>(
        w: &SimpleCommunicator,
        buf: &mut [u8],
        op: ReduceOp,
    ) {
        let n = buf.len() / size_of::<T>();
        let mut v = vec![T::default(); n];
        let mut out = vec![T::default(); n];
        // SAFETY: `v` has room for `n * size_of::<T>()` bytes, all of which `buf` provides; T is plain data.
        unsafe {
            std::ptr::copy_nonoverlapping(
                buf.as_ptr(),
                v.as_mut_ptr().cast::<u8>(),
                n * size_of::<T>(),
            )
        };
        w.all_reduce_into(&v[..], &mut out[..], system_op(op));
        // SAFETY: as above, in the other direction.
        unsafe {
            std::ptr::copy_nonoverlapping(
                out.as_ptr().cast::<u8>(),
                buf.as_mut_ptr(),
                n * size_of::<T>(),
            )
        };
    }

    /// f16/bf16 have no MPI type: reduce in f32 and round back.
    fn reduce_half(w: &SimpleCommunicator, buf: &mut [u8], dtype: DType, op: ReduceOp) {
        if buf.len() < 2 {
            return;
        }
        let v: Vec<f32> = buf
            .chunks_exact(2)
            .map(|c| match dtype {
                DType::F16 => half::f16::from_ne_bytes([c[0], c[1]]).to_f32(),
                _ => half::bf16::from_ne_bytes([c[0], c[1]]).to_f32(),
            })
            .collect();
        let mut out = vec![0f32; v.len()];
        w.all_reduce_into(&v[..], &mut out[..], system_op(op));
        for (c, x) in buf.chunks_exact_mut(2).zip(out) {
            c.copy_from_slice(&match dtype {
                DType::F16 => half::f16::from_f32(x).to_ne_bytes(),
                _ => half::bf16::from_f32(x).to_ne_bytes(),
            });
        }
    }

    fn reduce_any(w: &SimpleCommunicator, buf: &mut [u8], dtype: DType, op: ReduceOp) {
        match dtype {
            DType::F32 => reduce_typed::<f32>(w, buf, op),
            DType::F64 => reduce_typed::<f64>(w, buf, op),
            DType::I8 => reduce_typed::<i8>(w, buf, op),
            DType::U8 => reduce_typed::<u8>(w, buf, op),
            DType::I32 => reduce_typed::<i32>(w, buf, op),
            DType::I64 => reduce_typed::<i64>(w, buf, op),
            DType::F16 | DType::BF16 => reduce_half(w, buf, dtype, op),
        }
        if op == ReduceOp::Average {
            finish_average(buf, dtype, w.size() as usize);
        }
    }

    fn byte_counts(counts: &[usize], es: usize) -> Result<(Vec<i32>, Vec<i32>)> {
        let too_big = || Error::InvalidArgument {
            op: "mpi",
            detail: "more than 2 GiB in one MPI call".into(),
        };
        let c: Vec<i32> = counts
            .iter()
            .map(|c| i32::try_from(c * es).map_err(|_| too_big()))
            .collect::<Result<_>>()?;
        let mut d = Vec::with_capacity(c.len());
        let mut acc: i64 = 0;
        for x in &c {
            d.push(i32::try_from(acc).map_err(|_| too_big())?);
            acc += i64::from(*x);
        }
        Ok((c, d))
    }

    impl Native for Mpi {
        const NAME: &'static str = "mpi";

        fn topology(&self) -> Topology {
            self.topology
        }

        fn all_gather_headers(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
            let n = self.topology.size;
            let bytes = mine.to_vec();
            self.call(move |w| {
                let mut all = vec![0u8; HEADER_LEN * n];
                w.all_gather_into(&bytes[..], &mut all[..]);
                all
            })
        }

        fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
            let raw = Raw::of_mut(buf);
            // SAFETY: `buf` outlives the call, which blocks until the MPI thread is done with it.
            self.call(move |w| reduce_any(w, unsafe { raw.slice() }, dtype, op))
        }

        fn allgatherv(&mut self, call: Allgatherv<'_>) -> Result<()> {
            let (c, d) = byte_counts(call.counts, call.dtype.size())?;
            let (s, r) = (Raw::of(call.send), Raw::of_mut(call.recv));
            self.call(move |w| {
                // SAFETY: both buffers outlive the blocking call.
                let (s, r) = unsafe { (s.slice(), r.slice()) };
                let mut p = PartitionMut::new(r, &c[..], &d[..]);
                w.all_gather_varcount_into(&s[..], &mut p);
            })
        }

        fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
            let raw = Raw::of_mut(buf);
            self.call(move |w| {
                // SAFETY: the buffer outlives the blocking call.
                let b = unsafe { raw.slice() };
                w.process_at_rank(root as i32).broadcast_into(&mut b[..]);
            })
        }

        fn alltoallv(&mut self, call: Alltoallv<'_>) -> Result<()> {
            let (sc, sd) = byte_counts(call.send_counts, call.dtype.size())?;
            let (rc, rd) = byte_counts(call.recv_counts, call.dtype.size())?;
            let (s, r) = (Raw::of(call.send), Raw::of_mut(call.recv));
            self.call(move |w| {
                // SAFETY: both buffers outlive the blocking call.
                let (s, r) = unsafe { (s.slice(), r.slice()) };
                let sp = Partition::new(&s[..], &sc[..], &sd[..]);
                let mut rp = PartitionMut::new(r, &rc[..], &rd[..]);
                w.all_to_all_varcount_into(&sp, &mut rp);
            })
        }

        fn reducescatter(&mut self, call: Reducescatter<'_>) -> Result<()> {
            let me = self.topology.rank;
            // Uneven blocks: allreduce the whole buffer, keep this rank's block.
            let mut all = call.send.to_vec();
            let raw = Raw::of_mut(&mut all);
            // SAFETY: `all` outlives the blocking call.
            self.call(move |w| reduce_any(w, unsafe { raw.slice() }, call.dtype, call.op))?;
            call.recv
                .copy_from_slice(&all[check::block(call.counts, me, call.dtype.size())]);
            Ok(())
        }

        fn barrier(&mut self) -> Result<()> {
            self.call(|w| w.barrier())
        }
    }
}
