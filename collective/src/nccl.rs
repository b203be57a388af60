//! The `nccl` backend (cargo feature `nccl`): collectives through NCCL, loaded at run time by `cudarc`, so the
//! crate builds on machines without CUDA and this backend answers [`Error::Unavailable`] there.
//!
//! The communicator's buffers are host memory (the [`Communicator`] contract); they are staged through device
//! memory on the rank's GPU (`HVD_LOCAL_RANK` modulo the device count). The NCCL unique id travels through the
//! rendezvous (`nccl.id`, written by rank 0 and read by everyone). Each operation first all-gathers the operation
//! headers, so mismatched calls fail on every rank. Not done: a timeout for a dead peer (NCCL calls block).

use std::time::Duration;

use crate::communicator::Communicator;
#[cfg(feature = "nccl")]
use crate::communicator::check;
use crate::error::{Error, Result};
use crate::job::JobEnv;

/// Joins `job` over NCCL.
#[cfg(not(feature = "nccl"))]
pub fn connect_from_env(_job: &JobEnv, _timeout: Duration) -> Result<Box<dyn Communicator>> {
    Err(Error::Unavailable {
        backend: "nccl",
        reason: "this build has no NCCL support; rebuild with `--features nccl`".into(),
    })
}

#[cfg(feature = "nccl")]
pub use imp::{NcclCommunicator, available, connect_from_env, new_id};

#[cfg(feature = "nccl")]
mod imp {
    use std::sync::Arc;

    use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
    use cudarc::nccl::result as nccl;
    use cudarc::nccl::sys;

    use super::*;
    use crate::communicator::{Allgatherv, Alltoallv, Reducescatter};
    use crate::env_vars;
    use crate::header::HEADER_LEN;
    use crate::negotiated::{Native, Negotiated};
    use crate::reduce::finish_average;
    use crate::types::{DType, ReduceOp, Topology};

    fn unavailable(reason: impl Into<String>) -> Error {
        Error::Unavailable {
            backend: "nccl",
            reason: reason.into(),
        }
    }

    fn nccl_err(what: &str, e: impl std::fmt::Debug) -> Error {
        Error::Broken(format!("NCCL {what} failed: {e:?}"))
    }

    /// Checks that the CUDA driver, NCCL and a GPU are present, and returns the number of GPUs.
    pub fn available() -> Result<usize> {
        // SAFETY: only tries to load the shared library; no CUDA call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(unavailable(
                "no CUDA driver library (libcuda.so) on this machine",
            ));
        }
        // SAFETY: as above, for libnccl.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(unavailable(
                "no NCCL library (libnccl.so) on this machine; install NCCL",
            ));
        }
        let n = CudaContext::device_count()
            .map_err(|e| unavailable(format!("CUDA cannot count devices: {e:?}")))?;
        if n <= 0 {
            return Err(unavailable("the CUDA driver sees no GPU"));
        }
        Ok(n as usize)
    }

    /// A communicator over NCCL on one GPU.
    pub type NcclCommunicator = Negotiated<Nccl>;

    /// One GPU's NCCL communicator and stream: the [`Native`] side of [`NcclCommunicator`].
    pub struct Nccl {
        comm: sys::ncclComm_t,
        stream: Arc<CudaStream>,
        topology: Topology,
    }

    // SAFETY: the NCCL communicator handle may be used from any thread, one at a time (`&mut self`).
    unsafe impl Send for Nccl {}

    fn env_num(name: &str) -> Option<usize> {
        std::env::var(name).ok()?.trim().parse().ok()
    }

    /// Joins `job` over NCCL: rank 0 makes the unique id and shares it through the rendezvous.
    pub fn connect_from_env(job: &JobEnv, timeout: Duration) -> Result<Box<dyn Communicator>> {
        let devices = available()?;
        let id: [u8; 128] = match (&job.rendezvous, job.size) {
            (Some(rv), _) => {
                let kv = rv.client(job.rank).next_round();
                if job.rank == 0 {
                    kv.put("nccl.id", &new_id()?)?;
                }
                let v = kv.get("nccl.id", timeout)?;
                v.try_into().map_err(|_| {
                    Error::Bootstrap("the NCCL id at the rendezvous is not 128 bytes".into())
                })?
            }
            (None, 1) => new_id()?,
            (None, _) => {
                return Err(Error::Bootstrap(format!(
                    "the nccl backend needs `{}` to share its id between {} ranks",
                    env_vars::HVD_RENDEZVOUS,
                    job.size
                )));
            }
        };
        let topology = Topology {
            rank: job.rank,
            size: job.size,
            local_rank: env_num(env_vars::HVD_LOCAL_RANK).unwrap_or(job.rank),
            local_size: env_num(env_vars::HVD_LOCAL_SIZE).unwrap_or(job.size),
            cross_rank: env_num(env_vars::HVD_CROSS_RANK).unwrap_or(0),
            cross_size: env_num(env_vars::HVD_CROSS_SIZE).unwrap_or(1),
        };
        Ok(Box::new(NcclCommunicator::new(
            topology,
            topology.local_rank % devices,
            id,
        )?))
    }

    /// A fresh NCCL unique id as bytes.
    pub fn new_id() -> Result<[u8; 128]> {
        available()?;
        let id = nccl::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        Ok(id.internal.map(|c| c as u8))
    }

    fn nccl_type(d: DType) -> sys::ncclDataType_t {
        use sys::ncclDataType_t as T;
        match d {
            DType::F16 => T::ncclFloat16,
            DType::BF16 => T::ncclBfloat16,
            DType::F32 => T::ncclFloat32,
            DType::F64 => T::ncclFloat64,
            DType::I8 => T::ncclInt8,
            DType::U8 => T::ncclUint8,
            DType::I32 => T::ncclInt32,
            DType::I64 => T::ncclInt64,
        }
    }

    fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
        use sys::ncclRedOp_t as O;
        match op {
            ReduceOp::Sum | ReduceOp::Average => O::ncclSum,
            ReduceOp::Product => O::ncclProd,
            ReduceOp::Min => O::ncclMin,
            ReduceOp::Max => O::ncclMax,
        }
    }

    impl NcclCommunicator {
        /// Joins the NCCL clique named by `id` on GPU `device`.
        pub fn new(topology: Topology, device: usize, id: [u8; 128]) -> Result<NcclCommunicator> {
            Nccl::start(topology, device, id).map(Negotiated::over)
        }
    }

    impl Nccl {
        fn start(topology: Topology, device: usize, id: [u8; 128]) -> Result<Nccl> {
            available()?;
            let ctx = CudaContext::new(device)
                .map_err(|e| unavailable(format!("open GPU {device}: {e:?}")))?;
            let stream = ctx.default_stream();
            let id = sys::ncclUniqueId {
                internal: id.map(|b| b as ::core::ffi::c_char),
            };
            let mut comm = std::mem::MaybeUninit::uninit();
            // SAFETY: `comm` is a valid out pointer; rank and size are checked by NCCL.
            unsafe {
                nccl::comm_init_rank(
                    comm.as_mut_ptr(),
                    topology.size as i32,
                    id,
                    topology.rank as i32,
                )
            }
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
            // SAFETY: initialised by the successful call above.
            let comm = unsafe { comm.assume_init() };
            Ok(Nccl {
                comm,
                stream,
                topology,
            })
        }

        fn up(&self, bytes: &[u8]) -> Result<CudaSlice<u8>> {
            let len = bytes.len().max(1);
            let mut d = self
                .stream
                .alloc_zeros::<u8>(len)
                .map_err(|e| nccl_err("cudaMalloc", e))?;
            if !bytes.is_empty() {
                self.stream
                    .memcpy_htod(bytes, &mut d)
                    .map_err(|e| nccl_err("copy to the GPU", e))?;
            }
            Ok(d)
        }

        fn down(&self, d: &CudaSlice<u8>, out: &mut [u8]) -> Result<()> {
            if out.is_empty() {
                return Ok(());
            }
            let mut tmp = vec![0u8; d.len()];
            self.stream
                .memcpy_dtoh(d, &mut tmp)
                .map_err(|e| nccl_err("copy from the GPU", e))?;
            out.copy_from_slice(&tmp[..out.len()]);
            Ok(())
        }

        fn raw_stream(&self) -> sys::cudaStream_t {
            self.stream.cu_stream() as _
        }

        /// Every rank's `mine` (`HEADER_LEN` bytes), in rank order.
        fn all_gather_header_bytes(&self, mine: &[u8]) -> Result<Vec<u8>> {
            let n = self.topology.size;
            let send = self.up(mine)?;
            let mut recv = self
                .stream
                .alloc_zeros::<u8>(HEADER_LEN * n)
                .map_err(|e| nccl_err("cudaMalloc", e))?;
            {
                let (s, _a) = send.device_ptr(&self.stream);
                let (r, _b) = recv.device_ptr_mut(&self.stream);
                // SAFETY: device buffers of the stated sizes, used on this communicator's stream.
                unsafe {
                    nccl::all_gather(
                        s as _,
                        r as _,
                        HEADER_LEN,
                        nccl_type(DType::U8),
                        self.comm,
                        self.raw_stream(),
                    )
                }
                .map_err(|e| nccl_err("ncclAllGather", e))?;
            }
            let mut all = vec![0u8; HEADER_LEN * n];
            self.down(&recv, &mut all)?;
            Ok(all)
        }

        fn reduce_device(
            &self,
            d: &mut CudaSlice<u8>,
            count: usize,
            dtype: DType,
            op: ReduceOp,
        ) -> Result<()> {
            let (p, _s) = d.device_ptr_mut(&self.stream);
            // SAFETY: in-place allreduce of `count` elements inside the device buffer.
            unsafe {
                nccl::all_reduce(
                    p as _,
                    p as _,
                    count,
                    nccl_type(dtype),
                    nccl_op(op),
                    self.comm,
                    self.raw_stream(),
                )
            }
            .map(|_| ())
            .map_err(|e| nccl_err("ncclAllReduce", e))
        }
    }

    impl Drop for Nccl {
        fn drop(&mut self) {
            // SAFETY: the handle came from ncclCommInitRank and is destroyed once.
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }

    impl Native for Nccl {
        const NAME: &'static str = "nccl";

        fn topology(&self) -> Topology {
            self.topology
        }

        fn all_gather_headers(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
            self.all_gather_header_bytes(mine)
        }

        fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
            let mut d = self.up(buf)?;
            self.reduce_device(&mut d, buf.len() / dtype.size(), dtype, op)?;
            self.down(&d, buf)?;
            if op == ReduceOp::Average {
                finish_average(buf, dtype, self.topology.size);
            }
            Ok(())
        }

        fn allgatherv(&mut self, call: Allgatherv<'_>) -> Result<()> {
            let (me, es) = (self.topology.rank, call.dtype.size());
            // NCCL has no allgatherv: one broadcast per rank into its block, grouped.
            call.recv[check::block(call.counts, me, es)].copy_from_slice(call.send);
            let mut d = self.up(call.recv)?;
            {
                let (base, _s) = d.device_ptr_mut(&self.stream);
                nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
                let mut at = 0u64;
                for (r, c) in call.counts.iter().enumerate() {
                    let p = base + at;
                    // SAFETY: each block lies inside the device buffer.
                    unsafe {
                        nccl::broadcast(
                            p as _,
                            p as _,
                            c * es,
                            nccl_type(DType::U8),
                            r as i32,
                            self.comm,
                            self.raw_stream(),
                        )
                    }
                    .map_err(|e| nccl_err("ncclBroadcast", e))?;
                    at += (c * es) as u64;
                }
                nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
            }
            self.down(&d, call.recv)
        }

        fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
            let mut d = self.up(buf)?;
            {
                let (p, _s) = d.device_ptr_mut(&self.stream);
                // SAFETY: in-place broadcast inside the device buffer.
                unsafe {
                    nccl::broadcast(
                        p as _,
                        p as _,
                        buf.len(),
                        nccl_type(DType::U8),
                        root as i32,
                        self.comm,
                        self.raw_stream(),
                    )
                }
                .map_err(|e| nccl_err("ncclBroadcast", e))?;
            }
            self.down(&d, buf)
        }

        fn alltoallv(&mut self, call: Alltoallv<'_>) -> Result<()> {
            let (n, es) = (self.topology.size, call.dtype.size());
            let ds = self.up(call.send)?;
            let mut dr = self.up(call.recv)?;
            {
                let (sp, _a) = ds.device_ptr(&self.stream);
                let (rp, _b) = dr.device_ptr_mut(&self.stream);
                nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
                let (mut so, mut ro) = (0u64, 0u64);
                for j in 0..n {
                    // SAFETY: blocks lie inside the device buffers.
                    unsafe {
                        nccl::send(
                            (sp + so) as _,
                            call.send_counts[j] * es,
                            nccl_type(DType::U8),
                            j as i32,
                            self.comm,
                            self.raw_stream(),
                        )
                        .map_err(|e| nccl_err("ncclSend", e))?;
                        nccl::recv(
                            (rp + ro) as _,
                            call.recv_counts[j] * es,
                            nccl_type(DType::U8),
                            j as i32,
                            self.comm,
                            self.raw_stream(),
                        )
                        .map_err(|e| nccl_err("ncclRecv", e))?;
                    }
                    so += (call.send_counts[j] * es) as u64;
                    ro += (call.recv_counts[j] * es) as u64;
                }
                nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
            }
            self.down(&dr, call.recv)
        }

        fn reducescatter(&mut self, call: Reducescatter<'_>) -> Result<()> {
            let (n, me, es) = (self.topology.size, self.topology.rank, call.dtype.size());
            // Blocks may differ in size: allreduce everything and keep this rank's block.
            let mut d = self.up(call.send)?;
            self.reduce_device(&mut d, call.send.len() / es, call.dtype, call.op)?;
            let mut all = vec![0u8; call.send.len()];
            self.down(&d, &mut all)?;
            call.recv
                .copy_from_slice(&all[check::block(call.counts, me, es)]);
            if call.op == ReduceOp::Average {
                finish_average(call.recv, call.dtype, n);
            }
            Ok(())
        }

        fn barrier(&mut self) -> Result<()> {
            // The header all-gather before it completes only when every rank has joined it.
            self.stream
                .synchronize()
                .map_err(|e| nccl_err("synchronize", e))
        }
    }
}
