//! An elastic step in a JobSet: two replicated jobs and the objects its launcher needs.
//!
//! - `STEP` (the name the other steps' `dependsOn` names): one **launcher pod** running `hvd run FILE --step=STEP
//!   --no-deps --force --engine=kubernetes` ([`launcher_argv`]), with the .hvd file from a ConfigMap
//!   ([`project_config_map`]) and its state in an `emptyDir`; in the pod that is the kubernetes engine of
//!   `engines/k8s_pods.rs`: the step's ranks go into the worker pods through `kubectl exec`, as the elastic
//!   supervisor of every engine starts, replaces and re-forms them. The step ends when the launcher does.
//! - `STEP-workers`: the step's **worker pods** (`max` of them, an Indexed Job), which only wait
//!   ([`IDLE`]; with caches, after pulling the env) for the launcher to exec ranks into them. Their Job never fails
//!   (a pod that is lost, evicted or deleted is started again, and found by the launcher's discovery); the JobSet's
//!   `successPolicy` completes the JobSet once every other replicated job completed, which removes them.
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

/// What a worker pod runs as its container's PID 1 (`/bin/sh -c IDLE`, or after `hvd worker-env --once --pull ...
/// --`, which execs it): nothing until the launcher execs ranks into it.
///
/// - SIGTERM (the pod evicted or deleted, its spot node reclaimed: the kubelet signals only PID 1, and every process
///   of the pod dies with it) is passed on to each rank in the pod: the top of its process tree (a process with
///   `HVD_RANK` in its environment whose parent has none), or, where that is the rank's `/bin/sh -c` leader, the
///   leader's children, so that the leader ends with the rank's own status; not the rank's own children (a torch
///   DataLoader's workers die of a SIGTERM, and their death would fail the rank before it commits). `hvd.elastic`
///   commits, hands over and leaves (the launcher's own hand-over request, which follows within a second or two when
///   it sees the pod being deleted, is the same notice: `hvd.elastic` takes a second SIGTERM within 5 s for it). Once
///   no rank and no rank's wrapper (`hvd-rank`, which passes the rank's status to `kubectl exec`) is left, at most
///   [`WORKER_STOP_SECONDS`], it exits 143, a failure, so that its Job starts the pod again.
/// - SIGUSR1 (the launcher, once the step is over: `kill -USR1 1` through `kubectl exec`) ends it with 0: the pod's
///   index of the Job is done, and the Job's `successPolicy` (one done index) ends the other pods, so that they hold
///   no resources the next steps need.
///
/// The text is constant.
pub const IDLE: &str = r#"ppid() { l=; read -r l < "/proc/$1/stat" || return 1; l=${l##*) }; set -- $l; echo "$2"; }
ranked() { grep -qz '^HVD_RANK=' "/proc/$1/environ" 2>/dev/null; }
stop() {
  s=$(readlink -f /bin/sh)
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" = "$$" ] && continue
    ranked "$p" || continue
    q=$(ppid "$p") || continue
    ranked "$q" && continue
    if [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$s" ]; then
      for c in /proc/[0-9]*/stat; do
        c=${c#/proc/}; c=${c%/stat}
        [ "$(ppid "$c" 2>/dev/null)" = "$p" ] && kill -TERM "$c" 2>/dev/null
      done
    else
      kill -TERM "$p" 2>/dev/null
    fi
  done
  i=0
  while [ "$i" -lt "$1" ] && { grep -qz '^HVD_RANK=' /proc/[0-9]*/environ || grep -qzx 'hvd-ran[k]' /proc/[0-9]*/cmdline; } 2>/dev/null; do
    sleep 0.1
    i=$((i + 1))
  done
  exit 143
}
trap 'stop 400' TERM
trap 'exit 0' USR1
while :; do sleep 3600 & wait $!; done
"#;

/// How long a worker pod's [`IDLE`] waits for its ranks to hand over after SIGTERM (40 s: past `hvd.elastic`'s
/// default `HVD_PREEMPT_GRACE` of 30 s), within its pod's `terminationGracePeriodSeconds`
/// ([`WORKER_GRACE_SECONDS`]).
pub const WORKER_STOP_SECONDS: u32 = 40;
/// A worker pod's `terminationGracePeriodSeconds`: [`WORKER_STOP_SECONDS`] and a margin.
pub const WORKER_GRACE_SECONDS: u32 = 45;
const _: () = assert!(WORKER_STOP_SECONDS < WORKER_GRACE_SECONDS);

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

/// A file system loader that keeps every file it read (its canonical path, its text).
#[derive(Default)]
struct Recording(std::sync::Mutex<Vec<(std::path::PathBuf, String)>>);

impl hvd_lang::ImportLoader for Recording {
    fn canonicalize(&self, path: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
        hvd_lang::FsLoader.canonicalize(path)
    }

    fn read_to_string(&self, path: &std::path::Path) -> std::io::Result<String> {
        let text = hvd_lang::FsLoader.read_to_string(path)?;
        let canonical = hvd_lang::FsLoader.canonicalize(path)?;
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((canonical, text.clone()));
        Ok(text)
    }
}

impl ProjectFiles {
    pub fn read(project: &Project) -> Result<ProjectFiles, LaunchError> {
        let engine = |message: String| LaunchError::Engine(message);
        let file = &project.file;
        let io = |source| LaunchError::Io {
            path: file.clone(),
            source,
        };
        let canonical = std::fs::canonicalize(file).map_err(io)?;
        let dir = canonical
            .parent()
            .ok_or(LaunchError::Internal("a file has a directory"))?;
        let recording = Recording::default();
        hvd_lang::load_file_with(file, &recording).map_err(|_| {
            engine(format!(
                "{} no longer loads (it changed while hvd ran?): run again",
                file.display()
            ))
        })?;
        let mut files = Vec::new();
        let read = recording
            .0
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The .hvd file first, each file once.
        let mut ordered: Vec<&(std::path::PathBuf, String)> =
            read.iter().filter(|(p, _)| *p == canonical).collect();
        ordered.extend(read.iter().filter(|(p, _)| *p != canonical));
        for (path, text) in ordered {
            let relative = path
                .strip_prefix(dir)
                .ok()
                .and_then(|r| r.to_str())
                .ok_or_else(|| {
                    engine(format!(
                        "{} imports {}, which is outside its directory (or not UTF-8): the launcher pod of an \
                         elastic step gets the project's files in a ConfigMap; move it into {}",
                        file.display(),
                        path.display(),
                        dir.display()
                    ))
                })?;
            if !files.iter().any(|(r, _): &(String, String)| r == relative) {
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
    worker_env: Value,
    resources: &Value,
    pull_args: Option<&[String]>,
    delivery: Option<&Delivery>,
    flags: &[String],
) -> Result<[Value; 2], LaunchError> {
    let job = dns_label(&step.name);
    let pool = pool_name(&job);
    let idle = match pull_args {
        // The worker pod pulls the env once it starts (and roots it while it waits); each rank then finds it.
        Some(pull) => {
            let mut argv = vec![
                "hvd".to_owned(),
                "worker-env".to_owned(),
                "--once".to_owned(),
            ];
            argv.extend(pull.iter().cloned());
            argv.extend(["--".into(), "/bin/sh".into(), "-c".into(), IDLE.into()]);
            argv
        }
        None => vec!["/bin/sh".into(), "-c".into(), IDLE.into()],
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
                { "action": "Ignore", "onPodConditions": [{ "type": "DisruptionTarget" }] },
            ] },
            // The launcher ends one pod with 0 once the step is over: the Job is done and ends the others.
            "successPolicy": { "rules": [{ "succeededCount": 1 }] },
            "template": { "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": WORKER_GRACE_SECONDS,
                "containers": [{
                    "name": crate::engines::k8s_pods::CONTAINER,
                    "image": image,
                    "command": idle,
                    "env": worker_env,
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
            "backoffLimit": 0,
            "template": {
              // Losing the launcher pod ends the step: no autoscaler may move it to consolidate nodes.
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
                    // Requested, so that it is not the first pod evicted under memory pressure (BestEffort).
                    "resources": { "requests": { "cpu": "100m", "memory": "256Mi" } },
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
