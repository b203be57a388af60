//! From an [`EnvPlan`] to store paths: derivations first (so a no-op build touches no network and no archive),
//! then downloads of what is missing, wheel installs in parallel, source builds, and finally the env.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use hvd_resolver::Sha256;

use crate::cache::Substituter;
use crate::cuda;
use crate::derivation::{Derivation, DerivationKind, normalize_name};
use crate::env;
use crate::error::{Error, Result};
use crate::fetch::{Artifact, Fetcher};
use crate::hash;
use crate::interpreter::{self, StoredPython};
use crate::plan::{BuildOptions, EnvPlan, LocalPackage, PackagePlan};
use crate::progress::Progress;
use crate::python::Interpreter;
use crate::source_build::{self, NetworkIsolation, SourceBuildRequest};
use crate::store::{BuildOutput, KnownTree, Store};
use crate::toolchain::Toolchain;
use crate::{unpack, wheel};

/// What [`build_env`] produced.
#[derive(Debug, Clone)]
pub struct EnvBuild {
    /// The env's store path (a venv layout; `bin/python` is its interpreter).
    pub env: PathBuf,
    /// Every runtime package path, with whether this run created it.
    pub packages: Vec<PackageOutcome>,
    /// Whether the env path itself was created by this run.
    pub env_built: bool,
    /// How source builds were isolated from the network (`None` when no source build ran).
    pub isolation: Option<NetworkIsolation>,
}

/// One package's store path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageOutcome {
    pub name: String,
    pub version: String,
    pub path: PathBuf,
    pub built: bool,
    pub source_built: bool,
}

/// The result of `--check` for one source-built package.
#[derive(Debug, Clone)]
pub struct CheckOutcome {
    pub name: String,
    pub version: String,
    pub path: PathBuf,
    /// Files whose content, mode or link target differ between the stored path and the rebuild; empty when equal.
    pub differing: Vec<String>,
}

/// Derivations of a plan, computed once.
struct Planned<'a> {
    store: &'a Store,
    plan: &'a EnvPlan,
    /// The interpreter's store path; `python` is its executable there.
    stored_python: StoredPython,
    python: Interpreter,
    /// The lock pins the interpreter and its path is only named so far: [`Planned::realize_interpreter`] makes it
    /// (while the wheels download and install, in a build).
    interpreter_pending: bool,
    toolchain: Option<Toolchain>,
    /// Derivation by the package plan's identity (name, version, artifact sha256).
    derivations: HashMap<(String, String, Sha256), Derivation>,
    build_envs: HashMap<(String, String, Sha256), (Derivation, Vec<PackagePlan>)>,
}

fn key(package: &PackagePlan) -> (String, String, Sha256) {
    (
        normalize_name(&package.name),
        package.version.clone(),
        package.artifact.sha256.clone(),
    )
}

fn platform() -> String {
    format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH)
}

impl<'a> Planned<'a> {
    /// The interpreter as derivations record it: version and path.
    fn python_identity(&self) -> String {
        format!(
            "{} {}",
            self.python.version,
            self.python.executable.display()
        )
    }

    fn new(
        store: &'a Store,
        plan: &'a EnvPlan,
        options: &BuildOptions,
        substituter: Option<&Substituter>,
        progress: &dyn Progress,
    ) -> Result<Planned<'a>> {
        // A pin names the path, so nothing here waits for the copy; without one the copy's content hash is the
        // path's name.
        let (stored_python, interpreter_pending) = match &plan.interpreter {
            Some(pin) => (
                StoredPython::pinned(store, &pin.version, &pin.content_hash),
                true,
            ),
            None => (
                stored_interpreter(store, plan, substituter, progress)?,
                false,
            ),
        };
        let python = stored_python.interpreter();
        let any_source_build = plan.packages.iter().any(|p| p.build.is_some());
        let toolchain = if any_source_build {
            Some(Toolchain::for_build(
                store,
                plan.toolchain.as_ref(),
                options.offline,
                options.locked,
            )?)
        } else {
            None
        };
        let mut planned = Planned {
            store,
            plan,
            stored_python,
            python,
            interpreter_pending,
            toolchain,
            derivations: HashMap::new(),
            build_envs: HashMap::new(),
        };
        for package in &plan.packages {
            planned.derive(package, 0)?;
        }
        Ok(planned)
    }

    /// Make the interpreter path the plan's derivations name (a pinned one is substituted or copied in here, not
    /// in [`Planned::new`]); an error when what was made is not that path.
    fn realize_interpreter(
        &self,
        substituter: Option<&Substituter>,
        progress: &dyn Progress,
    ) -> Result<()> {
        if !self.interpreter_pending {
            return Ok(());
        }
        let stored = stored_interpreter(self.store, self.plan, substituter, progress)?;
        if stored.path != self.stored_python.path {
            return Err(Error::Invalid(format!(
                "the interpreter was made at `{}`, not at the pinned `{}`",
                stored.path.display(),
                self.stored_python.path.display()
            )));
        }
        Ok(())
    }

    fn runtime_package(&self, name: &str) -> Option<&'a PackagePlan> {
        let name = normalize_name(name);
        self.plan
            .packages
            .iter()
            .find(|p| normalize_name(&p.name) == name)
    }

    /// The closure of `roots` over the runtime packages' dependency edges.
    fn closure(&self, roots: &[String]) -> Result<Vec<&'a PackagePlan>> {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<String> = roots.iter().map(|r| normalize_name(r)).collect();
        let mut out = Vec::new();
        while let Some(name) = stack.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let package = self.runtime_package(&name).ok_or_else(|| {
                Error::Invalid(format!(
                    "a source build needs `{name}`, which is not among the env's locked packages"
                ))
            })?;
            out.push(package);
            stack.extend(package.dependencies.iter().map(|d| normalize_name(d)));
        }
        out.sort_by_key(|p| normalize_name(&p.name));
        Ok(out)
    }

    fn derive(&mut self, package: &PackagePlan, depth: usize) -> Result<Derivation> {
        if depth > 16 {
            return Err(Error::Invalid(format!(
                "build requirements of `{}` nest too deep (a cycle?)",
                package.name
            )));
        }
        if let Some(existing) = self.derivations.get(&key(package)) {
            return Ok(existing.clone());
        }
        let derivation = match &package.build {
            None => Derivation::new(DerivationKind::Wheel, &package.name, &package.version)
                .input("artifact.sha256", package.artifact.sha256.as_str())
                .input("artifact.filename", &package.artifact.filename)
                .input("installer", "hvd-wheel-1"),
            Some(build) => {
                let mut derivation =
                    Derivation::new(DerivationKind::SourceBuild, &package.name, &package.version)
                        .input("artifact.sha256", package.artifact.sha256.as_str())
                        .input("artifact.filename", &package.artifact.filename)
                        .input("builder", "hvd-pep517-1")
                        .input("platform", platform())
                        .input("python", self.python_identity())
                        .input("source-date-epoch", source_build::SOURCE_DATE_EPOCH)
                        .input(
                            "toolchain",
                            self.toolchain
                                .as_ref()
                                .map(|t| t.identity())
                                .unwrap_or_default(),
                        );
                for (name, value) in &build.env {
                    derivation
                        .inputs
                        .insert(format!("env.{name}"), value.clone());
                }
                let mut env_packages: Vec<PackagePlan> = Vec::new();
                let mut cuda_parts = Vec::new();
                for requirement in &build.requires {
                    let hash = self.derive(requirement, depth + 1)?.hash();
                    derivation.input_derivations.insert(
                        format!("requires.{}", normalize_name(&requirement.name)),
                        hash.clone(),
                    );
                    cuda_parts.push(cuda::Part {
                        name: requirement.name.clone(),
                        version: requirement.version.clone(),
                        hash,
                    });
                    env_packages.push(requirement.clone());
                }
                if let Some(toolkit) = cuda::derivation(&cuda_parts) {
                    derivation.inputs.insert("cuda".into(), toolkit.hash());
                }
                let against = self.closure(&build.against)?;
                for runtime in against {
                    let hash = self.derive(runtime, depth + 1)?.hash();
                    derivation
                        .input_derivations
                        .insert(format!("against.{}", normalize_name(&runtime.name)), hash);
                    env_packages.push(runtime.clone());
                }
                let build_env = self.env_derivation(
                    &format!("{}-build-env", package.name),
                    &package.version,
                    &env_packages,
                    &[],
                )?;
                self.build_envs
                    .insert(key(package), (build_env, env_packages));
                derivation
            }
        };
        self.derivations.insert(key(package), derivation.clone());
        Ok(derivation)
    }

    fn env_derivation(
        &mut self,
        name: &str,
        version: &str,
        packages: &[PackagePlan],
        locals: &[(LocalPackage, Derivation)],
    ) -> Result<Derivation> {
        let mut derivation = Derivation::new(DerivationKind::Env, name, version)
            .input("python", self.python_identity())
            // 2: console scripts run their entry point only as `__main__` (multiprocessing's spawn re-imports them).
            // 3: the pycache `.pth` line works on every python (a no-op plus no bytecode before 3.8); python 2 layout.
            // 4: the interpreter is a store path the env references (interpreter.rs).
            .input("layout", "hvd-venv-4")
            .input(
                "pycache",
                self.store.root().join(".pycache").display().to_string(),
            );
        for (index, package) in packages.iter().enumerate() {
            let hash = self.derive(package, 1)?.hash();
            // The index keeps the priority order (first wins on a file conflict) part of the hash.
            derivation.input_derivations.insert(
                format!("package.{index:04}.{}", normalize_name(&package.name)),
                hash,
            );
        }
        derivation.input_derivations.insert(
            "interpreter".into(),
            crate::interpreter::derivation(
                &self.stored_python.version,
                &self.stored_python.content_hash,
            )
            .hash(),
        );
        for (local, local_derivation) in locals {
            derivation.input_derivations.insert(
                format!("local.{}", normalize_name(&local.name)),
                local_derivation.hash(),
            );
        }
        Ok(derivation)
    }
}

/// The env's interpreter as a store path. With the lock's pin: the pinned path when it is valid or a cache has it
/// (the host's interpreter is then never looked at), else this machine's interpreter of exactly that version,
/// copied in, whose content hash must equal the pin's. Without a pin: the host's interpreter for `plan.python`.
fn stored_interpreter(
    store: &Store,
    plan: &EnvPlan,
    substituter: Option<&Substituter>,
    progress: &dyn Progress,
) -> Result<StoredPython> {
    let Some(pin) = &plan.interpreter else {
        return interpreter::import(store, &Interpreter::find(&plan.python)?);
    };
    let derivation = interpreter::derivation(&pin.version, &pin.content_hash);
    let path = store.path_of(&derivation);
    if !store.is_valid(&path)
        && let Some(substituter) = substituter.filter(|s| !s.is_empty())
    {
        substituter.substitute(store, &derivation, progress)?;
    }
    if store.is_valid(&path) {
        return StoredPython::from_path(store, &path);
    }
    let host = Interpreter::find(&pin.version)?;
    if host.version != pin.version {
        return Err(Error::PythonNotFound {
            version: pin.version.clone(),
        });
    }
    let stored = interpreter::import(store, &host)?;
    if stored.content_hash != pin.content_hash {
        return Err(Error::InterpreterMismatch {
            version: pin.version.clone(),
            executable: host.executable,
            expected: pin.content_hash.to_string(),
            found: stored.content_hash.to_string(),
        });
    }
    Ok(stored)
}

fn local_derivation(local: &LocalPackage) -> Result<Derivation> {
    let manifest = hash::manifest(&local.source)?;
    Ok(
        Derivation::new(DerivationKind::Local, &local.name, &local.version)
            .input("content", hash::content_hash(&manifest).as_str()),
    )
}

/// Build (or find) every store path of `plan` and the env over them.
pub fn build_env(
    store: &Store,
    plan: &EnvPlan,
    options: &BuildOptions,
    progress: &dyn Progress,
) -> Result<EnvBuild> {
    build_env_with(store, plan, options, None, progress)
}

/// [`build_env`], substituting from binary caches first: the env with its closure when a cache has it (then
/// nothing is downloaded or built), else every package and local path a cache has; the rest is built as usual.
pub fn build_env_with(
    store: &Store,
    plan: &EnvPlan,
    options: &BuildOptions,
    substituter: Option<&Substituter>,
    progress: &dyn Progress,
) -> Result<EnvBuild> {
    let _builders = store.lock_builders()?;
    let mut planned = Planned::new(store, plan, options, substituter, progress)?;
    let locals: Vec<(LocalPackage, Derivation)> = plan
        .local_packages
        .iter()
        .map(|local| Ok((local.clone(), local_derivation(local)?)))
        .collect::<Result<_>>()?;
    let env_derivation = planned.env_derivation(&plan.name, "env", &plan.packages, &locals)?;
    let env_path = store.path_of(&env_derivation);
    let mut isolation = None;

    let realizer = Realizer::new(&planned, store, options, progress);
    let mut packages = Vec::new();
    if store.is_valid(&env_path) && !options.rebuild {
        // The common no-op: everything the env references exists, because valid paths are complete.
        for package in &plan.packages {
            let path = store.path_of(&planned.derivations[&key(package)]);
            packages.push(outcome(package, path, false));
        }
        return Ok(EnvBuild {
            env: env_path,
            packages,
            env_built: false,
            isolation,
        });
    }

    if let Some(substituter) = substituter.filter(|s| !s.is_empty() && !options.rebuild) {
        let package_paths = || {
            plan.packages
                .iter()
                .map(|p| store.path_of(&planned.derivations[&key(p)]))
        };
        if substituter.substitute(store, &env_derivation, progress)?
            && package_paths().all(|path| store.is_valid(&path))
        {
            let packages = plan
                .packages
                .iter()
                .zip(package_paths())
                .map(|(package, path)| outcome(package, path, false))
                .collect();
            return Ok(EnvBuild {
                env: env_path,
                packages,
                env_built: false,
                isolation,
            });
        }
        let mut wanted: Vec<Derivation> = plan
            .packages
            .iter()
            .map(|p| planned.derivations[&key(p)].clone())
            .collect();
        wanted.extend(locals.iter().map(|(_, derivation)| derivation.clone()));
        substituter.substitute_all(store, &wanted, progress)?;
    }

    // The interpreter is copied in (or substituted) while the wheels download and install: neither needs the other,
    // and on a cold store the copy would otherwise hold back the first download. Its failure stops new downloads
    // and installs and is the error reported.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let interpreter = scope.spawn(|| {
            let made = planned.realize_interpreter(substituter, progress);
            if made.is_err() {
                stop.store(true, Ordering::Release);
            }
            made
        });
        let wheels = realizer.realize_wheels(&plan.packages, &stop);
        let made = interpreter.join().unwrap_or_else(|_| {
            Err(Error::Invalid(
                "copying the interpreter into the store panicked".into(),
            ))
        });
        match made {
            // Both failed: the interpreter's error is the one reported, the wheels' is not lost (a hash mismatch
            // says something about a host).
            Err(err) => {
                if let Err(other) = &wheels {
                    tracing::error!(
                        "installing the wheels failed too (the interpreter's error is reported): {other}"
                    );
                }
                Err(err)
            }
            Ok(_) => wheels,
        }
    })?;
    for package in &plan.packages {
        let (path, _) = realizer.realize_package(package, options.rebuild)?;
        let built = realizer
            .built
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&path);
        if package.build.is_some() && built {
            isolation = Some(source_build::network_isolation());
        }
        packages.push(outcome(package, path, built));
    }
    let mut local_paths = Vec::new();
    for (local, derivation) in &locals {
        let realized = store.realize(derivation, false, |target| {
            copy_tree(&local.source, &target.out.join("site-packages"))?;
            Ok(BuildOutput::default())
        })?;
        local_paths.push(realized.path);
    }
    let mut all_paths: Vec<PathBuf> = packages.iter().map(|p| p.path.clone()).collect();
    all_paths.extend(local_paths);
    let python = planned.python.clone();
    let python_path = planned.stored_python.path.clone();
    progress.step_started("env", &plan.name, "");
    let env = store.realize(&env_derivation, false, |target| {
        env::assemble_env(target, &python, &all_paths, &store.root().join(".pycache"))?;
        Ok(BuildOutput {
            references: references(&all_paths, &python_path),
            ..BuildOutput::default()
        })
    })?;
    progress.step_finished("env", &plan.name, "");
    Ok(EnvBuild {
        env: env.path,
        packages,
        env_built: env.built,
        isolation,
    })
}

/// `--check`: rebuild every source-built runtime package in a temp location and compare with its store path.
pub fn check_env(
    store: &Store,
    plan: &EnvPlan,
    options: &BuildOptions,
    progress: &dyn Progress,
) -> Result<Vec<CheckOutcome>> {
    let _builders = store.lock_builders()?;
    let planned = Planned::new(store, plan, options, None, progress)?;
    planned.realize_interpreter(None, progress)?;
    let realizer = Realizer::new(&planned, store, options, progress);
    let mut outcomes = Vec::new();
    for package in plan.packages.iter().filter(|p| p.build.is_some()) {
        let derivation = &planned.derivations[&key(package)];
        let path = store.path_of(derivation);
        if !store.is_valid(&path) {
            realizer.realize_wheels(std::slice::from_ref(package), &AtomicBool::new(false))?;
            realizer.realize_package(package, false)?;
        }
        let name = derivation.path_name();
        let _lock = store.lock_path(&name)?;
        let temp = store.temp_dir(&format!("{name}-check"))?;
        let out = temp.join("out");
        fs_err::create_dir(&out)?;
        realizer.build_from_source(package, &out)?;
        crate::store::canonicalize(&out)?;
        let rebuilt = hash::manifest(&out)?;
        let stored = hash::manifest(&path)?;
        let differing = hash::manifest_differences(&stored, &rebuilt);
        crate::store::remove_tree(&temp)?;
        outcomes.push(CheckOutcome {
            name: package.name.clone(),
            version: package.version.clone(),
            path,
            differing,
        });
    }
    Ok(outcomes)
}

fn outcome(package: &PackagePlan, path: PathBuf, built: bool) -> PackageOutcome {
    PackageOutcome {
        name: package.name.clone(),
        version: package.version.clone(),
        path,
        built,
        source_built: package.build.is_some(),
    }
}

/// The store path names an env over `paths` with the interpreter at `python` needs at run time.
fn references(paths: &[PathBuf], python: &Path) -> BTreeSet<String> {
    paths
        .iter()
        .map(PathBuf::as_path)
        .chain([python])
        .filter_map(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect()
}

struct Realizer<'a> {
    planned: &'a Planned<'a>,
    fetcher: Fetcher,
    progress: &'a dyn Progress,
    /// Paths this run created (wheels are installed ahead of the loop that reports them).
    built: Mutex<BTreeSet<PathBuf>>,
}

impl<'a> Realizer<'a> {
    fn new(
        planned: &'a Planned<'a>,
        store: &Store,
        options: &BuildOptions,
        progress: &'a dyn Progress,
    ) -> Realizer<'a> {
        Realizer {
            planned,
            fetcher: Fetcher::new(store.downloads_dir(), options.offline),
            progress,
            built: Mutex::new(BTreeSet::new()),
        }
    }

    fn path_of(&self, package: &PackagePlan) -> PathBuf {
        self.planned
            .store
            .path_of(&self.planned.derivations[&key(package)])
    }

    /// Wheels (and sdists) needed for `roots`: those whose paths are missing, and the build requirements and
    /// build-env packages of missing source builds.
    fn missing(
        &self,
        roots: &[PackagePlan],
        out: &mut BTreeMap<(String, String, Sha256), PackagePlan>,
    ) {
        for package in roots {
            if self.planned.store.is_valid(&self.path_of(package))
                || out.contains_key(&key(package))
            {
                continue;
            }
            out.insert(key(package), package.clone());
            if let Some((_, env_packages)) = self.planned.build_envs.get(&key(package)) {
                self.missing(env_packages, out);
            }
        }
    }

    /// Download everything missing and install the missing wheels on a few threads, each wheel as soon as it is
    /// in the download cache (while the others still download), largest first. The first error stops the rest:
    /// no new download or install starts; paths already made are complete (each is made atomically). So does
    /// `stop` set by the caller (then the caller has the error).
    fn realize_wheels(&self, roots: &[PackagePlan], stop: &AtomicBool) -> Result<()> {
        let mut missing = BTreeMap::new();
        self.missing(roots, &mut missing);
        let mut packages: Vec<&PackagePlan> = missing.values().collect();
        // Largest first: the biggest wheel bounds the whole, so it must neither download nor install last.
        packages.sort_by_key(|p| std::cmp::Reverse(p.artifact.size.unwrap_or(0)));
        let artifacts: Vec<Artifact> = packages.iter().map(|p| p.artifact.clone()).collect();
        let wheels = packages.iter().filter(|p| p.build.is_none()).count();
        // Indexes into `packages` of wheels in the cache and not taken yet; whether downloads are still running.
        let queue = Mutex::new((BTreeSet::<usize>::new(), true));
        let wake = Condvar::new();
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        let fail = |err: Error| {
            first_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(err);
            stop.store(true, Ordering::Release);
            let _queue = queue.lock().unwrap_or_else(|e| e.into_inner());
            wake.notify_all();
        };
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(1, 8)
            .min(wheels);
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    loop {
                        let index = {
                            let mut queue = queue.lock().unwrap_or_else(|e| e.into_inner());
                            loop {
                                if stop.load(Ordering::Acquire) {
                                    return;
                                }
                                if let Some(index) = queue.0.pop_first() {
                                    break index;
                                }
                                if !queue.1 {
                                    return;
                                }
                                queue = wake.wait(queue).unwrap_or_else(|e| e.into_inner());
                            }
                        };
                        if let Err(err) = self.realize_package(packages[index], false) {
                            fail(err);
                            return;
                        }
                    }
                });
            }
            // A big wheel is also installed while it downloads, on a thread of its own (it waits for the bytes).
            // Once its download is verified that thread finishes it; after a failed first attempt a retry's
            // complete file goes to the queue as any other.
            let fail = &fail;
            let streaming: Mutex<HashMap<usize, Arc<unpack::Growing>>> = Mutex::new(HashMap::new());
            let streaming = &streaming;
            let streamed = |index: usize, growing: Arc<unpack::Growing>| {
                let package = packages[index];
                if package.build.is_some() {
                    return;
                }
                streaming
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(index, growing.clone());
                scope.spawn(move || {
                    match self.realize_package_from(package, false, Some(growing.clone())) {
                        Ok(_) => {}
                        // The fetch reports the failure, or a retry's complete file is installed as usual.
                        Err(_) if growing.failed() => {}
                        // The range answer was not the verified file's end: what was unpacked from it is gone, the
                        // verified file is installed as any other.
                        Err(err) if growing.tail_differed() => {
                            tracing::warn!("{err}; installing it from the verified file");
                            if let Err(err) = self.realize_package(package, false) {
                                fail(err);
                            }
                        }
                        Err(err) => fail(err),
                    }
                });
            };
            let fetched = self.fetcher.fetch_each(
                &artifacts,
                self.progress,
                stop,
                &|index| {
                    let installing = streaming
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&index)
                        .is_some_and(|growing| growing.verified());
                    if packages[index].build.is_none() && !installing {
                        queue
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                            .insert(index);
                        wake.notify_one();
                    }
                },
                Some(&streamed),
            );
            if let Err(err) = fetched {
                fail(err);
            }
            queue.lock().unwrap_or_else(|e| e.into_inner()).1 = false;
            wake.notify_all();
        });
        match first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Realize one package path (its artifact must be fetched, or fetchable).
    fn realize_package(&self, package: &PackagePlan, rebuild: bool) -> Result<(PathBuf, bool)> {
        self.realize_package_from(package, rebuild, None)
    }

    /// [`Self::realize_package`]; a wheel from `growing`, its download under way, when given (an error too when
    /// that download fails: the caller tells which by [`unpack::Growing::failed`]).
    fn realize_package_from(
        &self,
        package: &PackagePlan,
        rebuild: bool,
        growing: Option<Arc<unpack::Growing>>,
    ) -> Result<(PathBuf, bool)> {
        let derivation = &self.planned.derivations[&key(package)];
        let replace = rebuild && package.build.is_some();
        if !replace
            && self
                .planned
                .store
                .is_valid(&self.planned.store.path_of(derivation))
        {
            return Ok((self.planned.store.path_of(derivation), false));
        }
        let what = if package.build.is_some() {
            "build"
        } else {
            "install"
        };
        self.progress
            .step_started(what, &package.name, &package.version);
        let realized = self
            .planned
            .store
            .realize_known(derivation, replace, |target| {
                let (manifest, references) = match &package.build {
                    None => {
                        let manifest = match growing {
                            Some(growing) => wheel::install_growing_for_store(
                                &self.fetcher.cached_path(&package.artifact.sha256),
                                growing,
                                &target.out,
                            ),
                            None => {
                                let wheel = self.fetcher.fetch_all(
                                    std::slice::from_ref(&package.artifact),
                                    self.progress,
                                )?;
                                wheel::install_wheel_for_store(&wheel[0], &target.out)
                            }
                        }
                        .map_err(|source| install_error(package, source))?;
                        (manifest, BTreeSet::new())
                    }
                    Some(_) => self.build_from_source(package, &target.out)?,
                };
                Ok(KnownTree {
                    manifest,
                    references,
                })
            })?;
        self.progress
            .step_finished(what, &package.name, &package.version);
        if realized.built {
            self.built
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(realized.path.clone());
        }
        Ok((realized.path, realized.built))
    }

    /// Build `package` from its sdist and install the wheel into `out` (caller holds the path's lock); the
    /// manifest of what was installed, canonical already.
    /// Also the store paths the output refers to (the CUDA toolkit, when the build wrote its path into it).
    fn build_from_source(
        &self,
        package: &PackagePlan,
        out: &Path,
    ) -> Result<(unpack::Manifest, BTreeSet<String>)> {
        let (env_derivation, env_packages) = &self.planned.build_envs[&key(package)];
        self.realize_wheels(env_packages, &AtomicBool::new(false))?;
        let mut paths = Vec::new();
        for env_package in env_packages {
            paths.push(self.realize_package(env_package, false)?.0);
        }
        let store = self.planned.store;
        let python = &self.planned.python;
        let build_env = store.realize(env_derivation, false, |target| {
            env::assemble_env(target, python, &paths, &store.root().join(".pycache"))?;
            Ok(BuildOutput {
                references: references(&paths, &self.planned.stored_python.path),
                ..BuildOutput::default()
            })
        })?;
        let sdist = self
            .fetcher
            .fetch_all(std::slice::from_ref(&package.artifact), self.progress)?;
        let build = package
            .build
            .as_ref()
            .ok_or_else(|| Error::Invalid("not a source build".into()))?;
        // Build requirements come first among the build env's packages (`Planned::derive`).
        let requirements: Vec<(cuda::Part, PathBuf)> = build
            .requires
            .iter()
            .zip(&paths)
            .map(|(requirement, path)| {
                let part = cuda::Part {
                    name: requirement.name.clone(),
                    version: requirement.version.clone(),
                    hash: self.planned.derivations[&key(requirement)].hash(),
                };
                (part, path.clone())
            })
            .collect();
        let toolkit = cuda::CudaToolkit::for_build(store, &requirements)?;
        if let Some(toolkit) = &toolkit {
            toolkit.check_compiler(self.planned.toolchain.as_ref())?;
        }
        let variables = cuda::substitute_variables(&package.name, &build.env, toolkit.as_ref())?;
        let name = self.planned.derivations[&key(package)].path_name();
        // A fixed directory per derivation: paths compiled into the output are the same on every rebuild.
        let build_dir = store.root().join(".build").join(&name);
        let request = SourceBuildRequest {
            name: &package.name,
            version: &package.version,
            sdist: &sdist[0],
            sdist_filename: &package.artifact.filename,
            build_env: &build_env.path,
            env: &variables,
            store: store.root(),
            toolchain: self.planned.toolchain.as_ref(),
            cuda: toolkit.as_ref(),
        };
        let wheel_path = source_build::build_wheel(&request, &build_dir)?;
        let manifest = wheel::install_wheel_for_store(&wheel_path, out)
            .map_err(|source| install_error(package, source))?;
        crate::store::remove_tree(&build_dir)?;
        let references = match &toolkit {
            Some(toolkit) => toolkit.references(out)?,
            None => BTreeSet::new(),
        };
        Ok((manifest, references))
    }
}

/// `source` (an archive refused or not installable) as the failure to install `package`, which it names.
fn install_error(package: &PackagePlan, source: Error) -> Error {
    Error::Install {
        name: package.name.clone(),
        version: package.version.clone(),
        filename: package.artifact.filename.clone(),
        source: Box::new(source),
    }
}

/// Copy a directory tree (files, links, directories).
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    fs_err::create_dir_all(to)?;
    for entry in walkdir::WalkDir::new(from)
        .follow_links(false)
        .sort_by_file_name()
        .min_depth(1)
    {
        let entry = entry.map_err(|err| {
            std::io::Error::other(format!("failed to walk `{}`: {err}", from.display()))
        })?;
        let dest = to.join(entry.path().strip_prefix(from).unwrap_or(entry.path()));
        if entry.file_type().is_symlink() {
            std::os::unix::fs::symlink(fs_err::read_link(entry.path())?, &dest)?;
        } else if entry.file_type().is_dir() {
            fs_err::create_dir_all(&dest)?;
        } else {
            fs_err::copy(entry.path(), &dest)?;
        }
    }
    Ok(())
}
