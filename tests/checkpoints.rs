//! Checkpoints beyond the process (issue #19 §4) under a real `hvd run` on the local engine: a numpy training script
//! commits and checkpoints (`state.checkpoint()`) every step; a run that fails with its restarts exhausted, or whose
//! whole job is killed, is followed by a run that resumes from the latest complete checkpoint, counts every committed
//! step once and says so in its summary; torn, hostile and linked checkpoints are skipped, never loaded.

use std::path::Path;
use std::process::Output;

mod common;

use common::text;

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
    let env = format!(", HVD_TEST_MARKER = \"{marker}\"");
    common::train_project(workers, &env, extra, TRAIN)
}

/// `hvd run --no-build --grace 2 <args>` in `dir` with `env`: its output, stdout and stderr.
fn run(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Output, String, String) {
    common::hvd_run_graced(dir, 2, args, env)
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

/// Asserts that the checkpoints under `dir` are those of `commits`, no more.
fn assert_kept(dir: &Path, commits: std::ops::RangeInclusive<u32>) {
    let want: Vec<String> = commits.map(|c| format!("ckpt-{c:012}")).collect();
    assert_eq!(checkpoints(dir), want);
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
    // The restart itself resumed from the checkpoint the first attempt wrote. Rank 1 says so before it fails again;
    // rank 0 may be stopped (rank 1 failed) before it gets to print its own line.
    assert!(
        stdout.contains("rank 0 starts at step 0") && stdout.contains("rank 1 starts at step 4"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("hvd: step `train` resumed from checkpoint at commit 4"),
        "{stderr}"
    );
    let ckpt = dir.path().join("ckpt");
    assert_kept(&ckpt, 2..=4);
    let manifest = std::fs::read_to_string(ckpt.join("ckpt-000000000004/MANIFEST.json")).unwrap();
    assert!(
        manifest.contains("\"commit\": 4") && manifest.contains("\"sha256\""),
        "{manifest}"
    );

    let (out, stdout, stderr) = run(dir.path(), &[], &[("CKPT_STEPS", "8")]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_resumed_and_finished(&stdout, &stderr, 4, 8);
    assert_kept(&ckpt, 6..=8);
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
    assert_kept(&ckpt, 4..=6);
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
    // Writing commit 5 moved everything at or above it aside (`.old-ckpt-*`), the link itself, not what it points to.
    assert_kept(&ckpt, 6..=8);
    assert!(linked.join("MANIFEST.json").is_file());
    assert!(!leftover.exists());
    common::assert_nothing_left(&marker);
}

/// Hostile checkpoints, one of each kind, in a directory with one good checkpoint below them: a JSON nesting bomb as
/// manifest, file lists that are not one, negative and huge sizes, a compressed (bomb-shaped), a pickled and a lying
/// (a header declaring 1.2 TB over 8 bytes) `.npz` entry, unknown tags and a nesting bomb in the state, an array name
/// that is not there, a commit that is not a number, a FIFO as a checkpoint and as a manifest. `load_checkpoint()` (a real Python process with the `hvd`
/// package) skips each with its reason, without a traceback or a hang, and loads the good one.
const HOSTILE: &str = r#"
import hashlib, io, json, os, shutil, zipfile
import numpy as np
import hvd

root = os.environ["HVD_CHECKPOINT_DIR"]
s = hvd.elastic.ObjectState(step=7, w=np.arange(3.0))
s.commit()
s.checkpoint(keep=10)
base = os.path.join(root, "ckpt-000000000001")


def clone(n, manifest=None, files=None):
    d = os.path.join(root, "ckpt-%012d" % n)
    shutil.copytree(base, d)
    m = json.load(open(os.path.join(d, "MANIFEST.json")))
    m["commit"] = n
    for name, data in (files or {}).items():
        open(os.path.join(d, name), "wb").write(data)
        for e in m["files"]:
            if e["name"] == name:
                e["size"], e["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    raw = manifest(m) if manifest else m
    open(os.path.join(d, "MANIFEST.json"), "w").write(raw if isinstance(raw, str) else json.dumps(raw))


clone(2, lambda m: "[" * 100000 + "]" * 100000)
clone(3, lambda m: dict(m, files=["state.json"]))
clone(4, lambda m: dict(m, files=[dict(m["files"][0], size=-5)]))
clone(5, lambda m: dict(m, files=[dict(m["files"][0], size=10 ** 18)]))
bomb = io.BytesIO()
with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("a0.npy", b"\0" * (1 << 20))
clone(6, files={"arrays.npz": bomb.getvalue()})
pickled = io.BytesIO()
np.savez(pickled, a0=np.array([{"x": 1}], dtype=object), allow_pickle=True)
clone(7, files={"arrays.npz": pickled.getvalue()})
clone(8, files={"state.json": json.dumps({"attrs": {"step": {"x": 1}, "w": {"a": "a0"}}}).encode()})
clone(9, files={"state.json": ('{"attrs": {"step": ' + "[" * 50000 + "]" * 50000 + ', "w": {"a": "a0"}}}').encode()})
clone(10, files={"state.json": json.dumps({"attrs": {"step": 1, "w": {"a": "missing"}}}).encode()})
clone(11, lambda m: dict(m, commit=True))
os.mkfifo(os.path.join(root, "ckpt-000000000012"))
os.makedirs(os.path.join(root, "ckpt-000000000013"))
os.mkfifo(os.path.join(root, "ckpt-000000000013", "MANIFEST.json"))
# An a0.npy whose header declares 1.2 TB over 8 bytes (numpy allocates the declared array before it reads).
npy = io.BytesIO()
np.lib.format.write_array_header_1_0(npy, {"descr": "<f4", "fortran_order": False, "shape": (3 * 10 ** 11,)})
npy.write(b"\0" * 8)
lying = io.BytesIO()
with zipfile.ZipFile(lying, "w", zipfile.ZIP_STORED) as z:
    z.writestr("a0.npy", npy.getvalue())
clone(14, files={"arrays.npz": lying.getvalue()})
t = hvd.elastic.ObjectState(step=0, w=np.zeros(3))
print("loaded commit %s: step %d w %s" % (t.load_checkpoint(), t.step, t.w.tolist()))
"#;

/// Runs a Python script (one process, no job) with this checkout's `hvd` package and `HVD_CHECKPOINT_DIR=ckpt`.
fn run_script(script: &str, ckpt: &Path) -> (std::process::Output, String, String) {
    let out = common::hvd_python()
        .args(["-c", script])
        .env("HVD_CHECKPOINT_DIR", ckpt)
        .env_remove("HVD_CHECKPOINT_REPORT")
        .env_remove("HVD_RANK")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    (out, stdout, stderr)
}

#[test]
fn hostile_manifests_and_archives_are_refused_without_loading_anything() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let (out, stdout, stderr) = run_script(HOSTILE, &ckpt);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout, "loaded commit 1: step 7 w [0.0, 1.0, 2.0]\n",
        "{stderr}"
    );
    for (n, why) in [
        (
            14,
            "arrays.npz holds 'a0.npy' declaring float32 [300000000000] (1200000000000 bytes) in 8 bytes of data",
        ),
        (13, "MANIFEST.json is not a regular file"),
        (
            12,
            "it is not a directory one can open without following a link",
        ),
        (11, "MANIFEST.json names commit True, not 11"),
        (10, "state.json does not decode ('missing')"),
        (
            9,
            "state.json is not JSON (maximum recursion depth exceeded",
        ),
        (8, "state.json does not decode (unknown tag 'x')"),
        (
            7,
            "arrays.npz does not load (Object arrays cannot be loaded when allow_pickle=False)",
        ),
        (6, "arrays.npz holds 'a0.npy' compressed ("),
        (
            5,
            "MANIFEST.json claims 1000000000000000000 bytes of files, more than this machine's memory",
        ),
        (
            4,
            "MANIFEST.json lists arrays.npz twice or without a size and a hash",
        ),
        (3, "MANIFEST.json has no valid file list"),
        (
            2,
            "MANIFEST.json is not JSON (maximum recursion depth exceeded",
        ),
    ] {
        let want = format!("checkpoint {}/ckpt-{n:012} skipped: ", ckpt.display());
        let line = stderr
            .lines()
            .find(|l| l.contains(&want))
            .unwrap_or_else(|| panic!("no warning for {n}:\n{stderr}"));
        assert!(line.contains(why), "want `{why}` in: {line}");
    }
    assert!(!stderr.contains("Traceback"), "{stderr}");
}

/// Checkpoints in an S3 bucket (a real S3 server): a run whose rank fails at step 4 leaves commits 2-4 named in the
/// bucket's INDEX; an attacker then rewrites INDEX with a path and a checkpoint that is not there; the next run
/// ignores the path, skips the missing one with a warning, and resumes from commit 4.
#[test]
fn checkpoints_in_an_s3_bucket_survive_the_job() {
    let marker = marker();
    let s3 = common::s3::S3Server::start("ckpt");
    let dir = project("2", "  checkpoints = \"s3://ckpt/runs/train\"\n", &marker);
    let env: Vec<(&str, String)> = s3.env().into_iter().collect();
    let with = |extra: &[(&'static str, &'static str)]| -> Vec<(&str, &str)> {
        env.iter()
            .map(|(k, v)| (*k, v.as_str()))
            .chain(extra.iter().copied())
            .collect()
    };
    let (out, stdout, stderr) = run(
        dir.path(),
        &[],
        &with(&[("CKPT_STEPS", "8"), ("CKPT_FAIL_AT", "4")]),
    );
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    // The attacker's INDEX, written with the workers' own client.
    let hostile = "import hvd\nstore = hvd.elastic._S3.of('s3://ckpt/runs/train')\n\
                   print(store.get('INDEX', 4096).decode(), end='')\n\
                   store.put('INDEX', b'../../../etc\\nckpt-000000000003\\nckpt-000000000004\\nckpt-000000000099\\n')\n";
    let out = common::hvd_python()
        .args(["-c", hostile])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    let (index, said) = text(&out);
    assert!(out.status.success(), "{said}");
    assert_eq!(
        index,
        "ckpt-000000000002\nckpt-000000000003\nckpt-000000000004\n"
    );

    let (out, stdout, stderr) = run(dir.path(), &[], &with(&[("CKPT_STEPS", "8")]));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        common::flat_stderr(&out).contains(
            "checkpoint s3://ckpt/runs/train/ckpt-000000000099 skipped: no readable MANIFEST.json \
             (s3://ckpt/runs/train/ckpt-000000000099/MANIFEST.json is not there)"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("etc"), "{stderr}");
    assert_resumed_and_finished(&stdout, &stderr, 4, 8);
    // A fresh start (a state no checkpoint fits) writes its commit 1: INDEX names only it, and the older history's
    // objects stay.
    let fresh = "import hvd\nE = hvd.elastic\ns = E.ObjectState(step=0, extra=1)\nprint(s.load_checkpoint())\n\
                 s.commit()\ns.checkpoint()\nstore = E._S3.of('s3://ckpt/runs/train')\n\
                 print(store.get('INDEX', 4096).decode(), end='')\n\
                 print(store.get('ckpt-000000000008/MANIFEST.json', 1 << 20) is not None)\n";
    let out = common::hvd_python()
        .args(["-c", fresh])
        .env("HVD_CHECKPOINT_DIR", "s3://ckpt/runs/train")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    let (said, warned) = text(&out);
    assert!(out.status.success(), "{said}\n{warned}");
    assert_eq!(said, "None\nckpt-000000000001\nTrue\n", "{warned}");
    assert!(
        warned.contains(
            "s3://ckpt/runs/train/ckpt-000000000008 is at or above commit 1 and not what this run resumed from: \
             left out of INDEX (its objects stay)"
        ),
        "{warned}"
    );
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
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("HVD_CHECKPOINT_DIR=s3://bucket/ckpt\n"),
        "{stdout}"
    );
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--dry-run", "--checkpoints", "s3://other/x"],
        &[],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("HVD_CHECKPOINT_DIR=s3://other/x\n"),
        "{stdout}"
    );

    // `--checkpoints` for several steps: a subdirectory each; two steps naming one place: refused, both named.
    let two = "step a {\n  run = \"true\"\n  workers = 2\n  checkpoints = \"ckpt/\"\n}\n\
               step b {\n  run = \"true\"\n  workers = 2\n  checkpoints = \"./ckpt\"\n}";
    let dir = common::project(two);
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--dry-run", "--checkpoints", "/abs/where"],
        &[],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("HVD_CHECKPOINT_DIR=/abs/where/a\n")
            && stdout.contains("HVD_CHECKPOINT_DIR=/abs/where/b\n"),
        "{stdout}"
    );
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--dry-run", "--checkpoints", "/abs/where", "--step", "b"],
        &[],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("HVD_CHECKPOINT_DIR=/abs/where/b\n"),
        "{stdout}"
    );
    let (out, stdout, stderr) = run(dir.path(), &["--dry-run"], &[]);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    assert!(
        flat.contains("steps `a` and `b` keep their checkpoints at the same place")
            && flat
                .replace(' ', "")
                .contains(&format!("`{}`", dir.path().join("ckpt").display())),
        "{stderr}"
    );

    // On the command line as in the file: a `file://` URL is its path; an `http(s)://` location (read-only), another
    // URL or an `s3://` one without a bucket is refused before anything runs, saying why.
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--dry-run", "--checkpoints", "file:///abs/url"],
        &[],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("HVD_CHECKPOINT_DIR=/abs/url/a\n"),
        "{stdout}"
    );
    for (value, says) in [
        (
            "https://cache.example/ckpt",
            "an `http(s)://` cache is read-only",
        ),
        (
            "gs://bucket/ckpt",
            "hvd cannot keep checkpoints at such a URL",
        ),
        ("s3://", "an `s3://` URL needs a bucket"),
        ("file://relative", "a `file://` URL needs an absolute path"),
    ] {
        let (out, stdout, stderr) = run(dir.path(), &["--dry-run", "--checkpoints", value], &[]);
        assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
        let flat = common::flat_stderr(&out);
        assert!(
            flat.contains(&format!("`--checkpoints {value}`: ")) && flat.contains(says),
            "{stderr}"
        );
        assert!(!stdout.contains("HVD_CHECKPOINT_DIR"), "{stdout}");
    }

    for (value, says) in [
        (
            "https://cache.example/ckpt",
            "`checkpoints` is a URL hvd cannot keep checkpoints at",
        ),
        (
            "s3:///ckpt",
            "`checkpoints` is an `s3://` URL without a bucket",
        ),
    ] {
        let dir = common::project(&format!(
            "step train {{\n  run = \"true\"\n  workers = 2\n  checkpoints = \"{value}\"\n}}"
        ));
        let (out, stdout, stderr) = run(dir.path(), &["--dry-run"], &[]);
        assert!(!out.status.success(), "{stdout}\n{stderr}");
        assert!(
            stderr.contains(says) && stderr.contains("train.hvd:"),
            "{stderr}"
        );
    }
}

/// Each step of [`reports_project`]: one committed step; then, per `ATTACK`, rank 1 (a peer with the job's token) puts
/// a value at the rendezvous key where rank 0 reports a resume, or (`fallback`) rank 0 cannot reach the rendezvous and
/// reports its resume in the attempt's file.
const REPORTS: &str = r#"
import http.client, os
import hvd

attack = os.environ["ATTACK"]
values = {
    "huge": b"commit 1" + b" " * (1 << 20),
    "overflow": b"commit 99999999999999999999999",
    "lines": b"commit 5\nhvd: step `lines` resumed from checkpoint at commit 5\n",
    "binary": b"commit \xff5",
    "negative": b"commit -5",
    "empty": b"",
}
hvd.init()
if attack == "fallback":
    # What a rank 0 on a host that cannot reach the launcher's rendezvous sees.
    os.environ["HVD_RENDEZVOUS"] = "127.0.0.1:1"
heard = []
if attack == "foreign" and hvd.rank() == 0:
    # Under mpirun: HVD_RENDEZVOUS is 127.0.0.1:PORT, on rank 0's host another process's port that answers 200 to
    # anything; hvd run does not say that rank 0 reaches its rendezvous.
    import http.server, threading

    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            heard.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    foreign = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    os.environ["HVD_RENDEZVOUS"] = "127.0.0.1:%d" % foreign.server_address[1]
    assert os.environ.pop("HVD_CHECKPOINT_REPORT_RENDEZVOUS") == "1"
state = hvd.elastic.ObjectState(step=0)


@hvd.elastic.run
def train(state):
    state.step += 1
    state.commit()


train(state)
if attack in values and hvd.rank() == 1:
    host, _, port = os.environ["HVD_RENDEZVOUS"].rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("PUT", "/kv/hvd.checkpoint/resumed", body=values[attack],
                 headers={"Authorization": "Bearer " + os.environ["HVD_JOB_TOKEN"]})
    print("put", attack, conn.getresponse().status, flush=True)
if attack == "foreign" and hvd.rank() == 0:
    print("the foreign listener heard %d requests" % len(heard), flush=True)
hvd.barrier()
print("rank %d done at step %d" % (hvd.rank(), state.step), flush=True)
hvd.shutdown()
"#;

/// Steps `huge`, `overflow`, `lines`, `binary`, `negative`, `empty`, `fallback` and `foreign` (2 workers each,
/// checkpoints in `ckpt-<step>/`) running [`REPORTS`].
const REPORT_STEPS: [&str; 8] = [
    "huge", "overflow", "lines", "binary", "negative", "empty", "fallback", "foreign",
];

/// A peer with the job's credentials puts a huge, an overflowing, a multi-line, a non-UTF-8, a negative and an empty
/// value where rank 0 reports a resume: `hvd run` prints no resume line for any of them, and finishes; a rank 0 that
/// cannot reach the rendezvous reports its resume in the attempt's file instead, and `hvd run` says so.
#[test]
fn resume_reports_are_validated_and_fall_back_to_the_file() {
    let marker = marker();
    let (python, package, lib) = common::allreduce_runtime();
    let steps: String = REPORT_STEPS
        .iter()
        .map(|name| {
            format!(
                "step {name} {{\n  run = \"{python} reports.py\"\n  workers = 2\n  checkpoints = \"ckpt-{name}/\"\n  \
                 env = {{ PYTHONPATH = \"{}\", HVD_LIBRARY = \"{}\", ATTACK = \"{name}\", HVD_TEST_MARKER = \
                 \"{marker}\" }}\n}}\n",
                package.display(),
                lib.display()
            )
        })
        .collect();
    let dir = common::project(&steps);
    std::fs::write(dir.path().join("reports.py"), REPORTS).unwrap();
    // The fallback and foreign steps' rank 0 resumes from commit 7.
    let seed = "import hvd\ns = hvd.elastic.ObjectState(step=7)\nfor i in range(7):\n    s.commit()\ns.checkpoint()\n";
    for name in ["fallback", "foreign"] {
        let ckpt = dir.path().join(format!("ckpt-{name}"));
        let (out, stdout, stderr) = run_script(seed, &ckpt);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert_kept(&ckpt, 7..=7);
    }

    let (out, stdout, stderr) = run(dir.path(), &[], &[]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for name in &REPORT_STEPS[..6] {
        assert!(
            stdout.contains(&format!("put {name} 200")),
            "{stdout}\n{stderr}"
        );
    }
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("resumed from checkpoint") && !l.contains("hvd.elastic: "))
        .collect();
    // The foreign listener got no request (so not the job's token), and its 200 did not stand for the report: the
    // file did.
    assert_eq!(
        said,
        [
            "hvd: step `fallback` resumed from checkpoint at commit 7",
            "hvd: step `foreign` resumed from checkpoint at commit 7"
        ],
        "{stderr}"
    );
    assert!(
        stdout.contains("the foreign listener heard 0 requests"),
        "{stdout}"
    );
    assert!(
        stdout.contains("rank 0 done at step 8") && stdout.contains("rank 1 done at step 8"),
        "{stdout}"
    );
    common::assert_nothing_left(&marker);
}

/// What the reviewer's failures and attackers do, each in one real Python process with the `hvd` package: a fresh
/// start (a state that no checkpoint fits) writes its own checkpoints and moves the older history aside, never deleting
/// it; a writer holding the directory's lock keeps its temporary directory; sparse files and a manifest that claims
/// more than the machine's memory are refused before anything is read; the resume report through a link leaves the
/// link's target alone; a torch older than 2.6 never loads `torch.pt`; an S3 server that drips its answer fails the
/// load within the deadline, naming the URL.
const FAILURES: &str = r#"
import fcntl, http.server, json, os, shutil, sys, threading, time, types
import hvd

E = hvd.elastic
root = os.environ["HVD_CHECKPOINT_DIR"]
a = E.ObjectState(step=0)
for i in range(1, 6):
    a.step = i
    a.commit()
    a.checkpoint(keep=10)
E._lineages.clear()  # what a new process knows
b = E.ObjectState(step=0, extra=1)
print("fresh start loads", b.load_checkpoint())
for i in range(1, 4):
    b.step = i
    b.commit()
    b.checkpoint(keep=2)
print("listed", sorted(n for n in os.listdir(root) if not n.startswith(".old-")))
aside = sorted(n for n in os.listdir(root) if n.startswith(".old-"))
print("aside", [n[:len(".old-ckpt-000000000001")] for n in aside])
print("aside intact", all(E._verified(os.open(root, os.O_RDONLY), n, int(n[10:22]))[0] for n in aside))

lock = os.open(os.path.join(root, ".hvd-checkpoint.lock"), os.O_RDWR)
fcntl.flock(lock, fcntl.LOCK_EX)
other = os.path.join(root, ".tmp-ckpt-000000000009-1")
os.mkdir(other)
done = []
b.step = 4
b.commit()
writer = threading.Thread(target=lambda: done.append(b.checkpoint(keep=2)))
writer.start()
writer.join(1.0)
print("while locked: writing", writer.is_alive(), "other's temp", os.path.isdir(other))
fcntl.flock(lock, fcntl.LOCK_UN)
writer.join()
print("unlocked: wrote", os.path.basename(done[0]), "other's temp", os.path.isdir(other))

root2 = root + "2"
os.environ["HVD_CHECKPOINT_DIR"] = root2
c = E.ObjectState(step=1)
c.commit()
c.checkpoint()
base = os.path.join(root2, "ckpt-000000000001")
for n in (60, 61):
    d = os.path.join(root2, "ckpt-%012d" % n)
    shutil.copytree(base, d)
    m = json.load(open(os.path.join(d, "MANIFEST.json")))
    m["commit"] = n
    if n == 61:
        m["files"][0]["size"] = 2 * E._memory()
    json.dump(m, open(os.path.join(d, "MANIFEST.json"), "w"))
os.truncate(os.path.join(root2, "ckpt-000000000060", "state.json"), 64 << 30)
print("sparse loads", E.ObjectState(step=0).load_checkpoint())

tmp = os.path.dirname(root)
victim = os.path.join(tmp, "victim")
open(victim, "w").write("keep")
os.symlink(victim, os.path.join(tmp, "report"))
os.environ["HVD_CHECKPOINT_REPORT"] = os.path.join(tmp, "report")
E._resume(E.ObjectState(step=0))
print("victim holds", open(victim).read())

torch = types.ModuleType("torch")
torch.__version__ = "2.5.1+cu121"
torch.load = lambda *a, **k: open(os.path.join(tmp, "torch-loaded"), "w").close()
sys.modules["torch"] = torch
try:
    E.TorchState._checkpoint_load(None, {"torch.pt": b"code"})
except E._Refused as e:
    print("old torch refused:", e)
print("torch.load called", os.path.exists(os.path.join(tmp, "torch-loaded")))


class Drip(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(100000):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
server.daemon_threads = True
threading.Thread(target=server.serve_forever, daemon=True).start()
os.environ["HVD_S3_ENDPOINT"] = "http://127.0.0.1:%d" % server.server_address[1]
os.environ["HVD_CHECKPOINT_DIR"] = "s3://bucket/drip"
E._S3_TIMEOUT = 1.0
print("dripping S3 loads", E.ObjectState(step=0).load_checkpoint())
"#;

#[test]
fn fresh_starts_lock_holders_sparse_files_links_old_torch_and_slow_servers_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let (out, stdout, stderr) = run_script(FAILURES, &ckpt);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let want = [
        "fresh start loads None",
        // Commit 1 of the fresh start: its own, pruned below the latest 2 it wrote.
        "listed ['.hvd-checkpoint.lock', 'ckpt-000000000002', 'ckpt-000000000003']",
        "aside ['.old-ckpt-000000000001', '.old-ckpt-000000000002', '.old-ckpt-000000000003', \
         '.old-ckpt-000000000004', '.old-ckpt-000000000005']",
        "aside intact True",
        "while locked: writing True other's temp True",
        "unlocked: wrote ckpt-000000000004 other's temp False",
        "sparse loads 1",
        "victim holds keep",
        "old torch refused: torch 2.5.1+cu121 is older than 2.6, where torch.load(weights_only=True) can still run \
         code from the file (CVE-2025-32434): torch.pt is not loaded; upgrade torch to resume from it",
        "torch.load called False",
        "dripping S3 loads None",
    ];
    assert_eq!(stdout.lines().collect::<Vec<_>>(), want, "{stderr}");
    let flat = stderr.replace('\n', " ");
    for says in [
        format!(
            "{}/ckpt-000000000005 is at or above commit 1 and not what this run resumed from: moved aside as \
             .old-ckpt-000000000005-",
            ckpt.display()
        ),
        format!(
            "checkpoint {}2/ckpt-000000000061 skipped: MANIFEST.json claims ",
            ckpt.display()
        ),
        format!(
            "checkpoint {}2/ckpt-000000000060 skipped: state.json has 68719476736 bytes where at most ",
            ckpt.display()
        ),
        "cannot tell hvd run that it resumed (".to_string(),
        "cannot read the checkpoints at s3://bucket/drip (GET s3://bucket/drip/INDEX: no whole answer within 1.0 s)"
            .to_string(),
    ] {
        assert!(flat.contains(&says), "want `{says}`:\n{stderr}");
    }
    assert!(!stderr.contains("Traceback"), "{stderr}");
}

/// Under mpirun `HVD_RENDEZVOUS` is 127.0.0.1 on whichever host each rank runs, perhaps another process's port, so
/// the mpi engine must leave `HVD_CHECKPOINT_REPORT_RENDEZVOUS` unset in the ranks' environment (docs/runtime.md:
/// rank 0 then reports a resume in the file only), while they still get the report file. The local engine, whose
/// rank 0 reaches the launcher's rendezvous, sets it through the same attempt environment, so a leak would show.
/// The mpi half is skipped, saying so, without OpenMPI's `mpirun.openmpi`.
#[test]
fn the_mpi_engine_leaves_the_rendezvous_report_gate_unset() {
    let dir = common::project(
        "step train {\n  run = \"echo rank=$HVD_RANK gate=$(printenv HVD_CHECKPOINT_REPORT_RENDEZVOUS || echo unset) \
         report=$HVD_CHECKPOINT_REPORT\"\n  workers = 2\n  checkpoints = \"ckpt/\"\n}",
    );
    let openmpi = std::process::Command::new("sh")
        .args(["-c", "command -v mpirun.openmpi"])
        .output()
        .is_ok_and(|o| o.status.success());
    for (engine, gate) in [("local", "1"), ("mpi", "unset")] {
        if engine == "mpi" && !openmpi {
            eprintln!("skipped the mpi engine: `mpirun.openmpi` is not installed");
            continue;
        }
        let args: &[&str] = match engine {
            "mpi" => &["--engine", "mpi", "--mpi", "openmpi"],
            _ => &["--engine", engine],
        };
        let (out, stdout, stderr) = run(dir.path(), args, &[]);
        assert!(out.status.success(), "{engine}: {stdout}\n{stderr}");
        for rank in 0..2 {
            let said = format!("rank={rank} gate=");
            let line = stdout
                .lines()
                .find(|l| l.contains(&said))
                .unwrap_or_else(|| {
                    panic!("{engine}: rank {rank} said nothing:\n{stdout}\n{stderr}")
                });
            let (_, rest) = line.split_once(&said).unwrap();
            assert!(
                rest.starts_with(&format!("{gate} report=/"))
                    && rest.ends_with("/checkpoint.resumed"),
                "{engine}, rank {rank}: {line}"
            );
        }
    }
}
