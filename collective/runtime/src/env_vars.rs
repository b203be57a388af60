//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! Each `HVD_X` engine setting also accepts Horovod's spelling `HOROVOD_X` ([`HOROVOD_PREFIX`]), so existing launch
//! scripts keep working. The job itself (rank, size, rendezvous, backend) is read by `hvd-collective`'s bootstrap,
//! whose registry lists those variables. The rows marked "python package" are read by `collective/python/hvd`.

/// Fusion buffer size in bytes; 0 disables fusion (default 134217728).
pub const HVD_FUSION_THRESHOLD: &str = "HVD_FUSION_THRESHOLD";
/// Milliseconds between engine cycles; a blocking wait starts a cycle at once (default 1).
pub const HVD_CYCLE_TIME: &str = "HVD_CYCLE_TIME";
/// Response cache entries; 0 disables the cached fast path (default 1024).
pub const HVD_CACHE_CAPACITY: &str = "HVD_CACHE_CAPACITY";
/// Seconds before the stall inspector warns; 0 disables it (default 60).
pub const HVD_STALL_CHECK_TIME: &str = "HVD_STALL_CHECK_TIME";
/// Seconds after which a stalled tensor stops the job with an error (default: never).
pub const HVD_STALL_SHUTDOWN_TIME: &str = "HVD_STALL_SHUTDOWN_TIME";
/// Path of a Chrome-trace JSON timeline written by rank 0 (`{rank}` in the path: one file per rank).
pub const HVD_TIMELINE: &str = "HVD_TIMELINE";
/// Mark engine cycles that did work in the timeline; `0`, `false` or `no`: off (default 1).
pub const HVD_TIMELINE_MARK_CYCLES: &str = "HVD_TIMELINE_MARK_CYCLES";
/// Microseconds a waiter (and the engine after a busy cycle) polls before sleeping (default 0).
pub const HVD_SPIN_TIME: &str = "HVD_SPIN_TIME";
/// Level of the runtime's stderr log when loaded through the C ABI (default `warn`).
pub const HVD_LOG_LEVEL: &str = "HVD_LOG_LEVEL";
/// Horovod's spelling of every engine setting above: `HOROVOD_X` is read when `HVD_X` is unset or empty.
pub const HOROVOD_PREFIX: &str = "HOROVOD_";
/// Whether this process is one rank of a larger job: the first of these set gives the size (none, or 1: a job of
/// one rank). hvd's size.
pub const HVD_SIZE: &str = "HVD_SIZE";
/// OpenMPI's size (see [`HVD_SIZE`]).
pub const OMPI_COMM_WORLD_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
/// MPICH/Hydra's size (see [`HVD_SIZE`]).
pub const PMI_SIZE: &str = "PMI_SIZE";
/// Slurm's size (see [`HVD_SIZE`]).
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
/// Python package: the `libhvd_runtime.so` to load, before the one inside the package.
pub const HVD_LIBRARY: &str = "HVD_LIBRARY";
/// Python package: a cargo target directory searched (before the `target/` directories above the package) for a
/// development build of the library.
pub const CARGO_TARGET_DIR: &str = "CARGO_TARGET_DIR";

/// `(name, default or "" when unset means none/off, one-line meaning)` for every constant above.
pub const ALL: &[(&str, &str, &str)] = &[
    (
        HVD_FUSION_THRESHOLD,
        "134217728",
        "fusion buffer size in bytes; 0 disables fusion",
    ),
    (
        HVD_CYCLE_TIME,
        "1",
        "milliseconds between engine cycles (a blocking wait starts a cycle at once)",
    ),
    (
        HVD_CACHE_CAPACITY,
        "1024",
        "response cache entries; 0 disables the cached fast path",
    ),
    (
        HVD_STALL_CHECK_TIME,
        "60",
        "seconds before the stall inspector warns; 0 disables it",
    ),
    (
        HVD_STALL_SHUTDOWN_TIME,
        "",
        "seconds after which a stalled tensor stops the job with an error",
    ),
    (
        HVD_TIMELINE,
        "",
        "path of a Chrome-trace timeline written by rank 0 (`{rank}` in it: one file per rank)",
    ),
    (
        HVD_TIMELINE_MARK_CYCLES,
        "1",
        "mark engine cycles that did work in the timeline (`0`: off)",
    ),
    (
        HVD_SPIN_TIME,
        "0",
        "microseconds a waiter (and the engine after a busy cycle) polls before sleeping",
    ),
    (
        HVD_LOG_LEVEL,
        "warn",
        "level of the runtime's stderr log when loaded through the C ABI",
    ),
    (
        HOROVOD_PREFIX,
        "",
        "Horovod's spelling of each setting above, read when the `HVD_` one is unset or empty",
    ),
    (
        HVD_SIZE,
        "",
        "job size: the first of these four set decides whether this is one rank of a larger job",
    ),
    (OMPI_COMM_WORLD_SIZE, "", "job size under OpenMPI"),
    (PMI_SIZE, "", "job size under MPICH/Hydra"),
    (SLURM_NTASKS, "", "job size under srun"),
    (
        HVD_LIBRARY,
        "",
        "python package: the `libhvd_runtime.so` to load, before the one inside the package",
    ),
    (
        CARGO_TARGET_DIR,
        "",
        "python package: a cargo target directory searched for a development build of the library",
    ),
];
