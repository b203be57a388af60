//! `hvd run --max-restarts N` and a step's `restarts = N` (issue #19 §1): a step whose rank fails starts again with
//! the same workers, the restart count in every worker's environment and in the summary; engines that own the run
//! map it (a JobSet's `failurePolicy.maxRestarts`) or restart through a launcher of their own (sbatch outside an
//! allocation).

use std::path::Path;
use std::process::Output;

mod common;

use common::text;

/// A unique marker every worker of one test carries (`HVD_TEST_MARKER`), to find what a run left behind.
fn marker() -> String {
    common::unique_marker("restarts")
}

/// `hvd run --no-build PROJECT/train.hvd ARGS...`.
fn run(dir: &Path, args: &[&str]) -> Output {
    common::hvd_run_command(dir)
        .arg("--no-build")
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("SLURM_JOB_ID")
        .output()
        .unwrap()
}

/// A 2-worker step `train` running `fail.sh` (rank 1 exits 3 on the attempts `fail.sh` is told to fail, once rank 0
/// has written down what it saw; rank 0 waits to be stopped), with `extra` lines in the step.
fn failing_project(extra: &str, failing_attempts: &str, marker: &str) -> tempfile::TempDir {
    let dir = common::project(&format!(
        "step train {{\n  run = \"sh fail.sh\"\n  workers = 2\n  env = {{ HVD_TEST_MARKER = \"{marker}\" }}\n{extra}}}"
    ));
    // Each attempt writes down what it saw (restart counts, rendezvous), then fails or succeeds.
    let script = format!(
        "echo \"$HVD_RANK $HVD_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $HVD_RENDEZVOUS $HVD_JOB_TOKEN\" \
         >> seen.$HVD_RANK\n\
         case \" {failing_attempts} \" in\n\
         *\" $HVD_RESTART_COUNT \"*)\n\
           if [ \"$HVD_RANK\" = 1 ]; then\n\
             while [ $(( $(cat seen.0 2>/dev/null | wc -l) )) -le \"$HVD_RESTART_COUNT\" ]; do sleep 0.01; done\n\
             echo \"rank 1 fails on attempt $HVD_RESTART_COUNT\" >&2; exit 3\n\
           fi\n\
           sleep 60 ;;\n\
         esac\n\
         echo \"rank $HVD_RANK done at restart $HVD_RESTART_COUNT\"\n"
    );
    std::fs::write(dir.path().join("fail.sh"), script).unwrap();
    dir
}

/// The lines each rank wrote to `seen.<rank>`: `rank restart torch-restart rendezvous token`.
fn seen(dir: &Path, rank: u32) -> Vec<Vec<String>> {
    std::fs::read_to_string(dir.join(format!("seen.{rank}")))
        .unwrap_or_default()
        .lines()
        .map(|l| l.split(' ').map(str::to_owned).collect())
        .collect()
}

/// The run's log directory (`.hvd/runs/<run id>`).
fn run_dir(dir: &Path) -> std::path::PathBuf {
    let runs = dir.join(".hvd/runs");
    let mut entries: Vec<_> = std::fs::read_dir(&runs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    entries.pop().unwrap()
}

#[test]
fn a_step_that_fails_once_succeeds_on_its_restart() {
    let marker = marker();
    let dir = failing_project("", "0", &marker);
    let out = run(dir.path(), &["--max-restarts", "1", "--grace", "2"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("hvd: step `train` succeeded after 1 restart"),
        "{stderr}"
    );
    assert!(stderr.contains("(restart 1 of 1)"), "{stderr}");
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("rank {rank} done at restart 1")),
            "{stdout}"
        );
        // Two attempts; the second with restart count 1 under both names, a new rendezvous server and token.
        let seen = seen(dir.path(), rank);
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert_eq!(seen[0][1..3], ["0", "0"], "{seen:?}");
        assert_eq!(seen[1][1..3], ["1", "1"], "{seen:?}");
        assert_ne!(
            seen[0][3], seen[1][3],
            "one rendezvous server for two attempts"
        );
        assert_ne!(seen[0][4], seen[1][4], "one job token for two attempts");
    }
    // The failed attempt's logs are kept where they always were; the restart's under restart.1/.
    let step_logs = run_dir(dir.path()).join("train");
    let first = std::fs::read_to_string(step_logs.join("rank.1/stderr")).unwrap();
    assert!(first.contains("rank 1 fails on attempt 0"), "{first}");
    let second = std::fs::read_to_string(step_logs.join("restart.1/rank.1/stdout")).unwrap();
    assert!(second.contains("rank 1 done at restart 1"), "{second}");
    common::assert_nothing_left(&marker);
}

#[test]
fn a_launched_step_restarts_its_launcher_with_every_rank() {
    let found = std::process::Command::new("sh")
        .args(["-c", "command -v mpirun"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipped: `mpirun` is not installed");
        return;
    }
    let marker = marker();
    let dir = failing_project("", "0", &marker);
    let out = run(
        dir.path(),
        &["--engine", "mpi", "--max-restarts", "1", "--grace", "2"],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("hvd: step `train` succeeded after 1 restart"),
        "{stderr}"
    );
    for rank in 0..2 {
        let seen = seen(dir.path(), rank);
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert_eq!(seen[1][1..3], ["1", "1"], "{seen:?}");
        assert_ne!(seen[0][4], seen[1][4], "one job token for two attempts");
    }
    common::assert_nothing_left(&marker);
}

#[test]
fn without_restarts_the_first_failure_ends_the_run_as_before() {
    for args in [&[][..], &["--max-restarts", "0"][..]] {
        let marker = marker();
        let dir = failing_project("", "0", &marker);
        let out = run(dir.path(), &[args, &["--grace", "2"]].concat());
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
        assert!(
            stderr.contains("step `train` failed: rank 1 on"),
            "{stderr}"
        );
        assert!(stderr.contains("ended first (exit code 3)"), "{stderr}");
        assert!(stderr.contains("rank 1 fails on attempt 0"), "{stderr}");
        assert!(!stderr.contains("attempts"), "{stderr}");
        assert!(!stderr.contains("restart"), "{stderr}");
        assert_eq!(seen(dir.path(), 1).len(), 1);
        assert!(!run_dir(dir.path()).join("train/restart.1").exists());
        common::assert_nothing_left(&marker);
    }
}

#[test]
fn restarts_in_the_file_run_every_attempt_then_fail_naming_them() {
    let marker = marker();
    let dir = failing_project("  restarts = 2\n", "0 1 2", &marker);
    let out = run(dir.path(), &["--grace", "2"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    // The root cause as without restarts, from the last attempt, then the attempts.
    assert!(
        stderr.contains("step `train` failed: rank 1 on"),
        "{stderr}"
    );
    assert!(stderr.contains("rank 1 fails on attempt 2"), "{stderr}");
    assert!(
        common::unwrapped(&stderr).contains(&common::unwrapped(
            "step `train` failed on each of its 3 attempts (2 restarts)"
        )),
        "{stderr}"
    );
    for rank in 0..2 {
        let restarts: Vec<String> = seen(dir.path(), rank)
            .into_iter()
            .map(|l| l[1].clone())
            .collect();
        assert_eq!(restarts, ["0", "1", "2"]);
    }
    let step_logs = run_dir(dir.path()).join("train");
    for (logs, attempt) in [
        ("rank.1", 0),
        ("restart.1/rank.1", 1),
        ("restart.2/rank.1", 2),
    ] {
        let stderr = std::fs::read_to_string(step_logs.join(logs).join("stderr")).unwrap();
        assert!(
            stderr.contains(&format!("rank 1 fails on attempt {attempt}")),
            "{logs}: {stderr}"
        );
    }
    common::assert_nothing_left(&marker);
    let out = run(dir.path(), &["--dry-run"]);
    assert!(
        text(&out)
            .0
            .contains("restarts: up to 2 (HVD_RESTART_COUNT)"),
        "{}",
        text(&out).0
    );

    // `--max-restarts` wins over the file: one attempt.
    std::fs::remove_dir_all(dir.path().join(".hvd")).unwrap();
    for rank in 0..2 {
        std::fs::remove_file(dir.path().join(format!("seen.{rank}"))).unwrap();
    }
    let out = run(dir.path(), &["--grace", "2", "--max-restarts", "0"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out).1);
    assert_eq!(seen(dir.path(), 1).len(), 1);
    common::assert_nothing_left(&marker);
}

#[test]
fn restarts_that_are_not_a_count_get_a_diagnostic() {
    for (value, says) in [("\"two\"", "expected an integer"), ("-1", "out of range")] {
        let dir = common::project(&format!(
            "step train {{\n  run = \"true\"\n  restarts = {value}\n}}"
        ));
        let out = run(dir.path(), &[]);
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{stdout}\n{stderr}");
        assert!(stderr.contains(says), "{value}: {stderr}");
        assert!(stderr.contains("restarts"), "{value}: {stderr}");
    }
}

const K8S: &str = r#"cluster {
  engine = "kubernetes"
  image = "example/train:1"
}
step train {
  run = "echo train"
  workers = 2
  restarts = 2
}"#;

#[test]
fn a_jobset_restarts_as_the_step_says_and_passes_the_count_on() {
    let dir = common::project(K8S);
    let jobset = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(".hvd/k8s/t.jobset.json")).unwrap())
            .unwrap()
    };
    let out = run(dir.path(), &["--dry-run"]);
    assert!(out.status.success(), "{}", text(&out).1);
    let doc = jobset(dir.path());
    assert_eq!(doc["spec"]["failurePolicy"]["maxRestarts"], 2);
    let env = &doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
        [0]["env"];
    for name in ["HVD_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"] {
        let var = env
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("{name} missing: {env}"));
        assert_eq!(
            var["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"
        );
    }
    // `--max-restarts` wins over the file.
    let out = run(dir.path(), &["--dry-run", "--max-restarts", "5"]);
    assert!(out.status.success(), "{}", text(&out).1);
    assert_eq!(
        jobset(dir.path())["spec"]["failurePolicy"]["maxRestarts"],
        5
    );
    let out = run(dir.path(), &["--dry-run", "--max-restarts", "0"]);
    assert!(out.status.success(), "{}", text(&out).1);
    let doc = jobset(dir.path());
    assert_eq!(doc["spec"]["failurePolicy"]["maxRestarts"], 0);
    assert!(!doc.to_string().contains("HVD_RESTART_COUNT"), "{doc}");
}

/// The slurm engine outside an allocation runs a step that may start again under a launcher of its own in the step's
/// batch job (`hvd run --step train --no-deps` inside the allocation, `--max-restarts` passed on): a step whose rank 1
/// fails on the first attempt succeeds on the second, saying so; one whose rank fails on both attempts fails the run
/// with that rank's exit code and the launcher's own report, naming the job.
#[test]
fn a_batch_job_restarts_its_step_through_its_own_launcher() {
    let Some(slurm) = common::slurm::Slurm::start() else {
        return;
    };
    let marker = marker();
    let dir = failing_project("", "0", &marker);
    let out = slurm.submit(dir.path(), &["--max-restarts", "1", "--grace", "2"]);
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert!(out.status.success(), "{}", logs());
    assert!(
        stderr.contains("hvd: step `train` succeeded after 1 restart"),
        "{}",
        logs()
    );
    for rank in [0, 1] {
        let restarts: Vec<String> = seen(dir.path(), rank)
            .iter()
            .map(|l| l[1].clone())
            .collect();
        assert_eq!(restarts, ["0", "1"], "rank {rank}: {}", logs());
        assert!(
            stdout.contains(&format!("] rank {rank} done at restart 1")),
            "{}",
            logs()
        );
    }
    slurm.assert_queue_empties();
    common::assert_nothing_left(&marker);

    let dir = failing_project("", "0 1", &marker);
    let out = slurm.submit(dir.path(), &["--max-restarts", "1", "--grace", "2"]);
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert_eq!(out.status.code(), Some(3), "{}", logs());
    let said = common::flat_stderr(&out);
    for want in [
        "step `train` failed: its launcher (`hvd run` in slurm job ",
        "rank 1 fails on attempt 1",
        "failed on each of its 2 attempts",
        "its report is above, and in ",
    ] {
        assert!(said.contains(want), "want `{want}`: {}", logs());
    }
    slurm.assert_queue_empties();
    common::assert_nothing_left(&marker);
}

/// kubectl for [`a_jobset_run_reports_the_restarts_the_jobset_made`]: keeps what `apply` got, shows one finished
/// pod, and a JobSet that completed after one restart (`status.restarts`).
const KUBECTL: &str = r#"#!/bin/sh
d=$(dirname "$0")
case "$1 $2" in
  "apply -f") cat > "$d/applied.json" ;;
  delete\ *) ;;
  "get pods") printf '{"items": [{"metadata": {"name": "t-train-0-0-x", "labels": {"jobset.sigs.k8s.io/replicatedjob-name": "train", "batch.kubernetes.io/job-completion-index": "0"}}, "spec": {"nodeName": "n"}, "status": {"phase": "Succeeded", "containerStatuses": [{"name": "worker", "state": {"terminated": {"exitCode": 0}}}]}}]}' ;;
  "get jobset") echo '{"status": {"restarts": 1, "conditions": [{"type": "Completed", "status": "True"}]}}' ;;
  "logs -f") echo "train done" ;;
  *) exit 1 ;;
esac
"#;

#[test]
fn a_jobset_run_reports_the_restarts_the_jobset_made() {
    let dir = common::project(&K8S.replace("workers = 2", "workers = 1"));
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::write(bin.join("kubectl"), KUBECTL).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(bin.join("kubectl"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = common::hvd_run_command(dir.path())
        .args(["--no-build", "--max-restarts", "3"])
        .env("PATH", path)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let applied: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bin.join("applied.json")).unwrap()).unwrap();
    assert_eq!(applied["items"][1]["kind"], "JobSet");
    assert_eq!(
        applied["items"][1]["spec"]["failurePolicy"]["maxRestarts"],
        3
    );
    assert!(
        stderr.contains("hvd: step `train` succeeded after 1 restart"),
        "{stderr}"
    );
}
