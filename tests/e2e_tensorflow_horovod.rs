//! Opt-in (real package index, a ~5 minute Horovod build on 2 cores, about 2 GB of store):
//!
//!     cargo nextest run -p hvd --test e2e_tensorflow_horovod --run-ignored only
//!
//! The seed scenario end to end: `examples/tensorflow-horovod` (tensorflow-cpu 2.12.1 with horovod 0.28.1 built
//! from source against it) locked, built and run by `hvd run --workers 2` through Horovod's gloo controller, whose
//! rendezvous `hvd run` serves; the script's allreduce and the equality of every rank's weights are checked, and
//! `hvd build --locked --check` must find the Horovod build reproducible. `HVD_TEST_REAL_STORE=DIR` reuses a store
//! between runs (else the default store is used, as a user's would be).

use std::path::Path;
use std::process::{Command, Output};

const HVD: &str = env!("CARGO_BIN_EXE_hvd");

fn hvd(dir: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(HVD);
    command.args(args).current_dir(dir).env("NO_COLOR", "1");
    if let Some(store) = std::env::var_os("HVD_TEST_REAL_STORE") {
        command.env("HVD_STORE", store);
    }
    let output = command.output().unwrap();
    eprintln!(
        "$ hvd {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

#[test]
#[ignore = "opt-in: needs the real package index and builds Horovod (minutes); run with --run-ignored only"]
fn tensorflow_horovod_example_runs_on_2_workers_through_gloo() {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tensorflow-horovod");
    let dir = tempfile::tempdir().unwrap();
    for name in ["train.hvd", "train.py"] {
        std::fs::copy(source.join(name), dir.path().join(name)).unwrap();
    }

    let run = hvd(dir.path(), &["run", "train.hvd", "--workers", "2"]);
    assert!(run.status.success(), "hvd run failed: {:?}", run.status);
    let stdout = String::from_utf8_lossy(&run.stdout);
    for rank in 0..2 {
        let line = format!("rank {rank}/2: weights match rank 0; allreduce sum 3.0 == 3.0");
        assert!(
            stdout.contains(&line),
            "rank {rank} did not report `{line}`:\n{stdout}"
        );
    }
    assert!(
        dir.path().join("checkpoints").is_dir(),
        "rank 0 wrote no checkpoint"
    );

    let check = hvd(dir.path(), &["build", "train.hvd", "--locked", "--check"]);
    assert!(
        check.status.success(),
        "hvd build --locked --check failed: {:?}",
        check.status
    );
}
