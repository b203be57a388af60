//! What `hvd run` was asked for besides the project: the options every engine reads ([`RunOptions`]), with the
//! command-line options of the ssh and spark engines.

use std::path::PathBuf;
use std::time::Duration;

use hvd_lang::model::EngineKind;

/// Everything `hvd run` was asked for besides the project itself.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Run only this step and the steps it needs.
    pub step: Option<String>,
    /// With [`RunOptions::step`]: that step alone, not the steps it needs (`--no-deps`: they ran before; a batch job
    /// of the slurm engine runs its step's own launcher this way).
    pub no_deps: bool,
    /// Override `workers` of every distributed step.
    pub workers: Option<u32>,
    /// Rerun steps even when their inputs are unchanged.
    pub force: bool,
    /// The built environment (a venv layout): `bin/` goes first on `PATH`, `VIRTUAL_ENV` points at it.
    pub env_dir: Option<PathBuf>,
    /// A hash that identifies the environment (the lock's env hash); part of every step's input hash.
    pub env_hash: Option<String>,
    /// Sets `HVD_TIMELINE` (and `HOROVOD_TIMELINE`) for the workers.
    pub timeline: Option<PathBuf>,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub grace: Duration,
    /// Fail a distributed step when not every rank has joined the rendezvous within this time. `None`: never
    /// (plain scripts never talk to the rendezvous; see docs/running.md).
    pub start_timeout: Option<Duration>,
    /// `--max-restarts N`: overrides every step's `restarts` (how many times a step starts again after a rank
    /// fails).
    pub max_restarts: Option<u32>,
    /// `--min-workers N`: makes every distributed step elastic with this minimum (over the step's
    /// `workers = { min }`).
    pub min_workers: Option<u32>,
    /// `--max-workers N`: the workers every distributed step starts with (as `--workers`, which it wins over).
    pub max_workers: Option<u32>,
    /// `--elastic-timeout` (over each elastic step's `elastic_timeout`; [`ElasticSettings::timeout`]).
    pub elastic_timeout: Option<Duration>,
    /// `--host-discovery-script` (over each elastic step's `discovery`; [`ElasticSettings::discovery`]).
    pub host_discovery_script: Option<PathBuf>,
    /// `--slots-per-host N` (over each elastic step's `slots_per_host`; [`ElasticSettings::slots_per_host`]).
    pub slots_per_host: Option<u32>,
    /// `--blacklist-cooldown-range MIN MAX` (over each elastic step's `cooldown`; [`ElasticSettings::cooldown`]).
    pub blacklist_cooldown: Option<crate::discovery::Cooldown>,
    /// `--checkpoints DIR`: where every step's workers keep `hvd.elastic` checkpoints (`HVD_CHECKPOINT_DIR`), over
    /// the steps' `checkpoints`.
    pub checkpoints: Option<PathBuf>,
    /// Where state and logs go; default `<project dir>/.hvd`.
    pub state_dir: Option<PathBuf>,
    /// Binary caches the nodes substitute the env from before their ranks start (`--cache`, `HVD_CACHES`, the file's
    /// `cluster { caches }`); engines whose nodes may lack the env pull it (`hvd cache pull`).
    pub caches: Vec<String>,
    /// The public keys (`NAME:BASE64`) the nodes trust for [`RunOptions::caches`].
    pub trusted_keys: Vec<String>,
    /// `--engine`: overrides `cluster { engine }`.
    pub engine: Option<EngineKind>,
    /// `--mpi openmpi|mpich` (else `cluster { settings { mpi } }`, else detected from `mpirun --version`).
    pub mpi: Option<String>,
    /// The mpirun program (else `cluster { settings { mpirun } }`, else found on PATH).
    pub mpirun: Option<PathBuf>,
    /// The hvd binary, whose `worker-env` subcommand is the shim engines run in front of each rank.
    pub shim: Option<PathBuf>,
    /// `--hosts` (`host:slots` entries): overrides `cluster { hosts }` for the mpi and ssh engines.
    pub hosts: Option<Vec<String>>,
    /// `--spark-master` and `--spark-python` for the spark engine.
    pub spark: SparkOptions,
    /// ssh options and `--network-interface` for the ssh engine.
    pub ssh: SshOptions,
    /// `--detach`: an engine that owns the run (sbatch) submits it and returns without following it.
    pub detach: bool,
    /// `-v` given this many times: passed on to the `hvd run` of a step's launcher elsewhere (a slurm batch job, a
    /// kubernetes launcher pod), whose log then says as much as this one's.
    pub verbose: u8,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            step: None,
            no_deps: false,
            workers: None,
            force: false,
            env_dir: None,
            env_hash: None,
            timeline: None,
            grace: Duration::from_secs(10),
            start_timeout: None,
            max_restarts: None,
            min_workers: None,
            max_workers: None,
            elastic_timeout: None,
            host_discovery_script: None,
            slots_per_host: None,
            blacklist_cooldown: None,
            checkpoints: None,
            state_dir: None,
            caches: Vec::new(),
            trusted_keys: Vec::new(),
            engine: None,
            mpi: None,
            mpirun: None,
            shim: None,
            hosts: None,
            spark: SparkOptions::default(),
            ssh: SshOptions::default(),
            detach: false,
            verbose: 0,
        }
    }
}

/// An elastic step's settings as it runs: `hvd run`'s flag, else the step's `workers = { .. }` in the file, else
/// the default (docs/running.md, Elastic steps).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticSettings {
    /// How long a new round waits for the live workers to ask to join (from the first that asked; one that does
    /// not is left out and stopped), and how long the step below its minimum waits for replacements or discovered
    /// slots before it fails (`--elastic-timeout`, `elastic_timeout`; 60 s).
    pub timeout: Duration,
    /// The step's hosts come from this program (Horovod's contract: it prints `host:slots` lines), run at the start
    /// and every second while the step runs; new slots start new workers (`--host-discovery-script`, absolute
    /// against the current directory; `discovery`, against the .hvd file's directory).
    pub discovery: Option<PathBuf>,
    /// The discovery program may print a host name alone, which gets N slots; `None`: every line must be
    /// `host:slots` (`--slots-per-host`, `slots_per_host`).
    pub slots_per_host: Option<u32>,
    /// How long a host whose workers were lost stays blacklisted (`--blacklist-cooldown-range`, `cooldown`).
    pub cooldown: crate::discovery::Cooldown,
}

/// The elastic timeout without a flag or a setting.
pub const ELASTIC_TIMEOUT: Duration = Duration::from_secs(60);

impl Default for ElasticSettings {
    fn default() -> Self {
        ElasticSettings {
            timeout: ELASTIC_TIMEOUT,
            discovery: None,
            slots_per_host: None,
            cooldown: crate::discovery::Cooldown::default(),
        }
    }
}

/// `at + by`, saturating where the clock ends (every deadline made of a user's duration uses it).
pub use hvd_collective::time::saturating_add;

/// What `hvd run` was told about ssh (`--ssh-port`, `--ssh-identity`, `--ssh-config`, `--network-interface`; each
/// falls back to `cluster { settings { ssh_port, ssh_identity, ssh_config, network_interface } }`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SshOptions {
    pub port: Option<u16>,
    pub identity: Option<PathBuf>,
    pub config: Option<PathBuf>,
    pub network_interface: Option<String>,
    /// Copy the env's store paths to hosts that lack them (`--ssh-copy-env`, `settings.copy_env = "true"`).
    pub copy_env: bool,
}

/// `hvd run` options of the spark engine (else `cluster { settings = { master, python } }`).
#[derive(Debug, Clone, Default)]
pub struct SparkOptions {
    /// `--spark-master URL`: `local[N]`, `local-cluster[W,C,M]`, `spark://host:port`, `yarn`, ...
    pub master: Option<String>,
    /// `--spark-python PROGRAM`: the Python (with pyspark) that runs the driver and the tasks.
    pub python: Option<PathBuf>,
}
