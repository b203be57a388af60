//! Adapter from `hvd-collective`'s communicators to the engine's [`Transport`], and joining the job from the
//! environment.

use crate::transport::{LocalTransport, Transport};

/// Variables that mean "this process is one rank of a larger job".
const JOB_VARIABLES: [&str; 4] = [
    "HVD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "SLURM_NTASKS",
];

/// Joins the job described by the environment; a process started without any job variables (or with size 1) is a
/// job of one rank.
pub fn connect_from_env() -> Result<Box<dyn Transport>, String> {
    let size = JOB_VARIABLES
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()));
    match size.as_deref().map(str::trim) {
        None | Some("1") => {
            let t = LocalTransport::group(1, std::time::Duration::from_secs(1)).pop().ok_or("no transport")?;
            Ok(Box::new(t))
        }
        Some(_) => Err("joining a multi-rank job needs the bootstrap of `hvd-collective`, which is not built yet".into()),
    }
}
