//! Adapter from `hvd-collective`'s communicators to the engine's [`Transport`], and joining the job from the
//! environment.

use hvd_collective::{Communicator, DType, ReduceOp, Staged};

use std::time::Duration;

use crate::env_vars;
use crate::transport::{LocalTransport, Topology, Transport, TransportResult};

/// The engine's view of a `hvd-collective` communicator. Counts the engine gives in bytes travel as `u8` elements.
pub struct CollectiveTransport {
    comm: Box<dyn Communicator>,
    name: String,
    /// [`Communicator::in_shared_memory`], asked once.
    shared_memory: bool,
}

impl CollectiveTransport {
    pub fn new(comm: Box<dyn Communicator>) -> CollectiveTransport {
        let name = comm.backend().to_uppercase();
        let shared_memory = comm.in_shared_memory();
        CollectiveTransport {
            comm,
            name,
            shared_memory,
        }
    }
}

impl Transport for CollectiveTransport {
    fn name(&self) -> &str {
        &self.name
    }

    /// Shared memory moves 4 KiB in a few microseconds: copying a 64 KiB tensor into the fusion buffer and out
    /// again already costs about what a collective of its own does (measured with `bench/engine.py`: a fused
    /// 15 MB buffer of 4 KiB..1 MiB tensors spent 6 ms in the two copies and saved nothing in the collective).
    fn fusion_max_tensor_bytes(&self) -> usize {
        if self.shared_memory {
            64 << 10
        } else {
            1 << 20
        }
    }

    fn topology(&self) -> Topology {
        self.comm.topology()
    }

    fn allreduce(&mut self, buf: &mut [u8], d: DType, op: ReduceOp) -> TransportResult<()> {
        self.comm.allreduce_in_place(buf, d, op)
    }

    fn allreduce_staged(
        &mut self,
        len: usize,
        d: DType,
        op: ReduceOp,
        io: &mut dyn Staged,
        scratch: &mut Vec<u8>,
    ) -> TransportResult<()> {
        self.comm.allreduce_staged(len, d, op, io, scratch)
    }

    fn allgatherv(
        &mut self,
        send: &[u8],
        recv_counts: &[usize],
        recv: &mut [u8],
    ) -> TransportResult<()> {
        self.comm.allgatherv(send, recv, recv_counts, DType::U8)
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> TransportResult<()> {
        self.comm.broadcast(buf, DType::U8, root)
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> TransportResult<()> {
        self.comm
            .alltoallv(send, send_counts, recv, recv_counts, DType::U8)
    }

    fn barrier(&mut self) -> TransportResult<()> {
        self.comm.barrier()
    }

    fn reducescatter(
        &mut self,
        buf: &mut [u8],
        block_elems: &[usize],
        out: &mut [u8],
        d: DType,
        op: ReduceOp,
    ) -> TransportResult<()> {
        self.comm.reducescatter(buf, out, block_elems, d, op)
    }
}

/// Variables that mean "this process is one rank of a larger job".
const JOB_VARIABLES: [&str; 4] = [
    env_vars::HVD_SIZE,
    env_vars::OMPI_COMM_WORLD_SIZE,
    env_vars::PMI_SIZE,
    env_vars::SLURM_NTASKS,
];

/// Joins the job described by the environment through `hvd-collective`'s bootstrap (`hvd run`'s rendezvous,
/// mpirun, srun; backend from `HVD_COLLECTIVE_BACKEND`, default auto: shm on one host, tcp or hierarchical across
/// hosts). A process started without any job variables, or with a size of 1, is a job of one rank.
pub fn connect_from_env() -> Result<Box<dyn Transport>, hvd_collective::Error> {
    let size = JOB_VARIABLES
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()));
    match size.as_deref().map(str::trim) {
        None | Some("1") => {
            let t = LocalTransport::group(1, Duration::from_secs(1))
                .pop()
                .ok_or_else(|| hvd_collective::Error::Bootstrap("no local transport".into()))?;
            Ok(Box::new(t))
        }
        Some(_) => {
            let comm = hvd_collective::bootstrap::from_env()?;
            Ok(Box::new(CollectiveTransport::new(comm)))
        }
    }
}

#[cfg(test)]
mod tests {
    use hvd_collective::testing::{Backend, LocalJob};

    use super::*;

    /// The fusion limit follows what the communicator is (shared memory or not), whatever its name says.
    #[test]
    fn only_a_shared_memory_job_gets_the_small_fusion_limit() {
        for (backend, shared, limit) in [
            (Backend::Shm, true, 64 << 10),
            (Backend::Tcp, false, 1 << 20),
            (Backend::Hierarchical, false, 1 << 20),
        ] {
            let comms = LocalJob::new(4, backend).communicators().unwrap();
            for comm in comms {
                assert_eq!(comm.in_shared_memory(), shared, "{backend:?}");
                let t = CollectiveTransport::new(comm);
                assert_eq!(t.fusion_max_tensor_bytes(), limit, "{backend:?}");
            }
        }
    }
}
