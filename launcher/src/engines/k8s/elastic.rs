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

/// What a worker pod runs (its container's PID 1, or the child of the pulling `hvd worker-env`, which passes
/// signals on): nothing until the launcher execs ranks into it. SIGTERM (the pod evicted, deleted, its spot node
/// reclaimed: the kubelet signals only PID 1, and the pod's processes all die with it) is passed on to the ranks
/// in the pod (every process with `HVD_RANK` in its environment but a rank's `/bin/sh -c` leader, which then ends
/// with the rank's own status, as the ssh wrapper's `PREEMPT` does), so that `hvd.elastic` commits, hands over and
/// leaves; once no rank is left (at most 25 s, within the pod's default 30 s grace) it exits 143, a failure, so that
/// its Job starts the pod again. The text is constant.
pub const IDLE: &str = r#"stop() {
  s=$(readlink -f /bin/sh)
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" = "$$" ] && continue
    grep -qz '^HVD_RANK=' "$e" 2>/dev/null || continue
    [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$s" ] && continue
    kill -TERM "$p" 2>/dev/null
  done
  i=0
  while [ "$i" -lt 250 ] && grep -qz '^HVD_RANK=' /proc/[0-9]*/environ 2>/dev/null; do
    sleep 0.1
    i=$((i + 1))
  done
  exit 143
}
trap stop TERM
while :; do sleep 3600 & wait $!; done
"#;

/// The replicated job of an elastic step's worker pods.
pub fn pool_name(job: &str) -> String {
    let head: String = job.chars().take(63 - "-workers".len()).collect();
    format!("{}-workers", head.trim_end_matches('-'))
}

/// The ServiceAccount, Role and RoleBinding of the launcher pods.
pub fn launcher_account(name: &str) -> String {
    format!("{name}-hvd-launcher")
}

/// The ConfigMap with the .hvd file.
pub fn project_config_map_name(name: &str) -> String {
    format!("{name}-hvd-project")
}

/// The .hvd file's name and text, as the launcher pods read it.
fn project_file(project: &Project) -> Result<(String, String), LaunchError> {
    let file = project
        .file
        .file_name()
        .and_then(|f| f.to_str())
        .filter(|f| {
            f.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        })
        .ok_or_else(|| {
            LaunchError::Engine(format!(
                "the .hvd file's name {} is not a ConfigMap key (letters, digits, `.`, `-`, `_`); rename it to run \
                 an elastic step on Kubernetes",
                project.file.display()
            ))
        })?
        .to_owned();
    let text = fs_err::read_to_string(&project.file).map_err(|source| LaunchError::Io {
        path: project.file.clone(),
        source,
    })?;
    Ok((file, text))
}

/// The objects an elastic step's launcher pods need besides the JobSet: the ConfigMap with the .hvd file and the
/// account that may list pods and exec into them.
pub fn launcher_objects(name: &str, project: &Project) -> Result<Vec<Manifest>, LaunchError> {
    let (file, text) = project_file(project)?;
    let account = launcher_account(name);
    let config = project_config_map_name(name);
    let mut config_map = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(&config, project),
        "data": {},
    });
    config_map["data"][&file] = json!(text);
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
    project: &Project,
    step: &Step,
    delivery: Option<&Delivery>,
    flags: &[String],
) -> Result<Vec<String>, LaunchError> {
    let (file, _) = project_file(project)?;
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
    project: &Project,
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
            // The launcher decides when the step has too few workers; the Job only starts lost pods again.
            "backoffLimit": i32::MAX,
            "template": { "spec": {
                "restartPolicy": "Never",
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
            "template": { "spec": {
                "restartPolicy": "Never",
                "serviceAccountName": launcher_account(name),
                "containers": [{
                    "name": crate::engines::k8s_pods::CONTAINER,
                    "image": image,
                    "command": launcher_argv(project, step, delivery, flags)?,
                    "env": [
                        { "name": WORKERS_VAR, "value": selector },
                        { "name": NAMESPACE_VAR, "valueFrom": field("metadata.namespace") },
                        { "name": POD_IP_VAR, "valueFrom": field("status.podIP") },
                    ],
                    "volumeMounts": [
                        { "name": "hvd-project", "mountPath": PROJECT_MOUNT, "readOnly": true },
                        { "name": "hvd-state", "mountPath": STATE_MOUNT },
                    ],
                }],
                "volumes": [
                    { "name": "hvd-project", "configMap": { "name": project_config_map_name(name) } },
                    { "name": "hvd-state", "emptyDir": {} },
                ],
            }},
        }},
    });
    Ok([launcher, workers])
}
