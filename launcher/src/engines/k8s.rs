//! Kubernetes manifests for a project (`hvd export k8s`): a JobSet (jobset.x-k8s.io/v1alpha2) whose replicated
//! jobs follow the step graph with `dependsOn`, or one MPIJob (kubeflow.org/v2beta1) per distributed step. Every
//! rank runs `hvd worker-env -- /bin/sh -c COMMAND` (the image must have `hvd` on its PATH), which maps the Indexed
//! Job's `JOB_COMPLETION_INDEX` (JobSet) or MPI's variables (MPIJob) to the worker contract.
//!
//! With a [`Delivery`] (the env's store path, binary caches and trusted keys), no env is baked into the image: each
//! JobSet pod's `hvd worker-env --pull ENV --cache URL --trusted-key KEY` substitutes the env's closure from the caches
//! (verified, into the env's own store directory) before its worker starts, so any image with `hvd` and glibc runs
//! it. An MPIJob's worker pods pull the same way in an init container (the store in a volume both containers mount),
//! the launcher is created once they are ready, and each rank's shim gets the same `--pull` (finding the env there).
//!
//! Every export also writes a Secret (`<name>-hvd-token`) with a fresh random job token; the ranks get it through
//! `secretKeyRef` and their pod IP through the downward API (`status.podIP`): rank 0's shim serves the rendezvous on
//! that address only, and answers only the token.

use std::collections::BTreeMap;

use hvd_lang::model::Project;
use serde_json::{Value, json};

use crate::LaunchError;
use crate::engines::mpi::{MpiFlavour, MpiStep, Mpirun};
use crate::graph::StepGraph;

/// Which manifests to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    JobSet,
    MpiJob,
}

impl Flavour {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "jobset" => Some(Flavour::JobSet),
            "mpijob" | "mpi" => Some(Flavour::MpiJob),
            _ => None,
        }
    }
}

/// One manifest: a file name and its content (JSON, which is also YAML for kubectl).
#[derive(Debug, Clone)]
pub struct Manifest {
    pub file: String,
    pub content: Value,
}

/// The manifests, and notes about steps that could not be expressed.
#[derive(Debug, Clone)]
pub struct Export {
    pub manifests: Vec<Manifest>,
    pub notes: Vec<String>,
}

/// The torch rendezvous port rank 0 listens on in a pod (pods have their own network namespace).
pub const MASTER_PORT: u16 = 29500;

/// A DNS-1123 label from `name`: lowercase alphanumerics and `-`, at most 63 characters, never empty.
pub fn dns_label(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    out.truncate(63);
    let out = out.trim_matches('-').to_owned();
    if out.is_empty() { "hvd".into() } else { out }
}

fn resources(project: &Project) -> Value {
    let mut limits = serde_json::Map::new();
    if let Some(cpus) = project.resources.cpus {
        limits.insert("cpu".into(), json!(cpus.to_string()));
    }
    if let Some(mem) = project.resources.mem {
        limits.insert("memory".into(), json!(mem.to_string()));
    }
    if project.resources.gpus > 0 {
        limits.insert(
            "nvidia.com/gpu".into(),
            json!(project.resources.gpus.to_string()),
        );
    }
    if limits.is_empty() {
        json!({})
    } else {
        json!({ "limits": limits, "requests": limits })
    }
}

/// The port rank 0's shim serves the rendezvous on in a JobSet (`MASTER_PORT` is torch's).
pub const RENDEZVOUS_PORT: u16 = 29400;

/// The key of the job token in the run's Secret ([`token_secret`]).
pub const TOKEN_KEY: &str = "token";

/// The name of the Secret that holds the job token of the manifests named `name`.
pub fn token_secret_name(name: &str) -> String {
    format!("{name}-hvd-token")
}

/// A Secret with a fresh job token (from the kernel's random source), one per export: the ranks read it through
/// `secretKeyRef` ([`with_job_token`]), so it is in no label, annotation or command line; who can list Jobs or pods
/// does not learn it, only who can read Secrets in the namespace.
fn token_secret(name: &str, project: &Project) -> Result<Value, LaunchError> {
    let token = crate::rendezvous::new_token().map_err(|source| LaunchError::Io {
        path: "/dev/urandom".into(),
        source,
    })?;
    Ok(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(&token_secret_name(name), project),
        "type": "Opaque",
        "stringData": { TOKEN_KEY: token },
    }))
}

/// Adds the rank's secrets and address to a step's env list: `HVD_JOB_TOKEN` from the run's Secret (`secret`;
/// `None` for a step that meets no other rank), and with `pod_ip` the pod's own IP (`status.podIP`, downward API) as
/// [`super::shim::POD_IP_VAR`], the only address rank 0's shim serves the rendezvous on. (Not in an MPIJob: its
/// ranks do not see their container's variables through mpirun's ssh, and MPICH would pass the launcher pod's IP on
/// to every rank; rank 0 binds what its own pod name resolves to there.)
fn with_job_token(mut env: Value, secret: Option<&str>, pod_ip: bool) -> Value {
    if let Value::Array(list) = &mut env {
        if let Some(secret) = secret {
            list.push(json!({
                "name": "HVD_JOB_TOKEN",
                "valueFrom": { "secretKeyRef": { "name": secret, "key": TOKEN_KEY } },
            }));
        }
        if pod_ip {
            list.push(json!({
                "name": super::shim::POD_IP_VAR,
                "valueFrom": { "fieldRef": { "fieldPath": "status.podIP" } },
            }));
        }
    }
    env
}

/// With restarts allowed, `env` plus the restart count (`HVD_RESTART_COUNT`, `TORCHELASTIC_RESTART_COUNT`) read
/// from the pod's `jobset.sigs.k8s.io/restart-attempt` label, which the JobSet controller sets on every pod.
fn with_restart_count(mut env: Value, max_restarts: u32) -> Value {
    if let (Value::Array(list), true) = (&mut env, max_restarts > 0) {
        for name in [
            crate::env_vars::HVD_RESTART_COUNT,
            crate::env_vars::TORCHELASTIC_RESTART_COUNT,
        ] {
            list.push(json!({
                "name": name,
                "valueFrom": { "fieldRef": {
                    "fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"
                } },
            }));
        }
    }
    env
}

fn env_list(vars: &BTreeMap<String, String>) -> Value {
    Value::Array(
        vars.iter()
            .map(|(k, v)| json!({ "name": k, "value": v }))
            .collect(),
    )
}

fn metadata(name: &str, project: &Project) -> Value {
    let mut meta = json!({
        "name": name,
        "labels": { "app.kubernetes.io/managed-by": "hvd", "hvd.dev/project": dns_label(&project.name) },
    });
    if let Some(ns) = project
        .cluster
        .as_ref()
        .and_then(|c| c.namespace.as_deref())
    {
        meta["namespace"] = json!(ns);
    }
    meta
}

fn image(project: &Project) -> Result<String, LaunchError> {
    project
        .cluster
        .as_ref()
        .and_then(|c| c.image.clone())
        .ok_or_else(|| {
            LaunchError::Engine(
                "Kubernetes needs a container image: set `image` in the `cluster` block (the image must have \
                 `hvd` and the project's files)"
                    .into(),
            )
        })
}

/// Where the pods get the env from when the image does not have it: the env's store path (its directory must be
/// the same in the pods: a store path is valid only at the store directory it was built in), the binary caches
/// holding its closure, and the public keys (`NAME:BASE64`) whose signatures the pods trust.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub env: std::path::PathBuf,
    pub caches: Vec<String>,
    pub trusted_keys: Vec<String>,
}

impl Delivery {
    /// The arguments of `hvd worker-env` that pull the env (`--pull=ENV --cache=URL... --trusted-key=KEY...`); a
    /// cache URL with credentials, or an env that is not a store path, is refused (a manifest is read by whoever can
    /// list pods).
    pub fn worker_env_args(&self) -> Result<Vec<String>, LaunchError> {
        let env = self.env.to_str().ok_or_else(|| {
            LaunchError::Engine(format!(
                "the env's path {} is not UTF-8; a manifest cannot name it",
                self.env.display()
            ))
        })?;
        let (Some(store), Some(name)) = (
            self.env.parent().and_then(|s| s.to_str()),
            self.env.file_name().and_then(|n| n.to_str()),
        ) else {
            return Err(LaunchError::Engine(format!(
                "the env {env} is not a store path; pods pull only store paths"
            )));
        };
        if !crate::closure::is_store_path_name(name) {
            return Err(LaunchError::Engine(format!(
                "the env {env} is not a store path (`<store>/<hash>-<name>-<version>`); pods pull only store paths: \
                 build it with `hvd build`"
            )));
        }
        // The same checks (credentials in a URL) as every node's pull command.
        let pull = super::pull_command("hvd", store, name, &self.caches, &self.trusted_keys)?;
        Ok(super::worker_pull_argv(&pull, env, false)
            .into_iter()
            .skip(2)
            .collect())
    }
}

/// The manifests for every step of `project`.
pub fn export(project: &Project, flavour: Flavour) -> Result<Export, LaunchError> {
    export_with(project, flavour, None)
}

/// The manifests for every step of `project`; with `delivery`, the pods pull the env at start (a JobSet's in their
/// worker's shim, an MPIJob's workers in an init container before mpirun reaches them).
pub fn export_with(
    project: &Project,
    flavour: Flavour,
    delivery: Option<&Delivery>,
) -> Result<Export, LaunchError> {
    let pull_args = delivery.map(Delivery::worker_env_args).transpose()?;
    let graph = StepGraph::new(project)?;
    let steps = graph.selection(None)?;
    let image = image(project)?;
    let name = dns_label(&project.name);
    let resources = resources(project);
    let mut notes = Vec::new();
    let secret = token_secret(&name, project)?;
    let secret_name = token_secret_name(&name);
    let secret_manifest = Manifest {
        file: format!("{name}.secret.json"),
        content: secret,
    };
    let step_env = |step: &hvd_lang::model::Step| {
        let mut env = project.env.variables.clone();
        env.extend(step.env.clone());
        env.insert(
            super::shim::GPUS_VAR.into(),
            project.resources.gpus.to_string(),
        );
        env
    };
    match flavour {
        Flavour::JobSet => {
            // The JobSet restarts as a whole (every job again) when a pod fails, up to the most any step allows.
            let max_restarts = steps.iter().filter_map(|s| s.restarts).max().unwrap_or(0);
            let mut jobs = Vec::new();
            for step in &steps {
                if step.workers == Some(0) {
                    return Err(LaunchError::ZeroWorkers(step.name.clone()));
                }
                let job = dns_label(&step.name);
                let n = step.workers.unwrap_or(1);
                let mut env = step_env(step);
                let command = match step.workers {
                    Some(n) => {
                        env.insert("HVD_SIZE".into(), n.to_string());
                        // Pod hostnames in a JobSet: <jobset>-<replicated job>-<job index>-<pod index>, under the
                        // headless service named after the JobSet.
                        env.insert("MASTER_ADDR".into(), format!("{name}-{job}-0-0.{name}"));
                        env.insert("MASTER_PORT".into(), MASTER_PORT.to_string());
                        // No launcher serves a rendezvous here: rank 0's shim serves it on its pod's name.
                        env.insert(
                            "HVD_RENDEZVOUS".into(),
                            format!("{name}-{job}-0-0.{name}:{RENDEZVOUS_PORT}"),
                        );
                        env.insert(super::shim::SERVE_VAR.into(), "1".into());
                        let mut argv = vec!["hvd".to_owned(), "worker-env".to_owned()];
                        argv.extend(pull_args.iter().flatten().cloned());
                        argv.extend(["--".into(), "/bin/sh".into(), "-c".into(), step.run.clone()]);
                        json!(argv)
                    }
                    // A step that runs once needs the env too: the shim pulls it and starts the command without
                    // rank variables.
                    None if pull_args.is_some() => {
                        let mut argv = vec![
                            "hvd".to_owned(),
                            "worker-env".to_owned(),
                            "--once".to_owned(),
                        ];
                        argv.extend(pull_args.iter().flatten().cloned());
                        argv.extend(["--".into(), "/bin/sh".into(), "-c".into(), step.run.clone()]);
                        json!(argv)
                    }
                    None => json!(["/bin/sh", "-c", step.run]),
                };
                let mut replicated = json!({
                    "name": job,
                    "replicas": 1,
                    "template": { "spec": {
                        "parallelism": n,
                        "completions": n,
                        "completionMode": "Indexed",
                        "backoffLimit": 0,
                        "template": { "spec": {
                            "restartPolicy": "Never",
                            "containers": [{
                                "name": "worker",
                                "image": image,
                                "command": command,
                                "env": with_restart_count(with_job_token(
                                    env_list(&env),
                                    step.workers.is_some().then_some(secret_name.as_str()),
                                    true,
                                ), max_restarts),
                                "resources": resources,
                            }],
                        }},
                    }},
                });
                let needs = graph.needs(&step.name);
                if needs.len() > 5 {
                    return Err(LaunchError::Engine(format!(
                        "step `{}` needs {} steps; a JobSet's dependsOn takes at most 5",
                        step.name,
                        needs.len()
                    )));
                }
                if !needs.is_empty() {
                    let mut needs: Vec<String> = needs.iter().map(|n| dns_label(n)).collect();
                    needs.sort();
                    replicated["dependsOn"] = Value::Array(
                        needs
                            .iter()
                            .map(|n| json!({ "name": n, "status": "Complete" }))
                            .collect(),
                    );
                }
                jobs.push(replicated);
            }
            let jobset = json!({
                "apiVersion": "jobset.x-k8s.io/v1alpha2",
                "kind": "JobSet",
                "metadata": metadata(&name, project),
                "spec": {
                    "failurePolicy": { "maxRestarts": max_restarts },
                    "network": { "enableDNSHostnames": true, "publishNotReadyAddresses": true, "subdomain": name },
                    "replicatedJobs": jobs,
                },
            });
            Ok(Export {
                manifests: vec![
                    secret_manifest,
                    Manifest {
                        file: format!("{name}.jobset.json"),
                        content: jobset,
                    },
                ],
                notes,
            })
        }
        Flavour::MpiJob => {
            let settings = project.cluster.as_ref().map(|c| &c.settings);
            let mpi = settings
                .and_then(|s| s.mpi.as_deref())
                .and_then(MpiFlavour::parse)
                .unwrap_or(MpiFlavour::OpenMpi);
            let mut manifests = vec![secret_manifest];
            for step in &steps {
                let Some(n) = step.workers else {
                    notes.push(format!(
                        "step `{}` runs once, not on workers: an MPIJob has no place for it (use --flavour jobset)",
                        step.name
                    ));
                    continue;
                };
                if !step.needs.is_empty() {
                    notes.push(format!(
                        "step `{}` needs {}: MPIJobs are not chained; apply them in order (or use --flavour jobset)",
                        step.name,
                        step.needs.join(", ")
                    ));
                }
                let job = format!("{name}-{}", dns_label(&step.name));
                let mut env = step_env(step);
                // The ranks meet at a rendezvous rank 0's shim serves on the first worker pod (mpirun places rank
                // 0 there: one slot per worker, hostfile order), with the run's token from its Secret (the
                // launcher's mpirun passes it on by name).
                env.insert(
                    "HVD_RENDEZVOUS".into(),
                    format!("{job}-worker-0.{job}:{RENDEZVOUS_PORT}"),
                );
                env.insert(super::shim::SERVE_VAR.into(), "1".into());
                let mut export: Vec<String> = env.keys().cloned().collect();
                export.push("HVD_JOB_TOKEN".into());
                // Each rank's shim makes sure of the env its pod's init container pulled (a no-op when it is
                // there: nothing fetched) and roots it, then starts the rank in it; it refuses (ending mpirun, so the
                // launcher Job and the MPIJob) when the init container left a note that its pull failed.
                let shim_args: Vec<String> = match &pull_args {
                    Some(pull) => pull
                        .iter()
                        .cloned()
                        .chain([PULL_FAILURE_NOTE_FLAG.to_owned()])
                        .collect(),
                    None => Vec::new(),
                };
                let argv = super::mpi::argv(
                    &Mpirun {
                        program: "mpirun".into(),
                        flavour: mpi,
                    },
                    &MpiStep {
                        np: n,
                        hosts: &[],
                        export: &export,
                        shim: std::path::Path::new("hvd"),
                        shim_args: &shim_args,
                        command: &step.run,
                        cores: u32::MAX,
                        root: false,
                    },
                );
                let container = |role: &str, command: Option<&Vec<String>>| {
                    let mut c = json!({
                        "name": role,
                        "image": image,
                        "env": with_job_token(
                            env_list(&env),
                            command.is_some().then_some(secret_name.as_str()),
                            false,
                        ),
                    });
                    match command {
                        Some(argv) => c["command"] = json!(argv),
                        None => c["resources"] = resources.clone(),
                    }
                    c
                };
                let mut worker = json!({ "containers": [container("worker", None)] });
                if let (Some(delivery), Some(pull)) = (delivery, &pull_args) {
                    worker = pulling_worker(worker, delivery, pull, &image, &env)?;
                }
                let mut mpijob = json!({
                    "apiVersion": "kubeflow.org/v2beta1",
                    "kind": "MPIJob",
                    "metadata": metadata(&job, project),
                    "spec": {
                        "slotsPerWorker": 1,
                        "mpiImplementation": match mpi { MpiFlavour::OpenMpi => "OpenMPI", MpiFlavour::Mpich => "MPICH" },
                        "runPolicy": { "cleanPodPolicy": "Running", "backoffLimit": 0 },
                        "mpiReplicaSpecs": {
                            "Launcher": {
                                "replicas": 1,
                                "restartPolicy": "Never",
                                "template": { "spec": { "containers": [container("launcher", Some(&argv))] } },
                            },
                            "Worker": {
                                "replicas": n,
                                "restartPolicy": "Never",
                                "template": { "spec": worker },
                            },
                        },
                    },
                });
                if delivery.is_some() {
                    // The launcher (and so mpirun) starts once every worker pod is ready: after its pull.
                    mpijob["spec"]["launcherCreationPolicy"] = json!("WaitForWorkersReady");
                }
                manifests.push(Manifest {
                    file: format!("{job}.mpijob.json"),
                    content: mpijob,
                });
            }
            Ok(Export { manifests, notes })
        }
    }
}

/// The name of the volume an MPIJob worker's store lives in (shared by its init container and its worker).
pub const STORE_VOLUME: &str = "hvd-store";

/// The flag of `hvd worker-env` by which an MPIJob worker's init container notes a failed pull in the pod's store
/// volume (and exits 0), and each rank's shim refuses such a note.
pub const PULL_FAILURE_NOTE_FLAG: &str = "--pull-failure-note";

/// An MPIJob's worker pod spec `worker` with the env pulled before mpirun reaches it: an init container (the same
/// image, the worker's env) runs `hvd worker-env --once --pull=ENV --cache=URL... --trusted-key=KEY...
/// --pull-failure-note` with no command (`pull`), which substitutes the closure, verified, into an `emptyDir`
/// mounted at the env's store directory in both containers. The launcher waits for ready workers. A failed pull
/// must end the job, not hold it: mpi-operator creates the launcher only once every worker is ready and fails the
/// MPIJob only when its launcher Job fails (or a worker is evicted), so a pod stuck in `Init:Error` would hold the
/// other workers forever. So the init container writes the pull's reason into the volume and exits 0; the worker
/// starts (sshd), the launcher's mpirun starts each rank's shim, and the shims on that pod refuse with the reason:
/// mpirun fails, the launcher Job fails, and the MPIJob is Failed with the reason in the launcher's log.
fn pulling_worker(
    mut worker: Value,
    delivery: &Delivery,
    pull: &[String],
    image: &str,
    env: &BTreeMap<String, String>,
) -> Result<Value, LaunchError> {
    let store = delivery
        .env
        .parent()
        .and_then(|s| s.to_str())
        .ok_or(LaunchError::Internal("a checked store path has a parent"))?;
    let mounts = json!([{ "name": STORE_VOLUME, "mountPath": store }]);
    let mut command = vec![
        "hvd".to_owned(),
        "worker-env".to_owned(),
        "--once".to_owned(),
    ];
    command.extend(pull.iter().cloned());
    command.push(PULL_FAILURE_NOTE_FLAG.to_owned());
    worker["initContainers"] = json!([{
        "name": "hvd-pull",
        "image": image,
        "command": command,
        "env": env_list(env),
        "volumeMounts": mounts,
    }]);
    worker["containers"][0]["volumeMounts"] = mounts;
    worker["volumes"] = json!([{ "name": STORE_VOLUME, "emptyDir": {} }]);
    Ok(worker)
}

/// Writes `export`'s manifests into `dir` (created), one pretty JSON file each, and returns their paths. The token
/// Secret is readable by its owner only (as `kubectl` keeps a kubeconfig): a new file is created 0600, an old one is
/// made so before the token is written.
pub fn write_manifests(
    export: &Export,
    dir: &std::path::Path,
) -> Result<Vec<std::path::PathBuf>, LaunchError> {
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    std::fs::create_dir_all(dir).map_err(|source| LaunchError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files = Vec::new();
    for manifest in &export.manifests {
        let path = dir.join(&manifest.file);
        let text = serde_json::to_string_pretty(&manifest.content)
            .map_err(|_| LaunchError::Internal("a manifest does not serialize"))?;
        let mode = if manifest.content["kind"] == "Secret" {
            0o600
        } else {
            0o644
        };
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(mode)
                .open(&path)?;
            file.set_permissions(std::fs::Permissions::from_mode(mode))?;
            file.set_len(0)?;
            file.write_all((text + "\n").as_bytes())
        };
        write().map_err(|source| LaunchError::Write {
            path: path.clone(),
            source,
        })?;
        files.push(path);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(env: &str, cache: &str) -> Delivery {
        Delivery {
            env: env.into(),
            caches: vec![cache.into()],
            trusted_keys: vec!["k1:AAAA".into()],
        }
    }

    /// The pull arguments name the env, every cache and key; a URL with credentials (a manifest is read by whoever
    /// can list pods) and an env that is not a store path are refused before any manifest is written.
    #[test]
    fn pods_pull_arguments_name_env_caches_and_keys_and_refuse_credentials() {
        let env = "/opt/hvd/store/0123456789abcdef0123456789abcdef-app-env";
        let args = delivery(env, "s3://bucket/cache")
            .worker_env_args()
            .unwrap();
        assert_eq!(
            args,
            [
                format!("--pull={env}"),
                "--cache=s3://bucket/cache".into(),
                "--trusted-key=k1:AAAA".into()
            ]
        );
        let err = delivery(env, "https://user:s3cr3t@cache.example/p")
            .worker_env_args()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("carries credentials") && !err.contains("s3cr3t"),
            "{err}"
        );
        for bad in ["/opt/venv", "/", "/opt/hvd/store/../etc"] {
            let err = delivery(bad, "file:///c")
                .worker_env_args()
                .unwrap_err()
                .to_string();
            assert!(err.contains("is not a store path"), "{bad}: {err}");
        }
    }
}
