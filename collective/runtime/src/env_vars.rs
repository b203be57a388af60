//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! Each `HVD_X` engine setting also accepts Horovod's spelling `HOROVOD_X` ([`HOROVOD_PREFIX`]), so existing launch
//! scripts keep working. The job itself (rank, size, rendezvous, backend) is read by `hvd-collective`'s bootstrap,
//! whose registry lists those variables. The rows marked "python package" are read by `collective/python/hvd`.

hvd_env_vars::env_vars! {
    /// Fusion buffer size in bytes; 0 disables fusion.
    HVD_FUSION_THRESHOLD default "134217728";
    /// Milliseconds between engine cycles (at most a day); a blocking wait starts a cycle at once.
    HVD_CYCLE_TIME default "1";
    /// Response cache entries; 0 disables the cached fast path.
    HVD_CACHE_CAPACITY default "1024";
    /// Seconds before the stall inspector warns, at most 86400 (a day); 0 disables it.
    HVD_STALL_CHECK_TIME default "60";
    /// Seconds after which a stalled tensor stops the job with an error, at most 86400 (default: never).
    HVD_STALL_SHUTDOWN_TIME;
    /// Path of a Chrome-trace JSON timeline written by rank 0 (`{rank}` in the path: one file per rank); `DYNAMIC`
    /// (Horovod's value): none until `start_timeline`.
    HVD_TIMELINE;
    /// Mark engine cycles that did work in the timeline; `0`, `false` or `no`: off.
    HVD_TIMELINE_MARK_CYCLES default "1";
    /// Microseconds a waiter (and the engine after a busy cycle) polls before sleeping.
    HVD_SPIN_TIME default "0";
    /// Level of the runtime's stderr log when loaded through the C ABI.
    HVD_LOG_LEVEL default "warn";
    /// Horovod's spelling of every engine setting above: `HOROVOD_X` is read when `HVD_X` is unset or empty.
    HOROVOD_PREFIX = "HOROVOD_";
    /// Whether this process is one rank of a larger job: the first of these set gives the size (none, or 1: a job of
    /// one rank). hvd's size.
    HVD_SIZE;
    /// OpenMPI's size (see [`HVD_SIZE`]).
    OMPI_COMM_WORLD_SIZE;
    /// MPICH/Hydra's size (see [`HVD_SIZE`]).
    PMI_SIZE;
    /// Slurm's size (see [`HVD_SIZE`]).
    SLURM_NTASKS;
    /// Python package: the `libhvd_runtime.so` to load, before the one inside the package.
    HVD_LIBRARY;
    /// Python package: a cargo target directory searched (before the `target/` directories above the package) for a
    /// development build of the library.
    CARGO_TARGET_DIR;
    /// Python package: re-forms in a row without a `commit()` that `hvd.elastic.run` allows before it raises
    /// (0: no limit; Horovod's `--reset-limit`).
    HVD_ELASTIC_RESET_LIMIT default "10";
    /// Python package: Horovod's rank, which `horovod.runner.common.util.env.get_env_rank_and_size` reads (after
    /// `HVD_RANK`) before `init`, as Horovod's process-set test suites do.
    HOROVOD_RANK;
    /// Python package: Horovod's size, read with `HOROVOD_RANK`.
    HOROVOD_SIZE;
    /// Python package: seconds a worker of an elastic step has, after a SIGTERM, to reach its next `commit()` and
    /// hand over (leave the job cleanly); past it the worker ends with code 143, a lost worker.
    HVD_PREEMPT_GRACE default "30";
    /// Python package: the directory `hvd.elastic`'s `state.checkpoint()` writes to and `load_checkpoint()` (and
    /// `run`) resume from (set by `hvd run` for a step with `checkpoints`).
    HVD_CHECKPOINT_DIR;
    /// Python package: the file rank 0 writes `commit N` into when `hvd.elastic.run` resumed from a checkpoint (set
    /// by `hvd run`, which reports it).
    HVD_CHECKPOINT_REPORT;
    /// Python package: `1` (set by `hvd run` where rank 0 surely reaches its rendezvous): `hvd.elastic.run` puts the
    /// resume report at the rendezvous before the file; otherwise only the file.
    HVD_CHECKPOINT_REPORT_RENDEZVOUS;
    /// Python package: the endpoint of the S3-compatible server of `s3://` checkpoints, before `AWS_ENDPOINT_URL`.
    HVD_S3_ENDPOINT;
    /// Python package: the endpoint of `s3://` checkpoints when `HVD_S3_ENDPOINT` is unset (else AWS's).
    AWS_ENDPOINT_URL;
    /// Python package: the access key that signs `s3://` checkpoint requests (unsigned without it).
    AWS_ACCESS_KEY_ID;
    /// Python package: the secret of `AWS_ACCESS_KEY_ID`.
    AWS_SECRET_ACCESS_KEY;
    /// Python package: a session token for temporary `s3://` credentials.
    AWS_SESSION_TOKEN;
    /// Python package: TensorFlow's inter-op thread count. Unset, the `tf.compat.v1` sessions made after `import
    /// hvd.tensorflow` get at least 64 (the CPU count when larger), so that collectives of one graph never wait on
    /// each other for a thread, and eager execution keeps TensorFlow's default; set, it holds for both
    /// (docs/horovod.md).
    TF_NUM_INTEROP_THREADS;
    /// Python package: the region `s3://` checkpoint requests are signed for.
    AWS_REGION default "us-east-1";
    /// Python package: the region when `AWS_REGION` is unset.
    AWS_DEFAULT_REGION;
}
