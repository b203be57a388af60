//! `hvd lock` builds the metadata of an sdist without static metadata (issue 21 item 3): the setup.py-only sdist
//! runs through setuptools' legacy backend in the build sandbox, the answer is cached by the sdist's sha256, and a
//! failing build names the sdist and the hook.
//!
//! Setuptools comes from the machine's own python installations (the real `setuptools` and `wheel` wheels that
//! CPython 3.12/3.13 ship as test data under pyenv, part of this machine image), served by a local fixture index:
//! no internet.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{python_version, text, unwrapped};
use hvd_resolver::Lockfile;
use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions};

/// The first of `names` found in a pyenv python's test data.
fn pyenv_test_wheel(names: &[&str]) -> (String, Vec<u8>) {
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| dirs_home().join(".pyenv"));
    let dirs = [
        "versions/3.13.0/lib/python3.13/test/wheeldata",
        "versions/3.12.1/lib/python3.12/test",
    ];
    for dir in dirs {
        for name in names {
            let path = root.join(dir).join(name);
            if let Ok(bytes) = std::fs::read(&path) {
                return (name.to_string(), bytes);
            }
        }
    }
    panic!(
        "none of {names:?} under {}/{dirs:?}: this test serves the setuptools and wheel wheels that pyenv's CPython \
         3.12/3.13 ship as test data (part of the machine image)",
        root.display()
    );
}

fn dirs_home() -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").expect("HOME"))
}

/// Serve a real wheel file under its own name (`<name>-<version>-py3-none-any.whl`).
fn add_wheel_file(index: &FixtureIndex, filename: &str, bytes: Vec<u8>) {
    let mut parts = filename.split('-');
    let (name, version) = (parts.next().unwrap(), parts.next().unwrap());
    let dist = Dist::wheel(name, version);
    assert_eq!(dist.filename(), filename);
    index.add_raw(dist, bytes);
}

struct Fixture {
    dir: tempfile::TempDir,
    _index: FixtureIndex,
}

impl Fixture {
    /// An index with setuptools, wheel, `dep 1.0` and a setup.py-only sdist `widget 1.0` whose setup.py is
    /// `setup_py` (`@HOME@` replaced by the home directory hvd runs with).
    fn new(setup_py: &str) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        for sub in ["app", "home", "cache"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
        }
        let setup_py = setup_py.replace("@HOME@", &dir.path().join("home").display().to_string());
        let index = FixtureIndex::start(
            vec![
                Dist::wheel("dep", "1.0"),
                Dist::sdist("widget", "1.0")
                    .legacy_metadata()
                    .without_pyproject()
                    .sdist_file("setup.py", &setup_py),
            ],
            FixtureOptions::default(),
        )
        .unwrap();
        let (setuptools, bytes) = pyenv_test_wheel(&["setuptools-67.6.1-py3-none-any.whl"]);
        add_wheel_file(&index, &setuptools, bytes);
        let (wheel, bytes) = pyenv_test_wheel(&[
            "wheel-0.43.0-py3-none-any.whl",
            "wheel-0.40.0-py3-none-any.whl",
        ]);
        add_wheel_file(&index, &wheel, bytes);
        let file = format!(
            "project \"app\"\nenv {{\n  index = \"{}\"\n  python = \"{}\"\n  packages = [\"widget\"]\n}}\n",
            index.url(),
            python_version()
        );
        std::fs::write(dir.path().join("app/train.hvd"), file).unwrap();
        Fixture { dir, _index: index }
    }

    fn path(&self, sub: &str) -> PathBuf {
        self.dir.path().join(sub)
    }

    /// `hvd lock` with this fixture's store, cache and home.
    fn lock(&self, store: &Path) -> Output {
        let file = self.path("app/train.hvd");
        common::hvd_with_store(
            self.dir.path(),
            store,
            &["lock", &file.display().to_string()],
        )
        .env("HVD_CACHE_DIR", self.path("cache"))
        .env("HOME", self.path("home"))
        .env_remove("PIP_INDEX_URL")
        .output()
        .unwrap()
    }

    fn lockfile(&self) -> Lockfile {
        Lockfile::read(&Lockfile::path_for(&self.path("app/train.hvd"))).unwrap()
    }

    /// The cached metadata files the resolver kept for built sdists.
    fn built_metadata(&self) -> Vec<PathBuf> {
        files_below(&self.path("cache/v1/built-metadata"))
    }
}

/// The dependency is computed when setup.py runs; no static metadata says it. The script also tries what a hostile
/// sdist would: read a secret from the user's home and write next to it.
const SETUP_PY: &str = r#"
from setuptools import setup
secret = "hidden"
try:
    with open("@HOME@/secret.txt") as f:
        secret = "LEAKED-" + f.read().strip()
except OSError:
    pass
try:
    with open("@HOME@/pwned", "w") as f:
        f.write("written by setup.py")
except OSError:
    pass
computed = ["".join(["d", "e", "p"]) + ">=1"]
setup(name="widget", version="1.0", packages=["widget"], install_requires=computed, description=secret)
"#;

#[test]
fn lock_builds_the_metadata_of_a_setup_py_sdist_in_the_sandbox_once() {
    let fixture = Fixture::new(SETUP_PY);
    std::fs::write(fixture.path("home/secret.txt"), "s3cr3t\n").unwrap();
    let store = fixture.path("store");

    let out = fixture.lock(&store);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let lock = fixture.lockfile();
    let widget = lock.package("widget").expect("widget locked");
    assert_eq!(
        widget
            .dependencies
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>(),
        ["dep"],
        "the dependency setup.py computes is locked"
    );
    assert_eq!(lock.package("dep").map(|p| p.version.as_str()), Some("1.0"));
    assert!(
        !err.contains("assuming") && !err.contains("warning"),
        "no assumption, no warning: {err}"
    );
    assert!(
        lock.package("setuptools").is_none(),
        "a build requirement is not a runtime package"
    );

    // Contained: the script could neither read the user's home nor write into it.
    assert!(
        !fixture.path("home/pwned").exists(),
        "setup.py wrote into the user's home"
    );
    let cached = fixture.built_metadata();
    assert_eq!(cached.len(), 1, "{cached:?}");
    let metadata = std::fs::read_to_string(&cached[0]).unwrap();
    assert!(metadata.contains("Summary: hidden"), "{metadata}");
    assert!(!metadata.contains("LEAKED"), "{metadata}");
    assert!(metadata.contains("Requires-Dist: dep"), "{metadata}");

    // The second lock answers from the cache: it builds nothing, which would need the store (here the store path
    // is a plain file, so any build would fail), and the cached file is not rewritten. Without a store the lock
    // cannot pin the interpreter (#18 §1): it says so and stays unpinned.
    let modified = std::fs::metadata(&cached[0]).unwrap().modified().unwrap();
    std::fs::remove_file(Lockfile::path_for(&fixture.path("app/train.hvd"))).unwrap();
    let not_a_store = fixture.path("not-a-store");
    std::fs::write(&not_a_store, "").unwrap();
    let again = fixture.lock(&not_a_store);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again).1);
    assert!(
        text(&again)
            .1
            .contains("the lock does not pin the interpreter: the store"),
        "{}",
        text(&again).1
    );
    assert!(fixture.lockfile().target.installation.is_none());
    assert_eq!(
        fixture
            .lockfile()
            .package("dep")
            .map(|p| p.version.as_str()),
        Some("1.0")
    );
    assert_eq!(
        std::fs::metadata(&cached[0]).unwrap().modified().unwrap(),
        modified
    );
}

#[test]
fn a_failing_metadata_build_names_the_sdist_and_the_hook() {
    let fixture = Fixture::new("raise RuntimeError('this sdist cannot say what it needs')\n");
    let out = fixture.lock(&fixture.path("store"));
    let (_, err) = text(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    let flat = unwrapped(&err);
    for part in [
        "widget==1.0",
        "widget-1.0.tar.gz",
        "prepare_metadata_for_build_wheel",
        "setuptools.build_meta:__legacy__",
        "thissdistcannotsaywhatitneeds",
    ] {
        assert!(flat.contains(part), "`{part}` missing from:\n{err}");
    }
    assert!(
        fixture.built_metadata().is_empty(),
        "a failure is not cached"
    );
}

/// A setup.py that floods its output and then never returns (waiting on a prompt, a loop): `hvd lock` kills it, with
/// every process it started, at `HVD_METADATA_TIMEOUT`, says so and how to raise the limit, and the log it kept is
/// bounded.
#[test]
fn a_metadata_build_that_never_ends_is_killed_at_its_deadline() {
    let fixture = Fixture::new(
        "import subprocess, sys\n\
         subprocess.Popen(['sleep', '600'])\n\
         sys.stdout.write('flood ' * 20_000_000)\n\
         sys.stdout.flush()\n\
         import time\n\
         time.sleep(600)\n",
    );
    let file = fixture.path("app/train.hvd");
    let out = common::hvd_with_store(
        fixture.dir.path(),
        &fixture.path("store"),
        &["lock", &file.display().to_string()],
    )
    .env("HVD_CACHE_DIR", fixture.path("cache"))
    .env("HOME", fixture.path("home"))
    .env("HVD_METADATA_TIMEOUT", "5")
    .env_remove("PIP_INDEX_URL")
    .output()
    .unwrap();
    let (_, err) = text(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    let flat = unwrapped(&err);
    for part in ["widget-1.0.tar.gz", "within5s", "HVD_METADATA_TIMEOUT"] {
        assert!(flat.contains(part), "`{part}` missing from:\n{err}");
    }
    let logs: Vec<PathBuf> = files_below(&fixture.path("store"))
        .into_iter()
        .filter(|path| path.file_name().is_some_and(|n| n == "build.log"))
        .collect();
    assert!(!logs.is_empty(), "no build.log kept");
    for log in logs {
        let len = std::fs::metadata(&log).unwrap().len();
        assert!(len <= 65 << 20, "{} has {len} bytes", log.display());
    }
    assert!(
        fixture.built_metadata().is_empty(),
        "a killed build is not cached"
    );
}

/// Every file below `root` (links not followed).
fn files_below(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() && !path.is_symlink() {
                stack.push(path);
            } else {
                found.push(path);
            }
        }
    }
    found
}
