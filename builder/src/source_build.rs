//! PEP 517 source builds in a cleared environment, in a sandbox where one can be made (see [`NetworkIsolation`]).
//!
//! The sdist is unpacked in a build directory whose path depends only on the derivation (so paths compiled into
//! the output are the same on every rebuild), the build env (build requirements + `against` packages, already in
//! the store) provides the interpreter, and a small Python driver calls the backend's `build_wheel`.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::toolchain::Toolchain;

mod process;

/// `SOURCE_DATE_EPOCH` for builds: 1980-01-01, the earliest time a zip (wheel) can record.
pub const SOURCE_DATE_EPOCH: &str = "315532800";

/// How builds are isolated on this machine (see docs/store.md, "Source builds").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkIsolation {
    /// `bwrap`: own mount, network, pid, ipc and uts namespaces; `/` read-only, home directories, `/tmp` and
    /// `/run` hidden, the store read-only, only the build directory writable; every build process ends with the
    /// builder.
    Sandbox,
    /// `unshare --net --pid` (root): no network, every build process ends with the builder; the file system is
    /// not isolated.
    Namespace,
    /// `unshare --map-root-user --net --pid` (unprivileged user namespaces): as [`NetworkIsolation::Namespace`].
    UserNamespace,
    /// Nothing works here: builds can reach the network and the whole file system.
    None,
}

/// The `unshare` arguments (before the program) of each fallback level.
const UNSHARE_ROOT: &[&str] = &["--net", "--pid", "--fork", "--kill-child"];
const UNSHARE_USER: &[&str] = &[
    "--map-root-user",
    "--net",
    "--pid",
    "--fork",
    "--kill-child",
];

/// Detect once per process which isolation works; each fallback is logged with the reason.
pub fn network_isolation() -> NetworkIsolation {
    static DETECTED: OnceLock<NetworkIsolation> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        let probe = |program: &str, args: &[&str]| -> std::result::Result<(), String> {
            let name = program;
            let program = trusted_program(name).ok_or_else(|| {
                format!("no `{name}` in {}", TRUSTED_DIRS.join(", "))
            })?;
            let output = Command::new(&program)
                .args(args)
                .arg("/bin/true")
                .env_clear()
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .output()
                .map_err(|err| format!("`{}` cannot run: {err}", program.display()))?;
            if output.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "`{} {}` failed: {}",
                    program.display(),
                    args.join(" "),
                    String::from_utf8_lossy(&output.stderr).trim()
                ))
            }
        };
        let probe_dir = std::env::temp_dir();
        let sandbox = sandbox_args(&probe_dir, &probe_dir, &[]);
        let sandbox: Vec<&str> = sandbox.iter().map(String::as_str).collect();
        let mut sandbox = sandbox;
        sandbox.push("--");
        let bwrap = match probe("bwrap", &sandbox) {
            Ok(()) => return NetworkIsolation::Sandbox,
            Err(reason) => reason,
        };
        tracing::warn!(
            "no build sandbox ({bwrap}; install the `bubblewrap` package): source builds can read and write the \
             file system; trying `unshare` for the network"
        );
        let unshare_root: Vec<&str> = UNSHARE_ROOT.iter().copied().chain(["--"]).collect();
        let unshare_user: Vec<&str> = UNSHARE_USER.iter().copied().chain(["--"]).collect();
        let root = match probe("unshare", &unshare_root) {
            Ok(()) => return NetworkIsolation::Namespace,
            Err(reason) => reason,
        };
        match probe("unshare", &unshare_user) {
            Ok(()) => NetworkIsolation::UserNamespace,
            Err(user) => {
                tracing::warn!(
                    "no private network namespace available ({root}; {user}): builds can reach the network"
                );
                NetworkIsolation::None
            }
        }
    })
}

/// Where the sandbox programs (`bwrap`, `unshare`, `env`) are looked up: system directories only, never `PATH`
/// (a lockfile's build variables or the caller's environment must not choose which program sets up the sandbox).
const TRUSTED_DIRS: &[&str] = &["/usr/bin", "/bin", "/usr/sbin", "/sbin", "/usr/local/bin"];

/// The absolute path of a system program: a regular file in [`TRUSTED_DIRS`] (links resolved), owned by root and
/// writable by nobody else. Looked up once per program and process.
pub(crate) fn trusted_program(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    static FOUND: OnceLock<std::sync::Mutex<BTreeMap<String, Option<PathBuf>>>> = OnceLock::new();
    let found = FOUND.get_or_init(Default::default);
    let mut found = found.lock().unwrap_or_else(|e| e.into_inner());
    found
        .entry(name.to_string())
        .or_insert_with(|| {
            TRUSTED_DIRS.iter().find_map(|dir| {
                let path = fs_err::canonicalize(Path::new(dir).join(name)).ok()?;
                let meta = fs_err::metadata(&path).ok()?;
                (meta.is_file()
                    && meta.uid() == 0
                    && meta.mode() & 0o022 == 0
                    && meta.mode() & 0o111 != 0)
                    .then_some(path)
            })
        })
        .clone()
}

/// A build variable's name must be a portable environment name (`[A-Za-z_][A-Za-z0-9_]*`): it is passed as an
/// argument (`bwrap --setenv NAME VALUE`, `env NAME=VALUE`), so nothing else may parse as an option or split.
fn check_variable(package: &str, name: &str, value: &str) -> Result<()> {
    let portable = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !portable {
        return Err(Error::Invalid(format!(
            "the build variable `{}` of {package} is not an environment variable name (letters, digits and `_`, \
             not starting with a digit); fix the recipe's `build.env` and run `hvd lock` again",
            name.escape_debug()
        )));
    }
    if value.contains('\0') {
        return Err(Error::Invalid(format!(
            "the build variable `{name}` of {package} contains a NUL byte; fix the recipe's `build.env`"
        )));
    }
    Ok(())
}

/// `bwrap` arguments (before `--` and the program) for a build in `build_dir`, with `store` and `readable` (the
/// interpreter's prefix, the compiler's directory) visible read-only even where they lie in a hidden directory.
fn sandbox_args(build_dir: &Path, store: &Path, readable: &[PathBuf]) -> Vec<String> {
    let mut args: Vec<String> = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        .map(String::from)
        .to_vec();
    // Hidden: home directories (the invoking user's included), shared temp space and runtime sockets.
    let mut hidden: Vec<PathBuf> = ["/home", "/root", "/tmp", "/var/tmp", "/run", "/dev/shm"]
        .map(PathBuf::from)
        .to_vec();
    if let Some(home) = dirs::home_dir().filter(|h| h.is_absolute() && h != Path::new("/")) {
        hidden.push(home);
    }
    hidden.retain(|dir| dir.is_dir() && !dir.is_symlink());
    for dir in &hidden {
        args.extend(["--tmpfs".into(), dir.display().to_string()]);
    }
    // What the build needs from a hidden directory comes back read-only (the rest of `/` is read-only already).
    for path in std::iter::once(store).chain(readable.iter().map(PathBuf::as_path)) {
        if path.is_dir() && hidden.iter().any(|dir| path.starts_with(dir)) {
            let path = path.display().to_string();
            args.extend(["--ro-bind".into(), path.clone(), path]);
        }
    }
    let build = build_dir.display().to_string();
    args.extend(["--bind".into(), build.clone(), build]);
    args.extend(
        [
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--die-with-parent",
            "--new-session",
        ]
        .map(String::from),
    );
    args
}

/// The base interpreter's installation prefix (`<prefix>/bin/python3.X`), which the sandbox must show.
fn interpreter_prefix(build_env: &Path) -> Option<PathBuf> {
    let executable = fs_err::canonicalize(build_env.join("bin").join("python")).ok()?;
    Some(executable.parent()?.parent()?.to_path_buf())
}

const DRIVER: &str = r#"
import importlib, os, sys
# The sandbox's `bwrap --chdir` sets PWD; the build's environment is only what hvd chose.
os.environ.pop("PWD", None)
source, out = sys.argv[1], sys.argv[2]
os.chdir(source)
backend_name, backend_path = "setuptools.build_meta:__legacy__", None
if os.path.exists("pyproject.toml"):
    import tomllib
    with open("pyproject.toml", "rb") as f:
        system = tomllib.load(f).get("build-system", {})
    backend_name = system.get("build-backend", backend_name)
    backend_path = system.get("backend-path")
if backend_path:
    sys.path[:0] = [os.path.abspath(p) for p in backend_path]
else:
    sys.path.insert(0, source)
module, _, attribute = backend_name.partition(":")
backend = importlib.import_module(module)
for part in filter(None, attribute.split(".")):
    backend = getattr(backend, part)
"#;

/// The driver's last part for a wheel build.
const BUILD_WHEEL: &str = r#"
print("HVD_HOOK=build_wheel of " + backend_name, flush=True)
name = backend.build_wheel(out)
print("HVD_WHEEL=" + name)
"#;

/// The driver's last part for metadata (PEP 517): the backend's `prepare_metadata_for_build_wheel`, else (the hook
/// is optional) its `build_wheel` and the `.dist-info/METADATA` read out of that wheel. Either way it reports the
/// `.dist-info` directory it left in `out`.
const PREPARE_METADATA: &str = r#"
hook = getattr(backend, "prepare_metadata_for_build_wheel", None)
if hook is not None:
    print("HVD_HOOK=prepare_metadata_for_build_wheel of " + backend_name, flush=True)
    name = hook(out)
else:
    import zipfile
    print("HVD_HOOK=build_wheel of " + backend_name + " (it has no prepare_metadata_for_build_wheel)", flush=True)
    wheels = os.path.join(out, "wheel")
    os.mkdir(wheels)
    with zipfile.ZipFile(os.path.join(wheels, backend.build_wheel(wheels))) as wheel:
        entry = next(n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        name = entry.split("/")[0]
        os.mkdir(os.path.join(out, name))
        with open(os.path.join(out, name, "METADATA"), "wb") as f:
            f.write(wheel.read(entry))
print("HVD_METADATA=" + name)
"#;

/// What one source build needs.
#[derive(Debug, Clone)]
pub struct SourceBuildRequest<'a> {
    pub name: &'a str,
    pub version: &'a str,
    /// The sdist in the download cache and its file name.
    pub sdist: &'a Path,
    pub sdist_filename: &'a str,
    /// The build env (a store path with `bin/python`).
    pub build_env: &'a Path,
    /// The recipe's variables.
    pub env: &'a BTreeMap<String, String>,
    /// The store root (visible read-only inside the sandbox).
    pub store: &'a Path,
    pub toolchain: Option<&'a Toolchain>,
    /// The CUDA toolkit of a build with `nvidia-cuda-nvcc` among its requirements (`cuda.rs`): its `bin/` goes on
    /// `PATH` after the compiler's, its variables are set.
    pub cuda: Option<&'a crate::cuda::CudaToolkit>,
}

/// Which PEP 517 hook a backend run calls, and how long it may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hook {
    BuildWheel,
    PrepareMetadata,
}

impl Hook {
    fn code(self) -> &'static str {
        match self {
            Hook::BuildWheel => BUILD_WHEEL,
            Hook::PrepareMetadata => PREPARE_METADATA,
        }
    }

    fn timeout_variable(self) -> &'static str {
        match self {
            Hook::BuildWheel => crate::env_vars::HVD_BUILD_TIMEOUT,
            Hook::PrepareMetadata => crate::env_vars::HVD_METADATA_TIMEOUT,
        }
    }

    /// The run's limit: the variable's value in seconds where set (`HVD_BUILD_TIMEOUT`, default an hour;
    /// `HVD_METADATA_TIMEOUT`, default ten minutes: `hvd lock` waits on it).
    fn deadline(self) -> Result<std::time::Duration> {
        let default = match self {
            Hook::BuildWheel => 3600,
            Hook::PrepareMetadata => 600,
        };
        let secs = hvd_resolver::deadline::positive_setting(
            self.timeout_variable(),
            std::env::var_os(self.timeout_variable()),
            "expected a whole number of seconds, at least 1",
            format!("{default} s"),
        )
        .map_err(|err| Error::Invalid(err.to_string()))?
        .unwrap_or(default);
        Ok(std::time::Duration::from_secs(secs))
    }
}

/// The most of the build log hvd reads back (for the error's tail and the `HVD_WHEEL=` line).
const LOG_TAIL_BYTES: u64 = 64 * 1024;

/// Build a wheel in `build_dir` (created fresh); returns the wheel's path, a copy hvd made outside what the build
/// could write.
///
/// Layout: `build_dir/work` (source, home, temp, dist) is the only directory the build can write; `build_dir`
/// itself holds what hvd reads afterwards: `build.log` (opened by hvd and handed over as stdout/stderr, read back
/// through hvd's own descriptor) and `wheel/<name>.whl` (copied from `work/dist` through descriptors that never
/// follow a link).
pub fn build_wheel(request: &SourceBuildRequest<'_>, build_dir: &Path) -> Result<PathBuf> {
    let run = run_backend(request, build_dir, Hook::BuildWheel)?;
    let reported = run
        .reported("HVD_WHEEL=")
        .ok_or_else(|| run.failed("the build backend reported no wheel".into()))?;
    let wheel_dir = build_dir.join("wheel");
    fs_err::create_dir(&wheel_dir)?;
    let work_fd = open_directory(&run.work).map_err(|message| run.failed(message))?;
    let wheel = copy_built_wheel(&work_fd, reported, &wheel_dir).map_err(|m| run.failed(m))?;
    Ok(wheel)
}

/// Build the sdist's core metadata in `build_dir` (created fresh) with the PEP 517 hook
/// `prepare_metadata_for_build_wheel` (or `build_wheel` where the backend lacks it), in the same sandbox and
/// environment as [`build_wheel`]; returns the METADATA file's bytes, read through descriptors that never follow a
/// link (as [`copy_built_wheel`]).
pub fn prepare_metadata(request: &SourceBuildRequest<'_>, build_dir: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let run = run_backend(request, build_dir, Hook::PrepareMetadata)?;
    let reported = run
        .reported("HVD_METADATA=")
        .ok_or_else(|| run.failed("the build backend reported no metadata directory".into()))?;
    let plain = plain_name(reported) && reported.ends_with(".dist-info");
    if !plain {
        return Err(run.failed(format!(
            "the build backend reported `{}` as its metadata directory, which is not a plain `.dist-info` name",
            reported.escape_debug()
        )));
    }
    let open = || -> std::result::Result<std::fs::File, String> {
        let work_fd = open_directory(&run.work)?;
        let dist_fd = open_below(&work_fd, "dist", true)?;
        let info_fd = open_below(&dist_fd, reported, true)?;
        let file = std::fs::File::from(open_below(&info_fd, "METADATA", false)?);
        if !file.metadata().map_err(|err| err.to_string())?.is_file() {
            return Err(format!("`dist/{reported}/METADATA` is not a regular file"));
        }
        Ok(file)
    };
    let file = open().map_err(|m| run.failed(m))?;
    let mut bytes = Vec::new();
    file.take(MAX_METADATA_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_METADATA_BYTES {
        return Err(run.failed(format!(
            "`dist/{reported}/METADATA` is larger than {MAX_METADATA_BYTES} bytes"
        )));
    }
    Ok(bytes)
}

/// The most bytes a built METADATA file may have.
const MAX_METADATA_BYTES: u64 = 16 << 20;

/// A backend run that exited successfully.
struct BackendRun {
    work: PathBuf,
    log: PathBuf,
    log_tail: String,
    name: String,
    version: String,
}

impl BackendRun {
    /// The value of the last `<prefix>...` line the driver printed.
    fn reported(&self, prefix: &str) -> Option<&str> {
        self.log_tail
            .lines()
            .rev()
            .find_map(|line| line.strip_prefix(prefix))
            .map(str::trim)
    }

    fn failed(&self, message: String) -> Error {
        Error::BuildFailed {
            name: self.name.clone(),
            version: self.version.clone(),
            message,
            log: self.log.clone(),
            tail: last_lines(&self.log_tail, 30),
        }
    }
}

/// Unpack the sdist into `build_dir/work` and run the driver (the backend prelude + `hook`) in the sandbox.
///
/// Layout: `build_dir/work` (source, home, temp, dist) is the only directory the build can write; `build_dir`
/// itself holds what hvd reads afterwards: `build.log` (opened by hvd and handed over as stdout/stderr, read back
/// through hvd's own descriptor) and what hvd copies out of `work/dist`.
fn run_backend(
    request: &SourceBuildRequest<'_>,
    build_dir: &Path,
    hook: Hook,
) -> Result<BackendRun> {
    let deadline = hook.deadline()?;
    if fs_err::symlink_metadata(build_dir).is_ok() {
        crate::store::remove_tree(build_dir)?;
    }
    fs_err::create_dir_all(build_dir)?;
    let work = build_dir.join("work");
    let source_root = work.join("src");
    let home = work.join("home");
    let tmp = work.join("tmp");
    let dist = work.join("dist");
    for dir in [&work, &source_root, &home, &tmp, &dist] {
        fs_err::create_dir(dir)?;
    }
    crate::unpack::unpack_sdist(request.sdist, request.sdist_filename, &source_root).map_err(
        |source| Error::Install {
            name: request.name.to_string(),
            version: request.version.to_string(),
            filename: request.sdist_filename.to_string(),
            source: Box::new(source),
        },
    )?;
    let source = single_top_dir(&source_root)?;
    let driver = work.join("hvd_build_driver.py");
    fs_err::write(&driver, format!("{DRIVER}{}", hook.code()))?;

    let mut path_entries = vec![request.build_env.join("bin")];
    if let Some(compiler_dir) = request
        .toolchain
        .and_then(|t| t.path.as_ref())
        .and_then(|p| p.parent())
    {
        path_entries.push(compiler_dir.to_path_buf());
    }
    path_entries.extend(request.cuda.map(|cuda| cuda.bin()));
    path_entries.extend(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from));
    let path =
        std::env::join_paths(&path_entries).map_err(|err| Error::Invalid(err.to_string()))?;

    // The build's whole environment. It reaches only the build's own processes (inside the sandbox): the programs
    // that set the sandbox up run with an empty environment.
    let mut vars: BTreeMap<String, std::ffi::OsString> = BTreeMap::new();
    let mut set = |key: &str, value: &std::ffi::OsStr| {
        vars.insert(key.to_string(), value.to_os_string());
    };
    set("PATH", &path);
    set("HOME", home.as_os_str());
    set("TMPDIR", tmp.as_os_str());
    set("SOURCE_DATE_EPOCH", SOURCE_DATE_EPOCH.as_ref());
    set("LANG", "C".as_ref());
    set("LC_ALL", "C".as_ref());
    set("PYTHONHASHSEED", "0".as_ref());
    set("PYTHONDONTWRITEBYTECODE", "1".as_ref());
    set("VIRTUAL_ENV", request.build_env.as_os_str());
    if let Some(gcc) = request
        .toolchain
        .filter(|t| t.name == "gcc")
        .and_then(|t| t.path.as_ref())
    {
        set("CC", gcc.as_os_str());
        set("CXX", gcc.with_file_name("g++").as_os_str());
    }
    for (key, value) in request.cuda.map(|c| c.variables()).unwrap_or_default() {
        set(key, &value);
    }
    for (key, value) in request.env {
        check_variable(request.name, key, value)?;
        set(key, value.as_ref());
    }

    let python = request.build_env.join("bin").join("python");
    let isolation = network_isolation();
    let system = |name: &str| {
        trusted_program(name).ok_or_else(|| {
            Error::Invalid(format!(
                "`{name}` is no longer in {}; it was there when hvd started",
                TRUSTED_DIRS.join(", ")
            ))
        })
    };
    let mut command = match isolation {
        NetworkIsolation::Sandbox => {
            let mut readable: Vec<PathBuf> =
                interpreter_prefix(request.build_env).into_iter().collect();
            readable.extend(path_entries.iter().filter(|p| p.is_dir()).cloned());
            let mut c = Command::new(system("bwrap")?);
            c.args(sandbox_args(&work, request.store, &readable))
                .arg("--chdir")
                .arg(&source);
            for (key, value) in &vars {
                c.arg("--setenv").arg(key).arg(value);
            }
            c.arg("--").arg(&python);
            c
        }
        NetworkIsolation::Namespace | NetworkIsolation::UserNamespace => {
            let args = if isolation == NetworkIsolation::Namespace {
                UNSHARE_ROOT
            } else {
                UNSHARE_USER
            };
            if python.as_os_str().as_encoded_bytes().contains(&b'=') {
                return Err(Error::Invalid(format!(
                    "the build env's interpreter path `{}` contains `=`",
                    python.display()
                )));
            }
            let mut c = Command::new(system("unshare")?);
            c.args(args).arg("--").arg(system("env")?).arg("-i");
            for (key, value) in &vars {
                let mut assignment = std::ffi::OsString::from(key);
                assignment.push("=");
                assignment.push(value);
                c.arg(assignment);
            }
            c.arg(&python);
            c
        }
        NetworkIsolation::None => {
            // No sandbox: the variables go to the interpreter, which is the build itself.
            Command::new(&python)
        }
    };
    command
        .arg(&driver)
        .arg(&source)
        .arg(&dist)
        .current_dir(&source)
        .env_clear();
    if isolation == NetworkIsolation::None {
        command.envs(&vars);
    }
    let log_path = build_dir.join("build.log");
    let mut log = crate::store::create_new_file(&log_path, 0o644)?;
    command.stdin(Stdio::null());
    die_with_parent(&mut command);
    tracing::info!(
        "building {} {} (isolation: {isolation:?})",
        request.name,
        request.version
    );
    let ended = process::run(command, log.try_clone()?, Some(deadline)).map_err(|err| {
        std::io::Error::other(format!("failed to run `{}`: {err}", python.display()))
    })?;
    // Read back through hvd's own descriptor: whatever the build did to names, this is the file hvd created.
    let log_tail = read_tail(&mut log, LOG_TAIL_BYTES);
    let run = BackendRun {
        work,
        log: log_path,
        log_tail,
        name: request.name.to_string(),
        version: request.version.to_string(),
    };
    let hook_name = run
        .reported("HVD_HOOK=")
        .unwrap_or("the build backend")
        .to_string();
    match ended {
        process::Ended::Exited(status) if status.success() => Ok(run),
        process::Ended::Exited(status) => Err(run.failed(format!(
            "{hook_name} failed on `{}`: it exited with {status}",
            request.sdist_filename
        ))),
        process::Ended::TimedOut => Err(run.failed(format!(
            "{hook_name} did not finish on `{}` within {} s and was killed (raise the limit with {}=<seconds>)",
            request.sdist_filename,
            deadline.as_secs(),
            hook.timeout_variable()
        ))),
    }
}

/// The last `limit` bytes of the file behind `file` (lossy UTF-8, starting at a line boundary when cut).
fn read_tail(file: &mut std::fs::File, limit: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(len) = file.metadata().map(|m| m.len()) else {
        return String::new();
    };
    let start = len.saturating_sub(limit);
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(start)).is_err()
        || file.take(limit).read_to_end(&mut bytes).is_err()
    {
        return String::new();
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    match (start > 0, text.find('\n')) {
        (true, Some(cut)) => text[cut + 1..].to_string(),
        _ => text,
    }
}

fn last_lines(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Copy the wheel the backend reported (`HVD_WHEEL=<name>`) out of `work/dist` into `into`: `name` must be a plain
/// `.whl` file name; `dist` and the wheel are opened from a descriptor on `work` with `O_NOFOLLOW`, and the wheel
/// must be a regular file. So a link or a path planted by the build can never make hvd read a file the build could
/// not see.
fn copy_built_wheel(
    work: &OwnedFd,
    name: &str,
    into: &Path,
) -> std::result::Result<PathBuf, String> {
    if !(plain_name(name) && name.ends_with(".whl")) {
        return Err(format!(
            "the build backend reported `{}` as its wheel, which is not a plain `.whl` file name in the dist directory",
            name.escape_debug()
        ));
    }
    let dist_fd = open_below(work, "dist", true)?;
    let mut wheel = std::fs::File::from(open_below(&dist_fd, name, false)?);
    let meta = wheel.metadata().map_err(|err| err.to_string())?;
    if !meta.is_file() {
        return Err(format!(
            "the reported wheel `dist/{name}` is not a regular file"
        ));
    }
    let copy = into.join(name);
    let mut out = crate::store::create_new_file(&copy, 0o644).map_err(|err| err.to_string())?;
    std::io::copy(&mut wheel, &mut out)
        .map_err(|err| format!("failed to copy the built wheel `dist/{name}`: {err}"))?;
    Ok(copy)
}

/// A name the backend reported: one plain entry of a directory, never `.`, `..` or a path.
fn plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

/// Open the build's work directory (hvd created it; the build cannot replace it, only what is inside).
fn open_directory(path: &Path) -> std::result::Result<OwnedFd, String> {
    use nix::fcntl::OFlag;
    use nix::sys::stat::Mode;
    let directory = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    nix::fcntl::open(path, directory, Mode::empty())
        .map_err(|err| format!("cannot open `{}`: {err}", path.display()))
}

/// Open `name` inside `parent` with `O_NOFOLLOW` (a directory when `directory`): a link or a path planted by the
/// build can never make hvd read a file the build could not see.
fn open_below(
    parent: &OwnedFd,
    name: &str,
    directory: bool,
) -> std::result::Result<OwnedFd, String> {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::Mode;
    let flags = if directory {
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
    } else {
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC
    };
    openat(parent, name, flags, Mode::empty()).map_err(|err| {
        format!("the build's `{name}` cannot be opened without following a link: {err}")
    })
}

/// Kill the build when the builder dies (a SIGKILLed `hvd build` must not leave a compiler running): the first
/// process gets SIGKILL when the builder thread ends; it is `bwrap --die-with-parent --unshare-pid` or
/// `unshare --pid --kill-child`, whose pid namespace takes every build process (`setsid` ones too) with it.
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only calls the async-signal-safe `prctl`.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn single_top_dir(root: &Path) -> Result<PathBuf> {
    let entries: Vec<_> = fs_err::read_dir(root)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .collect();
    match entries.as_slice() {
        [only] if only.is_dir() => Ok(only.clone()),
        _ => Ok(root.to_path_buf()),
    }
}
