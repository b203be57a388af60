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

pub mod elastic;

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
    export_running(project, flavour, delivery, &[])
}

/// [`export_with`], with `flags` (`hvd run`'s flags that shape a step: `--workers=N`, `--grace=S`, ...) on the
/// command line of each elastic step's launcher pod ([`elastic::launcher_argv`]).
pub fn export_running(
    project: &Project,
    flavour: Flavour,
    delivery: Option<&Delivery>,
    flags: &[String],
) -> Result<Export, LaunchError> {
    let pull_args = delivery.map(Delivery::worker_env_args).transpose()?;
    let graph = StepGraph::new(project)?;
    let steps = graph.selection(None, false)?;
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
            // The JobSet restarts as a whole (every job again) when a pod fails, up to the most any step allows; an
            // elastic step's restarts are its launcher's.
            let max_restarts = steps
                .iter()
                .filter(|s| !s.is_elastic())
                .filter_map(|s| s.restarts)
                .max()
                .unwrap_or(0);
            let mut jobs = Vec::new();
            let mut pools = Vec::new();
            // What an elastic step's launcher pod reads: the .hvd file and its imports.
            let files = match steps.iter().any(|s| s.is_elastic()) {
                true => Some(elastic::ProjectFiles::read(project)?),
                false => None,
            };
            for step in &steps {
                if step.workers == Some(0) {
                    return Err(LaunchError::ZeroWorkers(step.name.clone()));
                }
                let job = dns_label(&step.name);
                let n = step.workers.unwrap_or(1);
                let needs = graph.needs(&step.name);
                if needs.len() > 5 {
                    return Err(LaunchError::Engine(format!(
                        "step `{}` needs {} steps; a JobSet's dependsOn takes at most 5",
                        step.name,
                        needs.len()
                    )));
                }
                let depends_on = (!needs.is_empty()).then(|| {
                    let mut needs: Vec<String> = needs.iter().map(|n| dns_label(n)).collect();
                    needs.sort();
                    Value::Array(
                        needs
                            .iter()
                            .map(|n| json!({ "name": n, "status": "Complete" }))
                            .collect(),
                    )
                });
                if step.is_elastic() {
                    elastic::check_step(step, &job, &steps)?;
                    let env = step_env(step);
                    let files = files
                        .as_ref()
                        .ok_or(LaunchError::Internal("read for an elastic step"))?;
                    for mut replicated in elastic::replicated_jobs(
                        &name,
                        files,
                        step,
                        n,
                        &image,
                        &env,
                        &resources,
                        pull_args.as_deref(),
                        delivery,
                        flags,
                    )? {
                        if let Some(d) = &depends_on {
                            replicated["dependsOn"] = d.clone();
                        }
                        jobs.push(replicated);
                    }
                    pools.push(elastic::pool_name(&job));
                    continue;
                }
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
                if let Some(d) = depends_on {
                    replicated["dependsOn"] = d;
                }
                jobs.push(replicated);
            }
            let mut jobset = json!({
                "apiVersion": "jobset.x-k8s.io/v1alpha2",
                "kind": "JobSet",
                "metadata": metadata(&name, project),
                "spec": {
                    "failurePolicy": { "maxRestarts": max_restarts },
                    "network": { "enableDNSHostnames": true, "publishNotReadyAddresses": true, "subdomain": name },
                    "replicatedJobs": jobs,
                },
            });
            let mut manifests = vec![secret_manifest];
            if !pools.is_empty() {
                // Done once every job but the elastic steps' worker pods is: the JobSet then removes those.
                let done: Vec<Value> = jobs
                    .iter()
                    .filter_map(|j| j["name"].as_str())
                    .filter(|j| !pools.iter().any(|p| p == j))
                    .map(|j| json!(j))
                    .collect();
                jobset["spec"]["successPolicy"] =
                    json!({ "operator": "All", "targetReplicatedJobs": done });
                let files = files
                    .as_ref()
                    .ok_or(LaunchError::Internal("read for an elastic step"))?;
                manifests.extend(elastic::launcher_objects(&name, project, files)?);
            }
            manifests.push(Manifest {
                file: format!("{name}.jobset.json"),
                content: jobset,
            });
            Ok(Export { manifests, notes })
        }
        Flavour::MpiJob => {
            let settings = project.cluster.as_ref().map(|c| &c.settings);
            let mpi = settings
                .and_then(|s| s.mpi.as_deref())
                .and_then(MpiFlavour::parse)
                .unwrap_or(MpiFlavour::OpenMpi);
            let mut manifests = vec![secret_manifest];
            for step in &steps {
                if step.is_elastic() {
                    notes.push(format!(
                        "step `{}` is elastic, but an MPIJob's mpirun ends every rank when one dies: it runs on all \
                         its workers and fails as a whole (`--flavour jobset` runs it elastic, under a launcher pod)",
                        step.name
                    ));
                }
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

/// The note (in the store directory) that an MPIJob worker's init container leaves when it could not get the env.
pub const PULL_FAILURE_NOTE: &str = ".hvd-pull-failed";

/// The name of an MPIJob worker's init container (also `$0` of [`PULL_GUARD`], which names it in the note).
pub const PULL_CONTAINER: &str = "hvd-pull";

/// The init container's command is `/bin/sh -c PULL_GUARD hvd-pull NOTE ENV hvd worker-env --once ...`: it runs the
/// pull (`"$@"`) as its child and, when that did not end with 0, writes a note itself (naming the pod, the env and
/// the exit status) and still exits 0. `hvd worker-env` notes the failures it sees, but not its own end: a pull
/// killed by the OOM killer or SIGKILL, an `hvd` that is missing from the image or not executable, a panic. Exiting
/// non-zero there would leave the pod in `Init:Error` and the MPIJob pending forever; with the note, the ranks'
/// shims refuse and the job ends. Its status replaces any note there (a non-zero end means the pull wrote none of
/// its own; what is there is an earlier pod's). The text is constant: every value (note path, env, command) is a
/// positional parameter, never part of the script, and is written with `printf %s`. The note is written to a
/// temporary name and renamed into place; the `rm -f` of that name just before is what makes the write create a new
/// file (whatever had the name, a file, a link, a FIFO, is gone). `set -C` adds little: dash refuses an existing
/// regular file with it but still opens a FIFO or a link to one. A directory in the note's place is left (renaming
/// onto it would move the note inside); the ranks' shims refuse that too ("the note is not a file"). A pod's name is
/// `$HOSTNAME` (what Kubernetes sets), else the kernel's host name, as `hvd worker-env` names it.
///
/// The shell is PID 1 of the init container, which the kernel sends only signals it handles: the pull runs in the
/// background and the shell forwards SIGTERM (a pod deleted mid-pull) to it and waits on, so the pod ends when the
/// pull does instead of after the whole grace period (the trap is set before the pull starts, and a SIGTERM before
/// its pid is known is sent once it is). `wait` returns above 128 when the trap interrupts it, so it is called again
/// while the pull is still there; the pull's own status, a signal's included, is mapped as before.
pub const PULL_GUARD: &str = r#"note=$1 env=$2
shift 2
child= term=
trap 'term=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null' TERM
"$@" &
child=$!
[ -z "$term" ] || kill -TERM "$child" 2>/dev/null
wait "$child"
status=$?
while [ "$status" -gt 128 ] && kill -0 "$child" 2>/dev/null; do
  wait "$child"
  status=$?
done
[ "$status" -eq 0 ] && exit 0
case $status in
101) why='hvd panicked' ;;
126) why='hvd could not be run: it is not executable in this image' ;;
127) why='hvd could not be run: it is not on the PATH of this image, or not executable there' ;;
137) why='killed (OOM or SIGKILL)' ;;
*) if [ "$status" -gt 128 ]; then why="killed by signal $((status - 128))"; else why='it wrote no note'; fi ;;
esac
pod=${HOSTNAME:-$(cat /proc/sys/kernel/hostname 2>/dev/null)}
text="node \`$pod\` could not get the env $env: its init container's \`hvd worker-env --once --pull\` ended with exit status $status: $why (its log: \`kubectl logs $pod -c $0\`)"
printf '%s: %s\n' "$0" "$text" >&2
tmp=$note.$$.sh
rm -f "$tmp" 2>/dev/null
if [ ! -d "$note" ] && (set -C && printf '%s\n' "$text" >"$tmp") 2>/dev/null && mv -f "$tmp" "$note"; then
  printf '%s: noted in %s; this pod'"'"'s ranks refuse to start with it, which ends the job\n' "$0" "$note" >&2
else
  rm -f "$tmp" 2>/dev/null
  if [ -e "$note" ] || [ -L "$note" ]; then
    printf '%s: could not write %s: something else is in its place (a directory, an earlier note); this pod'"'"'s ranks refuse to start with that, which ends the job\n' "$0" "$note" >&2
  else
    printf '%s: could not write %s; this pod'"'"'s ranks pull the env themselves\n' "$0" "$note" >&2
  fi
fi
exit 0
"#;

/// An MPIJob's worker pod spec `worker` with the env pulled before mpirun reaches it: an init container (the same
/// image, the worker's env) runs `hvd worker-env --once --pull=ENV --cache=URL... --trusted-key=KEY...
/// --pull-failure-note` with no command (`pull`) under [`PULL_GUARD`], which substitutes the closure, verified, into an `emptyDir`
/// mounted at the env's store directory in both containers. The launcher waits for ready workers. A failed pull
/// must end the job, not hold it: mpi-operator creates the launcher only once every worker is ready and fails the
/// MPIJob only when its launcher Job fails (or a worker is evicted), so a pod stuck in `Init:Error` would hold the
/// other workers forever. So the init container writes the pull's reason into the volume and exits 0; the worker
/// starts (sshd), the launcher's mpirun starts each rank's shim, and the shims on that pod refuse with the reason:
/// mpirun fails, the launcher Job fails, and the MPIJob is Failed with the reason in the launcher's log. A pull that
/// dies without its note gets one from the guard.
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
    let env_path = delivery
        .env
        .to_str()
        .ok_or(LaunchError::Internal("a checked store path is text"))?;
    let mounts = json!([{ "name": STORE_VOLUME, "mountPath": store }]);
    let mut command: Vec<String> = [
        "/bin/sh",
        "-c",
        PULL_GUARD,
        PULL_CONTAINER,
        &format!("{store}/{PULL_FAILURE_NOTE}"),
        env_path,
        "hvd",
        "worker-env",
        "--once",
    ]
    .map(str::to_owned)
    .into();
    command.extend(pull.iter().cloned());
    command.push(PULL_FAILURE_NOTE_FLAG.to_owned());
    worker["initContainers"] = json!([{
        "name": PULL_CONTAINER,
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

    /// Runs [`PULL_GUARD`] with the real `/bin/sh` as the init container does (`$0` the container, then the note, the
    /// env and the pull's command) with `HOSTNAME` set to `pod`, in the note's store's parent directory.
    fn guard(note: &std::path::Path, env: &str, pod: &str, pull: &[&str]) -> std::process::Output {
        std::process::Command::new("/bin/sh")
            .current_dir(note.parent().and_then(|s| s.parent()).unwrap())
            .args(["-c", PULL_GUARD, PULL_CONTAINER])
            .arg(note)
            .arg(env)
            .args(pull)
            .env("HOSTNAME", pod)
            .output()
            .unwrap()
    }

    /// A pull that dies without a note (here: SIGKILL) still ends the init container with 0 and a note naming the
    /// pod, the env and the status, written at the exact path; hostile values (a pod name, an env and a note path
    /// with quotes, `$(...)`, backticks and a newline) are text in the note, never shell code; an earlier pod's note
    /// is replaced and a link in its place is replaced, not followed.
    #[test]
    fn the_pull_guard_notes_a_pull_that_died_and_runs_nothing_it_was_given_as_text() {
        let dir = tempfile::tempdir().unwrap();
        let canary = dir.path().join("canary");
        let store = dir.path().join("st'ore $(touch canary) `touch canary`");
        std::fs::create_dir(&store).unwrap();
        let note = store.join(PULL_FAILURE_NOTE);
        let env = format!("{}/abc-env\"$(touch canary)", store.display());
        let pod = "pod-1`touch canary`$(touch canary)\nsecond";
        let out = guard(&note, &env, pod, &["sh", "-c", "kill -9 $$"]);
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        let text = std::fs::read_to_string(&note).unwrap();
        assert!(
            text.starts_with(&format!("node `{pod}` could not get the env {env}: ")),
            "{text}"
        );
        assert!(
            text.contains("exit status 137: killed (OOM or SIGKILL)")
                && text.contains(&format!("kubectl logs {pod} -c hvd-pull")),
            "{text}"
        );
        assert!(!canary.exists(), "a value ran as shell code");
        let left: Vec<_> = std::fs::read_dir(&store).unwrap().collect();
        assert_eq!(left.len(), 1, "a temporary file is left: {left:?}");

        // An earlier pod's note as a link to a file outside: the link is replaced, the file untouched.
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "kept").unwrap();
        std::fs::remove_file(&note).unwrap();
        std::os::unix::fs::symlink(&outside, &note).unwrap();
        let out = guard(&note, &env, "pod-2", &["sh", "-c", "exit 3"]);
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "kept");
        assert!(!std::fs::symlink_metadata(&note).unwrap().is_symlink());
        let text = std::fs::read_to_string(&note).unwrap();
        assert!(text.contains("exit status 3: it wrote no note"), "{text}");

        // A pull that works leaves the note to the pull (which removes an earlier one itself) and exits 0.
        std::fs::remove_file(&note).unwrap();
        let out = guard(&note, &env, "pod-3", &["true"]);
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        assert!(!note.exists() && out.stderr.is_empty(), "{out:?}");
        // A missing `hvd` (127) and one that is not executable (126) are named.
        for (program, why) in [
            (
                "no-such-hvd-program",
                "exit status 127: hvd could not be run: it is not on the PATH",
            ),
            (
                outside.to_str().unwrap(),
                "exit status 126: hvd could not be run: it is not executable",
            ),
        ] {
            let out = guard(&note, &env, "pod-4", &[program, "worker-env"]);
            assert_eq!(out.status.code(), Some(0), "{out:?}");
            let text = std::fs::read_to_string(&note).unwrap();
            assert!(text.contains(why), "{program}: {text}");
        }
    }

    /// A directory in the note's place is left as it is (renaming onto it would put the note inside), and the guard
    /// says what the ranks' shims then do: refuse (the note is not a file), not pull the env themselves; where
    /// nothing can be written and nothing is there, they do pull it.
    #[test]
    fn the_pull_guard_notes_what_the_ranks_do_when_it_cannot_write() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        std::fs::create_dir(&store).unwrap();
        let note = store.join(PULL_FAILURE_NOTE);
        std::fs::create_dir(&note).unwrap();
        let out = guard(&note, "e", "pod-1", &["sh", "-c", "exit 3"]);
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("something else is in its place (a directory, an earlier note); this pod's ranks refuse")
                && !err.contains("pull the env themselves"),
            "{err}"
        );
        assert_eq!(
            std::fs::read_dir(&note).unwrap().count(),
            0,
            "written into the directory"
        );
        assert_eq!(
            std::fs::read_dir(&store).unwrap().count(),
            1,
            "a temporary file is left"
        );

        // A store the guard cannot write (one that is not there stands in for a read-only volume) and no note.
        let out = guard(
            &dir.path().join("missing").join(PULL_FAILURE_NOTE),
            "e",
            "pod-2",
            &["false"],
        );
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("this pod's ranks pull the env themselves"),
            "{err}"
        );
    }

    /// The guard is PID 1 of its container, where a SIGTERM (the pod deleted mid-pull) does nothing unless handled:
    /// it forwards it to the pull, which ends on it, and still notes that and exits 0.
    #[test]
    fn the_pull_guard_forwards_sigterm_to_the_pull_and_still_notes_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        std::fs::create_dir(&store).unwrap();
        let note = store.join(PULL_FAILURE_NOTE);
        let started = dir.path().join("started");
        let got = dir.path().join("got-term");
        // The pull: notes that it runs, notes the SIGTERM it gets and ends on it (143); it would sleep ~forever.
        let pull = format!(
            "trap 'touch \"{}\"; exit 143' TERM; touch \"{}\"; while :; do sleep 0.05; done",
            got.display(),
            started.display()
        );
        let mut child = std::process::Command::new("/bin/sh")
            .current_dir(dir.path())
            .args(["-c", PULL_GUARD, PULL_CONTAINER])
            .arg(&note)
            .arg("e")
            .args(["sh", "-c", &pull])
            .env("HOSTNAME", "pod-1")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !started.exists() {
            assert!(std::time::Instant::now() < until, "the pull never started");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // SAFETY: kill(2) on the guard's own pid, a child of this process not yet waited for.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() >= until {
                let _ = child.kill();
                panic!("the guard did not end after SIGTERM");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(status.code(), Some(0), "{status:?}");
        assert!(got.exists(), "the pull did not get the SIGTERM");
        let text = std::fs::read_to_string(&note).unwrap();
        assert!(
            text.contains("exit status 143: killed by signal 15"),
            "{text}"
        );
    }
}
