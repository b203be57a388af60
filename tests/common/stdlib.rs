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
