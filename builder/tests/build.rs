//! End-to-end builder tests over real HTTP, real archives, a real interpreter and a real C compiler.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use hvd_builder::{
    BuildOptions, EnvPlan, Error, NoProgress, PackagePlan, SourceBuildPlan, Store, Toolchain,
    build_env, check_env,
};

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    server: FileServer,
    store: Store,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let files = root.join("files");
    std::fs::create_dir(&files).unwrap();
    let server = FileServer::start(&files);
    let store = Store::open(root.join("store")).unwrap();
    Fixture {
        _dir: dir,
        root,
        server,
        store,
    }
}

fn plan(packages: Vec<PackagePlan>) -> EnvPlan {
    EnvPlan {
        name: "demo".into(),
        python: host_python(),
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
    let backend = backend_source(name, "1.0", prelude);
    let module = format!("from {name}_native import value\n");
    let port = port(&f.server);
    let filename = make_sdist(
        &f.server.root,
        name,
        "1.0",
        &[
            ("pyproject.toml", PYPROJECT.as_bytes()),
            ("fixture_backend.py", backend.as_bytes()),
            (
                "native.c",
                NATIVE_C
                    .replace("ext_native", &format!("{name}_native"))
                    .as_bytes(),
            ),
            ("module.py", module.as_bytes()),
            ("port.txt", port.as_bytes()),
        ],
    );
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

    let built = build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress).unwrap();
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
    let again = build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress).unwrap();
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
    let err = build_env(
        &f.store,
        &plan(vec![package.clone()]),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::HashMismatch { .. }), "{message}");
    assert!(
        message.contains(&package.artifact.url)
            && message.contains(&expected)
            && message.contains(&actual),
        "{message}"
    );
    assert!(f.store.list_paths().unwrap().is_empty());
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
    let err = build_env(
        &f.store,
        &plan(vec![f.server.wheel_plan("evil", "1.0", &filename)]),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    assert!(matches!(err, Error::UnsafeArchiveEntry { .. }), "{err}");
    assert!(f.store.list_paths().unwrap().is_empty());
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

    let first = build_env(
        &f.store,
        &with_fwk(&fwk1, "1.0"),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap();
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

    let second = build_env(
        &f.store,
        &with_fwk(&fwk2, "2.0"),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(ext_value(&second.env, "ext"), "2");
    let ext_second = second.packages.iter().find(|p| p.name == "ext").unwrap();
    assert!(
        ext_second.built,
        "a framework change must rebuild the extension"
    );
    assert_ne!(ext_second.path, ext_first.path);

    let third = build_env(
        &f.store,
        &with_fwk(&fwk1, "1.0"),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap();
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
    });
    let locked = BuildOptions {
        locked: true,
        ..BuildOptions::default()
    };
    let err = build_env(&f.store, &pinned, &locked, &NoProgress)
        .unwrap_err()
        .to_string();
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
    build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress).unwrap();
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

/// A backend that blocks while `<dir>/block` exists, after creating `<dir>/started`, and counts its runs.
fn blocking_sdist(f: &Fixture, name: &str) -> PackagePlan {
    let dir = f.root.display().to_string();
    let prelude = format!(
        "    import time\n    open({count:?}, 'a').write('run\\n')\n    if os.path.exists({block:?}):\n        open({started:?}, 'w').close()\n        while os.path.exists({block:?}):\n            time.sleep(0.02)",
        count = format!("{dir}/count"),
        block = format!("{dir}/block"),
        started = format!("{dir}/started"),
    );
    ext_sdist(f, name, &prelude)
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
    std::fs::write(f.root.join("block"), "").unwrap();
    let results = std::thread::scope(|scope| {
        let first =
            scope.spawn(|| build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress));
        wait_for(&f.root.join("started"));
        // The first build is mid-way and holds the path's lock; start the second, then let both finish.
        let second =
            scope.spawn(|| build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress));
        std::fs::remove_file(f.root.join("block")).unwrap();
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
    assert_eq!(
        std::fs::read_to_string(f.root.join("count"))
            .unwrap()
            .lines()
            .count(),
        1
    );
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
    let (base, store_root) = (lines.next().unwrap(), lines.next().unwrap());
    let f = Fixture {
        _dir: tempfile::tempdir().unwrap(),
        root: root.clone(),
        server: FileServer {
            root: root.join("files"),
            base: base.to_string(),
        },
        store: Store::open(store_root).unwrap(),
    };
    let fwk = f
        .server
        .wheel_plan("fwk", "1.0", "fwk-1.0-py3-none-any.whl");
    let _ = build_env(
        &f.store,
        &plan(vec![fwk, blocking_sdist(&f, "victim")]),
        &BuildOptions::default(),
        &NoProgress,
    );
}

#[test]
fn killed_build_leaves_nothing_and_the_retry_succeeds() {
    let f = fixture();
    let fwk = make_framework(&f.server.root, "1.0", 1);
    let victim = blocking_sdist(&f, "victim");
    std::fs::write(
        f.root.join("spec"),
        format!("{}\n{}\n", f.server.base, f.store.root().display()),
    )
    .unwrap();
    std::fs::write(f.root.join("block"), "").unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "kill_helper", "--nocapture"])
        .env("HVD_TEST_KILL_DIR", &f.root)
        .spawn()
        .unwrap();
    wait_for(&f.root.join("started"));
    child.kill().unwrap(); // SIGKILL, mid-build
    child.wait().unwrap();
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

    std::fs::remove_file(f.root.join("block")).unwrap();
    let plan = plan(vec![f.server.wheel_plan("fwk", "1.0", &fwk), victim]);
    let built = build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress).unwrap();
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
    let keep = build_env(&f.store, &keep_plan, &BuildOptions::default(), &NoProgress).unwrap();
    let gone = build_env(&f.store, &drop_plan, &BuildOptions::default(), &NoProgress).unwrap();
    let project_a = f.root.join("a/.hvd/env");
    let project_b = f.root.join("b/.hvd/env");
    hvd_builder::gc::add_root(&f.store, &project_a, &keep.env).unwrap();
    hvd_builder::gc::add_root(&f.store, &project_b, &gone.env).unwrap();
    std::fs::remove_dir_all(f.root.join("b")).unwrap();

    let dry = hvd_builder::gc::collect_garbage(&f.store, true).unwrap();
    assert_eq!(dry.dead.len(), 2, "{:?}", dry.dead);
    assert_eq!(
        f.store.list_paths().unwrap().len(),
        4,
        "a dry run removes nothing"
    );

    let report = hvd_builder::gc::collect_garbage(&f.store, false).unwrap();
    assert_eq!(report.dead, dry.dead);
    let left = f.store.list_paths().unwrap();
    assert_eq!(left.len(), 2, "{left:?}");
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
    let first = build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress).unwrap();
    assert_eq!(
        run_python(
            &first.env.join("bin/python"),
            "import hvdrt; print(hvdrt.VALUE)"
        ),
        "1"
    );
    std::fs::write(runtime.join("hvdrt/__init__.py"), "VALUE = 2\n").unwrap();
    let second = build_env(&f.store, &plan, &BuildOptions::default(), &NoProgress).unwrap();
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
