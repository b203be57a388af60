//! Kubernetes manifests for a project (`hvd export k8s`): a JobSet (jobset.x-k8s.io/v1alpha2) whose replicated
//! jobs follow the step graph with `dependsOn`, or one MPIJob (kubeflow.org/v2beta1) per distributed step. Every
//! rank runs `hvd worker-env -- /bin/sh -c COMMAND` (the image must have `hvd` on its PATH), which maps the Indexed
//! Job's `JOB_COMPLETION_INDEX` (JobSet) or MPI's variables (MPIJob) to the worker contract.

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

/// Adds `HVD_JOB_TOKEN` to a distributed step's env list: the Job's UID, which every pod of the step (a JobSet's
/// Indexed Job; an MPIJob's launcher Job, whose mpirun passes it on) can read from its own labels (downward API) and
/// which is not written in the manifest.
fn with_job_token(mut env: Value, distributed: bool) -> Value {
    if distributed && let Value::Array(list) = &mut env {
        list.push(json!({
            "name": "HVD_JOB_TOKEN",
            "valueFrom": { "fieldRef": {
                "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"
            }},
        }));
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

/// The manifests for every step of `project`.
pub fn export(project: &Project, flavour: Flavour) -> Result<Export, LaunchError> {
    let graph = StepGraph::new(project)?;
    let steps = graph.selection(None)?;
    let image = image(project)?;
    let name = dns_label(&project.name);
    let resources = resources(project);
    let mut notes = Vec::new();
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
                        json!(["hvd", "worker-env", "--", "/bin/sh", "-c", step.run])
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
                                "env": with_job_token(env_list(&env), step.workers.is_some()),
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
                    "failurePolicy": { "maxRestarts": 0 },
                    "network": { "enableDNSHostnames": true, "publishNotReadyAddresses": true, "subdomain": name },
                    "replicatedJobs": jobs,
                },
            });
            Ok(Export {
                manifests: vec![Manifest {
                    file: format!("{name}.jobset.json"),
                    content: jobset,
                }],
                notes,
            })
        }
        Flavour::MpiJob => {
            let settings = project.cluster.as_ref().map(|c| &c.settings);
            let mpi = settings
                .and_then(|s| s.get("mpi"))
                .and_then(|m| MpiFlavour::parse(m))
                .unwrap_or(MpiFlavour::OpenMpi);
            let mut manifests = Vec::new();
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
                // 0 there: one slot per worker, hostfile order), with the launcher Job's UID as token.
                env.insert(
                    "HVD_RENDEZVOUS".into(),
                    format!("{job}-worker-0.{job}:{RENDEZVOUS_PORT}"),
                );
                env.insert(super::shim::SERVE_VAR.into(), "1".into());
                let mut export: Vec<String> = env.keys().cloned().collect();
                export.push("HVD_JOB_TOKEN".into());
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
                        command: &step.run,
                        cores: u32::MAX,
                        root: false,
                    },
                );
                let container = |role: &str, command: Option<&Vec<String>>| {
                    let mut c = json!({
                        "name": role,
                        "image": image,
                        "env": with_job_token(env_list(&env), command.is_some()),
                    });
                    match command {
                        Some(argv) => c["command"] = json!(argv),
                        None => c["resources"] = resources.clone(),
                    }
                    c
                };
                let mpijob = json!({
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
                                "template": { "spec": { "containers": [container("worker", None)] } },
                            },
                        },
                    },
                });
                manifests.push(Manifest {
                    file: format!("{job}.mpijob.json"),
                    content: mpijob,
                });
            }
            Ok(Export { manifests, notes })
        }
    }
}
