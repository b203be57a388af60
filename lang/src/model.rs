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
    /// Number of workers; `None` means the step runs once, not distributed.
    pub workers: Option<u32>,
    /// Input paths (files or directories, relative to the project directory) whose content feeds the step's hash.
    pub inputs: Vec<String>,
    /// Output paths the step produces.
    pub outputs: Vec<String>,
    /// Extra environment variables for this step.
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit for the step, in milliseconds.
    pub timeout_ms: Option<u64>,
}

/// The optional `cluster { ... }` block: which engine runs distributed steps, and its settings.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cluster {
    /// `local`, `ssh`, `mpi`, `slurm`, `kubernetes` or `spark`.
    pub engine: Option<String>,
    /// `hosts = ["h1:4", "h2:4"]` for ssh/mpi.
    pub hosts: Vec<String>,
    /// Container image (kubernetes).
    pub image: Option<String>,
    /// Kubernetes namespace.
    pub namespace: Option<String>,
    /// Slurm partition.
    pub partition: Option<String>,
    /// Engine-specific settings that are not modelled above, as strings.
    pub settings: BTreeMap<String, String>,
}
