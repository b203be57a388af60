//! `hvd.init()` after `hvd.shutdown()` under a real `hvd run --workers 2`, as Horovod's test suites do it (init in
//! setUp, shutdown in tearDown, one process per rank): five rounds of init, allreduce, shutdown in the same worker
//! processes, over shm and over tcp.

mod common;

use std::path::Path;
use std::process::Command;

use common::{HVD, allreduce_runtime, project, text};

#[test]
fn workers_init_and_shut_down_five_times_in_a_row_over_shm_and_tcp() {
    let (python, package, lib) = allreduce_runtime();
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("collective/runtime/tests/python/reinit.py");
    for backend in ["shm", "tcp"] {
        let dir = project(&format!(
            "step train {{\n  run = \"{python} reinit.py\"\n  workers = 2\n  env = {{ PYTHONPATH = \"{}\", \
             HVD_LIBRARY = \"{}\", HVD_COLLECTIVE_BACKEND = \"{backend}\" }}\n}}",
            package.display(),
            lib.display()
        ));
        std::fs::copy(&script, dir.path().join("reinit.py")).unwrap();
        let out = Command::new(HVD)
            .arg("run")
            .arg(dir.path().join("train.hvd"))
            .args(["--no-build", "--grace", "2"])
            .env("NO_COLOR", "1")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{backend}:\n{stdout}\n{stderr}");
        for rank in 0..2 {
            assert!(
                stdout.contains(&format!(
                    ":{rank}] ok reinit rank {rank} rounds 5 backend {}",
                    backend.to_uppercase()
                )),
                "{backend}: rank {rank} did not finish five rounds:\n{stdout}\n{stderr}"
            );
        }
    }
}
