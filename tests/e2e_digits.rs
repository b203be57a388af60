//! The README's main job, end to end: `examples/digits` locked against the real package index, built into the
//! store and trained on 2 workers through the `hvd` runtime.
//!
//! This is the one test of the default suite that uses the network: it is the README's main job, and the index
//! it locks against is the machine's own (pip's configuration or pip's default). Locking retries transient errors;
//! the store is the default one (or `HVD_STORE`), so a second run on the same machine reuses every download.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

mod common;

const EXAMPLE_FILES: &[&str] = &[
    "train.hvd",
    "prepare.py",
    "model.py",
    "train.py",
    "evaluate.py",
];

fn example_copy() -> tempfile::TempDir {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/digits");
    let dir = tempfile::tempdir().unwrap();
    for name in EXAMPLE_FILES {
        std::fs::copy(source.join(name), dir.path().join(name)).unwrap();
    }
    dir
}

fn hvd(dir: &Path, args: &[&str]) -> Output {
    common::hvd_logged(dir, args, |_| {})
}

/// `hvd lock`, retried: the index is on the internet and a run of CI should not fail for one dropped connection.
fn lock_with_retries(dir: &Path) {
    let mut last = None;
    for attempt in 0..4 {
        if attempt > 0 {
            std::thread::sleep(Duration::from_secs(5 * attempt));
        }
        let output = hvd(dir, &["lock", "train.hvd"]);
        if output.status.success() {
            return;
        }
        last = Some(output);
    }
    panic!(
        "hvd lock failed 4 times; last: {:?}",
        last.map(|o| o.status)
    );
}

fn accuracy(stdout: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|line| line.starts_with("[evaluate ") && line.contains("test accuracy"))
        .unwrap_or_else(|| panic!("no accuracy line from the evaluate step in:\n{stdout}"));
    let value = line
        .split("test accuracy")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    value.parse().unwrap()
}

#[test]
fn digits_locks_builds_and_trains_to_95_percent_on_2_workers() {
    let dir = example_copy();
    let lockfile: PathBuf = dir.path().join("train.hvd.lock");
    lock_with_retries(dir.path());
    let locked = std::fs::read(&lockfile).unwrap();

    let first = hvd(
        dir.path(),
        &["run", "train.hvd", "--workers", "2", "--locked"],
    );
    assert!(
        first.status.success(),
        "the first run failed: {:?}",
        first.status
    );
    let stdout = String::from_utf8_lossy(&first.stdout);
    let acc = accuracy(&stdout);
    assert!(acc >= 0.95, "test accuracy {acc} is below 0.95");
    assert!(
        stdout.contains("[train ") && stdout.contains(":0] epoch"),
        "rank 0 printed no epochs:\n{stdout}"
    );
    assert!(dir.path().join("checkpoints/model.npz").is_file());

    // A second run reuses everything: the lock is untouched, the env is a no-op, unchanged steps are skipped.
    let second = hvd(
        dir.path(),
        &["run", "train.hvd", "--workers", "2", "--locked"],
    );
    assert!(
        second.status.success(),
        "the second run failed: {:?}",
        second.status
    );
    let stderr = String::from_utf8_lossy(&second.stderr);
    for step in ["prepare", "train"] {
        assert!(
            stderr.contains(&format!("step `{step}` skipped")),
            "step {step} was not skipped:\n{stderr}"
        );
    }
    assert_eq!(
        std::fs::read(&lockfile).unwrap(),
        locked,
        "a second run changed the lockfile"
    );

    // The CI recipe: the lock still matches and the build reproduces.
    let check = hvd(dir.path(), &["build", "train.hvd", "--locked", "--check"]);
    assert!(
        check.status.success(),
        "hvd build --locked --check failed: {:?}",
        check.status
    );
}
