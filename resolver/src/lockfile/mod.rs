//! The lockfile (`train.hvd.lock`): types, a deterministic TOML writer, a reader that refuses newer schemas,
//! the env hash and the field-by-field staleness check.
//!
//! The format and its compatibility rules are documented in `docs/lockfile.md`. The writer is hand-written
//! (not `toml::to_string`) so the bytes depend only on the data and this file, never on a serializer's
//! formatting choices: same input, same bytes, one artifact per line.
//!
//! This module holds the lockfile's model; the rest is split by role: `read` parses and validates what comes
//! from outside, `write` is the writer, and `staleness` compares a lock with the env it was made for.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hvd_lang::model::{Env, PackageRequest, SourceBuild};
use serde::{Deserialize, Serialize};
use sha2::Digest;

pub use crate::digest::Sha256;
use crate::names::{normalize_name, normalize_requirement};

mod read;
mod staleness;
mod write;

pub use read::is_local_url;
pub use staleness::{FieldChange, Staleness};

/// The schema version this build writes and the newest it reads.
pub const SCHEMA_VERSION: u32 = 1;

/// A whole lockfile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Lockfile {
    /// Schema version ([`SCHEMA_VERSION`] when written by this build).
    pub version: u32,
    /// `sha256:<hex>` of the normalized `env` ([`env_hash`]).
    pub env_hash: String,
    /// What was asked, normalized, so staleness can be explained field by field.
    pub request: Request,
    /// What it was resolved for.
    pub target: Target,
    /// The compiler found at lock time, when the env names a toolchain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toolchain: Option<ToolchainPin>,
    /// Every runtime package, sorted by name.
    #[serde(default, rename = "package")]
    pub packages: Vec<LockedPackage>,
    /// Every source build, sorted by package name.
    #[serde(default, rename = "build")]
    pub builds: Vec<LockedBuild>,
}

/// The normalized echo of `env`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Request {
    /// `env.python`.
    pub python: String,
    /// `env.index` as written in the file (`None`: pip's configuration was used; see each package's `index`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<String>,
    /// `env.toolchain`: `"<name> <version>"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toolchain: Option<String>,
    /// `env.packages` in file order.
    #[serde(default)]
    pub packages: Vec<RequestedPackage>,
    /// `env.variables`.
    #[serde(default)]
    pub variables: BTreeMap<String, String>,
}

/// One entry of `env.packages`, normalized.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct RequestedPackage {
    /// The PEP 508 requirement, normalized (lowercase name, canonical spacing).
    pub requirement: String,
    /// The source build recipe, when the package is built from source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<RequestedBuild>,
}

/// The normalized `SourceBuild` of a request.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct RequestedBuild {
    #[serde(default)]
    pub requires: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub against: Vec<String>,
    #[serde(default)]
    pub no_build_isolation: bool,
}

/// The interpreter and platform the lock was resolved for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Target {
    /// `major.minor` of the interpreter, e.g. `"3.11"`.
    pub python: String,
    /// The full version markers were evaluated with (`python_full_version`), e.g. `"3.11.0"`.
    pub python_full: String,
    /// Interpreter tag, e.g. `"cp311"`.
    pub interpreter: String,
    /// ABI tag, e.g. `"cp311"`.
    pub abi: String,
    /// `sys.platform`, e.g. `"linux"`.
    pub os: String,
    /// `platform.machine()`, e.g. `"x86_64"`.
    pub arch: String,
    /// The newest `manylinux_X_Y` accepted (the host's glibc), e.g. `"2.36"`; `None` off glibc.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glibc: Option<String>,
    /// The platform tags accepted, best first. `manylinux_X_Y` tags older than `glibc` (and the
    /// `manylinux1/2010/2014` aliases) are accepted too; they are implied, not listed.
    pub platforms: Vec<String>,
    /// The interpreter's store path, pinned exactly (docs/store.md, "The interpreter"); absent in locks written
    /// before interpreters were store paths, or when no interpreter of `python` was found at lock time: the build
    /// then copies in the host's interpreter unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub installation: Option<InstallationPin>,
}

/// The interpreter's store path: its full version and the content hash of its (relocated) tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct InstallationPin {
    /// `major.minor.micro`, e.g. `"3.11.7"`.
    pub version: String,
    /// The store path's content hash.
    pub content_hash: Sha256,
}

/// The compiler pinned at lock time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ToolchainPin {
    /// `env.toolchain.name`, e.g. `"gcc"`.
    pub name: String,
    /// `env.toolchain.version` as requested, e.g. `"12"`.
    pub requested: String,
    /// The compilers found on PATH (e.g. `gcc` and `g++`), sorted by command; empty for a toolchain from Debian.
    pub tools: Vec<ToolPin>,
    /// Where a toolchain the host lacks comes from (docs/eras.md, "Toolchains"); absent for the host's compiler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debian: Option<DebianSource>,
    /// The `.deb`s of a toolchain from Debian, sorted by name; empty for the host's compiler.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub debs: Vec<DebPin>,
}

/// The Debian archive and suite a toolchain was pinned from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DebianSource {
    /// The archive's base URL (the folder holding `dists/` and `pool/`), from the machine's apt sources.
    pub archive: String,
    /// e.g. `"bullseye"`.
    pub suite: String,
    /// The compiler's upstream version, e.g. `"10.2.1"`.
    pub version: String,
    /// Debian's name of the machine architecture the packages are for (`"amd64"`, `"arm64"`); absent in locks
    /// written before it was recorded, which means `"amd64"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
}

impl DebianSource {
    /// [`Self::arch`], `"amd64"` when absent.
    pub fn arch(&self) -> &str {
        self.arch.as_deref().unwrap_or("amd64")
    }
}

/// One Debian package of a toolchain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DebPin {
    pub name: String,
    /// The Debian version, e.g. `"10.2.1-6"`.
    pub version: String,
    /// Its path in the archive, e.g. `"pool/main/g/gcc-10/gcc-10_10.2.1-6_amd64.deb"`.
    pub filename: String,
    /// From the suite's `Packages` index.
    pub sha256: Sha256,
    pub size: u64,
}

/// One compiler binary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ToolPin {
    /// The command looked up on PATH, e.g. `"g++"`.
    pub command: String,
    /// The binary it resolves to, symlinks followed.
    pub path: String,
    /// `<command> -dumpfullversion` (or the first line of `--version`).
    pub version: String,
    /// sha256 of the binary.
    pub sha256: Sha256,
}

/// One locked package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LockedPackage {
    /// Normalized name (PEP 503).
    pub name: String,
    pub version: String,
    /// The simple-API root it came from.
    pub index: String,
    /// The chosen file.
    pub artifact: Artifact,
    /// Dependency edges active for the target, sorted by name.
    #[serde(default)]
    pub dependencies: Vec<Dependency>,
}

/// A wheel or sdist file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Artifact {
    pub kind: ArtifactKind,
    pub filename: String,
    pub url: String,
    /// The sha256 the index listed (or, for an index that lists none, the one hvd computed while streaming the
    /// file at lock time). Validated when read: 64 hex digits, never empty.
    pub sha256: Sha256,
    /// Size in bytes; 0 when the index did not say (downloads then stop at a fixed maximum).
    pub size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArtifactKind {
    Wheel,
    Sdist,
}

impl ArtifactKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ArtifactKind::Wheel => "wheel",
            ArtifactKind::Sdist => "sdist",
        }
    }
}

/// A dependency edge.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Dependency {
    /// Normalized name of the dependency (a package of the same section).
    pub name: String,
    /// Extras requested on the edge, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extras: Vec<String>,
    /// The edge's marker as published (it evaluated to true for the target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub marker: Option<String>,
}

/// A source build: the recipe inputs and the separately locked build requirements.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LockedBuild {
    /// Normalized name of the runtime package this builds (its sdist is in `[[package]]`).
    #[serde(rename = "name")]
    pub package: String,
    /// Build requirements as requested (normalized).
    #[serde(default)]
    pub requires: Vec<String>,
    /// Environment variables for the build.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Runtime packages the build compiles against (normalized names; locked in `[[package]]`).
    #[serde(default)]
    pub against: Vec<String>,
    #[serde(default)]
    pub no_build_isolation: bool,
    /// The locked build requirements, sorted by name: the closure of `requires` minus the runtime closure of
    /// `against` (those come from `[[package]]`, and the build resolution is pinned to their versions).
    #[serde(default, rename = "package")]
    pub packages: Vec<LockedPackage>,
}

/// Reading a lockfile failed.
#[derive(Debug, thiserror::Error)]
pub enum LockfileError {
    #[error("failed to read lockfile")]
    Io(#[from] std::io::Error),
    #[error(
        "lockfile `{path}` has schema version {found}, newer than this hvd reads ({supported}); upgrade hvd, or delete the lockfile and run `hvd lock`"
    )]
    NewerSchema {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("lockfile `{path}` is not valid: {message}; delete it and run `hvd lock`")]
    Invalid { path: PathBuf, message: String },
}

impl Lockfile {
    /// The lockfile path of a `.hvd` file: `train.hvd` -> `train.hvd.lock`.
    pub fn path_for(hvd_file: &Path) -> PathBuf {
        let mut os = hvd_file.as_os_str().to_owned();
        os.push(".lock");
        PathBuf::from(os)
    }

    /// Look up a runtime package by (normalized) name.
    pub fn package(&self, name: &str) -> Option<&LockedPackage> {
        let name = normalize_name(name);
        self.packages.iter().find(|p| p.name == name)
    }

    /// Sort everything that has no meaningful order, so equal locks serialize to equal bytes.
    pub fn canonicalize(&mut self) {
        fn sort_packages(packages: &mut [LockedPackage]) {
            packages.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.version.cmp(&b.version)));
            for p in packages.iter_mut() {
                p.dependencies.sort();
                p.dependencies.dedup();
            }
        }
        sort_packages(&mut self.packages);
        self.builds.sort_by(|a, b| a.package.cmp(&b.package));
        for b in &mut self.builds {
            sort_packages(&mut b.packages);
        }
        if let Some(t) = &mut self.toolchain {
            t.tools.sort_by(|a, b| a.command.cmp(&b.command));
            t.debs.sort_by(|a, b| a.name.cmp(&b.name));
        }
    }
}

impl Request {
    /// The normalized echo of an env.
    pub fn from_env(env: &Env) -> Request {
        Request {
            python: env.python.trim().to_string(),
            index: env
                .index
                .as_ref()
                .map(|i| i.trim().trim_end_matches('/').to_string()),
            toolchain: env
                .toolchain
                .as_ref()
                .map(|t| format!("{} {}", t.name.trim(), t.version.trim())),
            packages: env
                .packages
                .iter()
                .map(RequestedPackage::from_request)
                .collect(),
            variables: env.variables.clone(),
        }
    }
}

impl RequestedPackage {
    fn from_request(p: &PackageRequest) -> RequestedPackage {
        RequestedPackage {
            requirement: normalize_requirement(&p.requirement),
            build: p.build.as_ref().map(RequestedBuild::from_source_build),
        }
    }
}

impl RequestedBuild {
    pub(crate) fn from_source_build(b: &SourceBuild) -> RequestedBuild {
        RequestedBuild {
            requires: b
                .requires
                .iter()
                .map(|r| normalize_requirement(r))
                .collect(),
            env: b.env.clone(),
            against: b.against.iter().map(|a| normalize_name(a)).collect(),
            no_build_isolation: b.no_build_isolation,
        }
    }
}

/// `sha256:<hex>` of the normalized env: its [`Request`] echo as canonical JSON. Only `env` counts (steps,
/// resources, comments and formatting do not).
pub fn env_hash(env: &Env) -> String {
    let request = Request::from_env(env);
    // serde_json writes struct fields in declaration order and BTreeMaps sorted: a stable encoding.
    let json = serde_json::to_vec(&request).unwrap_or_default();
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(&json)))
}

#[cfg(test)]
mod tests;
