//! End-to-end tests of `hvd build`, `exec`, `why-depends`, `gc` and `build --check`: the real binary, a real
//! interpreter, fixture packages served over real HTTP on 127.0.0.1, lockfiles written with the resolver's types.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hvd_resolver::lockfile::{LockedBuild, LockedPackage, Lockfile};

struct Project {
    _dir: tempfile::TempDir,
    root: PathBuf,
    store: PathBuf,
    base: String,
    python: String,
}

fn project(packages: &str) -> Project {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let files = root.join("files");
    std::fs::create_dir(&files).unwrap();
    common::make_fixtures(common::GREET_AND_NOISY, &files);
    let project = Project {
        store: root.join("store"),
        _dir: dir,
        root,
        base: common::serve_files(files),
        python: common::python_version(),
    };
    project.write_file(packages);
    project
}

impl Project {
    fn file(&self) -> PathBuf {
        self.root.join("app/train.hvd")
    }

    fn write_file(&self, packages: &str) {
        std::fs::create_dir_all(self.root.join("app")).unwrap();
        let text = format!(
            "project \"app\"\nenv {{\n  python = \"{}\"\n  packages = [{packages}]\n}}\n",
            self.python
        );
        std::fs::write(self.file(), text).unwrap();
    }

    /// Points the env at the package index `url`.
    fn use_index(&self, url: &str) {
        let text = std::fs::read_to_string(self.file()).unwrap();
        let text = text.replace("env {", &format!("env {{\n  index = \"{url}\""));
        std::fs::write(self.file(), text).unwrap();
    }

    fn package(&self, name: &str, filename: &str, deps: &[&str]) -> LockedPackage {
        common::locked_file(
            name,
            &self.base,
            &self.root.join("files").join(filename),
            deps,
        )
    }

    /// Write the lock for the current file, as `hvd lock` would for these packages.
    fn lock(&self, packages: Vec<LockedPackage>, builds: Vec<LockedBuild>) {
        common::lockfile(&self.file(), &self.python, packages, builds)
            .write(&Lockfile::path_for(&self.file()))
            .unwrap();
    }

    fn hvd(&self, args: &[&str]) -> Output {
        common::hvd_with_store(&self.root, &self.store, args)
            .output()
            .unwrap()
    }
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).trim().to_string(),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

#[test]
fn build_exec_why_depends_locked_and_gc() {
    let p = project("\"greet==1.0\"");
    p.lock(
        vec![
            p.package("greet", "greet-1.0-py3-none-any.whl", &["helper"]),
            p.package("helper", "helper-1.0-py3-none-any.whl", &[]),
        ],
        vec![],
    );
    let file = p.file().display().to_string();

    let first = p.hvd(&["build", &file, "--locked"]);
    let (env, err) = text(&first);
    assert_eq!(first.status.code(), Some(0), "{err}");
    assert!(
        env.starts_with(&p.store.canonicalize().unwrap().display().to_string()),
        "{env}"
    );
    let link = p.root.join("app/.hvd/env");
    assert_eq!(std::fs::read_link(&link).unwrap(), PathBuf::from(&env));

    let again = p.hvd(&["build", &file, "--locked"]);
    assert_eq!(
        text(&again).0,
        env,
        "an unchanged project builds to the same env"
    );

    let exec = p.hvd(&["exec", &file, "--locked", "--", "greet"]);
    assert_eq!(text(&exec).0, "hello from greet", "{}", text(&exec).1);
    let prefix = p.hvd(&[
        "exec",
        &file,
        "--",
        "python",
        "-c",
        "import sys; print(sys.prefix)",
    ]);
    assert_eq!(text(&prefix).0, env);

    let why = p.hvd(&["why-depends", &file, "helper"]);
    assert_eq!(text(&why).0, "greet 1.0 -> helper 1.0");
    assert_eq!(
        p.hvd(&["why-depends", &file, "numpy"]).status.code(),
        Some(1)
    );
    // The env references its interpreter, a store path of its own (#18 §1).
    let why_python = text(&p.hvd(&["why-depends", &file, "python"])).0;
    let env_name = Path::new(&env)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        why_python.starts_with(&format!("{env_name} -> python 3."))
            && why_python.contains("-python-3."),
        "{why_python}"
    );

    // A changed request makes `--locked` fail with the lock's own code, naming the field.
    p.write_file("\"greet==1.0\", \"helper\"");
    let stale = p.hvd(&["build", &file, "--locked"]);
    assert_eq!(stale.status.code(), Some(3));
    assert!(
        text(&stale).1.contains("env.packages[1]"),
        "{}",
        text(&stale).1
    );

    // gc keeps what the project's link reaches, and removes it once the project's link is gone.
    let dry = p.hvd(&["gc", "--dry-run"]);
    assert_eq!(
        text(&dry).0,
        "",
        "nothing is garbage while the project links its env"
    );
    std::fs::remove_dir_all(p.root.join("app/.hvd")).unwrap();
    let gc = p.hvd(&["gc"]);
    // The env, its two packages, the worker runtime (`hvd`) that every env gets and its interpreter.
    let removed = text(&gc).0;
    assert_eq!(removed.lines().count(), 5, "{removed}");
    for name in ["-app-env", "-greet-1.0", "-helper-1.0", "-hvd-", "-python-"] {
        assert!(
            removed.contains(name),
            "gc did not remove the path of {name}: {removed}"
        );
    }
    assert!(!Path::new(&env).exists());
}

#[test]
fn hash_mismatch_fails_the_build_naming_the_url() {
    let p = project("\"helper==1.0\"");
    let mut helper = p.package("helper", "helper-1.0-py3-none-any.whl", &[]);
    let actual = helper.artifact.sha256.to_string();
    helper.artifact.sha256 = "0".repeat(64).parse().unwrap();
    p.lock(vec![helper.clone()], vec![]);
    let out = p.hvd(&["build", &p.file().display().to_string(), "--locked"]);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // The renderer wraps long lines; compare without the wrapping.
    let err = common::unwrapped(&err);
    assert!(
        err.contains(&helper.artifact.url)
            && err.contains(&actual)
            && err.contains(&"0".repeat(64)),
        "{err}"
    );
    assert!(!p.root.join("app/.hvd/env").exists());
}

#[test]
fn check_lists_the_differing_file_and_exits_4() {
    let p = project("{ requirement = \"noisy==1.0\", build = { requires = [], against = [] } }");
    let build = common::plain_build("noisy");
    p.lock(
        vec![p.package("noisy", "noisy-1.0.tar.gz", &[])],
        vec![build],
    );
    let file = p.file().display().to_string();
    let built = p.hvd(&["build", &file, "--locked"]);
    assert_eq!(built.status.code(), Some(0), "{}", text(&built).1);
    let check = p.hvd(&["build", &file, "--locked", "--check"]);
    let (out, err) = text(&check);
    assert_eq!(check.status.code(), Some(4), "{err}");
    assert!(
        out.lines().any(|l| l.ends_with("site-packages/noisy.py")),
        "{out}"
    );
}

#[test]
fn build_without_a_lock_resolves_against_the_index_then_builds() {
    use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions};
    let index = FixtureIndex::start(
        vec![
            Dist::wheel("alpha", "1.0").requires(&["beta>=2"]),
            Dist::wheel("beta", "2.0"),
            Dist::wheel("beta", "1.0"),
        ],
        FixtureOptions::default(),
    )
    .unwrap();
    let p = project("\"alpha\"");
    p.use_index(&index.url());
    let file = p.file().display().to_string();

    let locked_missing = p.hvd(&["build", &file, "--locked"]);
    assert_eq!(
        locked_missing.status.code(),
        Some(3),
        "--locked without a lockfile is stale"
    );

    let built = p.hvd(&["build", &file]);
    let (env, err) = text(&built);
    assert_eq!(built.status.code(), Some(0), "{err}");
    assert!(Lockfile::path_for(&p.file()).exists());
    let out = Command::new(Path::new(&env).join("bin/python"))
        .args([
            "-c",
            "import alpha, beta; print(alpha.__version__, beta.__version__)",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1.0 2.0");
    let again = p.hvd(&["build", &file, "--locked", "--offline"]);
    assert_eq!(text(&again).0, env, "{}", text(&again).1);
}

/// A tiny PEP 517 backend (the fixture index has no setuptools): zips the sdist's package directory, named by
/// PKG-INFO, into a wheel, and adds `<package>/_built_by.py` to prove it ran.
const FIXTURE_BACKEND: &str = r#"
import base64, hashlib, os, zipfile
def _h(d): return base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
def _meta():
    fields = {}
    with open("PKG-INFO", encoding="utf-8") as f:
        for line in f:
            if ":" in line:
                k, v = line.split(":", 1)
                fields.setdefault(k.strip(), v.strip())
    return fields["Name"], fields["Version"]
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name, version = _meta()
    dist = name.replace("-", "_")
    files = {}
    for root, _, names in os.walk(dist):
        for n in sorted(names):
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                files[p.replace(os.sep, "/")] = f.read()
    files[dist + "/_built_by.py"] = b"BACKEND = 'fixture_backend'\n"
    di = "%s-%s.dist-info" % (dist, version)
    files[di + "/METADATA"] = ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version)).encode()
    files[di + "/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: fixture-backend\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[di + "/RECORD"] = ("".join("%s,sha256=%s,%d\n" % (p, _h(d), len(d)) for p, d in files.items()) + di + "/RECORD,,\n").encode()
    wheel = "%s-%s-py3-none-any.whl" % (dist, version)
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as z:
        for p in sorted(files):
            z.writestr(zipfile.ZipInfo(p, (1980, 1, 1, 0, 0, 0)), files[p])
    return wheel
def build_sdist(sdist_directory, config_settings=None):
    raise NotImplementedError("fixture backend builds wheels only")
"#;

#[test]
fn plain_sdist_builds_with_its_locked_pyproject_build_requirements() {
    use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions};
    let index = FixtureIndex::start(
        vec![
            Dist::sdist("widget", "1.0")
                .requires(&["beta"])
                .build_system(&["fixture-backend>=1"], "fixture_backend"),
            Dist::wheel("beta", "2.0"),
            Dist::wheel("fixture-backend", "1.0").module_source(FIXTURE_BACKEND),
        ],
        FixtureOptions::default(),
    )
    .unwrap();
    let p = project("\"widget\"");
    p.use_index(&index.url());
    let file = p.file().display().to_string();

    let built = p.hvd(&["build", &file]);
    let (env, err) = text(&built);
    assert_eq!(built.status.code(), Some(0), "{err}");
    let lock = Lockfile::read(&Lockfile::path_for(&p.file())).unwrap();
    let build = lock.builds.iter().find(|b| b.package == "widget").unwrap();
    assert_eq!(build.requires, ["fixture-backend>=1"]);
    assert!(!build.no_build_isolation);
    assert_eq!(build.packages.len(), 1);
    assert_eq!(build.packages[0].name, "fixture-backend");
    assert!(
        lock.package("fixture-backend").is_none(),
        "a build requirement is not a runtime package"
    );
    let out = Command::new(Path::new(&env).join("bin/python"))
        .args([
            "-c",
            "import widget, widget._built_by, beta; print(widget.__version__, widget._built_by.BACKEND, beta.__version__)",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "1.0 fixture_backend 2.0",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The backend is not in the runtime env.
    let backend = Command::new(Path::new(&env).join("bin/python"))
        .args(["-c", "import fixture_backend"])
        .output()
        .unwrap();
    assert!(!backend.status.success());
    // Built from the store alone: offline and locked gives the same env.
    let again = p.hvd(&["build", &file, "--locked", "--offline"]);
    assert_eq!(text(&again).0, env, "{}", text(&again).1);
}

/// Opt-in (`--run-ignored only`; needs the real package index, ~700 MB of downloads and ~5 minutes of compiling):
/// tensorflow-cpu 2.12.1 + horovod 0.28.1 built from source against it, `import horovod.tensorflow` works inside
/// the env, and `hvd build --check` finds the horovod build reproducible.
#[test]
#[ignore = "opt-in: builds tensorflow-cpu + horovod from the real package index (minutes); run with --run-ignored only"]
fn real_index_tensorflow_horovod_builds_imports_and_passes_check() {
    let dir = tempfile::tempdir().unwrap();
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tensorflow-horovod/train.hvd");
    let file = dir.path().join("train.hvd");
    let source = std::fs::read_to_string(&example).unwrap();
    std::fs::write(&file, source).unwrap();
    // Reuse a store across runs when given (the build takes minutes).
    let store = std::env::var_os("HVD_TEST_REAL_STORE")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.path().join("store"));
    let hvd = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_hvd"))
            .args(args)
            .env("HVD_STORE", &store)
            .output()
            .unwrap()
    };
    let file = file.display().to_string();
    let built = hvd(&["build", &file]);
    assert_eq!(built.status.code(), Some(0), "{}", text(&built).1);
    let import = hvd(&common::exec_locked_python(
        &file,
        "import horovod.tensorflow as h; print(h.__name__)",
    ));
    assert_eq!(
        text(&import).0.lines().last(),
        Some("horovod.tensorflow"),
        "{}",
        text(&import).1
    );
    let check = hvd(&["build", &file, "--locked", "--check"]);
    assert_eq!(
        check.status.code(),
        Some(0),
        "{}\n{}",
        text(&check).0,
        text(&check).1
    );
}

/// Hostile wheels the security review made (#16), written next to the fixtures: a symlink chain that passes a
/// lexical check (`l -> .`, `x -> l/l/../../..`) followed by `./x` or a file below `x`, and a `..-1.0.dist-info`
/// whose headers would land above the package path.
const MAKE_HOSTILE_WHEELS: &str = r#"
import base64, hashlib, os, sys, zipfile
out, escape = sys.argv[1], sys.argv[2]
def h(d): return base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
def wheel(filename, dist_info, members):
    rec = "".join("%s,sha256=%s,%d\n" % (p, h(d), len(d)) for p, d, _ in members) + dist_info + "/RECORD,,\n"
    with zipfile.ZipFile(os.path.join(out, filename), "w") as z:
        for p, d, link in members:
            info = zipfile.ZipInfo(p)
            if link: info.external_attr = (0o120777 << 16)
            z.writestr(info, d)
        z.writestr(dist_info + "/RECORD", rec)
meta = lambda n: ("Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n" % n).encode()
wheel("chain-1.0-py3-none-any.whl", "chain-1.0.dist-info", [
    ("chain-1.0.dist-info/METADATA", meta("chain"), False),
    ("l", b".", True),
    ("x", ("l/" * 8 + "../" * 12 + escape.lstrip("/")).encode(), True),
    ("./x", b"pwned\n", False),
])
wheel("through-1.0-py3-none-any.whl", "through-1.0.dist-info", [
    ("through-1.0.dist-info/METADATA", meta("through"), False),
    ("l", b".", True),
    ("x", ("l/" * 8 + "../" * 12 + os.path.dirname(escape).lstrip("/")).encode(), True),
    ("x/pwned", b"pwned\n", False),
])
wheel("dotdot-1.0-py3-none-any.whl", "..-1.0.dist-info", [
    ("..-1.0.dist-info/METADATA", meta("dotdot"), False),
    ("dotdot-1.0.data/headers/site-packages/_hvd_pycache.pth", b"../../../../pwned", True),
])
"#;

#[test]
fn hostile_wheels_install_nothing_and_write_nothing_outside_the_store() {
    let p = project("\"chain==1.0\"");
    let escape = p.root.join("pwned");
    let status = Command::new("python3")
        .arg("-c")
        .arg(MAKE_HOSTILE_WHEELS)
        .arg(p.root.join("files"))
        .arg(&escape)
        .status()
        .unwrap();
    assert!(status.success());
    for (name, filename) in [
        ("chain", "chain-1.0-py3-none-any.whl"),
        ("through", "through-1.0-py3-none-any.whl"),
        ("dotdot", "dotdot-1.0-py3-none-any.whl"),
    ] {
        p.write_file(&format!("\"{name}==1.0\""));
        p.lock(vec![p.package(name, filename, &[])], vec![]);
        let out = p.hvd(&["build", &p.file().display().to_string(), "--locked"]);
        let (_, err) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        let flat = common::unwrapped(&err);
        assert!(
            flat.contains(filename),
            "{name}: the error names the wheel: {err}"
        );
        assert!(!escape.exists(), "{name} wrote outside the store");
        assert!(!p.root.join("app/.hvd/env").exists(), "{name}: no env");
        // Only finished store paths have their metadata file: none of this package.
        let installed: Vec<_> = std::fs::read_dir(&p.store)
            .map(|dir| {
                dir.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(&format!("-{name}-1.0")))
                    .collect()
            })
            .unwrap_or_default();
        assert!(installed.is_empty(), "{name} was installed: {installed:?}");
    }
    let mut top: Vec<_> = std::fs::read_dir(&p.root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    assert_eq!(
        top,
        ["app", "files", "store"],
        "nothing new next to the store"
    );
}
