//! PEP 517 source builds in a cleared environment, in a sandbox where one can be made (see [`NetworkIsolation`]).
//!
//! The sdist is unpacked in a build directory whose path depends only on the derivation (so paths compiled into
//! the output are the same on every rebuild), the build env (build requirements + `against` packages, already in
//! the store) provides the interpreter, and a small Python driver calls the backend's `build_wheel`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::toolchain::Toolchain;

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
            let output = Command::new(program)
                .args(args)
                .arg("true")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .output()
                .map_err(|err| format!("`{program}` cannot run: {err}"))?;
            if output.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "`{program} {}` failed: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&output.stderr).trim()
                ))
            }
        };
        let probe_dir = std::env::temp_dir();
        let sandbox = sandbox_args(&probe_dir, &probe_dir, &[]);
        let sandbox: Vec<&str> = sandbox.iter().map(String::as_str).collect();
        let bwrap = match probe("bwrap", &sandbox) {
            Ok(()) => return NetworkIsolation::Sandbox,
            Err(reason) => reason,
        };
        tracing::warn!(
            "no build sandbox ({bwrap}; install the `bubblewrap` package): source builds can read and write the \
             file system; trying `unshare` for the network"
        );
        let root = match probe("unshare", UNSHARE_ROOT) {
            Ok(()) => return NetworkIsolation::Namespace,
            Err(reason) => reason,
        };
        match probe("unshare", UNSHARE_USER) {
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
name = backend.build_wheel(out)
print("HVD_WHEEL=" + name)
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
}

/// Build a wheel in `build_dir` (created fresh); returns the wheel's path inside it.
pub fn build_wheel(request: &SourceBuildRequest<'_>, build_dir: &Path) -> Result<PathBuf> {
    if build_dir.exists() {
        crate::store::remove_tree(build_dir)?;
    }
    let source_root = build_dir.join("src");
    let home = build_dir.join("home");
    let tmp = build_dir.join("tmp");
    let dist = build_dir.join("dist");
    for dir in [&source_root, &home, &tmp, &dist] {
        fs_err::create_dir_all(dir)?;
    }
    crate::unpack::unpack_sdist(request.sdist, request.sdist_filename, &source_root)?;
    let source = single_top_dir(&source_root)?;
    let driver = build_dir.join("hvd_build_driver.py");
    fs_err::write(&driver, DRIVER)?;

    let mut path_entries = vec![request.build_env.join("bin")];
    if let Some(compiler_dir) = request
        .toolchain
        .and_then(|t| t.path.as_ref())
        .and_then(|p| p.parent())
    {
        path_entries.push(compiler_dir.to_path_buf());
    }
    path_entries.extend(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from));
    let path =
        std::env::join_paths(&path_entries).map_err(|err| Error::Invalid(err.to_string()))?;

    let python = request.build_env.join("bin").join("python");
    let isolation = network_isolation();
    let mut command = match isolation {
        NetworkIsolation::Sandbox => {
            let mut readable: Vec<PathBuf> =
                interpreter_prefix(request.build_env).into_iter().collect();
            readable.extend(path_entries.iter().filter(|p| p.is_dir()).cloned());
            let mut c = Command::new("bwrap");
            c.args(sandbox_args(build_dir, request.store, &readable))
                .arg("--chdir")
                .arg(&source)
                .arg("--")
                .arg(&python);
            c
        }
        NetworkIsolation::Namespace => {
            let mut c = Command::new("unshare");
            c.args(UNSHARE_ROOT).arg(&python);
            c
        }
        NetworkIsolation::UserNamespace => {
            let mut c = Command::new("unshare");
            c.args(UNSHARE_USER).arg(&python);
            c
        }
        NetworkIsolation::None => Command::new(&python),
    };
    command
        .arg(&driver)
        .arg(&source)
        .arg(&dist)
        .current_dir(&source)
        .env_clear();
    command
        .env("PATH", &path)
        .env("HOME", &home)
        .env("TMPDIR", &tmp)
        .env("SOURCE_DATE_EPOCH", SOURCE_DATE_EPOCH)
        .env("LANG", "C")
        .env("LC_ALL", "C")
        .env("PYTHONHASHSEED", "0")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("VIRTUAL_ENV", request.build_env);
    if let Some(gcc) = request
        .toolchain
        .filter(|t| t.name == "gcc")
        .and_then(|t| t.path.as_ref())
    {
        command.env("CC", gcc).env("CXX", gcc.with_file_name("g++"));
    }
    for (key, value) in request.env {
        command.env(key, value);
    }
    let log_path = build_dir.join("build.log");
    let log = fs_err::File::create(&log_path)?;
    let log_err = log.try_clone()?;
    command
        .stdin(Stdio::null())
        .stdout(log.into_parts().0)
        .stderr(log_err.into_parts().0);
    die_with_parent(&mut command);
    tracing::info!(
        "building {} {} (isolation: {isolation:?})",
        request.name,
        request.version
    );
    let status = command.status().map_err(|err| {
        std::io::Error::other(format!("failed to run `{}`: {err}", python.display()))
    })?;
    let failed = |message: String| Error::BuildFailed {
        name: request.name.to_string(),
        version: request.version.to_string(),
        message,
        log: log_path.clone(),
        tail: tail(&log_path, 30),
    };
    if !status.success() {
        return Err(failed(format!("the build backend exited with {status}")));
    }
    let log_text = fs_err::read_to_string(&log_path).unwrap_or_default();
    let wheel = log_text
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix("HVD_WHEEL="))
        .map(|name| dist.join(name.trim()))
        .filter(|path| path.is_file())
        .ok_or_else(|| failed("the build backend reported no wheel".into()))?;
    Ok(wheel)
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

fn tail(path: &Path, lines: usize) -> String {
    let text = fs_err::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
