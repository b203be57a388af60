//! An elastic step on Kubernetes: `hvd export k8s` writes a launcher pod (`hvd run --step S --no-deps --engine
//! kubernetes`, the .hvd file from a ConfigMap) and worker pods that wait; in the launcher pod the kubernetes engine
//! finds the worker pods with `kubectl get pods` and starts each rank with `kubectl exec`. Tested as the other
//! Kubernetes tests are (tests/cli_engines.rs, tests/k8s_delivery.rs): no cluster. The launcher pod is a process
//! with exactly its container's command and env (the ConfigMap and the state volume at their mount paths under a
//! temporary directory, the pod IP 127.0.0.1); a fake `kubectl` serves a cluster of worker "pods": `get pods` lists
//! the running ones, `exec` runs the command here in the image's working directory (the project), marked with the
//! pod's name so that the test can lose a pod whole.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{HVD, text};

/// The fake cluster's kubectl: `$FAKE_K8S/pods/NAME` is a running pod; every call is logged to `$FAKE_K8S/calls`.
const FAKE_KUBECTL: &str = r#"#!/bin/sh
printf '%s\n' "$*" >> "$FAKE_K8S/calls"
case $1 in
get)
  for p in "$FAKE_K8S"/pods/*; do [ -e "$p" ] && printf '%s:1\n' "${p##*/}"; done
  exit 0 ;;
exec)
  shift
  [ "$1" = -i ] && shift
  [ "$1" = -n ] && shift 2
  pod=$1; shift
  [ "$1" = -c ] && shift 2
  [ "$1" = -- ] && shift
  if [ ! -e "$FAKE_K8S/pods/$pod" ]; then
    echo "Error from server (NotFound): pods \"$pod\" not found" >&2; exit 1
  fi
  cd "$FAKE_K8S/workdir" || exit 1
  FAKE_POD=$pod exec "$@" ;;
esac
echo "fake kubectl: unexpected: $*" >&2
exit 1
"#;

/// The exported manifests of `dir`'s project.
fn export(dir: &Path) -> (serde_json::Value, serde_json::Value, serde_json::Value) {
    let out_dir = dir.join("k8s-out");
    let out = Command::new(HVD)
        .args(["export", "k8s"])
        .arg(dir.join("train.hvd"))
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(out_dir.join(name)).unwrap()).unwrap()
    };
    (
        read("t.jobset.json"),
        read("t.configmap.json"),
        read("t.secret.json"),
    )
}

fn replicated<'a>(jobset: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    jobset["spec"]["replicatedJobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["name"] == name)
        .unwrap_or_else(|| panic!("no replicated job {name}: {jobset}"))
}

/// Kills every process of `pod` (its ranks, their shells, the exec sessions) at once and removes it from the
/// cluster: a lost pod (its node died).
fn lose_pod(cluster: &Path, pod: &str) {
    std::fs::remove_file(cluster.join("pods").join(pod)).unwrap();
    for (pid, _) in common::processes_with_env(&format!("FAKE_POD={pod}")) {
        // SAFETY: kill has no memory preconditions.
        unsafe { libc_kill(pid as i32, 9) };
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: i32) -> i32;
}

/// The launcher pod: its container's command (`hvd` the binary under test; the mounts under `root`) with its env,
/// PATH with the fake kubectl first.
fn launcher_pod(
    jobset: &serde_json::Value,
    config_map: &serde_json::Value,
    secret: &serde_json::Value,
    root: &Path,
    bin: &Path,
) -> Command {
    let spec = &replicated(jobset, "train")["template"]["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    // The volumes: the ConfigMap's files, and an empty state directory.
    let mut mounts: Vec<(String, PathBuf)> = Vec::new();
    for mount in container["volumeMounts"].as_array().unwrap() {
        let path = mount["mountPath"].as_str().unwrap().to_owned();
        let here = root.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(&here).unwrap();
        let volume = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        if volume["configMap"]["name"] == config_map["metadata"]["name"] {
            for (file, content) in config_map["data"].as_object().unwrap() {
                std::fs::write(here.join(file), content.as_str().unwrap()).unwrap();
            }
        } else {
            assert!(volume["emptyDir"].is_object(), "{volume}");
        }
        mounts.push((path, here));
    }
    let argv: Vec<String> = container["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let mut a = a.as_str().unwrap().to_owned();
            for (path, here) in &mounts {
                a = a.replace(path.as_str(), &here.display().to_string());
            }
            a
        })
        .collect();
    assert_eq!(argv[0], "hvd", "{argv:?}");
    let mut command = Command::new(HVD);
    command.args(&argv[1..]);
    command.env_clear();
    command.envs(common::pod_env(
        container,
        secret,
        Some("127.0.0.1"),
        Some("ml"),
    ));
    command
        .env(
            "PATH",
            format!(
                "{}:{}",
                bin.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .env("HOME", root)
        .env("NO_COLOR", "1")
        .env("FAKE_K8S", bin)
        .current_dir(root);
    command
}

/// Four worker pods (and a hostile name in `get pods`' output, never used), elastic minimum 2: one pod is lost while slot 0 waits at step 5 (its ranks, shells and exec
/// sessions killed at once, and gone from `get pods`), and the Job's new pod in its place appears. The launcher pod's
/// `hvd run` counts the rank lost, the three survivors re-form, the new pod is found by its discovery and its rank
/// joins at a commit; the four finish together with every committed step once, and nothing is left running.
#[test]
fn a_launcher_pod_replaces_a_lost_worker_pod_through_kubectl() {
    let marker = common::unique_marker("k8s-elastic");
    let steps = 10;
    let dir = common::elastic::project(
        "{ min = 2, max = 4 }",
        steps,
        &format!(", ELASTIC_PAUSE = \"5\", ELASTIC_UNTIL = \"4\", HVD_TEST_MARKER = \"{marker}\""),
    );
    common::append_to_project(
        dir.path(),
        "cluster {\n  engine = \"kubernetes\"\n  image = \"img\"\n  namespace = \"ml\"\n}",
    );
    let (jobset, config_map, secret) = export(dir.path());
    // The worker pods wait for ranks, as many as the step's maximum; the JobSet is done when the launcher is.
    let workers = &replicated(&jobset, "train-workers")["template"]["spec"];
    assert_eq!(workers["parallelism"], 4, "{workers}");
    assert_eq!(
        jobset["spec"]["successPolicy"],
        serde_json::json!({ "operator": "All", "targetReplicatedJobs": ["train"] })
    );
    let root = tempfile::tempdir().unwrap();
    let bin = root.path().join("cluster");
    std::fs::create_dir_all(bin.join("pods")).unwrap();
    std::os::unix::fs::symlink(dir.path(), bin.join("workdir")).unwrap();
    let kubectl = bin.join("kubectl");
    std::fs::write(&kubectl, FAKE_KUBECTL).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&kubectl, std::fs::Permissions::from_mode(0o755)).unwrap();
    let pod = |index: u32, suffix: &str| format!("t-train-workers-0-{index}-{suffix}");
    for index in 0..4 {
        std::fs::write(bin.join("pods").join(pod(index, "aaaaa")), "").unwrap();
    }
    // What `get pods` prints is the API server's: a "pod" named like a kubectl option is never exec'd into.
    std::fs::write(bin.join("pods").join("--kubeconfig=evil"), "").unwrap();
    let mut child = launcher_pod(&jobset, &config_map, &secret, root.path(), &bin)
        .args(["--grace", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !dir.path().join("paused").exists() {
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            let (stdout, stderr) = text(&out);
            panic!("slot 0 did not reach the pause:\n{stdout}\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    lose_pod(&bin, &pod(2, "aaaaa"));
    std::fs::write(bin.join("pods").join(pod(2, "bbbbb")), "").unwrap();
    std::fs::write(dir.path().join("go"), "").unwrap();
    let out = wait_within(child, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    let calls = std::fs::read_to_string(bin.join("calls")).unwrap();
    let all = format!("{stdout}\n{stderr}\n{calls}");
    assert!(out.status.success(), "{all}");
    let flat = common::flat_stderr(&out);
    assert!(flat.contains("rank 2 of step `train` was lost"), "{all}");
    assert!(
        flat.contains(&format!(
            "host discovery found 4 slots for step `train`: started rank 4 on {}",
            pod(2, "bbbbb")
        )),
        "{all}"
    );
    // Each rank's lines carry its pod.
    assert!(
        stdout.contains(&format!(
            "[train {}:3] slot 3 starts as rank 3 of 4",
            pod(3, "aaaaa")
        )),
        "{all}"
    );
    common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (3, 2), (4, 3)]);
    // Discovery asked for the step's running worker pods in the namespace; each rank went through `kubectl exec`
    // into its pod's worker container, the job token on its stdin only.
    let selector =
        "jobset.sigs.k8s.io/jobset-name=t,jobset.sigs.k8s.io/replicatedjob-name=train-workers";
    assert!(
        calls.lines().any(|c| c.starts_with(&format!(
            "get pods -n ml -l {selector} --field-selector=status.phase=Running -o jsonpath="
        ))),
        "{calls}"
    );
    for index in [0, 1, 3] {
        let exec = format!(
            "exec -i -n ml {} -c worker -- /bin/sh -c exec /bin/sh -c ",
            pod(index, "aaaaa")
        );
        assert!(
            calls.lines().any(|c| c.starts_with(&exec)),
            "{exec}\n{calls}"
        );
    }
    assert!(!calls.contains("HVD_JOB_TOKEN="), "{calls}");
    assert!(!calls.contains("exec -i -n ml --kubeconfig"), "{calls}");
    assert!(
        flat.contains("host discovery found host `--kubeconfig=evil` for step `train`, but it cannot run workers"),
        "{all}"
    );
    // No rank is told a MASTER_ADDR: rank 0's pod is not known when a rank starts, and a pod's name is no address.
    assert!(!calls.contains("MASTER_ADDR"), "{calls}");
    // The run's state went to the state volume, not next to the (read-only) file.
    assert!(root.path().join("var/run/hvd/state/runs").is_dir(), "{all}");
    assert!(
        !root.path().join("var/run/hvd/project/.hvd").exists(),
        "{all}"
    );
    common::assert_nothing_left(&marker);
}

/// `child`'s output once it ends, killing it (and failing) past `within`.
fn wait_within(mut child: std::process::Child, within: Duration) -> Output {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let out = child.wait_with_output().unwrap();
            let (stdout, stderr) = text(&out);
            panic!("the launcher pod did not finish within {within:?}:\n{stdout}\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}
