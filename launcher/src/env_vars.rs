//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! Most are set for the workers (docs/running.md says which engine sets what, and in which order); the rows marked
//! "spark driver" are read or set by `engines/spark_driver.py`. The launchers' rank variables the shim reads are
//! `hvd-collective`'s (its `env_vars` and [`hvd_collective::launch_env`]).

hvd_env_vars::env_vars! {
    /// Seconds one run of `--host-discovery-script` may take before it is killed and counted as failed (the step
    /// keeps its hosts).
    HVD_DISCOVERY_TIMEOUT default "10";
    /// Read (the step's, else the launcher's own) to time how long an elastic worker on the ssh engine asked to
    /// leave (host discovery no longer lists its slot) has to hand over before the host's wrapper kills it: this
    /// plus 10 s. The workers read it too (the python package: docs/running.md, Preemption).
    HVD_PREEMPT_GRACE default "30";
    /// Seconds between the keepalive lines `hvd run` writes to every remote rank's stdin (ssh, srun, spark relays,
    /// `kubectl exec`), so that no idle timeout on the way closes a silent rank's stream; `0`: none (the step's `env`,
    /// else the launcher's own; 0.1 to 3600).
    HVD_REMOTE_KEEPALIVE default "30";
    /// `off`: no cgroups, the subreaper fallback alone; empty or `auto` (the default): a cgroup per run where the
    /// machine allows it; anything else is an error naming the variable.
    HVD_CGROUPS default "auto";
    /// Searched for the engines' programs (mpirun, srun, sbatch, spark-submit, kubectl); set for workers with an env
    /// (its `bin` first) and passed on by the engines that start ranks themselves.
    PATH;
    /// Set for workers with an env: the env's directory.
    VIRTUAL_ENV;
    /// Set for workers to `1`.
    PYTHONUNBUFFERED default "1";
    /// Set for workers to the CPUs divided by the local workers (at least 1), unless already set.
    OMP_NUM_THREADS;
    /// Set for workers with `resources.gpus = g`: devices `local_rank*g .. local_rank*g+g-1`.
    CUDA_VISIBLE_DEVICES;
    /// `resources.gpus` handed to the shim, which sets `CUDA_VISIBLE_DEVICES` from the local rank.
    HVD_GPUS_PER_WORKER default "0";
    /// Set for every worker (`<run id>/<step>/<n>`): finds the processes a step started after they left its process
    /// groups.
    HVD_RUN_STEP;
    /// Set for every worker: how many times its step has been started again after a rank failed (`0` on the first
    /// attempt; `restarts` / `--max-restarts`).
    HVD_RESTART_COUNT default "0";
    /// torchrun's name for `HVD_RESTART_COUNT`, set with it.
    TORCHELASTIC_RESTART_COUNT default "0";
    /// Set to `C` for the `sort` of the ssh engine's copy check on a host, so its listing sorts bytewise like the list
    /// sent with the copy.
    LC_ALL default "C";
    /// Set for the workers of a step with `checkpoints` (or under `hvd run --checkpoints`): the absolute directory
    /// `hvd.elastic`'s `state.checkpoint()` writes to and a new run resumes from.
    HVD_CHECKPOINT_DIR;
    /// Set with `HVD_CHECKPOINT_DIR`: the file (in the attempt's log directory) rank 0 writes `commit N` into when it
    /// resumed from a checkpoint, which `hvd run` reads.
    HVD_CHECKPOINT_REPORT;
    /// Set to `1` with `HVD_CHECKPOINT_REPORT` where rank 0 surely reaches the launcher's rendezvous (local, ssh,
    /// spark, slurm in a run with an elastic step): rank 0 then reports its resume there first (`HVD_RENDEZVOUS`);
    /// without it (mpi, slurm's srun otherwise: 127.0.0.1, maybe on another host) only in the file.
    HVD_CHECKPOINT_REPORT_RENDEZVOUS;
    /// Set for workers with `--timeline FILE`: the runtime's timeline.
    HVD_TIMELINE;
    /// Horovod's spelling of `HVD_TIMELINE`, set with it.
    HOROVOD_TIMELINE;
    /// `1`: rank 0's shim serves the rendezvous itself on `HVD_RENDEZVOUS`'s port (a Kubernetes JobSet).
    HVD_RENDEZVOUS_SERVE;
    /// Seconds the shim waits for `HVD_RENDEZVOUS` to resolve and accept connections, at most 86400 (default 300 when
    /// rank 0 serves it, else 0).
    HVD_RENDEZVOUS_WAIT;
    /// The pod's own IP (set from `status.podIP` by the manifests of `hvd export k8s`): where rank 0's shim serves,
    /// and where an elastic step's launcher pod binds the rendezvous.
    HVD_POD_IP;
    /// Set on an elastic step's launcher pod by the JobSet: the label selector of the step's worker pods; with it,
    /// `hvd run --engine kubernetes` runs the step's ranks in them through `kubectl exec`.
    HVD_K8S_WORKERS;
    /// Set on an elastic step's launcher pod (`metadata.namespace`): where its worker pods are.
    HVD_K8S_NAMESPACE;
    /// Set by the spark driver for each task: its executor's host, read first by the shim.
    HVD_SPARK_HOST;
    /// The spark engine's settings for its driver and relay server (a JSON object of `spark.*` strings), kept off
    /// their command lines; the driver removes it from its environment at once.
    HVD_SPARK_CONF;
    /// Read by the shim for the host name after `HVD_HOSTNAME`.
    SLURMD_NODENAME;
    /// Read by the shim for the host name after `SLURMD_NODENAME` (else the kernel's).
    HOSTNAME;
    /// Set for workers: Horovod's rank.
    HOROVOD_RANK;
    /// Set for workers: Horovod's size.
    HOROVOD_SIZE;
    /// Set for workers: Horovod's local rank.
    HOROVOD_LOCAL_RANK;
    /// Set for workers: Horovod's local size.
    HOROVOD_LOCAL_SIZE;
    /// Set for workers: Horovod's cross rank.
    HOROVOD_CROSS_RANK;
    /// Set for workers: Horovod's cross size.
    HOROVOD_CROSS_SIZE;
    /// Set for workers: Horovod's host name.
    HOROVOD_HOSTNAME;
    /// Set for workers: torch's rank.
    RANK;
    /// Set for workers: torch's size.
    WORLD_SIZE;
    /// Set for workers: torch's local rank.
    LOCAL_RANK;
    /// Set for workers: torch's local size.
    LOCAL_WORLD_SIZE;
    /// Set for workers: the rendezvous's address, for Horovod's gloo controller.
    HOROVOD_GLOO_RENDEZVOUS_ADDR;
    /// Set for workers: the rendezvous's port, for Horovod's gloo controller.
    HOROVOD_GLOO_RENDEZVOUS_PORT;
    /// Set for workers to `gloo`.
    HOROVOD_CONTROLLER default "gloo";
    /// Set for workers to `gloo`.
    HOROVOD_CPU_OPERATIONS default "gloo";
    /// Set for workers to `lo` (ssh: the interface that reaches the launcher).
    HOROVOD_GLOO_IFACE default "lo";
    /// Set for workers to `lo` (ssh: the interface that reaches the launcher).
    NCCL_SOCKET_IFNAME default "lo";
    /// Set for ssh workers: the interface that reaches the launcher.
    GLOO_SOCKET_IFNAME;
    /// Set for ssh workers: the interface that reaches the launcher.
    HVD_NETWORK_INTERFACE;
    /// Set for workers: torch's `env://` address (rank 0's host).
    MASTER_ADDR;
    /// Set for workers: torch's `env://` port (a free port, not the rendezvous port).
    MASTER_PORT;
    /// Read to tell whether hvd runs inside a Slurm allocation; read by the batch scripts of sbatch.
    SLURM_JOB_ID;
    /// Read by the batch scripts of sbatch: the allocation's nodes (the first is `MASTER_ADDR`); read by the slurm
    /// engine inside an allocation for a distributed step's nodes (where its rendezvous listens, its layout).
    SLURM_JOB_NODELIST;
    /// Read by the slurm engine inside an allocation for a distributed step: how many tasks each node has.
    SLURM_TASKS_PER_NODE;
    /// Read by the slurm engine inside an allocation: a plain step on every task takes the allocation's layout (its
    /// lines labelled by node) only when this is unset or `block` across nodes. Read by the shim under srun:
    /// `arbitrary` keeps `MASTER_ADDR` off the step's first node.
    SLURM_DISTRIBUTION;
    /// Read by the slurm engine inside an allocation: a plain step with another `resources.cpus` keeps this
    /// machine's name in its labels (srun may place its tasks otherwise).
    SLURM_CPUS_PER_TASK default "1";
    /// Read by the shim under srun with a rendezvous not on loopback: its first node (rank 0's) is `MASTER_ADDR`.
    SLURM_STEP_NODELIST;
    /// Set to `1` for the `mpirun` of `hvd doctor`, which may run as root in a container.
    OMPI_ALLOW_RUN_AS_ROOT default "1";
    /// Set to `1` with `OMPI_ALLOW_RUN_AS_ROOT`.
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM default "1";
    /// Spark driver: a Java installation (else `java` on `PATH`).
    JAVA_HOME;
    /// Spark driver: set to a directory under the run's state that links pyspark's `bin` and `jars`.
    SPARK_HOME;
    /// Spark driver: set, unless already set, to the driver's interpreter.
    PYSPARK_PYTHON;
    /// Spark driver: set, unless already set, to the driver's interpreter.
    PYSPARK_DRIVER_PYTHON;
    /// Spark driver: set, unless already set, to `127.0.0.1` for a local cluster.
    SPARK_LOCAL_IP;
    /// Spark driver: `--properties-file FILE` (the settings, off the command line) put before the user's own.
    PYSPARK_SUBMIT_ARGS;
}

/// Set for workers (and read by the shim): the collective's own variables, declared once in its registry and
/// documented in its table: the rendezvous and token, the rank variables, the host name, the tcp interface (ssh),
/// and the spark driver's per-task `HVD_SPARK_*`.
pub use hvd_collective::env_vars::{
    HVD_CROSS_RANK, HVD_CROSS_SIZE, HVD_ELASTIC, HVD_HOSTNAME, HVD_JOB_TOKEN, HVD_LOCAL_RANK,
    HVD_LOCAL_SIZE, HVD_RANK, HVD_RENDEZVOUS, HVD_SIZE, HVD_SPARK_CROSS_RANK, HVD_SPARK_CROSS_SIZE,
    HVD_SPARK_LOCAL_RANK, HVD_SPARK_LOCAL_SIZE, HVD_SPARK_RANK, HVD_SPARK_SIZE, HVD_TCP_INTERFACE,
};
