//! `hvd build`: lock if needed, build the env into the store, keep a root link under `.hvd/` next to the file.
//!
//! [`ensure_env`] is the entry point other commands (`exec`, `shell`, `run`) use to get a built env.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use clap::Args;
use hvd_builder::{BuildOptions, EnvBuild, Progress, Store};
use hvd_resolver::Lockfile;

use crate::env_vars;
use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct BuildArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: PathBuf,
    #[command(flatten)]
    pub lock: LockMode,
    /// Rebuild source-built packages even when their store paths exist, replacing them.
    #[arg(long)]
    pub rebuild: bool,
    /// Rebuild every source-built package in a temp location and compare with the store (exit 4 on a difference).
    #[arg(long)]
    pub check: bool,
    #[command(flatten)]
    pub caches: super::substitute::CacheOptions,
}

/// How the lockfile is used; shared by `build`, `exec` and `shell`.
#[derive(Debug, Clone, Copy, Default, Args)]
pub struct LockMode {
    /// Fail (exit 3) unless the lockfile exists and matches the file; check the toolchain against its pin.
    #[arg(long)]
    pub locked: bool,
    /// Use the lockfile as it is, without checking it against the file.
    #[arg(long)]
    pub frozen: bool,
    /// Never touch the network: only the download cache and the store.
    #[arg(long)]
    pub offline: bool,
}

/// A built env and what it was built from.
#[derive(Debug)]
pub struct ReadyEnv {
    pub project: hvd_lang::model::Project,
    pub lock: Lockfile,
    pub build: EnvBuild,
    /// The root link kept next to the file (`.hvd/env`).
    pub link: PathBuf,
    /// Keeps the env alive for as long as this process (or what it `exec`s) runs, whatever the link points at.
    pub temp_root: hvd_builder::gc::TempRoot,
    /// Store paths installed from binary caches by this build.
    pub substituted: usize,
}

impl ReadyEnv {
    /// Variables a process inside the env gets: `VIRTUAL_ENV`, `PATH` with the env first, `env.variables`.
    pub fn variables(&self) -> Vec<(String, String)> {
        let path = std::env::var(env_vars::PATH).unwrap_or_default();
        let mut vars = vec![
            (
                env_vars::VIRTUAL_ENV.to_string(),
                self.build.env.display().to_string(),
            ),
            (
                env_vars::PATH.to_string(),
                format!("{}/bin:{path}", self.build.env.display()),
            ),
        ];
        vars.extend(
            self.project
                .env
                .variables
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        vars
    }
}

pub fn run(args: BuildArgs) -> CommandResult {
    if args.check {
        return check(&args);
    }
    let ready = ensure_env_with(&args.file, args.lock, args.rebuild, &args.caches)?;
    if ready.substituted > 0 {
        eprintln!(
            "substituted {} store path(s) from binary caches",
            ready.substituted
        );
    }
    let built: Vec<_> = ready.build.packages.iter().filter(|p| p.built).collect();
    if !built.is_empty() {
        eprintln!(
            "built {} store path(s) for {}",
            built.len() + usize::from(ready.build.env_built),
            ready.project.name
        );
    }
    use hvd_builder::source_build::NetworkIsolation;
    match ready.build.isolation {
        Some(NetworkIsolation::None) => eprintln!(
            "warning: no private network namespace here (`unshare --net` failed): source builds could reach the network"
        ),
        Some(NetworkIsolation::Namespace | NetworkIsolation::UserNamespace) => eprintln!(
            "warning: no build sandbox here (install `bubblewrap`): source builds ran without network but could read and write the file system"
        ),
        _ => {}
    }
    tracing::debug!(
        "{} locked packages; root link {}",
        ready.lock.packages.len(),
        ready.link.display()
    );
    println!("{}", ready.build.env.display());
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let file = args.file.display();
        eprintln!(
            "next: `hvd run {file}` runs its steps; `hvd shell {file}` opens a shell in the env"
        );
    }
    Ok(Status::Success)
}

fn check(args: &BuildArgs) -> CommandResult {
    let (project, lock) = load_and_lock(&args.file, args.lock)?;
    let plan = plan(&project, &lock)?;
    let store = open_store()?;
    let options = options(args.lock, false);
    let progress = TerminalProgress::new();
    let outcomes =
        hvd_builder::check_env(&store, &plan, &options, &progress).map_err(build_failure)?;
    progress.clear();
    let mut status = Status::Success;
    for outcome in &outcomes {
        if outcome.differing.is_empty() {
            eprintln!("{} {}: reproducible", outcome.name, outcome.version);
        } else {
            status = Status::NotReproducible;
            eprintln!(
                "{} {}: NOT reproducible; differing files in {}:",
                outcome.name,
                outcome.version,
                outcome.path.display()
            );
            for file in &outcome.differing {
                println!("{}/{file}", outcome.path.display());
            }
        }
    }
    if outcomes.is_empty() {
        eprintln!("no source-built packages to check");
    }
    if status == Status::NotReproducible {
        return Err(Failure::new(
            Status::NotReproducible,
            miette::miette!(
                help = "fix the build's nondeterminism (timestamps, random names, paths)",
                "a rebuild produced different bytes"
            ),
        ));
    }
    Ok(status)
}

/// Load the file, get an up-to-date lock (per `mode`), build the env and keep the root link. Substitutes from the
/// caches of `HVD_CACHES` and the file's `cluster { caches }`.
pub fn ensure_env(file: &Path, mode: LockMode, rebuild: bool) -> Result<ReadyEnv, Failure> {
    ensure_env_with(
        file,
        mode,
        rebuild,
        &super::substitute::CacheOptions::default(),
    )
}

/// [`ensure_env`], substituting from `caches` (the command line's) first.
pub fn ensure_env_with(
    file: &Path,
    mode: LockMode,
    rebuild: bool,
    caches: &super::substitute::CacheOptions,
) -> Result<ReadyEnv, Failure> {
    let (project, lock) = load_and_lock(file, mode)?;
    let mut plan = plan(&project, &lock)?;
    // The worker runtime (`import hvd`) is part of every env, with the `horovod` package (runtime.rs says when);
    // the staged copy must outlive the build.
    let runtime = crate::runtime::stage(crate::runtime::wants_horovod_compat(
        plan.packages.iter().map(|p| p.name.as_str()),
        &project.env.variables,
    ))?;
    plan.local_packages.push(hvd_builder::LocalPackage {
        name: "hvd".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        source: runtime.path().to_path_buf(),
    });
    let store = open_store()?;
    let substituter = caches.substituter(Some(&project), mode.offline)?;
    let progress = TerminalProgress::new();
    // Held (shared) from before the build until both roots exist: `hvd gc` (exclusive) cannot run in between.
    let builders = store.lock_builders().map_err(build_failure)?;
    let build = hvd_builder::build_env_with(
        &store,
        &plan,
        &options(mode, rebuild),
        substituter.as_ref(),
        &progress,
    )
    .map_err(build_failure)?;
    progress.clear();
    let link = root_link(file);
    hvd_builder::gc::add_root(&store, &link, &build.env).map_err(build_failure)?;
    // The project link can be repointed by another build of the same file; this process's env stays alive anyway.
    let temp_root =
        hvd_builder::gc::TempRoot::create(&store, &[&build.env]).map_err(build_failure)?;
    drop(builders);
    Ok(ReadyEnv {
        project,
        lock,
        build,
        link,
        temp_root,
        substituted: substituter.as_ref().map_or(0, |s| s.substituted()),
    })
}

/// `.hvd/env` next to the file.
pub fn root_link(file: &Path) -> PathBuf {
    let dir = file
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    dir.join(".hvd").join("env")
}

fn options(mode: LockMode, rebuild: bool) -> BuildOptions {
    BuildOptions {
        locked: mode.locked || mode.frozen,
        offline: mode.offline,
        rebuild,
    }
}

fn open_store() -> Result<Store, Failure> {
    Store::open(Store::default_root()).map_err(build_failure)
}

fn plan(
    project: &hvd_lang::model::Project,
    lock: &Lockfile,
) -> Result<hvd_builder::EnvPlan, Failure> {
    hvd_builder::lockfile::plan_from_lockfile(lock, &project.name)
        .map_err(|err| Failure::from_error(Status::Usage, &err))
}

/// Metadata of sdists without static metadata, built by their backend in the build sandbox of the default store.
pub fn sdist_metadata_builder(
    offline: bool,
) -> std::sync::Arc<dyn hvd_resolver::SourceMetadataProvider> {
    std::sync::Arc::new(hvd_builder::source_metadata::SandboxedMetadata::new(
        hvd_builder::Store::default_root(),
        offline,
    ))
}

pub(crate) fn build_failure(err: hvd_builder::Error) -> Failure {
    let help = match &err {
        hvd_builder::Error::HashMismatch { .. } => {
            "the file changed on the server or in transit; run `hvd lock` again if it was republished"
        }
        hvd_builder::Error::Offline { .. } => {
            "run without `--offline` once to fill the download cache"
        }
        hvd_builder::Error::ToolchainMismatch { .. } => {
            "install the pinned compiler, or run `hvd lock` to pin this one"
        }
        hvd_builder::Error::PythonNotFound { .. } => {
            "install that python (e.g. with pyenv) or set HVD_PYTHON"
        }
        hvd_builder::Error::InterpreterMismatch { .. } => {
            "the lock pins another build of this python (a lock from another machine, or edited): run `hvd lock` to \
             pin this machine's, or substitute the pinned one from a cache (`--cache URL --trusted-key KEY`)"
        }
        hvd_builder::Error::Cache(_) => {
            "the cache (or the network to it) served something its signed record does not vouch for: remove that \
             path from the cache and push it again, or build without `--cache`"
        }
        _ => "run with -v for details",
    };
    let status = match &err {
        hvd_builder::Error::PythonNotFound { .. }
        | hvd_builder::Error::InterpreterMismatch { .. }
        | hvd_builder::Error::Invalid(_) => Status::Usage,
        _ => Status::Failure,
    };
    Failure::from_error_with_help(status, "failed to build the env", &err, help)
}

/// Read the file and the lock; with `--locked` a missing or stale lock exits 3.
pub fn load_and_lock(
    file: &Path,
    mode: LockMode,
) -> Result<(hvd_lang::model::Project, Lockfile), Failure> {
    let project = hvd_lang::load_file(file)
        .map_err(|diagnostics| Failure::new(Status::Usage, miette::Report::new(diagnostics)))?;
    let lock_path = Lockfile::path_for(file);
    let read = |status: Status| {
        Lockfile::read(&lock_path).map_err(|err| {
            Failure::from_error_with_help(
                status,
                format_args!("failed to read `{}`", lock_path.display()),
                &err,
                "run `hvd lock` to create it",
            )
        })
    };
    if mode.frozen {
        return Ok((project, read(Status::Usage)?));
    }
    let existing = if lock_path.exists() {
        Some(read(Status::Usage)?)
    } else {
        None
    };
    let stale = match &existing {
        None => Some(format!("`{}` does not exist", lock_path.display())),
        Some(lock) => lock
            .check_against(&project.env)
            .err()
            .map(|s| s.to_string()),
    };
    match (stale, existing) {
        (None, Some(lock)) => Ok((project, lock)),
        (Some(reason), _) if mode.locked => Err(Failure::new(
            Status::LockStale,
            miette::miette!(
                help = "run `hvd lock` and commit the lockfile",
                "`--locked`: {reason}"
            ),
        )),
        (Some(reason), _) => {
            tracing::info!("re-locking: {reason}");
            relock(file, &project, mode.offline)?;
            Ok((project, read(Status::Failure)?))
        }
        (None, None) => Err(Failure::usage("no lockfile")),
    }
}

/// Resolve the env into `FILE.lock` (the lockfile is missing or stale), keeping the old pins that still fit.
fn relock(file: &Path, project: &hvd_lang::model::Project, offline: bool) -> Result<(), Failure> {
    let lock_path = Lockfile::path_for(file);
    let options = hvd_resolver::LockOptions {
        offline,
        existing: Lockfile::read(&lock_path).ok(),
        source_metadata: Some(sdist_metadata_builder(offline)),
        ..hvd_resolver::LockOptions::default()
    };
    eprintln!("locking {}", file.display());
    let lock = hvd_resolver::lock(&project.env, &options).map_err(|err| {
        let status = match err {
            hvd_resolver::ResolveError::NoSolution(_)
            | hvd_resolver::ResolveError::BadRequirement { .. } => Status::Usage,
            _ => Status::Failure,
        };
        Failure::from_error_in(
            status,
            format_args!("failed to lock `{}`", file.display()),
            &err,
        )
    })?;
    let mut lock = lock;
    pin_interpreter(&mut lock, &lock_path, false)?;
    lock.write(&lock_path).map_err(|err| {
        Failure::from_error_in(
            Status::Failure,
            format_args!("failed to write `{}`", lock_path.display()),
            &err,
        )
    })?;
    Ok(())
}

/// Pin the interpreter's store path in `lock` (`[target] installation`: full version and content hash), copying
/// this machine's interpreter for `target.python` into the store. A pin the lock already has is kept (unless
/// `repin`) when its path is in this store or this machine has no such interpreter; otherwise this machine's
/// interpreter is pinned in its place, so relocking fixes a pin this machine cannot satisfy. Without an
/// interpreter of that version here (or one that cannot be copied) the lock stays unpinned, with a warning: the
/// build then copies in whichever interpreter the building machine has.
/// The pinned lock is checked with the lockfile reader before it is returned: a pin its own reader would refuse
/// is never written.
pub(crate) fn pin_interpreter(
    lock: &mut Lockfile,
    lock_path: &Path,
    repin: bool,
) -> Result<(), Failure> {
    set_pin(lock, repin)?;
    Lockfile::parse(&lock.to_toml(), lock_path).map_err(|err| {
        Failure::from_error_in(
            Status::Failure,
            format_args!(
                "refusing to write `{}`: the lock with its interpreter pinned fails the lockfile reader",
                lock_path.display()
            ),
            &err,
        )
    })?;
    Ok(())
}

fn set_pin(lock: &mut Lockfile, repin: bool) -> Result<(), Failure> {
    let existing = lock.target.installation.clone();
    // A lock needs no store: when the store cannot be opened, the lock keeps the pin it has (or stays unpinned,
    // which a build accepts and copies this machine's interpreter unchecked), and says why.
    let opened = Store::open(Store::default_root()).and_then(|store| {
        let builders = store.lock_builders()?;
        Ok((store, builders))
    });
    let (store, _builders) = match opened {
        Ok(opened) => opened,
        Err(err) => {
            if existing.is_none() {
                eprintln!(
                    "warning: the lock does not pin the interpreter: the store `{}` cannot be opened: {err}",
                    Store::default_root().display()
                );
            }
            return Ok(());
        }
    };
    if let Some(pin) = &existing
        && !repin
    {
        let path = store.path_of(&hvd_builder::interpreter::derivation(
            &pin.version,
            &pin.content_hash,
        ));
        if store.is_valid(&path) {
            return Ok(());
        }
    }
    let host = match hvd_builder::python::Interpreter::find(&lock.target.python) {
        Ok(host) => host,
        Err(err) => {
            if existing.is_none() {
                eprintln!("warning: the lock does not pin the interpreter: {err}");
            }
            return Ok(());
        }
    };
    // The pin is computed without copying the interpreter into the store: `hvd build` copies it.
    match hvd_builder::interpreter::pin(&store, &host) {
        Ok(pinned) => {
            let pin = hvd_resolver::lockfile::InstallationPin {
                version: pinned.version,
                content_hash: pinned.content_hash,
            };
            if let Some(old) = existing.filter(|old| *old != pin) {
                eprintln!(
                    "note: the lock pinned python {} with content hash {}, which this store does not have; it now \
                     pins this machine's python {} (content hash {})",
                    old.version, old.content_hash, pin.version, pin.content_hash
                );
            }
            lock.target.installation = Some(pin);
        }
        Err(err) => eprintln!(
            "warning: the lock does not pin the interpreter: python {} at `{}` cannot be read for its content \
             hash: {err}",
            host.version,
            host.executable.display()
        ),
    }
    Ok(())
}

/// Renders builder progress on stderr: download bars and build lines on a terminal, nothing otherwise.
pub struct TerminalProgress {
    bars: Option<indicatif::MultiProgress>,
    downloads: Mutex<std::collections::HashMap<usize, indicatif::ProgressBar>>,
}

impl TerminalProgress {
    pub fn new() -> TerminalProgress {
        let bars = std::io::stderr()
            .is_terminal()
            .then(indicatif::MultiProgress::new);
        TerminalProgress {
            bars,
            downloads: Mutex::new(Default::default()),
        }
    }

    pub fn clear(&self) {
        if let Some(bars) = &self.bars {
            let _ = bars.clear();
        }
    }
}

impl Default for TerminalProgress {
    fn default() -> Self {
        TerminalProgress::new()
    }
}

impl Progress for TerminalProgress {
    fn download_started(&self, id: usize, name: &str, size: Option<u64>) {
        let Some(bars) = &self.bars else { return };
        let bar = bars.add(indicatif::ProgressBar::new(size.unwrap_or(0)));
        let style = indicatif::ProgressStyle::with_template(
            "{msg:40!} {bar:30} {bytes:>10}/{total_bytes:10} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_message(name.to_string());
        self.downloads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, bar);
    }

    fn download_progress(&self, id: usize, bytes: u64) {
        if let Some(bar) = self
            .downloads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
        {
            bar.inc(bytes);
        }
    }

    fn download_finished(&self, id: usize) {
        if let Some(bar) = self
            .downloads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
        {
            bar.finish_and_clear();
        }
    }

    fn warning(&self, message: &str) {
        match &self.bars {
            Some(bars) => {
                let _ = bars.println(format!("warning: {message}"));
            }
            None => eprintln!("warning: {message}"),
        }
    }

    fn step_started(&self, what: &str, name: &str, version: &str) {
        if what == "build" {
            // Source builds take minutes; say so even when not on a terminal.
            match &self.bars {
                Some(bars) => {
                    let _ = bars.println(format!("building {name} {version} from source"));
                }
                None => eprintln!("building {name} {version} from source"),
            }
        }
    }
}
