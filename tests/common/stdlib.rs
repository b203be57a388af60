//! Projects that use `std` packages, and what `hvd check --json` makes of them (tests/stdlib_*.rs).

use std::path::Path;
use std::process::{Command, Output};

use super::{HVD, text};

/// A project `name` with `python`, an `extra` env line (none when empty) and `packages` (the text inside the list)
/// in a fresh directory.
pub fn project(name: &str, python: &str, extra: &str, packages: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let extra = if extra.is_empty() {
        String::new()
    } else {
        format!("  {extra}\n")
    };
    let hvd = format!(
        "project \"{name}\"\nimport std\nenv {{\n  python = \"{python}\"\n{extra}  packages = [{packages}]\n}}\n"
    );
    std::fs::write(dir.path().join("train.hvd"), hvd).unwrap();
    dir
}

/// `hvd ARGS DIR/train.hvd`.
pub fn hvd(dir: &Path, args: &[&str]) -> Output {
    Command::new(HVD)
        .args(args)
        .arg(dir.join("train.hvd"))
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

/// `hvd check --json` of the project `name` (see `project`), which must succeed.
pub fn check_json(name: &str, python: &str, extra: &str, packages: &str) -> serde_json::Value {
    let dir = project(name, python, extra, packages);
    let out = hvd(dir.path(), &["check", "--json"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{packages} on {python}: {stderr}");
    serde_json::from_str(&stdout).unwrap()
}

/// A JSON array of strings.
pub fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// `hvd check` and `hvd lock` of the project in `dir` (with `packages`) both exit 2 saying `message` and `instead`,
/// and leave nothing but train.hvd.
pub fn assert_refused(dir: &Path, packages: &str, message: &str, instead: &str) {
    for command in ["check", "lock"] {
        let out = hvd(dir, &[command]);
        let stderr = super::flat_stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{command} {packages}: {stderr}");
        assert!(
            stderr.contains(message),
            "{command}: {message} not in {stderr}"
        );
        assert!(
            stderr.contains(instead),
            "{command}: {instead} not in {stderr}"
        );
    }
    let files: Vec<_> = std::fs::read_dir(dir).unwrap().collect();
    assert_eq!(
        files.len(),
        1,
        "nothing but train.hvd after refusing {packages}"
    );
}
