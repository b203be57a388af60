//! End-to-end tests of the engines beyond `local` with the built binary: the worker shim (`hvd worker-env`) and the
//! `mpi` engine under OpenMPI (`mpirun`) and MPICH (`mpirun.mpich`). MPI tests are skipped, saying so, where that
//! mpirun is not installed.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::slurm::{Slurm, assert_finished_together, elastic_project, elastic_train_py, have};
use common::{HVD, allreduce_runtime, project, text};

fn hvd_run(dir: &Path, args: &[&str]) -> Output {
    Command::new(HVD)
        .arg("run")
        .arg(dir.join("train.hvd"))
        .args(["--no-build", "--grace", "2"])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

#[test]
fn worker_env_maps_openmpi_and_slurm_ranks() {
    let (stdout, _) = common::succeeded(
        Command::new(HVD)
            .args(["worker-env", "--", "sh", "-c"])
            .arg("echo $HVD_RANK $HVD_SIZE $HVD_LOCAL_RANK $HOROVOD_RANK $RANK $WORLD_SIZE $HVD_RENDEZVOUS")
            .env("OMPI_COMM_WORLD_RANK", "2")
            .env("OMPI_COMM_WORLD_SIZE", "3")
            .env("OMPI_COMM_WORLD_LOCAL_RANK", "0")
            .env("HVD_RENDEZVOUS", "127.0.0.1:9")
            .env("HVD_JOB_TOKEN", "t"),
    );
    assert_eq!(stdout.trim(), "2 3 0 2 2 3 127.0.0.1:9");
    let out = Command::new(HVD)
        .args([
            "worker-env",
            "--",
            "sh",
            "-c",
            "echo $HVD_RANK/$HVD_SIZE $HVD_CROSS_RANK",
        ])
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env("SLURM_PROCID", "1")
        .env("SLURM_NTASKS", "2")
        .env("SLURM_NODEID", "1")
        .env("SLURM_NNODES", "2")
        .output()
        .unwrap();
    assert_eq!(text(&out).0.trim(), "1/2 1");
    // No rank anywhere: a usage error that says which variables it looked for.
    let out = Command::new(HVD)
        .args(["worker-env", "--", "true"])
        .env_clear()
        .output()
        .unwrap();
    common::assert_exit_saying(&out, 2, "OMPI_COMM_WORLD_RANK");
}

#[test]
fn worker_env_refuses_a_node_whose_glibc_is_older_than_the_env_needs() {
    // An env in a store whose wheel needs glibc 2.999, as a lock made on a far newer machine would pick.
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let env = store.join("0123456789abcdef0123456789abcdef-train-env");
    let wheel = store.join("11111111111111111111111111111111-x-2.0");
    for (path, json) in [
        (
            &env,
            serde_json::json!({"schema": 1, "content_hash": "c1", "references": [wheel.file_name().unwrap().to_str()]}),
        ),
        (
            &wheel,
            serde_json::json!({"schema": 1, "content_hash": "c2", "references": [],
            "derivation": {"kind": "wheel", "inputs": {"artifact.filename": "x-2.0-cp311-cp311-manylinux_2_999_x86_64.whl"}}}),
        ),
    ] {
        std::fs::create_dir_all(path).unwrap();
        std::fs::write(path.join(".hvd-path.json"), json.to_string()).unwrap();
    }
    let run = |venv: &Path| {
        Command::new(HVD)
            .args(["worker-env", "--", "echo", "started"])
            .env("OMPI_COMM_WORLD_RANK", "0")
            .env("OMPI_COMM_WORLD_SIZE", "1")
            .env("VIRTUAL_ENV", venv)
            .output()
            .unwrap()
    };
    let out = run(&env);
    let (stdout, _) = text(&out);
    let stderr = common::flat_stderr(&out);
    assert!(
        !out.status.success() && !stdout.contains("started"),
        "{stdout}{stderr}"
    );
    assert!(stderr.contains("has glibc 2."), "{stderr}");
    assert!(
        stderr.contains("manylinux_2_999_x86_64.whl` needs glibc 2.999"),
        "{stderr}"
    );
    // A plain venv (not a store path) is not checked.
    let out = run(dir.path());
    assert!(out.status.success(), "{}", text(&out).1);
}

const RANKS: &str = r#"step train {
  run = "case $HVD_RENDEZVOUS in 127.0.0.1:*) r=yes;; esac; echo rank=$HVD_RANK/$HVD_SIZE torch=$RANK/$WORLD_SIZE rdv=$r x=$X"
  workers = 2
  env = { X = "from-step" }
}"#;

const FAILS: &str = r#"step train {
  run = "if [ $HVD_RANK = 1 ]; then echo boom-$HVD_RANK >&2; exit 3; fi; sleep 20"
  workers = 2
}"#;

/// [`RANKS`] succeeded and each rank's line is attributed to it.
fn assert_ranks_report(out: &Output) {
    common::assert_every_rank_says(out, 2, |rank| {
        format!(":{rank}] rank={rank}/2 torch={rank}/2 rdv=yes x=from-step")
    });
}

fn mpi_runs_two_ranks_and_fails_with_one(flavour: &str) {
    let dir = project(RANKS);
    let out = hvd_run(dir.path(), &["--engine", "mpi", "--mpi", flavour]);
    assert_ranks_report(&out);
    let dir = project(FAILS);
    let out = hvd_run(dir.path(), &["--engine", "mpi", "--mpi", flavour]);
    let (stdout, stderr) = text(&out);
    // mpirun exits with its own code (MPICH: 9, the shim's SIGKILL); hvd names the failing rank and passes its
    // code on, read from mpirun's message or the shim's.
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(stderr.contains("rank 1 on "), "{stderr}");
    assert!(stderr.contains("boom-1"), "{stderr}");
}

#[test]
fn mpi_engine_with_openmpi() {
    if have("mpirun.openmpi") {
        mpi_runs_two_ranks_and_fails_with_one("openmpi");
    }
}

#[test]
fn mpi_engine_with_mpich() {
    if have("mpirun.mpich") {
        mpi_runs_two_ranks_and_fails_with_one("mpich");
    }
}

#[test]
fn dry_run_shows_the_mpirun_command() {
    if !have("mpirun.mpich") {
        return;
    }
    let dir = project(RANKS);
    let out = hvd_run(
        dir.path(),
        &["--engine", "mpi", "--mpi", "mpich", "--dry-run"],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("mpirun:"))
        .unwrap_or_else(|| panic!("no mpirun line:\n{stdout}"));
    assert!(line.contains("-np 2"), "{line}");
    assert!(line.contains("-genvlist PATH,"), "{line}");
    assert!(line.contains(",X "), "{line}");
    assert!(
        line.contains(" worker-env --whole-lines --kill-on-failure -- /bin/sh -c "),
        "{line}"
    );
    // An engine hvd does not know is a usage error naming it.
    let out = hvd_run(dir.path(), &["--engine", "nomad", "--dry-run"]);
    common::assert_exit_saying(&out, 2, "nomad");
}

const K8S: &str = r#"cluster {
  engine = "kubernetes"
  image = "example/train:1"
  namespace = "ml"
}
step prepare {
  run = "echo prep"
}
step train {
  run = "echo train"
  workers = 2
  needs = ["prepare"]
}"#;

/// `hvd export k8s PROJECT/train.hvd --out OUT`.
fn export_k8s(project: &Path, out: &Path) -> Output {
    Command::new(HVD)
        .args(["export", "k8s"])
        .arg(project.join("train.hvd"))
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn export_k8s_writes_a_jobset_and_run_needs_kubectl() {
    let dir = project(K8S);
    let out_dir = dir.path().join("out");
    let out = export_k8s(dir.path(), &out_dir);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.trim().ends_with("t.jobset.json"), "{stdout}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("t.jobset.json")).unwrap())
            .unwrap();
    assert_eq!(doc["metadata"]["namespace"], "ml");
    let train = &doc["spec"]["replicatedJobs"][1];
    assert_eq!(train["dependsOn"][0]["name"], "prepare");
    let container = &train["template"]["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], "example/train:1");
    assert_eq!(container["command"][1], "worker-env");
    // The job token: a fresh random one in a Secret file only its owner can read, referenced by the ranks, in no
    // other manifest; each export makes a new one.
    let token = |out_dir: &Path| {
        let file = out_dir.join("t.secret.json");
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", file.display());
        let secret: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(secret["kind"], "Secret");
        assert_eq!(secret["metadata"]["name"], "t-hvd-token");
        secret["stringData"]["token"].as_str().unwrap().to_owned()
    };
    let first = token(&out_dir);
    assert_eq!(first.len(), 32, "{first}");
    let jobset_text = std::fs::read_to_string(out_dir.join("t.jobset.json")).unwrap();
    assert!(!jobset_text.contains(&first), "{jobset_text}");
    assert!(!jobset_text.contains("controller-uid"), "{jobset_text}");
    assert!(
        jobset_text.contains(r#""name": "t-hvd-token""#),
        "{jobset_text}"
    );
    let out = export_k8s(dir.path(), &out_dir);
    assert!(out.status.success(), "{}", text(&out).1);
    assert_ne!(token(&out_dir), first, "two exports, one token");
    // The MPIJob flavour leaves out the step that runs once, saying so.
    let out = Command::new(HVD)
        .args(["export", "k8s", "--flavour", "mpijob", "--out"])
        .arg(&out_dir)
        .arg(dir.path().join("train.hvd"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out).1);
    assert!(
        text(&out).1.contains("`prepare` runs once"),
        "{}",
        text(&out).1
    );
    assert!(out_dir.join("t-train.mpijob.json").is_file());
    // `hvd run` with the kubernetes engine and no kubectl on PATH: a clear usage error, manifests kept.
    let out = common::hvd_run_command(dir.path())
        .arg("--no-build")
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out).1);
    assert!(
        text(&out).1.contains("kubectl is not on PATH"),
        "{}",
        text(&out).1
    );
    assert!(dir.path().join(".hvd/k8s/t.jobset.json").is_file());
}

const SLURM: &str = r#"resources {
  gpus = 1
  cpus = 2
  mem = 1GiB
}
cluster {
  engine = "slurm"
  partition = "debug"
  settings = { nodes = "2" }
}
step prep {
  run = "echo prep"
}
step train {
  run = "python train.py"
  workers = 4
  needs = ["prep"]
  env = { LR = "0.1" }
}"#;

#[test]
fn slurm_dry_run_prints_chained_sbatch_scripts() {
    let dir = project(SLURM);
    let out = common::hvd_run_command(dir.path())
        .args(["--no-build", "--dry-run"])
        .env_remove("SLURM_JOB_ID")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let got = stdout
        .replace(&dir.path().display().to_string(), "@DIR@")
        .replace(HVD, "@HVD@");
    common::assert_golden("slurm-dry-run.sh", &got);
    // The script is valid shell.
    let check = Command::new("sh")
        .args(["-n", "-c", &stdout])
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", text(&check).1);
    // Inside an allocation the step is one srun.
    let out = common::hvd_run_command(dir.path())
        .args(["--no-build", "--dry-run"])
        .env("SLURM_JOB_ID", "7")
        .output()
        .unwrap();
    let stdout = text(&out).0;
    assert!(
        stdout.contains("srun:    srun --kill-on-bad-exit=1 --ntasks=4 --label --cpus-per-task=2 --gpus-per-task=1 "),
        "{stdout}"
    );
    // Outside an allocation without Slurm's commands: a usage error naming what to install.
    let out = common::hvd_run_command(dir.path())
        .arg("--no-build")
        .env_remove("SLURM_JOB_ID")
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    common::assert_exit_saying(&out, 2, "sbatch, scontrol, scancel not on PATH");
}

/// A project whose step `first` runs `run` and whose 2-worker step `train` (`echo never`) needs it.
fn step_then_train(first: &str, run: &str) -> tempfile::TempDir {
    project(&format!(
        "step {first} {{\n  run = \"{run}\"\n}}\nstep train {{\n  run = \"echo never\"\n  workers = 2\n  needs = [\"{first}\"]\n}}"
    ))
}

/// The job id hvd reported for `step` ("step `NAME` submitted as slurm job ID").
fn submitted_job(stderr: &str, step: &str) -> String {
    let marker = format!("step `{step}` submitted as slurm job ");
    let rest = stderr
        .split_once(&marker)
        .unwrap_or_else(|| panic!("no job for `{step}`:\n{stderr}"))
        .1;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .to_owned()
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: i32) -> i32;
}

#[test]
fn slurm_engine_runs_srun_in_an_allocation() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let dir = project(RANKS);
    let out = slurm.run(dir.path());
    assert_ranks_report(&out);
    let dir = project(FAILS);
    let out = slurm.run(dir.path());
    let (stdout, stderr) = text(&out);
    // srun exits 143 (the killed task); hvd reads the failing task and its code from srun's message.
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(stderr.contains("boom-1"), "{stderr}");
    assert!(stderr.contains("rank 1 on "), "{stderr}");
}

/// The plan of an elastic step inside an allocation: one srun per rank, on the allocation's nodes; allocation
/// variables Slurm would not write are refused, and so is a step with more workers than the allocation has tasks
/// (its extra `srun --exact` would wait for a free task while the others time out). Needs only `scontrol` (to
/// expand the node list) and a slurm.conf for it, no Slurm daemons; the refusals before scontrol need nothing.
#[test]
fn slurm_elastic_plan_is_one_srun_per_rank_within_the_allocations_tasks() {
    let dir = elastic_project(16, "", "slurm-elastic-plan");
    let conf = tempfile::tempdir().unwrap();
    std::fs::write(
        conf.path().join("slurm.conf"),
        "ClusterName=hvdtest\nSlurmctldHost=localhost\n",
    )
    .unwrap();
    let dry_run = |nodes: &str, tasks: &str, extra: &[&str]| {
        common::hvd_run_command(dir.path())
            .args(["--no-build", "--engine", "slurm", "--dry-run"])
            .args(extra)
            .env("SLURM_CONF", conf.path().join("slurm.conf"))
            .env("SLURM_JOB_ID", "7")
            .env("SLURM_JOB_NODELIST", nodes)
            .env("SLURM_TASKS_PER_NODE", tasks)
            .env("NO_COLOR", "1")
            .output()
            .unwrap()
    };
    let refused = |out: &Output, part: &str| {
        assert!(!out.status.success(), "{}", text(out).0);
        assert!(
            common::flat_stderr(out).contains(part),
            "`{part}` missing: {}",
            text(out).1
        );
    };
    // A node list that would be an option of scontrol is refused before scontrol runs.
    refused(
        &dry_run("--help", "4", &[]),
        "`SLURM_JOB_NODELIST` is `--help`, not a Slurm node list",
    );
    if !have("scontrol") {
        eprintln!("skipped: the rest of this test expands the node list with Slurm's `scontrol`");
        return;
    }
    // Names that resolve anywhere (both this machine): the plan resolves the nodes.
    let out = dry_run("127.0.0.[1-2]", "3,1", &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for (rank, node) in [(0, "127.0.0.1"), (2, "127.0.0.1"), (3, "127.0.0.2")] {
        assert!(
            stdout.contains(&format!(
                "srun: setsid --fork --wait setpriv --pdeathsig KILL srun --ntasks=1 --nodes=1 --nodelist={node} \
                 --exact --mem=0 --kill-on-bad-exit=1 --job-name=train.{rank} "
            )),
            "{stdout}"
        );
    }
    refused(
        &dry_run("127.0.0.[1-2]", "2(x3)", &[]),
        "`SLURM_TASKS_PER_NODE` is `2(x3)` (3 nodes) but `SLURM_JOB_NODELIST` names 2 nodes",
    );
    // Three tasks for four workers: refused, naming both; three workers fit.
    refused(
        &dry_run("127.0.0.[1-2]", "2,1", &[]),
        "elastic step `train` has 4 workers, but the allocation has 3 tasks (`SLURM_TASKS_PER_NODE` is `2,1`)",
    );
    let out = dry_run("127.0.0.[1-2]", "2,1", &["--max-workers", "3"]);
    assert!(out.status.success(), "{}", text(&out).1);
    // Host discovery: the allocation's nodes are the step's hosts (lost ranks are replaced on them without it).
    let script = dir.path().join("discover.sh");
    std::fs::write(&script, "#!/bin/sh\necho localhost:4\n").unwrap();
    refused(
        &dry_run(
            "127.0.0.[1-2]",
            "3,1",
            &["--host-discovery-script", script.to_str().unwrap()],
        ),
        "runs elastic steps on the local and ssh engines only, not on the slurm engine: its hosts are the \
         allocation's nodes",
    );
}

/// An elastic step inside an allocation: each rank is its own job step, so when one rank SIGKILLs itself its step
/// ends alone and the survivors re-form; the lost rank is replaced by a new job step (`srun --exact`, slot 4) on the
/// allocation's node with the free task, which joins at a commit (training goes on until the job is back to 4), and
/// the four finish every committed step once with the same weights; no job step is left.
#[test]
fn slurm_elastic_step_replaces_a_rank_that_kills_itself() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let marker = common::unique_marker("slurm-elastic");
    let steps = 16;
    let dir = elastic_project(
        steps,
        ", ELASTIC_KILL = \"2:5\", ELASTIC_UNTIL = \"size:4\"",
        &marker,
    );
    let out = slurm.spawn_elastic(dir.path()).wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(
        stderr.contains("rank 2 of step `train` was lost"),
        "{stdout}\n{stderr}"
    );
    assert!(stderr.contains("3 of its 4 workers go on"), "{stderr}");
    assert!(
        stderr.contains("started rank 4 of step `train` on ")
            && stderr.contains(" in place of a lost worker; it joins the workers' next round"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("slot 4 starts as rank 3 of 4"),
        "{stdout}\n{stderr}"
    );
    // Slot 3 (rank 3 before) takes the lost rank's place: in a round of the 3 survivors, or, when the replacement
    // asked to join before the survivors re-formed, in the round it joins (either is a correct re-form).
    assert!(
        stdout.contains("slot 3 re-formed as rank 2 of 3")
            || stdout.contains("slot 3 re-formed as rank 2 of 4"),
        "{stdout}\n{stderr}"
    );
    // One replacement: no sixth slot.
    assert!(!stdout.contains("slot 5 "), "{stdout}");
    let members: &[(u32, u32)] = &[(0, 0), (1, 1), (3, 2), (4, 3)];
    assert_finished_together(&slurm, dir.path(), &out, (members, steps), &marker);
}

/// An elastic step submitted from outside an allocation (`hvd run --engine slurm`: batch jobs) runs under a launcher
/// of its own in its job (`hvd run --step train --no-deps` inside the allocation, made with `--no-kill`), after the
/// step it needs ran as a job of its own: so it goes on as inside `salloc`. Rank 2 SIGKILLs itself, the survivors
/// re-form, a replacement joins as a new job step, and the four finish with every committed step once; the launcher's
/// worker lines come through as the ranks' own (`[train HOST:4] ...`), its notes as notes; no job is left.
#[test]
fn an_elastic_step_submitted_as_a_batch_job_replaces_a_rank_that_kills_itself() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let marker = common::unique_marker("sbatch-elastic");
    let steps = 16;
    let dir = elastic_project(
        steps,
        ", ELASTIC_KILL = \"2:5\", ELASTIC_UNTIL = \"size:4\"",
        &marker,
    );
    // Four tasks on the node's two CPUs, and a step before it, which the launcher in the job must not run again.
    let file = dir.path().join("train.hvd");
    let text_of = std::fs::read_to_string(&file).unwrap();
    let text_of = text_of.replacen(
        "step train {",
        "step prep {\n  run = \"echo prep >> prep.txt\"\n}\nstep train {\n  needs = [\"prep\"]",
        1,
    );
    std::fs::write(
        &file,
        format!("{text_of}\ncluster {{\n  settings = {{ overcommit = \"true\" }}\n}}\n"),
    )
    .unwrap();
    let out = slurm.submit(dir.path(), &["--grace", "2"]);
    let (stdout, stderr) = text(&out);
    let logs = || format!("{stdout}\n{stderr}\n{}", slurm.logs());
    let flat = common::flat_stderr(&out);
    for want in [
        "rank 2 of step `train` was lost (exit code 137); 3 of its 4 workers go on",
        "started rank 4 of step `train` on ",
    ] {
        assert!(flat.contains(want), "want `{want}`: {}", logs());
    }
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("[train ") && l.contains(":4] slot 4 starts as rank 3 of 4")),
        "{}",
        logs()
    );
    assert!(!stdout.contains("slot 5 "), "{}", logs());
    let members: &[(u32, u32)] = &[(0, 0), (1, 1), (3, 2), (4, 3)];
    common::slurm::assert_trained_together(&out, (members, steps));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("prep.txt")).unwrap(),
        "prep\n",
        "{}",
        logs()
    );
    common::assert_nothing_left(&marker);
    slurm.assert_queue_empties();
}

/// Below its minimum a slurm elastic step waits for the lost rank's replacement (before replacements on slurm it failed
/// at once): 4 workers, minimum 4, one SIGKILLs itself; the new job step joins, the step is back to 4 and all four
/// finish with every committed step once.
#[test]
fn a_slurm_elastic_step_below_its_minimum_is_brought_back_by_the_replacement() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let marker = common::unique_marker("slurm-elastic-min");
    let steps = 12;
    let dir = common::train_project(
        "{ min = 4, max = 4 }",
        &format!(
            ", ELASTIC_STEPS = \"{steps}\", HVD_TEST_MARKER = \"{marker}\", ELASTIC_KILL = \"2:5\""
        ),
        "",
        elastic_train_py(),
    );
    let out = slurm.spawn_elastic(dir.path()).wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    let flat = common::flat_stderr(&out);
    for want in [
        "rank 2 of step `train` was lost (exit code 137): 3 of its workers are left, fewer than its minimum of 4; \
         waiting up to 60 s (--elastic-timeout) for replacements (elastic)",
        "started rank 4 of step `train` on ",
        "step `train` is back to 4 workers (minimum 4); it goes on (elastic)",
    ] {
        assert!(flat.contains(want), "want `{want}`:\n{stdout}\n{stderr}");
    }
    let members: &[(u32, u32)] = &[(0, 0), (1, 1), (3, 2), (4, 3)];
    assert_finished_together(&slurm, dir.path(), &out, (members, steps), &marker);
}

/// Killing a rank's srun the way the supervisor does after the grace period (SIGKILL to its whole process group)
/// ends the rank's job step and kills its task on the node: srun's shepherd, in a session of its own, cancels the
/// step. The survivors then re-form, the rank's replacement joins them, and the four finish.
#[test]
fn killing_a_slurm_ranks_srun_group_kills_its_task_and_the_others_go_on() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let marker = common::unique_marker("slurm-elastic-srun");
    let steps = 8;
    // Slot 2 hangs (sleeps) when it begins step 3: alive, until its srun is killed. Training goes on until its
    // replacement has joined.
    let dir = elastic_project(
        steps,
        ", ELASTIC_HANG = \"2:3\", ELASTIC_UNTIL = \"size:4\"",
        &marker,
    );
    let mut child = slurm.spawn_elastic(dir.path());
    // Once slot 2 has joined the first round (a job of 4), its loss is a re-form of the others.
    let (joined_tx, joined) = std::sync::mpsc::channel();
    let reader = {
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut all = String::new();
            for line in
                std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok)
            {
                if line.contains("slot 2 starts as rank 2 of 4") {
                    let _ = joined_tx.send(());
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        })
    };
    if joined
        .recv_timeout(std::time::Duration::from_secs(120))
        .is_err()
    {
        let _ = child.kill();
        panic!(
            "slot 2 never joined:\n{}",
            text(&child.wait_with_output().unwrap()).1
        );
    }
    // The task: the rank's processes on the node (they have the rank's variables in their environment).
    let task: Vec<u32> = common::processes_with_env(&format!("HVD_TEST_MARKER={marker}"))
        .into_iter()
        .map(|(pid, _)| pid)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|e| e.split(|&b| b == 0).any(|v| v == b"HVD_RANK=2"))
        })
        .collect();
    assert!(!task.is_empty(), "rank 2 has no task");
    // The rank's process on this side: the child of `hvd run` whose srun runs rank 2 in this test's project (the
    // rank's variables travel on its stdin, not its command line).
    let project_dir = dir.path().display().to_string();
    let leader = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            let parent = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    stat.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse::<u32>()
                        .ok()
                });
            args.contains(&project_dir.as_bytes())
                && args.contains(&&b"--job-name=train.2"[..])
                && parent.is_some_and(|p| {
                    std::fs::read_to_string(format!("/proc/{p}/comm"))
                        .is_ok_and(|c| c.trim() == "hvd")
                })
        })
        .expect("rank 2's process under hvd run");
    // SAFETY: plain syscall; the group is the one the supervisor started for rank 2.
    assert_eq!(unsafe { libc_kill(-leader, 9) }, 0);
    let left = common::wait_until_empty(
        std::time::Duration::from_secs(30),
        std::time::Duration::from_millis(50),
        || {
            task.iter()
                .copied()
                .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
                .collect::<Vec<_>>()
        },
    );
    for pid in &left {
        // Not left to hang the run: the test fails below.
        // SAFETY: plain syscall, to a process of this test's rank 2.
        unsafe { libc_kill(*pid as i32, 9) };
    }
    let mut out = child.wait_with_output().unwrap();
    out.stdout = reader.join().unwrap().into_bytes();
    assert!(
        left.is_empty(),
        "rank 2's task outlived its srun:\n{}",
        text(&out).1
    );
    let members: &[(u32, u32)] = &[(0, 0), (1, 1), (3, 2), (4, 3)];
    assert_finished_together(&slurm, dir.path(), &out, (members, steps), &marker);
}

/// An engine that starts a step's ranks as one unit refuses an elastic step before anything runs, saying why:
/// mpirun ends every rank when one dies. (The spark engine relays an elastic step's ranks one by one:
/// tests/engine_spark.rs.)
#[test]
fn mpi_refuses_an_elastic_step_saying_why() {
    let dir = project("step train {\n  run = \"true\"\n  workers = 2\n}");
    let out = hvd_run(
        dir.path(),
        &["--engine", "mpi", "--min-workers", "1", "--dry-run"],
    );
    assert!(!out.status.success(), "{}", text(&out).1);
    let flat = common::flat_stderr(&out);
    assert!(
        flat.contains(
            "step `train` is elastic, but the mpi engine starts its ranks through one launcher process: mpirun ends \
             every rank when one dies"
        ) && flat.contains("run elastic steps on the local, ssh, spark, slurm or kubernetes engine"),
        "{flat}"
    );
}

/// What `ar.py` ([`common::write_allreduce_py`]) prints after its allreduce.
const ALLREDUCE_REPORT_PY: &str = r#"# The text and its newline in two writes, as print() does with PYTHONUNBUFFERED=1: the shim's --whole-lines must
# keep mpirun from tagging the pieces as two lines (or putting another rank's line between them).
sys.stdout.write(f"allreduce rank={r} size={n} sum={float(out[0])} ok={ok}")
sys.stdout.flush()
sys.stdout.write("\n")
sys.stdout.flush()
sys.exit(0 if ok else 1)
"#;

/// A project whose one step runs the Python `hvd` package's allreduce on 2 ranks and checks the sum.
fn allreduce_project() -> tempfile::TempDir {
    allreduce_project_after("", "")
}

/// [`allreduce_project`] with steps `before` in the file and the train step's command prefixed with `guard`.
fn allreduce_project_after(before: &str, guard: &str) -> tempfile::TempDir {
    let (python, package, lib) = allreduce_runtime();
    let needs = if before.is_empty() {
        String::new()
    } else {
        "\n  needs = [\"prepare\"]".to_owned()
    };
    let dir = project(&format!(
        "{before}\nstep train {{\n  run = \"{guard}{python} ar.py\"\n  workers = 2{needs}\n  {}\n}}",
        common::allreduce_step_env(&package, &lib)
    ));
    common::write_allreduce_py(dir.path(), ALLREDUCE_REPORT_PY);
    dir
}

fn assert_allreduce(out: &Output) {
    common::assert_every_rank_says(out, 2, |rank| {
        format!(":{rank}] allreduce rank={rank} size=2 sum=3.0 ok=True\n")
    });
}

#[test]
fn the_allreduce_worker_runs_under_mpi_and_slurm() {
    let dir = allreduce_project();
    for flavour in ["openmpi", "mpich"] {
        if have(&format!("mpirun.{flavour}")) {
            assert_allreduce(&hvd_run(dir.path(), &["--engine", "mpi", "--mpi", flavour]));
        }
    }
    if let Some(slurm) = Slurm::start() {
        assert_allreduce(&slurm.run(dir.path()));
    }
}

#[test]
fn hosts_and_hostfiles_reach_mpirun() {
    if !have("mpirun.openmpi") || !have("mpirun.mpich") {
        return;
    }
    let dir = project(RANKS);
    std::fs::write(dir.path().join("hosts"), "# one host\nlocalhost slots=2\n").unwrap();
    let hostfile = dir.path().join("hosts").display().to_string();
    let out = hvd_run(
        dir.path(),
        &[
            "--engine",
            "mpi",
            "--mpi",
            "openmpi",
            "--hostfile",
            &hostfile,
            "--dry-run",
        ],
    );
    let stdout = text(&out).0;
    assert!(stdout.contains(" -np 2 -H localhost:2 "), "{stdout}");
    let out = hvd_run(
        dir.path(),
        &[
            "--engine",
            "mpi",
            "--mpi",
            "mpich",
            "--hosts",
            "localhost:2",
        ],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("[train localhost:1] rank=1/2"), "{stdout}");
    std::fs::write(dir.path().join("hosts"), "localhost slots=two\n").unwrap();
    let out = hvd_run(
        dir.path(),
        &["--engine", "mpi", "--hostfile", &hostfile, "--dry-run"],
    );
    common::assert_exit_saying(&out, 2, "slots=two");
}

#[test]
fn slurm_batch_jobs_run_in_order_from_outside_an_allocation() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    // prepare -> train (the allreduce worker on 2 ranks), submitted with sbatch and followed.
    let dir = allreduce_project_after(
        "step prepare {\n  run = \"echo $SLURM_JOB_ID > prepared; echo prepared\"\n}",
        "test -f prepared && ",
    );
    let out = slurm.submit(dir.path(), &[]);
    assert_allreduce(&out);
    let (stdout, stderr) = text(&out);
    assert!(stdout.contains("[prepare "), "{stdout}");
    let prepare = submitted_job(&stderr, "prepare");
    let train = submitted_job(&stderr, "train");
    assert!(
        stderr.contains(&format!("slurm job {train} (after {prepare})")),
        "{stderr}"
    );
    let prepared = std::fs::read_to_string(dir.path().join("prepared")).unwrap();
    assert_eq!(
        prepared.trim(),
        prepare,
        "the prepare step ran as its own job"
    );
    slurm.assert_state(&train, "COMPLETED");
    // The file rendezvous of the train job is gone; the output files stay.
    let files: Vec<String> = std::fs::read_dir(dir.path().join(".hvd/slurm"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(files.contains(&format!("t-train-{train}.out")), "{files:?}");
    assert!(!files.iter().any(|f| f.starts_with("rdv-")), "{files:?}");
    // Per-rank copies of the lines, as the local engine keeps them.
    let run = std::fs::read_dir(dir.path().join(".hvd/runs"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let rank1 = std::fs::read_to_string(run.join("train/rank.1/stdout")).unwrap();
    assert_eq!(rank1, "allreduce rank=1 size=2 sum=3.0 ok=True\n");
    assert_eq!(slurm.queued(), "");
}

#[test]
fn a_failed_slurm_batch_step_cancels_its_dependents_and_passes_its_code() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let dir = step_then_train("prepare", "echo bad-prep >&2; exit 5");
    let out = slurm.submit(dir.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(5), "{stdout}\n{stderr}");
    assert!(stderr.contains("step `prepare` failed"), "{stderr}");
    assert!(stderr.contains("bad-prep"), "{stderr}");
    assert!(!stdout.contains("never"), "{stdout}");
    // The dependent job was cancelled, not left pending with DependencyNeverSatisfied.
    let train = submitted_job(&stderr, "train");
    slurm.assert_state(&train, "CANCELLED");
    assert_eq!(slurm.queued(), "");
    // A failing rank: srun ends the other task and exits 143; hvd names rank 1 and exits with its code.
    let dir = project(FAILS);
    let out = slurm.submit(dir.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(stderr.contains("rank 1 on "), "{stderr}");
    assert!(stderr.contains("boom-1"), "{stderr}");
    assert_eq!(slurm.queued(), "");
}

/// A stand-in for kubectl (there is no cluster here): records every call's arguments in `calls` and what `apply`
/// got on stdin in `applied.json`; `get pods` prints `pods.json`; `get jobset` prints a JobSet without conditions
/// the first time, then `jobset.json`; `logs -f POD` prints `logs/POD`.
const FAKE_KUBECTL: &str = r#"#!/bin/sh
d=$(dirname "$0")
echo "$*" >> "$d/calls"
case "$1 $2" in
  "apply -f") cat > "$d/applied.json"; echo "jobset.jobset.x-k8s.io/t created" ;;
  delete\ *) echo "deleted" ;;
  "get pods") cat "$d/pods.json" ;;
  "get jobset")
    if [ -e "$d/seen" ]; then cat "$d/jobset.json"; else : > "$d/seen"; echo '{"status": {}}'; fi ;;
  "logs -f") cat "$d/logs/$3" ;;
  *) echo "fake kubectl: unexpected: $*" >&2; exit 1 ;;
esac
"#;

/// A pod of the fake cluster: replicated job, index, exit code.
fn pod(job: &str, index: u32, code: i32) -> serde_json::Value {
    serde_json::json!({
        "metadata": {
            "name": format!("t-{job}-0-{index}-abcde"),
            "labels": {
                "jobset.sigs.k8s.io/jobset-name": "t",
                "jobset.sigs.k8s.io/replicatedjob-name": job,
                "batch.kubernetes.io/job-completion-index": index.to_string(),
            },
        },
        "spec": { "nodeName": "node-a" },
        "status": {
            "phase": if code == 0 { "Succeeded" } else { "Failed" },
            "containerStatuses": [{
                "name": "worker",
                "state": { "terminated": { "exitCode": code, "finishedAt": format!("2026-11-30T08:00:0{index}Z") } },
            }],
        },
    })
}

/// Runs `hvd run --engine kubernetes` (from the file's cluster block) against the fake kubectl in `bin`.
fn run_with_fake_kubectl(
    dir: &Path,
    bin: &Path,
    pods: &[serde_json::Value],
    jobset: &str,
) -> Output {
    fake_kubectl_run(dir, bin, pods, jobset).output().unwrap()
}

/// `hvd run --engine kubernetes` with the fake kubectl in `bin` first on PATH, which shows `pods` and, from the
/// second poll on, a JobSet whose condition is `jobset`.
fn fake_kubectl_run(dir: &Path, bin: &Path, pods: &[serde_json::Value], jobset: &str) -> Command {
    std::fs::create_dir_all(bin.join("logs")).unwrap();
    let kubectl = bin.join("kubectl");
    std::fs::write(&kubectl, FAKE_KUBECTL).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&kubectl, std::fs::Permissions::from_mode(0o755)).unwrap();
    for name in ["calls", "seen"] {
        let _ = std::fs::remove_file(bin.join(name));
    }
    std::fs::write(
        bin.join("pods.json"),
        serde_json::json!({ "items": pods }).to_string(),
    )
    .unwrap();
    for pod in pods {
        let name = pod["metadata"]["name"].as_str().unwrap();
        let index = &pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"];
        std::fs::write(
            bin.join("logs").join(name),
            format!("hello from {name} index {}\n", index.as_str().unwrap()),
        )
        .unwrap();
    }
    std::fs::write(
        bin.join("jobset.json"),
        format!(r#"{{"status": {{"conditions": [{{"type": "{jobset}", "status": "True", "message": "m"}}]}}}}"#),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new(HVD);
    command
        .arg("run")
        .arg(dir.join("train.hvd"))
        .arg("--no-build")
        .env("PATH", path)
        .env("NO_COLOR", "1");
    command
}

#[test]
fn kubernetes_run_applies_the_jobset_and_follows_its_pods_with_kubectl() {
    let dir = project(K8S);
    let bin = dir.path().join("fake-bin");
    let ok = [pod("prepare", 0, 0), pod("train", 0, 0), pod("train", 1, 0)];
    let out = run_with_fake_kubectl(dir.path(), &bin, &ok, "Completed");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for (step, rank) in [("prepare", 0), ("train", 0), ("train", 1)] {
        assert!(
            stdout.contains(&format!(
                "[{step} node-a:{rank}] hello from t-{step}-0-{rank}-abcde index {rank}"
            )),
            "{step} {rank}:\n{stdout}"
        );
    }
    // The command sequence: delete a previous run, apply on stdin, then poll pods and the JobSet and follow logs.
    let calls = std::fs::read_to_string(bin.join("calls")).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(
        calls[..3],
        [
            "delete jobset/t secret/t-hvd-token -n ml --ignore-not-found --wait=true",
            "apply -f -",
            "get pods -n ml -l jobset.sigs.k8s.io/jobset-name=t -o json",
        ],
        "{calls:#?}"
    );
    assert!(
        calls.contains(&"logs -f t-train-0-1-abcde -n ml -c worker"),
        "{calls:#?}"
    );
    assert!(
        calls
            .iter()
            .filter(|c| c.starts_with("get jobset t -n ml -o json"))
            .count()
            >= 2,
        "hvd waited for the JobSet's condition: {calls:#?}"
    );
    let applied: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bin.join("applied.json")).unwrap()).unwrap();
    // One apply: the token Secret (the one in the manifest files hvd wrote), then the JobSet that references it.
    assert_eq!(applied["kind"], "List");
    let (secret, jobset) = (&applied["items"][0], &applied["items"][1]);
    assert_eq!(secret["kind"], "Secret");
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(".hvd/k8s/t.secret.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(secret, &written);
    let token = secret["stringData"]["token"].as_str().unwrap();
    assert!(!jobset.to_string().contains(token), "{jobset}");
    assert_eq!(jobset["kind"], "JobSet");
    assert_eq!(
        jobset["spec"]["replicatedJobs"][1]["dependsOn"][0]["name"],
        "prepare"
    );
    assert!(
        dir.path()
            .join(".hvd/k8s/logs/t-train-0-1-abcde.log")
            .is_file(),
        "pod logs are kept"
    );
    // A failed pod: hvd names its step and index and exits with its code.
    let failed = [pod("prepare", 0, 0), pod("train", 0, 0), pod("train", 1, 7)];
    let out = run_with_fake_kubectl(dir.path(), &bin, &failed, "Failed");
    common::assert_exit_saying(&out, 7, "step `train` failed: rank 1 on node-a");
    let (_, stderr) = text(&out);
    assert!(stderr.contains("hello from t-train-0-1-abcde"), "{stderr}");
    // SIGTERM while the JobSet runs: hvd deletes it and exits 143.
    let mut child = fake_kubectl_run(dir.path(), &bin, &ok[..1], "Running")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let calls = bin.join("calls");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while std::fs::read_to_string(&calls)
        .unwrap_or_default()
        .matches("get jobset")
        .count()
        < 2
    {
        assert!(
            std::time::Instant::now() < deadline,
            "hvd never polled the JobSet"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert_eq!(child.wait().unwrap().code(), Some(143));
    let calls = std::fs::read_to_string(&calls).unwrap();
    assert!(
        calls
            .lines()
            .any(|c| c == "delete jobset/t secret/t-hvd-token -n ml --wait=false"),
        "{calls}"
    );
    // --dry-run prints the JobSet and the kubectl commands, and runs none.
    let _ = std::fs::remove_file(bin.join("calls"));
    let dry_run = |extra: &[&str]| {
        let out = common::hvd_run_command(dir.path())
            .args(["--no-build", "--dry-run"])
            .args(extra)
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out).1);
        text(&out).0
    };
    let stdout = dry_run(&[]);
    assert!(stdout.contains("\"kind\": \"JobSet\""), "{stdout}");
    assert!(
        stdout.contains("#   kubectl apply -f - < MANIFEST"),
        "{stdout}"
    );
    assert!(
        stdout.contains("#   kubectl logs -f POD -n ml -c worker"),
        "{stdout}"
    );
    assert!(!bin.join("calls").exists(), "a dry run calls no kubectl");
    // `--workers N` sizes the distributed steps of the JobSet as with every other engine.
    let stdout = dry_run(&["--workers", "3"]);
    assert!(stdout.contains("\"parallelism\": 3"), "{stdout}");
    assert!(
        stdout.contains("\"parallelism\": 1"),
        "the once step stays one pod: {stdout}"
    );
}

/// An elastic step on `hvd run --engine kubernetes`: the launcher pod's objects are applied with the JobSet (and
/// deleted with it), the launcher pod's `[STEP POD:RANK]` lines become that rank's lines and its own lines notes
/// naming it, a lost worker pod is not the run's failure, and a failed launcher pod is named as the step's launcher
/// with its exit code and report.
#[test]
fn kubernetes_run_follows_an_elastic_steps_launcher_pod() {
    let dir = project(&K8S.replace("workers = 2", "workers = { min = 1, max = 2 }"));
    let bin = dir.path().join("fake-bin");
    // The step's worker pods: one was lost (its replacement runs, not terminated), the JobSet ends them at the end.
    let lost = {
        let mut p = pod("train-workers", 1, 137);
        p["metadata"]["name"] = serde_json::json!("t-train-workers-0-1-lost0");
        // Lost before the launcher ended: still not the failure hvd reports.
        p["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] =
            serde_json::json!("2026-11-30T07:00:00Z");
        p
    };
    let mut waiting = pod("train-workers", 0, 0);
    waiting["status"] = serde_json::json!({
        "phase": "Running",
        "containerStatuses": [{ "name": "worker", "state": { "running": {} } }],
    });
    let launcher_log = "[train t-train-workers-0-0-abcde:0] hello from rank 0\n\
                        hvd: rank 1 of step `train` was lost (killed by SIGKILL)\n\
                        [train t-train-workers-0-1-new00:2] hello from rank 2\n";
    for (launcher_code, jobset) in [(0, "Completed"), (3, "Failed")] {
        let pods = [
            pod("prepare", 0, 0),
            waiting.clone(),
            lost.clone(),
            pod("train", 0, launcher_code),
        ];
        let mut command = fake_kubectl_run(dir.path(), &bin, &pods, jobset);
        std::fs::write(bin.join("logs/t-train-0-0-abcde"), launcher_log).unwrap();
        let out = command.output().unwrap();
        let (stdout, stderr) = text(&out);
        for want in [
            "[train t-train-workers-0-0-abcde:0] hello from rank 0",
            "[train t-train-workers-0-1-new00:2] hello from rank 2",
        ] {
            assert!(stdout.contains(want), "want `{want}`:\n{stdout}\n{stderr}");
        }
        assert!(
            stderr.contains("hvd: t-train-0-0-abcde: rank 1 of step `train` was lost"),
            "{stderr}"
        );
        if launcher_code == 0 {
            assert!(out.status.success(), "{stdout}\n{stderr}");
        } else {
            assert_eq!(out.status.code(), Some(3), "{stderr}");
            let flat = common::flat_stderr(&out);
            assert!(
                flat.contains(
                    "step `train` failed: its launcher (`hvd run` in launcher pod t-train-0-0-"
                ) && flat.contains("ended (exit code 3)"),
                "{stderr}"
            );
        }
    }
    // The launcher pods' objects go with the JobSet, before it, and are deleted with it.
    let applied: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bin.join("applied.json")).unwrap()).unwrap();
    let kinds: Vec<&str> = applied["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "Secret",
            "ConfigMap",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "JobSet"
        ]
    );
    let calls = std::fs::read_to_string(bin.join("calls")).unwrap();
    assert!(
        calls.lines().next().unwrap().starts_with(
            "delete jobset/t secret/t-hvd-token configmap/t-hvd-project serviceaccount/t-hvd-launcher \
             role.rbac.authorization.k8s.io/t-hvd-launcher rolebinding.rbac.authorization.k8s.io/t-hvd-launcher -n ml"
        ),
        "{calls}"
    );
}

#[test]
fn slurm_batch_jobs_are_cancelled_by_sigterm_and_run_on_detached() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    // SIGTERM to hvd while the first step runs: every submitted job is cancelled, hvd exits 143.
    let dir = step_then_train("wait", "echo waiting; sleep 60");
    let mut command = Command::new(HVD);
    command
        .arg("run")
        .arg(dir.path().join("train.hvd"))
        .args(["--no-build", "--engine", "slurm"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("SLURM_") {
            command.env_remove(name);
        }
    }
    let mut child = command.env("SLURM_CONF", slurm.conf()).spawn().unwrap();
    // A guard: should the job never start, hvd is killed after a minute and the test fails instead of hanging.
    let pid = child.id().to_string();
    let finished = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let guard = {
        let finished = finished.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !finished.load(std::sync::atomic::Ordering::SeqCst) {
                if std::time::Instant::now() > deadline {
                    let _ = Command::new("kill").args(["-KILL", &pid]).status();
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        })
    };
    let stderr = child.stderr.take().unwrap();
    let mut seen = String::new();
    {
        use std::io::BufRead as _;
        let mut lines = std::io::BufReader::new(stderr).lines();
        // "hvd: step `wait`" comes when Slurm reports the job running.
        for line in lines.by_ref() {
            let line = line.unwrap();
            seen.push_str(&line);
            seen.push('\n');
            if line == "hvd: step `wait`" {
                break;
            }
        }
        let kill = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
        for line in lines {
            seen.push_str(&line.unwrap());
            seen.push('\n');
        }
    }
    let status = child.wait().unwrap();
    finished.store(true, std::sync::atomic::Ordering::SeqCst);
    guard.join().unwrap();
    assert_eq!(status.code(), Some(143), "{seen}");
    assert!(seen.contains("cancelling the slurm jobs"), "{seen}");
    let wait = submitted_job(&seen, "wait");
    let train = submitted_job(&seen, "train");
    slurm.assert_state(&wait, "CANCELLED");
    slurm.assert_state(&train, "CANCELLED");
    assert_eq!(slurm.queued(), "");
    // --detach: the ids on stdout, the job runs on without hvd.
    let dir = project("step hello {\n  run = \"echo hello-detached\"\n}");
    let out = slurm.submit(dir.path(), &["--detach"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let id = stdout.trim().to_owned();
    assert!(
        !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()),
        "{stdout}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !slurm.job(&id).contains("JobState=COMPLETED") {
        assert!(std::time::Instant::now() < deadline, "{}", slurm.job(&id));
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let log = dir.path().join(format!(".hvd/slurm/t-hello-{id}.out"));
    assert_eq!(std::fs::read_to_string(log).unwrap(), "hello-detached\n");
}

#[test]
fn unchanged_slurm_batch_steps_are_not_submitted_again() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let dir = project(
        r#"step gen {
  run = "echo generated > out.txt"
  outputs = ["out.txt"]
}
step use {
  run = "cat out.txt > used.txt"
  needs = ["gen"]
  inputs = ["out.txt"]
  outputs = ["used.txt"]
}"#,
    );
    let out = slurm.submit(dir.path(), &[]);
    assert!(out.status.success(), "{}", text(&out).1);
    assert!(
        text(&out).1.contains("step `use` submitted"),
        "{}",
        text(&out).1
    );
    let out = slurm.submit(dir.path(), &[]);
    let stderr = text(&out).1;
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("submitted"), "{stderr}");
    assert!(
        stderr.contains("step `use` skipped: inputs unchanged"),
        "{stderr}"
    );
}

/// A Slurm that numbers its jobs from 1 again (a new cluster, its state cleared) gives a new job the id of an earlier
/// one whose output files are still in `.hvd/slurm/`: hvd submits each job held, moves such files aside and removes
/// such a file rendezvous, then releases it, so following the jobs never shows an earlier job's lines (before, the
/// second job's stale file was read while it waited for the first). A stale `rdv-<id>` that is a link (planted, so
/// that the job's rendezvous follows it) or a file goes as itself; the link's target is left alone.
#[test]
fn an_earlier_jobs_output_files_with_a_new_jobs_id_are_moved_aside_unread() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let dir = project(
        "step a {\n  run = \"sleep 1; echo a-fresh\"\n}\n\
         step b {\n  run = \"echo b-fresh\"\n  needs = [\"a\"]\n}",
    );
    let out_dir = dir.path().join(".hvd/slurm");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::set_permissions(
        &out_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::write(elsewhere.path().join("kept"), "kept").unwrap();
    for id in 1..=50 {
        for step in ["a", "b"] {
            for ext in ["out", "err"] {
                std::fs::write(
                    out_dir.join(format!("t-{step}-{id}.{ext}")),
                    format!("stale-line {step} {id} {ext}\n"),
                )
                .unwrap();
            }
        }
        let rdv = out_dir.join(format!("rdv-{id}"));
        match id % 3 {
            0 => std::fs::create_dir_all(&rdv).unwrap(),
            1 => std::os::unix::fs::symlink(elsewhere.path(), &rdv).unwrap(),
            _ => std::fs::write(&rdv, "x").unwrap(),
        }
    }
    let out = slurm.submit(dir.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        !stdout.contains("stale-line") && !stderr.contains("stale-line"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("a-fresh") && stdout.contains("b-fresh"),
        "{stdout}\n{stderr}"
    );
    for step in ["a", "b"] {
        let id = submitted_job(&stderr, step);
        for ext in ["out", "err"] {
            let file = out_dir.join(format!("t-{step}-{id}.{ext}"));
            assert!(
                stderr.contains(&format!(
                    "{} was an earlier job's (Slurm numbers its jobs from 1 again): moved to {}.stale-",
                    file.display(),
                    file.display()
                )),
                "{stderr}"
            );
            assert!(
                !std::fs::read_to_string(&file)
                    .unwrap()
                    .contains("stale-line")
            );
        }
        let moved: Vec<String> = std::fs::read_dir(&out_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("t-{step}-{id}.out.stale-")))
            .collect();
        assert_eq!(moved.len(), 1, "{moved:?}");
        assert_eq!(
            std::fs::read_to_string(out_dir.join(&moved[0])).unwrap(),
            format!("stale-line {step} {id} out\n")
        );
        let rdv = out_dir.join(format!("rdv-{id}"));
        assert!(std::fs::symlink_metadata(&rdv).is_err(), "{rdv:?}");
    }
    let left: Vec<_> = std::fs::read_dir(elsewhere.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["kept"], "a link's target is not removed");
}

/// The jobs' output directory holds their output and their file rendezvous (keys): the user's own left writable by
/// others is made 0700 and used; another user's (here uid 65534, as an NFS export's root_squash maps root) is
/// refused before anything is submitted, naming its owner and what to do; a new one is created 0700.
#[test]
fn the_slurm_output_directory_is_made_private_or_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let dir = project("step a {\n  run = \"echo a-ran\"\n}");
    let out_dir = dir.path().join(".hvd/slurm");
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o7777;
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::set_permissions(&out_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = slurm.submit(dir.path(), &[]);
    assert!(out.status.success(), "{}", text(&out).1);
    assert_eq!(mode(&out_dir), 0o700);
    std::fs::remove_dir_all(&out_dir).unwrap();
    std::fs::create_dir(&out_dir).unwrap();
    // Slurm's tests run as root: the directory can be given to another user.
    std::os::unix::fs::chown(&out_dir, Some(65534), None).unwrap();
    let out = slurm.submit(dir.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let said = common::unwrapped(&stderr);
    assert!(
        said.contains(&common::unwrapped(&format!(
            "`{}` belongs to uid 65534, not to this user (uid 0): its owner could plant the jobs' output files or \
             their rendezvous keys; remove it",
            out_dir.display(),
        ))) && said.contains("root_squash"),
        "{stderr}"
    );
    assert!(
        !stdout.contains("a-ran") && !stderr.contains("submitted"),
        "{stdout}\n{stderr}"
    );
    std::fs::remove_dir(&out_dir).unwrap();
    let out = slurm.submit(dir.path(), &[]);
    assert!(out.status.success(), "{}", text(&out).1);
    assert_eq!(mode(&out_dir), 0o700);
}

#[test]
fn kubernetes_style_ranks_meet_at_the_rendezvous_rank_zeros_shim_serves() {
    // What a JobSet pod runs, taken from the manifests of `hvd export k8s`: no launcher; each pod-like process gets
    // exactly the env its container defines (values as written, `HVD_JOB_TOKEN` from the Secret through
    // `secretKeyRef`, `HVD_POD_IP` from `status.podIP`), plus what Kubernetes adds (JOB_COMPLETION_INDEX, HOSTNAME).
    // The pods' IPs are 127.0.0.2 and 127.0.0.3; HVD_RENDEZVOUS names rank 0's pod, which cluster DNS would resolve
    // to its IP: here that IP itself. Rank 1 starts first and must wait for rank 0's shim to serve.
    let (python, package, lib) = allreduce_runtime();
    let dir = project(
        "cluster {\n  engine = \"kubernetes\"\n  image = \"example/train:1\"\n}\nstep train {\n  \
         run = \"$HVD_TEST_PYTHON ar.py\"\n  workers = 2\n}",
    );
    common::write_allreduce_py(dir.path(), ALLREDUCE_REPORT_PY);
    let out_dir = dir.path().join("k8s");
    let out = export_k8s(dir.path(), &out_dir);
    assert!(out.status.success(), "{}", text(&out).1);
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(out_dir.join(name)).unwrap()).unwrap()
    };
    let (secret, jobset) = (read("t.secret.json"), read("t.jobset.json"));
    let pod = &jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let port = common::free_port();
    let pod_env = |rank: u32| -> Vec<(String, String)> {
        let pod_ip = format!("127.0.0.{}", 2 + rank);
        let mut vars = common::container_env(container, &secret, Some(&pod_ip));
        for (name, value) in &mut vars {
            match name.as_str() {
                // Cluster DNS: the pod name of rank 0 is its IP here.
                "HVD_RENDEZVOUS" => {
                    assert_eq!(value, "t-train-0-0.t:29400");
                    *value = format!("127.0.0.2:{port}");
                }
                "MASTER_ADDR" => *value = "127.0.0.2".into(),
                _ => {}
            }
        }
        vars.extend([
            ("JOB_COMPLETION_INDEX".into(), rank.to_string()),
            ("HOSTNAME".into(), format!("t-train-0-{rank}")),
            ("PATH".into(), std::env::var("PATH").unwrap_or_default()),
            // What the image would have: the Python with the `hvd` package and its runtime.
            ("HVD_TEST_PYTHON".into(), python.clone()),
            ("PYTHONPATH".into(), package.display().to_string()),
            ("HVD_LIBRARY".into(), lib.display().to_string()),
        ]);
        vars
    };
    let token = secret["stringData"]["token"].as_str().unwrap();
    assert!(
        pod_env(0).contains(&("HVD_JOB_TOKEN".to_string(), token.to_owned())),
        "the token comes from the Secret"
    );
    let command: Vec<String> = container["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(command[..3], ["hvd", "worker-env", "--"]);
    let start = |rank: u32| {
        Command::new(HVD)
            .args(&command[1..])
            .current_dir(dir.path())
            .env_clear()
            .envs(pod_env(rank))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let rank1 = start(1);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let rank0 = start(0);
    for (rank, child) in [(0, rank0), (1, rank1)] {
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "rank {rank}: {stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("allreduce rank={rank} size=2 sum=3.0 ok=True")),
            "rank {rank}: {stdout}\n{stderr}"
        );
    }

    // Rank 0 is gone (its shim stopped serving when its worker ended): a rank gives up after HVD_RENDEZVOUS_WAIT
    // with a message that says what to check, instead of hanging.
    let out = Command::new(HVD)
        .args(["worker-env", "--", "true"])
        .env("JOB_COMPLETION_INDEX", "1")
        .env("HVD_SIZE", "2")
        .env("HVD_RENDEZVOUS", format!("localhost:{port}"))
        .env("HVD_RENDEZVOUS_SERVE", "1")
        .env("HVD_RENDEZVOUS_WAIT", "1")
        .env("HVD_JOB_TOKEN", "t")
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    // The report is wrapped to the terminal's width: compare its words.
    let words = common::flat_stderr(&out);
    assert!(
        words.contains("did not accept connections within") && words.contains("is rank 0 running"),
        "{stderr}"
    );
}

/// The Slurm batch chain with a binary cache and an empty node store (issue #18), while `hvd gc` runs in a loop on
/// that store: each job's per-node `hvd cache pull` gets the env, and its commands (a step without workers, then 2
/// ranks) start through `hvd worker-env --pull`, which roots it; every command waits until gc has run twice more
/// after it started, then uses the env (`greet`, an import). Once the jobs have ended nothing roots the env and gc
/// removes it (without the shims' roots the loop would have removed it before the commands used it).
#[test]
fn slurm_batch_jobs_pull_the_env_into_an_empty_store_and_hold_it_against_gc() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let counter = outside.path().join("gc-runs");
    let wait = common::gc_wait_script(&[&counter], 2);
    let p = common::pushed_fixture_env(
        root.path(),
        &outside.path().join("cache"),
        &format!(
            "step prepare {{\n  run = \"{wait} && greet\"\n}}\nstep train {{\n  run = \"{wait} && python -c \
             'import helper, sys; print(helper.WORD, sys.prefix)'\"\n  workers = 2\n  needs = [\"prepare\"]\n}}\n"
        ),
    );
    // The node's store starts empty (the built one moves away).
    let store = root.path().join("store");
    std::fs::rename(&store, root.path().join("built-store")).unwrap();
    std::fs::create_dir_all(&store).unwrap();
    let gc = {
        let (dir, store) = (root.path().to_path_buf(), store.clone());
        move || common::hvd_with_store(&dir, &store, &["gc"])
    };
    let mut looping = common::GcLoop::start(gc.clone(), Some(counter));
    looping.wait_runs(1);
    let (env, cache) = (p.env.display().to_string(), p.cache.display().to_string());
    let key = p.public_key.display().to_string();
    let out = slurm.submit_with(
        &p.project,
        &[
            "--env-dir",
            &env,
            "--cache",
            &format!("file://{cache}"),
            "--trusted-key",
            &key,
            "--grace",
            "2",
        ],
    );
    looping.stop();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("hello from greet"), "{stdout}");
    assert_eq!(
        stdout.matches(&format!("hello {env}")).count(),
        2,
        "{stdout}"
    );
    assert_eq!(slurm.queued(), "");
    // The jobs have ended: their roots are stale, and gc takes the env.
    let out = gc().output().unwrap();
    assert!(out.status.success(), "{}", text(&out).1);
    assert!(!p.env.exists(), "gc kept an env nothing roots");
}
