//! The local engine with real worker processes (small sh/python scripts), through the library API.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use hvd_lang::model::{Project, Step};
use hvd_launcher::{
    Cause, Event, Interrupts, LaunchError, RunOptions, RunReport, Stream, WorkerExit, execute, plan,
};

mod common;
use common::step;

/// The test project: two GPUs a worker, and `FROM_ENV_BLOCK=yes` from its env block.
fn project(dir: &Path, steps: Vec<Step>) -> Project {
    let mut project = common::project(dir, "test", steps);
    project.env.variables = BTreeMap::from([("FROM_ENV_BLOCK".into(), "yes".into())]);
    project.resources.gpus = 2;
    project
}

fn options() -> RunOptions {
    RunOptions {
        grace: Duration::from_secs(2),
        ..RunOptions::default()
    }
}

/// Runs and collects every event.
fn run(project: &Project, options: &RunOptions) -> (RunReport, Vec<Event>) {
    let events = Mutex::new(Vec::new());
    let plan = plan(project, options).unwrap();
    let report = execute(
        &plan,
        options,
        &|e| events.lock().unwrap().push(e),
        Interrupts::none(),
    )
    .unwrap();
    (report, events.into_inner().unwrap())
}

fn lines(events: &[Event], want: Stream) -> Vec<(String, u32, String)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Line {
                step,
                rank,
                stream,
                text,
                ..
            } if *stream == want => Some((step.to_string(), *rank, text.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn every_rank_gets_the_environment_contract() {
    let dir = tempfile::tempdir().unwrap();
    let mut train = step("train", "env > env.$HVD_RANK");
    train.workers = Some(2);
    train.env.insert("FROM_STEP".into(), "1".into());
    let p = project(dir.path(), vec![train]);
    let opts = RunOptions {
        workers: Some(3),
        timeline: Some(dir.path().join("tl.json")),
        ..options()
    };
    let (report, _) = run(&p, &opts);
    assert!(report.failure.is_none(), "{:?}", report.failure);
    for rank in 0..3u32 {
        let text = std::fs::read_to_string(dir.path().join(format!("env.{rank}"))).unwrap();
        let env: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        let r = rank.to_string();
        for (name, want) in [
            ("HVD_RANK", r.as_str()),
            ("HVD_SIZE", "3"),
            ("HVD_LOCAL_RANK", &r),
            ("HVD_LOCAL_SIZE", "3"),
            ("HVD_CROSS_RANK", "0"),
            ("HVD_CROSS_SIZE", "1"),
            ("HOROVOD_RANK", &r),
            ("HOROVOD_SIZE", "3"),
            ("HOROVOD_LOCAL_RANK", &r),
            ("HOROVOD_LOCAL_SIZE", "3"),
            ("HOROVOD_CROSS_RANK", "0"),
            ("HOROVOD_CROSS_SIZE", "1"),
            ("HOROVOD_CONTROLLER", "gloo"),
            ("HOROVOD_CPU_OPERATIONS", "gloo"),
            ("HOROVOD_GLOO_IFACE", "lo"),
            ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1"),
            ("RANK", &r),
            ("WORLD_SIZE", "3"),
            ("LOCAL_RANK", &r),
            ("LOCAL_WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("PYTHONUNBUFFERED", "1"),
            ("FROM_ENV_BLOCK", "yes"),
            ("FROM_STEP", "1"),
        ] {
            assert_eq!(env.get(name).copied(), Some(want), "rank {rank}: {name}");
        }
        let gpus = format!("{},{}", rank * 2, rank * 2 + 1);
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], gpus);
        assert_eq!(
            env["HVD_TIMELINE"],
            dir.path().join("tl.json").display().to_string()
        );
        let rdv = env["HVD_RENDEZVOUS"];
        assert_eq!(
            rdv,
            format!("127.0.0.1:{}", env["HOROVOD_GLOO_RENDEZVOUS_PORT"])
        );
        assert_ne!(env["MASTER_PORT"], env["HOROVOD_GLOO_RENDEZVOUS_PORT"]);
        assert_eq!(env["HVD_JOB_TOKEN"].len(), 32);
        assert_eq!(env["HVD_HOSTNAME"], env["HOROVOD_HOSTNAME"]);
        assert!(env["OMP_NUM_THREADS"].parse::<u32>().unwrap() >= 1);
    }
}

#[test]
fn a_step_without_workers_runs_once_without_rendezvous() {
    let dir = tempfile::tempdir().unwrap();
    let p = project(
        dir.path(),
        vec![step("once", "echo ran >> count; env > env.txt")],
    );
    let opts = RunOptions {
        workers: Some(4),
        ..options()
    };
    let (report, _) = run(&p, &opts);
    assert!(report.failure.is_none());
    assert_eq!(
        std::fs::read_to_string(dir.path().join("count")).unwrap(),
        "ran\n"
    );
    let env = std::fs::read_to_string(dir.path().join("env.txt")).unwrap();
    assert!(
        !env.contains("HVD_RENDEZVOUS="),
        "no rendezvous for a single run"
    );
}

#[test]
fn env_dir_bin_comes_first_on_path() {
    let dir = tempfile::tempdir().unwrap();
    let env_dir = dir.path().join("venv");
    std::fs::create_dir_all(env_dir.join("bin")).unwrap();
    let tool = env_dir.join("bin/hvd-test-tool");
    std::fs::write(&tool, "#!/bin/sh\necho from-env \"$VIRTUAL_ENV\"\n").unwrap();
    std::os::unix::fs::PermissionsExt::set_mode(
        &mut std::fs::metadata(&tool).unwrap().permissions(),
        0o755,
    );
    std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let p = project(dir.path(), vec![step("s", "hvd-test-tool")]);
    let (report, events) = run(
        &p,
        &RunOptions {
            env_dir: Some(env_dir.clone()),
            ..options()
        },
    );
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert_eq!(
        lines(&events, Stream::Stdout),
        [("s".into(), 0, format!("from-env {}", env_dir.display()))]
    );
}

#[test]
fn workers_exchange_addresses_through_the_rendezvous() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import http.client, os
host, port = os.environ["HVD_RENDEZVOUS"].rsplit(":", 1)
rank, size = int(os.environ["HVD_RANK"]), int(os.environ["HVD_SIZE"])
hdrs = {"Authorization": "Bearer " + os.environ["HVD_JOB_TOKEN"], "X-Hvd-Rank": str(rank)}
def req(method, path, body=b""):
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request(method, path, body=body, headers=hdrs)
    r = c.getresponse()
    return r.status, r.read()
assert req("PUT", "/kv/hvd/addr.%d" % rank, b"addr-of-%d" % rank)[0] == 200
got = []
for other in range(size):
    status, body = req("GET", "/kv/hvd/addr.%d?wait_ms=20000" % other)
    assert status == 200, status
    got.append(body.decode())
print(",".join(got))
"#;
    std::fs::write(dir.path().join("rdv.py"), script).unwrap();
    let mut train = step("train", "python3 rdv.py");
    train.workers = Some(4);
    let p = project(dir.path(), vec![train]);
    let opts = RunOptions {
        start_timeout: Some(Duration::from_secs(60)),
        ..options()
    };
    let (report, events) = run(&p, &opts);
    assert!(report.failure.is_none(), "{:?}", report.failure);
    let out = lines(&events, Stream::Stdout);
    assert_eq!(out.len(), 4);
    for (_, _, text) in out {
        assert_eq!(text, "addr-of-0,addr-of-1,addr-of-2,addr-of-3");
    }
}

#[test]
fn steps_run_after_what_they_need_and_independent_ones_in_parallel() {
    let dir = tempfile::tempdir().unwrap();
    // b and c both wait for each other's marker: they only finish if they run at the same time.
    let a = step("a", "touch a.done");
    let mut b = step(
        "b",
        "test -f a.done && touch b.started && for i in $(seq 200); do test -f c.started && exit 0; sleep 0.05; done; exit 1",
    );
    b.needs = vec!["a".into()];
    let mut c = step(
        "c",
        "test -f a.done && touch c.started && for i in $(seq 200); do test -f b.started && exit 0; sleep 0.05; done; exit 1",
    );
    c.needs = vec!["a".into()];
    let mut d = step("d", "test -f b.started && test -f c.started && echo last");
    d.needs = vec!["b".into(), "c".into()];
    let p = project(dir.path(), vec![d, c, b, a]);
    let (report, events) = run(&p, &options());
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert_eq!(report.ran.first().map(String::as_str), Some("a"));
    assert_eq!(report.ran.last().map(String::as_str), Some("d"));
    assert_eq!(
        lines(&events, Stream::Stdout),
        [("d".into(), 0, "last".into())]
    );
}

#[test]
fn step_selection_takes_what_the_step_needs() {
    let dir = tempfile::tempdir().unwrap();
    let a = step("a", "true");
    let mut b = step("b", "true");
    b.needs = vec!["a".into()];
    let c = step("c", "true");
    let p = project(dir.path(), vec![a, b, c]);
    let plan = plan(
        &p,
        &RunOptions {
            step: Some("b".into()),
            ..options()
        },
    )
    .unwrap();
    let names: Vec<_> = plan.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert!(plan.render().contains("2. step b"));
    let err = hvd_launcher::plan(
        &p,
        &RunOptions {
            step: Some("x".into()),
            ..options()
        },
    )
    .unwrap_err();
    assert!(matches!(err, LaunchError::UnknownStep { .. }), "{err}");
}

#[test]
fn bad_graphs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = step("a", "true");
    a.needs = vec!["b".into()];
    let mut b = step("b", "true");
    b.needs = vec!["a".into()];
    assert!(matches!(
        plan(&project(dir.path(), vec![a.clone(), b]), &options()),
        Err(LaunchError::Cycle(_))
    ));
    // An engine is a name of the language's list: one it does not know never reaches a plan.
    let err = "yarn".parse::<hvd_lang::model::EngineKind>().unwrap_err();
    assert!(err.to_string().contains("unknown engine `yarn`"), "{err}");
    a.needs = vec!["nope".into()];
    assert!(matches!(
        plan(&project(dir.path(), vec![a]), &options()),
        Err(LaunchError::UnknownNeed { .. })
    ));
}

#[test]
fn unchanged_steps_are_skipped_and_changes_rerun_them() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("in.txt"), "v1").unwrap();
    let mut prep = step(
        "prep",
        "echo ran >> prep.log; mkdir -p out; cat in.txt > out/data",
    );
    prep.inputs = vec!["in.txt".into()];
    prep.outputs = vec!["out".into()];
    let mut train = step("train", "echo ran >> train.log; cat out/data > model");
    train.needs = vec!["prep".into()];
    train.outputs = vec!["model".into()];
    let p = project(dir.path(), vec![prep, train]);
    let count = |f: &str| {
        std::fs::read_to_string(dir.path().join(f))
            .unwrap()
            .lines()
            .count()
    };

    let (r1, _) = run(&p, &options());
    assert_eq!((r1.ran.len(), r1.skipped.len()), (2, 0));
    let (r2, events) = run(&p, &options());
    assert_eq!(r2.skipped, ["prep", "train"]);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::StepSkipped { step } if step == "prep"))
    );
    assert_eq!((count("prep.log"), count("train.log")), (1, 1));

    // A changed input reruns the step, and its changed output reruns the next one.
    std::fs::write(dir.path().join("in.txt"), "v2").unwrap();
    let (r3, _) = run(&p, &options());
    assert_eq!(r3.ran, ["prep", "train"]);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("model")).unwrap(),
        "v2"
    );

    // A deleted output reruns the step that makes it, but not the upstream one.
    std::fs::remove_file(dir.path().join("model")).unwrap();
    let (r4, _) = run(&p, &options());
    assert_eq!(
        (r4.skipped.as_slice(), r4.ran.as_slice()),
        (&["prep".to_string()][..], &["train".to_string()][..])
    );

    // --force reruns everything; a different env hash does too.
    let (r5, _) = run(
        &p,
        &RunOptions {
            force: true,
            ..options()
        },
    );
    assert_eq!(r5.ran.len(), 2);
    let (r6, _) = run(
        &p,
        &RunOptions {
            env_hash: Some("other-env".into()),
            ..options()
        },
    );
    assert_eq!(r6.ran.len(), 2);
    assert_eq!(count("prep.log"), 4);
}

#[test]
fn output_is_split_into_prefixed_lines_and_kept_per_rank() {
    let dir = tempfile::tempdir().unwrap();
    let mut train = step(
        "train",
        r"printf 'a%s\r\nb\rc\n' $HVD_RANK; printf 'oops %s\n' $HVD_RANK >&2; printf tail",
    );
    train.workers = Some(2);
    let p = project(dir.path(), vec![train]);
    let (report, events) = run(&p, &options());
    assert!(report.failure.is_none());
    let mut out = lines(&events, Stream::Stdout);
    out.sort();
    let want: Vec<(String, u32, String)> = [
        (0, "a0"),
        (0, "b"),
        (0, "c"),
        (0, "tail"),
        (1, "a1"),
        (1, "b"),
        (1, "c"),
        (1, "tail"),
    ]
    .into_iter()
    .map(|(r, t)| ("train".to_string(), r, t.to_string()))
    .collect();
    let mut want = want;
    want.sort();
    assert_eq!(out, want);
    for rank in 0..2 {
        let rank_dir = report.log_dir.join(format!("train/rank.{rank}"));
        assert_eq!(
            std::fs::read_to_string(rank_dir.join("stdout")).unwrap(),
            format!("a{rank}\r\nb\rc\ntail")
        );
        assert_eq!(
            std::fs::read_to_string(rank_dir.join("stderr")).unwrap(),
            format!("oops {rank}\n")
        );
    }
    assert!(report.log_dir.starts_with(dir.path().join(".hvd/runs")));
}

#[test]
fn first_failure_stops_the_others_and_is_the_root_cause() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 2 fails; the others would run for minutes and ignore nothing: SIGTERM ends them.
    let mut train = step(
        "train",
        r#"if [ "$HVD_RANK" = 2 ]; then for i in $(seq 30); do echo "line $i" >&2; done; exit 7; fi; exec sleep 300"#,
    );
    train.workers = Some(4);
    let mut after = step("after", "touch after.ran");
    after.needs = vec!["train".into()];
    let p = project(dir.path(), vec![train, after]);
    let (report, events) = run(&p, &options());
    let failure = report.failure.expect("the run failed");
    assert_eq!(
        failure.cause,
        Cause::Worker {
            rank: 2,
            host: hvd_launcher::env::local_hostname(),
            exit: WorkerExit::Code(7)
        }
    );
    assert_eq!(failure.exit_code, 7);
    let want: Vec<String> = (11..=30).map(|i| format!("line {i}")).collect();
    assert_eq!(failure.stderr_tail, want);
    assert!(events.iter().any(|e| matches!(e, Event::Stopping { .. })));
    assert!(
        !dir.path().join("after.ran").exists(),
        "nothing runs after a failure"
    );
}

#[test]
fn a_worker_ignoring_sigterm_is_killed_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let mut train = step(
        "train",
        r#"if [ "$HVD_RANK" = 0 ]; then while [ ! -f ready ]; do sleep 0.01; done; exit 3; fi; trap '' TERM; touch ready; while true; do sleep 0.1; done"#,
    );
    train.workers = Some(2);
    let p = project(dir.path(), vec![train]);
    let (report, _) = run(
        &p,
        &RunOptions {
            grace: Duration::from_millis(300),
            ..options()
        },
    );
    let failure = report.failure.unwrap();
    assert_eq!(failure.exit_code, 3);
    assert!(matches!(failure.cause, Cause::Worker { rank: 0, .. }));
}

#[test]
fn step_timeout_stops_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut slow = step("slow", "exec sleep 300");
    slow.timeout_ms = Some(200);
    slow.workers = Some(2);
    let p = project(dir.path(), vec![slow]);
    let (report, _) = run(&p, &options());
    let failure = report.failure.unwrap();
    assert_eq!(
        failure.cause,
        Cause::Timeout {
            after: Duration::from_millis(200)
        }
    );
    assert_eq!(failure.exit_code, 124);
}

#[test]
fn start_timeout_names_the_ranks_that_never_joined() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 joins (an authenticated request), rank 1 never talks to the rendezvous.
    let script = r#"
import http.client, os, sys, time
if os.environ["HVD_RANK"] == "0":
    host, port = os.environ["HVD_RENDEZVOUS"].rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("PUT", "/kv/hvd/addr.0", body=b"x", headers={"Authorization": "Bearer " + os.environ["HVD_JOB_TOKEN"], "X-Hvd-Rank": "0"})
    assert c.getresponse().status == 200
time.sleep(300)
"#;
    std::fs::write(dir.path().join("join.py"), script).unwrap();
    let mut train = step("train", "exec python3 join.py");
    train.workers = Some(2);
    let p = project(dir.path(), vec![train]);
    let (report, _) = run(
        &p,
        &RunOptions {
            start_timeout: Some(Duration::from_secs(3)),
            ..options()
        },
    );
    let failure = report.failure.unwrap();
    assert!(
        matches!(&failure.cause, Cause::StartTimeout { missing, .. } if missing == &[1]),
        "{:?}",
        failure.cause
    );
}

#[test]
fn processes_that_leave_the_worker_group_end_with_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let marker = format!("escaped-{}-{}", std::process::id(), dir.path().display());
    // One escapee holds the stdout pipe, one does not; both started their own session.
    let mut s = step(
        "s",
        "setsid sleep 300 & setsid sh -c 'sleep 300' >/dev/null 2>&1 & sleep 0.3; echo started",
    );
    s.env.insert("HVD_TEST_MARKER".into(), marker.clone());
    let p = project(dir.path(), vec![s]);
    let (report, events) = run(&p, &options());
    assert!(report.failure.is_none());
    assert_eq!(
        lines(&events, Stream::Stdout),
        [("s".into(), 0, "started".into())]
    );
    let needle = format!("HVD_TEST_MARKER={marker}");
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == needle.as_bytes()))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, Vec::<String>::new(), "escaped processes left running");
}
