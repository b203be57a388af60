//! `hvd build --locked` against a lockfile (e.g. from a pull request) whose `[[build]]` recipe carries variables the
//! project file never asked for (issue #16, review finding 2): the real binary refuses it before anything runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use hvd_resolver::lockfile::{Artifact, ArtifactKind, LockedBuild, LockedPackage, Lockfile};

mod common;

/// A project building `noisy` (an sdist) with `recipe` (an `.hvd` build table or nothing), locked with a
/// `[[build]]` whose variables are `locked_env`.
fn project(dir: &Path, recipe: Option<&str>, locked_env: &[(&str, &str)]) -> PathBuf {
    let python = common::python_version();
    let file = dir.join("train.hvd");
    let package = match recipe {
        Some(recipe) => format!("{{ requirement = \"noisy==1.0\", build = {recipe} }}"),
        None => "\"noisy==1.0\"".to_string(),
    };
    std::fs::write(
        &file,
        format!("project \"app\"\nenv {{\n  python = \"{python}\"\n  packages = [{package}]\n}}\n"),
    )
    .unwrap();
    let packages = vec![LockedPackage {
        name: "noisy".into(),
        version: "1.0".into(),
        index: "http://127.0.0.1:1".into(),
        artifact: Artifact {
            kind: ArtifactKind::Sdist,
            filename: "noisy-1.0.tar.gz".into(),
            url: "http://127.0.0.1:1/noisy-1.0.tar.gz".into(),
            sha256: "ab".repeat(32).parse().unwrap(),
            size: 100,
        },
        dependencies: vec![],
    }];
    let builds = vec![LockedBuild {
        package: "noisy".into(),
        requires: vec![],
        env: locked_env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>(),
        against: vec![],
        no_build_isolation: false,
        packages: vec![],
    }];
    common::lockfile(&file, &python, packages, builds)
        .write(&Lockfile::path_for(&file))
        .unwrap();
    file
}

fn build_locked(dir: &Path, file: &Path) -> Output {
    let file = file.display().to_string();
    common::hvd_with_store(
        dir,
        &dir.join("store"),
        &["build", &file, "--locked", "--offline"],
    )
    .output()
    .unwrap()
}

#[test]
fn locked_refuses_build_variables_the_file_does_not_ask_for() {
    let recipe = Some("{ requires = [], env = { FLAG = \"on\" }, against = [] }");
    // The recipe asks for FLAG only; the lockfile adds LD_PRELOAD.
    let dir = tempfile::tempdir().unwrap();
    let file = project(
        dir.path(),
        recipe,
        &[("FLAG", "on"), ("LD_PRELOAD", "./evil.so")],
    );
    let out = build_locked(dir.path(), &file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("build.noisy.env") && err.contains("LD_PRELOAD"),
        "{err}"
    );
    assert!(!dir.path().join(".hvd").exists() && !dir.path().join("store/.build").exists());

    // An sdist built without a recipe: its `[[build]]` may carry no variables either.
    let dir = tempfile::tempdir().unwrap();
    let file = project(dir.path(), None, &[("PATH", "/tmp/evil")]);
    let out = build_locked(dir.path(), &file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("build.noisy.env"), "{err}");

    // The same lockfile with exactly the recipe's variables passes the check (and stops later, offline, at the
    // sdist that is not in the download cache).
    let dir = tempfile::tempdir().unwrap();
    let file = project(dir.path(), recipe, &[("FLAG", "on")]);
    let out = build_locked(dir.path(), &file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(3), "{err}");
    assert!(!err.contains("out of date"), "{err}");
}
