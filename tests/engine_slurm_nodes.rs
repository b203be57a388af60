//! The slurm engine on two nodes: a test Slurm whose slurmds run in two network namespaces (tests/common/slurm.rs),
//! each with its own host name, and the controller and `hvd run` in a third. An elastic step across both nodes loses a
//! rank, then a whole node; the batch chain substitutes the env into node-local stores from a binary cache. Skipped,
//! saying why, where Slurm, iproute2 or root is missing.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

mod common;

use common::slurm::{
    NODES, Slurm, assert_finished_together, assert_nothing_left_in_slurm, assert_trained_together,
    elastic_project,
};
use common::text;

/// `salloc` of two tasks on each node.
const TWO_BY_TWO: &[&str] = &["--nodes=2", "--ntasks-per-node=2"];

/// An elastic step of 4 workers on both nodes (`salloc --no-kill`, two tasks on each), `hvd run` on the first node,
/// once all four have started; its stdout is read on a thread meanwhile.
struct FourRunning {
    child: std::process::Child,
    reader: std::thread::JoinHandle<String>,
}

impl FourRunning {
    /// Starts the step in `dir` and waits (120 s at most, else panics with the output so far) for four workers to
    /// start.
    fn start(slurm: &Slurm, dir: &Path) -> Self {
        let salloc = ["--no-kill", TWO_BY_TWO[0], TWO_BY_TWO[1]];
        Self::watch(slurm.spawn_elastic_with(dir, &salloc, NODES[0]), slurm)
    }

    /// [`FourRunning::start`] of `child`, an `hvd run` whose four workers are on their way.
    fn watch(mut child: std::process::Child, slurm: &Slurm) -> Self {
        let (started_tx, started) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut all = String::new();
            let mut seen = 0;
            for line in
                std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok)
            {
                if line.contains(" starts as rank ") {
                    seen += 1;
                    if seen == 4 {
                        let _ = started_tx.send(());
                    }
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        if started.recv_timeout(Duration::from_secs(120)).is_err() {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the four workers never started:\n{}\n{}\n{}",
                reader.join().unwrap(),
                text(&out).1,
                slurm.logs()
            );
        }
        FourRunning { child, reader }
    }

    /// [`FourRunning::finish`], but fails the test when `hvd run` has not ended within `deadline` (stopped first:
    /// SIGTERM, then the second node's processes killed, which ends whatever waits for them).
    fn finish_within(mut self, deadline: Duration, slurm: &mut Slurm) -> Output {
        let end = std::time::Instant::now() + deadline;
        while self.child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > end {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &self.child.id().to_string()])
                    .status();
                slurm.lose_node(1);
                let out = self.finish();
                let (stdout, stderr) = text(&out);
                panic!(
                    "`hvd run` did not end within {deadline:?}:\n{stdout}\n{stderr}\n{}",
                    slurm.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.finish()
    }

    /// Waits for `hvd run` to end: its output, stdout being all the lines the reader saw.
    fn finish(self) -> Output {
        let mut out = self.child.wait_with_output().unwrap();
        out.stdout = self.reader.join().unwrap().into_bytes();
        out
    }
}

/// Asserts that slot `slot` started on node `node` (its lines carry the node's host name).
fn assert_started_on(stdout: &str, slot: u32, node: &str) {
    assert!(
        stdout.contains(&format!(
            "[train {node}:{slot}] slot {slot} starts as rank {slot} of 4"
        )),
        "slot {slot} did not start on {node}:\n{stdout}"
    );
}

/// The second node is lost whole ([`Slurm::lose_node`]) and Slurm is told it is down (`scontrol update state=down`,
/// what a health check or `SlurmdTimeout` does).
fn lose_the_second_node(slurm: &mut Slurm) {
    slurm.lose_node(1);
    let down = slurm
        .command("scontrol")
        .args([
            "update",
            &format!("nodename={}", NODES[1]),
            "state=down",
            "reason=lost",
        ])
        .output()
        .unwrap();
    assert!(down.status.success(), "{}", text(&down).1);
}

/// Asserts that nothing but the slurmds runs on the nodes (waiting up to 10 s for exiting processes).
fn assert_nodes_clean(slurm: &Slurm, out: &Output) {
    let left = common::wait_until_empty(Duration::from_secs(10), Duration::from_millis(50), || {
        slurm.leftovers()
    });
    assert!(
        left.is_empty(),
        "left on the nodes: {left:#?}\n{}",
        text(out).1
    );
}

/// 4 elastic workers, 2 on each node (minimum 2): rank 2, on the second node, SIGKILLs itself at step 5. Its job step
/// ends alone; the three survivors (on both nodes) re-form, the lost rank is replaced by a new job step on the node
/// with the free task (the second), which joins; the four finish with every committed step counted once and the same
/// weights, and nothing is left: no job step, no job, no process on either node.
#[test]
fn an_elastic_step_on_two_slurm_nodes_replaces_a_rank_lost_on_the_second() {
    let Some(slurm) = Slurm::start_two_nodes("sr", [&[], &[]]) else {
        return;
    };
    let marker = common::unique_marker("slurm-nodes-rank");
    let steps = 16;
    let dir = elastic_project(
        steps,
        ", ELASTIC_KILL = \"2:5\", ELASTIC_UNTIL = \"size:4\"",
        &marker,
    );
    let out = slurm
        .spawn_elastic_with(dir.path(), TWO_BY_TWO, "")
        .wait_with_output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    for (slot, node) in [(0, NODES[0]), (1, NODES[0]), (2, NODES[1]), (3, NODES[1])] {
        assert_started_on(&stdout, slot, node);
    }
    assert!(
        stderr
            .contains("rank 2 of step `train` was lost (exit code 137); 3 of its 4 workers go on"),
        "{}",
        logs()
    );
    assert!(
        stderr.contains(&format!(
            "started rank 4 of step `train` on {} in place of a lost worker",
            NODES[1]
        )),
        "{}",
        logs()
    );
    assert!(
        stdout.contains(&format!(
            "[train {}:4] slot 4 starts as rank 3 of 4",
            NODES[1]
        )),
        "{}",
        logs()
    );
    // Slot 3 (on the second node) takes the lost rank's place.
    assert!(
        stdout.contains("slot 3 re-formed as rank 2 of 3")
            || stdout.contains("slot 3 re-formed as rank 2 of 4"),
        "{}",
        logs()
    );
    assert!(!stdout.contains("slot 5 "), "{stdout}");
    let members: &[(u32, u32)] = &[(0, 0), (1, 1), (3, 2), (4, 3)];
    assert_finished_together(&slurm, dir.path(), &out, (members, steps), &marker);
    assert_nodes_clean(&slurm, &out);
}

/// 4 elastic workers, 2 on each node (minimum 2), in an allocation that survives a node failure (`salloc
/// --no-kill`): once all four train, the second node is lost (its slurmd, the steps' slurmstepds and the ranks all
/// SIGKILLed at once) and Slurm is told it is down (`scontrol update state=down`, what a health check or
/// `SlurmdTimeout` does). The two survivors on the first node re-form as a job of 2 and train on until they have
/// (`ELASTIC_UNTIL=atmost:2`: the loss cannot come after the end), finishing with every committed step counted once
/// and the same weights. The lost ranks' sruns end ("Node failure"; their job steps stay listed until the allocation
/// ends, and only theirs); then nothing is queued and nothing but the first node's slurmd is left.
///
/// Slurm 22.05's srun exits 0 after "Node failure": hvd still names ranks 2 and 3 as lost (with srun's reason),
/// because their wrapper never reported their exit status, and blacklists the node after its two losses.
#[test]
fn an_elastic_step_on_two_slurm_nodes_goes_on_when_the_second_node_is_lost() {
    let Some(mut slurm) = Slurm::start_two_nodes("sn", [&[], &[]]) else {
        return;
    };
    let marker = common::unique_marker("slurm-nodes-lost");
    let steps = 12;
    let dir = elastic_project(steps, ", ELASTIC_UNTIL = \"atmost:2\"", &marker);
    let running = FourRunning::start(&slurm, dir.path());
    lose_the_second_node(&mut slurm);
    let out = running.finish();
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert_started_on(&stdout, 2, NODES[1]);
    assert!(
        stderr.contains(&format!("srun: error: Node failure on {}", NODES[1])),
        "{}",
        logs()
    );
    for slot in [0, 1] {
        assert!(
            stdout.contains(&format!("slot {slot} re-formed as rank {slot} of 2")),
            "{}",
            logs()
        );
    }
    assert!(!stdout.contains("slot 3 finished"), "{}", logs());
    // srun exits 0 after "Node failure": the launcher takes the ranks for lost, not finished, because their
    // wrapper never reported their exit status.
    for rank in [2, 3] {
        assert!(
            stderr.contains(&format!(
                "rank {rank} of step `train` on node {} is lost: its srun exited 0, but the rank's command never \
                 reported its exit status (it said `srun: error: Node failure on {}`)",
                NODES[1], NODES[1]
            )),
            "{}",
            logs()
        );
    }
    // Two losses on the node: no new worker starts there for a while.
    assert!(
        stderr.contains(&format!("host {} is blacklisted for ", NODES[1])),
        "{}",
        logs()
    );
    // The ranks that finished reported it, and the report is in neither the lines nor the ranks' log files.
    assert!(
        !format!("{stdout}{stderr}").contains("hvd-rank-status"),
        "{}",
        logs()
    );
    let runs = dir.path().join(".hvd/runs");
    let run = std::fs::read_dir(&runs)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    for rank in 0..4 {
        let log = std::fs::read_to_string(run.join(format!("train/rank.{rank}/stderr"))).unwrap();
        assert!(!log.contains("hvd-rank-status"), "rank {rank}: {log}");
    }
    let members: &[(u32, u32)] = &[(0, 0), (1, 1)];
    assert_trained_together(&out, (members, steps));
    // The lost ranks' job steps may stay listed while the allocation lives (a DOWN node reports nothing; seen
    // here every time), but only theirs: every step on the first node has ended.
    let all = std::fs::read_to_string(dir.path().join("all-steps.txt")).unwrap();
    let lost: Vec<String> = all
        .lines()
        .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
        .collect();
    let want = [
        format!("train.2 {}", NODES[1]),
        format!("train.3 {}", NODES[1]),
    ];
    assert!(lost.iter().all(|l| want.contains(l)), "{all}");
    assert_nothing_left_in_slurm(&slurm, dir.path(), &marker);
    assert_nodes_clean(&slurm, &out);
}

/// The lost node of the test above under the slurm engine outside an allocation: `hvd run --engine slurm` submits the
/// elastic step as a batch job of 4 tasks on the two nodes, which runs the step's own launcher on the first node in
/// an allocation that survives a lost node (`#SBATCH --no-kill`; without it Slurm revokes the job when the node goes
/// down). Once all four train the second node is lost and marked down; the two survivors re-form and finish, the
/// job completes, and nothing is left queued or running on the nodes.
#[test]
fn an_elastic_batch_job_goes_on_when_its_second_node_is_lost() {
    let Some(mut slurm) = Slurm::start_two_nodes("sj", [&[], &[]]) else {
        return;
    };
    let marker = common::unique_marker("slurm-batch-lost");
    let steps = 12;
    let dir = elastic_project(steps, ", ELASTIC_UNTIL = \"atmost:2\"", &marker);
    common::append_to_project(
        dir.path(),
        "cluster {\n  partition = \"debug\"\n  settings = { nodes = \"2\" }\n}",
    );
    let running = FourRunning::watch(slurm.spawn_submit(dir.path()), &slurm);
    lose_the_second_node(&mut slurm);
    let out = running.finish_within(Duration::from_secs(120), &mut slurm);
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert_started_on(&stdout, 2, NODES[1]);
    for slot in [0, 1] {
        assert!(
            stdout.contains(&format!("slot {slot} re-formed as rank {slot} of 2")),
            "{}",
            logs()
        );
    }
    let members: &[(u32, u32)] = &[(0, 0), (1, 1)];
    assert_trained_together(&out, (members, steps));
    common::assert_nothing_left(&marker);
    slurm.assert_queue_empties();
    assert_nodes_clean(&slurm, &out);
}

/// The second node lost as above, but Slurm never told (no `scontrol update state=down`, and the test ends before
/// `SlurmdTimeout`): the lost ranks' sruns wait on, so the survivors' next round forms without them only at
/// `elastic_timeout` (5 s here), when hvd stops them (SIGKILL after the grace). The heartbeat timeout is a day here:
/// the killed ranks' silence would otherwise find them too, and this test is about the round window. The survivors then train to the end;
/// the stopped ranks ending after that is not a loss below the minimum (before, it failed the step: "0 of its
/// workers are left, fewer than its minimum of 2").
#[test]
fn an_elastic_step_goes_on_when_a_lost_node_is_never_marked_down() {
    let Some(mut slurm) = Slurm::start_two_nodes("sd", [&[], &[]]) else {
        return;
    };
    let marker = common::unique_marker("slurm-nodes-not-down");
    let steps = 12;
    let dir = common::train_project(
        "{ min = 2, max = 4, elastic_timeout = 5s }",
        &format!(
            ", ELASTIC_STEPS = \"{steps}\", HVD_TEST_MARKER = \"{marker}\", ELASTIC_UNTIL = \"atmost:2\", \
             HVD_HEARTBEAT_TIMEOUT = \"86400\""
        ),
        "",
        common::slurm::elastic_train_py(),
    );
    let running = FourRunning::start(&slurm, dir.path());
    slurm.lose_node(1);
    let out = running.finish();
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    for rank in [2, 3] {
        assert!(
            stderr.contains(&format!(
                "rank {rank} of step `train` did not rejoin within 5 s; stopping it (elastic)"
            )),
            "{}",
            logs()
        );
    }
    assert!(!stderr.contains("fewer than its minimum"), "{}", logs());
    let members: &[(u32, u32)] = &[(0, 0), (1, 1)];
    assert_trained_together(&out, (members, steps));
}

/// The second node freezes (every process there stopped: its slurmd, the steps' slurmstepd, the ranks; Slurm is not
/// told, and the ranks' sruns wait on): with the collective timeout and the round window an hour, the frozen ranks'
/// silence (no heartbeat for `HVD_HEARTBEAT_TIMEOUT`, 10 s here) makes hvd stop their sruns and count them lost; the
/// survivors on the first node learn it from their heartbeat's answer, fail their collective in flight (the frozen
/// peers' connections stay up), re-form as 2 and train to the end. Without heartbeats they would wait an hour: the
/// test's deadline fails the run first.
#[test]
fn an_elastic_step_goes_on_when_a_node_freezes() {
    let Some(mut slurm) = Slurm::start_two_nodes("sz", [&[], &[]]) else {
        return;
    };
    let marker = common::unique_marker("slurm-nodes-frozen");
    let steps = 12;
    let dir = common::train_project(
        "{ min = 2, max = 4, elastic_timeout = 3600s }",
        &format!(
            ", ELASTIC_STEPS = \"{steps}\", HVD_TEST_MARKER = \"{marker}\", ELASTIC_UNTIL = \"atmost:2\", \
             HVD_COLLECTIVE_TIMEOUT = \"3600\", HVD_HEARTBEAT_TIMEOUT = \"10\""
        ),
        "",
        common::slurm::elastic_train_py(),
    );
    let running = FourRunning::start(&slurm, dir.path());
    slurm.freeze_node(1);
    let out = running.finish_within(Duration::from_secs(300), &mut slurm);
    // What is left frozen there goes.
    slurm.lose_node(1);
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    for rank in [2, 3] {
        assert!(
            stderr.contains(&format!(
                "rank {rank} of step `train` on {} sent no heartbeat for ",
                NODES[1]
            )),
            "{}",
            logs()
        );
    }
    // Only the frozen node's ranks were found silent.
    assert_eq!(
        stderr.matches(" sent no heartbeat for ").count(),
        2,
        "{}",
        logs()
    );
    assert!(!stderr.contains("did not rejoin within"), "{}", logs());
    assert!(!stderr.contains("fewer than its minimum"), "{}", logs());
    let members: &[(u32, u32)] = &[(0, 0), (1, 1)];
    assert_trained_together(&out, (members, steps));
}

/// Every rank on both nodes freezes (SIGSTOP) while the nodes stay up: every worker goes quiet at once, which the
/// launcher alone cannot tell from its own network failing, so it runs `srun --nodelist=NODE --overlap true`; a node
/// answers, so the launcher is not cut off and each rank is judged on its own silence, its srun stopped, and the step
/// fails below its minimum, saying so, leaving nothing on the nodes. Before, `hvd run` took the common silence for a
/// cut-off and waited for ever (the collective timeout an hour): the test's deadline failed it.
#[test]
fn an_elastic_step_whose_ranks_all_freeze_is_found_through_srun() {
    let Some(mut slurm) = Slurm::start_two_nodes("sh", [&[], &[]]) else {
        return;
    };
    let marker = common::unique_marker("slurm-nodes-all-frozen");
    let dir = common::train_project(
        "{ min = 2, max = 4, elastic_timeout = 5s }",
        &format!(
            ", ELASTIC_STEPS = \"100000\", ELASTIC_STEP_SLEEP = \"0.05\", HVD_TEST_MARKER = \"{marker}\", \
             HVD_COLLECTIVE_TIMEOUT = \"3600\", HVD_HEARTBEAT_TIMEOUT = \"4\""
        ),
        "",
        common::slurm::elastic_train_py(),
    );
    let running = FourRunning::start(&slurm, dir.path());
    let ranks: Vec<u32> = slurm.namespaces[1..]
        .iter()
        .flat_map(|ns| common::nshosts::rank_pids(ns, None))
        .collect();
    assert!(!ranks.is_empty(), "no rank processes on the nodes");
    common::nshosts::signal_all(&ranks, 19);
    let out = running.finish_within(Duration::from_secs(180), &mut slurm);
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert!(!out.status.success(), "{}", logs());
    assert!(
        stderr.contains("0 of its workers are left, fewer than its minimum of 2"),
        "{}",
        logs()
    );
    assert!(stderr.contains("the launcher reached host "), "{}", logs());
    assert!(!stderr.contains("it seems cut off"), "{}", logs());
    assert_eq!(
        stderr.matches(" sent no heartbeat for ").count(),
        4,
        "{}",
        logs()
    );
    assert_nodes_clean(&slurm, &out);
    assert_nothing_left_in_slurm(&slurm, dir.path(), &marker);
}

/// The attacker's side of the rule above: both nodes freeze whole, their slurmd too (as the launcher's own network
/// failing looks from the launcher: nobody beats, no node answers). The launcher's `srun ... true` reaches neither
/// node within the heartbeat timeout; it says it seems cut off and judges nobody, and once the nodes go on the four
/// workers train to the end together.
#[test]
fn an_elastic_step_on_nodes_srun_cannot_reach_judges_nobody_and_goes_on() {
    let Some(mut slurm) = Slurm::start_two_nodes("si", [&[], &[]]) else {
        return;
    };
    let marker = common::unique_marker("slurm-nodes-unreached");
    let steps = 40;
    let dir = common::train_project(
        "{ min = 2, max = 4, elastic_timeout = 5s }",
        &format!(
            ", ELASTIC_STEPS = \"{steps}\", ELASTIC_STEP_SLEEP = \"0.05\", HVD_TEST_MARKER = \"{marker}\", \
             HVD_COLLECTIVE_TIMEOUT = \"3600\", HVD_HEARTBEAT_TIMEOUT = \"4\""
        ),
        "",
        common::slurm::elastic_train_py(),
    );
    let running = FourRunning::start(&slurm, dir.path());
    slurm.freeze_node(0);
    slurm.freeze_node(1);
    // Found silent after 4 s, the nodes given 4 s to answer: 16 s in all, far below Slurm's SlurmdTimeout.
    std::thread::sleep(Duration::from_secs(16));
    slurm.thaw_node(0);
    slurm.thaw_node(1);
    let out = running.finish_within(Duration::from_secs(180), &mut slurm);
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert!(
        stderr.contains("it seems cut off from them (its network)"),
        "{}",
        logs()
    );
    assert!(!stderr.contains("the launcher reached host "), "{}", logs());
    assert!(!stderr.contains(" sent no heartbeat for "), "{}", logs());
    assert!(out.status.success(), "{}", logs());
    let step =
        common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (2, 2), (3, 3)]);
    assert!(step >= steps, "{}", logs());
    assert_nothing_left_in_slurm(&slurm, dir.path(), &marker);
}

/// A plain (not elastic) step of 4 workers inside an allocation of two tasks on each node: its one srun starts two
/// ranks on each node, which meet at a rendezvous the nodes reach (not this machine's loopback), allreduce and say
/// where they ran; their lines carry their node's name.
#[test]
fn a_plain_step_in_a_two_node_allocation_runs_its_ranks_on_both_nodes() {
    let Some(slurm) = Slurm::start_two_nodes("sp", [&[], &[]]) else {
        return;
    };
    let dir = common::train_project(
        "4",
        "",
        "",
        "import socket\nimport numpy as np\nimport hvd\nhvd.init()\n\
         s = hvd.allreduce(np.array([float(hvd.rank())]), op=hvd.Sum, name=\"r\")\n\
         print(f\"rank {hvd.rank()} of {hvd.size()} on {socket.gethostname()} sum {float(s[0])}\")\n\
         hvd.shutdown()\n",
    );
    let out = slurm
        .command("salloc")
        .args(TWO_BY_TWO)
        .args([common::HVD, "run"])
        .arg(dir.path().join("train.hvd"))
        .args(["--no-build", "--engine", "slurm", "--grace", "2"])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert!(out.status.success(), "{}", logs());
    assert!(stderr.contains("rendezvous 10.77.0.1:"), "{}", logs());
    for rank in 0..4 {
        let node = NODES[rank / 2];
        assert!(
            stdout.contains(&format!(
                "[train {node}:{rank}] rank {rank} of 4 on {node} sum 6.0\n"
            )),
            "{}",
            logs()
        );
    }
    slurm.assert_queue_empties();
    assert_nodes_clean(&slurm, &out);
}

/// The rest of the batch test's project: 4 ranks, each saying where it runs and with which env, and whether it sees the
/// launcher's store (it must not: the node's store is its own).
fn batch_step(store: &Path) -> String {
    format!(
        "cluster {{\n  engine = \"slurm\"\n  partition = \"debug\"\n  settings = {{ nodes = \"2\" }}\n}}\nstep train \
         {{\n  run = \"test -e {}/launcher-only && echo sees-the-launchers-store; python -c 'import helper, socket, \
         sys; print(helper.WORD, sys.prefix, socket.gethostname())'\"\n  workers = 4\n}}\n",
        store.display()
    )
}

/// `hvd run --engine slurm --env-dir ENV --cache file://CACHE --trusted-key KEY` of `project` from outside an
/// allocation, with the download cache home under `root` (private to each node with the store).
fn submit_with_cache(slurm: &Slurm, p: &common::PushedEnv, root: &Path) -> Output {
    let (env, cache) = (p.env.display().to_string(), p.cache.display().to_string());
    let key = p.public_key.display().to_string();
    let mut command = slurm.command(common::HVD);
    command
        .arg("run")
        .arg(p.project.join("train.hvd"))
        .args(["--engine", "slurm", "--env-dir", &env, "--grace", "2"])
        .args(["--cache", &format!("file://{cache}"), "--trusted-key", &key])
        .env("XDG_CACHE_HOME", root.join("home-cache"))
        .env("NO_COLOR", "1")
        .env_remove("HVD_CACHES")
        .env_remove("HVD_TRUSTED_KEYS");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("SLURM_") {
            command.env_remove(name);
        }
    }
    command.env("SLURM_CONF", slurm.conf());
    command.output().unwrap()
}

/// The batch chain on two nodes whose stores are their own (an empty tmpfs over the store and the download cache
/// home on each, while the launcher's machine has the built env there): the job substitutes the env from a signed
/// file cache into each node's store before srun, and the 4 ranks (2 a node) run with it, none seeing the launcher's
/// store. Then the same with the cache hidden from the second node: the job fails naming that node before any rank
/// runs.
#[test]
fn the_slurm_batch_chain_substitutes_the_env_into_each_nodes_own_store() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let store = root.path().join("store");
    let home = root.path().join("home-cache");
    std::fs::create_dir_all(&home).unwrap();
    let p = common::pushed_fixture_env(
        root.path(),
        &outside.path().join("cache"),
        &batch_step(&store),
    );
    std::fs::write(store.join("launcher-only"), "").unwrap();
    let private: &[&Path] = &[&store, &home];
    {
        let Some(slurm) = Slurm::start_two_nodes("sb", [private, private]) else {
            return;
        };
        let out = submit_with_cache(&slurm, &p, root.path());
        let (stdout, stderr) = text(&out);
        let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
        assert!(out.status.success(), "{}", logs());
        assert!(!stdout.contains("sees-the-launchers-store"), "{}", logs());
        for node in NODES {
            assert_eq!(
                stdout
                    .matches(&format!("hello {} {node}\n", p.env.display()))
                    .count(),
                2,
                "{}",
                logs()
            );
        }
        assert_eq!(slurm.queued(), "");
        assert_nodes_clean(&slurm, &out);
    }
    // The launcher's store is as it was: the nodes wrote into their own.
    assert!(store.join("launcher-only").exists());
    // The second node cannot read the cache (an empty tmpfs over it there). The new Slurm numbers its jobs from 1
    // again: the first run's output files (`.hvd/slurm/NAME-STEP-ID.out`) go, or the second run could read the first
    // job's lines from the file its own job 1 has not yet truncated.
    std::fs::remove_dir_all(p.project.join(".hvd/slurm")).unwrap();
    let hidden: &[&Path] = &[&store, &home, &p.cache];
    let Some(slurm) = Slurm::start_two_nodes("sf", [private, hidden]) else {
        return;
    };
    let out = submit_with_cache(&slurm, &p, root.path());
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert!(!out.status.success(), "{}", logs());
    assert!(
        stderr.contains(&format!(
            "hvd: node {} could not get the env from the binary caches",
            NODES[1]
        )),
        "{}",
        logs()
    );
    assert!(
        !stderr.contains(&format!("node {} could not", NODES[0])),
        "{}",
        logs()
    );
    // No rank ran.
    assert!(!stdout.contains("hello "), "{}", logs());
    assert_eq!(slurm.queued(), "");
    assert_nodes_clean(&slurm, &out);
}
