//! Checkpoints (issue #19 §4) on the `ssh` engine across hosts that are network namespaces with file systems of their
//! own (`common::nshosts`, `Hosts::start_private`): the project directory, the launcher's log directory among it, is
//! not on the hosts, whose ranks run in a copy of the project's files; the checkpoints are on storage every host
//! sees at the same path. Rank 0 (on the first host) reports its resume through the launcher's rendezvous, so `hvd run`
//! says so although the report file's directory does not exist where rank 0 runs; a relative `checkpoints`, which
//! would land on the hosts' own disks, is refused before any rank starts, and is fine where the hosts share the
//! project directory.
//!
//! Like tests/engine_ssh.rs, these need root, iproute2 and OpenSSH, and fail saying so where one is missing.

use std::path::Path;
use std::process::Output;

mod common;

use common::nshosts::{HOSTS, Hosts};
use common::text;

/// `CKPT_STEPS` steps of an allreduce (the file's step env: the ssh engine passes only those on), each committed and
/// checkpointed; every rank prints where it starts and, at the end, its step and `w[0]` (4 per step on 4 ranks).
const TRAIN: &str = r#"
import os
import numpy as np
import hvd

steps = int(os.environ["CKPT_STEPS"])
hvd.init()
state = hvd.elastic.ObjectState(step=0, w=np.zeros(3))


@hvd.elastic.run
def train(state):
    print("rank %d starts at step %d in %s" % (hvd.rank(), state.step, os.getcwd()), flush=True)
    while state.step < steps:
        state.w = state.w + hvd.allreduce(np.full(3, 1.0), op=hvd.Sum, name="g")
        state.step += 1
        state.commit()
        state.checkpoint()


train(state)
print("rank %d done: step %d w0 %r" % (hvd.rank(), state.step, float(state.w[0])), flush=True)
hvd.shutdown()
"#;

/// A project whose 4-worker step `train` runs [`TRAIN`] for `steps` steps with `checkpoints = "<checkpoints>"`.
fn project(steps: u32, checkpoints: &str) -> tempfile::TempDir {
    common::train_project(
        "4",
        &format!(", CKPT_STEPS = \"{steps}\""),
        &format!("  checkpoints = \"{checkpoints}\"\n"),
        TRAIN,
    )
}

/// Rewrites the project's step to run `steps` steps (the next run's copy of the project's files has it).
fn set_steps(dir: &Path, steps: u32) {
    let file = dir.join("train.hvd");
    let text = std::fs::read_to_string(&file).unwrap();
    let start = text.find("CKPT_STEPS = \"").unwrap() + "CKPT_STEPS = \"".len();
    let end = start + text[start..].find('"').unwrap();
    std::fs::write(&file, format!("{}{steps}{}", &text[..start], &text[end..])).unwrap();
}

/// Asserts that every rank started at step `from` and finished `steps` steps with the sum of all of them.
fn assert_trained(out: &Output, from: u32, steps: u32) {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..4 {
        for want in [
            format!("rank {rank} starts at step {from} in "),
            format!(
                "rank {rank} done: step {steps} w0 {:?}",
                f64::from(4 * steps)
            ),
        ] {
            assert!(stdout.contains(&want), "want `{want}`:\n{stdout}\n{stderr}");
        }
    }
}

/// The checkpoints in `dir`, oldest first.
fn checkpoints(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("ckpt-"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Every file named `name` under `dir`.
fn files_named(dir: &Path, name: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(path);
            } else if entry.file_name() == name {
                found.push(path);
            }
        }
    }
    found
}

#[test]
fn rank_zero_on_a_host_without_the_launchers_files_reports_its_resume_through_the_rendezvous() {
    let shared = tempfile::tempdir().unwrap();
    let ckpt = shared.path().join("ckpt");
    let dir = project(3, ckpt.to_str().unwrap());
    let hosts = Hosts::start_private("k", dir.path());

    let out = hosts.hvd_run(dir.path(), &[]);
    assert_trained(&out, 0, 3);
    let (stdout, stderr) = text(&out);
    // The ranks ran on both hosts in a copy of the project's files, not in the project directory, which they lack.
    let starts: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(" starts at step "))
        .collect();
    assert_eq!(starts.len(), 4, "{stdout}");
    assert!(
        starts.iter().all(|l| l.contains("/home-cache/hvd/work/")),
        "{stdout}"
    );
    for host in HOSTS {
        assert!(
            starts
                .iter()
                .any(|l| l.starts_with(&format!("[train {host}:"))),
            "{stdout}"
        );
    }
    assert!(!stderr.contains("resumed from checkpoint"), "{stderr}");
    assert_eq!(checkpoints(&ckpt).last().unwrap(), "ckpt-000000000003");

    set_steps(dir.path(), 6);
    let out = hosts.hvd_run(dir.path(), &[]);
    assert_trained(&out, 3, 6);
    let (stdout, stderr) = text(&out);
    assert!(
        format!("{stdout}{stderr}").contains(&format!(
            "[train {}:0] hvd.elastic: resumed from checkpoint at commit 3",
            HOSTS[0]
        )),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("hvd: step `train` resumed from checkpoint at commit 3"),
        "{stderr}"
    );
    // Not through the report file: rank 0 could not have written it here (its directory is not on its host).
    assert_eq!(
        files_named(&dir.path().join(".hvd"), "checkpoint.resumed"),
        Vec::<std::path::PathBuf>::new()
    );
    assert_eq!(checkpoints(&ckpt).last().unwrap(), "ckpt-000000000006");
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
    drop(hosts);

    // A relative `checkpoints` names a directory inside the project directory, which these hosts do not have: rank 0
    // would keep its checkpoints on its own host's disk. Refused before any rank starts, saying what to do.
    let relative = project(3, "ckpt/");
    let hosts = Hosts::start_private("m", relative.path());
    let out = hosts.hvd_run(relative.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let said = common::unwrapped(&stderr);
    for want in [
        format!(
            "step `train` keeps its checkpoints in {}, inside the project directory",
            relative.path().join("ckpt").display()
        ),
        format!(
            "but host `{}` does not have the project directory",
            HOSTS[0]
        ),
        "an absolute path on storage every host mounts at the same path".to_owned(),
        "`s3://bucket/prefix`".to_owned(),
    ] {
        assert!(
            said.contains(&common::unwrapped(&want)),
            "want `{want}`:\n{stderr}"
        );
    }
    assert!(!stdout.contains("[train "), "a rank ran:\n{stdout}");
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}

/// Hosts that share the project directory (the namespaces share this machine's file system) keep a relative
/// `checkpoints` where the launcher does: the next run resumes from it, and says so.
#[test]
fn a_relative_checkpoint_directory_is_fine_on_hosts_that_share_the_project_directory() {
    let dir = project(2, "ckpt/");
    let hosts = Hosts::start("n");
    let out = hosts.hvd_run(dir.path(), &[]);
    assert_trained(&out, 0, 2);
    assert_eq!(
        checkpoints(&dir.path().join("ckpt")).last().unwrap(),
        "ckpt-000000000002"
    );
    set_steps(dir.path(), 3);
    let out = hosts.hvd_run(dir.path(), &[]);
    assert_trained(&out, 2, 3);
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains("hvd: step `train` resumed from checkpoint at commit 2"),
        "{stderr}"
    );
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}
