//! `lock`: an `Env` in, a `Lockfile` out. Also which index to use and the toolchain pin.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hvd_lang::model::Env;
use pep440_rs::Version;

use crate::deadline::HttpDeadlines;
use crate::index::{IndexClient, IndexError, IndexOptions, default_cache_dir};
use crate::lockfile::{
    ArtifactKind, LockedBuild, Lockfile, Request, RequestedBuild, SCHEMA_VERSION, ToolPin,
    ToolchainPin, env_hash,
};
use crate::names::{normalize_name, normalize_requirement};
pub use crate::pip_config::discover_ca_bundle;
use crate::solver::{self, Asked, BadRequirement, Resolution, SolveError};
use crate::source::{FetchCallback, IndexSource, SourceError, SourceMetadataProvider};
use crate::tags::{Platform, TargetError, TargetSpec};

/// How to lock.
#[derive(Clone, Default)]
pub struct LockOptions {
    /// Use this index, overriding `env.index` and pip's configuration (tests, `--index`).
    pub index_url: Option<String>,
    /// Cache directory; default `$HVD_CACHE_DIR`, else `<user cache dir>/hvd`.
    pub cache_dir: Option<PathBuf>,
    /// Use only the cache.
    pub offline: bool,
    /// Ignore every existing pin.
    pub upgrade: bool,
    /// Ignore the existing pins of these packages.
    pub upgrade_packages: Vec<String>,
    /// The current lock: its pins are kept when still allowed.
    pub existing: Option<Lockfile>,
    /// The target platform; default the host.
    pub platform: Option<Platform>,
    /// Skip pinning the toolchain (tests on machines without a compiler).
    pub skip_toolchain: bool,
    /// Metadata of sdists without static metadata (the builder implements it).
    pub source_metadata: Option<Arc<dyn SourceMetadataProvider>>,
    /// Called with each project name as its page is requested (progress display).
    pub on_fetch: Option<FetchCallback>,
    /// How long one request may take; default [`HttpDeadlines::from_env`].
    pub deadlines: Option<HttpDeadlines>,
}

impl std::fmt::Debug for LockOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockOptions")
            .field("index_url", &self.index_url)
            .field("cache_dir", &self.cache_dir)
            .field("offline", &self.offline)
            .field("upgrade", &self.upgrade)
            .field("upgrade_packages", &self.upgrade_packages)
            .finish_non_exhaustive()
    }
}

/// Why locking failed.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error(
        "no package index configured: set `index = \"...\"` in the env, PIP_INDEX_URL, or an `index-url` in pip.conf ({0})"
    )]
    NoIndex(String),
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("{0}")]
    NoSolution(String),
    #[error(transparent)]
    BadRequirement(#[from] BadRequirement),
    #[error("{0}")]
    Toolchain(String),
    /// Pinning a gcc from Debian's archive failed (network, a bad index).
    #[error("failed to pin a toolchain from Debian")]
    Debian(#[source] crate::debian::DebianError),
    #[error("failed to start the async runtime")]
    Runtime(#[source] std::io::Error),
    #[error("the index gave an artifact hvd will not lock: {0}")]
    Unlockable(String),
}

impl From<SolveError<SourceError>> for ResolveError {
    fn from(e: SolveError<SourceError>) -> Self {
        match e {
            SolveError::NoSolution(text) => ResolveError::NoSolution(text),
            SolveError::BadRequirement(bad) => ResolveError::BadRequirement(bad),
            SolveError::Source(e) => ResolveError::Source(e),
        }
    }
}

/// Network counters of one lock run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LockStats {
    pub requests: u64,
    pub not_modified: u64,
    pub cache_hits: u64,
    pub bytes: u64,
}

/// A lock and how it was obtained.
#[derive(Debug, Clone)]
pub struct Locked {
    pub lockfile: Lockfile,
    pub stats: LockStats,
    pub index_url: String,
    /// What the user should be told (each once); the caller renders them.
    pub warnings: Vec<String>,
}

/// Resolve `env` into a lockfile. Creates its own async runtime: call it from synchronous code.
pub fn lock(env: &Env, options: &LockOptions) -> Result<Lockfile, ResolveError> {
    lock_detailed(env, options).map(|l| l.lockfile)
}

/// [`lock`], also returning request counters and the index used.
pub fn lock_detailed(env: &Env, options: &LockOptions) -> Result<Locked, ResolveError> {
    let platform = options.platform.clone().unwrap_or_else(Platform::host);
    let target = Arc::new(TargetSpec::new(&env.python, platform)?);
    let index_url = match options.index_url.clone().or_else(|| env.index.clone()) {
        Some(url) => url,
        None => discover_index_url()?,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .map_err(ResolveError::Runtime)?;
    let client = IndexClient::new(IndexOptions {
        index_url: index_url.clone(),
        cache_dir: options.cache_dir.clone().unwrap_or_else(default_cache_dir),
        offline: options.offline,
        ca_bundle: discover_ca_bundle(),
        deadlines: match options.deadlines {
            Some(d) => d,
            None => HttpDeadlines::from_env().map_err(IndexError::from)?,
        },
    })?;
    // Temp files of a lock that was killed mid-write; at most once an hour, so a lock pays nothing for it.
    client.remove_stale_temps();

    let build_names: BTreeSet<String> = env
        .packages
        .iter()
        .filter(|p| p.build.is_some())
        .filter_map(|p| requirement_name(&p.requirement))
        .collect();
    let upgrade: BTreeSet<String> = options
        .upgrade_packages
        .iter()
        .map(|n| normalize_name(n))
        .collect();
    let keep = |name: &str| !options.upgrade && !upgrade.contains(name);
    let mut preferences = HashMap::new();
    let mut build_preferences = HashMap::new();
    if let Some(existing) = &options.existing {
        for p in &existing.packages {
            if let (true, Ok(v)) = (keep(&p.name), Version::from_str(&p.version)) {
                preferences.insert(p.name.clone(), v);
            }
        }
        for b in &existing.builds {
            for p in &b.packages {
                if let (true, Ok(v)) = (keep(&p.name), Version::from_str(&p.version)) {
                    build_preferences.insert((b.package.clone(), p.name.clone()), v);
                }
            }
        }
    }

    let source = IndexSource::new(
        client.clone(),
        runtime.handle().clone(),
        target.clone(),
        build_names.clone(),
        preferences.clone(),
        options.source_metadata.clone(),
        options.on_fetch.clone(),
    );
    let words = target.describe();
    let roots: Vec<String> = env.packages.iter().map(|p| p.requirement.clone()).collect();
    let asked = Asked::all(&roots, "the env's packages");
    // Start every root page (and, speculatively, the graph below it) at once; the solver finds them in flight.
    for req in roots
        .iter()
        .filter_map(|r| pep508_rs::Requirement::<pep508_rs::VerbatimUrl>::from_str(r).ok())
    {
        let range = match &req.version_or_url {
            Some(pep508_rs::VersionOrUrl::VersionSpecifier(spec)) => {
                Some(pubgrub::Ranges::from(spec.clone()))
            }
            _ => None,
        };
        source.prefetch(req.name.as_ref(), range);
    }
    // With an existing lock, the whole graph is known up front: fetch every pinned page at once instead of
    // discovering it level by level (a relock then costs one round of revalidations).
    for (name, version) in &preferences {
        source.prefetch(name, Some(pubgrub::Ranges::singleton(version.clone())));
    }
    // A build with `against` installs the env's versions of the `against` packages' closure, so its requirements
    // on packages of that closure bind the env too: solve again with each one the solution breaks as a constraint
    // (each is added once, so this ends).
    let mut constraints: Vec<Asked> = Vec::new();
    let resolution = loop {
        let resolution = solver::solve(
            &source,
            &asked,
            &constraints,
            &target.markers,
            &preferences,
            &words,
        )?;
        let broken = shared_build_requirements(env, &resolution, &target.markers)
            .into_iter()
            .filter(|c| !constraints.contains(c))
            .collect::<Vec<_>>();
        if broken.is_empty() {
            break resolution;
        }
        constraints.extend(broken);
    };
    let packages = source.locked_packages(&resolution)?;

    let mut builds = Vec::new();
    for request in &env.packages {
        let Some(build) = &request.build else {
            continue;
        };
        let Some(name) = requirement_name(&request.requirement) else {
            continue;
        };
        let normalized = RequestedBuild::from_source_build(build);
        let mut build_roots = Asked::all(
            &normalized.requires,
            &format!("`{name}`'s build requirements"),
        );
        for against in &normalized.against {
            if !resolution.packages.contains_key(against) {
                return Err(ResolveError::NoSolution(format!(
                    "the build of `{name}` compiles against `{against}`, which is not among the locked packages; add it to env.packages"
                )));
            }
        }
        // The `against` packages and everything they pull in are installed in the build env from the runtime
        // lock, so the build resolution must agree with it: pin that whole closure to its runtime versions.
        let closure = runtime_closure(&resolution, &normalized.against);
        for package in &closure {
            if let Some((v, _)) = resolution.packages.get(package) {
                build_roots.push(Asked {
                    requirement: format!("{package}=={v}"),
                    by: format!(
                        "the env's lock, since `{name}`'s build installs {} and what it needs at the env's versions",
                        normalized.against.join(", ")
                    ),
                });
            }
        }
        let prefs: HashMap<String, Version> = build_preferences
            .iter()
            .filter(|((b, _), _)| b == &name)
            .map(|((_, p), v)| (p.clone(), v.clone()))
            .collect();
        let build_resolution =
            solver::solve(&source, &build_roots, &[], &target.markers, &prefs, &words).map_err(
                |e| match ResolveError::from(e) {
                    ResolveError::NoSolution(t) => ResolveError::NoSolution(format!(
                        "the build requirements of `{name}` have no solution:\n{t}"
                    )),
                    other => other,
                },
            )?;
        let mut locked = source.locked_packages(&build_resolution)?;
        locked.retain(|p| !closure.contains(&p.name));
        builds.push(LockedBuild {
            package: name,
            requires: normalized.requires,
            env: normalized.env,
            against: normalized.against,
            no_build_isolation: normalized.no_build_isolation,
            packages: locked,
        });
    }

    // An sdist picked for a package without a recipe is built with its own PEP 517 backend: lock the build
    // requirements its pyproject.toml declares (or the PEP 517 default), so the builder installs them from the
    // store. The sdist was already downloaded for its PKG-INFO; that read cached them.
    for package in &packages {
        if package.artifact.kind != ArtifactKind::Sdist
            || builds
                .iter()
                .any(|b: &LockedBuild| b.package == package.name)
        {
            continue;
        }
        let name = package.name.clone();
        let version = Version::from_str(&package.version)
            .map_err(|e| ResolveError::NoSolution(format!("bad version of `{name}`: {e}")))?;
        let (file, _) = source.artifact(&name, &version)?;
        let requires: Vec<String> = runtime
            .block_on(client.sdist_build_requires(&file))?
            .iter()
            .map(|r| normalize_requirement(r))
            .collect();
        let prefs: HashMap<String, Version> = build_preferences
            .iter()
            .filter(|((b, _), _)| b == &name)
            .map(|((_, p), v)| (p.clone(), v.clone()))
            .collect();
        let asked = Asked::all(&requires, &format!("`{name}`'s pyproject.toml"));
        let build_resolution = solver::solve(&source, &asked, &[], &target.markers, &prefs, &words)
            .map_err(|e| match ResolveError::from(e) {
                ResolveError::NoSolution(t) => ResolveError::NoSolution(format!(
                    "the build requirements of `{name}` (from its sdist's pyproject.toml) have no solution:\n{t}"
                )),
                other => other,
            })?;
        builds.push(LockedBuild {
            package: name,
            requires,
            env: Default::default(),
            against: Vec::new(),
            no_build_isolation: false,
            packages: source.locked_packages(&build_resolution)?,
        });
    }

    let toolchain = match (&env.toolchain, options.skip_toolchain) {
        (Some(t), false) => Some(pin_host_or_debian(
            &t.name,
            &t.version,
            target.platform.glibc,
            options,
            &runtime,
        )?),
        _ => None,
    };
    let mut lockfile = Lockfile {
        version: SCHEMA_VERSION,
        env_hash: env_hash(env),
        request: Request::from_env(env),
        target: target.to_lock(),
        toolchain,
        packages,
        builds,
    };
    // The interpreter's store path is pinned by the caller (it needs the store); a relock keeps the old pin while
    // it is for the same python.
    lockfile.target.installation = options
        .existing
        .as_ref()
        .and_then(|l| l.target.installation.clone())
        .filter(|pin| {
            pin.version
                .starts_with(&format!("{}.", lockfile.target.python))
        });
    lockfile.canonicalize();
    // Never write a lockfile that the reader would refuse (e.g. a file name of another package from a hostile page).
    lockfile.validate().map_err(ResolveError::Unlockable)?;
    let s = &client.stats;
    let stats = LockStats {
        requests: s.requests.load(Ordering::Relaxed),
        not_modified: s.not_modified.load(Ordering::Relaxed),
        cache_hits: s.cache_hits.load(Ordering::Relaxed),
        bytes: s.bytes.load(Ordering::Relaxed),
    };
    let warnings = source.warnings();
    drop(source);
    runtime.shutdown_background();
    Ok(Locked {
        lockfile,
        stats,
        index_url,
        warnings,
    })
}

/// The build requirements `resolution` breaks on packages a build shares with the env: a build with `against`
/// installs those packages and their closure at the env's versions (e.g. horovod's `setuptools<82` against torch
/// 2.0.1, whose CUDA wheels depend on setuptools), so the env must satisfy its requirements on them.
fn shared_build_requirements(
    env: &Env,
    resolution: &Resolution,
    markers: &pep508_rs::MarkerEnvironment,
) -> Vec<Asked> {
    let mut broken = Vec::new();
    for request in &env.packages {
        let (Some(build), Some(name)) = (&request.build, requirement_name(&request.requirement))
        else {
            continue;
        };
        let normalized = RequestedBuild::from_source_build(build);
        let closure = runtime_closure(resolution, &normalized.against);
        for requirement in &normalized.requires {
            if solver::breaks(resolution, requirement, markers, |n| closure.contains(n)) {
                broken.push(Asked {
                    requirement: requirement.clone(),
                    by: format!(
                        "`{name}`'s build, which installs {} and what it needs at the env's versions",
                        normalized.against.join(", ")
                    ),
                });
            }
        }
    }
    broken
}

/// `roots` and every package reachable from them through the resolution's dependency edges.
fn runtime_closure(resolution: &Resolution, roots: &[String]) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack: Vec<String> = roots.to_vec();
    while let Some(name) = stack.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        if let Some((_, edges)) = resolution.packages.get(&name) {
            stack.extend(edges.iter().map(|e| e.name.clone()));
        }
    }
    seen
}

fn requirement_name(requirement: &str) -> Option<String> {
    pep508_rs::Requirement::<pep508_rs::VerbatimUrl>::from_str(requirement)
        .ok()
        .map(|r| r.name.to_string())
}

/// The index pip would use: PIP_INDEX_URL, else pip configuration files, else pip's built-in default asked
/// from `python3`. Never a host written in this repository.
pub(crate) fn discover_index_url() -> Result<String, ResolveError> {
    if let Some(url) = std::env::var("PIP_INDEX_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
    {
        return Ok(url.trim().to_string());
    }
    if let Some(url) = crate::pip_config::index_url() {
        return Ok(url);
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "from pip._internal.models.index import PyPI; print(PyPI.simple_url)",
        ])
        .output()
        .map_err(|e| ResolveError::NoIndex(format!("running `python3` failed: {e}")))?;
    let url = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() && url.starts_with("http") {
        Ok(url)
    } else {
        Err(ResolveError::NoIndex(
            "`python3` could not tell pip's default index; is pip installed?".into(),
        ))
    }
}

fn find_on_path(command: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(command))
        .find(|p| p.is_file())
}

fn compiler_version(path: &Path) -> Option<String> {
    let out = std::process::Command::new(path)
        .arg("-dumpfullversion")
        .output()
        .ok()?;
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() && !v.is_empty() {
        return Some(v);
    }
    let out = std::process::Command::new(path)
        .arg("--version")
        .output()
        .ok()?;
    let first = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .to_string();
    first
        .split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(str::to_string)
}

/// The existing lock's Debian pin when it answers the same request (unless upgrading); else the host's compiler when
/// it matches (the default); else, for gcc, a new pin from the machine's Debian archive (`crate::debian`).
fn pin_host_or_debian(
    name: &str,
    requested: &str,
    host_glibc: Option<(u64, u64)>,
    options: &LockOptions,
    runtime: &tokio::runtime::Runtime,
) -> Result<ToolchainPin, ResolveError> {
    // An existing Debian pin for the same request is kept before the host is asked: a teammate whose gcc N is on
    // PATH must not flip the lock to their driver's path (`--upgrade` asks again).
    if !options.upgrade
        && let Some(existing) = options.existing.as_ref().and_then(|l| l.toolchain.as_ref())
        && existing.name == name
        && existing.requested == requested
        && existing.debian.is_some()
    {
        return Ok(existing.clone());
    }
    let host_error = match pin_toolchain(name, requested) {
        Ok(pin) => return Ok(pin),
        Err(e) if name == "gcc" => e,
        Err(e) => return Err(e),
    };
    let cache_dir = options.cache_dir.clone().unwrap_or_else(default_cache_dir);
    let archives = crate::debian::Archives::discover().map_err(ResolveError::Debian)?;
    runtime
        .block_on(crate::debian::pin_gcc(
            requested,
            &archives,
            host_glibc,
            &cache_dir,
            options.offline,
        ))
        .map_err(|e| match e {
            crate::debian::DebianError::NotFound { .. }
            | crate::debian::DebianError::GlibcTooOld { .. }
            | crate::debian::DebianError::NoArchive => {
                ResolveError::Toolchain(format!("{host_error}. Nor from Debian: {e}"))
            }
            other => ResolveError::Debian(other),
        })
}

/// Find the compilers of a toolchain on PATH, check their version, and record path, version and sha256.
pub(crate) fn pin_toolchain(name: &str, requested: &str) -> Result<ToolchainPin, ResolveError> {
    let commands: Vec<&str> = match name {
        "gcc" => vec!["gcc", "g++"],
        "clang" => vec!["clang", "clang++"],
        other => vec![other],
    };
    let matches = |v: &str| v == requested || v.starts_with(&format!("{requested}."));
    let mut tools = Vec::new();
    for command in commands {
        let mut seen = Vec::new();
        let mut chosen = None;
        for candidate in [format!("{command}-{requested}"), command.to_string()] {
            let Some(path) = find_on_path(&candidate) else {
                continue;
            };
            let Some(version) = compiler_version(&path) else {
                continue;
            };
            if matches(&version) {
                chosen = Some((candidate, path, version));
                break;
            }
            seen.push(format!("`{candidate}` is {version}"));
        }
        let Some((_, path, version)) = chosen else {
            let found = if seen.is_empty() {
                "none is on PATH".to_string()
            } else {
                seen.join(", ")
            };
            return Err(ResolveError::Toolchain(format!(
                "env.toolchain asks for {name} {requested}, but `{command}` {requested} was not found ({found}); install it or change env.toolchain"
            )));
        };
        let real = fs_err::canonicalize(&path).unwrap_or(path);
        let bytes = fs_err::read(&real)
            .map_err(|e| ResolveError::Toolchain(format!("failed to hash compiler: {e}")))?;
        tools.push(ToolPin {
            command: command.to_string(),
            path: real.display().to_string(),
            version,
            sha256: crate::digest::Sha256::of_bytes(&bytes),
        });
    }
    Ok(ToolchainPin {
        name: name.to_string(),
        requested: requested.to_string(),
        tools,
        debian: None,
        debs: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_the_host_compiler_or_explains() {
        match pin_toolchain("gcc", "1") {
            Ok(_) => panic!("no gcc 1 anywhere"),
            Err(e) => assert!(e.to_string().contains("gcc 1"), "{e}"),
        }
        // When a gcc exists, pinning its own major version works and records a sha256.
        if let Some(path) = find_on_path("gcc") {
            let version = compiler_version(&path).unwrap();
            let major = version.split('.').next().unwrap();
            let pin = pin_toolchain("gcc", major).unwrap();
            assert!(
                pin.tools
                    .iter()
                    .any(|t| t.command == "gcc" && t.sha256.as_str().len() == 64)
            );
        }
    }
}
