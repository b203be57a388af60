//! The evaluated, typed model of a `.hvd` file.
//!
//! This is the contract between `lang` and every crate downstream of it (resolver, builder, launcher, the CLI).
//! It is plain data: no spans, no references back into the AST. `hvd check --json` prints it as JSON.
//! Changing a field here changes every consumer; keep it small and explicit.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A whole evaluated `.hvd` file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Project {
    /// From `project "name"`; defaults to the file stem.
    pub name: String,
    /// The file that was evaluated (as given, not canonicalized).
    pub file: PathBuf,
    pub env: Env,
    pub resources: Resources,
    /// Steps in the order they appear in the file.
    pub steps: Vec<Step>,
    pub cluster: Option<Cluster>,
}

/// The `env { ... }` block: everything that goes into the lockfile and the store.
/// Nothing outside this block may influence resolution or builds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Env {
    /// Requested interpreter version, e.g. `"3.11"` (major.minor, optionally .patch).
    pub python: String,
    /// `index = "..."`: a package index URL (PEP 503/691 simple API root). `None`: ask pip's configuration.
    pub index: Option<String>,
    /// `toolchain = std.gcc { ... }`: the C/C++ compiler used for source builds.
    pub toolchain: Option<Toolchain>,
    /// Requested packages, in file order.
    pub packages: Vec<PackageRequest>,
    /// `variables = { NAME = "value" }`: extra environment variables set in the built env (and in every step).
    pub variables: BTreeMap<String, String>,
}

/// One entry of `env.packages`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackageRequest {
    /// A PEP 508 requirement string, e.g. `"numpy<2"` or `"tensorflow-cpu==2.12.1"`.
    pub requirement: String,
    /// Present when the package must be built from source with a recipe (e.g. horovod).
    pub build: Option<SourceBuild>,
}

/// How a source-built package is built (PEP 517), as declared by its recipe.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SourceBuild {
    /// Build requirements (PEP 508 strings), resolved and locked separately from the runtime packages,
    /// e.g. `["cmake<4", "setuptools", "wheel"]`.
    pub requires: Vec<String>,
    /// Environment variables for the build, e.g. `HOROVOD_WITH_TENSORFLOW = "1"`.
    pub env: BTreeMap<String, String>,
    /// Names of runtime packages the build compiles against (e.g. `["tensorflow-cpu"]`). They are installed
    /// into the build environment and their derivation hashes become inputs of this build.
    pub against: Vec<String>,
    /// Build with `--no-build-isolation` semantics: `requires` and `against` are installed together.
    pub no_build_isolation: bool,
}

/// A compiler toolchain pin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Toolchain {
    /// e.g. `"gcc"`.
    pub name: String,
    /// e.g. `"12"`: the required major version (or a longer prefix).
    pub version: String,
}

/// `resources { ... }`: what each worker gets.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Resources {
    /// GPUs per worker (0 when absent).
    pub gpus: u32,
    /// CPUs per worker.
    pub cpus: Option<u32>,
    /// Memory per worker, in bytes.
    pub mem: Option<u64>,
}

/// `step NAME { ... }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub name: String,
    /// The shell command to run (run with `sh -c`).
    pub run: String,
    /// Names of steps that must finish first.
    pub needs: Vec<String>,
    /// Number of workers; `None` means the step runs once, not distributed. For an elastic step
    /// (`workers = { min = 2, max = 8 }`) the most workers, the number it starts with.
    pub workers: Option<u32>,
    /// Elastic steps only: the fewest workers the step goes on with after losing some (`workers = { min = .. }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_workers: Option<u32>,
    /// Elastic steps only: the rest of the elastic configuration (`workers = { min, max, discovery, .. }`).
    #[serde(default, skip_serializing_if = "Elastic::is_empty")]
    pub elastic: Elastic,
    /// Input paths (files or directories, relative to the project directory) whose content feeds the step's hash.
    pub inputs: Vec<String>,
    /// Output paths the step produces.
    pub outputs: Vec<String>,
    /// Extra environment variables for this step.
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit for the step, in milliseconds.
    pub timeout_ms: Option<u64>,
    /// `restarts = N`: start the step again, up to N times, when a rank fails (`hvd run --max-restarts` overrides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarts: Option<u32>,
    /// `checkpoints = "ckpt/"`: the directory (relative to the project directory, or absolute; or a `file://` URL;
    /// or an `s3://bucket/prefix` URL)
    /// the step's workers save `hvd.elastic` checkpoints in and resume from (`HVD_CHECKPOINT_DIR`; `hvd run
    /// --checkpoints` overrides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<String>,
}

impl Step {
    /// Whether the step is elastic as the file writes it (`workers = { min, max }`); `hvd run --min-workers` makes
    /// every distributed step elastic besides.
    pub fn is_elastic(&self) -> bool {
        self.workers.is_some() && self.min_workers.is_some()
    }

    /// A step named `name` that runs `run` once: no needs, inputs, outputs, variables, time limit, restarts or
    /// checkpoints (set those with struct update syntax).
    pub fn new(name: &str, run: &str) -> Step {
        Step {
            name: name.into(),
            run: run.into(),
            needs: vec![],
            workers: None,
            min_workers: None,
            elastic: Elastic::default(),
            inputs: vec![],
            outputs: vec![],
            env: BTreeMap::new(),
            timeout_ms: None,
            restarts: None,
            checkpoints: None,
        }
    }
}

/// The bounds of a blacklist cooldown in whole seconds (`workers = { cooldown }`, `hvd run
/// --blacklist-cooldown-range`; Horovod's: at least 1 s, at most an hour).
pub const COOLDOWN_SECONDS: (u64, u64) = (1, 3600);

/// An elastic step's settings besides its range, from `workers = { min = 2, max = 8, discovery = "./discover.sh",
/// slots_per_host = 4, elastic_timeout = 60s, cooldown = [60s, 10m] }`. Each is optional; `hvd run`'s flag of the
/// same meaning overrides it (docs/running.md, Elastic steps).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Elastic {
    /// `discovery`: the host discovery program (`--host-discovery-script`), a path relative to the .hvd file's
    /// directory (or absolute), as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery: Option<String>,
    /// `slots_per_host`: the slots of a host the discovery program names alone (`--slots-per-host`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_per_host: Option<u32>,
    /// `elastic_timeout`, in milliseconds, within [`hvd_env_vars::ELASTIC_TIMEOUT_SECONDS`] (`--elastic-timeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic_timeout_ms: Option<u64>,
    /// `cooldown = [MIN, MAX]`: the blacklist cooldown range in whole seconds, within [`COOLDOWN_SECONDS`], MIN at
    /// most MAX (`--blacklist-cooldown-range`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown_seconds: Option<(u64, u64)>,
}

impl Elastic {
    /// Whether no setting is given (the step's serialized form then has no `elastic`).
    pub fn is_empty(&self) -> bool {
        *self == Elastic::default()
    }
}

/// The optional `cluster { ... }` block: which engine runs distributed steps, and its settings.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cluster {
    pub engine: Option<EngineKind>,
    /// `hosts = ["h1:4", "h2:4"]` for ssh/mpi.
    pub hosts: Vec<String>,
    /// Container image (kubernetes).
    pub image: Option<String>,
    /// Kubernetes namespace.
    pub namespace: Option<String>,
    /// Slurm partition.
    pub partition: Option<String>,
    /// `settings = { ... }`: the engines' settings, checked against [`SETTINGS`].
    pub settings: EngineSettings,
    /// `caches = ["s3://bucket/prefix", ...]`: binary caches `hvd build` substitutes store paths from, after
    /// `--cache` and `HVD_CACHES` (docs/store.md, "Binary cache").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caches: Vec<String>,
}

/// The type of an engine setting's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettingType {
    /// A string.
    Text,
    /// A path (a string).
    Path,
    /// A TCP port, 1-65535 (a number, or a string of digits).
    Port,
    /// A positive whole number (or a string of digits).
    Count,
    /// A whole number of seconds (or a string of digits).
    Seconds,
    /// `true` or `false` (also `"yes"`/`"no"`, `1`/`0`).
    Flag,
}

impl SettingType {
    /// How a diagnostic names what is expected.
    pub fn expected(self) -> &'static str {
        match self {
            SettingType::Text => "a string",
            SettingType::Path => "a path (a string)",
            SettingType::Port => "a port number (1-65535)",
            SettingType::Count => "a positive whole number",
            SettingType::Seconds => "a whole number of seconds",
            SettingType::Flag => "`true` or `false`",
        }
    }

    /// Reads `value` as this type.
    fn read(self, value: &SettingValue<'_>) -> Option<Typed> {
        let number = |value: &SettingValue<'_>| match *value {
            SettingValue::Int(n) => u64::try_from(n).ok(),
            SettingValue::Str(s) if !s.trim().is_empty() => s.trim().parse().ok(),
            _ => None,
        };
        match self {
            SettingType::Text | SettingType::Path => match *value {
                SettingValue::Str(s) => Some(Typed::Text(s.to_owned())),
                _ => None,
            },
            SettingType::Port => number(value)
                .filter(|n| (1..=65535).contains(n))
                .map(Typed::Number),
            SettingType::Count => number(value).filter(|n| *n > 0).map(Typed::Number),
            SettingType::Seconds => number(value).map(Typed::Number),
            SettingType::Flag => match *value {
                SettingValue::Bool(b) => Some(Typed::Flag(b)),
                SettingValue::Int(1) => Some(Typed::Flag(true)),
                SettingValue::Int(0) => Some(Typed::Flag(false)),
                SettingValue::Str(s) => match s.trim() {
                    "true" | "yes" | "1" => Some(Typed::Flag(true)),
                    "false" | "no" | "0" => Some(Typed::Flag(false)),
                    _ => None,
                },
                _ => None,
            },
        }
    }
}

/// A setting's value as written in the file (a scalar).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SettingValue<'a> {
    Str(&'a str),
    Int(i64),
    Bool(bool),
    Float(f64),
}

impl std::fmt::Display for SettingValue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SettingValue::Str(s) => f.write_str(s),
            SettingValue::Int(n) => write!(f, "{n}"),
            SettingValue::Bool(b) => write!(f, "{b}"),
            SettingValue::Float(x) => write!(f, "{x}"),
        }
    }
}

/// A value read as its [`SettingType`].
enum Typed {
    Text(String),
    Number(u64),
    Flag(bool),
}

/// Converts a [`Typed`] value into a field's Rust type (the schema chose the [`SettingType`] that fits).
trait FromTyped: Sized {
    fn from_typed(typed: Typed) -> Option<Self>;
}

impl FromTyped for String {
    fn from_typed(typed: Typed) -> Option<Self> {
        match typed {
            Typed::Text(s) => Some(s),
            _ => None,
        }
    }
}

impl FromTyped for PathBuf {
    fn from_typed(typed: Typed) -> Option<Self> {
        String::from_typed(typed).map(PathBuf::from)
    }
}

impl FromTyped for u16 {
    fn from_typed(typed: Typed) -> Option<Self> {
        match typed {
            Typed::Number(n) => u16::try_from(n).ok(),
            _ => None,
        }
    }
}

impl FromTyped for u32 {
    fn from_typed(typed: Typed) -> Option<Self> {
        match typed {
            Typed::Number(n) => u32::try_from(n).ok(),
            _ => None,
        }
    }
}

impl FromTyped for bool {
    fn from_typed(typed: Typed) -> Option<Self> {
        match typed {
            Typed::Flag(b) => Some(b),
            _ => None,
        }
    }
}

/// One engine setting as the schema declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SettingSpec {
    pub key: &'static str,
    pub ty: SettingType,
    /// The engines that read it (a cluster block may carry settings of several engines: `--engine` chooses).
    pub engines: &'static [EngineKind],
    /// What it means (docs/engines.md lists the same).
    pub doc: &'static str,
}

/// Why a setting was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    #[error("unknown setting `{0}`")]
    Unknown(String),
    #[error("setting `{key}` is {expected}, not `{found}`")]
    Type {
        key: String,
        expected: &'static str,
        found: String,
    },
}

/// Settings whose key starts with this prefix are Spark configuration, passed on to Spark's `SparkConf` (off every
/// command line: docs/security.md).
pub const SPARK_CONF_PREFIX: &str = "spark.";

/// Declares the engine settings once: the typed fields of [`EngineSettings`], the [`SETTINGS`] table lang checks
/// files against (and the docs list), and [`EngineSettings::set`].
macro_rules! engine_settings {
    ($($(#[doc = $doc:literal])+ $key:ident: $rust:ty = $ty:ident for [$($engine:ident),+];)+) => {
        /// The typed settings of `cluster { settings = { ... } }`: each key of [`SETTINGS`], and the `spark.*`
        /// entries.
        #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
        pub struct EngineSettings {
            $($(#[doc = $doc])+
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub $key: Option<$rust>,)+
            /// `"spark.KEY" = VALUE` entries, passed to Spark's `SparkConf` (not on a command line).
            #[serde(flatten)]
            pub spark_conf: BTreeMap<String, String>,
        }

        /// Every engine setting, with its type and the engines that read it.
        pub const SETTINGS: &[SettingSpec] = &[$(SettingSpec {
            key: stringify!($key),
            ty: SettingType::$ty,
            engines: &[$(EngineKind::$engine),+],
            doc: concat!($($doc),+),
        }),+];

        impl EngineSettings {
            /// Sets `key` to `value`, checked against its declared type; a `spark.*` key takes any scalar.
            pub fn set(&mut self, key: &str, value: SettingValue<'_>) -> Result<(), SettingError> {
                if key.starts_with(SPARK_CONF_PREFIX) {
                    self.spark_conf.insert(key.to_owned(), value.to_string());
                    return Ok(());
                }
                let refused = |ty: SettingType| SettingError::Type {
                    key: key.to_owned(),
                    expected: ty.expected(),
                    found: value.to_string(),
                };
                match key {
                    $(stringify!($key) => {
                        let ty = SettingType::$ty;
                        let typed = ty.read(&value).ok_or_else(|| refused(ty))?;
                        self.$key = Some(<$rust>::from_typed(typed).ok_or_else(|| refused(ty))?);
                        Ok(())
                    })+
                    _ => Err(SettingError::Unknown(key.to_owned())),
                }
            }
        }
    };
}

engine_settings! {
    /// `openmpi` or `mpich` (default: detected from `mpirun --version`).
    mpi: String = Text for [Mpi, Kubernetes];
    /// The mpirun program (default: found on PATH).
    mpirun: PathBuf = Path for [Mpi];
    /// ssh port (default: ssh's own, from its config).
    ssh_port: u16 = Port for [Ssh];
    /// ssh identity (private key) file.
    ssh_identity: PathBuf = Path for [Ssh];
    /// ssh config file (`ssh -F FILE`).
    ssh_config: PathBuf = Path for [Ssh];
    /// The interface the rendezvous binds and the workers use (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME).
    network_interface: String = Text for [Ssh, Spark];
    /// Copy the env's store paths to hosts that lack them (tar over ssh).
    copy_env: bool = Flag for [Ssh];
    /// The Spark master URL (default: `local[N]`).
    master: String = Text for [Spark];
    /// The Python (with pyspark) that runs the driver and the tasks.
    python: PathBuf = Path for [Spark];
    /// Seconds the driver waits for executors with enough task slots (default 120, 300 for `local-cluster`).
    slots_timeout: u32 = Seconds for [Spark];
    /// Nodes per batch job (default: the number of `hosts`, else 1).
    nodes: u32 = Count for [Slurm];
    /// Add `--overcommit` to the batch jobs.
    overcommit: bool = Flag for [Slurm];
}

/// Which engine runs a project's distributed steps (`cluster { engine }`, `hvd run --engine`): the language's list
/// of engine names, which the launcher maps to its engines (docs/engines.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Local,
    Ssh,
    Mpi,
    Slurm,
    Kubernetes,
    Spark,
}

/// A name that is not an engine ([`EngineKind`]'s `FromStr`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown engine `{0}`: use `local`, `ssh`, `mpi`, `slurm`, `kubernetes` or `spark` (see docs/engines.md)"
)]
pub struct UnknownEngine(pub String);

impl EngineKind {
    /// Every engine, in the order the docs list them.
    pub const ALL: [EngineKind; 6] = [
        EngineKind::Local,
        EngineKind::Ssh,
        EngineKind::Mpi,
        EngineKind::Slurm,
        EngineKind::Kubernetes,
        EngineKind::Spark,
    ];

    /// The name in `.hvd` files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Local => "local",
            EngineKind::Ssh => "ssh",
            EngineKind::Mpi => "mpi",
            EngineKind::Slurm => "slurm",
            EngineKind::Kubernetes => "kubernetes",
            EngineKind::Spark => "spark",
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for EngineKind {
    type Err = UnknownEngine;

    fn from_str(name: &str) -> Result<Self, UnknownEngine> {
        EngineKind::ALL
            .into_iter()
            .find(|e| e.name() == name)
            .ok_or_else(|| UnknownEngine(name.to_owned()))
    }
}
