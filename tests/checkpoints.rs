//! Checkpoints beyond the process (issue #19 §4) under a real `hvd run` on the local engine: a numpy training script
//! commits and checkpoints (`state.checkpoint()`) every step; a run that fails with its restarts exhausted, or whose
//! whole job is killed, is followed by a run that resumes from the latest complete checkpoint, counts every committed
//! step once and says so in its summary; torn, hostile and linked checkpoints are skipped, never loaded.

use std::path::Path;
use std::process::Output;

mod common;

use common::{allreduce_runtime, text};

/// `CKPT_STEPS` steps of an allreduce, each committed and checkpointed (keeping 3). `CKPT_FAIL_AT`: rank 1 exits 3
/// when it begins that step; `CKPT_HOLD_AT`: at that step rank 0 writes `held` and every rank sleeps (the test kills
/// the whole job). At the end every rank prints its step, whether `seen` holds each step once in order, and `w[0]`
/// (the sum of every step's allreduce: 2 per step on 2 ranks).
const TRAIN: &str = r#"
import os
import time
import numpy as np
import hvd

steps = int(os.environ["CKPT_STEPS"])
fail_at = int(os.environ.get("CKPT_FAIL_AT", "-1"))
hold_at = int(os.environ.get("CKPT_HOLD_AT", "-1"))
hvd.init()
# `CKPT_BAD`: the state holds a value no checkpoint can hold (a set).
extra = {"bad": {1}} if os.environ.get("CKPT_BAD") else {}
state = hvd.elastic.ObjectState(step=0, seen=[], w=np.zeros(3), **extra)


@hvd.elastic.run
def train(state):
    print("rank %d starts at step %d" % (hvd.rank(), state.step), flush=True)
    while state.step < steps:
        if state.step == fail_at and hvd.rank() == 1:
            os._exit(3)  # a crash: no shutdown (which would leave the others going on as joined)
        if state.step == hold_at:
            if hvd.rank() == 0:
                open("held", "w").close()
            time.sleep(600)
        g = hvd.allreduce(np.full(3, 1.0), op=hvd.Sum, name="g")
        state.w = state.w + g
        state.step += 1
        state.seen.append(state.step)
        state.commit()
        state.checkpoint(keep=3)


train(state)
once = "once" if state.seen == list(range(1, steps + 1)) else repr(state.seen)
print("rank %d done: step %d seen %s w0 %r" % (hvd.rank(), state.step, once, float(state.w[0])), flush=True)
hvd.shutdown()
"#;

fn marker() -> String {
    common::unique_marker("checkpoints")
}

/// A project whose 2-worker step `train` (`workers` as written in the file) runs the training script, with `extra`
/// lines in the step.
fn project(workers: &str, extra: &str, marker: &str) -> tempfile::TempDir {
    let (python, package, lib) = allreduce_runtime();
    let dir = common::project(&format!(
        "step train {{\n  run = \"{python} train.py\"\n  workers = {workers}\n  env = {{ PYTHONPATH = \"{}\", \
         HVD_LIBRARY = \"{}\", HVD_TEST_MARKER = \"{marker}\" }}\n{extra}}}",
        package.display(),
        lib.display()
    ));
    std::fs::write(dir.path().join("train.py"), TRAIN).unwrap();
    dir
}

/// `hvd run --no-build --grace 2 <args>` in `dir` with `env`: its output, stdout and stderr.
fn run(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Output, String, String) {
    let out = common::hvd_run_command(dir)
        .args(["--no-build", "--grace", "2"])
        .args(args)
        .env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    (out, stdout, stderr)
}

/// The checkpoints in `dir`, oldest first.
fn checkpoints(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ckpt-"))
        .collect();
    names.sort();
    names
}

/// Asserts that both ranks resumed at `from` and finished `steps` with every step counted once.
fn assert_resumed_and_finished(stdout: &str, stderr: &str, from: u32, steps: u32) {
    for rank in 0..2 {
        for want in [
            format!("rank {rank} starts at step {from}"),
            format!(
                "rank {rank} done: step {steps} seen once w0 {:?}",
                f64::from(2 * steps)
            ),
        ] {
            assert!(stdout.contains(&want), "want `{want}`:\n{stdout}\n{stderr}");
        }
    }
    assert!(
        stderr.contains(&format!(
            "hvd: step `train` resumed from checkpoint at commit {from}"
        )),
        "{stderr}"
    );
}

/// A run whose rank fails at step 4 on every attempt (its one restart resumes from commit 4 and fails again) ends
/// failed; the next `hvd run` resumes from commit 4 and finishes with each step counted once.
#[test]
fn a_run_after_restarts_ran_out_resumes_from_the_last_checkpoint() {
    let marker = marker();
    let dir = project("2", "  checkpoints = \"ckpt/\"\n  restarts = 1\n", &marker);
    let (out, stdout, stderr) = run(
        dir.path(),
        &[],
        &[("CKPT_STEPS", "8"), ("CKPT_FAIL_AT", "4")],
    );
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    // The restart itself resumed from the checkpoint the first attempt wrote.
    assert!(
        stdout.contains("rank 0 starts at step 0") && stdout.contains("rank 0 starts at step 4"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("hvd: step `train` resumed from checkpoint at commit 4"),
        "{stderr}"
    );
    let ckpt = dir.path().join("ckpt");
    assert_eq!(
        checkpoints(&ckpt),
        [
            "ckpt-000000000002",
            "ckpt-000000000003",
            "ckpt-000000000004"
        ]
    );
    let manifest = std::fs::read_to_string(ckpt.join("ckpt-000000000004/MANIFEST.json")).unwrap();
    assert!(
        manifest.contains("\"commit\": 4") && manifest.contains("\"sha256\""),
        "{manifest}"
    );

    let (out, stdout, stderr) = run(dir.path(), &[], &[("CKPT_STEPS", "8")]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_resumed_and_finished(&stdout, &stderr, 4, 8);
    assert_eq!(
        checkpoints(&ckpt),
        [
            "ckpt-000000000006",
            "ckpt-000000000007",
            "ckpt-000000000008"
        ]
    );
    common::assert_nothing_left(&marker);
}

/// The whole job of an elastic step is killed (SIGKILL to `hvd run`) after commit 5; the next run, told the directory
/// with `--checkpoints`, resumes from it.
#[test]
fn a_run_after_the_whole_job_was_killed_resumes_from_the_last_checkpoint() {
    let marker = marker();
    let dir = project("{ min = 1, max = 2 }", "", &marker);
    let ckpt = dir.path().join("elsewhere");
    let mut child = common::hvd_run_command(dir.path())
        .args(["--no-build", "--grace", "2", "--checkpoints"])
        .arg(&ckpt)
        .env("NO_COLOR", "1")
        .env("CKPT_STEPS", "8")
        .env("CKPT_HOLD_AT", "5")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    common::wait_for_path(&dir.path().join("held"), std::time::Duration::from_secs(60));
    child.kill().unwrap();
    child.wait().unwrap();
    common::assert_nothing_left(&marker);
    assert_eq!(checkpoints(&ckpt).last().unwrap(), "ckpt-000000000005");

    let (out, stdout, stderr) = run(
        dir.path(),
        &["--checkpoints", ckpt.to_str().unwrap()],
        &[("CKPT_STEPS", "8")],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_resumed_and_finished(&stdout, &stderr, 5, 8);
    common::assert_nothing_left(&marker);
}

/// The attacker owns the checkpoint directory: the newest checkpoint is torn (a file truncated), the next names a
/// path outside itself in its manifest, a `ckpt-` entry is a link to a valid checkpoint elsewhere, and a killed
/// writer's temporary directory holds a newer one. Each is skipped (the first three with a warning naming it and
/// why); the run resumes from the oldest, and its writes remove the link, not its target, and the leftover.
#[test]
fn torn_hostile_and_linked_checkpoints_are_skipped() {
    let marker = marker();
    let dir = project("2", "  checkpoints = \"ckpt/\"\n", &marker);
    let (out, stdout, stderr) = run(dir.path(), &[], &[("CKPT_STEPS", "6")]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let ckpt = dir.path().join("ckpt");
    assert_eq!(
        checkpoints(&ckpt),
        [
            "ckpt-000000000004",
            "ckpt-000000000005",
            "ckpt-000000000006"
        ]
    );
    // A valid checkpoint outside the directory, reached through a link with the highest number.
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let linked = outside.join("ckpt-000000000099");
    copy_dir(&ckpt.join("ckpt-000000000006"), &linked);
    let manifest = linked.join("MANIFEST.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text.replace("\"commit\": 6", "\"commit\": 99")).unwrap();
    std::os::unix::fs::symlink(&linked, ckpt.join("ckpt-000000000099")).unwrap();
    // What a writer killed before its rename leaves: a whole-looking checkpoint under its temporary name.
    let leftover = ckpt.join(".tmp-ckpt-000000000007-1");
    copy_dir(&ckpt.join("ckpt-000000000006"), &leftover);
    let manifest = leftover.join("MANIFEST.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text.replace("\"commit\": 6", "\"commit\": 7")).unwrap();
    // Torn: the newest real one loses the end of its state.
    let state = ckpt.join("ckpt-000000000006/state.json");
    let len = std::fs::metadata(&state).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&state)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    // Hostile: the next one's manifest names a file outside the checkpoint.
    let manifest = ckpt.join("ckpt-000000000005/MANIFEST.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        text.replace("\"state.json\"", "\"../../outside/secret\""),
    )
    .unwrap();

    let (out, stdout, stderr) = run(dir.path(), &[], &[("CKPT_STEPS", "8")]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    let named = |n: u32| format!("checkpoint {}/ckpt-{n:012} skipped: ", ckpt.display());
    for want in [
        format!(
            "{}it is not a directory one can open without following a link",
            named(99)
        ),
        format!(
            "{}state.json has {} bytes where the manifest says {len}: torn",
            named(6),
            len / 2
        ),
        format!(
            "{}MANIFEST.json names the file '../../outside/secret', which is not one of",
            named(5)
        ),
    ] {
        assert!(flat.contains(&want), "want `{want}`:\n{stderr}");
    }
    assert_resumed_and_finished(&stdout, &stderr, 4, 8);
    // Writing commit 5 replaced everything at or above it, the link itself, not what it points to.
    assert_eq!(
        checkpoints(&ckpt),
        [
            "ckpt-000000000006",
            "ckpt-000000000007",
            "ckpt-000000000008"
        ]
    );
    assert!(linked.join("MANIFEST.json").is_file());
    assert!(!leftover.exists());
    common::assert_nothing_left(&marker);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// A value that cannot go into a checkpoint fails `state.checkpoint()` on rank 0, naming the attribute, and every
/// rank raises (the allreduce after the write tells them); nothing is left in the directory.
#[test]
fn a_state_that_cannot_be_checkpointed_fails_naming_the_attribute() {
    let marker = marker();
    let dir = project("2", "  checkpoints = \"ckpt/\"\n", &marker);
    let (out, stdout, stderr) = run(dir.path(), &[], &[("CKPT_STEPS", "3"), ("CKPT_BAD", "1")]);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let ckpt = dir.path().join("ckpt");
    assert!(
        stderr.contains(&format!(
            "hvd.elastic.CheckpointError: cannot write the checkpoint of commit 1 to {}: state.bad: a set cannot go \
             into a checkpoint",
            ckpt.display()
        )),
        "{stderr}"
    );
    assert!(
        std::fs::read_dir(&ckpt)
            .map(|entries| entries.count() == 0)
            .unwrap_or(true),
        "{:?}",
        std::fs::read_dir(&ckpt).map(|e| e.map(|e| e.unwrap().file_name()).collect::<Vec<_>>())
    );
    common::assert_nothing_left(&marker);
}

/// The plan shows where a step's checkpoints go (relative to the project, or `--checkpoints` relative to the current
/// directory); a URL hvd cannot keep checkpoints at is an error of the file, with its place.
#[test]
fn the_checkpoint_directory_is_planned_and_a_bad_one_is_named() {
    let dir = common::project(
        "step train {\n  run = \"true\"\n  workers = 2\n  checkpoints = \"ckpt/a\"\n}",
    );
    let (out, stdout, stderr) = run(dir.path(), &["--dry-run"], &[]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let planned = format!("HVD_CHECKPOINT_DIR={}", dir.path().join("ckpt/a").display());
    assert!(stdout.contains(&planned), "{stdout}");

    let (out, stdout, stderr) = run(
        dir.path(),
        &["--dry-run", "--checkpoints", "/abs/where"],
        &[],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("HVD_CHECKPOINT_DIR=/abs/where"), "{stdout}");

    let dir = common::project(
        "step train {\n  run = \"true\"\n  workers = 2\n  checkpoints = \"file:///abs/url\"\n}",
    );
    let (out, stdout, stderr) = run(dir.path(), &["--dry-run"], &[]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("HVD_CHECKPOINT_DIR=/abs/url\n"), "{stdout}");

    let dir = common::project(
        "step train {\n  run = \"true\"\n  workers = 2\n  checkpoints = \"file://relative\"\n}",
    );
    let (out, stdout, stderr) = run(dir.path(), &["--dry-run"], &[]);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("`checkpoints` is a `file://` URL without an absolute path"),
        "{stderr}"
    );

    let dir = common::project(
        "step train {\n  run = \"true\"\n  workers = 2\n  checkpoints = \"s3://bucket/ckpt\"\n}",
    );
    let (out, stdout, stderr) = run(dir.path(), &["--dry-run"], &[]);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("`checkpoints` is a URL hvd cannot keep checkpoints at")
            && stderr.contains("train.hvd:"),
        "{stderr}"
    );
}
