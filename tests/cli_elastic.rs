//! Elastic steps (issue #19 §2, §3) under a real `hvd run` on the local engine: workers of a numpy training script
//! that uses `hvd.elastic` kill themselves (SIGKILL) at chosen steps; the survivors re-form the job with the lost
//! workers' replacements and finish with every committed step counted once and the same state everywhere, or, below
//! the minimum for longer than `--elastic-timeout`, the run fails saying so.

use std::path::Path;
use std::process::Output;

mod common;

use common::text;

/// The training script: `ELASTIC_STEPS` steps, each an allreduce of the step's gradient and of a participation
/// count, committed after each step; `ELASTIC_KILL` (`slot:step,...`) names the workers that send themselves
/// `ELASTIC_SIGNAL` (default SIGKILL) when they begin a step (`ELASTIC_SIGNALS` times, 0.2 s apart; default once). Every worker prints its re-forms and, at the end,
/// what it finished with and whether every rank of the final round agrees. With `ELASTIC_INTERRUPT`, every worker
/// raises `HostsUpdatedInterrupt` once when it begins that step; the worker `ELASTIC_STALL` does not come back after a
/// loss (it sleeps); every worker raises `HorovodInternalError` at step `ELASTIC_RAISE`, every time; `ELASTIC_HANG` (`slot:step,...`) names workers that hang (sleep) when they begin a step.
const TRAIN: &str = r#"
import os
import time
import numpy as np
import hvd

steps = int(os.environ["ELASTIC_STEPS"])
slot = int(os.environ["HVD_RANK"])
kills = dict(tuple(int(x) for x in k.split(":")) for k in os.environ.get("ELASTIC_KILL", "").split(",") if k)
signal = int(os.environ.get("ELASTIC_SIGNAL", "9"))
interrupt = int(os.environ.get("ELASTIC_INTERRUPT", "-1"))
stall = int(os.environ.get("ELASTIC_STALL", "-1"))
raise_at = int(os.environ.get("ELASTIC_RAISE", "-1"))
hangs = dict(tuple(int(x) for x in k.split(":")) for k in os.environ.get("ELASTIC_HANG", "").split(",") if k)
# Keep training past `steps` until this holds on some rank (`size:N`: the round has N members or more; `atmost:N`:
# N members or fewer; `file:PATH:N`: the number in PATH is at least N), checking every step with an allreduce; at
# most 4000 steps in all.
until = os.environ.get("ELASTIC_UNTIL", "")
# `slot:step:PATH:TEXT`: that worker writes TEXT into PATH when it begins that step (a discovery script reads it).
grow = os.environ.get("ELASTIC_GROW", "")
interrupted = []
# `slot:step:DIR`: that worker, beginning that step, puts files named `rank.3` .. `rank.63` into the step's log
# directory under DIR (the project), so that the launcher cannot create a new worker's log directory: its start fails.
block = os.environ.get("ELASTIC_BLOCK_LOGS", "")
# Seconds each step sleeps (a training long enough for the launcher to act meanwhile).
step_sleep = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
# `slot:step:PATH`: that worker waits, beginning that step, until PATH exists (at most 60 s).
wait_at = os.environ.get("ELASTIC_WAIT_AT", "")


def until_met():
    if not until:
        return True
    kind, _, arg = until.partition(":")
    if kind == "size":
        mine = hvd.size() >= int(arg)
    elif kind == "atmost":
        mine = hvd.size() <= int(arg)
    else:
        path, _, n = arg.rpartition(":")
        try:
            mine = int(open(path).read().strip() or 0) >= int(n)
        except (OSError, ValueError):
            mine = False
    time.sleep(0.02)
    return hvd.allreduce(np.array([1.0 if mine else 0.0]), op=hvd.Max, name="until")[0] > 0

# `slot:seconds`: that worker's `hvd.shutdown()` sleeps once the engine is down (the rest of a slow teardown).
slow = os.environ.get("ELASTIC_SLOW_SHUTDOWN", "")
if slow and int(slow.split(":")[0]) == slot:
    _shutdown = hvd.shutdown
    hvd.shutdown = lambda: (_shutdown(), time.sleep(float(slow.split(":")[1])))[0]

# `slot:PATH`: that worker waits until PATH exists, and 1 s more, before it joins (a replacement that asks late); it
# leaves `awaiting.<slot>` in the working directory first.
await_ = os.environ.get("ELASTIC_AWAIT", "")


def wait_for(path, seconds):
    """Waits until `path` exists, `seconds` at most."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


if await_ and int(await_.split(":")[0]) == slot:
    open("awaiting.%d" % slot, "w").close()
    wait_for(await_.split(":", 1)[1], 300)
    time.sleep(1)

# `slot:-1` in ELASTIC_KILL: that worker dies before it ever asks the rendezvous.
if kills.get(slot) == -1:
    os.kill(os.getpid(), signal)

if os.environ.get("ELASTIC_CHILD"):
    # A data loader's worker: a child of the rank that dies of SIGTERM (as torch's do), saying so in a file.
    import subprocess, sys
    subprocess.Popen([sys.executable, "-c",
                      "import os, signal, sys, time\n"
                      "def h(*a):\n"
                      "    open('child-termed.%s' % os.environ['HVD_RANK'], 'w').close()\n"
                      "    sys.exit(1)\n"
                      "signal.signal(signal.SIGTERM, h)\n"
                      "time.sleep(3600)\n"])
hvd.init()
print("slot %d starts as rank %d of %d" % (slot, hvd.rank(), hvd.size()), flush=True)
state = hvd.elastic.ObjectState(step=0, count=0.0, w=np.zeros(4))
state.register_reset_callbacks(
    [lambda: print("slot %d re-formed as rank %d of %d" % (slot, hvd.rank(), hvd.size()), flush=True)])


@hvd.elastic.run
def train(state):
    while state.step < 4000 and (state.step < steps or not until_met()):
        if grow and int(grow.split(":")[0]) == slot and int(grow.split(":")[1]) == state.step:
            _, _, path, text = grow.split(":", 3)
            with open(path, "w") as f:
                f.write(text + "\n")
        if block and int(block.split(":")[0]) == slot and int(block.split(":")[1]) == state.step:
            import glob
            for d in glob.glob(os.path.join(block.split(":", 2)[2], ".hvd", "runs", "*", "train")):
                for n in range(3, 64):
                    open(os.path.join(d, "rank.%d" % n), "w").close()
        time.sleep(step_sleep)
        if wait_at and wait_at.split(":", 2)[:2] == [str(slot), str(state.step)]:
            wait_for(wait_at.split(":", 2)[2], 60)
        if kills.get(slot) == state.step:
            os.kill(os.getpid(), signal)
            for _ in range(int(os.environ.get("ELASTIC_SIGNALS", "1")) - 1):
                # The same notice again (a platform and hvd's launcher both pass one eviction on).
                time.sleep(0.2)
                os.kill(os.getpid(), signal)
        if state.step == raise_at:
            # Every rank, every time: a failure no re-form cures.
            raise hvd.HorovodInternalError("deterministic failure at step %d" % state.step)
        if hangs.get(slot) == state.step:
            # Alive but hung outside any collective: the others time out, and the next round forms without it.
            time.sleep(600)
        if state.step == interrupt and not interrupted:
            # Every rank at the same committed step: re-form without restoring.
            interrupted.append(True)
            raise hvd.elastic.HostsUpdatedInterrupt()
        try:
            g = hvd.allreduce(np.full(4, state.step + 1.0), op=hvd.Average, name="grad")
        except hvd.HorovodInternalError:
            if slot == stall:
                # Alive but never back: the next round must form without it.
                time.sleep(600)
            raise
        c = hvd.allreduce(np.array([1.0]), op=hvd.Sum, name="count")
        state.w = state.w + g
        # 1 when every member of the round took part in this step.
        state.count += float(c[0]) / hvd.size()
        state.step += 1
        state.commit()
    if os.environ.get("ELASTIC_TERM_AT_END") == str(slot):
        # SIGTERM after the last commit, as the training returns: nothing is left to hand over.
        os.kill(os.getpid(), 15)
        time.sleep(0.1)


try:
    train(state)
except hvd.elastic.Preempted:
    if os.environ.get("ELASTIC_LATE_TERM") == "1":
        # The same notice once more after the hand-over (a launcher's request that comes after the pod's own).
        os.kill(os.getpid(), 15)
        time.sleep(0.2)
    elif os.environ.get("ELASTIC_LATE_TERM") == "exit":
        # ... or as the interpreter exits, once it has put the default action back for Python's handlers: a global
        # whose finalizer sends it as the modules are torn down.
        class _LateNotice:
            def __del__(self):
                os.kill(os.getpid(), 15)
                time.sleep(0.2)
        late_notice = _LateNotice()
    print("slot %d left after committing step %d" % (slot, state.step), flush=True)
    raise
finally:
    # `ELASTIC_FINALLY` (a directory): each worker leaves `finally.<slot>` there when it unwinds.
    if os.environ.get("ELASTIC_FINALLY"):
        open(os.path.join(os.environ["ELASTIC_FINALLY"], "finally.%d" % slot), "w").close()
final = hvd.allgather_object((state.step, state.count, state.w.tolist()))
print("slot %d finished as rank %d of %d: step %d count %r w0 %r agree %s" % (
    slot, hvd.rank(), hvd.size(), state.step, state.count, float(state.w[0]), all(f == final[0] for f in final)), flush=True)
hvd.shutdown()
"#;

/// A unique marker every worker of one test carries (`HVD_TEST_MARKER`), to find what a run left behind.
fn marker() -> String {
    common::unique_marker("elastic")
}

/// A project whose step `train` runs the training script on `workers` (as written in the file).
fn project(workers: &str, steps: u32, kill: &str, marker: &str) -> tempfile::TempDir {
    project_with_signal(workers, steps, kill, 9, marker)
}

/// [`project`] whose killed workers send themselves `signal`.
fn project_with_signal(
    workers: &str,
    steps: u32,
    kill: &str,
    signal: i32,
    marker: &str,
) -> tempfile::TempDir {
    let env = format!(
        ", ELASTIC_STEPS = \"{steps}\", ELASTIC_KILL = \"{kill}\", ELASTIC_SIGNAL = \"{signal}\", \
         HVD_TEST_MARKER = \"{marker}\""
    );
    common::train_project(workers, &env, "", TRAIN)
}

/// `hvd run --no-build --grace 2 <args>` in `dir` with the variables `env` set: its output, stdout and stderr.
fn run(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Output, String, String) {
    common::hvd_run_graced(dir, 2, args, env)
}

/// Asserts that each `(slot, rank)` of `members` printed that it re-formed as that rank of a job of `size`.
fn assert_re_formed(stdout: &str, stderr: &str, members: &[(u32, u32)], size: usize) {
    for (slot, rank) in members {
        assert!(
            stdout.contains(&format!("slot {slot} re-formed as rank {rank} of {size}")),
            "slot {slot}:\n{stdout}\n{stderr}"
        );
    }
}

/// Asserts that each `(slot, rank)` of `survivors` printed that it finished as that rank of a job of
/// `survivors.len()` at the last of `steps`, having counted every step once, followed by `then`.
fn assert_finished(stdout: &str, stderr: &str, survivors: &[(u32, u32)], steps: u32, then: &str) {
    let size = survivors.len();
    for (slot, rank) in survivors {
        let want = format!(
            "slot {slot} finished as rank {rank} of {size}: step {steps} count {:?}{then}",
            f64::from(steps)
        );
        assert!(stdout.contains(&want), "want `{want}`:\n{stdout}\n{stderr}");
    }
}

/// A killed worker of an elastic step is replaced without host discovery: the launcher starts a new worker in its
/// place on this machine (a new slot, 4), which joins at the survivors' next commit (training goes on until it has);
/// the job is back to 4 and finishes with every committed step counted once and the same state on every rank.
#[test]
fn a_lost_worker_is_replaced_and_the_job_finishes_every_committed_step_once() {
    let marker = marker();
    let steps = 24;
    let dir = project("{ min = 2, max = 4 }", steps, "2:9", &marker);
    // Every worker also raises `HostsUpdatedInterrupt` at step 5: a re-form of all four, before the loss.
    let (out, stdout, stderr) = run(
        dir.path(),
        &[],
        &[("ELASTIC_INTERRUPT", "5"), ("ELASTIC_UNTIL", "size:4")],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // `sh -c` reports its python's death as exit code 137.
    assert!(
        stderr
            .contains("rank 2 of step `train` was lost (exit code 137); 3 of its 4 workers go on"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("started rank 4 of step `train` on ")
            && stderr.contains(" in place of a lost worker; it joins the workers' next round"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("slot 4 starts as rank 3 of 4"),
        "{stdout}\n{stderr}"
    );
    // The survivors, slots 0, 1 and 3, re-form as 3, then with the replacement as ranks 0-3 of 4, and finish with
    // the same state: every step counted once, the weights the sum of every step's gradient.
    assert_re_formed(&stdout, &stderr, &[(0, 0), (1, 1), (2, 2), (3, 3)], 4);
    assert_re_formed(&stdout, &stderr, &[(0, 0), (1, 1), (3, 2)], 3);
    assert_re_formed(&stdout, &stderr, &[(0, 0), (1, 1), (3, 2)], 4);
    let step =
        common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (3, 2), (4, 3)]);
    assert!(step >= steps, "{stdout}");
    assert!(!stdout.contains("slot 2 finished"), "{stdout}");
    // One replacement: no fifth slot.
    assert!(!stdout.contains("slot 5 "), "{stdout}");
    common::assert_nothing_left(&marker);
}

/// Below its minimum an elastic step waits (up to `--elastic-timeout`) for workers to come back; the survivors wait
/// in their join meanwhile. Here a worker of 3 (minimum 3) dies: its replacement joins, the round of 3 that forms
/// brings the step back to 3 (said then, not when the replacement starts), then the replacement dies too: the machine
/// is blacklisted after 2 lost workers, past the timeout, so none can start, and the run fails at once naming the
/// reason. Its SIGTERM is a stop, not a preemption: the survivors, waiting in their join, end at once and
/// unwind (their `finally` blocks run), without the SIGKILL after `--grace`.
#[test]
fn below_its_minimum_a_step_waits_for_replacements_then_fails_naming_the_reason() {
    let marker = marker();
    // Slot 2 dies beginning step 3; its replacement (slot 3) gets the state of step 3 and dies beginning it too.
    let dir = project("3", 40, "2:3,3:3", &marker);
    let (out, stdout, stderr) = common::hvd_run_graced(
        dir.path(),
        5,
        &["--min-workers", "3", "--elastic-timeout", "2"],
        &[("ELASTIC_FINALLY", dir.path().to_str().unwrap())],
    );
    assert_eq!(out.status.code(), Some(137), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    for want in [
        "rank 2 of step `train` was lost (exit code 137): 2 of its workers are left, fewer than its minimum of 3; \
         waiting up to 2 s (--elastic-timeout) for replacements (elastic)",
        "started rank 3 of step `train` on ",
        "step `train` is back to 3 workers (minimum 3); it goes on (elastic)",
        "no new workers start there until then",
        // Without host discovery replacements start only on this machine, blacklisted for at least 60 s: the step
        // fails at once rather than wait out a timeout nothing can come back within.
        "step `train` has 2 workers, fewer than its minimum of 3, and none can come back within 2 s \
         (--elastic-timeout): every host where a replacement could start (",
        ") is blacklisted past it; the last one lost was rank 3 (exit code 137)",
        // The summary, its lines joined (the renderer wraps them).
        "step `train` failed: 2 of its workers are left, fewer than its minimum of 3 (elastic); the last one lost \
         was rank 3",
    ] {
        assert!(flat.contains(want), "want `{want}`:\n{stdout}\n{stderr}");
    }
    // The step was back before its replacement was lost, said in that order even when the launcher looks late (a
    // loaded machine: the replacement joined, its round formed and it died before the launcher saw the round).
    let back = flat.find("step `train` is back to 3 workers");
    let lost = flat.find("rank 3 of step `train` was lost");
    assert!(
        back.zip(lost).is_some_and(|(b, l)| b < l),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("slot 3 starts as rank 2 of 3"),
        "{stdout}\n{stderr}"
    );
    for slot in [0, 1] {
        assert!(
            dir.path().join(format!("finally.{slot}")).exists(),
            "slot {slot} did not unwind:\n{stdout}\n{stderr}"
        );
        assert!(
            stderr.contains(&format!(
                "SIGTERM: hvd run is stopping the step; this worker (slot {slot}) ends now"
            )),
            "{stdout}\n{stderr}"
        );
    }
    assert!(!stdout.contains("left after committing"), "{stdout}");
    assert!(!stderr.contains("SIGKILL"), "{stderr}");
    common::assert_nothing_left(&marker);
}

/// A replacement that hangs before it joins does not bring the step back to its minimum: only a round formed with
/// `min` members does. Slot 2 of 3 (minimum 3) dies; its replacement (slot 3) starts but never asks to join; after
/// `--elastic-timeout` the run fails naming the reason, as if nothing had started.
#[test]
fn below_its_minimum_a_replacement_that_never_joins_does_not_end_the_wait() {
    let marker = marker();
    let dir = project("3", 40, "2:3", &marker);
    let never = dir.path().join("never");
    let (out, stdout, stderr) = common::hvd_run_graced(
        dir.path(),
        2,
        &["--min-workers", "3", "--elastic-timeout", "2"],
        &[("ELASTIC_AWAIT", &format!("3:{}", never.display()))],
    );
    assert_eq!(out.status.code(), Some(137), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    for want in [
        "started rank 3 of step `train` on ",
        "step `train` has 2 workers, fewer than its minimum of 3, and no workers came back within 2 s \
         (--elastic-timeout); the last one lost was rank 2 (exit code 137)",
    ] {
        assert!(flat.contains(want), "want `{want}`:\n{stdout}\n{stderr}");
    }
    assert!(!flat.contains("is back to"), "{stdout}\n{stderr}");
    assert!(!stdout.contains("slot 3 starts"), "{stdout}\n{stderr}");
    common::assert_nothing_left(&marker);
}

/// Below its minimum a step with host discovery waits for the script to list slots again: slot 2 of 3 (minimum 3)
/// takes its slot off the list and dies; the survivors wait in their join until the script lists 3 slots again (after
/// 3 runs), a new worker starts there, and the job of 3 finishes with every committed step counted once.
#[test]
fn below_its_minimum_a_step_waits_until_discovery_finds_slots_again() {
    let marker = marker();
    let steps = 8;
    let dir = project("{ min = 3, max = 3 }", steps, "2:3", &marker);
    std::fs::write(dir.path().join("slots"), "localhost:3\n").unwrap();
    let script = discovery_script(
        dir.path(),
        "if grep -q ':2' slots; then n=$(cat waits 2>/dev/null || echo 0); n=$((n+1)); echo $n > waits; \
         if [ $n -ge 3 ]; then echo localhost:3 > slots; fi; fi\ncat slots",
    );
    let (out, stdout, stderr) = run(
        dir.path(),
        &[
            "--host-discovery-script",
            script.to_str().unwrap(),
            "--elastic-timeout",
            "30",
        ],
        &[("ELASTIC_GROW", "2:3:slots:localhost:2")],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    for want in [
        "rank 2 of step `train` was lost (exit code 137): 2 of its workers are left, fewer than its minimum of 3; \
         waiting up to 30 s (--elastic-timeout) for host discovery to find slots (elastic)",
        "host discovery found 3 slots for step `train`: started rank 3",
        "step `train` is back to 3 workers (minimum 3); it goes on (elastic)",
    ] {
        assert!(flat.contains(want), "want `{want}`:\n{stdout}\n{stderr}");
    }
    // The script listed 2 slots at least 3 times: the survivors waited, no round of 2 formed.
    assert!(!stdout.contains("re-formed as rank 0 of 2"), "{stdout}");
    let w0 = f64::from(steps * (steps + 1) / 2);
    let members = [(0, 0), (1, 1), (3, 2)];
    assert_finished(
        &stdout,
        &stderr,
        &members,
        steps,
        &format!(" w0 {w0:?} agree True"),
    );
    common::assert_nothing_left(&marker);
}

/// Host discovery lists fewer slots (4, then 2): the workers on the slots no longer listed (the highest, 3 and 2) are
/// asked to leave and hand over at their next commit, as a preempted worker does; they are not failures, the other
/// two re-form and finish with every committed step counted once. The request (SIGTERM) reaches each rank alone, not
/// the child every rank started (a data loader's worker, which dies of a SIGTERM).
#[test]
fn workers_on_slots_discovery_no_longer_lists_leave_at_a_commit() {
    let marker = marker();
    let dir = project("{ min = 2, max = 4 }", 4, "", &marker);
    std::fs::write(dir.path().join("slots"), "localhost:4\n").unwrap();
    let script = discovery_script(dir.path(), "cat slots");
    // Slot 0 lists 2 slots at step 3; training goes on until the round has 2 members.
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--host-discovery-script", script.to_str().unwrap()],
        &[
            ("ELASTIC_GROW", "0:3:slots:localhost:2"),
            ("ELASTIC_UNTIL", "atmost:2"),
            ("ELASTIC_CHILD", "1"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    for slot in [3, 2] {
        for want in [
            format!("host discovery no longer lists the slot of rank {slot} of step `train` on "),
            format!(
                "rank {slot} of step `train` left: host discovery no longer lists its slot (it committed and handed \
                 over)"
            ),
        ] {
            assert!(flat.contains(&want), "want `{want}`:\n{stdout}\n{stderr}");
        }
        assert!(
            stdout.contains(&format!("slot {slot} left after committing step")),
            "{stdout}\n{stderr}"
        );
    }
    assert!(
        !flat.contains("was lost") && !flat.contains("was preempted"),
        "{stderr}"
    );
    assert!(!flat.contains("preempted (SIGTERM)"), "{stderr}");
    assert!(!stderr.contains("PeerLostError"), "{stderr}");
    let step = common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1)]);
    assert!(step > 3, "{stdout}");
    // The hand-over request reached the rank alone, not its child (a data loader's worker, which dies of it).
    let termed = common::elastic::children_termed(dir.path());
    assert!(termed.is_empty(), "{termed:?}\n{stderr}");
    common::assert_nothing_left(&marker);
}

/// A replacement that asks to join only after the training finished (slot 2 waits until the survivor, slot 0, has
/// left its training loop) never joins: once the survivor ends well, every live worker that never was a member is
/// stopped, and the membership answers it that it is left out. Minimum 1: it would otherwise form a round alone and
/// train again from its initial state. Slot 0 waits at step 5 until the replacement runs (on a loaded machine the
/// survivor's last steps used to end before the launcher started one, and nothing was left to test).
#[test]
fn a_replacement_that_asks_after_the_training_finished_never_trains() {
    let marker = marker();
    let dir = project("{ min = 1, max = 2 }", 6, "1:3", &marker);
    let finally = dir.path().join("finally.0");
    let awaiting = dir.path().join("awaiting.2");
    let (out, stdout, stderr) = run(
        dir.path(),
        &[],
        &[
            ("ELASTIC_FINALLY", dir.path().to_str().unwrap()),
            ("ELASTIC_AWAIT", &format!("2:{}", finally.display())),
            ("ELASTIC_WAIT_AT", &format!("0:5:{}", awaiting.display())),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("started rank 2 of step `train` on "),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains(
            "rank 2 of step `train` never joined, and the training finished; stopping it"
        ),
        "{stdout}\n{stderr}"
    );
    assert!(!stdout.contains("slot 2 starts"), "{stdout}\n{stderr}");
    assert_finished(&stdout, &stderr, &[(0, 0)], 6, " w0 21.0 agree True");
    common::assert_nothing_left(&marker);
}

/// A replacement that cannot be started (its log directory cannot be created) is tried again only after a wait, and
/// its host (this machine) is blacklisted after 2 failures (the lost worker and the failed start): the survivors go
/// on and finish, instead of the launcher retrying every few milliseconds until the start cap fails the step.
#[test]
fn a_replacement_that_cannot_start_is_retried_after_a_wait_and_blacklists_its_host() {
    let marker = marker();
    let dir = project("{ min = 1, max = 3 }", 24, "2:3", &marker);
    let (out, stdout, stderr) = run(
        dir.path(),
        &[],
        &[
            (
                "ELASTIC_BLOCK_LOGS",
                &format!("2:2:{}", dir.path().display()),
            ),
            ("ELASTIC_STEP_SLEEP", "0.1"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    for want in [
        "warning: could not start rank 3 of step `train` for a free slot on ",
        "; trying again in 1 s at the earliest",
        "2 of its workers were lost or could not start; no new workers start there until then",
    ] {
        assert!(flat.contains(want), "want `{want}`:\n{stdout}\n{stderr}");
    }
    assert!(
        !flat.contains("could not start rank 4 "),
        "{stdout}\n{stderr}"
    );
    assert!(!flat.contains("its cap"), "{stdout}\n{stderr}");
    assert_finished(
        &stdout,
        &stderr,
        &[(0, 0), (1, 1)],
        24,
        " w0 300.0 agree True",
    );
    common::assert_nothing_left(&marker);
}

/// `--start-timeout` does not fail a healthy elastic step because one of its workers died before its first request:
/// slot 2 of 3 (minimum 2) dies before `hvd.init()`, the others (with its replacement) train on past the timeout.
#[test]
fn a_worker_lost_before_it_joined_does_not_trip_the_start_timeout() {
    let marker = marker();
    let dir = project("{ min = 2, max = 3 }", 30, "2:-1", &marker);
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--start-timeout", "2"],
        &[("ELASTIC_STEP_SLEEP", "0.1")],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 2 of step `train` was lost"),
        "{stdout}\n{stderr}"
    );
    assert!(
        !stderr.contains("did not join the rendezvous in time"),
        "{stderr}"
    );
    assert!(
        stdout.contains("slot 0 finished as rank 0 of "),
        "{stdout}\n{stderr}"
    );
    common::assert_nothing_left(&marker);
}

#[test]
fn an_elastic_range_above_the_workers_started_is_refused() {
    let marker = marker();
    let dir = project("{ min = 2, max = 4 }", 1, "", &marker);
    let (out, stdout, stderr) = run(dir.path(), &["--max-workers", "1"], &[]);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("minimum of 2 workers but starts only 1"),
        "{stdout}\n{stderr}"
    );
}

/// Preemption (spot reclaim, Kubernetes eviction) arrives as SIGTERM: in an elastic step the worker finishes its step,
/// commits, hands over and leaves (exit 0); the others re-form at that commit without restoring anything, so every
/// committed step counts once, and the run reports the worker as preempted, not failed.
#[test]
fn a_preempted_worker_commits_hands_over_and_leaves() {
    // Once, and the same notice twice 0.2 s apart (Kubernetes' SIGTERM and hvd's launcher's hand-over request for
    // one eviction), or the second after the worker handed over (it ended with 143 before: the default handler was
    // back), or as its interpreter exits (it ended with 143 there, until SIGTERM was ignored once handed over): one
    // hand-over either way.
    for (signals, late) in [("1", ""), ("2", ""), ("1", "1"), ("1", "exit")] {
        preempted_worker_hands_over(signals, late);
    }
}

/// [`a_preempted_worker_commits_hands_over_and_leaves`] with SIGTERM sent `signals` times (and once more after the
/// hand-over when `late` is not empty).
fn preempted_worker_hands_over(signals: &str, late: &str) {
    let marker = marker();
    let steps = 12;
    let dir = project_with_signal("{ min = 2, max = 4 }", steps, "2:5", 15, &marker);
    let (out, stdout, stderr) = run(
        dir.path(),
        &[],
        &[("ELASTIC_SIGNALS", signals), ("ELASTIC_LATE_TERM", late)],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // It began step 5 when SIGTERM came, finished it, and left at that step's commit.
    assert!(
        stdout.contains("slot 2 left after committing step 6"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains(
            "rank 2 of step `train` was preempted: it committed, handed over and left; 3 of its 4 workers go on"
        ),
        "{stdout}\n{stderr}"
    );
    let flat = common::flat_stderr(&out);
    assert!(
        flat.contains("step `train`: rank 2 preempted (SIGTERM): committed, handed over and left; not a failure"),
        "{stderr}"
    );
    assert!(!stderr.contains("was lost"), "{stderr}");
    // A hand-over, not a failure: no collective failed on the survivors.
    assert!(!stderr.contains("PeerLostError"), "{stderr}");
    let w0 = f64::from(steps * (steps + 1) / 2);
    let survivors = [(0, 0), (1, 1), (3, 2)];
    assert_re_formed(&stdout, &stderr, &survivors, 3);
    assert_finished(
        &stdout,
        &stderr,
        &survivors,
        steps,
        &format!(" w0 {w0:?} agree True"),
    );
    assert!(!stdout.contains("slot 2 finished"), "{stdout}");
    common::assert_nothing_left(&marker);
}

/// A stop while a hand-over is under way ends the worker at once: slot 2 is preempted (SIGTERM) at step 5 and waits
/// in that step's allreduce for slot 0, which is paused there; then `hvd run` gets SIGTERM. Its SIGTERM to the workers
/// is a stop, not the same notice again: slot 2 says so and ends with 143 (the earlier rule, which took any SIGTERM
/// within 5 s of the first for a duplicate, left it to be killed after `--grace`). The stop ends slot 0, so slot 2's
/// step completes (slot 0 takes part in it as a shut-down rank): when the stop's SIGTERM reaches slot 2 only after its
/// commit (a loaded machine; here forced by a handler of the script's own that ignores it), the launcher refuses its
/// hand-over and it ends as stopped all the same; it used to hand over, exit 0 and say its job went on.
#[test]
fn a_stop_during_a_hand_over_ends_the_worker_at_once() {
    for deaf in ["", "1"] {
        a_stop_during_a_hand_over(deaf);
    }
}

fn a_stop_during_a_hand_over(deaf: &str) {
    let marker = marker();
    let dir = common::elastic::project(
        "{ min = 2, max = 4 }",
        10,
        &format!(
            ", ELASTIC_PAUSE = \"5\", ELASTIC_TERM = \"2:5\", ELASTIC_TERM_DEAF = \"{deaf}\", \
             HVD_TEST_MARKER = \"{marker}\""
        ),
    );
    let child = common::hvd_run_command(dir.path())
        .args(["--no-build", "--grace", "5"])
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !dir.path().join("paused").exists() {
        assert!(std::time::Instant::now() < deadline, "slot 0 never paused");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Slot 2's own SIGTERM came as it began step 5, before slot 0 paused there; give its handler a moment.
    std::thread::sleep(std::time::Duration::from_secs(1));
    let interrupted = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(143), "{stdout}\n{stderr}");
    for want in [
        "hvd.elastic: SIGTERM: this worker (slot 2) commits, hands over and leaves at its next commit",
        "hvd.elastic: SIGTERM: hvd run is stopping the step; this worker (slot 2) ends now (exit code 143)",
    ] {
        assert!(stderr.contains(want), "want `{want}`:\n{stdout}\n{stderr}");
    }
    assert!(
        !stderr.contains("preempted: committed and left"),
        "{stderr}"
    );
    if !deaf.is_empty() {
        assert!(
            stderr.contains(
                "hvd.elastic: preempted, but hvd run began to stop the step before the hand-over (failed to leave \
                 the elastic job"
            ),
            "{stdout}\n{stderr}"
        );
        assert!(
            stderr.contains("the launcher is stopping this elastic step: it takes no hand-over"),
            "{stderr}"
        );
    }
    common::assert_nothing_left(&marker);
}

/// A preemption that leaves fewer workers than the minimum fails the step (exit code 143, as the SIGTERM): without
/// host discovery a preempted worker gets no replacement (its capacity is going away), so nothing can come back and
/// the step does not wait.
#[test]
fn a_preemption_below_the_minimum_without_discovery_fails_at_once() {
    let marker = marker();
    let dir = project_with_signal("{ min = 3, max = 3 }", 40, "2:3", 15, &marker);
    let (out, stdout, stderr) = run(dir.path(), &[], &[]);
    assert_eq!(out.status.code(), Some(143), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    assert!(
        flat.contains(
            "rank 2 of step `train` was preempted: it committed, handed over and left: 2 of its workers are left, \
             fewer than its minimum of 3; stopping the others"
        ),
        "{stdout}\n{stderr}"
    );
    assert!(!flat.contains("waiting up to"), "{stderr}");
    assert!(!flat.contains("in place of a lost worker"), "{stderr}");
    common::assert_nothing_left(&marker);
}

/// A preempted worker whose teardown is slow (its `hvd.shutdown()` goes on past the round window after its engine
/// released the others) still hands over: it tells the rendezvous it leaves before it shuts down, so the survivors' next round does not form without
/// it first (which would refuse its leave and count it as lost).
#[test]
fn a_preempted_worker_with_a_slow_shutdown_leaves_before_the_round_forms() {
    let marker = marker();
    let steps = 8;
    let dir = project_with_signal("{ min = 2, max = 3 }", steps, "2:3", 15, &marker);
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--elastic-timeout", "1"],
        &[("ELASTIC_SLOW_SHUTDOWN", "2:3")],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "rank 2 of step `train` was preempted: it committed, handed over and left; 2 of its 3 workers go on"
        ),
        "{stdout}\n{stderr}"
    );
    assert!(!stderr.contains("was lost"), "{stderr}");
    assert_finished(&stdout, &stderr, &[(0, 0), (1, 1)], steps, "");
    common::assert_nothing_left(&marker);
}

/// A rendezvous that accepts and never answers (blackholed) costs one timed-out ask at a commit, not one per commit:
/// after a failed `GET /elastic/v1/round` the members do not ask again for `_JOIN_CHECK_BACKOFF` seconds.
#[test]
fn a_rendezvous_that_does_not_answer_is_not_asked_again_at_every_commit() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    // The attacker: takes every connection and says nothing (the streams are kept open).
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            held.push(stream);
        }
    });
    let out = common::hvd_python()
        .args([
            "-c",
            "import hvd.elastic as e\n\
             e._JOIN_CHECK_INTERVAL = 0\n\
             e._JOIN_CHECK_TIMEOUT = 0.3\n\
             print([e._new_workers_waiting() for _ in range(4)])",
        ])
        .env("HVD_RENDEZVOUS", addr.to_string())
        .env("HVD_JOB_TOKEN", "t")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "[False, False, False, False]", "{stderr}");
    assert!(
        stderr.contains(&format!("cannot ask the rendezvous {addr} for new workers")),
        "{stderr}"
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "{stderr}");
}

/// A worker SIGTERM'd after its last commit, as its training returns, has nothing left to hand over: it finishes
/// like the others (the run's last collective included) and exits 0, not as a lost worker.
#[test]
fn a_sigterm_after_the_last_commit_lets_the_worker_finish_normally() {
    let marker = marker();
    let steps = 3;
    let dir = project("{ min = 1, max = 2 }", steps, "", &marker);
    let (out, stdout, stderr) = run(dir.path(), &[], &[("ELASTIC_TERM_AT_END", "1")]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr
            .contains("the training finished before another commit; this worker (slot 1) goes on"),
        "{stdout}\n{stderr}"
    );
    assert!(!stderr.contains("was lost"), "{stderr}");
    assert_finished(&stdout, &stderr, &[(0, 0), (1, 1)], steps, "");
    common::assert_nothing_left(&marker);
}

/// A SIGTERM'd worker that reaches no commit within `HVD_PREEMPT_GRACE` (here it hangs) ends as SIGTERM would have
/// ended it: a lost worker, and the others go on from their last commit.
#[test]
fn a_sigtermed_worker_without_a_commit_within_the_grace_is_a_loss() {
    let marker = marker();
    let steps = 10;
    let dir = project_with_signal("{ min = 2, max = 3 }", steps, "1:3", 15, &marker);
    let (out, stdout, stderr) = run(
        dir.path(),
        &[],
        &[
            ("HVD_PREEMPT_GRACE", "1"),
            ("ELASTIC_HANG", "1:3"),
            ("ELASTIC_UNTIL", "size:3"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr
            .contains("no commit within HVD_PREEMPT_GRACE=1 s of SIGTERM: ending as a lost worker"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr
            .contains("rank 1 of step `train` was lost (exit code 143); 2 of its 3 workers go on"),
        "{stdout}\n{stderr}"
    );
    assert!(!stderr.contains("preempted (SIGTERM)"), "{stderr}");
    // A lost worker: replaced (slot 3), which joins at a commit.
    let step = common::assert_finished_together(&stdout, &stderr, &[(0, 0), (2, 1), (3, 2)]);
    assert!(step >= steps, "{stdout}");
    common::assert_nothing_left(&marker);
}

/// Writes an executable discovery script into `dir`.
fn discovery_script(dir: &Path, body: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("discover.sh");
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Host discovery adds a slot mid-run: the launcher starts a third worker, which joins at the others' next commit
/// (they re-form and sync the state from rank 0); the final state is the same everywhere, every step counted once.
#[test]
fn a_slot_found_by_discovery_mid_run_joins_at_a_commit() {
    let marker = marker();
    let steps = 6;
    let dir = project("{ min = 1, max = 4 }", steps, "", &marker);
    std::fs::write(dir.path().join("slots"), "localhost:2\n").unwrap();
    let script = discovery_script(dir.path(), "cat slots");
    // Slot 0 writes a third slot at step 3; training goes on until the round has 3 members.
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--host-discovery-script", script.to_str().unwrap()],
        &[
            ("ELASTIC_GROW", "0:3:slots:localhost:3"),
            ("ELASTIC_UNTIL", "size:3"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("step `train` on 2 worker(s)"), "{stderr}");
    assert!(
        stdout.contains("slot 0 starts as rank 0 of 2")
            && stdout.contains("slot 1 starts as rank 1 of 2"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("host discovery found 3 slots for step `train`: started rank 2"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("slot 2 starts as rank 2 of 3"),
        "{stdout}\n{stderr}"
    );
    // Every slot finished at the same step with the same state; each step counted once.
    let line = |slot: u32| {
        stdout
            .lines()
            .find(|l| l.contains(&format!("slot {slot} finished as rank {slot} of 3: ")))
            .unwrap_or_else(|| panic!("slot {slot} did not finish:\n{stdout}\n{stderr}"))
            .split_once("finished as")
            .unwrap()
            .1
            .split_once(": ")
            .unwrap()
            .1
            .to_owned()
    };
    let first = line(0);
    assert_eq!(line(1), first);
    assert_eq!(line(2), first);
    let step: u32 = first.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(step > 3, "{first}");
    let want = format!(
        "step {step} count {:?} w0 {:?} agree True",
        f64::from(step),
        f64::from(step * (step + 1) / 2)
    );
    assert_eq!(first, want, "{stdout}");
    common::assert_nothing_left(&marker);
}

/// A discovery script that prints garbage, exits 1, hangs or prints nothing (exit 0) is named in a warning each time,
/// and the step keeps its workers and completes (an empty list would otherwise remove every worker above the
/// minimum).
#[test]
fn a_failing_discovery_script_is_named_and_the_step_keeps_its_workers() {
    let marker = marker();
    let dir = project("{ min = 1, max = 3 }", 4, "", &marker);
    let script = discovery_script(
        dir.path(),
        "n=$(cat runs 2>/dev/null || echo 0); n=$((n+1)); echo $n > runs\n\
         case $n in\n  1) echo localhost:2 ;;\n  2) echo 'this is no host line' ;;\n  3) echo 'no hosts today' >&2; \
         exit 1 ;;\n  4) sleep 600 ;;\n  5) ;;\n  *) echo localhost:2 ;;\nesac",
    );
    // Train until the script has started a 6th time: runs 2-5 (the bad ones) have been reported by then.
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--host-discovery-script", script.to_str().unwrap()],
        &[
            ("HVD_DISCOVERY_TIMEOUT", "1"),
            ("ELASTIC_UNTIL", "file:runs:6"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    let named = format!("host discovery script `{}`", script.display());
    for want in [
        format!(
            "{named} printed line 1 \"this is no host line\", which is not `host:slots`; keeping the current hosts"
        ),
        format!("{named} failed (exit status: 1): no hosts today; keeping the current hosts"),
        format!("{named} did not finish within 1 s (killed); keeping the current hosts"),
        format!("{named} printed no `host:slots` line; keeping the current hosts"),
    ] {
        assert!(flat.contains(&want), "want `{want}`:\n{stderr}");
    }
    let finished: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(" finished as rank "))
        .collect();
    assert_eq!(finished.len(), 2, "{stdout}\n{stderr}");
    assert!(
        finished
            .iter()
            .all(|l| l.contains(" of 2: ") && l.ends_with("agree True")),
        "{stdout}"
    );
    common::assert_nothing_left(&marker);
}

/// Two workers on this machine are lost: the machine is blacklisted for the cooldown, so host discovery, which still
/// finds 4 slots there (2 of them free, below the step's maximum of 6), starts no new workers; the two survivors go
/// on and finish. The training goes on until the script has run 3 times after slot 0 saw the loss (it writes `mark`
/// two steps later), so discovery had its chances.
#[test]
fn a_host_whose_workers_fail_repeatedly_is_blacklisted_and_the_others_go_on() {
    let marker = marker();
    let dir = project("{ min = 1, max = 6 }", 6, "2:3,3:3", &marker);
    let script = discovery_script(
        dir.path(),
        "if [ -f mark ]; then n=$(cat runs 2>/dev/null || echo 0); echo $((n+1)) > runs; fi\necho localhost:4",
    );
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--host-discovery-script", script.to_str().unwrap()],
        &[
            ("ELASTIC_GROW", "0:5:mark:x"),
            ("ELASTIC_UNTIL", "file:runs:3"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("step `train` on 4 worker(s)"), "{stderr}");
    // The default range's first cooldown: 60 s and its random part, less than a quarter more.
    let flat = common::flat_stderr(&out);
    let cooldown: u32 = flat
        .split("is blacklisted for ")
        .nth(1)
        .and_then(|rest| {
            let (n, tail) = rest.split_once(" s: ")?;
            tail.starts_with(
                "2 of its workers were lost or could not start; no new workers start there until then",
            )
                .then_some(n)?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no blacklisting:\n{stderr}"));
    assert!((60..=75).contains(&cooldown), "{cooldown}:\n{stderr}");
    assert!(!stderr.contains("host discovery found"), "{stderr}");
    assert!(
        std::fs::read_to_string(dir.path().join("runs"))
            .is_ok_and(|n| n.trim().parse::<u32>().is_ok_and(|n| n >= 3)),
        "{stderr}"
    );
    let mut finished: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(" finished as rank "))
        .collect();
    assert_eq!(finished.len(), 2, "{stdout}\n{stderr}");
    // The two survivors print in either order.
    finished.sort_by_key(|l| l.split("] slot ").nth(1).unwrap_or(l).to_owned());
    for (slot, line) in finished.iter().enumerate() {
        let step: u32 = line
            .split("step ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        // Every step counted once: its participation count is 1 per step, its gradient sum 1 + 2 + ... + step.
        let want = format!(
            "slot {slot} finished as rank {slot} of 2: step {step} count {:?} w0 {:?} agree True",
            f64::from(step),
            f64::from(step * (step + 1) / 2)
        );
        assert!(line.ends_with(&want), "want `{want}`:\n{stdout}");
    }
    common::assert_nothing_left(&marker);
}

/// `--slots-per-host 2` (horovodrun's flag): the discovery script prints host names alone, each worth 2 slots. The
/// step starts on `localhost`'s 2, and when the script also names `127.0.0.1` (this machine again: 4 slots, the
/// step's maximum 3) a third worker starts and joins at a commit; every step counted once, the same state everywhere.
/// Without the flag the same script's bare name is refused, naming the line, and the step never starts.
#[test]
fn bare_host_names_from_discovery_get_the_slots_per_host() {
    let marker = marker();
    let steps = 6;
    let dir = project("{ min = 1, max = 3 }", steps, "", &marker);
    let script = discovery_script(dir.path(), "echo localhost\ncat extra 2>/dev/null || true");
    let discover = ["--host-discovery-script", script.to_str().unwrap()];
    let (out, stdout, stderr) = run(
        dir.path(),
        &[&discover[..], &["--slots-per-host", "2"]].concat(),
        &[
            ("ELASTIC_GROW", "0:3:extra:127.0.0.1"),
            ("ELASTIC_UNTIL", "size:3"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("step `train` on 2 worker(s)"), "{stderr}");
    assert!(
        stderr.contains("host discovery found 4 slots for step `train`: started rank 2"),
        "{stdout}\n{stderr}"
    );
    let step = common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (2, 2)]);
    assert!(step >= steps, "{stdout}");
    common::assert_nothing_left(&marker);

    let (out, stdout, stderr) = run(
        dir.path(),
        &[&discover[..], &["--elastic-timeout", "2"]].concat(),
        &[],
    );
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    for want in [
        format!(
            "host discovery script `{}` printed line 1 \"localhost\", which is not `host:slots`; keeping the \
             current hosts",
            script.display()
        ),
        "step `train` did not start: host discovery".to_owned(),
    ] {
        assert!(flat.contains(&want), "want `{want}`:\n{stderr}");
    }
    assert!(!stdout.contains(" starts as rank "), "{stdout}");
    common::assert_nothing_left(&marker);
}

/// `--blacklist-cooldown-range 1 1`: this machine, blacklisted once two of its workers are lost, is out for 1 s
/// instead of the default 60; then host discovery, which still finds 4 slots, starts new workers again, and the step
/// is back to 4 with every step counted once.
#[test]
fn a_blacklisted_host_comes_back_after_the_cooldown_range_given() {
    let marker = marker();
    let dir = project("{ min = 1, max = 4 }", 6, "2:3,3:3", &marker);
    let script = discovery_script(dir.path(), "echo localhost:4");
    let (out, stdout, stderr) = run(
        dir.path(),
        &[
            "--host-discovery-script",
            script.to_str().unwrap(),
            "--blacklist-cooldown-range",
            "1",
            "1",
        ],
        &[("ELASTIC_UNTIL", "size:4")],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    assert!(
        flat.contains("is blacklisted for 1 s: 2 of its workers were lost"),
        "{stderr}"
    );
    // The lost slots 2 and 3 are replaced by new slots 4 and 5 (one may have started between the two losses).
    assert!(
        stderr.contains("host discovery found 4 slots for step `train`: started rank 5"),
        "{stdout}\n{stderr}"
    );
    common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (4, 2), (5, 3)]);
    common::assert_nothing_left(&marker);
}

/// Writes an executable program `name` into `dir` that prints `lines`.
fn program(dir: &Path, name: &str, lines: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\nprintf '{lines}\\n'\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// An elastic step's settings in the file (`workers = { .., discovery, slots_per_host, elastic_timeout }`) take
/// effect in `hvd run`, each flag overriding its setting. `hvd run` runs from the test's directory, not the
/// project's: the file's `discovery = "discover.sh"` is found next to the .hvd file.
#[test]
fn an_elastic_steps_settings_in_the_file_take_effect_and_the_flags_override_them() {
    let marker = marker();
    let dir = project(
        "{ min = 1, max = 3, discovery = \"discover.sh\", slots_per_host = 2, elastic_timeout = 2s }",
        2,
        "",
        &marker,
    );
    // A host name alone: 2 slots by the file's `slots_per_host`.
    program(dir.path(), "discover.sh", "localhost");
    let bad = program(dir.path(), "bad.sh", "not a host line!");
    let bad = bad.to_str().unwrap();
    assert_ne!(std::env::current_dir().unwrap(), dir.path());

    let (out, stdout, stderr) = run(dir.path(), &[], &[]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("step `train` on 2 worker(s)"), "{stderr}");
    common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1)]);
    common::assert_nothing_left(&marker);

    // `--slots-per-host` over `slots_per_host`.
    let (out, stdout, stderr) = run(dir.path(), &["--slots-per-host", "3"], &[]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("step `train` on 3 worker(s)"), "{stderr}");
    common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (2, 2)]);
    common::assert_nothing_left(&marker);

    // `--host-discovery-script` over `discovery`; the file's `elastic_timeout` (2 s, not the default 60) still
    // bounds the wait for slots, and `--elastic-timeout` over it.
    for (args, within) in [
        (&["--host-discovery-script", bad][..], "2"),
        (
            &["--host-discovery-script", bad, "--elastic-timeout", "1"][..],
            "1",
        ),
    ] {
        let (out, stdout, stderr) = run(dir.path(), args, &[]);
        assert!(!out.status.success(), "{args:?}: {stdout}\n{stderr}");
        let want = format!(
            "step `train` did not start: host discovery (`{bad}`) found no 1 slots within {within} s"
        );
        assert!(
            common::flat_stderr(&out).contains(&want),
            "{args:?}: want `{want}`:\n{stderr}"
        );
        assert!(!stdout.contains(" starts as rank "), "{stdout}");
    }
    // A `discovery` program that is not there is refused before anything runs, naming it.
    let missing = project(
        "{ min = 1, max = 2, discovery = \"missing.sh\" }",
        1,
        "",
        &marker,
    );
    let (out, stdout, stderr) = run(missing.path(), &[], &[]);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    // (The path, absolute, may be wrapped anywhere.)
    let flat = common::flat_stderr(&out);
    assert!(
        flat.contains("step `train`: its host discovery program (`workers = { discovery }`)")
            && flat.contains("missing.sh` is not a file"),
        "{stderr}"
    );
    assert!(!stdout.contains(" starts as rank "), "{stdout}");
    common::assert_nothing_left(&marker);
}

/// The file's `cooldown = [1s, 1s]`: as `--blacklist-cooldown-range 1 1` (below), this machine, blacklisted once
/// two of its workers are lost, is out for 1 s instead of the default 60 (an exact cooldown: MIN = MAX leaves its
/// random part no room), and discovery starts new workers again.
#[test]
fn a_cooldown_in_the_file_sets_the_blacklists_range() {
    let marker = marker();
    let dir = project(
        "{ min = 1, max = 4, discovery = \"discover.sh\", cooldown = [1s, 1s] }",
        6,
        "2:3,3:3",
        &marker,
    );
    program(dir.path(), "discover.sh", "localhost:4");
    let (out, stdout, stderr) = run(dir.path(), &[], &[("ELASTIC_UNTIL", "size:4")]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        common::flat_stderr(&out).contains("is blacklisted for 1 s: 2 of its workers were lost"),
        "{stderr}"
    );
    assert!(
        stderr.contains("host discovery found 4 slots for step `train`: started rank 5"),
        "{stdout}\n{stderr}"
    );
    common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (4, 2), (5, 3)]);
    common::assert_nothing_left(&marker);
}

/// The new flags' values are checked before anything runs, each refusal naming the flag.
#[test]
fn slots_per_host_the_cooldown_range_and_the_elastic_timeout_are_checked() {
    let marker = marker();
    let dir = project("{ min = 1, max = 2 }", 1, "", &marker);
    let script = discovery_script(dir.path(), "echo localhost");
    let script = script.to_str().unwrap();
    for (args, want) in [
        (&["--slots-per-host", "2"][..], "--host-discovery-script"),
        (
            &["--host-discovery-script", script, "--slots-per-host", "0"][..],
            "--slots-per-host",
        ),
        (
            &["--blacklist-cooldown-range", "5"][..],
            "--blacklist-cooldown-range",
        ),
        (
            &["--blacklist-cooldown-range", "0", "10"][..],
            "`--blacklist-cooldown-range 0 10`: each bound is a number of seconds from 1 to 3600",
        ),
        (
            &["--blacklist-cooldown-range", "30", "10"][..],
            "`--blacklist-cooldown-range 30 10`: the first number (the shortest cooldown) is above the second",
        ),
        // The workers take at most a day (`HVD_ELASTIC_TIMEOUT`), and `1e19` s once overflowed the supervisor's
        // deadline (a panic); under a second a round waits for nobody.
        (
            &["--elastic-timeout", "1e19"][..],
            "`--elastic-timeout 10000000000000000000` is out of range: give from 1 to 86400 seconds",
        ),
        (
            &["--elastic-timeout", "86401"][..],
            "`--elastic-timeout 86401` is out of range: give from 1 to 86400 seconds",
        ),
        (
            &["--elastic-timeout", "0.5"][..],
            "`--elastic-timeout 0.5` is out of range: give from 1 to 86400 seconds",
        ),
        (
            &["--elastic-timeout", "NaN"][..],
            "`--elastic-timeout NaN` is out of range",
        ),
    ] {
        let (out, stdout, stderr) = run(dir.path(), args, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stdout}\n{stderr}");
        assert!(
            common::flat_stderr(&out).contains(want),
            "{args:?}: want `{want}`:\n{stderr}"
        );
        assert!(!stdout.contains(" starts as rank "), "{stdout}");
    }
    common::assert_nothing_left(&marker);
}

#[test]
fn the_plan_shows_an_elastic_step_and_whole_run_engines_give_it_a_launcher() {
    let marker = marker();
    let dir = project("{ min = 2, max = 4 }", 1, "", &marker);
    let (out, stdout, stderr) = run(dir.path(), &["--dry-run"], &[]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("workers: 4 (local")
            && stdout.contains("elastic: goes on while at least 2 of its workers are alive"),
        "{stdout}"
    );
    // sbatch outside an allocation runs the step under a launcher of its own in the step's job, in an allocation
    // that survives a lost node; a step it needs is a job of its own, which that launcher does not run again.
    // `hvd run --no-build --engine slurm --dry-run ARGS` from outside an allocation.
    let slurm_dry_run = |args: &[&std::ffi::OsStr]| {
        common::hvd_run_command(dir.path())
            .args(["--no-build", "--engine", "slurm", "--dry-run"])
            .args(args)
            .env("NO_COLOR", "1")
            .env_remove("SLURM_JOB_ID")
            .output()
            .unwrap()
    };
    let out = slurm_dry_run(&["--elastic-timeout".as_ref(), "7".as_ref()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("#SBATCH --no-kill\n"), "{stdout}");
    let launcher = stdout
        .lines()
        .find(|l| l.starts_with("exec "))
        .unwrap_or_else(|| panic!("no launcher line: {stdout}"));
    for part in [
        " run ",
        "train.hvd --step=train --no-deps --force --engine=slurm --no-build ",
        " --elastic-timeout=7",
    ] {
        assert!(launcher.contains(part), "want `{part}`: {launcher}");
    }
    // With host discovery it is refused (the job's nodes are its hosts).
    let discovery = dir.path().join("discover.sh");
    std::fs::write(&discovery, "#!/bin/sh\necho localhost:2\n").unwrap();
    let out = slurm_dry_run(&["--host-discovery-script".as_ref(), discovery.as_os_str()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out).1);
    assert!(
        common::flat_stderr(&out).contains(
            "step `train` is elastic with host discovery, which the slurm engine does not run"
        ),
        "{}",
        text(&out).1
    );
    // Kubernetes runs the step under a launcher pod of its own (the flags that shape it on its command line) and
    // worker pods that wait for its ranks; host discovery is refused (the worker pods are the hosts).
    common::append_to_project(dir.path(), "cluster {\n  image = \"img\"\n}");
    let k8s_dry_run = |args: &[&std::ffi::OsStr]| {
        common::hvd_run_command(dir.path())
            .args(["--no-build", "--engine", "kubernetes", "--dry-run"])
            .args(args)
            .env("NO_COLOR", "1")
            .output()
            .unwrap()
    };
    let out = k8s_dry_run(&["--elastic-timeout".as_ref(), "7".as_ref(), "-vv".as_ref()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let jobset: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(".hvd/k8s/t.jobset.json")).unwrap(),
    )
    .unwrap();
    let jobs = jobset["spec"]["replicatedJobs"].as_array().unwrap();
    let names: Vec<&str> = jobs.iter().map(|j| j["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["train", "train-workers"], "{stdout}");
    let command: Vec<&str> =
        jobs[0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
    for part in [
        "--step=train",
        "--no-deps",
        "--engine=kubernetes",
        "--no-build",
        "--elastic-timeout=7",
    ] {
        assert!(command.contains(&part), "want `{part}`: {command:?}");
    }
    // `-vv` reaches the launcher pod's `hvd run`, whose log is the one to read.
    assert_eq!(
        command.iter().filter(|a| **a == "-v").count(),
        2,
        "{command:?}"
    );
    assert_eq!(jobs[1]["template"]["spec"]["parallelism"], 4);
    for kind in ["configmap", "serviceaccount", "role", "rolebinding"] {
        assert!(
            stdout.contains(&format!("/.hvd/k8s/t.{kind}.json\n")),
            "{kind}: {stdout}"
        );
    }
    let out = k8s_dry_run(&["--host-discovery-script".as_ref(), discovery.as_os_str()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out).1);
    assert!(
        common::flat_stderr(&out).contains(
            "step `train` is elastic with host discovery, which the kubernetes engine does not run"
        ),
        "{}",
        text(&out).1
    );
}

/// A live worker that does not rejoin (stuck outside any collective) is left out of the next round after
/// `--elastic-timeout`, stopped, and counted as lost; the others go on.
#[test]
fn a_worker_that_does_not_rejoin_in_time_is_left_out_and_stopped() {
    let marker = marker();
    let steps = 16;
    let dir = project("{ min = 2, max = 4 }", steps, "2:6", &marker);
    // Until slot 2's replacement (4) is in: it may start too late for the round that leaves out slot 3, and join at
    // a commit after it; slot 3, lost too, gets none (the machine is blacklisted after 2 lost workers).
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--elastic-timeout", "1"],
        &[
            ("ELASTIC_STALL", "3"),
            ("ELASTIC_UNTIL", "size:3"),
            // The round window's path, not the heartbeat's.
            ("HVD_HEARTBEAT_TIMEOUT", "86400"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 3 of step `train` did not rejoin within 1 s; stopping it (elastic)"),
        "{stdout}\n{stderr}"
    );
    let step = common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (4, 2)]);
    assert!(step >= steps, "{stdout}");
    assert!(!stdout.contains("slot 5 "), "{stdout}");
    common::assert_nothing_left(&marker);
}

/// A worker that hangs (alive, outside any collective) with the default relation of the timeouts (the round window
/// above the collective timeout): the survivors stop on the stall, wait for the round past their own collective
/// timeout, and go on without it; it is stopped as one that did not rejoin.
#[test]
fn a_hung_worker_is_dropped_when_the_round_window_exceeds_the_collective_timeout() {
    let marker = marker();
    let steps = 8;
    let dir = project("{ min = 2, max = 3 }", steps, "", &marker);
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--elastic-timeout", "6"],
        &[
            ("HVD_COLLECTIVE_TIMEOUT", "1"),
            ("HVD_STALL_CHECK_TIME", "1"),
            ("HVD_STALL_SHUTDOWN_TIME", "1"),
            ("ELASTIC_HANG", "2:4"),
            ("ELASTIC_UNTIL", "size:3"),
            // The round window's path, not the heartbeat's.
            ("HVD_HEARTBEAT_TIMEOUT", "86400"),
        ],
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 2 of step `train` did not rejoin within 6 s; stopping it (elastic)"),
        "{stdout}\n{stderr}"
    );
    // Its replacement (slot 3) joins at a commit.
    let step = common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (3, 2)]);
    assert!(step >= steps, "{stdout}");
    common::assert_nothing_left(&marker);
}

/// A failure that repeats after every re-form (here raised by every worker at the same step) ends the workers after
/// `HVD_ELASTIC_RESET_LIMIT` re-forms in a row without a commit, instead of re-forming forever.
#[test]
fn re_forms_without_a_commit_stop_at_the_reset_limit() {
    let marker = marker();
    let dir = project("{ min = 1, max = 2 }", 4, "", &marker);
    let (out, stdout, stderr) = run(
        dir.path(),
        &[],
        &[("ELASTIC_RAISE", "2"), ("HVD_ELASTIC_RESET_LIMIT", "2")],
    );
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let both = format!("{stdout}\n{stderr}");
    assert!(
        both.contains("2 re-forms in a row without a commit() (HVD_ELASTIC_RESET_LIMIT=2)"),
        "{both}"
    );
    assert!(both.contains("deterministic failure at step 2"), "{both}");
    assert_eq!(both.matches("slot 0 re-formed").count(), 2, "{both}");
    common::assert_nothing_left(&marker);
}

/// `--host-discovery-script` needs an elastic step and an existing program; both are refused naming the flag.
#[test]
fn host_discovery_needs_an_elastic_step_and_an_existing_script() {
    let marker = marker();
    let dir = project("2", 1, "", &marker);
    let script = discovery_script(dir.path(), "echo localhost:2");
    let (out, stdout, stderr) = run(
        dir.path(),
        &["--host-discovery-script", script.to_str().unwrap()],
        &[],
    );
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let flat = common::flat_stderr(&out);
    assert!(
        flat.contains("needs an elastic step") && flat.contains("no step of this run is elastic"),
        "{stderr}"
    );
    let (out, stdout, stderr) = run(
        dir.path(),
        &[
            "--min-workers",
            "1",
            "--host-discovery-script",
            "no-such.sh",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("`--host-discovery-script no-such.sh`: no such file"),
        "{stderr}"
    );
    common::assert_nothing_left(&marker);
}

/// `hvd run --no-build --grace 2 <args>` in `dir` with `env`, like [`run`], but failed by the test after `deadline`
/// (the run is stopped first) instead of waiting for it without end.
fn run_within(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    deadline: std::time::Duration,
) -> (Output, String, String) {
    let mut child = common::hvd_run_command(dir)
        .args(["--no-build", "--grace", "2"])
        .args(args)
        .env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let end = std::time::Instant::now() + deadline;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > end {
            // SIGTERM: `hvd run` stops its workers (a SIGKILL would leave them).
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let out = child.wait_with_output().unwrap();
            let (stdout, stderr) = text(&out);
            panic!("`hvd run` did not end within {deadline:?}:\n{stdout}\n{stderr}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    (out, stdout, stderr)
}

/// A worker that freezes (it stops itself, SIGSTOP: alive to the OS, answering nobody, its process never ends) is
/// found by its silence: with the collective timeout and the round window an hour, `hvd run` finds it once it has
/// sent no heartbeat for `HVD_HEARTBEAT_TIMEOUT`, says so, stops it and counts it lost; the survivors' collective in
/// flight fails, they re-form without it, its replacement joins, and the training finishes with every committed step
/// counted once. Without heartbeats the survivors would wait an hour: the test's deadline fails the run first.
#[test]
fn a_frozen_worker_is_found_by_its_silence_and_the_others_go_on() {
    let marker = marker();
    let steps = 16;
    let dir = project_with_signal("{ min = 2, max = 4 }", steps, "2:6", 19, &marker);
    let (out, stdout, stderr) = run_within(
        dir.path(),
        &["--elastic-timeout", "3600"],
        &[
            ("HVD_COLLECTIVE_TIMEOUT", "3600"),
            ("HVD_HEARTBEAT_TIMEOUT", "10"),
            ("ELASTIC_UNTIL", "size:4"),
        ],
        std::time::Duration::from_secs(300),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let said = stderr.lines().any(|l| {
        l.contains("rank 2 of step `train` on ")
            && l.contains(" sent no heartbeat for ")
            && l.contains("(HVD_HEARTBEAT_TIMEOUT): lost; stopping it (elastic)")
    });
    assert!(said, "{stdout}\n{stderr}");
    // Only the frozen worker was found silent (a healthy one judged lost on a loaded machine shows here).
    assert_eq!(
        stderr.matches(" sent no heartbeat for ").count(),
        1,
        "{stdout}\n{stderr}"
    );
    assert!(
        !stderr.contains("did not rejoin within"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("started rank 4 of step `train` on "),
        "{stdout}\n{stderr}"
    );
    let step =
        common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (3, 2), (4, 3)]);
    assert!(step >= steps, "{stdout}");
    assert!(!stdout.contains("slot 2 finished"), "{stdout}");
    common::assert_nothing_left(&marker);
}

/// Every worker of an elastic step on this machine freezes at once (both SIGSTOP themselves at step 6): they reach
/// the launcher over loopback, so nothing can have cut it off from them, and each is found silent after
/// `HVD_HEARTBEAT_TIMEOUT`, stopped and counted lost; their host is blacklisted for losing both, so no replacement
/// starts and the step fails below its minimum, saying so (before, `hvd run` took the common silence for its own
/// network and waited for ever: the collective timeout an hour, and no round pending).
#[test]
fn workers_on_this_machine_that_all_freeze_are_found_not_waited_for() {
    let marker = marker();
    let dir = project_with_signal("{ min = 2, max = 2 }", 16, "0:6,1:6", 19, &marker);
    let (out, stdout, stderr) = run_within(
        dir.path(),
        &["--elastic-timeout", "5"],
        &[
            ("HVD_COLLECTIVE_TIMEOUT", "3600"),
            ("HVD_HEARTBEAT_TIMEOUT", "3"),
        ],
        std::time::Duration::from_secs(120),
    );
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    // In the failure's summary (framed: its lines wrap), whether both were found silent in one pass of the launcher
    // or one after the other (on a loaded machine: the first loss waits for a replacement, the second finds the
    // host blacklisted).
    assert!(
        common::flat_stderr(&out).contains(
            "step `train` failed: 0 of its workers are left, fewer than its minimum of 2 (elastic)"
        ),
        "{stdout}\n{stderr}"
    );
    assert_eq!(
        stderr.matches(" sent no heartbeat for ").count(),
        2,
        "{stdout}\n{stderr}"
    );
    assert!(!stderr.contains("seems cut off"), "{stdout}\n{stderr}");
    common::assert_nothing_left(&marker);
}
