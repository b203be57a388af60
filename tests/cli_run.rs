//! End-to-end tests of `hvd run` with the built binary: workers are small sh scripts.
//!
//! Fault-injection tests check the process table (/proc) for anything of the job left behind: every worker gets a
//! unique `HVD_TEST_MARKER` in its environment (through the step's `env`), inherited by whatever it starts.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime};

mod common;

use common::HVD;

struct Job {
    dir: tempfile::TempDir,
    marker: String,
}

fn unique() -> u128 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        ^ (u128::from(std::process::id()) << 64)
}

/// A project directory with `train.hvd` made of `steps` (each a full `step NAME { ... }` block) and files.
fn job(steps: &str, files: &[(&str, &str)]) -> Job {
    let dir = tempfile::tempdir().unwrap();
    let marker = format!("m{}", unique());
    let steps = steps.replace("@MARKER@", &marker);
    let text =
        format!("project \"t\"\nenv {{\n  python = \"3.11\"\n  packages = []\n}}\n{steps}\n");
    std::fs::write(dir.path().join("train.hvd"), text).unwrap();
    for (name, content) in files {
        std::fs::write(dir.path().join(name), content).unwrap();
    }
    Job { dir, marker }
}

impl Job {
    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(HVD);
        // Most tests run without building the env (`--no-build`); `the_env_is_built_and_used` covers the default.
        cmd.arg("run")
            .arg(self.path().join("train.hvd"))
            .arg("--no-build")
            .args(args)
            .env("NO_COLOR", "1");
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }

    fn spawn(&self, args: &[&str]) -> Child {
        self.command(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Pids of live processes that carry this job's marker.
    fn leftovers(&self) -> Vec<u32> {
        common::processes_with_env(&format!("HVD_TEST_MARKER={}", self.marker))
            .into_iter()
            .map(|(pid, _)| pid)
            .collect()
    }

    /// Polls until no process of the job is left, up to `limit`; returns what is left.
    fn wait_gone(&self, limit: Duration) -> Vec<u32> {
        common::wait_until_empty(limit, Duration::from_millis(20), || self.leftovers())
    }

    fn wait_for_files(&self, names: &[String]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !names.iter().all(|n| self.path().join(n).exists()) {
            assert!(Instant::now() < deadline, "workers never got ready");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Waits for `child`, killing it when it runs past `limit` (a hang guard, generous by design).
fn wait_with_guard(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn stderr_of(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const FOUR_WORKERS: &str = r#"
step train {
  workers = 4
  run = "sh worker.sh"
  env = { HVD_TEST_MARKER = "@MARKER@" }
}
"#;

/// A worker that starts a child of its own (so the process group matters), and a victim rank that fails after a
/// delay: `VICTIM` rank, `ACTION` (`kill` = SIGKILL itself, `exit` = exit 5), `DELAY` seconds.
const FAULTY_WORKER: &str = r#"
sleep 300 &
touch ready.$HVD_RANK
if [ "$HVD_RANK" = VICTIM ]; then
  while [ "$(ls ready.* | wc -l)" -lt 4 ]; do sleep 0.01; done
  sleep DELAY
  echo "rank $HVD_RANK about to fail" >&2
  # $PPID is the worker process itself (`sh -c`), the one the launcher started.
  if [ ACTION = kill ]; then kill -KILL $PPID; sleep 300; else exit 5; fi
fi
wait
"#;

fn fault_injection(action: &str) {
    const GRACE_S: u64 = 3;
    for victim in 0..4u32 {
        // A random moment: 0-300 ms after every rank is up.
        let delay = format!("0.{:03}", unique() % 300);
        let script = FAULTY_WORKER
            .replace("VICTIM", &victim.to_string())
            .replace("ACTION", action)
            .replace("DELAY", &delay);
        let job = job(FOUR_WORKERS, &[("worker.sh", &script)]);
        let mut child = job.spawn(&["--grace", &GRACE_S.to_string()]);
        // The run must end within the grace period + 2 s (workers here die on SIGTERM at once).
        let status = wait_with_guard(&mut child, Duration::from_secs(GRACE_S + 2));
        let stderr = stderr_of(child);
        let status = status.unwrap_or_else(|| {
            panic!("victim {victim} ({action}): run did not end in time\n{stderr}")
        });
        let want = if action == "kill" { 137 } else { 5 };
        assert_eq!(
            status.code(),
            Some(want),
            "victim {victim} ({action}):\n{stderr}"
        );
        let cause = if action == "kill" {
            "killed by SIGKILL"
        } else {
            "exit code 5"
        };
        assert!(
            stderr.contains(&format!("rank {victim} on ")),
            "victim {victim}: summary names the rank:\n{stderr}"
        );
        assert!(
            stderr.contains(cause),
            "victim {victim}: summary names the cause:\n{stderr}"
        );
        assert!(
            stderr.contains(&format!("| rank {victim} about to fail")),
            "stderr tail in summary:\n{stderr}"
        );
        assert_eq!(
            job.leftovers(),
            Vec::<u32>::new(),
            "victim {victim} ({action}): processes left"
        );
    }
}

#[test]
fn a_rank_killed_by_sigkill_ends_the_run_with_its_code_and_nothing_left() {
    fault_injection("kill");
}

#[test]
fn a_rank_exiting_non_zero_ends_the_run_with_its_code_and_nothing_left() {
    fault_injection("exit");
}

const WAITING_WORKER: &str = r#"
sleep 300 &
touch ready.$HVD_RANK
wait
"#;

#[test]
fn sigint_or_sigterm_to_the_launcher_stops_every_worker() {
    for (signal, code, name) in [("-INT", 130, "SIGINT"), ("-TERM", 143, "SIGTERM")] {
        let job = job(FOUR_WORKERS, &[("worker.sh", WAITING_WORKER)]);
        let mut child = job.spawn(&[]);
        job.wait_for_files(&(0..4).map(|r| format!("ready.{r}")).collect::<Vec<_>>());
        assert!(job.leftovers().len() >= 4, "the workers are running");
        Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .unwrap();
        let status = wait_with_guard(&mut child, Duration::from_secs(12)).expect("run ended");
        let stderr = stderr_of(child);
        assert_eq!(status.code(), Some(code), "{stderr}");
        assert!(
            stderr.contains(&format!("interrupted ({name})")),
            "{stderr}"
        );
        assert_eq!(job.leftovers(), Vec::<u32>::new());
    }
}

#[test]
fn a_second_sigint_kills_workers_that_ignore_sigterm() {
    // The worker process itself (`sh -c`) ignores SIGINT (passed on by the launcher) and SIGTERM, and so does its script.
    let steps = FOUR_WORKERS.replace(
        "run = \"sh worker.sh\"",
        "run = \"trap '' INT TERM; sh worker.sh\"",
    );
    let stubborn = "touch ready.$HVD_RANK\nwhile true; do sleep 0.05; done\n";
    let job = job(&steps, &[("worker.sh", stubborn)]);
    let mut child = job.spawn(&["--grace", "300"]);
    job.wait_for_files(&(0..4).map(|r| format!("ready.{r}")).collect::<Vec<_>>());
    let pid = child.id().to_string();
    Command::new("kill").args(["-INT", &pid]).status().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        child.try_wait().unwrap().is_none(),
        "first SIGINT waits for the grace period"
    );
    Command::new("kill").args(["-INT", &pid]).status().unwrap();
    let status =
        wait_with_guard(&mut child, Duration::from_secs(12)).expect("second SIGINT ends the run");
    assert_eq!(status.code(), Some(130));
    assert_eq!(job.leftovers(), Vec::<u32>::new());
}

#[test]
fn workers_die_with_a_sigkilled_launcher() {
    let job = job(FOUR_WORKERS, &[("worker.sh", WAITING_WORKER)]);
    let mut child = job.spawn(&[]);
    job.wait_for_files(&(0..4).map(|r| format!("ready.{r}")).collect::<Vec<_>>());
    // Each rank: `sh -c`, the script's shell and its background `sleep` (which may still be exec'ing).
    let running = job.leftovers();
    assert!(running.len() >= 8, "the workers are running: {running:?}");
    child.kill().unwrap();
    child.wait().unwrap();
    let left = job.wait_gone(Duration::from_secs(2));
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "workers still alive 2 s after the launcher was killed"
    );
}

#[test]
fn output_is_prefixed_filtered_by_rank_and_logged_per_rank() {
    let steps = r#"
step train {
  workers = 3
  run = "echo hello from $HVD_RANK; echo problem $HVD_RANK >&2"
}
"#;
    let job = job(steps, &[]);
    let out = job.run(&["--ranks", "0,2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned();
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            format!("[train {host}:0] hello from 0"),
            format!("[train {host}:2] hello from 2")
        ]
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("[train {host}:2] problem 2")));
    assert!(
        !stderr.contains("problem 1"),
        "rank 1 filtered from the console"
    );
    let runs: Vec<PathBuf> = std::fs::read_dir(job.path().join(".hvd/runs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1);
    for rank in 0..3 {
        let dir = runs[0].join(format!("train/rank.{rank}"));
        assert_eq!(
            std::fs::read_to_string(dir.join("stdout")).unwrap(),
            format!("hello from {rank}\n")
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("stderr")).unwrap(),
            format!("problem {rank}\n")
        );
    }
}

#[test]
fn steps_run_in_order_and_unchanged_ones_are_skipped() {
    let steps = r#"
step prepare {
  run = "echo prepared >> log; mkdir -p data; cat input.txt > data/x"
  inputs = ["input.txt"]
  outputs = ["data"]
}
step train {
  needs = [prepare]
  workers = 2
  run = "test -f data/x && echo trained $HVD_RANK >> log"
}
"#;
    let job = job(steps, &[("input.txt", "1")]);
    let first = job.run(&[]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = job.run(&["--workers", "3"]);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{stderr}");
    assert!(stderr.contains("step `prepare` skipped"), "{stderr}");
    let log = std::fs::read_to_string(job.path().join("log")).unwrap();
    assert_eq!(log.lines().filter(|l| *l == "prepared").count(), 1);
    assert_eq!(
        log.lines().filter(|l| l.starts_with("trained")).count(),
        5,
        "2 then 3 workers"
    );
    assert_eq!(log.lines().next(), Some("prepared"));
    let forced = job.run(&["--force", "--step", "prepare"]);
    assert!(forced.status.success());
    let log = std::fs::read_to_string(job.path().join("log")).unwrap();
    assert_eq!(log.lines().filter(|l| *l == "prepared").count(), 2);
}

#[test]
fn dry_run_prints_the_plan_and_runs_nothing() {
    let steps = r#"
step prepare {
  run = "touch ran"
}
step train {
  needs = [prepare]
  workers = 2
  run = "python train.py"
  env = { LR = "0.1" }
}
"#;
    let job = job(steps, &[]);
    let out = job.run(&["--dry-run", "--workers", "3"]);
    assert!(out.status.success());
    let plan = String::from_utf8_lossy(&out.stdout);
    for want in [
        "1. step prepare",
        "2. step train",
        "needs:   prepare",
        "workers: 3",
        "rank 2 on",
        "LR=0.1",
        "python train.py",
    ] {
        assert!(plan.contains(want), "missing {want:?} in\n{plan}");
    }
    assert!(!job.path().join("ran").exists());
}

/// `--step S --no-deps` runs S alone, not the steps it needs (what a slurm batch job's launcher runs), and always:
/// what the steps it needs made is part of its inputs, which it cannot check (here `b`'s inputs are unchanged and a
/// plain run skips it), nor record; `--no-deps` without `--step` is a usage error.
#[test]
fn no_deps_runs_the_step_alone() {
    let job = job(
        "step a {\n  run = \"echo a >> ran\"\n}\nstep b {\n  needs = [\"a\"]\n  inputs = [\"in.txt\"]\n  \
         outputs = [\"out.txt\"]\n  run = \"echo b >> ran; touch out.txt\"\n}\n",
        &[],
    );
    std::fs::write(job.path().join("in.txt"), "x").unwrap();
    let ran = || std::fs::read_to_string(job.path().join("ran")).unwrap();
    for (args, want, skipped) in [
        (&["--step", "b", "--no-deps"][..], "b\n", false),
        (&["--step", "b"], "b\na\nb\n", false),
        (&["--step", "b"], "b\na\nb\na\n", true),
        (&["--step", "b", "--no-deps"], "b\na\nb\na\nb\n", false),
        // Not recorded: a record without `a`'s outputs would skip it here.
        (&["--step", "b", "--no-deps"], "b\na\nb\na\nb\nb\n", false),
    ] {
        let out = job.run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert_eq!(ran(), want, "{args:?}: {stderr}");
        assert_eq!(
            stderr.contains("step `b` skipped"),
            skipped,
            "{args:?}: {stderr}"
        );
    }
    let out = job.run(&["--no-deps"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--step"));
}

#[test]
fn unknown_step_is_a_usage_error() {
    let job = job("step a {\n  run = \"true\"\n}\n", &[]);
    let out = job.run(&["--step", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no step named `nope`"));
}

/// `--grace` and `--start-timeout` take seconds within a range, like `--elastic-timeout`: `1e19` fit a `Duration`
/// and reached the deadlines made of them (`Instant + Duration` panics past the clock), NaN, infinities and negative
/// values are refused too, each a usage error naming the flag, the value and the range before anything runs. A day,
/// the most each takes, runs the step (which fails at once with its own code: no wait, no panic).
#[test]
fn grace_and_start_timeout_out_of_range_are_usage_errors() {
    let job = job(
        "step a {\n  workers = 2\n  run = \"touch ran.$HVD_RANK; exit 3\"\n}\n",
        &[],
    );
    let grace = "is out of range: give from 0 to 86400 seconds (a day)";
    let start = "is out of range: give from 1 to 86400 seconds (a day)";
    for (args, want) in [
        (
            ["--grace", "1e19"],
            format!("`--grace 10000000000000000000` {grace}"),
        ),
        (["--grace", "86400.5"], format!("`--grace 86400.5` {grace}")),
        (["--grace=-1", "--force"], format!("`--grace -1` {grace}")),
        (["--grace", "NaN"], format!("`--grace NaN` {grace}")),
        (
            ["--start-timeout", "1e19"],
            format!("`--start-timeout 10000000000000000000` {start}"),
        ),
        (
            ["--start-timeout", "inf"],
            format!("`--start-timeout inf` {start}"),
        ),
        (
            ["--start-timeout", "0.5"],
            format!("`--start-timeout 0.5` {start}"),
        ),
    ] {
        let out = job.run(&args);
        let stderr = common::flat_stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&want), "{args:?}: want `{want}`:\n{stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    let ran = || job.path().join("ran.0").exists() || job.path().join("ran.1").exists();
    assert!(!ran(), "a step ran");
    let out = job.run(&["--grace", "86400", "--start-timeout", "86400"]);
    let stderr = common::flat_stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(ran(), "the step never ran");
}

#[test]
fn a_once_step_failure_passes_its_exit_code_through() {
    let job = job(
        "step a {\n  run = \"echo bad input >&2; exit 42\"\n}\n",
        &[],
    );
    let out = job.run(&[]);
    assert_eq!(out.status.code(), Some(42));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("| bad input"), "{stderr}");
}

#[test]
fn a_closed_stderr_does_not_hang_the_launcher() {
    // Regression: `eprintln!` panicked on a closed stderr inside a step thread and the run waited forever.
    let steps = FOUR_WORKERS.replace("run = \"sh worker.sh\"", "run = \"sleep 0.3; exit 3\"");
    let job = job(&steps, &[]);
    let mut child = job
        .command(&[])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    let status = wait_with_guard(&mut child, Duration::from_secs(30)).expect("the run ended");
    // src/main.rs prints the final report with `eprintln!`, which exits 101 on a closed stderr; what matters here
    // is that the run ends, fails, and leaves nothing behind.
    assert!(!status.success());
    assert_eq!(job.leftovers(), Vec::<u32>::new());
}

#[test]
fn the_env_is_built_and_used_by_default() {
    let steps = r#"
step train {
  workers = 2
  run = "echo venv=$VIRTUAL_ENV; test \"$(command -v python)\" = \"$VIRTUAL_ENV/bin/python\" && echo python-from-env"
}
"#;
    let job = job(steps, &[]);
    let store = job.path().join("store");
    let out = common::hvd_run_command(job.path())
        .env("HVD_STORE", &store)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let link = std::fs::read_link(job.path().join(".hvd/env")).expect("root link to the built env");
    assert!(link.starts_with(&store), "{}", link.display());
    common::assert_every_rank_says(&out, 2, |rank| format!(":{rank}] venv={}", link.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("python-from-env").count(), 2, "{stdout}");
}

/// A distributed step's bad `HVD_REMOTE_KEEPALIVE` (its `env`) stops the run before anything runs, naming the
/// variable, the value and the step; a step that runs once is not asked for one.
#[test]
fn a_bad_keepalive_is_refused_before_any_step_runs() {
    let dir = common::project(
        "step prep {\n  run = \"touch prepped\"\n  env = { HVD_REMOTE_KEEPALIVE = \"soon\" }\n}\n\
         step train {\n  needs = [\"prep\"]\n  run = \"true\"\n  workers = 2\n  env = { HVD_REMOTE_KEEPALIVE = \"fast\" }\n}",
    );
    let out = common::hvd_run_command(dir.path())
        .arg("--no-build")
        .output()
        .unwrap();
    let (stdout, stderr) = common::text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    assert!(
        flat.contains("step `train`: HVD_REMOTE_KEEPALIVE=\"fast\" is not a number of seconds from 0.1 to 3600"),
        "{stderr}"
    );
    assert!(!dir.path().join("prepped").exists(), "{stderr}");
    // Without the distributed step, the one that runs once runs.
    let file = dir.path().join("train.hvd");
    let text_of = std::fs::read_to_string(&file).unwrap();
    let (once, _) = text_of.split_once("step train").unwrap();
    std::fs::write(&file, once).unwrap();
    let out = common::hvd_run_command(dir.path())
        .arg("--no-build")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out).1);
    assert!(dir.path().join("prepped").exists());
}
