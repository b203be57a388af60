//! How `hvd run` fails when an engine's external tool is missing or the run dir cannot be written: the error names
//! the tool or the path, with its causes (the whole `source()` chain, each cause once), and the exit code keeps its
//! class (2: the machine lacks what the engine needs and hvd can say so up front; 1: the run failed). Fake tools on
//! PATH stand in for the real ones where the run must get as far as the run dir; none of them is ever reached there.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::{HVD, text};

const STEP: &str = "step train {\n  run = \"echo hi\"\n  workers = 2\n}";

/// A project whose train.hvd holds an env with no packages, `cluster` (may be empty) and a 2-worker step.
fn project(cluster: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "project \"t\"\nenv {{\n  python = \"3.11\"\n  packages = []\n}}\n{cluster}\n{STEP}\n"
    );
    std::fs::write(dir.path().join("train.hvd"), text).unwrap();
    dir
}

/// `hvd run` of `dir`'s train.hvd with only `path` as PATH and no inherited Slurm or Kubernetes job; `slurm`: as
/// inside a Slurm allocation.
fn hvd_run(dir: &Path, path: &str, slurm: bool, args: &[&str]) -> Output {
    let mut command = Command::new(HVD);
    command
        .arg("run")
        .arg(dir.join("train.hvd"))
        .args(["--no-build", "--grace", "2"])
        .args(args)
        .env_clear()
        .env("PATH", path)
        .env("HOME", dir)
        .env("NO_COLOR", "1");
    if slurm {
        command
            .env("SLURM_JOB_ID", "1")
            .env("SLURM_NNODES", "1")
            .env("SLURM_JOB_NODELIST", "localhost")
            .env("SLURM_TASKS_PER_NODE", "2");
    }
    command.output().unwrap()
}

/// stderr as one line: miette's frame (`×`, `│`, `├─▶`, `╰─▶`) and its wrapping taken out, so that a message
/// wrapped at the terminal width still reads as written.
/// Asserts that `text` holds each of `parts`, in that order.
fn assert_says_in_order(what: &str, text: &str, parts: &[&str]) {
    let mut at = 0;
    for part in parts {
        let found = text[at..].find(part);
        assert!(found.is_some(), "{what}: `{part}` missing in order: {text}");
        at += found.unwrap_or(0) + part.len();
    }
}

fn flat(out: &Output) -> String {
    let stderr = text(out).1;
    stderr
        .split_whitespace()
        .filter(|word| !["×", "│", "├─▶", "╰─▶"].contains(word))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A directory of fake tools (`name` -> shell script body) to put first on PATH.
fn fake_tools(tools: &[(&str, &str)]) -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    for (name, body) in tools {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    dir
}

/// Never run in these tests: the run fails before any rank starts. Exits non-zero so that a run reaching it fails.
const UNREACHED: &str = "echo \"fake $0 ran\" >&2; exit 99";

/// An `ssh` that runs the remote command on this machine (`ssh [options] HOST -- COMMAND`): the ssh engine's host
/// check passes and the run goes on to its run dir.
const LOCAL_SSH: &str = r#"while [ $# -gt 0 ]; do
  case "$1" in -o|-p|-i|-F) shift 2;; -*) shift;; *) break;; esac
done
shift
[ "$1" = "--" ] && shift
exec /bin/sh -c "$*""#;

#[test]
fn a_missing_engine_tool_is_named() {
    let empty = tempfile::tempdir().unwrap();
    let path = empty.path().to_str().unwrap();
    let dir = project("");
    let kube = project("cluster {\n  engine = \"kubernetes\"\n  image = \"example/train:1\"\n}");
    // (what, the run, the exit code, what stderr must say, in this order)
    let cases: [(&str, Output, i32, &[&str]); 6] = [
        (
            "mpi",
            hvd_run(dir.path(), path, false, &["--engine", "mpi"]),
            2,
            &["`mpirun` was not found on PATH", "install OpenMPI or MPICH"],
        ),
        (
            "slurm (batch)",
            hvd_run(dir.path(), path, false, &["--engine", "slurm"]),
            2,
            &["sbatch, scontrol, scancel not on PATH", "slurm-client"],
        ),
        (
            // A distributed step's rendezvous must listen where the allocation's nodes reach it: their names come
            // from scontrol, the first tool the run needs.
            "slurm (allocation)",
            hvd_run(dir.path(), path, true, &["--engine", "slurm"]),
            2,
            &[
                "cannot run `scontrol show hostnames`",
                "is Slurm's scontrol on PATH?",
            ],
        ),
        (
            "kubernetes",
            hvd_run(kube.path(), path, false, &[]),
            2,
            &["kubectl is not on PATH", "install kubectl"],
        ),
        (
            "ssh",
            hvd_run(
                dir.path(),
                path,
                false,
                &["--engine", "ssh", "--hosts", "127.0.0.2:1,127.0.0.3:1"],
            ),
            1,
            &["failed to run `ssh`", "No such file or directory"],
        ),
        (
            "spark",
            hvd_run(dir.path(), path, false, &["--engine", "spark"]),
            2,
            &["`python3` is not on PATH", "--spark-python"],
        ),
    ];
    for (what, out, code, says) in cases {
        let stderr = flat(&out);
        assert_eq!(out.status.code(), Some(code), "{what}: {stderr}");
        assert_says_in_order(what, &stderr, says);
        assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    }
}

#[test]
fn an_unwritable_run_dir_is_named_with_its_cause() {
    // A regular file where the run dir `.hvd` must be: root cannot create directories under it either.
    let fakes = fake_tools(&[
        ("mpirun", UNREACHED),
        ("srun", UNREACHED),
        ("sbatch", UNREACHED),
        // `scontrol show hostnames LIST` as Slurm's answers for one node: inside an allocation the run reads its
        // nodes before it makes its run dir.
        ("scontrol", "echo \"$3\""),
        ("scancel", UNREACHED),
        ("kubectl", UNREACHED),
        ("python3", UNREACHED),
        ("ssh", LOCAL_SSH),
    ]);
    let path = format!("{}:/usr/bin:/bin", fakes.path().display());
    let dir = project("");
    std::fs::write(dir.path().join(".hvd"), "not a directory\n").unwrap();
    let kube = project("cluster {\n  engine = \"kubernetes\"\n  image = \"example/train:1\"\n}");
    std::fs::write(kube.path().join(".hvd"), "not a directory\n").unwrap();
    // What stderr says, in order, about a directory under `.hvd` that cannot be made.
    let unmakeable = |path: String| {
        [
            format!("failed to access `{path}"),
            format!("failed to create directory `{path}"),
            "Not a directory (os error 20)".to_owned(),
        ]
    };
    let runs = unmakeable(format!("{}/.hvd/runs/", dir.path().display()));
    let run_dir: Vec<&str> = runs.iter().map(String::as_str).collect();
    let run_dir = run_dir.as_slice();
    let slurm_access = format!("failed to access `{}/.hvd/slurm`", dir.path().display());
    let slurm_says: &[&str] = &[&slurm_access, "Not a directory (os error 20)"];
    // The spark engine writes its driver into `.hvd/spark` before the run dir exists.
    let spark = unmakeable(format!("{}/.hvd/spark`", dir.path().display()));
    let spark_says: Vec<&str> = spark.iter().map(String::as_str).collect();
    let spark_says = spark_says.as_slice();
    let k8s_dir = format!("failed to create `{}/.hvd/k8s`", kube.path().display());
    let k8s_says: &[&str] = &[&k8s_dir, "Not a directory (os error 20)"];
    let (d, k) = (dir.path(), kube.path());
    // (engine, project, inside a Slurm allocation, arguments, what stderr says in order)
    type Case<'a> = (&'a str, &'a Path, bool, &'a [&'a str], &'a [&'a str]);
    #[rustfmt::skip]
    let cases: [Case; 7] = [
        ("local", d, false, &[], run_dir),
        ("mpi", d, false, &["--engine", "mpi", "--mpi", "openmpi"], run_dir),
        ("slurm (allocation)", d, true, &["--engine", "slurm"], run_dir),
        ("slurm (batch)", d, false, &["--engine", "slurm"], slurm_says),
        ("ssh", d, false, &["--engine", "ssh", "--hosts", "127.0.0.2:1,127.0.0.3:1"], run_dir),
        ("spark", d, false, &["--engine", "spark"], spark_says),
        ("kubernetes", k, false, &[], k8s_says),
    ];
    for (what, project_dir, in_allocation, args, says) in cases {
        let out = hvd_run(project_dir, &path, in_allocation, args);
        let stderr = flat(&out);
        assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
        assert_says_in_order(what, &stderr, says);
        // Each cause once, and no fake tool was reached.
        assert_eq!(
            stderr.matches("Not a directory").count(),
            1,
            "{what}: {stderr}"
        );
        assert!(!stderr.contains("fake "), "{what}: {stderr}");
        assert!(dir.path().join(".hvd").is_file() && kube.path().join(".hvd").is_file());
    }
}
