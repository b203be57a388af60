//! The builder's input: what to put into an env. The CLI maps the resolver's `Lockfile` onto these types, so the
//! builder depends on no lockfile schema.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::fetch::Artifact;
use crate::toolchain::Toolchain;

/// One env to build.
#[derive(Debug, Clone)]
pub struct EnvPlan {
    /// Project name (used in the env's store path name).
    pub name: String,
    /// Requested interpreter, e.g. `3.11`.
    pub python: String,
    /// The lock's pin of the interpreter's store path (exact version and content hash); `None` for a lock written
    /// before interpreters were store paths: then the host's interpreter for `python` is copied in unchecked.
    pub interpreter: Option<crate::interpreter::InterpreterPin>,
    /// Runtime packages.
    pub packages: Vec<PackagePlan>,
    /// The lock's toolchain pin for source builds.
    pub toolchain: Option<Toolchain>,
    /// Extra local package directories (the hvd worker runtime); see [`LocalPackage`].
    pub local_packages: Vec<LocalPackage>,
}

/// One locked package.
#[derive(Debug, Clone)]
pub struct PackagePlan {
    pub name: String,
    pub version: String,
    /// The wheel, or the sdist when `build` is set.
    pub artifact: Artifact,
    /// Names of the packages this one depends on (the lock's edges); used to give source builds the closure of
    /// their `against` packages.
    pub dependencies: Vec<String>,
    pub build: Option<SourceBuildPlan>,
}

/// How to build a package from its sdist.
#[derive(Debug, Clone, Default)]
pub struct SourceBuildPlan {
    /// Locked build requirements (wheels, or sdists with their own build plans).
    pub requires: Vec<PackagePlan>,
    /// Recipe variables, e.g. `HOROVOD_WITH_TENSORFLOW = "1"`.
    pub env: BTreeMap<String, String>,
    /// Runtime packages (by name) compiled against; they and their dependencies are installed in the build env
    /// and their derivation hashes are inputs of this build.
    pub against: Vec<String>,
}

/// A directory whose contents are installed as a package's `site-packages` (e.g. a staged `hvd/` Python package
/// with `libhvd_runtime.so` inside). Its content hash is the derivation input, so editing it makes a new path.
#[derive(Debug, Clone)]
pub struct LocalPackage {
    pub name: String,
    pub version: String,
    /// The directory copied into `<path>/site-packages/`.
    pub source: PathBuf,
}

/// CI and cache modes.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuildOptions {
    /// Check the host toolchain against the lock's pin (`--locked`/`--frozen`).
    pub locked: bool,
    /// Never use the network (`--offline`).
    pub offline: bool,
    /// Rebuild source-built packages even when their paths exist, replacing them (`--rebuild`).
    pub rebuild: bool,
}
