//! End-to-end builder tests over real HTTP, real archives, a real interpreter and a real C compiler.

#[allow(dead_code)] // each test binary uses part of the shared fixtures
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use hvd_builder::{
    BuildOptions, EnvBuild, EnvPlan, Error, NoProgress, PackagePlan, SourceBuildPlan, Store,
    Toolchain, build_env, check_env,
};

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    server: FileServer,
    store: Store,
    /// Where a test signals a build (`block`): outside `/tmp`, which the build sandbox hides, so a build sees it
    /// (read-only).
    control: PathBuf,
    _control_dir: Option<tempfile::TempDir>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let files = root.join("files");
    std::fs::create_dir(&files).unwrap();
    let server = FileServer::start(&files);
    let store = Store::open(root.join("store")).unwrap();
    let control_dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    Fixture {
        _dir: dir,
        root,
        server,
        store,
        control: control_dir.path().to_path_buf(),
        _control_dir: Some(control_dir),
    }
}

impl Fixture {
    /// Build `plan` with the default options; it must succeed.
    fn build(&self, plan: &EnvPlan) -> EnvBuild {
        build_env(&self.store, plan, &BuildOptions::default(), &NoProgress).unwrap()
    }

    /// Build `plan` with `options`; it must fail. The error's text.
    fn build_error(&self, plan: &EnvPlan, options: &BuildOptions) -> String {
        build_env(&self.store, plan, options, &NoProgress)
            .unwrap_err()
            .to_string()
    }
}

fn plan(packages: Vec<PackagePlan>) -> EnvPlan {
    EnvPlan {
        name: "demo".into(),
        python: host_python(),
        interpreter: None,
        packages,
        toolchain: None,
        local_packages: Vec::new(),
    }
}

fn port(server: &FileServer) -> String {
    server.base.rsplit(':').next().unwrap().to_string()
}

/// The `ext` sdist: a C extension compiled against `fwk`'s header. `prelude` is Python run first in build_wheel.
fn ext_sdist(f: &Fixture, name: &str, prelude: &str) -> PackagePlan {
    ext_sdist_with(f, name, prelude, &[])
}

/// [`ext_sdist`] with `extra` files in the sdist.
fn ext_sdist_with(f: &Fixture, name: &str, prelude: &str, extra: &[(&str, &[u8])]) -> PackagePlan {
    let backend = backend_source(name, "1.0", prelude);
    let module = format!("from {name}_native import value\n");
    let port = port(&f.server);
    let native = NATIVE_C.replace("ext_native", &format!("{name}_native"));
    let mut files: Vec<(&str, &[u8])> = vec![
        ("pyproject.toml", PYPROJECT.as_bytes()),
        ("fixture_backend.py", backend.as_bytes()),
        ("native.c", native.as_bytes()),
        ("module.py", module.as_bytes()),
        ("port.txt", port.as_bytes()),
    ];
    files.extend_from_slice(extra);
    let filename = make_sdist(&f.server.root, name, "1.0", &files);
    PackagePlan {
        name: name.into(),
        version: "1.0".into(),
        artifact: f.server.artifact(&filename),
        dependencies: vec!["fwk".into()],
        build: Some(SourceBuildPlan {
            requires: Vec::new(),
            env: BTreeMap::from([("FIXTURE_FLAG".to_string(), "on".to_string())]),
            against: vec!["fwk".into()],
        }),
    }
}

#[test]
fn wheels_install_into_a_venv_layout_env() {
    let f = fixture();
    let greet = make_wheel(
        &f.server.root,
        "greet",
        "1.0",
        &[
            (
                "greet/__init__.py",
                b"def main():\n    print('hello from greet')\n",
            ),
            (
                "greet-1.0.data/scripts/raw-tool",
                b"#!python\nimport sys\nprint(sys.executable)\n",
            ),
            ("greet-1.0.data/purelib/greet_extra.py", b"X = 1\n"),
            ("greet_paths.pth", b"import greet_extra\n"),
            ("ns/a/__init__.py", b"A = 'a'\n"),
        ],
        Some("[console_scripts]\ngreet = greet:main\n"),
    );
    let other = make_wheel(
        &f.server.root,
        "other",
        "2.0",
        &[("ns/b/__init__.py", b"B = 'b'\n")],
        None,
    );
    let plan = plan(vec![
        f.server.wheel_plan("greet", "1.0", &greet),
        f.server.wheel_plan("other", "2.0", &other),
    ]);

    let built = f.build(&plan);
    assert!(built.env_built);
    assert!(built.packages.iter().all(|p| p.built && !p.source_built));
    let python = built.env.join("bin/python");
    let cfg = std::fs::read_to_string(built.env.join("pyvenv.cfg")).unwrap();
    assert!(
        cfg.contains("include-system-site-packages = false"),
        "{cfg}"
    );

    // Namespace package merged from two wheels, .pth processed, isolated from the system site-packages.
    let out = run_python(
        &python,
        "import sys, ns.a, ns.b; print(ns.a.A + ns.b.B, 'greet_extra' in sys.modules, sys.prefix); \
         print(all(not p.endswith('site-packages') or p.startswith(sys.prefix) for p in sys.path))",
    );
    let env = built.env.display().to_string();
    assert_eq!(out, format!("ab True {env}\nTrue"));

    // Console script and `#!python` script run with the env's interpreter.
    let greet_out = Command::new(built.env.join("bin/greet")).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&greet_out.stdout).trim(),
        "hello from greet"
    );
    let raw = Command::new(built.env.join("bin/raw-tool"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&raw.stdout).trim(),
        format!("{env}/bin/python")
    );

    // The recorded content hash (computed from the hashes taken while unpacking) matches a fresh walk.
    for package in &built.packages {
        let info = f.store.path_info(&package.path).unwrap();
        let fresh =
            hvd_builder::hash::content_hash(&hvd_builder::hash::manifest(&package.path).unwrap());
        assert_eq!(info.content_hash, fresh, "{}", package.name);
    }

    // Store paths are read-only and the second build is a no-op.
    let package = &built.packages[0].path;
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(package.join("site-packages/greet/__init__.py"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o444);
    let again = f.build(&plan);
    assert_eq!(again.env, built.env);
    assert!(!again.env_built && again.packages.iter().all(|p| !p.built));

    // Offline from a warm download cache: remove the paths, keep the downloads, stop trusting the server.
    for name in f.store.list_paths().unwrap() {
        hvd_builder::store::remove_tree(&f.store.root().join(name)).unwrap();
    }
    std::fs::remove_dir_all(&f.server.root).unwrap();
    let offline = BuildOptions {
        offline: true,
        ..BuildOptions::default()
    };
    let rebuilt = build_env(&f.store, &plan, &offline, &NoProgress).unwrap();
    assert_eq!(rebuilt.env, built.env);
    assert!(rebuilt.env_built);
}

#[test]
fn hash_mismatch_names_url_and_hashes_and_installs_nothing() {
    let f = fixture();
    let filename = make_wheel(&f.server.root, "good", "1.0", &[("good.py", b"")], None);
    let mut package = f.server.wheel_plan("good", "1.0", &filename);
    let actual = package.artifact.sha256.to_string();
    package.artifact.sha256 = hvd_builder::Sha256::of_bytes(b"something else");
    let expected = package.artifact.sha256.to_string();
    let err = build_default(&f.store, &plan(vec![package.clone()])).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::HashMismatch { .. }), "{message}");
    assert!(
        message.contains(&package.artifact.url)
            && message.contains(&expected)
            && message.contains(&actual),
        "{message}"
    );
    // The env's interpreter is copied into the store before any package is fetched.
    assert!(paths_besides_interpreters(&f.store).is_empty());
    let cached: Vec<_> = std::fs::read_dir(f.store.downloads_dir().join("sha256"))
        .unwrap()
        .collect();
    assert!(cached.is_empty(), "nothing may stay in the download cache");
}

#[test]
fn wheel_with_path_traversal_is_refused() {
    let f = fixture();
    let filename = make_wheel(
        &f.server.root,
        "evil",
        "1.0",
        &[("../../escaped.py", b"x")],
        None,
    );
    let err = build_default(
        &f.store,
        &plan(vec![f.server.wheel_plan("evil", "1.0", &filename)]),
    )
    .unwrap_err();
    // The refusal names the package (`Error::Install`), with the archive's own reason as its cause.
    match &err {
        Error::Install { name, source, .. } => {
            assert_eq!(name, "evil");
            assert!(
                matches!(**source, Error::UnsafeArchiveEntry { .. }),
                "{source}"
            );
        }
        other => panic!("expected Error::Install, got {other}"),
    }
    // The env's interpreter is copied into the store before any package is fetched.
    assert!(paths_besides_interpreters(&f.store).is_empty());
    assert!(
        !f.store.root().join(".tmp/escaped.py").exists()
            && !f.store.root().join("escaped.py").exists()
    );
}

fn ext_value(env: &Path, module: &str) -> String {
    run_python(
        &env.join("bin/python"),
        &format!("import {module}; print({module}.value())"),
    )
}

#[test]
fn source_build_follows_the_framework_and_reverting_is_a_cache_hit() {
    let f = fixture();
    let fwk1 = make_framework(&f.server.root, "1.0", 1);
    let fwk2 = make_framework(&f.server.root, "2.0", 2);
    let ext = ext_sdist(&f, "ext", "");
    let with_fwk = |file: &str, version: &str| {
        plan(vec![f.server.wheel_plan("fwk", version, file), ext.clone()])
    };

    let first = f.build(&with_fwk(&fwk1, "1.0"));
    assert_eq!(ext_value(&first.env, "ext"), "1");
    let ext_first = first
        .packages
        .iter()
        .find(|p| p.name == "ext")
        .unwrap()
        .clone();
    assert!(ext_first.built && ext_first.source_built);

    // The build ran with a cleared environment, without network (where namespaces work), with fixed HOME.
    let facts = run_python(
        &first.env.join("bin/python"),
        "from ext.build_facts import NETWORK, ENV; print(NETWORK); print(' '.join(ENV))",
    );
    let (network, env) = facts.split_once('\n').unwrap();
    if first.isolation != Some(hvd_builder::source_build::NetworkIsolation::None) {
        assert_eq!(network, "unreachable");
    }
    let allowed = [
        "CC",
        "CXX",
        "FIXTURE_FLAG",
        "HOME",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "PATH",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONHASHSEED",
        "SOURCE_DATE_EPOCH",
        "TMPDIR",
        "VIRTUAL_ENV",
    ];
    for name in env.split(' ') {
        assert!(
            allowed.contains(&name),
            "unexpected variable `{name}` in the build environment: {env}"
        );
    }

    let second = f.build(&with_fwk(&fwk2, "2.0"));
    assert_eq!(ext_value(&second.env, "ext"), "2");
    let ext_second = second.packages.iter().find(|p| p.name == "ext").unwrap();
    assert!(
        ext_second.built,
        "a framework change must rebuild the extension"
    );
    assert_ne!(ext_second.path, ext_first.path);

    let third = f.build(&with_fwk(&fwk1, "1.0"));
    assert_eq!(third.env, first.env);
    let ext_third = third.packages.iter().find(|p| p.name == "ext").unwrap();
    assert_eq!(ext_third.path, ext_first.path);
    assert!(
        !ext_third.built && !third.env_built,
        "reverting the framework must be a cache hit"
    );

    let info = f.store.path_info(&ext_first.path).unwrap();
    assert_eq!(
        info.content_hash,
        hvd_builder::hash::content_hash(&hvd_builder::hash::manifest(&ext_first.path).unwrap())
    );

    // `--check` rebuilds and finds the same bytes for this deterministic build.
    let report = check_env(
        &f.store,
        &with_fwk(&fwk1, "1.0"),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(report.len(), 1);
    assert!(report[0].differing.is_empty(), "{:?}", report[0].differing);

    // Under `--locked`, a toolchain other than the pin is refused, naming both.
    let mut pinned = with_fwk(&fwk1, "1.0");
    pinned.toolchain = Some(Toolchain {
        name: "gcc".into(),
        version: "1.2.3".into(),
        sha256: None,
        path: None,
        debian: None,
    });
    let locked = BuildOptions {
        locked: true,
        ..BuildOptions::default()
    };
    let err = f.build_error(&pinned, &locked);
    assert!(
        err.contains("expects gcc 1.2.3") && err.contains("this machine has gcc"),
        "{err}"
    );
}

#[test]
fn check_reports_the_file_of_a_nondeterministic_build() {
    let f = fixture();
    let fwk = make_framework(&f.server.root, "1.0", 1);
    let noisy = ext_sdist(
        &f,
        "noisy",
        "    open('module.py', 'a').write('STAMP = %r\\n' % os.urandom(8).hex())",
    );
    let plan = plan(vec![f.server.wheel_plan("fwk", "1.0", &fwk), noisy]);
    f.build(&plan);
    let report = check_env(&f.store, &plan, &BuildOptions::default(), &NoProgress).unwrap();
    assert_eq!(report.len(), 1);
    // The module differs, and so does the RECORD listing its hash; nothing else.
    let differing = &report[0].differing;
    assert!(
        differing.contains(&"site-packages/noisy/__init__.py".to_string()),
        "{differing:?}"
    );
    assert!(
        differing
            .iter()
            .all(|p| p.ends_with("noisy/__init__.py") || p.ends_with("/RECORD")),
        "{differing:?}"
    );
}

/// A backend that, while `<control>/block` exists, records its start in its build directory
/// (`<store>/.build/<path>/work/home/started`: the only place a sandboxed build can write), starts a `setsid` process
/// tagged with the control directory's path, and blocks.
fn blocking_sdist(f: &Fixture, name: &str) -> PackagePlan {
    let control = f.control.display().to_string();
    let prelude = format!(
        "    import time\n    if os.path.exists({block:?}):\n        subprocess.Popen(['setsid', 'sh', '-c', 'sleep 300; : ' + {tag:?}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n        open(os.environ['HOME'] + '/started', 'w').close()\n        while os.path.exists({block:?}):\n            time.sleep(0.02)",
        block = format!("{control}/block"),
        tag = format!("escapee {control}"),
    );
    ext_sdist(f, name, &prelude)
}

/// Waits until a blocking build has started (see [`blocking_sdist`]); returns its build directory.
fn wait_started(store: &Store) -> PathBuf {
    for _ in 0..3000 {
        if let Ok(entries) = std::fs::read_dir(store.root().join(".build")) {
            for entry in entries.flatten() {
                if entry.path().join("work/home/started").exists() {
                    return entry.path();
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("no build started in {}", store.root().display());
}

/// Pids of processes whose command line holds `tag`.
fn tagged_processes(tag: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline)
                .contains(tag)
                .then_some(pid)
        })
        .collect()
}

fn wait_for(path: &Path) {
    for _ in 0..2000 {
        if path.exists() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("{} never appeared", path.display());
}

#[test]
fn concurrent_builds_of_one_path_build_once() {
    let f = fixture();
    let fwk = make_framework(&f.server.root, "1.0", 1);
    let plan = plan(vec![
        f.server.wheel_plan("fwk", "1.0", &fwk),
        blocking_sdist(&f, "slow"),
    ]);
    std::fs::write(f.control.join("block"), "").unwrap();
    let results = std::thread::scope(|scope| {
        let first =
            scope.spawn(|| build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress));
        wait_started(&f.store);
        // The first build is mid-way and holds the path's lock; start the second, then let both finish.
        let second =
            scope.spawn(|| build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress));
        std::fs::remove_file(f.control.join("block")).unwrap();
        [
            first.join().unwrap().unwrap(),
            second.join().unwrap().unwrap(),
        ]
    });
    assert_eq!(results[0].env, results[1].env);
    let slow: Vec<_> = results
        .iter()
        .map(|r| r.packages.iter().find(|p| p.name == "slow").unwrap().built)
        .collect();
    assert_eq!(
        slow.iter().filter(|b| **b).count(),
        1,
        "exactly one build: {slow:?}"
    );
    // The build's `setsid` child ended with the build, which ended normally (where the build has its own pid
    // namespace).
    let tag = format!("escapee {}", f.control.display());
    if hvd_builder::source_build::network_isolation()
        != hvd_builder::source_build::NetworkIsolation::None
    {
        assert_eq!(tagged_processes(&tag), Vec::<u32>::new());
    }
    assert_eq!(
        std::fs::read_dir(f.store.root().join(".tmp"))
            .unwrap()
            .count(),
        0
    );
}

/// Runs only when re-executed by `killed_build_leaves_nothing_and_the_retry_succeeds`.
#[test]
fn kill_helper() {
    let Some(dir) = std::env::var_os("HVD_TEST_KILL_DIR") else {
        return;
    };
    let root = PathBuf::from(dir);
    let spec = std::fs::read_to_string(root.join("spec")).unwrap();
    let mut lines = spec.lines();
    let (base, store_root, control) = (
        lines.next().unwrap(),
        lines.next().unwrap(),
        lines.next().unwrap(),
    );
    let f = Fixture {
        _dir: tempfile::tempdir().unwrap(),
        root: root.clone(),
        server: FileServer {
            root: root.join("files"),
            base: base.to_string(),
        },
        store: Store::open(store_root).unwrap(),
        control: PathBuf::from(control),
        _control_dir: None,
    };
    let fwk = f
        .server
        .wheel_plan("fwk", "1.0", "fwk-1.0-py3-none-any.whl");
    let _ = build_default(&f.store, &plan(vec![fwk, blocking_sdist(&f, "victim")]));
}

#[test]
fn killed_build_leaves_nothing_and_the_retry_succeeds() {
    let f = fixture();
    let fwk = make_framework(&f.server.root, "1.0", 1);
    let victim = blocking_sdist(&f, "victim");
    std::fs::write(
        f.root.join("spec"),
        format!(
            "{}\n{}\n{}\n",
            f.server.base,
            f.store.root().display(),
            f.control.display()
        ),
    )
    .unwrap();
    std::fs::write(f.control.join("block"), "").unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "kill_helper", "--nocapture"])
        .env("HVD_TEST_KILL_DIR", &f.root)
        .spawn()
        .unwrap();
    wait_started(&f.store);
    let tag = format!("escapee {}", f.control.display());
    // `started` is written right after Popen returned, which may be before `setsid` has exec'd the tagged `sh`.
    let mut running = tagged_processes(&tag);
    for _ in 0..500 {
        if !running.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        running = tagged_processes(&tag);
    }
    assert!(!running.is_empty(), "the build's setsid child runs");
    child.kill().unwrap(); // SIGKILL, mid-build
    child.wait().unwrap();
    // Every process of the build ends with the builder, the backend's `setsid` child included.
    let mut left = tagged_processes(&tag);
    for _ in 0..250 {
        if left.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        left = tagged_processes(&tag);
    }
    if hvd_builder::source_build::network_isolation()
        != hvd_builder::source_build::NetworkIsolation::None
    {
        assert_eq!(
            left,
            Vec::<u32>::new(),
            "build processes outlived `kill -9`"
        );
    }
    let paths = f.store.list_paths().unwrap();
    assert!(
        !paths.iter().any(|p| p.ends_with("-victim-1.0")),
        "no partial path may appear: {paths:?}"
    );
    assert!(
        std::fs::read_dir(f.store.root().join(".tmp"))
            .unwrap()
            .count()
            > 0,
        "the killed build left its temp dir"
    );

    std::fs::remove_file(f.control.join("block")).unwrap();
    let plan = plan(vec![f.server.wheel_plan("fwk", "1.0", &fwk), victim]);
    let built = f.build(&plan);
    assert_eq!(ext_value(&built.env, "victim"), "1");
    assert_eq!(
        std::fs::read_dir(f.store.root().join(".tmp"))
            .unwrap()
            .count(),
        0,
        "stale temp dirs are cleaned"
    );
}

#[test]
fn gc_removes_what_no_root_reaches() {
    let f = fixture();
    let kept = make_wheel(&f.server.root, "kept", "1.0", &[("kept.py", b"")], None);
    let dropped = make_wheel(
        &f.server.root,
        "dropped",
        "1.0",
        &[("dropped.py", b"")],
        None,
    );
    let keep_plan = plan(vec![f.server.wheel_plan("kept", "1.0", &kept)]);
    let mut drop_plan = plan(vec![f.server.wheel_plan("dropped", "1.0", &dropped)]);
    drop_plan.name = "other".into();
    let keep = f.build(&keep_plan);
    let gone = f.build(&drop_plan);
    let project_a = f.root.join("a/.hvd/env");
    let project_b = f.root.join("b/.hvd/env");
    hvd_builder::gc::add_root(&f.store, &project_a, &keep.env).unwrap();
    hvd_builder::gc::add_root(&f.store, &project_b, &gone.env).unwrap();
    std::fs::remove_dir_all(f.root.join("b")).unwrap();

    let dry = hvd_builder::gc::collect_garbage(&f.store, true).unwrap();
    assert_eq!(dry.dead.len(), 2, "{:?}", dry.dead);
    assert_eq!(
        f.store.list_paths().unwrap().len(),
        5,
        "a dry run removes nothing (2 packages, 2 envs, the interpreter)"
    );

    let report = hvd_builder::gc::collect_garbage(&f.store, false).unwrap();
    assert_eq!(report.dead, dry.dead);
    let left = f.store.list_paths().unwrap();
    assert_eq!(
        left.len(),
        3,
        "the kept env, its package and interpreter: {left:?}"
    );
    assert!(
        left.iter().any(|p| p.ends_with("-kept-1.0"))
            && left.iter().any(|p| p.ends_with("-demo-env"))
    );
    assert!(!gone.env.exists() && keep.env.exists());
    assert_eq!(
        run_python(&project_a.join("bin/python"), "import kept; print('ok')"),
        "ok"
    );
}

#[test]
fn local_packages_join_the_env_and_edits_make_a_new_path() {
    let f = fixture();
    let runtime = f.root.join("runtime");
    std::fs::create_dir_all(runtime.join("hvdrt")).unwrap();
    std::fs::write(runtime.join("hvdrt/__init__.py"), "VALUE = 1\n").unwrap();
    let mut plan = plan(Vec::new());
    plan.local_packages.push(hvd_builder::LocalPackage {
        name: "hvdrt".into(),
        version: "0.1.0".into(),
        source: runtime.clone(),
    });
    let first = f.build(&plan);
    assert_eq!(
        run_python(
            &first.env.join("bin/python"),
            "import hvdrt; print(hvdrt.VALUE)"
        ),
        "1"
    );
    std::fs::write(runtime.join("hvdrt/__init__.py"), "VALUE = 2\n").unwrap();
    let second = f.build(&plan);
    assert_ne!(second.env, first.env);
    assert_eq!(
        run_python(
            &second.env.join("bin/python"),
            "import hvdrt; print(hvdrt.VALUE)"
        ),
        "2"
    );
    assert_eq!(
        run_python(
            &first.env.join("bin/python"),
            "import hvdrt; print(hvdrt.VALUE)"
        ),
        "1",
        "old envs are immutable"
    );
}

/// Runs `script` with `sh -c` as the unprivileged user `nobody` (root ignores file modes, so only a non-root writer
/// shows what the modes allow). `None` when this machine cannot switch users (not root, no `setpriv`).
fn as_nobody(script: &str) -> Option<std::process::Output> {
    let output = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            script,
        ])
        .output()
        .ok()?;
    // Exit 127 / an error from setpriv itself: the switch did not happen.
    let stderr = String::from_utf8_lossy(&output.stderr);
    (!stderr.starts_with("setpriv:")).then_some(output)
}

#[test]
fn store_paths_are_read_only_all_the_way_down() {
    let f = fixture();
    // The test's temp dir is 0700; let `nobody` reach the store (store paths themselves are world-readable).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(f.root.as_path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let deep = make_wheel(
        &f.server.root,
        "deep",
        "1.0",
        &[
            ("deep/__init__.py", b"X = 1\n"),
            ("deep/sub/inner/mod.py", b"Y = 2\n"),
            ("deep-1.0.data/scripts/tool", b"#!/bin/sh\necho tool\n"),
        ],
        None,
    );
    let built = f.build(&plan(vec![f.server.wheel_plan("deep", "1.0", &deep)]));
    let package = &built.packages[0].path;
    let mut checked = 0;
    for top in [package, &built.env] {
        for entry in walk(top) {
            let meta = std::fs::symlink_metadata(&entry).unwrap();
            if meta.file_type().is_symlink() {
                continue;
            }
            let mode = meta.permissions().mode() & 0o7777;
            let expected: &[u32] = if meta.is_dir() {
                &[0o555]
            } else {
                &[0o444, 0o555]
            };
            assert!(
                expected.contains(&mode),
                "{} has mode {mode:o}",
                entry.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 10, "walked only {checked} entries");

    // A job running as the store's owner can read the package but change nothing in it, at any depth. Root
    // ignores modes, so the package is handed to `nobody` and the job runs as `nobody`: only the modes stop it.
    let inner = package.join("site-packages/deep/sub/inner");
    let chown = Command::new("chown")
        .args(["-R", "-h", "65534:65534"])
        .arg(package)
        .status();
    if !chown.is_ok_and(|s| s.success()) {
        eprintln!("cannot chown here (not root); the mode walk above is the check");
        return;
    }
    let Some(read) = as_nobody(&format!("cat '{}/mod.py'", inner.display())) else {
        eprintln!("cannot switch to an unprivileged user here; the mode walk above is the check");
        return;
    };
    assert!(
        read.status.success(),
        "nobody must be able to read the store: {}",
        String::from_utf8_lossy(&read.stderr)
    );
    for attack in [
        format!("echo 'Y = 666' > '{}/mod.py'", inner.display()),
        format!("touch '{}/planted.py'", inner.display()),
        format!(
            "mkdir '{}/planted'",
            package.join("site-packages/deep").display()
        ),
        format!("rm -f '{}/mod.py'", inner.display()),
        format!(
            "mv '{}' '{}/moved'",
            inner.display(),
            package.join("site-packages").display()
        ),
    ] {
        let out = as_nobody(&attack).unwrap();
        assert!(!out.status.success(), "`{attack}` succeeded as nobody");
    }
    assert_eq!(
        std::fs::read_to_string(inner.join("mod.py")).unwrap(),
        "Y = 2\n"
    );
    assert!(!inner.join("planted.py").exists());

    // gc can still remove read-only paths.
    let report = hvd_builder::gc::collect_garbage(&f.store, false).unwrap();
    assert_eq!(
        report.dead.len(),
        3,
        "package, env, interpreter: {:?}",
        report.dead
    );
    assert!(!package.exists() && !built.env.exists());
}

/// Runs only when re-executed by `running_env_survives_gc_and_a_dead_ones_root_does_not`: does what `hvd exec`
/// does (build under the builders' lock, take a temporary root, keep it across exec) and execs a shell that waits
/// for `<dir>/stop`, then imports from the env.
#[test]
fn temp_root_helper() {
    use std::os::unix::process::CommandExt;
    let Some(dir) = std::env::var_os("HVD_TEST_ROOT_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let spec = std::fs::read_to_string(dir.join("spec")).unwrap();
    let mut lines = spec.lines();
    let store = Store::open(lines.next().unwrap()).unwrap();
    let env = PathBuf::from(lines.next().unwrap());
    let builders = store.lock_builders().unwrap();
    assert!(store.is_valid(&env));
    let root = hvd_builder::gc::TempRoot::create(&store, &[&env]).unwrap();
    root.keep_across_exec().unwrap();
    drop(builders);
    let script = format!(
        "touch '{d}/ready'; while [ ! -e '{d}/stop' ]; do sleep 0.02; done; exec '{env}/bin/python' -c 'import kept; print(\"imported\")'",
        d = dir.display(),
        env = env.display()
    );
    let err = Command::new("/bin/sh").arg("-c").arg(script).exec();
    panic!("exec failed: {err}");
}

#[test]
fn running_env_survives_gc_and_a_dead_ones_root_does_not() {
    let f = fixture();
    let kept = make_wheel(&f.server.root, "kept", "1.0", &[("kept.py", b"")], None);
    let built = f.build(&plan(vec![f.server.wheel_plan("kept", "1.0", &kept)]));
    // No project link: only the running process keeps the env.
    std::fs::write(
        f.root.join("spec"),
        format!("{}\n{}\n", f.store.root().display(), built.env.display()),
    )
    .unwrap();
    let spawn = || {
        let _ = std::fs::remove_file(f.root.join("ready"));
        let _ = std::fs::remove_file(f.root.join("stop"));
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "temp_root_helper", "--nocapture"])
            .env("HVD_TEST_ROOT_DIR", &f.root)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&f.root.join("ready"));
        child
    };

    let child = spawn();
    let report = hvd_builder::gc::collect_garbage(&f.store, false).unwrap();
    assert_eq!(report.temp_roots, 1, "{report:?}");
    assert!(report.dead.is_empty(), "removed in use: {:?}", report.dead);
    assert!(f.store.is_valid(&built.env) && f.store.is_valid(&built.packages[0].path));
    std::fs::write(f.root.join("stop"), "").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("imported"));

    // A process killed with SIGKILL leaves its root file behind; gc sees nobody holds it and stops keeping paths.
    let mut child = spawn();
    child.kill().unwrap();
    child.wait().unwrap();
    // Both processes exec'd, so neither removed its root file: gc has to tell them from live ones.
    let roots = f.store.root().join(".temproots");
    assert_eq!(std::fs::read_dir(&roots).unwrap().count(), 2);
    // The shell's last `sleep` inherited the descriptor too and holds the root for up to 20 ms more.
    let mut report = hvd_builder::gc::collect_garbage(&f.store, true).unwrap();
    for _ in 0..250 {
        if report.stale_temp_roots == 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        report = hvd_builder::gc::collect_garbage(&f.store, true).unwrap();
    }
    assert_eq!(report.stale_temp_roots, 2, "{report:?}");
    assert_eq!(report.temp_roots, 0, "{report:?}");
    let report = hvd_builder::gc::collect_garbage(&f.store, false).unwrap();
    assert_eq!(
        report.dead.len(),
        3,
        "package, env, interpreter: {report:?}"
    );
    assert!(!built.env.exists());
    assert_eq!(std::fs::read_dir(&roots).unwrap().count(), 0);
}

/// Removes a file when dropped (a secret planted in the real home directory for the sandbox test).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_hostile_build_backend_cannot_write_outside_read_home_or_reach_the_network() {
    if hvd_builder::source_build::network_isolation()
        != hvd_builder::source_build::NetworkIsolation::Sandbox
    {
        eprintln!("no `bwrap` sandbox on this machine (install bubblewrap); skipping");
        return;
    }
    let f = fixture();
    let fwk = make_framework(&f.server.root, "1.0", 1);
    let watched = f.root.join("watched");
    std::fs::create_dir(&watched).unwrap();
    // A listener that must never see a connection from the build.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    // A secret in the real home directory of the user running the build.
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap();
    let secret = home.join(format!(".hvd-test-secret-{}", std::process::id()));
    std::fs::write(&secret, "top secret").unwrap();
    let _cleanup = RemoveOnDrop(secret.clone());
    // Paths already in the store (the framework wheel) and the store's own directories.
    let fwk_plan = f.server.wheel_plan("fwk", "1.0", &fwk);
    f.build(&plan(vec![fwk_plan.clone()]));
    let fwk_path = f
        .store
        .list_paths()
        .unwrap()
        .into_iter()
        .find(|p| p.ends_with("-fwk-1.0"))
        .map(|p| f.store.root().join(p))
        .unwrap();
    let prelude = format!(
        r#"    import pwd
    def attempt(label, action):
        try:
            action()
            print("HOSTILE", label, "ok", flush=True)
        except BaseException as err:
            print("HOSTILE", label, "denied", type(err).__name__, flush=True)
    def write(path):
        with open(path, "w") as f:
            f.write("pwned")
    def read(path):
        print("HOSTILE read:", open(path).read(), flush=True)
    attempt("write-watched", lambda: write({watched:?} + "/escaped"))
    attempt("write-store-root", lambda: write({store:?} + "/planted"))
    attempt("write-store-path", lambda: write({fwk:?} + "/planted"))
    attempt("write-downloads", lambda: write({store:?} + "/.downloads/planted"))
    attempt("read-home-secret", lambda: read(pwd.getpwuid(os.getuid()).pw_dir + "/" + {secret_name:?}))
    attempt("connect", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2).close())
    attempt("write-build-dir", lambda: write(os.path.join(os.getcwd(), "scratch")))
    attempt("write-home-var", lambda: write(os.path.join(os.environ["HOME"], "scratch")))
    raise SystemExit("HOSTILE done")"#,
        watched = watched.display().to_string(),
        store = f.store.root().display().to_string(),
        fwk = fwk_path.display().to_string(),
        secret_name = secret.file_name().unwrap().to_string_lossy().to_string(),
    );
    let hostile = ext_sdist(&f, "hostile", &prelude);
    let err = build_default(&f.store, &plan(vec![fwk_plan, hostile])).unwrap_err();
    let Error::BuildFailed { tail, .. } = &err else {
        panic!("expected the hostile build to fail on purpose: {err}");
    };
    assert!(tail.contains("HOSTILE done"), "{tail}");
    let result = |label: &str| {
        tail.lines()
            .find_map(|l| l.strip_prefix(&format!("HOSTILE {label} ")))
            .unwrap_or_else(|| panic!("no result for {label}: {tail}"))
            .to_string()
    };
    for label in [
        "write-watched",
        "write-store-root",
        "write-store-path",
        "write-downloads",
        "read-home-secret",
        "connect",
    ] {
        assert!(
            result(label).starts_with("denied"),
            "{label}: {}\n{tail}",
            result(label)
        );
    }
    assert_eq!(result("write-build-dir"), "ok", "{tail}");
    assert_eq!(result("write-home-var"), "ok", "{tail}");
    assert!(!tail.contains("top secret"), "{tail}");
    // And from the outside: nothing appeared, nobody connected.
    assert_eq!(std::fs::read_dir(&watched).unwrap().count(), 0);
    assert!(!f.store.root().join("planted").exists());
    assert!(!fwk_path.join("planted").exists());
    assert!(!f.store.root().join(".downloads/planted").exists());
    assert!(listener.accept().is_err(), "the build reached the listener");
}

/// Compile a shared object whose constructor appends to `marker` (it runs in every process that loads it).
fn preload_object(dir: &Path, marker: &Path) -> PathBuf {
    let source = dir.join("evil.c");
    std::fs::write(
        &source,
        format!(
            "#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) static void evil(void) {{\n  \
             int fd = open({:?}, O_WRONLY | O_CREAT | O_APPEND, 0644);\n  if (fd >= 0) {{ write(fd, \"x\", 1); \
             close(fd); }}\n}}\n",
            marker.display().to_string()
        ),
    )
    .unwrap();
    let object = dir.join("evil.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&object)
        .arg(&source)
        .status()
        .unwrap();
    assert!(status.success());
    object
}

/// #16, review finding 2: a lockfile's build variables (`LD_PRELOAD` of a shared object the sdist ships, a `PATH`
/// with a fake `bwrap` first) reach only the build inside the sandbox, never the program that sets it up.
#[test]
fn build_variables_never_reach_the_sandbox_program() {
    if hvd_builder::source_build::network_isolation()
        != hvd_builder::source_build::NetworkIsolation::Sandbox
    {
        eprintln!("no `bwrap` sandbox on this machine (install bubblewrap); skipping");
        return;
    }
    let f = fixture();
    // Outside the sandbox's view: /tmp is a private tmpfs inside it.
    let outside = tempfile::tempdir_in("/tmp").unwrap();
    let marker = outside.path().join("preloaded");
    let object = preload_object(outside.path(), &marker);
    // The attack works where the variables reach a process outside: the constructor runs and the marker appears.
    let probe = Command::new("/bin/true")
        .env("LD_PRELOAD", &object)
        .status()
        .unwrap();
    assert!(
        probe.success() && marker.exists(),
        "the preload object does not work here"
    );
    std::fs::remove_file(&marker).unwrap();
    let fake_bin = outside.path().join("bin");
    std::fs::create_dir(&fake_bin).unwrap();
    let fake_marker = outside.path().join("fake-bwrap-ran");
    let fake = fake_bin.join("bwrap");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\necho ran > {:?}\nexec /usr/bin/bwrap \"$@\"\n",
            fake_marker.display().to_string()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();

    let fwk = make_framework(&f.server.root, "1.0", 1);
    let so = std::fs::read(&object).unwrap();
    // The build itself checks that its variables arrived (FIXTURE_FLAG and the recipe's PATH).
    let prelude = format!(
        "    assert os.environ[\"FIXTURE_FLAG\"] == \"on\", os.environ\n    \
         assert os.environ[\"PATH\"].startswith({:?}), os.environ[\"PATH\"]\n    \
         assert os.environ[\"LD_PRELOAD\"] == \"./evil.so\", os.environ",
        fake_bin.display().to_string()
    );
    let mut hostile = ext_sdist_with(&f, "preload", &prelude, &[("evil.so", so.as_slice())]);
    let build = hostile.build.as_mut().unwrap();
    build
        .env
        .insert("LD_PRELOAD".to_string(), "./evil.so".to_string());
    build.env.insert(
        "PATH".to_string(),
        format!("{}:/usr/local/bin:/usr/bin:/bin", fake_bin.display()),
    );
    let built = f.build(&plan(vec![
        f.server.wheel_plan("fwk", "1.0", &fwk),
        hostile,
    ]));
    assert_eq!(ext_value(&built.env, "preload"), "1");
    assert!(
        !marker.exists(),
        "the preload object ran outside the sandbox"
    );
    assert!(
        !fake_marker.exists(),
        "the recipe's PATH chose the sandbox program"
    );

    // A variable name that is not an environment name is refused, naming it and the package.
    let mut odd = ext_sdist(&f, "oddname", "");
    odd.build
        .as_mut()
        .unwrap()
        .env
        .insert("--ro-bind".to_string(), "/".to_string());
    let err = f.build_error(
        &plan(vec![f.server.wheel_plan("fwk", "1.0", &fwk), odd]),
        &BuildOptions::default(),
    );
    assert!(
        err.contains("--ro-bind") && err.contains("oddname"),
        "{err}"
    );
}

/// #16, review finding 3: the build folder is the build's, so hvd reads nothing from it by a name the build could
/// have changed: the log is outside it (a link planted where it used to be shows nothing), and the reported wheel
/// must be a plain file in `dist` opened without following links.
#[test]
fn a_build_cannot_make_hvd_read_files_through_its_folder() {
    let f = fixture();
    let fwk = make_framework(&f.server.root, "1.0", 1);
    let fwk_plan = f.server.wheel_plan("fwk", "1.0", &fwk);
    // Outside the sandbox's view (/tmp is private inside it): a secret and a wheel the build must not install.
    let outside = tempfile::tempdir_in("/tmp").unwrap();
    let secret = outside.path().join("secret");
    std::fs::write(&secret, "TOP-SECRET-LINE\n").unwrap();
    let stolen = make_wheel(
        outside.path(),
        "stolen",
        "1.0",
        &[("stolen.py", b"SECRET = 1\n")],
        None,
    );
    let stolen = outside.path().join(stolen);
    let run = |name: &str, prelude: String| {
        build_default(
            &f.store,
            &plan(vec![fwk_plan.clone(), ext_sdist(&f, name, &prelude)]),
        )
    };

    // 1. Every name the log had or might have becomes a link to the secret, then the build fails.
    let prelude = format!(
        r#"    for rel in ("../../build.log", "../../../build.log", "../build.log", "build.log"):
        try:
            if os.path.lexists(rel):
                os.remove(rel)
            os.symlink({secret:?}, rel)
            print("HOSTILE linked", rel, flush=True)
        except OSError as err:
            print("HOSTILE refused", rel, type(err).__name__, flush=True)
    raise SystemExit("HOSTILE done")"#,
        secret = secret.display().to_string()
    );
    let err = run("logleak", prelude).unwrap_err();
    let Error::BuildFailed { tail, log, .. } = &err else {
        panic!("expected a failed build: {err}");
    };
    assert!(tail.contains("HOSTILE done"), "{tail}");
    let shown = err.to_string();
    assert!(!shown.contains("TOP-SECRET"), "{shown}");
    assert!(
        !std::fs::read_to_string(log).unwrap().contains("TOP-SECRET"),
        "the log path leads to the secret"
    );

    // 2. The reported wheel is a link in dist to a wheel outside.
    let prelude = format!(
        "    os.symlink({:?}, os.path.join(wheel_directory, \"stolen-1.0-py3-none-any.whl\"))\n    \
         return \"stolen-1.0-py3-none-any.whl\"",
        stolen.display().to_string()
    );
    let err = run("linkwheel", prelude).unwrap_err().to_string();
    assert!(
        err.contains("linkwheel") && err.contains("without following a link"),
        "{err}"
    );

    // 3. `dist` itself replaced by a link to the folder holding the wheel outside.
    let prelude = format!(
        "    import shutil\n    shutil.rmtree(wheel_directory)\n    os.symlink({:?}, wheel_directory)\n    \
         return \"stolen-1.0-py3-none-any.whl\"",
        outside.path().display().to_string()
    );
    let err = run("linkdist", prelude).unwrap_err().to_string();
    assert!(
        err.contains("linkdist") && err.contains("without following a link"),
        "{err}"
    );

    // 4. An absolute path and a `..` path as the wheel's name.
    for (name, reported) in [
        ("abswheel", stolen.display().to_string()),
        (
            "dotwheel",
            "../../../../../../../../..".to_string() + &stolen.display().to_string(),
        ),
    ] {
        let prelude = format!("    return {reported:?}");
        let err = run(name, prelude).unwrap_err().to_string();
        assert!(
            err.contains(name) && err.contains("not a plain `.whl` file name"),
            "{err}"
        );
    }

    // Nothing of the outside wheel was installed anywhere in the store.
    for path in f.store.list_paths().unwrap() {
        assert!(!path.contains("stolen"), "{path}");
        assert!(
            !f.store
                .root()
                .join(&path)
                .join("site-packages/stolen.py")
                .exists()
        );
    }
}

/// #16, review finding 1 (the store and env half): files hvd writes itself into an env or a store path after the
/// packages are in place are created new and never through a link: a package that provides such a name is refused
/// by name, and nothing outside (or in its own store path) is written.
#[test]
fn names_hvd_writes_itself_are_never_written_through_a_package() {
    let f = fixture();
    let outside = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();

    // 1. A package whose site-packages has `_hvd_pycache.pth` as a link to a file outside the store.
    let pth_target = outside.path().join("pwned-pth");
    let evil = f.root.join("evilpth");
    std::fs::create_dir_all(&evil).unwrap();
    std::os::unix::fs::symlink(&pth_target, evil.join("_hvd_pycache.pth")).unwrap();
    let mut with_local = plan(Vec::new());
    with_local.local_packages.push(hvd_builder::LocalPackage {
        name: "evilpth".into(),
        version: "0.1.0".into(),
        source: evil.clone(),
    });
    let err = f.build_error(&with_local, &BuildOptions::default());
    assert!(
        err.contains("evilpth") && err.contains("_hvd_pycache.pth"),
        "{err}"
    );
    assert!(!pth_target.exists(), "hvd wrote through the package's link");

    // 2. A wheel whose scripts include `activate` (linked into the env's bin): hvd must not write into the
    //    package's store path through that link.
    let wheel = make_wheel(
        &f.server.root,
        "activator",
        "1.0",
        &[
            ("activator.py", b"X = 1\n"),
            (
                "activator-1.0.data/scripts/activate",
                b"#!/bin/sh\necho from the package\n",
            ),
        ],
        None,
    );
    let err = f.build_error(
        &plan(vec![f.server.wheel_plan("activator", "1.0", &wheel)]),
        &BuildOptions::default(),
    );
    assert!(
        err.contains("activator") && err.contains("`activate`"),
        "{err}"
    );
    let package = f
        .store
        .list_paths()
        .unwrap()
        .into_iter()
        .find(|p| p.ends_with("-activator-1.0"))
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(f.store.root().join(package).join("scripts/activate")).unwrap(),
        "#!/bin/sh\necho from the package\n"
    );

    // 3. A store path whose contents placed `.hvd-path.json` as a link out: the metadata write refuses it.
    let info_target = outside.path().join("pwned-info");
    let derivation = hvd_builder::derivation::Derivation::new(
        hvd_builder::derivation::DerivationKind::Local,
        "infolink",
        "1.0",
    );
    let err = f
        .store
        .realize(&derivation, false, |target| {
            std::os::unix::fs::symlink(&info_target, target.out.join(".hvd-path.json")).unwrap();
            Ok(Default::default())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("infolink") && err.contains(".hvd-path.json"),
        "{err}"
    );
    assert!(!info_target.exists(), "hvd wrote through the placed link");
    assert!(
        !f.store
            .list_paths()
            .unwrap()
            .iter()
            .any(|p| p.contains("infolink"))
    );
}

/// #16 review finding 10: two processes in different pid namespaces (each pid 1 there) sharing one store each
/// hold their own temporary root; when one ends, gc still keeps the env the other is using.
#[test]
fn temp_roots_of_processes_in_different_pid_namespaces_do_not_collide() {
    let unshare = ["--pid", "--fork", "--kill-child"];
    let usable = Command::new("unshare")
        .args(unshare)
        .arg("true")
        .status()
        .is_ok_and(|s| s.success());
    if !usable {
        eprintln!("no pid namespaces here (`unshare --pid` needs root); skipping");
        return;
    }
    let f = fixture();
    let kept = make_wheel(&f.server.root, "kept", "1.0", &[("kept.py", b"")], None);
    let built = f.build(&plan(vec![f.server.wheel_plan("kept", "1.0", &kept)]));
    let spawn = |name: &str| {
        let dir = f.root.join(name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(
            dir.join("spec"),
            format!("{}\n{}\n", f.store.root().display(), built.env.display()),
        )
        .unwrap();
        let child = Command::new("unshare")
            .args(unshare)
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "temp_root_helper", "--nocapture"])
            .env("HVD_TEST_ROOT_DIR", &dir)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&dir.join("ready"));
        (dir, child)
    };
    let (first_dir, first) = spawn("first");
    let (second_dir, second) = spawn("second");
    // Whatever happens below, the helpers end with the test (they wait for a stop file in a temp dir).
    let mut helpers = Helpers(vec![
        (first_dir.clone(), first),
        (second_dir.clone(), second),
    ]);
    let report = hvd_builder::gc::collect_garbage(&f.store, true).unwrap();
    assert_eq!(report.temp_roots, 2, "{report:?}");
    // The second ends; the first still runs on the env.
    let (_, second) = helpers.0.pop().unwrap();
    std::fs::write(second_dir.join("stop"), "").unwrap();
    assert!(second.wait_with_output().unwrap().status.success());
    let mut report = hvd_builder::gc::collect_garbage(&f.store, false).unwrap();
    for _ in 0..250 {
        if report.temp_roots == 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        report = hvd_builder::gc::collect_garbage(&f.store, false).unwrap();
    }
    assert_eq!(report.temp_roots, 1, "{report:?}");
    assert!(report.dead.is_empty(), "removed in use: {:?}", report.dead);
    assert!(f.store.is_valid(&built.env));
    let (_, first) = helpers.0.pop().unwrap();
    std::fs::write(first_dir.join("stop"), "").unwrap();
    let out = first.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("imported"));
}

/// Helper processes that end (stop file, then SIGKILL) when the test ends, also when it fails.
struct Helpers(Vec<(PathBuf, std::process::Child)>);

impl Drop for Helpers {
    fn drop(&mut self) {
        for (dir, child) in &mut self.0 {
            let _ = std::fs::write(dir.join("stop"), "");
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
