//! An elastic step on Kubernetes: `hvd export k8s` writes a launcher pod (`hvd run --step S --no-deps --engine
//! kubernetes`, the .hvd file from a ConfigMap) and worker pods that wait; in the launcher pod the kubernetes engine
//! finds the worker pods with `kubectl get pods` and starts each rank with `kubectl exec`. Tested as the other
//! Kubernetes tests are (tests/cli_engines.rs, tests/k8s_delivery.rs): no cluster. The launcher pod is a process
//! with exactly its container's command and env (the ConfigMap and the state volume at their mount paths under a
//! temporary directory, the pod IP 127.0.0.1). Each worker pod is its container's command (the exported one) as PID 1
//! of a PID namespace of its own (`unshare --pid --mount-proc`), with its container's env and the project as the
//! image's working directory: as in a container, the pod's processes see only each other and all die with PID 1, and
//! the kubelet's SIGTERM reaches PID 1 only. A fake `kubectl` serves them: `get pods` lists the running ones, `exec`
//! runs the command in the pod (`nsenter` into its namespaces, the container's env and working directory).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{HVD, text};

/// The fake cluster's kubectl: `$FAKE_K8S/pods/NAME/` is a running pod (`pid`: its PID 1 as seen here, `env`: its
/// container's environment as shell assignments, `deleting`: its deletion time once it is being deleted); `get pods`
/// prints what the launcher's jsonpath asks for (`NAME:1 DELETION-TIME`); every call is logged to `$FAKE_K8S/calls`.
const FAKE_KUBECTL: &str = r#"#!/bin/sh
printf '%s\n' "$*" >> "$FAKE_K8S/calls"
case $1 in
get)
  for p in "$FAKE_K8S"/pods/*; do
    [ -e "$p/pid" ] || continue
    if [ -e "$p/deleting" ]; then printf '%s:1 %s\n' "${p##*/}" "$(cat "$p/deleting")"; else printf '%s:1 \n' "${p##*/}"; fi
  done
  exit 0 ;;
exec)
  shift
  [ "$1" = -i ] && shift
  [ "$1" = -n ] && shift 2
  pod=$1; shift
  [ "$1" = -c ] && shift 2
  [ "$1" = -- ] && shift
  if [ ! -e "$FAKE_K8S/pods/$pod/pid" ]; then
    echo "Error from server (NotFound): pods \"$pod\" not found" >&2; exit 1
  fi
  exec env -i /usr/bin/nsenter -t "$(cat "$FAKE_K8S/pods/$pod/pid")" -p -m --wd="$FAKE_K8S/workdir" \
    /bin/sh -c '. "$0"; exec "$@"' "$FAKE_K8S/pods/$pod/env" "$@" ;;
esac
echo "fake kubectl: unexpected: $*" >&2
exit 1
"#;

/// The fake cluster: its directory (kubectl, `pods/`, `calls`, `workdir` -> the project) and its worker pods.
struct Cluster {
    dir: PathBuf,
    /// The worker container's command and env (from the JobSet).
    command: Vec<String>,
    env: Vec<(String, String)>,
    pods: Vec<(String, Child)>,
}

impl Cluster {
    fn new(
        root: &Path,
        project: &Path,
        worker: &serde_json::Value,
        secret: &serde_json::Value,
    ) -> Cluster {
        Self::with_path(
            root,
            project,
            worker,
            secret,
            &std::env::var("PATH").unwrap_or_default(),
        )
    }

    /// [`Cluster::new`] whose image has `path` for PATH.
    fn with_path(
        root: &Path,
        project: &Path,
        worker: &serde_json::Value,
        secret: &serde_json::Value,
        path: &str,
    ) -> Cluster {
        let dir = root.join("cluster");
        std::fs::create_dir_all(dir.join("pods")).unwrap();
        std::os::unix::fs::symlink(project, dir.join("workdir")).unwrap();
        let kubectl = dir.join("kubectl");
        std::fs::write(&kubectl, FAKE_KUBECTL).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&kubectl, std::fs::Permissions::from_mode(0o755)).unwrap();
        let command = worker["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect();
        // The container's variables, and the image's PATH.
        let mut env = common::pod_env(worker, secret, None, Some("ml"));
        env.push(("PATH".into(), path.to_owned()));
        Cluster {
            dir,
            command,
            env,
            pods: Vec::new(),
        }
    }

    /// Starts pod `name`: its container's command as PID 1 of a new PID namespace, in the project directory.
    fn start(&mut self, name: &str) {
        let pod = self.dir.join("pods").join(name);
        std::fs::create_dir_all(&pod).unwrap();
        let quoted: String = self
            .env
            .iter()
            .map(|(k, v)| format!("export {k}='{}'\n", v.replace('\'', "'\\''")))
            .collect();
        std::fs::write(pod.join("env"), quoted).unwrap();
        let child = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "--kill-child", "--"])
            .args(&self.command)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(self.dir.join("workdir"))
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        // PID 1 of the pod: unshare's child.
        let children = format!("/proc/{0}/task/{0}/children", child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        let init = loop {
            let text = std::fs::read_to_string(&children).unwrap_or_default();
            if let Some(pid) = text.split_whitespace().next() {
                break pid.to_owned();
            }
            assert!(Instant::now() < deadline, "pod {name} did not start");
            std::thread::sleep(Duration::from_millis(10));
        };
        std::fs::write(pod.join("pid"), init).unwrap();
        self.pods.push((name.to_owned(), child));
    }

    fn init(&self, name: &str) -> i32 {
        std::fs::read_to_string(self.dir.join("pods").join(name).join("pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// Pod `name` is lost (its node died): PID 1 killed, so every process of the pod dies at once; gone from the
    /// API.
    fn lose(&mut self, name: &str) {
        let init = self.init(name);
        std::fs::remove_dir_all(self.dir.join("pods").join(name)).unwrap();
        // SAFETY: kill has no memory preconditions.
        unsafe { libc_kill(init, 9) };
        self.wait(name);
    }

    /// Pod `name` is evicted (spot reclaim, a drained node): the kubelet's SIGTERM to its PID 1. Returns how it
    /// ended.
    fn evict(&mut self, name: &str) -> std::process::ExitStatus {
        // The API server marks it first: terminating, still `Running`.
        std::fs::write(
            self.dir.join("pods").join(name).join("deleting"),
            "2026-12-03T12:00:00Z",
        )
        .unwrap();
        // SAFETY: kill has no memory preconditions.
        unsafe { libc_kill(self.init(name), 15) };
        let status = self.wait(name);
        std::fs::remove_dir_all(self.dir.join("pods").join(name)).unwrap();
        status
    }

    /// The end of pod `name` (its `unshare` ends with PID 1's status), within 60 s.
    fn wait(&mut self, name: &str) -> std::process::ExitStatus {
        let i = self.pods.iter().position(|(n, _)| n == name).unwrap();
        let (_, mut child) = self.pods.remove(i);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "pod {name} did not end");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn calls(&self) -> String {
        std::fs::read_to_string(self.dir.join("calls")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    /// The JobSet is done: its worker pods are deleted (SIGTERM; with no rank left they end at once).
    fn drop(&mut self) {
        for (_, child) in &mut self.pods {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: i32) -> i32;
}

/// The exported manifests of `dir`'s project.
fn export(dir: &Path) -> (serde_json::Value, serde_json::Value, serde_json::Value) {
    let out_dir = dir.join("k8s-out");
    let mut command = Command::new(HVD);
    command
        .args(["export", "k8s"])
        .arg(dir.join("train.hvd"))
        .arg("--out")
        .arg(&out_dir);
    exported(command, &out_dir, "t")
}

/// The manifests (JobSet, ConfigMap, Secret) of JobSet `name` that `command` (an `hvd export k8s`) writes to
/// `out_dir`.
fn exported(
    mut command: Command,
    out_dir: &Path,
    name: &str,
) -> (serde_json::Value, serde_json::Value, serde_json::Value) {
    let out = command.output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    manifests(out_dir, name)
}

/// The manifests (JobSet, ConfigMap, Secret) of JobSet `name` in `out_dir`, as an export wrote them.
fn manifests(
    out_dir: &Path,
    name: &str,
) -> (serde_json::Value, serde_json::Value, serde_json::Value) {
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(out_dir.join(name)).unwrap()).unwrap()
    };
    (
        read(&format!("{name}.jobset.json")),
        read(&format!("{name}.configmap.json")),
        read(&format!("{name}.secret.json")),
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

/// The launcher pod: its container's command (`hvd` the binary under test; the mounts under `root`) with its env,
/// PATH with the fake kubectl first.
fn launcher_pod(
    jobset: &serde_json::Value,
    config_map: &serde_json::Value,
    secret: &serde_json::Value,
    root: &Path,
    bin: &Path,
) -> Command {
    launcher_pod_with_path(
        jobset,
        config_map,
        secret,
        root,
        bin,
        &std::env::var("PATH").unwrap_or_default(),
    )
}

/// [`launcher_pod`] whose image has `path` for PATH.
fn launcher_pod_with_path(
    jobset: &serde_json::Value,
    config_map: &serde_json::Value,
    secret: &serde_json::Value,
    root: &Path,
    bin: &Path,
    path: &str,
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
            // Each key at its item's path (a file the .hvd file imports in a directory of its own included).
            for item in volume["configMap"]["items"].as_array().unwrap() {
                let path = here.join(item["path"].as_str().unwrap());
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                let key = item["key"].as_str().unwrap();
                std::fs::write(path, config_map["data"][key].as_str().unwrap()).unwrap();
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
        .env("PATH", format!("{}:{path}", bin.display()))
        .env("HOME", root)
        .env("NO_COLOR", "1")
        .env("FAKE_K8S", bin)
        .current_dir(root);
    command
}

/// A project whose elastic step `train` (2 to 4 workers) runs the elastic training script with `env`, exported;
/// the launcher pod started against a fake cluster of four worker pods (`t-train-workers-0-N-aaaaa`), with slot 0
/// paused at step 5 (the test acts there, then writes `go`). Returns the cluster, the launcher and the project.
struct Run {
    cluster: Cluster,
    launcher: Child,
    project: tempfile::TempDir,
    /// The launcher pod's mounts and the cluster live under it.
    root: tempfile::TempDir,
}

fn pod(index: u32, suffix: &str) -> String {
    format!("t-train-workers-0-{index}-{suffix}")
}

/// The exported project (`env`: more of the step's variables) and a fake cluster for it, without pods yet; the
/// launcher pod's command.
fn prepare(marker: &str, env: &str) -> (tempfile::TempDir, tempfile::TempDir, Cluster, Command) {
    let project = common::elastic::project(
        "{ min = 2, max = 4 }",
        10,
        &format!(", HVD_TEST_MARKER = \"{marker}\"{env}"),
    );
    common::append_to_project(
        project.path(),
        "cluster {\n  engine = \"kubernetes\"\n  image = \"img\"\n  namespace = \"ml\"\n}",
    );
    // The file imports one of its own, in a directory of its own: the launcher pod gets both.
    std::fs::create_dir_all(project.path().join("lib")).unwrap();
    std::fs::write(
        project.path().join("lib/settings.hvd"),
        "let image = \"img\"\n",
    )
    .unwrap();
    let file = project.path().join("train.hvd");
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(
        &file,
        format!(
            "import \"./lib/settings.hvd\" as settings\n{}",
            text.replace("image = \"img\"", "image = settings.image")
        ),
    )
    .unwrap();
    let (jobset, config_map, secret) = export(project.path());
    // The worker pods wait for ranks, as many as the step's maximum; the JobSet is done when the launcher is.
    let workers = &replicated(&jobset, "train-workers")["template"]["spec"];
    assert_eq!(workers["parallelism"], 4, "{workers}");
    assert_eq!(
        jobset["spec"]["successPolicy"],
        serde_json::json!({ "operator": "All", "targetReplicatedJobs": ["train"] })
    );
    let root = tempfile::tempdir().unwrap();
    let worker = &workers["template"]["spec"]["containers"][0];
    let cluster = Cluster::new(root.path(), project.path(), worker, &secret);
    let launcher = launcher_pod(&jobset, &config_map, &secret, root.path(), &cluster.dir);
    (project, root, cluster, launcher)
}

fn start_paused(marker: &str, env: &str, hostile: bool) -> Run {
    let (project, root, mut cluster, mut command) =
        prepare(marker, &format!(", ELASTIC_PAUSE = \"5\"{env}"));
    for index in 0..4 {
        cluster.start(&pod(index, "aaaaa"));
    }
    if hostile {
        // What `get pods` prints is the API server's: a "pod" named like a kubectl option is never exec'd into.
        cluster.start("--kubeconfig=evil");
    }
    let mut launcher = command
        .args(["--grace", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !project.path().join("paused").exists() {
        if Instant::now() > deadline || launcher.try_wait().unwrap().is_some() {
            let _ = launcher.kill();
            let out = launcher.wait_with_output().unwrap();
            let (stdout, stderr) = text(&out);
            panic!("slot 0 did not reach the pause:\n{stdout}\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Run {
        cluster,
        launcher,
        project,
        root,
    }
}

/// Four worker pods (and a hostile name in `get pods`' output, never used), elastic minimum 2: one pod is lost while
/// slot 0 waits at step 5 (its PID 1 killed: every process of the pod dies at once, and it is gone from `get pods`),
/// and the Job's new pod in its place starts. The launcher pod's `hvd run` counts the rank lost, the three survivors
/// re-form, the new pod is found by its discovery and its rank joins at a commit; the four finish together with every
/// committed step once, and nothing is left running.
#[test]
fn a_launcher_pod_replaces_a_lost_worker_pod_through_kubectl() {
    let marker = common::unique_marker("k8s-elastic");
    let Run {
        mut cluster,
        launcher,
        project,
        root,
    } = start_paused(&marker, ", ELASTIC_UNTIL = \"4\"", true);
    cluster.lose(&pod(2, "aaaaa"));
    cluster.start(&pod(2, "bbbbb"));
    std::fs::write(project.path().join("go"), "").unwrap();
    let out = wait_within(launcher, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    let calls = cluster.calls();
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
            "get pods -n ml -l {selector} --field-selector=status.phase=Running --request-timeout=10s -o \
             jsonpath={{range .items[*]}}{{.metadata.name}}:1 {{.metadata.deletionTimestamp}}{{\"\\n\"}}{{end}}"
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
        flat.contains(
            "host discovery found host `--kubeconfig=evil` for step `train`, but it cannot run workers"
        ),
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
    // Once the step is over the launcher ends every worker pod with 0 (SIGUSR1 to its PID 1): they hold nothing the
    // next steps need. The hostile name was never exec'd into.
    for index in [0, 1, 3] {
        assert_eq!(cluster.wait(&pod(index, "aaaaa")).code(), Some(0), "{all}");
    }
    assert_eq!(cluster.wait(&pod(2, "bbbbb")).code(), Some(0), "{all}");
    assert!(
        calls.contains(&format!(
            "exec -i -n ml {} -c worker -- /bin/sh -c kill -USR1 1",
            pod(0, "aaaaa")
        )),
        "{calls}"
    );
    drop(cluster);
    common::assert_nothing_left(&marker);
}

/// The launcher pod evicted (its node drained or reclaimed: the kubelet's SIGTERM to `hvd run`) while slot 0 waits at
/// step 5: `hvd run` stops its ranks (none is left in the worker pods, which go on waiting) and ends with 143. Its Job
/// ignores the disruption (`podFailurePolicy`: `DisruptionTarget` neither fails the Job nor counts against its
/// `backoffLimit` of 0) and starts a new launcher pod, with an empty state volume: its `hvd run` finds the same worker
/// pods and runs the step again to its end (from its latest checkpoint, when it has `checkpoints`).
#[test]
fn an_evicted_launcher_pod_is_replaced_and_runs_its_step_again() {
    let marker = common::unique_marker("k8s-launcher-evict");
    let Run {
        mut cluster,
        launcher,
        project,
        root: _keep,
    } = start_paused(&marker, "", false);
    let (jobset, config_map, secret) = manifests(&project.path().join("k8s-out"), "t");
    let job = &replicated(&jobset, "train")["template"]["spec"];
    assert_eq!(job["backoffLimit"], 0, "{job}");
    assert_eq!(
        job["podFailurePolicy"]["rules"][0]["onPodConditions"][0]["type"], "DisruptionTarget",
        "{job}"
    );
    // SAFETY: kill has no memory preconditions.
    unsafe { libc_kill(launcher.id() as i32, 15) };
    let out = wait_within(launcher, Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(143), "{stdout}\n{stderr}");
    let ranks = || {
        let mine = common::processes_with_env(&format!("HVD_TEST_MARKER={marker}"));
        let ranks: Vec<u32> = (0..4)
            .flat_map(|r| common::processes_with_env(&format!("HVD_RANK={r}")))
            .map(|(pid, _)| pid)
            .collect();
        mine.into_iter()
            .filter(|(pid, _)| ranks.contains(pid))
            .collect::<Vec<_>>()
    };
    let left = common::wait_until_empty(Duration::from_secs(10), Duration::from_millis(20), ranks);
    assert!(left.is_empty(), "ranks left in the worker pods: {left:?}");
    // The Job's new launcher pod: the same worker pods, still waiting.
    std::fs::write(project.path().join("go"), "").unwrap();
    let root = tempfile::tempdir().unwrap();
    let launcher = launcher_pod(&jobset, &config_map, &secret, root.path(), &cluster.dir)
        .args(["--grace", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_within(launcher, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (2, 2), (3, 3)]),
        10
    );
    for index in 0..4 {
        assert_eq!(
            cluster.wait(&pod(index, "aaaaa")).code(),
            Some(0),
            "{stdout}\n{stderr}"
        );
    }
    drop(cluster);
    common::assert_nothing_left(&marker);
}

/// A worker pod evicted (spot reclaim, a drained node: the kubelet's SIGTERM to its PID 1) while slot 0 waits at
/// step 5: the pod's waiting process passes SIGTERM on to its rank, which finishes the step, commits, hands over and
/// leaves; the pod then ends (143, so that its Job starts it again). The launcher reports the rank preempted (or,
/// when its discovery saw the pod being deleted first, leaving at its commit), not lost, and the other three finish
/// with every committed step once.
#[test]
fn an_evicted_worker_pod_hands_its_rank_over() {
    let marker = common::unique_marker("k8s-evict");
    let Run {
        mut cluster,
        launcher,
        project,
        root: _keep,
        ..
    } = start_paused(
        &marker,
        ", ELASTIC_CHILD = \"1\", ELASTIC_HOLD = \"8\"",
        false,
    );
    // The rank's step blocks on slot 0's pause, so the pod waits for its rank to hand over: let slot 0 go on
    // meanwhile.
    let go = project.path().join("go");
    let evicting = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        std::fs::write(go, "").unwrap();
    });
    let status = cluster.evict(&pod(2, "aaaaa"));
    evicting.join().unwrap();
    // The others wait at step 8 until the evicted pod has ended: the step's end would release it (exit 0) first.
    std::fs::write(project.path().join("release"), "").unwrap();
    assert_eq!(status.code(), Some(143), "the evicted pod's end");
    let out = wait_within(launcher, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    let all = format!("{stdout}\n{stderr}");
    assert!(out.status.success(), "{all}");
    let flat = common::flat_stderr(&out);
    // The rank's own word: it got SIGTERM and handed over. The launcher says so, or (when its discovery saw the pod
    // being deleted first and asked the rank to leave) that the rank left at its commit.
    assert!(
        stdout.contains(
            "[train t-train-workers-0-2-aaaaa:2] hvd.elastic: preempted: committed and left the job"
        ) || stderr.contains("hvd.elastic: preempted: committed and left the job"),
        "{all}"
    );
    assert!(
        flat.contains(
            "rank 2 of step `train` was preempted: it committed, handed over and left; 3 of its 4 workers go on"
        ) || flat.contains(
            "rank 2 of step `train` left: host discovery no longer lists its slot (it committed and handed over); \
             3 of its 4 workers go on"
        ),
        "{all}"
    );
    assert!(!flat.contains("was lost"), "{all}");
    common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1), (3, 2)]);
    // SIGTERM reached the rank alone, not its child (a data loader's worker, which dies of it).
    let termed = common::elastic::children_termed(project.path());
    assert!(termed.is_empty(), "{termed:?}\n{all}");
    drop(cluster);
    common::assert_nothing_left(&marker);
}

/// The worker pods start after the launcher pod (being scheduled, pulling their image): its first discovery waits
/// for the step's minimum past `--elastic-timeout` (1 s here; the worker pods' start has its own allowance), then the
/// two pods' ranks train.
#[test]
fn worker_pods_that_start_after_the_launcher_are_waited_for() {
    let marker = common::unique_marker("k8s-late-pods");
    let (_project, _root, mut cluster, mut command) = prepare(&marker, "");
    let launcher = command
        .args(["--grace", "2", "--elastic-timeout", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    for index in 0..2 {
        cluster.start(&pod(index, "aaaaa"));
    }
    let out = wait_within(launcher, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("printed no `host:slots` line; keeping the current hosts"),
        "{stderr}"
    );
    assert_eq!(
        common::assert_finished_together(&stdout, &stderr, &[(0, 0), (1, 1)]),
        10
    );
    drop(cluster);
    common::assert_nothing_left(&marker);
}

/// With caches (no env in the image): the launcher pod runs with `--env-dir=ENV --cache=URL --trusted-key=KEY`, each
/// worker pod pulls the env when it starts (`hvd worker-env --once --pull ... -- /bin/sh -c IDLE`) and every rank
/// starts through the same pull in its pod, which finds the env there. The store is removed after the export and the
/// pods' PATH has only `hvd` and the system: the ranks import a package only the env has.
#[test]
fn ranks_in_worker_pods_run_in_the_env_the_pods_pulled() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = common::pushed_fixture_env(
        root.path(),
        &outside.path().join("cache"),
        "cluster {\n  engine = \"kubernetes\"\n  image = \"example/bare:1\"\n  namespace = \"ml\"\n}\n\
         step train {\n  run = \"python job.py\"\n  workers = { min = 1, max = 2 }\n}\n",
    );
    std::fs::write(
        p.project.join("job.py"),
        "import os, hvd, helper\nhvd.init()\nhvd.barrier()\n\
         print(f\"job rank={hvd.rank()} size={hvd.size()} word={helper.WORD} venv={os.environ['VIRTUAL_ENV']}\")\n",
    )
    .unwrap();
    let store = root.path().join("store");
    let url = format!("file://{}", p.cache.display());
    let key = p.public_key.display().to_string();
    let out_dir = root.path().join("k8s");
    let mut command = common::hvd_with_store(
        root.path(),
        &store,
        &["export", "k8s", "app/train.hvd", "--locked", "--out"],
    );
    command
        .arg(&out_dir)
        .args(["--cache", &url, "--trusted-key", &key])
        .env_remove("HVD_CACHES")
        .env_remove("HVD_TRUSTED_KEYS");
    let (jobset, config_map, secret) = exported(command, &out_dir, "app");
    // Nothing of the env is left here: the pods must pull it.
    if std::fs::remove_dir_all(&store).is_err() {
        let _ = Command::new("chmod")
            .args(["-R", "u+w"])
            .arg(&store)
            .status();
        std::fs::remove_dir_all(&store).unwrap();
    }
    let bin = outside.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(HVD, bin.join("hvd")).unwrap();
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let workers = &replicated(&jobset, "train-workers")["template"]["spec"];
    let worker = &workers["template"]["spec"]["containers"][0];
    assert_eq!(
        worker["command"].as_array().unwrap()[..3],
        ["hvd", "worker-env", "--once"],
        "{worker}"
    );
    let pods = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::with_path(pods.path(), &p.project, worker, &secret, &path);
    for index in 0..2 {
        cluster.start(&format!("app-train-workers-0-{index}-aaaaa"));
    }
    let launcher = launcher_pod_with_path(
        &jobset,
        &config_map,
        &secret,
        pods.path(),
        &cluster.dir,
        &path,
    )
    .args(["--grace", "2"])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let out = wait_within(launcher, Duration::from_secs(180));
    let (stdout, stderr) = text(&out);
    let calls = cluster.calls();
    assert!(out.status.success(), "{stdout}\n{stderr}\n{calls}");
    for rank in 0..2 {
        let want = format!("job rank={rank} size=2 word=hello venv={}", p.env.display());
        assert!(stdout.contains(&want), "want `{want}`:\n{stdout}\n{stderr}");
    }
    let pull = format!(" hvd worker-env --once --pull={} ", p.env.display());
    assert!(calls.contains(&pull), "want `{pull}`: {calls}");
    assert!(
        p.env.join("bin").is_dir(),
        "the pods pulled the env into its store"
    );
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
