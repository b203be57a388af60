//! The slurm engine's plain (not elastic) distributed steps inside an allocation: where torch's `env://` meets and
//! which interface the libraries are told to use when the ranks span nodes (on the two-node test Slurm of
//! tests/common/slurm.rs), and a run that needs no rendezvous reading nothing of the allocation.

use std::process::Output;

mod common;

use common::slurm::{NODES, Slurm};
use common::text;

/// Each rank prints the interface variables and `MASTER_ADDR`, then the ranks meet as torch's `env://` does: rank 0
/// listens on `MASTER_ADDR:MASTER_PORT` (so it must be an address of rank 0's node), the others connect to it and
/// say which host answered.
const MEET_PY: &str = r#"import os, socket, time
r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
nccl = os.environ.get("NCCL_SOCKET_IFNAME", "-")
gloo = os.environ.get("HOROVOD_GLOO_IFACE", "-")
print(f"rank {r} on {socket.gethostname()} nccl={nccl} gloo={gloo} master={addr}", flush=True)
if r == 0:
    s = socket.create_server((addr, port))
    s.settimeout(60)
    for _ in range(n - 1):
        c, _ = s.accept()
        c.sendall(socket.gethostname().encode())
        c.close()
else:
    deadline = time.time() + 60
    while True:
        try:
            c = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    print(f"rank {r} met rank 0 on {c.recv(100).decode()}", flush=True)
"#;

/// `salloc --nodes=2 --ntasks-per-node=2 SALLOC... hvd run` of a project whose step `train` runs [`MEET_PY`] on 4
/// workers, with `args` after `hvd run FILE`.
fn meet(slurm: &Slurm, salloc: &[&str], args: &[&str]) -> Output {
    let dir = common::train_project("4", "", "", MEET_PY);
    slurm
        .command("salloc")
        .args(["--nodes=2", "--ntasks-per-node=2"])
        .args(salloc)
        .args([common::HVD, "run"])
        .arg(dir.path().join("train.hvd"))
        .args(["--no-build", "--engine", "slurm", "--grace", "2"])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

/// Asserts that every one of `ranks` ranks saw no `lo` interface and rank 0's node as `MASTER_ADDR`, that ranks 1..
/// met rank 0 there, and that rank `r` ran on `node(r)`; returns stdout.
fn assert_met_at_rank_zeros_node(
    slurm: &Slurm,
    out: &Output,
    ranks: usize,
    node: impl Fn(usize) -> &'static str,
) -> String {
    let (stdout, stderr) = text(out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    assert!(out.status.success(), "{}", logs());
    // The launcher's address, on the bridge the nodes share: the rendezvous, never torch's meeting point.
    assert!(stderr.contains("rendezvous 10.77.0.1:"), "{}", logs());
    for rank in 0..ranks {
        assert!(
            stdout.contains(&format!(
                "] rank {rank} on {} nccl=- gloo=- master={}\n",
                node(rank),
                NODES[0]
            )),
            "rank {rank}: {}",
            logs()
        );
        if rank > 0 {
            assert!(
                stdout.contains(&format!("] rank {rank} met rank 0 on {}\n", NODES[0])),
                "rank {rank}: {}",
                logs()
            );
        }
    }
    slurm.assert_queue_empties();
    stdout
}

/// A plain step of 4 ranks over two nodes (block placement: two a node): every rank, on either node, has
/// `MASTER_ADDR` = the first node (rank 0's), not the launcher's address, and no `lo` for NCCL or gloo; rank 0 listens
/// there and the others, the second node's included, reach it; lines are labelled with their node. Then the same
/// step on 3 of the allocation's 4 tasks: srun places it, `MASTER_ADDR` is still the step's first node.
#[test]
fn a_plain_step_across_nodes_meets_torch_at_rank_zeros_node_without_loopback() {
    let Some(slurm) = Slurm::start_two_nodes("pm", [&[], &[]]) else {
        return;
    };
    let out = meet(&slurm, &[], &[]);
    let stdout = assert_met_at_rank_zeros_node(&slurm, &out, 4, |r| NODES[r / 2]);
    for rank in 0..4 {
        let node = NODES[rank / 2];
        assert!(
            stdout.contains(&format!("[train {node}:{rank}] rank {rank} on {node} ")),
            "{stdout}"
        );
    }
    let out = meet(&slurm, &[], &["--workers", "3"]);
    let stdout = text(&out).0;
    // Where srun put ranks 1 and 2 is its choice; rank 0 is on the step's first node.
    assert_met_at_rank_zeros_node(&slurm, &out, 3, |r| {
        match (r, stdout.contains(&format!("] rank {r} on {}", NODES[1]))) {
            (0, _) | (_, false) => NODES[0],
            (_, true) => NODES[1],
        }
    });
}

/// `salloc --distribution=cyclic`: srun deals the ranks out node by node (0 and 2 on the first, 1 and 3 on the
/// second), so the allocation's block layout would name the wrong node for ranks 1 and 2: the lines carry this
/// machine's name instead, and the ranks still meet at the first node.
#[test]
fn a_cyclic_plain_step_is_not_labelled_with_a_guessed_node() {
    let Some(slurm) = Slurm::start_two_nodes("pc", [&[], &[]]) else {
        return;
    };
    let out = meet(&slurm, &["--distribution=cyclic"], &[]);
    let stdout = assert_met_at_rank_zeros_node(&slurm, &out, 4, |r| NODES[r % 2]);
    let here = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    for rank in 0..4 {
        assert!(
            stdout.contains(&format!(
                "[train {}:{rank}] rank {rank} on {} ",
                here.trim(),
                NODES[rank % 2]
            )),
            "{stdout}"
        );
    }
}

/// Inside an allocation (faked: `SLURM_JOB_ID`, a node list, no `SLURM_TASKS_PER_NODE`, and no `scontrol` on PATH), a
/// run whose selected steps all run once reads nothing of the allocation and runs; a run that selects a distributed
/// step is refused with an error about that step (not about elastic ones), and with the tasks given, `scontrol`'s
/// absence is reported for it.
#[test]
fn a_run_without_distributed_steps_needs_nothing_of_the_allocation() {
    let dir = common::project(
        "step once {\n  run = \"echo ran-once\"\n}\nstep train {\n  run = \"echo never\"\n  workers = 2\n  needs = [\"once\"]\n}",
    );
    let run = |args: &[&str], tasks: Option<&str>| {
        let mut command = common::hvd_run_command(dir.path());
        command
            .args(["--no-build", "--engine", "slurm"])
            .args(args)
            .env("SLURM_JOB_ID", "7")
            .env("SLURM_JOB_NODELIST", "hvdnone[1-2]")
            .env("PATH", "/nonexistent")
            .env("NO_COLOR", "1")
            .env_remove("SLURM_DISTRIBUTION")
            .env_remove("SLURM_CPUS_PER_TASK");
        match tasks {
            Some(t) => command.env("SLURM_TASKS_PER_NODE", t),
            None => command.env_remove("SLURM_TASKS_PER_NODE"),
        };
        command.output().unwrap()
    };
    let out = run(&["--step", "once"], None);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("ran-once"), "{stdout}\n{stderr}");
    let refused = |out: &Output, parts: &[&str]| {
        let flat = common::flat_stderr(out);
        assert!(!out.status.success(), "{flat}");
        for part in parts {
            assert!(flat.contains(part), "`{part}` missing: {flat}");
        }
        assert!(!flat.contains("elastic"), "{flat}");
        assert!(
            !text(out).0.contains("ran-once"),
            "a step ran: {}",
            text(out).0
        );
    };
    refused(
        &run(&[], None),
        &[
            "distributed step `train` runs inside a Slurm allocation",
            "`SLURM_TASKS_PER_NODE` is not set",
        ],
    );
    refused(
        &run(&[], Some("1(x2)")),
        &[
            "distributed step `train` runs inside a Slurm allocation",
            "cannot run `scontrol show hostnames`",
        ],
    );
}
