//! End-to-end tests of `hvd lock`: the real binary against the fixture index served over HTTP on 127.0.0.1.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions};

mod common;

struct Project {
    dir: tempfile::TempDir,
    cache: tempfile::TempDir,
}

impl Project {
    fn new() -> Project {
        Project {
            dir: tempfile::tempdir().unwrap(),
            cache: tempfile::tempdir().unwrap(),
        }
    }

    fn file(&self) -> PathBuf {
        self.dir.path().join("train.hvd")
    }

    fn lock_path(&self) -> PathBuf {
        self.dir.path().join("train.hvd.lock")
    }

    fn write(&self, index: &str, packages: &[&str]) {
        let list: Vec<String> = packages.iter().map(|p| format!("{p:?}")).collect();
        let text = format!(
            "project \"t\"\nenv {{\n  python = \"3.11\"\n  index = \"{index}\"\n  packages = [{}]\n}}\nstep train {{\n  run = \"true\"\n}}\n",
            list.join(", ")
        );
        std::fs::write(self.file(), text).unwrap();
    }

    fn hvd(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_hvd"))
            .args(args)
            .arg(self.file())
            .env("HVD_CACHE_DIR", self.cache.path())
            .env_remove("PIP_INDEX_URL")
            .env_remove("PIP_CONFIG_FILE")
            .current_dir(self.dir.path())
            .output()
            .unwrap()
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Asserts that `out` failed saying each of `parts` (compared without the renderer's wrapping).
fn assert_failed_saying(out: &Output, parts: &[&str]) {
    assert!(!out.status.success(), "{}", text(out));
    let all = common::unwrapped(&text(out));
    for part in parts {
        assert!(all.contains(part), "`{part}` missing: {}", text(out));
    }
}

fn index() -> FixtureIndex {
    FixtureIndex::start(
        vec![
            Dist::wheel("numpy", "1.25.0").tag("cp311-cp311-manylinux_2_17_x86_64"),
            Dist::wheel("numpy", "1.26.4").tag("cp311-cp311-manylinux_2_17_x86_64"),
            Dist::wheel("numpy", "2.0.0").tag("cp311-cp311-manylinux_2_17_x86_64"),
            Dist::wheel("pillow", "10.0.0").tag("cp311-cp311-manylinux_2_28_x86_64"),
            Dist::wheel("scipy", "1.11.0")
                .tag("cp311-cp311-manylinux_2_17_x86_64")
                .requires(&["numpy<1.28,>=1.21"]),
        ],
        FixtureOptions::default(),
    )
    .unwrap()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn lock_relock_and_check_each_field() {
    let index = index();
    let p = Project::new();
    p.write(&index.url(), &["pillow>=10", "numpy<1.26"]);
    let out = p.hvd(&["lock"]);
    assert!(out.status.success(), "{}", text(&out));
    let first = read(&p.lock_path());
    assert!(
        first.contains("name = \"numpy\"\nversion = \"1.25.0\""),
        "{first}"
    );

    // Unchanged file: identical bytes, only revalidation (304s) on the wire.
    index.clear_requests();
    let out = p.hvd(&["lock"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(read(&p.lock_path()), first);
    let requests = index.requests();
    assert!(requests.iter().all(|r| r.ends_with(" 304")), "{requests:?}");

    let out = p.hvd(&["lock", "--check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // A changed requirement: --check exits 3 and names the field.
    p.write(&index.url(), &["pillow>=10", "numpy<2"]);
    let out = p.hvd(&["lock", "--check"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        text(&out).contains(r#"env.packages[1]: "numpy<2" was "numpy<1.26""#),
        "{}",
        text(&out)
    );
    assert_eq!(read(&p.lock_path()), first, "--check never writes");

    let out = p.hvd(&["lock", "--check", "--json"]);
    assert_eq!(out.status.code(), Some(3));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["fresh"], false);
    assert_eq!(json["changes"][0]["field"], "env.packages[1]");

    // Relock keeps the pin numpy 1.25.0 (still allowed) until upgraded.
    let out = p.hvd(&["lock", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["packages"], 2);
    assert!(read(&p.lock_path()).contains("version = \"1.25.0\""));
    let out = p.hvd(&["lock", "--upgrade-package", "numpy"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(read(&p.lock_path()).contains("version = \"1.26.4\""));
    assert!(
        text(&out).contains("~ numpy 1.25.0 -> 1.26.4"),
        "{}",
        text(&out)
    );

    // Python changed: stale on env.python.
    let changed = read(&p.file()).replace("\"3.11\"", "\"3.12\"");
    std::fs::write(p.file(), changed).unwrap();
    let out = p.hvd(&["lock", "--check"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out).contains(r#"env.python: "3.12" was "3.11""#),
        "{}",
        text(&out)
    );
}

#[test]
fn missing_lock_fails_check_and_offline_uses_the_cache() {
    let index = index();
    let p = Project::new();
    p.write(&index.url(), &["scipy"]);
    let out = p.hvd(&["lock", "--check"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("does not exist"), "{}", text(&out));

    let out = p.hvd(&["lock", "--offline"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("--offline"), "{}", text(&out));

    assert!(p.hvd(&["lock"]).status.success());
    let first = read(&p.lock_path());
    std::fs::remove_file(p.lock_path()).unwrap();
    index.clear_requests();
    let out = p.hvd(&["lock", "--offline"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(read(&p.lock_path()), first);
    assert!(index.requests().is_empty(), "{:?}", index.requests());
}

#[test]
fn no_solution_and_newer_schema_are_usage_errors() {
    let index = index();
    let p = Project::new();
    p.write(&index.url(), &["scipy", "numpy>=2"]);
    let out = p.hvd(&["lock"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("scipy"), "{}", text(&out));
    assert!(!p.lock_path().exists());

    p.write(&index.url(), &["numpy"]);
    std::fs::write(p.lock_path(), "version = 99\n").unwrap();
    let out = p.hvd(&["lock"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("schema version 99, newer"),
        "{}",
        text(&out)
    );
    assert_eq!(
        read(&p.lock_path()),
        "version = 99\n",
        "a newer lock is never overwritten"
    );
}

/// Issue 16 item 1, end to end: an index listing a path as a wheel's sha256 made `hvd lock` write attacker bytes
/// at that path and record the path in the lockfile.
#[test]
fn hostile_index_sha256_path_writes_nothing_and_names_the_package() {
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("pwned");
    let index = FixtureIndex::start(
        vec![Dist::wheel("helper", "1.0")],
        FixtureOptions::default(),
    )
    .unwrap();
    index.list_sha256(
        "helper-1.0-py3-none-any.whl",
        Some(&format!("{}{}", "../".repeat(32), target.display())),
    );
    let p = Project::new();
    p.write(&index.url(), &["helper"]);
    let out = p.hvd(&["lock"]);
    assert_failed_saying(&out, &["helper", "notasha256"]);
    assert!(!target.exists());
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    assert!(!p.lock_path().exists());
}

/// Issue 16 item 15: a lockfile in a pull request naming a local file (here `/dev/zero`, which was read whole into
/// memory) as an artifact of a package from an HTTP index is refused by `hvd build --locked`, naming the package.
#[test]
fn locked_build_refuses_a_lockfile_with_a_local_artifact_of_a_remote_index() {
    let index = index();
    let p = Project::new();
    p.write(&index.url(), &["numpy<1.26"]);
    assert!(p.hvd(&["lock"]).status.success());
    let lock = read(&p.lock_path());
    let url = format!(
        "{}files/numpy-1.25.0",
        index.url().trim_end_matches("simple/")
    );
    assert!(lock.contains(&url), "{lock}");
    let start = lock.find(&url).unwrap();
    let end = start + lock[start..].find('"').unwrap();
    for hostile in ["file:///dev/zero", "/dev/zero"] {
        let edited = format!("{}{hostile}{}", &lock[..start], &lock[end..]);
        std::fs::write(p.lock_path(), &edited).unwrap();
        let out = p.hvd(&["build", "--locked"]);
        assert_failed_saying(&out, &["numpy", "isalocalfilebutthepackage'sindex"]);
    }
    // A lockfile with a non-hex digest is refused the same way.
    let sha_at = lock.find("sha256 = \"").unwrap() + "sha256 = \"".len();
    let edited = format!("{}../../x{}", &lock[..sha_at], &lock[sha_at + 64..]);
    std::fs::write(p.lock_path(), &edited).unwrap();
    let out = p.hvd(&["build", "--locked"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("not a sha256"), "{}", text(&out));
}
