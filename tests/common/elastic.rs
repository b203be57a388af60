//! The elastic training script the engines' elastic tests run (tests/engine_ssh_elastic.rs, tests/engine_spark.rs),
//! and what its workers print.

/// The training script: `ELASTIC_STEPS` steps, each an allreduce of the step's gradient and of a participation count,
/// committed after each step. With `ELASTIC_HOLD` (`step`), slot 0 waits at that step until `release` exists in the
/// project directory. With `ELASTIC_PAUSE` (`step`), slot 0 writes `paused` into the project directory when it
/// begins that step and waits there until `go` exists (the test loses a host meanwhile). With `ELASTIC_GROW`
/// (`step`), slot 0 moves `grown` to `slots` when it begins that step. With `ELASTIC_UNTIL` (`n`), training goes on
/// past `ELASTIC_STEPS` until a round has `n` members (a negative `n`: at most `-n`), or until a worker has waited
/// `ELASTIC_UNTIL_WAIT` seconds (default 90) from its start: a time, not a count of steps, so that a replacement
/// started slowly on a loaded machine still finds the training going (400 steps, the old bound, were about 8 s). `ELASTIC_KILL`
/// (`slot:step`, several separated by commas) names a worker that SIGKILLs itself when it begins that step,
/// `ELASTIC_TERM` (the same) one that SIGTERMs itself (preempted); with `ELASTIC_TERM_DEAF` it then answers later
/// SIGTERMs with a handler of its own that does nothing (a stop's SIGTERM that reaches it only after its commit). Every worker prints its start and re-forms and,
/// at the end, what it finished with and whether every rank of the final round agrees.
pub const TRAIN: &str = r#"
import os
import signal
import time
import numpy as np
import hvd

steps = int(os.environ["ELASTIC_STEPS"])
slot = int(os.environ["HVD_RANK"])
pause = int(os.environ.get("ELASTIC_PAUSE", "-1"))
hold = int(os.environ.get("ELASTIC_HOLD", "-1"))
grow = os.environ.get("ELASTIC_GROW", "")
kill = os.environ.get("ELASTIC_KILL", "")
term = os.environ.get("ELASTIC_TERM", "")
until = int(os.environ.get("ELASTIC_UNTIL", "0"))
# How long this worker keeps training for a round of `until` members before it gives up on one (agreed by every rank
# through the same allreduce): long enough for a replacement that a loaded machine starts slowly (a Spark job, a pod).
give_up = time.monotonic() + float(os.environ.get("ELASTIC_UNTIL_WAIT", "90"))
paused = []

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
print("slot %d starts as rank %d of %d on %s" % (slot, hvd.rank(), hvd.size(), os.environ["HVD_HOSTNAME"]), flush=True)
state = hvd.elastic.ObjectState(step=0, count=0.0, w=np.zeros(4))
state.register_reset_callbacks(
    [lambda: print("slot %d re-formed as rank %d of %d" % (slot, hvd.rank(), hvd.size()), flush=True)])


def big_enough():
    if not until:
        return True
    time.sleep(0.02)
    # A negative `until`: at most that many members.
    mine = hvd.size() >= until if until > 0 else hvd.size() <= -until
    done = mine or time.monotonic() > give_up
    return hvd.allreduce(np.array([1.0 if done else 0.0]), op=hvd.Max, name="until")[0] > 0


@hvd.elastic.run
def train(state):
    while state.step < steps or not big_enough():
        if slot == 0 and state.step == hold:
            while not os.path.exists("release"):
                time.sleep(0.02)
        if slot == 0 and state.step == pause and not paused:
            paused.append(True)
            open("paused", "w").close()
            while not os.path.exists("go"):
                time.sleep(0.02)
        if "%d:%d" % (slot, state.step) in kill.split(","):
            os.kill(os.getpid(), 9)
        if "%d:%d" % (slot, state.step) in term.split(","):
            # Preempted (spot reclaim, eviction): hvd.elastic finishes this step, commits, hands over and leaves.
            os.kill(os.getpid(), 15)
            if os.environ.get("ELASTIC_TERM_DEAF"):
                signal.signal(signal.SIGTERM, lambda *_: None)
        if slot == 0 and grow and int(grow) == state.step and os.path.exists("grown"):
            os.replace("grown", "slots")
        g = hvd.allreduce(np.full(4, state.step + 1.0), op=hvd.Average, name="grad")
        c = hvd.allreduce(np.array([1.0]), op=hvd.Sum, name="count")
        state.w = state.w + g
        # 1 when every member of the round took part in this step.
        state.count += float(c[0]) / hvd.size()
        state.step += 1
        state.commit()


train(state)
final = hvd.allgather_object((state.step, state.count, state.w.tolist()))
print("slot %d finished as rank %d of %d: step %d count %r w0 %r agree %s" % (
    slot, hvd.rank(), hvd.size(), state.step, state.count, float(state.w[0]), all(f == final[0] for f in final)),
    flush=True)
hvd.shutdown()
"#;

/// The `child-termed.N` files in `dir`: the children of ranks (`ELASTIC_CHILD`) that got a SIGTERM.
pub fn children_termed(dir: &std::path::Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("child-termed"))
        .map(|e| e.file_name())
        .collect()
}

/// A project whose step `train` runs the training script on `workers` (as written in the file) with `env` (more
/// `NAME = "VALUE"` entries).
pub fn project(workers: &str, steps: u32, env: &str) -> tempfile::TempDir {
    let env = format!(", ELASTIC_STEPS = \"{steps}\"{env}");
    super::train_project(workers, &env, "", TRAIN)
}

/// The part after `finished as rank R of N: ` of each slot's last line, by slot.
pub fn finished(stdout: &str, slots: &[u32], size: usize) -> Vec<String> {
    slots
        .iter()
        .map(|slot| {
            let line = stdout
                .lines()
                .find(|l| l.contains(&format!("] slot {slot} finished as rank ")))
                .unwrap_or_else(|| panic!("slot {slot} did not finish:\n{stdout}"));
            let (head, tail) = line.split_once(": step ").unwrap();
            assert!(head.ends_with(&format!(" of {size}")), "{line}");
            format!("step {tail}")
        })
        .collect()
}

/// What a finished slot says after `step S` when every step of the run was counted once on every rank.
pub fn counted_once(step: u32) -> String {
    format!(
        "step {step} count {:?} w0 {:?} agree True",
        f64::from(step),
        f64::from(step * (step + 1) / 2)
    )
}
