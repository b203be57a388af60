//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! The crate only reads. The launchers' rank variables are read in the order of [`crate::launch_env::FAMILIES`]
//! (its documentation gives the precedence and why).

hvd_env_vars::env_vars! {
    /// Seconds a pending operation waits for a silent peer before failing, fractions allowed; above 0, at most 86400
    /// (a day).
    HVD_COLLECTIVE_TIMEOUT default "30";
    /// Backend: `auto` (default: shm on one host, tcp or hierarchical across hosts), `shm`, `tcp`, `hierarchical`,
    /// `mpi`, `nccl`.
    HVD_COLLECTIVE_BACKEND default "auto";
    /// Allreduce messages up to this many bytes use recursive doubling, larger ones a ring.
    HVD_ALLREDUCE_SMALL_BYTES default "32768";
    /// Allreduce messages with `bytes x (ranks - 1)` up to this go straight to every rank with the operation header
    ///.
    HVD_ALLREDUCE_DIRECT_BYTES default "16384";
    /// When 3 or more ranks outnumber cores on one shared-memory segment (the whole job), allreduces past the direct
    /// size with `bytes x (ranks - 1)` up to this (and at most 32 KiB per rank) are deposited on the segment with the
    /// operation header: one wait instead of three (0: never).
    HVD_ALLREDUCE_DEPOSIT_BYTES default "49152";
    /// Large allreduces run the ring over segments of `ranks x` this many bytes (0: one segment).
    HVD_ALLREDUCE_CHUNK_BYTES default "262144";
    /// With at least this many ranks alone on one shared-memory segment, large allreduces go through the single copy
    /// (from 32 KiB, when the ranks reach each other's buffers) or the segment's arenas (0: never; such ranks then
    /// take the 2-rank order: recursive doubling, the single copy, the ring).
    HVD_ALLREDUCE_ARENA_RANKS default "3";
    /// Allgather totals up to this many bytes go directly to every rank, larger ones use a ring.
    HVD_ALLGATHER_SMALL_BYTES default "262144";
    /// Capacity of each shared-memory ring between two ranks, rounded to 4 KiB, 4 KiB to 1 GiB.
    HVD_SHM_RING_BYTES default "524288";
    /// Fruitless polling rounds a waiting shm rank spins before it yields (4 when ranks outnumber cores).
    HVD_SHM_SPIN default "4096";
    /// Rounds a waiting shm rank yields before it sleeps on a futex (when ranks outnumber cores: unless set, it
    /// yields for up to 2 µs without progress instead).
    HVD_SHM_YIELDS default "512";
    /// Large shm allreduces read peers' buffers directly: `auto` when all ranks are threads of one process, `1`
    /// also between processes (`process_vm_readv`), `0` never (the ring).
    HVD_SHM_CMA default "auto";
    /// Network interface whose address the tcp backend listens on (e.g. `eth0`).
    HVD_TCP_INTERFACE;
    /// Address the tcp backend listens on and advertises (overrides the interface).
    HVD_TCP_ADDRESS;
    /// Host name that groups ranks into hosts (set by the launcher; else the machine's host name).
    HVD_HOSTNAME;
    /// `host:port` of the launcher's rendezvous server, or `file:DIR` for a directory shared by all ranks.
    HVD_RENDEZVOUS;
    /// `1` for the workers of an elastic step (set by `hvd run`): each join asks the launcher's rendezvous for this
    /// worker's rank and the size of the job's next round.
    HVD_ELASTIC;
    /// Seconds a round of an elastic step waits for live workers that have not asked to join (set by `hvd run` from
    /// `--elastic-timeout` or `workers = { elastic_timeout }`; from 1 to 86400, `ELASTIC_TIMEOUT_SECONDS`): a join
    /// waits at least this long, plus a margin, before giving up.
    HVD_ELASTIC_TIMEOUT;
    /// Seconds after which the launcher counts an elastic worker that has sent heartbeats and then none as lost (a
    /// frozen process or node): read by `hvd run` (the step's, else its own; from 1 to 86400), which sets it for the
    /// workers; each worker beats five times per timeout, at most every 2 s.
    HVD_HEARTBEAT_TIMEOUT default "10";
    /// Token for the rendezvous server (`Authorization: Bearer`) and the tcp handshake.
    HVD_JOB_TOKEN;
    /// Names the job for a `file:` rendezvous (default `SLURM_JOB_ID.SLURM_STEP_ID` under Slurm, else none).
    HVD_JOB_ID;
    /// Slurm's job id: names the job for a `file:` rendezvous when `HVD_JOB_ID` is unset.
    SLURM_JOB_ID;
    /// Slurm's step id, next to `SLURM_JOB_ID`.
    SLURM_STEP_ID;
    /// Rank of a Spark barrier task (set by the spark engine's driver; the innermost family).
    HVD_SPARK_RANK;
    /// Size of the spark engine's job.
    HVD_SPARK_SIZE;
    /// Local rank of a Spark barrier task.
    HVD_SPARK_LOCAL_RANK;
    /// Ranks on a Spark task's host.
    HVD_SPARK_LOCAL_SIZE;
    /// Index of a Spark task's host.
    HVD_SPARK_CROSS_RANK;
    /// Hosts of the spark engine's job.
    HVD_SPARK_CROSS_SIZE;
    /// OpenMPI's rank.
    OMPI_COMM_WORLD_RANK;
    /// OpenMPI's size.
    OMPI_COMM_WORLD_SIZE;
    /// OpenMPI's local rank.
    OMPI_COMM_WORLD_LOCAL_RANK;
    /// OpenMPI's local size.
    OMPI_COMM_WORLD_LOCAL_SIZE;
    /// MVAPICH2's rank.
    MV2_COMM_WORLD_RANK;
    /// MVAPICH2's size.
    MV2_COMM_WORLD_SIZE;
    /// MVAPICH2's local rank.
    MV2_COMM_WORLD_LOCAL_RANK;
    /// MVAPICH2's local size.
    MV2_COMM_WORLD_LOCAL_SIZE;
    /// MPICH/Hydra's and Intel MPI's rank.
    PMI_RANK;
    /// MPICH/Hydra's and Intel MPI's size.
    PMI_SIZE;
    /// MPICH/Hydra's local rank.
    MPI_LOCALRANKID;
    /// MPICH/Hydra's local size.
    MPI_LOCALNRANKS;
    /// hvd's rank (set per worker by `hvd run`'s engines and the shim).
    HVD_RANK;
    /// hvd's size; with `JOB_COMPLETION_INDEX`, the size of an Indexed Kubernetes Job.
    HVD_SIZE;
    /// hvd's local rank.
    HVD_LOCAL_RANK;
    /// hvd's local size.
    HVD_LOCAL_SIZE;
    /// hvd's cross rank (index of the host).
    HVD_CROSS_RANK;
    /// hvd's cross size (number of hosts).
    HVD_CROSS_SIZE;
    /// Slurm's rank (srun).
    SLURM_PROCID;
    /// Slurm's size.
    SLURM_NTASKS;
    /// Slurm's local rank.
    SLURM_LOCALID;
    /// Slurm's tasks per node (else the size spread over `SLURM_NNODES`).
    SLURM_NTASKS_PER_NODE;
    /// Slurm's node index.
    SLURM_NODEID;
    /// Slurm's node count.
    SLURM_NNODES;
    /// The pod's index in an Indexed Kubernetes Job (one pod per rank; the size is `HVD_SIZE`).
    JOB_COMPLETION_INDEX;
}
