//! Helpers shared by the CLI tests (`mod common;` in each test binary; each uses a different part).
#![allow(
    dead_code,
    reason = "each test binary uses a different part of this module"
)]

pub mod elastic;
pub mod nshosts;
pub mod s3;
pub mod slurm;
pub mod stdlib;

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hvd_resolver::lockfile::{
    Artifact, ArtifactKind, Dependency, LockedBuild, LockedPackage, Lockfile, Request,
    SCHEMA_VERSION, Target, env_hash,
};

pub const HVD: &str = env!("CARGO_BIN_EXE_hvd");

/// A fixture script for [`make_fixtures`]: wheels `helper 1.0` and `greet 1.0` (which needs helper and has a
/// `greet` console script), and an sdist `noisy 1.0` whose in-tree backend writes a random stamp into its wheel (so
/// two builds differ).
pub const GREET_AND_NOISY: &str = r#"
import base64, hashlib, io, os, sys, tarfile, zipfile
out = sys.argv[1]
def h(d): return base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
def wheel(name, files, requires=(), entry_points=None):
    di = name + "-1.0.dist-info"
    files = dict(files)
    files[di + "/METADATA"] = ("Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n" % name + "".join("Requires-Dist: %s\n" % r for r in requires)).encode()
    files[di + "/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: fixture\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if entry_points: files[di + "/entry_points.txt"] = entry_points.encode()
    rec = "".join("%s,sha256=%s,%d\n" % (p, h(d), len(d)) for p, d in files.items()) + di + "/RECORD,,\n"
    files[di + "/RECORD"] = rec.encode()
    with zipfile.ZipFile(os.path.join(out, name + "-1.0-py3-none-any.whl"), "w") as z:
        for p, d in files.items(): z.writestr(p, d)
wheel("helper", {"helper.py": b"WORD = 'hello'\n"})
wheel("greet", {"greet/__init__.py": b"from helper import WORD\ndef main():\n    print(WORD + ' from greet')\n"},
      requires=["helper"], entry_points="[console_scripts]\ngreet = greet:main\n")
backend = '''
import base64, hashlib, os, zipfile
def h(d): return base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = {"noisy.py": ("STAMP = %r\\n" % os.urandom(8).hex()).encode()}
    di = "noisy-1.0.dist-info"
    files[di + "/METADATA"] = b"Metadata-Version: 2.1\\nName: noisy\\nVersion: 1.0\\n"
    files[di + "/WHEEL"] = b"Wheel-Version: 1.0\\nGenerator: fixture\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
    files[di + "/RECORD"] = ("".join("%s,sha256=%s,%d\\n" % (p, h(d), len(d)) for p, d in files.items()) + di + "/RECORD,,\\n").encode()
    with zipfile.ZipFile(os.path.join(wheel_directory, "noisy-1.0-py3-none-any.whl"), "w") as z:
        for p, d in files.items(): z.writestr(p, d)
    return "noisy-1.0-py3-none-any.whl"
'''
with tarfile.open(os.path.join(out, "noisy-1.0.tar.gz"), "w:gz") as t:
    for p, d in {"pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
                 "backend.py": backend.encode()}.items():
        info = tarfile.TarInfo("noisy-1.0/" + p); info.size = len(d); t.addfile(info, io.BytesIO(d))
"#;

/// stdout and stderr of `out` as text.
pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `command` to its end, asserts that it succeeded (showing its stderr if not) and returns its stdout and
/// stderr as text.
pub fn succeeded(command: &mut Command) -> (String, String) {
    let out = command.output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    (stdout, stderr)
}

/// The environment a Kubernetes `container` (of an exported manifest) defines, as its pod gets it: values as
/// written, a Secret key's value from `secret` (which the entry must name), the pod's IP for `status.podIP` where
/// `pod_ip` gives one; any other source fails the test, saying so.
pub fn container_env(
    container: &serde_json::Value,
    secret: &serde_json::Value,
    pod_ip: Option<&str>,
) -> Vec<(String, String)> {
    pod_env(container, secret, pod_ip, None)
}

/// [`container_env`] in namespace `namespace` (`metadata.namespace`, downward API).
pub fn pod_env(
    container: &serde_json::Value,
    secret: &serde_json::Value,
    pod_ip: Option<&str>,
    namespace: Option<&str>,
) -> Vec<(String, String)> {
    let mut vars = Vec::new();
    for entry in container["env"].as_array().unwrap() {
        let name = entry["name"].as_str().unwrap().to_owned();
        let value = if let Some(v) = entry["value"].as_str() {
            v.to_owned()
        } else if let Some(r) = entry["valueFrom"]["secretKeyRef"].as_object() {
            assert_eq!(r["name"], secret["metadata"]["name"], "{entry}");
            let key = r["key"].as_str().unwrap();
            secret["stringData"][key].as_str().unwrap().to_owned()
        } else if let Some(ip) = pod_ip
            && entry["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        {
            ip.to_owned()
        } else if let Some(ns) = namespace
            && entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        {
            ns.to_owned()
        } else {
            panic!("a variable this test cannot provide: {entry}");
        };
        vars.push((name, value));
    }
    vars
}

/// Appends `block` (a `cluster { ... }` block, say) to the project's train.hvd in `dir`.
pub fn append_to_project(dir: &Path, block: &str) {
    let file = dir.join("train.hvd");
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, format!("{text}\n{block}\n")).unwrap();
}

/// A temporary project whose train.hvd holds an env with no packages and `step`.
pub fn project(step: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("project \"t\"\nenv {{\n  python = \"3.11\"\n  packages = []\n}}\n{step}\n");
    std::fs::write(dir.path().join("train.hvd"), text).unwrap();
    dir
}

/// What the allreduce workers of these tests need outside an env: (a python3 with numpy, the `hvd` Python
/// package's directory for PYTHONPATH, `libhvd_runtime.so` for HVD_LIBRARY).
pub fn allreduce_runtime() -> (String, PathBuf, PathBuf) {
    // Cargo builds the runtime library with the binary (hvd depends on hvd-runtime): always in `deps/`, and at the
    // top of the target dir after a `cargo build -p hvd-runtime` (possibly older): the newest one.
    let lib = [
        Path::new(HVD).with_file_name("libhvd_runtime.so"),
        Path::new(HVD)
            .with_file_name("deps")
            .join("libhvd_runtime.so"),
    ]
    .into_iter()
    .filter(|lib| lib.is_file())
    .max_by_key(|lib| std::fs::metadata(lib).and_then(|m| m.modified()).ok())
    .expect("libhvd_runtime.so is built with the hvd binary");
    let python = Command::new("python3")
        .args(["-c", "import numpy, sys; print(sys.executable)"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| text(&o).0.trim().to_owned())
        .expect("python3 with numpy (scripts/install-deps installs it)");
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("collective/python");
    (python, package, lib)
}

/// `python3` (with numpy) set up to import this checkout's `hvd` package outside `hvd run`: PYTHONPATH and
/// HVD_LIBRARY (on a fresh clone the runtime library is only in `deps/`, where the package does not look).
pub fn hvd_python() -> Command {
    let (python, package, lib) = allreduce_runtime();
    let mut command = Command::new(python);
    command.env("PYTHONPATH", package).env("HVD_LIBRARY", lib);
    command
}

/// The `env = { ... }` entry of a step that runs the allreduce worker outside an env.
pub fn allreduce_step_env(package: &Path, lib: &Path) -> String {
    format!(
        "env = {{ PYTHONPATH = \"{}\", HVD_LIBRARY = \"{}\" }}",
        package.display(),
        lib.display()
    )
}

/// A project whose step `train` runs `script` (written as train.py) with the allreduce runtime on `workers` (as
/// written in the file): `env` follows the step's PYTHONPATH and HVD_LIBRARY entries (`, NAME = "VALUE"` each) and
/// `extra` is more lines of the step.
pub fn train_project(workers: &str, env: &str, extra: &str, script: &str) -> tempfile::TempDir {
    let (python, package, lib) = allreduce_runtime();
    let dir = project(&format!(
        "step train {{\n  run = \"{python} train.py\"\n  workers = {workers}\n  env = {{ PYTHONPATH = \"{}\", \
         HVD_LIBRARY = \"{}\"{env} }}\n{extra}}}",
        package.display(),
        lib.display()
    ));
    std::fs::write(dir.path().join("train.py"), script).unwrap();
    dir
}

/// `hvd run --no-build --grace <grace> <args>` in `dir` with the variables `env` set: its output, stdout and stderr.
pub fn hvd_run_graced(
    dir: &Path,
    grace: u32,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Output, String, String) {
    let out = hvd_run_command(dir)
        .args(["--no-build", "--grace", &grace.to_string()])
        .args(args)
        .env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    (out, stdout, stderr)
}

/// Serves the files under `root` over HTTP on 127.0.0.1 (one request per connection, 404 for what is missing);
/// returns the base URL.
pub fn serve_files(root: PathBuf) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let request = read_request(&stream);
            let path = request.split_whitespace().nth(1).unwrap_or("/");
            let response = file_response(&root, path);
            let _ = stream.write_all(&response);
        }
    });
    base
}

/// Reads one HTTP request's head from `stream`: returns its request line, skips its headers.
pub fn read_request(stream: &std::net::TcpStream) -> String {
    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
    let mut request = String::new();
    let _ = reader.read_line(&mut request);
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 2 {
        line.clear();
    }
    request
}

/// The HTTP response that serves `path` (a request target) from under `root`: 200 with the file, or 404.
pub fn file_response(root: &Path, path: &str) -> Vec<u8> {
    match std::fs::read(root.join(path.trim_start_matches('/'))) {
        Ok(body) => {
            let mut out = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .into_bytes();
            out.extend(body);
            out
        }
        Err(_) => {
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec()
        }
    }
}

/// `MAJOR.MINOR` of the `python3` on PATH.
pub fn python_version() -> String {
    let out = Command::new("python3")
        .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Runs the Python `script` with `dir` as its argument (the fixture makers write their files there).
pub fn make_fixtures(script: &str, dir: &Path) {
    let status = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(dir)
        .status()
        .unwrap();
    assert!(status.success(), "the fixture script failed");
}

/// The lockfile `hvd lock` would write for the env of the project `file` on this machine's `python` (`3.11`),
/// with these packages and builds.
pub fn lockfile(
    file: &Path,
    python: &str,
    packages: Vec<LockedPackage>,
    builds: Vec<LockedBuild>,
) -> Lockfile {
    let model = hvd_lang::load_file(file).unwrap();
    Lockfile {
        version: SCHEMA_VERSION,
        env_hash: env_hash(&model.env),
        request: Request::from_env(&model.env),
        target: Target {
            python: python.to_owned(),
            python_full: format!("{python}.0"),
            interpreter: format!("cp{}", python.replace('.', "")),
            abi: format!("cp{}", python.replace('.', "")),
            os: "linux".into(),
            arch: std::env::consts::ARCH.into(),
            glibc: None,
            platforms: vec![],
            installation: None,
        },
        toolchain: None,
        packages,
        builds,
    }
}

/// The locked package `name` 1.0 whose artifact is the fixture file `path`, served at `base`.
pub fn locked_file(name: &str, base: &str, path: &Path, deps: &[&str]) -> LockedPackage {
    let filename = path.file_name().unwrap().to_string_lossy().into_owned();
    LockedPackage {
        name: name.into(),
        version: "1.0".into(),
        index: base.to_owned(),
        artifact: Artifact {
            kind: if filename.ends_with(".whl") {
                ArtifactKind::Wheel
            } else {
                ArtifactKind::Sdist
            },
            url: format!("{base}/{filename}"),
            filename,
            sha256: hvd_builder::Sha256::of_file(path)
                .unwrap()
                .to_string()
                .parse()
                .unwrap(),
            size: std::fs::metadata(path).unwrap().len(),
        },
        dependencies: deps
            .iter()
            .map(|d| Dependency {
                name: d.to_string(),
                extras: vec![],
                marker: None,
            })
            .collect(),
    }
}

/// `hvd ARGS` run in `dir` with the store at `store`.
pub fn hvd_with_store(dir: &Path, store: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(HVD);
    command.args(args).env("HVD_STORE", store).current_dir(dir);
    command
}

/// `text` without the wrapping of the error renderer: no whitespace, no `│` borders (messages are compared whole).
pub fn unwrapped(text: &str) -> String {
    text.chars()
        .filter(|c| !c.is_whitespace() && *c != '│')
        .collect()
}

/// `hvd run PROJECT/train.hvd`, arguments to follow.
pub fn hvd_run_command(project: &Path) -> Command {
    let mut command = Command::new(HVD);
    command.arg("run").arg(project.join("train.hvd"));
    command
}

/// Asserts that `out` exited with `code` and that its stderr contains `part`.
pub fn assert_exit_saying(out: &Output, code: i32, part: &str) {
    let (stdout, stderr) = text(out);
    assert_eq!(out.status.code(), Some(code), "{stdout}\n{stderr}");
    assert!(stderr.contains(part), "`{part}` missing: {stderr}");
}

/// Live processes (pid, command line) whose environment holds `entry` (`NAME=value`).
pub fn processes_with_env(entry: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for proc_entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = proc_entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(environ) = std::fs::read(proc_entry.path().join("environ")) else {
            continue;
        };
        if environ.split(|&b| b == 0).any(|v| v == entry.as_bytes()) {
            let cmdline = std::fs::read(proc_entry.path().join("cmdline")).unwrap_or_default();
            found.push((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
        }
    }
    found
}

/// stderr of `out` with miette's frame undone: one line, single spaces, no `×`/`│` marks.
pub fn flat_stderr(out: &Output) -> String {
    text(out)
        .1
        .replace(['│', '×'], " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `[[build]]` entry of a source-built `package` with no build requirements, variables or `against` packages.
pub fn plain_build(package: &str) -> LockedBuild {
    LockedBuild {
        package: package.into(),
        requires: vec![],
        env: Default::default(),
        against: vec![],
        no_build_isolation: false,
        packages: vec![],
    }
}

/// A value for `HVD_TEST_MARKER` no other test run uses: `<prefix>-<pid>-<nanoseconds>`.
pub fn unique_marker(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// Asserts that each `(slot, rank)` of `members` printed that it finished as that rank of a job of `members.len()`,
/// all at the same step with the same state, every step counted once; returns that step.
pub fn assert_finished_together(stdout: &str, stderr: &str, members: &[(u32, u32)]) -> u32 {
    let size = members.len();
    let ends: Vec<String> = members
        .iter()
        .map(|(slot, rank)| {
            let prefix = format!("slot {slot} finished as rank {rank} of {size}: ");
            stdout
                .lines()
                .find_map(|l| l.split_once(&prefix).map(|(_, end)| end.to_owned()))
                .unwrap_or_else(|| panic!("no `{prefix}`:\n{stdout}\n{stderr}"))
        })
        .collect();
    let step: u32 = ends[0]
        .strip_prefix("step ")
        .and_then(|e| e.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{}", ends[0]));
    let want = format!(
        "step {step} count {:?} w0 {:?} agree True",
        f64::from(step),
        f64::from(step * (step + 1) / 2)
    );
    for end in &ends {
        assert_eq!(*end, want, "{stdout}\n{stderr}");
    }
    step
}

/// Asserts that no process whose environment holds `HVD_TEST_MARKER=<marker>` is left (one killed a moment ago
/// may take a little while to leave /proc: waits up to 10 s for that).
pub fn assert_nothing_left(marker: &str) {
    let left = wait_until_empty(
        std::time::Duration::from_secs(10),
        std::time::Duration::from_millis(20),
        || processes_with_env(&format!("HVD_TEST_MARKER={marker}")),
    );
    assert!(left.is_empty(), "left running: {left:?}");
}

/// Calls `left` every `pause` until it returns nothing or `limit` has passed; returns its last answer.
pub fn wait_until_empty<T>(
    limit: std::time::Duration,
    pause: std::time::Duration,
    left: impl Fn() -> Vec<T>,
) -> Vec<T> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let now = left();
        if now.is_empty() || std::time::Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(pause);
    }
}

/// Writes `ar.py` into `dir`: the Python `hvd` package's allreduce of `rank + 1` over every rank, checked (`ok`),
/// then `report` (which prints what the test expects and exits with `ok`).
pub fn write_allreduce_py(dir: &Path, report: &str) {
    const CHECK: &str = r#"import os, sys
import numpy as np
import hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
assert r == int(os.environ["HVD_RANK"]), (r, os.environ["HVD_RANK"])
out = np.asarray(hvd.allreduce(np.full(4, r + 1, dtype=np.float32), op=hvd.Sum, name="x"))
ok = bool(np.all(out == n * (n + 1) / 2))
"#;
    std::fs::write(dir.join("ar.py"), format!("{CHECK}{report}")).unwrap();
}

/// Asserts that `out` succeeded and that its stdout holds `line(rank)` for each of the first `ranks` ranks.
pub fn assert_every_rank_says(out: &Output, ranks: u32, line: impl Fn(u32) -> String) {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..ranks {
        let want = line(rank);
        assert!(
            stdout.contains(&want),
            "rank {rank}: `{want}` missing (or not attributed to its rank):\n{stdout}\n{stderr}"
        );
    }
}

/// Asserts that `got` is the golden file `launcher/tests/data/golden/NAME`; `HVD_UPDATE_GOLDEN=1` rewrites it.
pub fn assert_golden(name: &str, got: &str) {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("launcher/tests/data/golden")
        .join(name);
    if std::env::var_os("HVD_UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, got).unwrap();
    }
    assert_eq!(
        got,
        std::fs::read_to_string(&golden).unwrap(),
        "HVD_UPDATE_GOLDEN=1 rewrites it"
    );
}

/// `hvd ARGS` in `dir` without colour, echoed with its output into the test's log (the end-to-end tests take
/// minutes; their log says what ran). `configure` adds to the command (e.g. a store).
pub fn hvd_logged(dir: &Path, args: &[&str], configure: impl FnOnce(&mut Command)) -> Output {
    let mut command = Command::new(HVD);
    command.args(args).current_dir(dir).env("NO_COLOR", "1");
    configure(&mut command);
    let output = command.output().unwrap();
    eprintln!(
        "$ hvd {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Waits until `path` exists; fails the test when it has not appeared within `limit`.
pub fn wait_for_path(path: &Path, limit: std::time::Duration) {
    let missing = wait_until_empty(limit, std::time::Duration::from_millis(10), || {
        if path.exists() { vec![] } else { vec![()] }
    });
    assert!(missing.is_empty(), "{} never appeared", path.display());
}

/// A project built and pushed by [`pushed_fixture_env`].
pub struct PushedEnv {
    /// The project directory (`root/app`, with `train.hvd` and its lock).
    pub project: PathBuf,
    /// The env's store path in `root/store`.
    pub env: PathBuf,
    /// The directory cache it was pushed to.
    pub cache: PathBuf,
    /// The public key file whose secret key signed the push.
    pub public_key: PathBuf,
}

/// A project `root/app/train.hvd` whose env (fixture wheels `greet` and `helper` from a local index, and hvd's
/// worker runtime) is built into `root/store` and pushed, signed by a fresh key (`cache.keys/`), into the directory
/// cache `cache`; `rest` follows the env in the file (steps, a cluster block). The cache and the keys sit outside
/// `root`, so a test can hide `root` from its hosts.
pub fn pushed_fixture_env(root: &Path, cache: &Path, rest: &str) -> PushedEnv {
    let files = cache.with_extension("files");
    std::fs::create_dir_all(&files).unwrap();
    make_fixtures(GREET_AND_NOISY, &files);
    let base = serve_files(files.clone());
    let python = python_version();
    let project = root.join("app");
    std::fs::create_dir_all(&project).unwrap();
    let file = project.join("train.hvd");
    std::fs::write(
        &file,
        format!(
            "project \"app\"\nenv {{\n  python = \"{python}\"\n  packages = [\"greet==1.0\"]\n}}\n{rest}"
        ),
    )
    .unwrap();
    let package = |name: &str, filename: &str, deps: &[&str]| {
        locked_file(name, &base, &files.join(filename), deps)
    };
    lockfile(
        &file,
        &python,
        vec![
            package("greet", "greet-1.0-py3-none-any.whl", &["helper"]),
            package("helper", "helper-1.0-py3-none-any.whl", &[]),
        ],
        vec![],
    )
    .write(&Lockfile::path_for(&file))
    .unwrap();
    let store = root.join("store");
    let hvd = |args: &[&str]| {
        let out = hvd_with_store(root, &store, args)
            .env_remove("HVD_CACHES")
            .env_remove("HVD_TRUSTED_KEYS")
            .output()
            .unwrap();
        assert!(out.status.success(), "hvd {args:?}: {}", text(&out).1);
        text(&out).0.trim().to_owned()
    };
    let env = PathBuf::from(hvd(&["build", "app/train.hvd", "--locked"]));
    let keys = cache.with_extension("keys");
    let keys_arg = keys.display().to_string();
    hvd(&["cache", "keygen", "fixture", "--out", &keys_arg]);
    let to = format!("file://{}", cache.display());
    let secret = keys.join("fixture.secret").display().to_string();
    hvd(&push_args("--locked", &to, &secret));
    PushedEnv {
        project,
        env,
        cache: cache.to_path_buf(),
        public_key: keys.join("fixture.public"),
    }
}

/// A TCP port that was free a moment ago, drawn below the kernel's ephemeral range as `MASTER_PORT` is
/// ([`hvd_launcher::env::master_port`]): an ephemeral port could be taken, before its daemon binds it, by any
/// outgoing connection of the tests running alongside (or of the network-namespace hosts and nodes it is used in).
pub fn free_port() -> u16 {
    hvd_launcher::env::master_port()
}

/// `hvd exec FILE --locked -- python -c CODE`'s arguments: `CODE` run by the Python of FILE's env, as locked.
pub fn exec_locked_python<'a>(file: &'a str, code: &'a str) -> [&'a str; 7] {
    ["exec", file, "--locked", "--", "python", "-c", code]
}

/// `hvd cache push app/train.hvd LOCK --to TO --key SECRET`'s arguments (LOCK: `--locked` or `--frozen`).
pub fn push_args<'a>(lock: &'a str, to: &'a str, secret: &'a str) -> [&'a str; 8] {
    [
        "cache",
        "push",
        "app/train.hvd",
        lock,
        "--to",
        to,
        "--key",
        secret,
    ]
}

/// Flips one byte in the middle of the cached archive (in the file cache at `cache`) of the package whose store
/// directory under `store` ends with `suffix` (e.g. `-helper-1.0`); returns that directory's name.
pub fn tamper_cached_archive(store: &Path, cache: &Path, suffix: &str) -> String {
    use hvd_builder::cache::record::{Record, archive_key, record_key};
    let name = std::fs::read_dir(store)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.ends_with(suffix))
        .unwrap();
    let record = Record::parse(&std::fs::read(cache.join(record_key(&name))).unwrap()).unwrap();
    let archive = cache.join(archive_key(&record.archive.sha256));
    let mut bytes = std::fs::read(&archive).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(&archive, &bytes).unwrap();
    name
}

/// A shell command (no double quotes) that waits until each [`GcLoop`] counting into `counters` has finished `runs`
/// more runs; it fails (exit 1, saying why on stderr) when a loop has failed (`COUNTER.failed`) or after 600 s
/// without them, never spinning forever.
pub fn gc_wait_script(counters: &[&Path], runs: usize) -> String {
    let (mut start, mut short, mut failed) = (String::new(), Vec::new(), String::new());
    for (i, c) in counters.iter().enumerate() {
        let c = c.display();
        start.push_str(&format!("a{i}=$(cat {c}); "));
        short.push(format!("[ $(cat {c}) -lt $((a{i} + {runs})) ]"));
        failed.push_str(&format!(
            "[ -e {c}.failed ] && {{ echo hvd-test: the gc loop failed >&2; exit 1; }}; "
        ));
    }
    format!(
        "{start}i=0; while {}; do {failed}i=$((i + 1)); [ $i -lt 12000 ] || {{ echo hvd-test: no gc run for 600 s \
         >&2; exit 1; }}; sleep 0.05; done",
        short.join(" || ")
    )
}

/// `hvd gc` (whatever command `gc` makes) run again and again on a thread until dropped, as an attacker on a node
/// would run it: every run must succeed (a failed one ends the loop, and the next wait fails with its output).
/// With `counter`, the number of finished runs is written there after each run (whole, through a rename), so a
/// process the test does not control (a rank) can wait for gc too.
pub struct GcLoop {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    runs: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl GcLoop {
    pub fn start(gc: impl Fn() -> Command + Send + 'static, counter: Option<PathBuf>) -> GcLoop {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (stopped, counted) = (stop.clone(), runs.clone());
        let thread = std::thread::spawn(move || {
            let result = (|| {
                while !stopped.load(Ordering::SeqCst) {
                    let out = gc().output().map_err(|e| e.to_string())?;
                    if !out.status.success() {
                        let (stdout, stderr) = text(&out);
                        return Err(format!("gc failed ({}): {stdout}\n{stderr}", out.status));
                    }
                    let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    if let Some(counter) = &counter {
                        let part = counter.with_extension("part");
                        std::fs::write(&part, n.to_string()).map_err(|e| e.to_string())?;
                        std::fs::rename(&part, counter).map_err(|e| e.to_string())?;
                    }
                }
                Ok(())
            })();
            // A waiting rank ([`gc_wait_script`]) stops waiting for runs that will never come.
            if let (Err(e), Some(counter)) = (&result, &counter) {
                let _ = std::fs::write(counter.with_extension("failed"), e);
            }
            result
        });
        GcLoop {
            stop,
            runs,
            thread: Some(thread),
        }
    }

    /// The runs finished so far.
    pub fn runs(&self) -> usize {
        self.runs.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until `n` runs have finished; fails the test when the loop has ended (a run failed) before.
    pub fn wait_runs(&mut self, n: usize) {
        while self.runs() < n {
            if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
                let result = self.thread.take().map(|t| t.join());
                panic!("the gc loop ended after {} runs: {result:?}", self.runs());
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Stops the loop after its current run; fails the test when a run failed.
    pub fn stop(mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let result = thread.join().expect("the gc loop panicked");
            assert!(result.is_ok(), "{result:?}");
        }
    }
}

impl Drop for GcLoop {
    /// Ends the loop however the test ends (a failed assertion must not leave it running).
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs `command` to its end while reading, as any local user can, every process's command line (`/proc/*/cmdline`)
/// every 20 ms: its output, and the command lines that held `secret`.
pub fn run_reading_command_lines(mut command: Command, secret: &str) -> (Output, Vec<String>) {
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scanner = {
        let (done, secret) = (done.clone(), secret.as_bytes().to_vec());
        std::thread::spawn(move || {
            let mut leaks = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                for entry in std::fs::read_dir("/proc").unwrap().flatten() {
                    let Ok(line) = std::fs::read(entry.path().join("cmdline")) else {
                        continue;
                    };
                    if line.windows(secret.len()).any(|w| w == secret.as_slice()) {
                        leaks.push(String::from_utf8_lossy(&line).replace('\0', " "));
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            leaks
        })
    };
    let out = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    (out, scanner.join().unwrap())
}
