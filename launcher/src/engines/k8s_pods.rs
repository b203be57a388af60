//! The kubernetes engine inside a launcher pod: an elastic step of a JobSet (`engines/k8s.rs`) runs under `hvd run
//! --step S --no-deps --engine kubernetes` in a pod of its own, whose hosts are the step's worker pods. The JobSet
//! sets [`WORKERS_VAR`] (their label selector), [`NAMESPACE_VAR`] and `HVD_POD_IP` on the launcher pod; with them,
//! `--engine kubernetes` is this supervised engine instead of the one that applies a JobSet.
//!
//! It is the ssh engine's remote ranks with `kubectl exec` for ssh ([`Transport::KubectlExec`]): each rank is
//! `kubectl exec -i POD -c worker -- /bin/sh -c WRAPPER...` (the token on stdin, stop lines after it, the rank's exit
//! status as kubectl's), the rendezvous binds the launcher pod's IP, and the step's hosts come from its own host
//! discovery, `kubectl get pods -l SELECTOR --field-selector=status.phase=Running` (one slot per pod, pods being
//! deleted left out): a pod that is lost (its node gone) takes its ranks with it; an evicted one hands them over (its
//! PID 1 passes SIGTERM on, and the launcher asks them too); the pod the Job controller starts in its place is found
//! and joins at a commit. The ranks run in the worker container's working directory (the image has the project's
//! files); with caches each starts through `hvd worker-env --once --pull` there. Once the step is over the launcher
//! ends every worker pod with 0 ([`SupervisedEngine::end_step`]).

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hvd_lang::model::Project;

use crate::LaunchError;
use crate::discovery::Program;
use crate::engine::{Engine, Plan, PlannedStep, RankCommand, RankStart, SupervisedEngine};
use crate::engines::shim::POD_IP_VAR;
use crate::engines::ssh::{Deadlines, SshSetup, Transport, started_rank_env};
use crate::env::{Slot, WorkerLayout};
use crate::options::RunOptions;

/// The label selector of the elastic step's worker pods (set on its launcher pod by the JobSet).
pub const WORKERS_VAR: &str = "HVD_K8S_WORKERS";
/// The launcher pod's namespace (downward API `metadata.namespace`), where its worker pods are.
pub const NAMESPACE_VAR: &str = "HVD_K8S_NAMESPACE";
/// The discovery of a launcher pod: runs `"$@"` (`kubectl get pods ...`, [`PodsSetup::get_pods_argv`]) and prints
/// the `POD:1` of each line without a deletion time; kubectl's failure is the discovery's (its status and stderr).
pub const DISCOVER: &str = r#"out=$("$@") || exit
printf '%s\n' "$out" | while read -r pod deleting; do [ -n "$pod" ] && [ -z "$deleting" ] && printf '%s\n' "$pod"; done
exit 0"#;

/// How long an elastic step's first discovery waits for its minimum of running worker pods without `--start-timeout`.
pub const PODS_START_WITHIN: Duration = Duration::from_secs(600);

/// How long the launcher waits for each worker pod to take its end-of-step signal.
pub const RELEASE_WITHIN: Duration = Duration::from_secs(10);

/// The container of a worker pod the ranks run in.
pub const CONTAINER: &str = "worker";

/// Whether this process runs in an elastic step's launcher pod ([`WORKERS_VAR`] is set).
pub fn in_launcher_pod() -> bool {
    std::env::var_os(WORKERS_VAR).is_some_and(|v| !v.is_empty())
}

/// The engine of a launcher pod (see the module docs).
#[derive(Debug, Clone)]
pub struct PodsSetup {
    ssh: SshSetup,
    selector: String,
    namespace: Option<String>,
    start_timeout: Option<Duration>,
}

pub fn start(_project: &Project, options: &RunOptions) -> Result<Engine, LaunchError> {
    Ok(Engine::Supervised(Arc::new(PodsSetup::from_env(options)?)))
}

fn engine_error(message: String) -> LaunchError {
    LaunchError::Engine(message)
}

/// A label selector as kubectl takes it: `key=value` terms separated by commas, in the characters of label keys and
/// values (nothing kubectl could read as an option, nothing a shell would split).
fn valid_selector(selector: &str) -> bool {
    !selector.starts_with('-')
        && selector.split(',').all(|term| {
            term.split_once('=').is_some_and(|(k, v)| {
                !k.is_empty()
                    && [k, v].iter().all(|part| {
                        part.bytes().all(|b| {
                            b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'/')
                        })
                    })
            })
        })
}

/// A DNS-1123 label (a namespace) or subdomain (a pod's name): lowercase alphanumerics, `-` and `.`, starting and
/// ending with an alphanumeric, at most 253 characters.
pub fn valid_k8s_name(name: &str) -> bool {
    let edge = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    name.len() <= 253
        && edge(name.as_bytes().first())
        && edge(name.as_bytes().last())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.'))
}

impl PodsSetup {
    /// From the launcher pod's variables ([`WORKERS_VAR`], [`NAMESPACE_VAR`], `HVD_POD_IP`) and the run's options.
    pub fn from_env(options: &RunOptions) -> Result<Self, LaunchError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let selector = var(WORKERS_VAR).unwrap_or_default();
        if !valid_selector(&selector) {
            return Err(engine_error(format!(
                "`{WORKERS_VAR}` is {selector:?}, not a label selector (`key=value,...`); the JobSet hvd writes sets \
                 it on an elastic step's launcher pod"
            )));
        }
        let namespace = var(NAMESPACE_VAR);
        if let Some(ns) = namespace.as_deref().filter(|ns| !valid_k8s_name(ns)) {
            return Err(engine_error(format!(
                "`{NAMESPACE_VAR}` is {ns:?}, not a namespace name (lowercase letters, digits, `-` and `.`)"
            )));
        }
        let pod_ip = var(POD_IP_VAR).unwrap_or_default();
        let bind_ip: IpAddr = pod_ip.parse().map_err(|_| {
            engine_error(format!(
                "`{POD_IP_VAR}` is {pod_ip:?}, not the launcher pod's IP address (the JobSet sets it from \
                 `status.podIP`): the rendezvous binds it"
            ))
        })?;
        Ok(PodsSetup {
            ssh: SshSetup {
                hosts: Vec::new(),
                ssh: Vec::new(),
                bind_ip,
                interface: None,
                host_addrs: vec![bind_ip],
                grace: options.grace,
                copy_env: false,
                caches: options.caches.clone(),
                trusted_keys: options.trusted_keys.clone(),
                hvd: None,
                work_dirs: Arc::default(),
                pulling_hvds: Arc::default(),
                deadlines: Deadlines::new(options.start_timeout),
                transport: Transport::KubectlExec {
                    namespace: namespace.clone(),
                    container: CONTAINER.into(),
                },
                rank_dir: Some(PathBuf::from(".")),
            },
            selector,
            namespace,
            start_timeout: options.start_timeout,
        })
    }

    /// `kubectl get pods [-n NS] -l SELECTOR --field-selector=status.phase=Running -o jsonpath=...`: each running
    /// worker pod as `POD:1`, followed by its `deletionTimestamp` when it is being deleted (evicted, its node
    /// drained: a terminating pod is still `Running` until it ends).
    pub fn get_pods_argv(&self) -> Vec<String> {
        let mut argv = vec!["kubectl".to_owned(), "get".to_owned(), "pods".to_owned()];
        if let Some(ns) = &self.namespace {
            argv.extend(["-n".into(), ns.clone()]);
        }
        argv.extend([
            "-l".into(),
            self.selector.clone(),
            "--field-selector=status.phase=Running".into(),
            "--request-timeout=10s".into(),
            "-o".into(),
            r#"jsonpath={range .items[*]}{.metadata.name}:1 {.metadata.deletionTimestamp}{"\n"}{end}"#.into(),
        ]);
        argv
    }

    /// A rank's variables on its pod: the ssh engine's, without `MASTER_ADDR` (torch's rendezvous host: rank 0's
    /// pod is found only when the step starts, and a pod's name is not an address other pods resolve).
    fn rank_vars(&self, env: super::ssh::RemoteRankEnv<'_>) -> Vec<(String, String)> {
        let mut vars = self.ssh.rank_vars(env);
        vars.retain(|(k, _)| k != crate::env_vars::MASTER_ADDR);
        vars
    }

    /// The `hvd` that pulls the env in a worker pod (the image's, on its PATH), with caches.
    fn pulling_hvd(&self) -> Option<&'static str> {
        (!self.ssh.caches.is_empty()).then_some("hvd")
    }
}

impl SupervisedEngine for PodsSetup {
    fn name(&self) -> &'static str {
        "kubernetes engine (in a launcher pod)"
    }

    /// The worker pods are found when the step starts: until then every rank is on "a worker pod".
    fn layout(&self, workers: Option<u32>) -> WorkerLayout {
        match workers {
            Some(n) => WorkerLayout::spread(&[("<worker pod>".to_owned(), 1)], n),
            None => WorkerLayout::local(&crate::env::local_hostname(), 1),
        }
    }

    /// Only an elastic step runs in a launcher pod (its hosts come from the engine's own discovery, never from a
    /// program the file names).
    fn prepare(&self, plan: &Plan) -> Result<(), LaunchError> {
        for step in plan.steps.iter().filter(|s| s.workers.is_some()) {
            if step.min_workers.is_none() {
                return Err(engine_error(format!(
                    "step `{}` is not elastic: in a launcher pod (`{WORKERS_VAR}` is set) the kubernetes engine runs \
                     only the elastic step the JobSet made the pod for",
                    step.name
                )));
            }
            if step.elastic.discovery.is_some() {
                return Err(engine_error(format!(
                    "step `{}` names a host discovery program: in a launcher pod its hosts are its worker pods",
                    step.name
                )));
            }
        }
        super::ssh::check_elastic_env_names(plan, "the kubernetes engine")
    }

    fn remote_hosts(&self) -> bool {
        true
    }

    /// The step is over: each worker pod's PID 1 ([`super::k8s::elastic::IDLE`]) gets SIGUSR1 and ends with 0, so
    /// that the worker pods hold nothing the next steps need (the Job's `successPolicy` ends any the launcher did not
    /// reach). Best effort, each within [`RELEASE_WITHIN`]: a pod not reached goes with the JobSet. Not when this
    /// launcher was interrupted (its pod evicted: the kubelet's SIGTERM): its Job starts another launcher pod in its
    /// place, which runs the step again in the same worker pods (ended with 0, they would end their Job).
    fn end_step(&self, _step: &PlannedStep, interrupted: bool) {
        if interrupted {
            return;
        }
        let get = self.get_pods_argv();
        let Ok(out) = std::process::Command::new(&get[0])
            .args(&get[1..])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
        else {
            return;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let pods: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter_map(|l| l.strip_suffix(":1"))
            .filter(|pod| valid_k8s_name(pod))
            .collect();
        std::thread::scope(|scope| {
            for pod in pods {
                scope.spawn(move || {
                    let argv = self.ssh.argv(pod, "kill -USR1 1");
                    let mut kubectl = std::process::Command::new(&argv[0]);
                    kubectl.args(&argv[1..]);
                    let _ = super::ssh::exits_within(&mut kubectl, RELEASE_WITHIN);
                });
            }
        });
    }

    /// A pod named by discovery: a pod name (so never a kubectl option); nothing to deliver (the image has the
    /// project, and each rank pulls the env).
    fn reach_host(&self, _plan: &Plan, _step: &PlannedStep, host: &str) -> Result<(), LaunchError> {
        if valid_k8s_name(host) {
            Ok(())
        } else {
            Err(engine_error(format!(
                "`kubectl get pods` named {host:?}, which is not a pod name"
            )))
        }
    }

    fn reaches_at_once(&self) -> bool {
        true
    }

    /// `kubectl exec POD -c worker -- /bin/sh -c true` within `within`.
    fn probe_host(&self, host: &str, within: Duration) -> Option<bool> {
        SupervisedEngine::probe_host(&self.ssh, host, within)
    }

    fn rendezvous(&self) -> (IpAddr, Vec<IpAddr>) {
        (self.ssh.bind_ip, vec![self.ssh.bind_ip])
    }

    fn rank_command(&self, rank: &RankStart<'_>) -> Result<RankCommand, LaunchError> {
        let Some(rendezvous) = rank.rendezvous else {
            return Ok(RankCommand::local(rank));
        };
        let vars = self.rank_vars(started_rank_env(rank, rendezvous));
        let after_token = super::ssh::stdin_vars(&vars, "the kubernetes engine")?;
        let argv = self.ssh.rank_argv(
            rank.plan,
            rank.step,
            rank.slot,
            rendezvous.addr.ip(),
            self.pulling_hvd(),
        )?;
        Ok(RankCommand::remote_argv(&argv, after_token, false))
    }

    fn dry_run_rank(&self, plan: &Plan, step: &PlannedStep, slot: &Slot) -> Vec<String> {
        let vars = self.rank_vars(super::ssh::dry_run_rank_env(
            plan,
            step,
            slot,
            self.ssh.bind_ip,
        ));
        let argv = self
            .ssh
            .rank_argv(plan, step, slot, self.ssh.bind_ip, self.pulling_hvd());
        super::ssh::dry_run_lines("kubectl", argv, &vars, "the kubernetes engine")
    }

    /// [`PodsSetup::get_pods_argv`] under [`DISCOVER`], which leaves out the pods being deleted.
    /// Worker pods start with the launcher pod: they may wait to be scheduled and pull their image (and the env)
    /// for minutes. The first discovery waits for the step's minimum up to `--start-timeout`, else
    /// [`PODS_START_WITHIN`] (at least `--elastic-timeout`).
    fn first_hosts_within(&self, elastic_timeout: Duration) -> (Duration, &'static str) {
        let start = self.start_timeout.unwrap_or(PODS_START_WITHIN);
        match start >= elastic_timeout {
            true => (
                start,
                "the worker pods' start: --start-timeout, default 600 s",
            ),
            false => (elastic_timeout, "--elastic-timeout"),
        }
    }

    fn discovery(&self) -> Option<Program> {
        let mut args = vec![
            "-c".to_owned(),
            DISCOVER.to_owned(),
            "hvd-discover".to_owned(),
        ];
        args.extend(self.get_pods_argv());
        Some(Program {
            path: PathBuf::from("/bin/sh"),
            args,
            label: PathBuf::from(format!("kubectl get pods -l {}", self.selector)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_and_names_are_checked() {
        assert!(valid_selector(
            "jobset.sigs.k8s.io/jobset-name=t,jobset.sigs.k8s.io/replicatedjob-name=train-workers"
        ));
        for bad in ["", "-oyaml", "a=b c", "a", "a=b;rm", "a=$(x)", "=b"] {
            assert!(!valid_selector(bad), "{bad}");
        }
        assert!(valid_k8s_name("t-train-workers-0-1-x7k2p"));
        for bad in ["", "-n", "Pod", "a b", "a/b", "a-", &"a".repeat(254)] {
            assert!(!valid_k8s_name(bad), "{bad}");
        }
    }

    /// A worker pod waits for its ranks past the step's `HVD_PREEMPT_GRACE`, within its pod's grace period.
    #[test]
    fn a_worker_pod_waits_for_its_ranks_past_their_grace_within_its_own() {
        use crate::engines::k8s::elastic::{worker_grace_seconds, worker_stop_seconds};
        let env = |v: &str| {
            std::collections::BTreeMap::from([("HVD_PREEMPT_GRACE".to_owned(), v.to_owned())])
        };
        assert_eq!(worker_stop_seconds(&Default::default()), 40);
        assert_eq!(worker_stop_seconds(&env("120")), 130);
        assert_eq!(worker_stop_seconds(&env("2.5")), 13);
        for bad in ["", "x", "-1", "nan", "inf"] {
            assert_eq!(worker_stop_seconds(&env(bad)), 40, "{bad}");
        }
        assert_eq!(worker_grace_seconds(40), 45);
    }

    /// Discovery lists the running pods but those being deleted, and fails when kubectl does.
    #[test]
    fn discovery_leaves_out_pods_being_deleted_and_fails_with_kubectl() {
        let run = |program: &[&str]| {
            std::process::Command::new("/bin/sh")
                .args(["-c", DISCOVER, "hvd-discover"])
                .args(program)
                .output()
                .unwrap()
        };
        let listing = "p-0:1 \np-1:1 2026-12-03T12:00:00Z\n\np-2:1\n";
        let out = run(&["printf", "%s", listing]);
        assert!(out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stdout), "p-0:1\np-2:1\n");
        let out = run(&["sh", "-c", "echo forbidden >&2; exit 1"]);
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(String::from_utf8_lossy(&out.stderr), "forbidden\n");
    }

    #[test]
    fn ranks_run_through_kubectl_exec_in_the_containers_directory() {
        let setup = PodsSetup {
            ssh: SshSetup {
                transport: Transport::KubectlExec {
                    namespace: Some("ml".into()),
                    container: CONTAINER.into(),
                },
                rank_dir: Some(PathBuf::from(".")),
                ..crate::engines::ssh::tests::setup(None)
            },
            selector: "a=b".into(),
            namespace: Some("ml".into()),
            start_timeout: None,
        };
        let argv = setup.ssh.argv("pod-1", "exec /bin/sh -c X");
        assert_eq!(
            argv,
            [
                "kubectl",
                "exec",
                "-i",
                "-n",
                "ml",
                "pod-1",
                "-c",
                "worker",
                "--",
                "/bin/sh",
                "-c",
                "exec /bin/sh -c X"
            ]
        );
        assert_eq!(
            setup.get_pods_argv()[..7],
            ["kubectl", "get", "pods", "-n", "ml", "-l", "a=b"]
        );
    }
}
