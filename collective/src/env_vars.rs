//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! The crate only reads. The launchers' rank variables are read in the order of [`crate::launch_env::FAMILIES`]
//! (its documentation gives the precedence and why).

/// Seconds a pending operation waits for a silent peer before failing, fractions allowed (default 30).
pub const HVD_COLLECTIVE_TIMEOUT: &str = "HVD_COLLECTIVE_TIMEOUT";
/// Backend: `auto` (default: shm on one host, tcp or hierarchical across hosts), `shm`, `tcp`, `hierarchical`,
/// `mpi`, `nccl`.
pub const HVD_COLLECTIVE_BACKEND: &str = "HVD_COLLECTIVE_BACKEND";
/// Allreduce messages up to this many bytes use recursive doubling, larger ones a ring (default 65536).
pub const HVD_ALLREDUCE_SMALL_BYTES: &str = "HVD_ALLREDUCE_SMALL_BYTES";
/// Allreduce messages with `bytes x (ranks - 1)` up to this go straight to every rank with the operation header
/// (default 16384).
pub const HVD_ALLREDUCE_DIRECT_BYTES: &str = "HVD_ALLREDUCE_DIRECT_BYTES";
/// Large allreduces run the ring over segments of `ranks x` this many bytes (default 262144; 0: one segment).
pub const HVD_ALLREDUCE_CHUNK_BYTES: &str = "HVD_ALLREDUCE_CHUNK_BYTES";
/// With at least this many ranks alone on one shared-memory segment, large allreduces go through the segment's
/// arenas (default 3; 0: never).
pub const HVD_ALLREDUCE_ARENA_RANKS: &str = "HVD_ALLREDUCE_ARENA_RANKS";
/// Allgather totals up to this many bytes go directly to every rank, larger ones use a ring (default 262144).
pub const HVD_ALLGATHER_SMALL_BYTES: &str = "HVD_ALLGATHER_SMALL_BYTES";
/// Capacity of each shared-memory ring between two ranks, rounded to 4 KiB, at least 4 KiB (default 524288).
pub const HVD_SHM_RING_BYTES: &str = "HVD_SHM_RING_BYTES";
/// Fruitless polling rounds a waiting shm rank spins before it yields (default 4096, 4 when ranks outnumber cores).
pub const HVD_SHM_SPIN: &str = "HVD_SHM_SPIN";
/// Rounds a waiting shm rank yields before it sleeps on a futex (default 512, 8 when ranks outnumber cores).
pub const HVD_SHM_YIELDS: &str = "HVD_SHM_YIELDS";
/// Network interface whose address the tcp backend listens on (e.g. `eth0`).
pub const HVD_TCP_INTERFACE: &str = "HVD_TCP_INTERFACE";
/// Address the tcp backend listens on and advertises (overrides the interface).
pub const HVD_TCP_ADDRESS: &str = "HVD_TCP_ADDRESS";
/// Host name that groups ranks into hosts (set by the launcher; else the machine's host name).
pub const HVD_HOSTNAME: &str = "HVD_HOSTNAME";
/// `host:port` of the launcher's rendezvous server, or `file:DIR` for a directory shared by all ranks.
pub const HVD_RENDEZVOUS: &str = "HVD_RENDEZVOUS";
/// Token for the rendezvous server (`Authorization: Bearer`) and the tcp handshake.
pub const HVD_JOB_TOKEN: &str = "HVD_JOB_TOKEN";
/// Names the job for a `file:` rendezvous (default `SLURM_JOB_ID.SLURM_STEP_ID` under Slurm, else none).
pub const HVD_JOB_ID: &str = "HVD_JOB_ID";
/// Slurm's job id: names the job for a `file:` rendezvous when `HVD_JOB_ID` is unset.
pub const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
/// Slurm's step id, next to `SLURM_JOB_ID`.
pub const SLURM_STEP_ID: &str = "SLURM_STEP_ID";

/// Rank of a Spark barrier task (set by the spark engine's driver; the innermost family).
pub const HVD_SPARK_RANK: &str = "HVD_SPARK_RANK";
/// Size of the spark engine's job.
pub const HVD_SPARK_SIZE: &str = "HVD_SPARK_SIZE";
/// Local rank of a Spark barrier task.
pub const HVD_SPARK_LOCAL_RANK: &str = "HVD_SPARK_LOCAL_RANK";
/// Ranks on a Spark task's host.
pub const HVD_SPARK_LOCAL_SIZE: &str = "HVD_SPARK_LOCAL_SIZE";
/// Index of a Spark task's host.
pub const HVD_SPARK_CROSS_RANK: &str = "HVD_SPARK_CROSS_RANK";
/// Hosts of the spark engine's job.
pub const HVD_SPARK_CROSS_SIZE: &str = "HVD_SPARK_CROSS_SIZE";
/// OpenMPI's rank.
pub const OMPI_COMM_WORLD_RANK: &str = "OMPI_COMM_WORLD_RANK";
/// OpenMPI's size.
pub const OMPI_COMM_WORLD_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
/// OpenMPI's local rank.
pub const OMPI_COMM_WORLD_LOCAL_RANK: &str = "OMPI_COMM_WORLD_LOCAL_RANK";
/// OpenMPI's local size.
pub const OMPI_COMM_WORLD_LOCAL_SIZE: &str = "OMPI_COMM_WORLD_LOCAL_SIZE";
/// MVAPICH2's rank.
pub const MV2_COMM_WORLD_RANK: &str = "MV2_COMM_WORLD_RANK";
/// MVAPICH2's size.
pub const MV2_COMM_WORLD_SIZE: &str = "MV2_COMM_WORLD_SIZE";
/// MVAPICH2's local rank.
pub const MV2_COMM_WORLD_LOCAL_RANK: &str = "MV2_COMM_WORLD_LOCAL_RANK";
/// MVAPICH2's local size.
pub const MV2_COMM_WORLD_LOCAL_SIZE: &str = "MV2_COMM_WORLD_LOCAL_SIZE";
/// MPICH/Hydra's and Intel MPI's rank.
pub const PMI_RANK: &str = "PMI_RANK";
/// MPICH/Hydra's and Intel MPI's size.
pub const PMI_SIZE: &str = "PMI_SIZE";
/// MPICH/Hydra's local rank.
pub const MPI_LOCALRANKID: &str = "MPI_LOCALRANKID";
/// MPICH/Hydra's local size.
pub const MPI_LOCALNRANKS: &str = "MPI_LOCALNRANKS";
/// hvd's rank (set per worker by `hvd run`'s engines and the shim).
pub const HVD_RANK: &str = "HVD_RANK";
/// hvd's size; with `JOB_COMPLETION_INDEX`, the size of an Indexed Kubernetes Job.
pub const HVD_SIZE: &str = "HVD_SIZE";
/// hvd's local rank.
pub const HVD_LOCAL_RANK: &str = "HVD_LOCAL_RANK";
/// hvd's local size.
pub const HVD_LOCAL_SIZE: &str = "HVD_LOCAL_SIZE";
/// hvd's cross rank (index of the host).
pub const HVD_CROSS_RANK: &str = "HVD_CROSS_RANK";
/// hvd's cross size (number of hosts).
pub const HVD_CROSS_SIZE: &str = "HVD_CROSS_SIZE";
/// Slurm's rank (srun).
pub const SLURM_PROCID: &str = "SLURM_PROCID";
/// Slurm's size.
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
/// Slurm's local rank.
pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
/// Slurm's tasks per node (else the size spread over `SLURM_NNODES`).
pub const SLURM_NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";
/// Slurm's node index.
pub const SLURM_NODEID: &str = "SLURM_NODEID";
/// Slurm's node count.
pub const SLURM_NNODES: &str = "SLURM_NNODES";
/// The pod's index in an Indexed Kubernetes Job (one pod per rank; the size is `HVD_SIZE`).
pub const JOB_COMPLETION_INDEX: &str = "JOB_COMPLETION_INDEX";

/// `(name, default or "" when unset means none/off, one-line meaning)` for every constant above.
pub const ALL: &[(&str, &str, &str)] = &[
    (
        HVD_COLLECTIVE_TIMEOUT,
        "30",
        "seconds a pending operation waits for a silent peer before failing",
    ),
    (
        HVD_COLLECTIVE_BACKEND,
        "auto",
        "backend: `auto`, `shm`, `tcp`, `hierarchical`, `mpi` or `nccl`",
    ),
    (
        HVD_ALLREDUCE_SMALL_BYTES,
        "65536",
        "allreduces up to this many bytes use recursive doubling, larger ones a ring",
    ),
    (
        HVD_ALLREDUCE_DIRECT_BYTES,
        "16384",
        "allreduces with `bytes x (ranks - 1)` up to this go straight to every rank",
    ),
    (
        HVD_ALLREDUCE_CHUNK_BYTES,
        "262144",
        "large allreduces ring over segments of `ranks x` this many bytes (0: one segment)",
    ),
    (
        HVD_ALLREDUCE_ARENA_RANKS,
        "3",
        "ranks alone on one shm segment from which large allreduces use its arenas (0: never)",
    ),
    (
        HVD_ALLGATHER_SMALL_BYTES,
        "262144",
        "allgather totals up to this many bytes go directly to every rank, larger ones use a ring",
    ),
    (
        HVD_SHM_RING_BYTES,
        "524288",
        "capacity of each shared-memory ring between two ranks (rounded to 4 KiB)",
    ),
    (
        HVD_SHM_SPIN,
        "4096",
        "fruitless polling rounds before a waiting shm rank yields (4 when ranks outnumber cores)",
    ),
    (
        HVD_SHM_YIELDS,
        "512",
        "yielding rounds before a waiting shm rank sleeps on a futex (8 when ranks outnumber cores)",
    ),
    (
        HVD_TCP_INTERFACE,
        "",
        "network interface whose address the tcp backend listens on",
    ),
    (
        HVD_TCP_ADDRESS,
        "",
        "address the tcp backend listens on and advertises (overrides the interface)",
    ),
    (
        HVD_HOSTNAME,
        "",
        "host name that groups ranks into hosts (else the machine's host name)",
    ),
    (
        HVD_RENDEZVOUS,
        "",
        "`host:port` of the launcher's rendezvous server, or `file:DIR`",
    ),
    (
        HVD_JOB_TOKEN,
        "",
        "the job's token for the rendezvous and the tcp handshake",
    ),
    (
        HVD_JOB_ID,
        "",
        "names the job for a `file:` rendezvous (else `SLURM_JOB_ID.SLURM_STEP_ID`)",
    ),
    (
        SLURM_JOB_ID,
        "",
        "names the job for a `file:` rendezvous when `HVD_JOB_ID` is unset",
    ),
    (SLURM_STEP_ID, "", "Slurm's step id, next to `SLURM_JOB_ID`"),
    (
        HVD_SPARK_RANK,
        "",
        "rank of a spark engine task (first family read)",
    ),
    (HVD_SPARK_SIZE, "", "size of a spark engine job"),
    (
        HVD_SPARK_LOCAL_RANK,
        "",
        "local rank of a spark engine task",
    ),
    (
        HVD_SPARK_LOCAL_SIZE,
        "",
        "local size of a spark engine task",
    ),
    (
        HVD_SPARK_CROSS_RANK,
        "",
        "cross rank of a spark engine task",
    ),
    (HVD_SPARK_CROSS_SIZE, "", "cross size of a spark engine job"),
    (OMPI_COMM_WORLD_RANK, "", "OpenMPI's rank (second family)"),
    (OMPI_COMM_WORLD_SIZE, "", "OpenMPI's size"),
    (OMPI_COMM_WORLD_LOCAL_RANK, "", "OpenMPI's local rank"),
    (OMPI_COMM_WORLD_LOCAL_SIZE, "", "OpenMPI's local size"),
    (MV2_COMM_WORLD_RANK, "", "MVAPICH2's rank (third family)"),
    (MV2_COMM_WORLD_SIZE, "", "MVAPICH2's size"),
    (MV2_COMM_WORLD_LOCAL_RANK, "", "MVAPICH2's local rank"),
    (MV2_COMM_WORLD_LOCAL_SIZE, "", "MVAPICH2's local size"),
    (
        PMI_RANK,
        "",
        "MPICH/Hydra's and Intel MPI's rank (fourth family)",
    ),
    (PMI_SIZE, "", "MPICH/Hydra's and Intel MPI's size"),
    (MPI_LOCALRANKID, "", "MPICH/Hydra's local rank"),
    (MPI_LOCALNRANKS, "", "MPICH/Hydra's local size"),
    (HVD_RANK, "", "hvd's rank (fifth family)"),
    (
        HVD_SIZE,
        "",
        "hvd's size; with `JOB_COMPLETION_INDEX`, an Indexed Job's size",
    ),
    (HVD_LOCAL_RANK, "", "hvd's local rank"),
    (HVD_LOCAL_SIZE, "", "hvd's local size"),
    (HVD_CROSS_RANK, "", "hvd's cross rank (index of the host)"),
    (HVD_CROSS_SIZE, "", "hvd's cross size (number of hosts)"),
    (SLURM_PROCID, "", "Slurm's rank (sixth family)"),
    (SLURM_NTASKS, "", "Slurm's size"),
    (SLURM_LOCALID, "", "Slurm's local rank"),
    (
        SLURM_NTASKS_PER_NODE,
        "",
        "Slurm's local size (else the size spread over `SLURM_NNODES`)",
    ),
    (SLURM_NODEID, "", "Slurm's cross rank"),
    (SLURM_NNODES, "", "Slurm's cross size"),
    (
        JOB_COMPLETION_INDEX,
        "",
        "the pod's index in an Indexed Kubernetes Job (last family; size `HVD_SIZE`)",
    ),
];
