//! The engine matches the controller of the env's Horovod (`hvd run --dry-run`, nothing is built): an MPI-only
//! Horovod (0.13.11, before gloo) runs under mpirun when no engine is named, saying so; a named engine that cannot
//! reach it is refused with the fix; a Horovod with gloo, and scripts that use only `hvd.*`, keep the local engine.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::{HVD, text};

/// A project whose env holds `horovod` (a `std.horovod { ... }` call, or a requirement string) and whose 2-worker
/// step runs `script`, written with `script_text`.
fn project(horovod: &str, cluster: &str, script_text: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let hvd = format!(
        "project \"t\"\nimport std\nenv {{\n  python = \"3.6\"\n  packages = [{horovod}]\n}}\n{cluster}\n\
         step train {{\n  workers = 2\n  run = \"python train.py\"\n}}\n"
    );
    std::fs::write(dir.path().join("train.hvd"), hvd).unwrap();
    std::fs::write(dir.path().join("train.py"), script_text).unwrap();
    dir
}

const OLD: &str = "std.horovod { version = \"0.13.11\", with_mpi = true }";
const HOROVOD_SCRIPT: &str = "import horovod.tensorflow as hvd\nhvd.init()\nprint(hvd.size())\n";

fn dry_run(dir: &Path, args: &[&str]) -> Output {
    Command::new(HVD)
        .arg("run")
        .arg(dir.join("train.hvd"))
        .args(["--dry-run", "--workers", "2"])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn has_mpirun() -> bool {
    let found = Command::new("sh")
        .args(["-c", "command -v mpirun"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipped: `mpirun` is not installed (the mpi engine needs it)");
    }
    found
}

#[test]
fn an_mpi_only_horovod_runs_under_mpirun_unless_an_engine_is_named() {
    if !has_mpirun() {
        return;
    }
    let dir = project(OLD, "", HOROVOD_SCRIPT);
    let out = dry_run(dir.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout
            .lines()
            .any(|l| l.trim_start().starts_with("mpirun:")),
        "no mpirun line:\n{stdout}"
    );
    assert!(stdout.contains("workers: 2 (mpi engine"), "{stdout}");
    assert!(
        stderr.contains(
            "Horovod 0.13.11 has no gloo controller (MPI only): distributed steps run under mpirun"
        ),
        "{stderr}"
    );
    // Named engines: mpi is what it needs (no note); local would give two worlds of size 1, so it is refused.
    let out = dry_run(dir.path(), &["--engine", "mpi"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("(mpi engine"), "{stdout}");
    assert!(!stderr.contains("no gloo controller"), "{stderr}");
}

#[test]
fn a_named_engine_that_cannot_reach_an_mpi_only_horovod_is_refused_with_the_fix() {
    let dir = project(OLD, "", HOROVOD_SCRIPT);
    let out = dry_run(dir.path(), &["--engine", "local"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    let said = common::flat_stderr(&out);
    for part in [
        "`--engine local` cannot run this env's Horovod 0.13.11",
        "no gloo controller (gloo came with Horovod 0.17.0)",
        "world of size 1",
        "`--engine mpi`",
    ] {
        assert!(said.contains(part), "{part:?} not in:\n{stderr}");
    }
    assert!(stdout.is_empty(), "a refused run prints no plan:\n{stdout}");
    // The same from the file's cluster block.
    let dir = project(
        OLD,
        "cluster {\n  engine = \"ssh\"\n  hosts = [\"a:2\"]\n}",
        HOROVOD_SCRIPT,
    );
    let out = dry_run(dir.path(), &[]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        common::flat_stderr(&out)
            .contains("`cluster { engine = \"ssh\" }` cannot run this env's Horovod 0.13.11"),
        "{stderr}"
    );
}

#[test]
fn a_horovod_with_gloo_and_hvd_only_scripts_keep_the_local_engine() {
    // 0.28.1 as the recipe builds it: gloo, so hvd's own rendezvous.
    let dir = project("std.horovod { version = \"0.28.1\" }", "", HOROVOD_SCRIPT);
    let out = dry_run(dir.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("workers: 2 (local engine"), "{stdout}");
    assert!(!stderr.contains("note:"), "{stderr}");
    // An MPI-only Horovod in the env, but the step's script uses hvd's own runtime: any engine works.
    let dir = project(OLD, "", "import hvd\nhvd.init()\nprint(hvd.size())\n");
    let out = dry_run(dir.path(), &["--engine", "local"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("workers: 2 (local engine"), "{stdout}");
}

#[test]
fn a_built_env_names_the_version_of_an_unpinned_horovod() {
    if !has_mpirun() {
        return;
    }
    // The requirement says no version; the built env's dist-info does.
    let dir = project("\"horovod\"", "", HOROVOD_SCRIPT);
    let env = dir.path().join("env");
    std::fs::create_dir_all(env.join("lib/python3.6/site-packages/horovod-0.13.11.dist-info"))
        .unwrap();
    let out = dry_run(dir.path(), &["--env-dir", env.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("(mpi engine"), "{stdout}");
    assert!(
        stderr.contains("Horovod 0.13.11 has no gloo controller"),
        "{stderr}"
    );
    // Without the built env nothing is known of it: the engine stays as named (local).
    let out = dry_run(dir.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("(local engine"), "{stdout}");
}

/// The seeds' era, built for real: python 3.6, TensorFlow 1.5.0 and Horovod 0.13.11 (MPI only) compiled against it.
/// The default `hvd run --workers 2` must give one world of size 2 (through mpirun), never two worlds of size 1, and
/// `hvd build --locked --check` must find the Horovod build reproducible.
#[test]
#[ignore = "opt-in: needs the real package index, python 3.6 and mpirun, and builds Horovod 0.13.11 (minutes); run with --run-ignored only"]
fn the_default_run_of_an_mpi_only_horovod_is_one_world_of_size_2() {
    let dir = tempfile::tempdir().unwrap();
    let hvd = "project \"seed-era\"\nimport std\nlet tf = std.tensorflow { version = \"1.5.0\", variant = \"gpu\" }\n\
               env {\n  python = \"3.6\"\n  toolchain = std.gcc { version = \"12\" }\n  packages = [\n    tf,\n    \
               std.horovod { version = \"0.13.11\", frameworks = [tf], with_mpi = true },\n  ]\n}\n\
               step train {\n  workers = 2\n  run = \"python train.py\"\n}\n";
    std::fs::write(dir.path().join("train.hvd"), hvd).unwrap();
    std::fs::write(
        dir.path().join("train.py"),
        "import tensorflow as tf\nimport horovod.tensorflow as hvd\nhvd.init()\n\
         with tf.Session() as session:\n    \
         total = session.run(hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), average=False))\n\
         print('rank %d/%d: allreduce sum %.1f' % (hvd.rank(), hvd.size(), total[0]))\n",
    )
    .unwrap();
    let real_store = |command: &mut Command| {
        if let Some(store) = std::env::var_os("HVD_TEST_REAL_STORE") {
            command.env("HVD_STORE", store);
        }
    };
    let run = common::hvd_logged(
        dir.path(),
        &["run", "train.hvd", "--workers", "2"],
        real_store,
    );
    let (stdout, stderr) = text(&run);
    assert!(run.status.success(), "hvd run failed: {:?}", run.status);
    assert!(
        stderr.contains("distributed steps run under mpirun"),
        "{stderr}"
    );
    for rank in 0..2 {
        let line = format!("rank {rank}/2: allreduce sum 3.0");
        assert!(
            stdout.contains(&line),
            "rank {rank} did not report `{line}`:\n{stdout}"
        );
    }
    // The era's Horovod rebuilt from its locked inputs must come out bit for bit the same.
    let check = common::hvd_logged(
        dir.path(),
        &["build", "train.hvd", "--locked", "--check"],
        real_store,
    );
    let (_, stderr) = text(&check);
    assert!(check.status.success(), "hvd build --locked --check failed");
    assert!(
        stderr.contains("horovod 0.13.11: reproducible"),
        "no `horovod 0.13.11: reproducible` in\n{stderr}"
    );
}
