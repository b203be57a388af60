//! An elastic step in a JobSet: two replicated jobs and the objects its launcher needs.
//!
//! - `STEP` (the name the other steps' `dependsOn` names): one **launcher pod** running `hvd run FILE --step=STEP
//!   --no-deps --force --engine=kubernetes` ([`launcher_argv`]), with the .hvd file and its imports from a ConfigMap
//!   ([`ProjectFiles`], [`launcher_objects`]) and its state in an `emptyDir`; in the pod that is the kubernetes engine of
//!   `engines/k8s_pods.rs`: the step's ranks go into the worker pods through `kubectl exec`, as the elastic
//!   supervisor of every engine starts, replaces and re-forms them. The step ends when the launcher does.
//! - `STEP-workers`: the step's **worker pods** (`max` of them, an Indexed Job), which only wait
//!   ([`IDLE`]; with caches, after pulling the env) for the launcher to exec ranks into them. Their Job never fails
//!   (a pod that is lost, evicted or deleted is started again, and found by the launcher's discovery); the launcher
//!   ends them once the step is over (the Job's `successPolicy`). The JobSet's `successPolicy` completes the JobSet
//!   once every other replicated job completed, whatever they do.
//! - a ServiceAccount, Role and RoleBinding (`NAME-hvd-launcher`) that let the launcher pod list pods and exec into
//!   them in its namespace, nothing else.

use serde_json::{Value, json};

use super::{Delivery, Manifest, dns_label, metadata};
use crate::LaunchError;
use crate::engines::k8s_pods::{NAMESPACE_VAR, WORKERS_VAR};
use crate::engines::kubectl::{JOBSET_LABEL, STEP_LABEL};
use crate::engines::shim::POD_IP_VAR;
use hvd_lang::model::{Project, Step};

/// Where the launcher pod finds the .hvd file (the ConfigMap's volume).
pub const PROJECT_MOUNT: &str = "/var/run/hvd/project";
/// Where the launcher pod keeps the run's state and logs (`--state-dir`, an `emptyDir`).
pub const STATE_MOUNT: &str = "/var/run/hvd/state";

/// What a worker pod runs as its container's PID 1 (`/bin/sh -c IDLE hvd-idle SECONDS`, or after `hvd worker-env
/// --once --pull ... --`, which execs it): nothing until the launcher execs ranks into it.
///
/// - SIGTERM (the pod evicted or deleted, its spot node reclaimed: the kubelet signals only PID 1, and every process
///   of the pod dies with it) is passed on to each rank in the pod: each process with `HVD_RANK` in its environment
///   that is not a shell and whose parent is a shell or has no `HVD_RANK` (past the rank's `/bin/sh -c` leader, which
///   then ends with the rank's own status, and past a `bash` script's, which may wait for its child before it runs a
///   trap), as the ssh wrapper's `PREEMPT` does; not the rank's own children (a torch DataLoader's workers die of a
///   SIGTERM, and their death would fail the rank before it commits). `hvd.elastic` commits, hands over and leaves
///   (the launcher's own hand-over request, which follows within a second or two when it sees the pod being deleted,
///   is the same notice to it). Once no rank and no rank's wrapper (`hvd-rank`, which passes the rank's status to
///   `kubectl exec`) is left, at most SECONDS by the clock, it exits 143, a failure, so that its Job starts the pod
///   again. An image whose `grep` has no `-z` is named in the pod's log at start (its ranks are not told then).
/// - SIGUSR1 (the launcher, once the step is over: `kill -USR1 1` through `kubectl exec`) ends it with 0: the pod's
///   index of the Job is done, and the Job's `successPolicy` (one done index) ends the other pods, so that they hold
///   no resources the next steps need.
///
/// The text is constant; SECONDS is its argument ([`worker_stop_seconds`]).
pub const IDLE: &str = r#"w=${1:-40}
shell() { case $(readlink "/proc/$1/exe" 2>/dev/null) in */sh|*/dash|*/bash|*/ash|*/ksh|*/mksh|*/zsh|*/busybox) return 0 ;; esac; return 1; }
ppid() { l=; read -r l < "/proc/$1/stat" || return 1; l=${l##*) }; set -- $l; echo "$2"; }
ranked() { grep -qz '^HVD_RANK=' "/proc/$1/environ" 2>/dev/null; }
stop() {
  end=$(($(date +%s) + w))
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" = "$$" ] && continue
    ranked "$p" || continue
    shell "$p" && continue
    q=$(ppid "$p" 2>/dev/null) || continue
    if ranked "$q" && ! shell "$q"; then continue; fi
    kill -TERM "$p" 2>/dev/null
  done
  while [ "$(date +%s)" -lt "$end" ] && { grep -qz '^HVD_RANK=' /proc/[0-9]*/environ || grep -qzx 'hvd-ran[k]' /proc/[0-9]*/cmdline; } 2>/dev/null; do
    sleep 0.1 2>/dev/null || sleep 1
  done
  exit 143
}
printf 'a\000' | grep -qz a 2>/dev/null || echo "hvd-idle: this image's grep has no -z: when this pod is evicted its ranks are not told to hand over" >&2
trap stop TERM
trap 'exit 0' USR1
while :; do sleep 3600 & wait $!; done
"#;

/// How long a worker pod's [`IDLE`] waits for its ranks to hand over after SIGTERM: the step's `HVD_PREEMPT_GRACE`
/// (its `env`, else the project's; default 30 s, as `hvd.elastic`'s) and 10 s.
pub fn worker_stop_seconds(env: &std::collections::BTreeMap<String, String>) -> u64 {
    let grace = env
        .get("HVD_PREEMPT_GRACE")
        .and_then(|g| g.trim().parse::<f64>().ok())
        .filter(|g| g.is_finite() && *g > 0.0)
        .map_or(30, |g| g.ceil().min(86_400.0) as u64);
    grace + 10
}

/// The memory a launcher pod asks for, in MiB: `hvd run` and a `kubectl exec` (about 48 MiB) per rank of `n`.
pub fn launcher_memory_mib(n: u32) -> u64 {
    128 + 48 * u64::from(n)
}

/// A worker pod's `terminationGracePeriodSeconds`: [`worker_stop_seconds`] and 5 s.
pub fn worker_grace_seconds(stop: u64) -> u64 {
    stop + 5
}

/// The replicated job of an elastic step's worker pods.
pub fn pool_name(job: &str) -> String {
    let head: String = job.chars().take(63 - "-workers".len()).collect();
    format!("{}-workers", head.trim_end_matches('-'))
}

/// Refuses what an elastic step cannot be in a JobSet: its own host discovery (its worker pods are its hosts, which
/// the launcher pod finds itself; a program the file names would run in the launcher pod, with its account),
/// checkpoints outside S3 (a directory is each pod's own file system, lost with the pod: no pod of the JobSet shares
/// a volume), and a step whose worker pods' replicated job (`STEP-workers`) is another step's name.
pub fn check_step(step: &Step, job: &str, all: &[&Step]) -> Result<(), LaunchError> {
    if step.elastic.discovery.is_some() {
        return Err(LaunchError::Engine(format!(
            "step `{}` is elastic with host discovery, which the kubernetes engine does not run: an elastic step's \
             hosts are its worker pods, which its launcher pod finds itself (a lost pod's replacement included); \
             leave `--host-discovery-script` (or `discovery`) out",
            step.name
        )));
    }
    if let Some(dir) = step
        .checkpoints
        .as_deref()
        .filter(|d| !d.starts_with("s3://"))
    {
        return Err(LaunchError::Engine(format!(
            "step `{}` keeps its checkpoints in `{dir}`: on Kubernetes that is each worker pod's own file system, \
             lost with the pod (no pod of the JobSet shares a volume); give `checkpoints = \"s3://bucket/prefix\"`",
            step.name
        )));
    }
    // Its ranks get their variables through the wrapper in the worker pods (the launcher pod checks the project's
    // too, when it prepares the run).
    crate::engines::ssh::check_var_names(step.env.keys(), "the kubernetes engine")
        .map_err(|e| LaunchError::Engine(format!("step `{}`: {e}", step.name)))?;
    let pool = pool_name(job);
    if let Some(other) = all.iter().map(|s| &s.name).find(|n| dns_label(n) == pool) {
        return Err(LaunchError::Engine(format!(
            "step `{other}` has the name of elastic step `{}`'s worker pods' job (`{pool}`) in the JobSet; rename one",
            step.name
        )));
    }
    Ok(())
}

/// The ServiceAccount, Role and RoleBinding of the launcher pods.
pub fn launcher_account(name: &str) -> String {
    format!("{name}-hvd-launcher")
}

/// The ConfigMap with the .hvd file.
pub fn project_config_map_name(name: &str) -> String {
    format!("{name}-hvd-project")
}

/// The .hvd file and the local files it imports, as the launcher pods get them: each file's path under the project's
/// directory (the .hvd file first) and its text, read (and parsed) again now through a loader that keeps what it
/// read, so that the pods run what was read here. An import from outside the project's directory is refused.
#[derive(Debug, Clone)]
pub struct ProjectFiles(pub Vec<(String, String)>);

/// A file system loader that keeps every file it read (its path as the evaluator named it, its text).
#[derive(Default)]
struct Recording(std::sync::Mutex<Vec<(std::path::PathBuf, String)>>);

impl hvd_lang::ImportLoader for Recording {
    fn canonicalize(&self, path: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
        hvd_lang::FsLoader.canonicalize(path)
    }

    fn read_to_string(&self, path: &std::path::Path) -> std::io::Result<String> {
        let text = hvd_lang::FsLoader.read_to_string(path)?;
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((path.to_path_buf(), text.clone()));
        Ok(text)
    }
}

impl ProjectFiles {
    pub fn read(project: &Project) -> Result<ProjectFiles, LaunchError> {
        let engine = |message: String| LaunchError::Engine(message);
        let file = &project.file;
        // Imports are read where the evaluator names them (joined to the importing file's directory, as written): the
        // pod gets each at that path under the .hvd file's directory, links in between as the pod will see them.
        let dir = file.parent().unwrap_or(std::path::Path::new(""));
        let recording = Recording::default();
        hvd_lang::load_file_with(file, &recording).map_err(|_| {
            engine(format!(
                "{} no longer loads (it changed while hvd ran?): run again",
                file.display()
            ))
        })?;
        let read = recording
            .0
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| engine(format!("{} has no UTF-8 file name", file.display())))?;
        let mut files: Vec<(String, String)> = Vec::new();
        // The .hvd file first, each file once.
        if let Some((_, text)) = read.iter().find(|(p, _)| p == file) {
            files.push((name.to_owned(), text.clone()));
        }
        for (path, text) in read.iter().filter(|(p, _)| p != file) {
            let relative = path
                .strip_prefix(dir)
                .ok()
                .filter(|r| {
                    r.components()
                        .all(|c| matches!(c, std::path::Component::Normal(_)))
                })
                .and_then(|r| r.to_str())
                .ok_or_else(|| {
                    engine(format!(
                        "{} imports {}, which is outside its directory (or not UTF-8): the launcher pod of an \
                         elastic step gets the project's files in a ConfigMap; move it into {}",
                        file.display(),
                        path.display(),
                        if dir.as_os_str().is_empty() {
                            ".".into()
                        } else {
                            dir.display().to_string()
                        }
                    ))
                })?;
            if relative != name && !files.iter().any(|(r, _)| r == relative) {
                files.push((relative.to_owned(), text.clone()));
            }
        }
        if files.is_empty() {
            return Err(LaunchError::Internal("the .hvd file was read"));
        }
        Ok(ProjectFiles(files))
    }

    /// The .hvd file's path under the project's directory.
    pub fn main(&self) -> &str {
        &self.0[0].0
    }

    /// The ConfigMap's key of file `i` (paths are not keys: `/` is not allowed in one).
    fn key(i: usize) -> String {
        format!("f{i}")
    }

    /// The ConfigMap's `data`.
    fn data(&self) -> Value {
        Value::Object(
            self.0
                .iter()
                .enumerate()
                .map(|(i, (_, text))| (Self::key(i), json!(text)))
                .collect(),
        )
    }

    /// The ConfigMap volume's `items`: each key at its file's path.
    fn items(&self) -> Value {
        Value::Array(
            self.0
                .iter()
                .enumerate()
                .map(|(i, (path, _))| json!({ "key": Self::key(i), "path": path }))
                .collect(),
        )
    }
}

/// The objects an elastic step's launcher pods need besides the JobSet: the ConfigMap with the .hvd file and the
/// account that may list pods and exec into them.
pub fn launcher_objects(
    name: &str,
    project: &Project,
    files: &ProjectFiles,
) -> Result<Vec<Manifest>, LaunchError> {
    let account = launcher_account(name);
    let config = project_config_map_name(name);
    let config_map = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(&config, project),
        "data": files.data(),
    });
    let service_account = json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(&account, project),
    });
    // Listing pods (discovery, probes) and exec into them (each rank; `get` too: kubectl's WebSocket exec).
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(&account, project),
        "rules": [
            { "apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"] },
            { "apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"] },
        ],
    });
    let mut subject = json!({ "kind": "ServiceAccount", "name": account });
    if let Some(ns) = metadata(&account, project)["namespace"].as_str() {
        subject["namespace"] = json!(ns);
    }
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(&account, project),
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account },
        "subjects": [subject],
    });
    Ok([
        ("configmap", config_map),
        ("serviceaccount", service_account),
        ("role", role),
        ("rolebinding", binding),
    ]
    .into_iter()
    .map(|(kind, content)| Manifest {
        file: format!("{name}.{kind}.json"),
        content,
    })
    .collect())
}

/// The launcher pod's command: `[hvd worker-env --once PULL... --] hvd run PROJECT_MOUNT/FILE --step=STEP --no-deps
/// --force --engine=kubernetes --state-dir=STATE_MOUNT`, the env the ranks pull (`--env-dir=ENV --cache=URL...
/// --trusted-key=KEY...`, else `--no-build`: the image's) and `flags` (the run's flags that shape the step).
pub fn launcher_argv(
    files: &ProjectFiles,
    step: &Step,
    delivery: Option<&Delivery>,
    flags: &[String],
) -> Result<Vec<String>, LaunchError> {
    let file = files.main();
    let mut argv: Vec<String> = [
        "hvd",
        "run",
        &format!("{PROJECT_MOUNT}/{file}"),
        &format!("--step={}", step.name),
        "--no-deps",
        "--force",
        "--engine=kubernetes",
        &format!("--state-dir={STATE_MOUNT}"),
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    match delivery {
        Some(delivery) => {
            // The same checks as the pods' own pull (a store path, no credentials in a URL).
            delivery.worker_env_args()?;
            let env = delivery.env.to_str().ok_or(LaunchError::Internal(
                "worker_env_args refuses an env path that is not UTF-8",
            ))?;
            argv.push(format!("--env-dir={env}"));
            argv.extend(delivery.caches.iter().map(|c| format!("--cache={c}")));
            argv.extend(
                delivery
                    .trusted_keys
                    .iter()
                    .map(|k| format!("--trusted-key={k}")),
            );
        }
        None => argv.push("--no-build".into()),
    }
    argv.extend(flags.iter().cloned());
    Ok(argv)
}

/// The launcher and worker replicated jobs of elastic step `step` (`n` workers at most) of JobSet `name`.
#[allow(clippy::too_many_arguments)]
pub fn replicated_jobs(
    name: &str,
    files: &ProjectFiles,
    step: &Step,
    n: u32,
    image: &str,
    env: &std::collections::BTreeMap<String, String>,
    resources: &Value,
    pull_args: Option<&[String]>,
    delivery: Option<&Delivery>,
    flags: &[String],
) -> Result<[Value; 2], LaunchError> {
    let job = dns_label(&step.name);
    let pool = pool_name(&job);
    let stop = worker_stop_seconds(env);
    let idle: Vec<String> = vec![
        "/bin/sh".into(),
        "-c".into(),
        IDLE.into(),
        "hvd-idle".into(),
        stop.to_string(),
    ];
    let idle = match pull_args {
        // The worker pod pulls the env once it starts (and roots it while it waits); each rank then finds it.
        Some(pull) => {
            let mut argv = vec![
                "hvd".to_owned(),
                "worker-env".to_owned(),
                "--once".to_owned(),
            ];
            argv.extend(pull.iter().cloned());
            argv.extend(["--".into()]);
            argv.extend(idle);
            argv
        }
        None => idle,
    };
    let workers = json!({
        "name": pool,
        "replicas": 1,
        "template": { "spec": {
            "parallelism": n,
            "completions": n,
            "completionMode": "Indexed",
            // The launcher decides when the step has too few workers; the Job only starts lost pods again, and an
            // evicted pod (a disruption) without counting it or backing off.
            "backoffLimit": i32::MAX,
            "podFailurePolicy": { "rules": [
                { "action": "Ignore", "onPodConditions": [{ "type": "DisruptionTarget", "status": "True" }] },
            ] },
            // The launcher ends one pod with 0 once the step is over: the Job is done and ends the others.
            "successPolicy": { "rules": [{ "succeededCount": 1 }] },
            "template": { "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": worker_grace_seconds(stop),
                "containers": [{
                    "name": crate::engines::k8s_pods::CONTAINER,
                    "image": image,
                    "command": idle,
                    "env": super::env_list(env),
                    "resources": resources,
                }],
            }},
        }},
    });
    let selector = format!("{JOBSET_LABEL}={name},{STEP_LABEL}={pool}");
    let field = |path: &str| json!({ "fieldRef": { "fieldPath": path } });
    let launcher = json!({
        "name": job,
        "replicas": 1,
        "template": { "spec": {
            "parallelism": 1,
            "completions": 1,
            // A launcher that fails fails the step; one disrupted (evicted, preempted, its node drained or lost:
            // `DisruptionTarget`) is started again without counting, and its `hvd run` runs the step again (from
            // its latest checkpoint when it has `checkpoints`).
            "backoffLimit": 0,
            "podFailurePolicy": { "rules": [
                { "action": "Ignore", "onPodConditions": [{ "type": "DisruptionTarget", "status": "True" }] },
            ] },
            "template": {
              // Losing the launcher pod restarts the step: no autoscaler may move it to consolidate nodes.
              "metadata": { "annotations": {
                  "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
                  "karpenter.sh/do-not-disrupt": "true",
              } },
              "spec": {
                "restartPolicy": "Never",
                "serviceAccountName": launcher_account(name),
                "containers": [{
                    "name": crate::engines::k8s_pods::CONTAINER,
                    "image": image,
                    "command": launcher_argv(files, step, delivery, flags)?,
                    "env": [
                        { "name": WORKERS_VAR, "value": selector },
                        { "name": NAMESPACE_VAR, "valueFrom": field("metadata.namespace") },
                        { "name": POD_IP_VAR, "valueFrom": field("status.podIP") },
                        // kubectl keeps its discovery cache under HOME: a writable one (an image's may not be).
                        { "name": "HOME", "value": STATE_MOUNT },
                    ],
                    // Requested, so that it is not the first pod evicted under memory pressure (BestEffort): hvd
                    // and a `kubectl exec` per rank.
                    "resources": { "requests": {
                        "cpu": "100m",
                        "memory": format!("{}Mi", launcher_memory_mib(n)),
                    } },
                    "volumeMounts": [
                        { "name": "hvd-project", "mountPath": PROJECT_MOUNT, "readOnly": true },
                        { "name": "hvd-state", "mountPath": STATE_MOUNT },
                    ],
                }],
                "volumes": [
                    { "name": "hvd-project", "configMap": {
                        "name": project_config_map_name(name),
                        "items": files.items(),
                    } },
                    { "name": "hvd-state", "emptyDir": {} },
                ],
              },
            },
        }},
    });
    Ok([launcher, workers])
}
