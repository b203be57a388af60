//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! Most are set for the workers (docs/running.md says which engine sets what, and in which order); the rows marked
//! "spark driver" are read or set by `engines/spark_driver.py`. The launchers' rank variables the shim reads are
//! `hvd-collective`'s (its `env_vars` and [`hvd_collective::launch_env`]).

/// `off`: no cgroups, the subreaper fallback alone; empty or `auto` (the default): a cgroup per run where the
/// machine allows it; anything else is an error naming the variable.
pub const HVD_CGROUPS: &str = "HVD_CGROUPS";
/// Searched for the engines' programs (mpirun, srun, sbatch, spark-submit, kubectl); set for workers with an env
/// (its `bin` first) and passed on by the engines that start ranks themselves.
pub const PATH: &str = "PATH";
/// Set for workers with an env: the env's directory.
pub const VIRTUAL_ENV: &str = "VIRTUAL_ENV";
/// Set for workers to `1`.
pub const PYTHONUNBUFFERED: &str = "PYTHONUNBUFFERED";
/// Set for workers to the CPUs divided by the local workers (at least 1), unless already set.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";
/// Set for workers with `resources.gpus = g`: devices `local_rank*g .. local_rank*g+g-1`.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// `resources.gpus` handed to the shim, which sets `CUDA_VISIBLE_DEVICES` from the local rank (default 0).
pub const HVD_GPUS_PER_WORKER: &str = "HVD_GPUS_PER_WORKER";
/// Set for every worker (`<run id>/<step>/<n>`): finds the processes a step started after they left its process
/// groups.
pub const HVD_RUN_STEP: &str = "HVD_RUN_STEP";
/// Set for every worker: how many times its step has been started again after a rank failed (`0` on the first
/// attempt; `restarts` / `--max-restarts`).
pub const HVD_RESTART_COUNT: &str = "HVD_RESTART_COUNT";
/// torchrun's name for `HVD_RESTART_COUNT`, set with it.
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// Set for workers with `--timeline FILE`: the runtime's timeline.
pub const HVD_TIMELINE: &str = "HVD_TIMELINE";
/// Horovod's spelling of `HVD_TIMELINE`, set with it.
pub const HOROVOD_TIMELINE: &str = "HOROVOD_TIMELINE";
/// `1`: rank 0's shim serves the rendezvous itself on `HVD_RENDEZVOUS`'s port (a Kubernetes JobSet).
pub const HVD_RENDEZVOUS_SERVE: &str = "HVD_RENDEZVOUS_SERVE";
/// Seconds the shim waits for `HVD_RENDEZVOUS` to resolve and accept connections (default 300 when rank 0 serves
/// it, else 0).
pub const HVD_RENDEZVOUS_WAIT: &str = "HVD_RENDEZVOUS_WAIT";
/// The pod's own IP (set from `status.podIP` by the manifests of `hvd export k8s`): where rank 0's shim serves.
pub const HVD_POD_IP: &str = "HVD_POD_IP";
/// Set by the spark driver for each task: its executor's host, read first by the shim.
pub const HVD_SPARK_HOST: &str = "HVD_SPARK_HOST";
/// Read by the shim for the host name after `HVD_HOSTNAME`.
pub const SLURMD_NODENAME: &str = "SLURMD_NODENAME";
/// Read by the shim for the host name after `SLURMD_NODENAME` (else the kernel's).
pub const HOSTNAME: &str = "HOSTNAME";
/// Set for workers: Horovod's rank.
pub const HOROVOD_RANK: &str = "HOROVOD_RANK";
/// Set for workers: Horovod's size.
pub const HOROVOD_SIZE: &str = "HOROVOD_SIZE";
/// Set for workers: Horovod's local rank.
pub const HOROVOD_LOCAL_RANK: &str = "HOROVOD_LOCAL_RANK";
/// Set for workers: Horovod's local size.
pub const HOROVOD_LOCAL_SIZE: &str = "HOROVOD_LOCAL_SIZE";
/// Set for workers: Horovod's cross rank.
pub const HOROVOD_CROSS_RANK: &str = "HOROVOD_CROSS_RANK";
/// Set for workers: Horovod's cross size.
pub const HOROVOD_CROSS_SIZE: &str = "HOROVOD_CROSS_SIZE";
/// Set for workers: Horovod's host name.
pub const HOROVOD_HOSTNAME: &str = "HOROVOD_HOSTNAME";
/// Set for workers: torch's rank.
pub const RANK: &str = "RANK";
/// Set for workers: torch's size.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Set for workers: torch's local rank.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Set for workers: torch's local size.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Set for workers: the rendezvous's address, for Horovod's gloo controller.
pub const HOROVOD_GLOO_RENDEZVOUS_ADDR: &str = "HOROVOD_GLOO_RENDEZVOUS_ADDR";
/// Set for workers: the rendezvous's port, for Horovod's gloo controller.
pub const HOROVOD_GLOO_RENDEZVOUS_PORT: &str = "HOROVOD_GLOO_RENDEZVOUS_PORT";
/// Set for workers to `gloo`.
pub const HOROVOD_CONTROLLER: &str = "HOROVOD_CONTROLLER";
/// Set for workers to `gloo`.
pub const HOROVOD_CPU_OPERATIONS: &str = "HOROVOD_CPU_OPERATIONS";
/// Set for workers to `lo` (ssh: the interface that reaches the launcher).
pub const HOROVOD_GLOO_IFACE: &str = "HOROVOD_GLOO_IFACE";
/// Set for workers to `lo` (ssh: the interface that reaches the launcher).
pub const NCCL_SOCKET_IFNAME: &str = "NCCL_SOCKET_IFNAME";
/// Set for ssh workers: the interface that reaches the launcher.
pub const GLOO_SOCKET_IFNAME: &str = "GLOO_SOCKET_IFNAME";
/// Set for ssh workers: the interface that reaches the launcher.
pub const HVD_NETWORK_INTERFACE: &str = "HVD_NETWORK_INTERFACE";
/// Set for workers: torch's `env://` address (rank 0's host).
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Set for workers: torch's `env://` port (a free port, not the rendezvous port).
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Read to tell whether hvd runs inside a Slurm allocation; read by the batch scripts of sbatch.
pub const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
/// Read by the batch scripts of sbatch: the allocation's nodes (the first is `MASTER_ADDR`).
pub const SLURM_JOB_NODELIST: &str = "SLURM_JOB_NODELIST";
/// Set to `1` for the `mpirun` of `hvd doctor`, which may run as root in a container.
pub const OMPI_ALLOW_RUN_AS_ROOT: &str = "OMPI_ALLOW_RUN_AS_ROOT";
/// Set to `1` with `OMPI_ALLOW_RUN_AS_ROOT`.
pub const OMPI_ALLOW_RUN_AS_ROOT_CONFIRM: &str = "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM";
/// Spark driver: a Java installation (else `java` on `PATH`).
pub const JAVA_HOME: &str = "JAVA_HOME";
/// Spark driver: set to a directory under the run's state that links pyspark's `bin` and `jars`.
pub const SPARK_HOME: &str = "SPARK_HOME";
/// Spark driver: set, unless already set, to the driver's interpreter.
pub const PYSPARK_PYTHON: &str = "PYSPARK_PYTHON";
/// Spark driver: set, unless already set, to the driver's interpreter.
pub const PYSPARK_DRIVER_PYTHON: &str = "PYSPARK_DRIVER_PYTHON";
/// Spark driver: set, unless already set, to `127.0.0.1` for a local cluster.
pub const SPARK_LOCAL_IP: &str = "SPARK_LOCAL_IP";

/// Set for workers (and read by the shim): the collective's own variables, declared once in its registry and
/// documented in its table: the rendezvous and token, the rank variables, the host name, the tcp interface (ssh),
/// and the spark driver's per-task `HVD_SPARK_*`.
pub use hvd_collective::env_vars::{
    HVD_CROSS_RANK, HVD_CROSS_SIZE, HVD_HOSTNAME, HVD_JOB_TOKEN, HVD_LOCAL_RANK, HVD_LOCAL_SIZE,
    HVD_RANK, HVD_RENDEZVOUS, HVD_SIZE, HVD_SPARK_CROSS_RANK, HVD_SPARK_CROSS_SIZE,
    HVD_SPARK_LOCAL_RANK, HVD_SPARK_LOCAL_SIZE, HVD_SPARK_RANK, HVD_SPARK_SIZE, HVD_TCP_INTERFACE,
};

/// `(name, default or "" when unset means none/off, one-line meaning)` for every constant above.
pub const ALL: &[(&str, &str, &str)] = &[
    (
        HVD_CGROUPS,
        "auto",
        "`off`: no cgroups, the subreaper fallback alone; `auto`: a cgroup per run where allowed",
    ),
    (
        PATH,
        "",
        "searched for the engines' programs; set for workers with an env (its `bin` first)",
    ),
    (
        VIRTUAL_ENV,
        "",
        "set for workers with an env: its directory",
    ),
    (PYTHONUNBUFFERED, "1", "set for workers"),
    (
        OMP_NUM_THREADS,
        "",
        "set for workers to CPUs / local workers (at least 1), unless already set",
    ),
    (
        CUDA_VISIBLE_DEVICES,
        "",
        "set for workers with `resources.gpus = g`: devices `local_rank*g ..` (g of them)",
    ),
    (
        HVD_GPUS_PER_WORKER,
        "0",
        "`resources.gpus`, handed to the shim, which sets `CUDA_VISIBLE_DEVICES`",
    ),
    (
        HVD_RUN_STEP,
        "",
        "set for every worker (`<run id>/<step>/<n>`): finds a step's escaped processes",
    ),
    (
        HVD_RESTART_COUNT,
        "0",
        "set for every worker: how many times its step was started again after a rank failed",
    ),
    (
        TORCHELASTIC_RESTART_COUNT,
        "0",
        "set for every worker: torchrun's name for `HVD_RESTART_COUNT`",
    ),
    (HVD_TIMELINE, "", "set for workers with `--timeline FILE`"),
    (
        HOROVOD_TIMELINE,
        "",
        "set for workers with `--timeline FILE`",
    ),
    (
        HVD_RENDEZVOUS_SERVE,
        "",
        "`1`: rank 0's shim serves the rendezvous itself (a Kubernetes JobSet)",
    ),
    (
        HVD_RENDEZVOUS_WAIT,
        "",
        "seconds the shim waits for the rendezvous (300 when rank 0 serves it, else 0)",
    ),
    (
        HVD_POD_IP,
        "",
        "the pod's own IP (from `status.podIP`): where rank 0's shim serves the rendezvous",
    ),
    (
        HVD_SPARK_HOST,
        "",
        "set by the spark driver per task: its host, read first by the shim",
    ),
    (
        SLURMD_NODENAME,
        "",
        "read by the shim for the host name, after `HVD_HOSTNAME`",
    ),
    (
        HOSTNAME,
        "",
        "read by the shim for the host name, after `SLURMD_NODENAME` (else the kernel's)",
    ),
    (HOROVOD_RANK, "", "set for workers: Horovod's rank"),
    (HOROVOD_SIZE, "", "set for workers: Horovod's size"),
    (
        HOROVOD_LOCAL_RANK,
        "",
        "set for workers: Horovod's local rank",
    ),
    (
        HOROVOD_LOCAL_SIZE,
        "",
        "set for workers: Horovod's local size",
    ),
    (
        HOROVOD_CROSS_RANK,
        "",
        "set for workers: Horovod's cross rank",
    ),
    (
        HOROVOD_CROSS_SIZE,
        "",
        "set for workers: Horovod's cross size",
    ),
    (HOROVOD_HOSTNAME, "", "set for workers: Horovod's host name"),
    (RANK, "", "set for workers: torch's rank"),
    (WORLD_SIZE, "", "set for workers: torch's size"),
    (LOCAL_RANK, "", "set for workers: torch's local rank"),
    (LOCAL_WORLD_SIZE, "", "set for workers: torch's local size"),
    (
        HOROVOD_GLOO_RENDEZVOUS_ADDR,
        "",
        "set for workers: the rendezvous's address, for Horovod's gloo",
    ),
    (
        HOROVOD_GLOO_RENDEZVOUS_PORT,
        "",
        "set for workers: the rendezvous's port, for Horovod's gloo",
    ),
    (HOROVOD_CONTROLLER, "gloo", "set for workers"),
    (HOROVOD_CPU_OPERATIONS, "gloo", "set for workers"),
    (
        HOROVOD_GLOO_IFACE,
        "lo",
        "set for workers (ssh: the interface that reaches the launcher)",
    ),
    (
        NCCL_SOCKET_IFNAME,
        "lo",
        "set for workers (ssh: the interface that reaches the launcher)",
    ),
    (
        GLOO_SOCKET_IFNAME,
        "",
        "set for ssh workers: the interface that reaches the launcher",
    ),
    (
        HVD_NETWORK_INTERFACE,
        "",
        "set for ssh workers: the interface that reaches the launcher",
    ),
    (MASTER_ADDR, "", "set for workers: torch's `env://` address"),
    (
        MASTER_PORT,
        "",
        "set for workers: torch's `env://` port (not the rendezvous port)",
    ),
    (
        SLURM_JOB_ID,
        "",
        "whether hvd runs inside a Slurm allocation; read by sbatch's batch scripts",
    ),
    (
        SLURM_JOB_NODELIST,
        "",
        "read by sbatch's batch scripts: the first node is `MASTER_ADDR`",
    ),
    (
        OMPI_ALLOW_RUN_AS_ROOT,
        "1",
        "set for the `mpirun` of `hvd doctor`",
    ),
    (
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM,
        "1",
        "set for the `mpirun` of `hvd doctor`",
    ),
    (
        JAVA_HOME,
        "",
        "spark driver: a Java installation (else `java` on `PATH`)",
    ),
    (
        SPARK_HOME,
        "",
        "spark driver: set to links to pyspark's `bin` and `jars` under the run's state",
    ),
    (
        PYSPARK_PYTHON,
        "",
        "spark driver: set, unless already set, to the driver's interpreter",
    ),
    (
        PYSPARK_DRIVER_PYTHON,
        "",
        "spark driver: set, unless already set, to the driver's interpreter",
    ),
    (
        SPARK_LOCAL_IP,
        "",
        "spark driver: set, unless already set, to `127.0.0.1` for a local cluster",
    ),
];
