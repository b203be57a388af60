//! `hvd bench allreduce --processes --shared-buffers`: the ranks run as worker processes of the binary (their own
//! rendezvous server) on shared buffers, and rank 0 prints one JSON line per size saying so; `--tensors` runs each
//! size as a fused group of that many tensors.

use std::process::Command;

/// Runs `hvd bench allreduce --processes --json` on one 1 MiB size with `args` added, outside any launcher's
/// environment, asserts it succeeded and returns its stdout.
fn bench_processes_json(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_hvd"))
        .args(["bench", "allreduce", "--processes"])
        .args(args)
        .arg("--json")
        .args(["--min-bytes", "1MiB", "--max-bytes", "1MiB", "--iters", "2"])
        .env_remove("HVD_RANK")
        .env_remove("HVD_SIZE")
        .env_remove("HVD_RENDEZVOUS")
        .output()
        .expect("run hvd bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn allreduce_runs_worker_processes_on_shared_buffers() {
    let stdout = bench_processes_json(&["--shared-buffers"]);
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 1, "one size, printed by rank 0 only: {stdout}");
    let row = &lines[0];
    assert_eq!(row["ranks"], 2);
    assert_eq!(row["ranks_are"], "processes");
    assert_eq!(row["buffers"], "shared");
    assert_eq!(row["bytes"], 1 << 20);
}

#[test]
fn allreduce_runs_a_fused_group_of_tensors() {
    let stdout = bench_processes_json(&["--tensors", "5"]);
    let row: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!(row["tensors"], 5);
    assert_eq!(row["buffers"], "private");
    assert_eq!(row["bytes"], 1 << 20);
    let zero = Command::new(env!("CARGO_BIN_EXE_hvd"))
        .args(["bench", "allreduce", "--tensors", "0"])
        .output()
        .expect("run hvd bench");
    assert!(!zero.status.success());
    assert!(String::from_utf8_lossy(&zero.stderr).contains("--tensors"));
}
