//! Joining the job from the environment: a communicator from `hvd-collective`'s bootstrap, or a job of one rank.

use std::time::Duration;

use hvd_collective::Communicator;

use crate::env_vars;
use crate::transport::LocalTransport;

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
pub fn connect_from_env() -> Result<Box<dyn Communicator>, hvd_collective::Error> {
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
        Some(_) => hvd_collective::bootstrap::from_env(),
    }
}

#[cfg(test)]
mod tests {
    use hvd_collective::testing::{Backend, LocalJob};

    use crate::transport::fusion_max_tensor_bytes;

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
                assert_eq!(fusion_max_tensor_bytes(&*comm), limit, "{backend:?}");
            }
        }
    }
}
