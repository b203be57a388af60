//! `hvd run --engine kubernetes`: applies the project's JobSet ([`crate::engines::k8s::export`]) with
//! `kubectl apply -f -`, follows every pod's log (`kubectl logs -f POD`, one follower per pod once it runs, lines
//! attributed to the pod's step, node and completion index), polls the JobSet's `Completed` / `Failed` condition and
//! the pods' container states, and reports the first pod that failed with its own exit code. SIGINT/SIGTERM delete
//! the JobSet. Only kubectl's command line and JSON output are used (no client library): [`commands`] lists them
//! for `--dry-run`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hvd_lang::model::Project;
use serde_json::Value;

use crate::engine::{Engine, WholeRunEngine};
use crate::engines::k8s::{self, Flavour};
use crate::options::RunOptions;
use crate::report::WorkerExit;
use crate::report::{
    Cause, Event, EventSink, FailureSummary, RunReport, STDERR_TAIL_LINES, Stream,
};
use crate::{Interrupts, LaunchError};

/// How often the JobSet and its pods are looked at.
const POLL: Duration = Duration::from_millis(500);
/// How long log followers may take to deliver their last lines once the JobSet has ended.
const LOG_DRAIN: Duration = Duration::from_secs(10);
/// Failed `kubectl get` calls in a row (about 15 s of polls) before hvd stops following.
const GET_RETRIES: u32 = 30;
/// The label JobSet puts on every pod of a JobSet.
pub const JOBSET_LABEL: &str = "jobset.sigs.k8s.io/jobset-name";
/// The label JobSet puts on every pod: its replicated job (one per step).
pub const STEP_LABEL: &str = "jobset.sigs.k8s.io/replicatedjob-name";
/// An Indexed Job's pod index (label since Kubernetes 1.28, annotation before).
pub const INDEX_KEY: &str = "batch.kubernetes.io/job-completion-index";

/// What `hvd run --engine kubernetes` works on.
#[derive(Debug, Clone)]
pub struct KubeJob {
    /// The JobSet's name.
    pub name: String,
    pub namespace: Option<String>,
    /// The JobSet manifest.
    pub manifest: Value,
    /// The Secret with the run's job token, which the JobSet's ranks read through `secretKeyRef`.
    pub secret: Value,
    /// Replicated job name -> (step name, `workers`: `None` for a step that runs once, in one pod).
    pub steps: BTreeMap<String, (String, Option<u32>)>,
    /// What an elastic step's launcher pods need, applied with the JobSet (a ConfigMap, ServiceAccount, Role and
    /// RoleBinding: `engines/k8s/elastic.rs`).
    pub extras: Vec<Value>,
    /// The replicated jobs of elastic steps' launcher pods (one pod each: the step is done when it is).
    pub launchers: BTreeSet<String>,
    /// The replicated jobs of elastic steps' worker pods -> their step: pods that wait for ranks; their losses are
    /// the launcher's to handle, not the run's failure.
    pub pools: BTreeMap<String, String>,
}

impl KubeJob {
    /// The JobSet of `project` (every step), with a fresh token.
    pub fn new(project: &Project) -> Result<Self, LaunchError> {
        let export = k8s::export(project, Flavour::JobSet)?;
        Self::from_manifests(project, export.manifests.into_iter().map(|m| m.content))
    }

    /// The JobSet and token Secret `hvd export k8s` wrote to `files` (so that what runs is what the files say).
    pub fn from_files(project: &Project, files: &[PathBuf]) -> Result<Self, LaunchError> {
        let mut manifests = Vec::new();
        for file in files {
            let text = fs_err::read_to_string(file).map_err(|source| LaunchError::Io {
                path: file.clone(),
                source,
            })?;
            manifests.push(serde_json::from_str(&text).map_err(|e| {
                LaunchError::Engine(format!("{} is not valid JSON: {e}", file.display()))
            })?);
        }
        Self::from_manifests(project, manifests)
    }

    fn from_manifests(
        project: &Project,
        manifests: impl IntoIterator<Item = Value>,
    ) -> Result<Self, LaunchError> {
        let mut jobset = None;
        let mut secret = None;
        let mut extras = Vec::new();
        for manifest in manifests {
            match manifest["kind"].as_str() {
                Some("JobSet") => jobset = Some(manifest),
                Some("Secret") => secret = Some(manifest),
                Some("ConfigMap" | "ServiceAccount" | "Role" | "RoleBinding") => {
                    extras.push(manifest)
                }
                _ => {}
            }
        }
        let manifest = jobset.ok_or(LaunchError::Internal("no JobSet manifest"))?;
        let secret = secret.ok_or(LaunchError::Internal("no token Secret manifest"))?;
        let name = manifest["metadata"]["name"]
            .as_str()
            .ok_or(LaunchError::Internal("JobSet without a name"))?
            .to_owned();
        let namespace = manifest["metadata"]["namespace"]
            .as_str()
            .map(str::to_owned);
        let mut steps = BTreeMap::new();
        let mut launchers = BTreeSet::new();
        let mut pools = BTreeMap::new();
        for step in &project.steps {
            let job = k8s::dns_label(&step.name);
            if step.is_elastic() {
                launchers.insert(job.clone());
                pools.insert(k8s::elastic::pool_name(&job), step.name.clone());
            }
            steps.insert(job, (step.name.clone(), step.workers));
        }
        Ok(KubeJob {
            name,
            namespace,
            manifest,
            secret,
            steps,
            extras,
            launchers,
            pools,
        })
    }

    /// The step (and its `workers`) whose pods replicated job `job` runs: an elastic step's worker pods are its
    /// own; an unknown job is named as it is.
    fn step_of(&self, job: &str) -> (String, Option<u32>) {
        let key = match self.pools.get(job) {
            Some(step) => k8s::dns_label(step),
            None => job.to_owned(),
        };
        self.steps
            .get(&key)
            .cloned()
            .unwrap_or_else(|| (job.to_owned(), None))
    }

    /// What `kubectl apply -f -` gets: a `List` of the token Secret and the JobSet.
    pub fn apply_manifest(&self) -> Value {
        let mut items = vec![self.secret.clone()];
        items.extend(self.extras.iter().cloned());
        items.push(self.manifest.clone());
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "List",
            "items": items,
        })
    }

    fn ns(&self) -> Vec<String> {
        match &self.namespace {
            Some(ns) => vec!["-n".into(), ns.clone()],
            None => Vec::new(),
        }
    }

    /// `kubectl HEAD... [-n NAMESPACE] TAIL...`.
    fn argv(&self, head: &[&str], tail: &[&str]) -> Vec<String> {
        let mut argv = strings(head);
        argv.extend(self.ns());
        argv.extend(strings(tail));
        argv
    }

    /// `kubectl delete jobset/NAME secret/NAME-hvd-token [KIND/NAME of the extras...] TAIL...`.
    fn delete(&self, tail: &[&str]) -> Vec<String> {
        let mut objects = vec![
            format!("jobset/{}", self.name),
            format!("secret/{}", k8s::token_secret_name(&self.name)),
        ];
        objects.extend(self.extras.iter().filter_map(|m| {
            let kind = m["kind"].as_str()?.to_ascii_lowercase();
            let name = m["metadata"]["name"].as_str()?;
            Some(match kind.as_str() {
                "role" | "rolebinding" => format!("{kind}.rbac.authorization.k8s.io/{name}"),
                _ => format!("{kind}/{name}"),
            })
        }));
        let mut head = vec!["delete"];
        head.extend(objects.iter().map(String::as_str));
        self.argv(&head, tail)
    }

    /// `kubectl delete jobset/NAME secret/NAME-hvd-token --ignore-not-found --wait=true`: a previous run of the same
    /// project and its token.
    pub fn delete_previous_argv(&self) -> Vec<String> {
        self.delete(&["--ignore-not-found", "--wait=true"])
    }

    /// `kubectl apply -f -` (the manifest on stdin).
    pub fn apply_argv(&self) -> Vec<String> {
        strings(&["apply", "-f", "-"])
    }

    /// `kubectl get jobset NAME -o json`.
    pub fn get_jobset_argv(&self) -> Vec<String> {
        self.argv(&["get", "jobset", &self.name], &["-o", "json"])
    }

    /// `kubectl get pods -l jobset.sigs.k8s.io/jobset-name=NAME -o json`.
    pub fn get_pods_argv(&self) -> Vec<String> {
        let label = format!("{JOBSET_LABEL}={}", self.name);
        self.argv(&["get", "pods"], &["-l", &label, "-o", "json"])
    }

    /// `kubectl logs -f POD -c worker`.
    pub fn logs_argv(&self, pod: &str) -> Vec<String> {
        self.argv(&["logs", "-f", pod], &["-c", "worker"])
    }

    /// `kubectl delete jobset/NAME secret/NAME-hvd-token --wait=false` (on SIGINT/SIGTERM).
    pub fn delete_argv(&self) -> Vec<String> {
        self.delete(&["--wait=false"])
    }
}

fn strings(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| (*w).to_owned()).collect()
}

/// The kubectl commands `hvd run` runs, in order, for `--dry-run`.
pub fn commands(job: &KubeJob) -> Vec<String> {
    let line = |argv: Vec<String>| {
        let mut all = vec!["kubectl".to_owned()];
        all.extend(argv);
        crate::engines::shell::line(&all)
    };
    vec![
        line(job.delete_previous_argv()),
        format!(
            "{} < MANIFEST   # a List: the token Secret, {}then the JobSet",
            line(job.apply_argv()),
            if job.extras.is_empty() {
                ""
            } else {
                "the launcher pods' ConfigMap, ServiceAccount, Role and RoleBinding, "
            }
        ),
        format!(
            "{}   # every {} ms",
            line(job.get_pods_argv()),
            POLL.as_millis()
        ),
        format!(
            "{}   # for each pod once it runs",
            line(job.logs_argv("POD"))
        ),
        format!(
            "{}   # with each poll, until Completed or Failed",
            line(job.get_jobset_argv())
        ),
    ]
}

/// The kubernetes engine: the JobSet of the project, written under `.hvd/k8s/`, applied and followed.
pub struct Kubectl {
    job: KubeJob,
    dir: PathBuf,
    files: Vec<PathBuf>,
    notes: Vec<String>,
}

/// Writes the JobSet and its token Secret under `.hvd/k8s/` (next to the file, or under `RunOptions::state_dir`);
/// `--workers N` sizes every distributed step, as it does for the other engines.
pub fn start(project: &Project, options: &RunOptions) -> Result<Engine, LaunchError> {
    let mut project = project.clone();
    // `--workers`/`--max-workers` and `--min-workers` as the plan reads them: the JobSet's sizes, and which steps
    // are elastic (each under a launcher pod, which reads the same flags from its own command line).
    if let Some(n) = options.max_workers.or(options.workers) {
        for step in &mut project.steps {
            if step.workers.is_some() {
                step.workers = Some(n);
            }
        }
    }
    if let Some(min) = options.min_workers {
        for step in &mut project.steps {
            if step.workers.is_some() {
                step.min_workers = Some(min);
            }
        }
    }
    for step in &project.steps {
        // A file's `discovery` is refused with the JobSet (`hvd export k8s` too).
        if step.is_elastic() && options.host_discovery_script.is_some() {
            return Err(LaunchError::Engine(format!(
                "step `{}` is elastic with host discovery, which the kubernetes engine does not run: an elastic \
                 step's hosts are its worker pods, which its launcher pod finds itself (a lost pod's replacement \
                 included); leave `--host-discovery-script` (or `discovery`) out",
                step.name
            )));
        }
        if let (Some(max), Some(min)) = (step.workers, step.min_workers)
            && min > max
        {
            return Err(LaunchError::Engine(format!(
                "step `{}` is elastic with at least {min} workers, more than its {max}",
                step.name
            )));
        }
    }
    // `--max-restarts` over each step's `restarts`: the JobSet's `failurePolicy.maxRestarts`.
    for step in &mut project.steps {
        step.restarts = Some(crate::graph::restarts_of(step, options));
    }
    let dir = match &options.state_dir {
        Some(state) => state.join("k8s"),
        None => project
            .file
            .parent()
            .unwrap_or(Path::new(""))
            .join(".hvd")
            .join("k8s"),
    };
    // With caches (and keys), the pods pull the built env instead of needing it in their image.
    let delivery = options
        .env_dir
        .as_ref()
        .filter(|_| !options.caches.is_empty())
        .map(|env| k8s::Delivery {
            env: env.clone(),
            caches: options.caches.clone(),
            trusted_keys: options.trusted_keys.clone(),
        });
    let flags = match project.steps.iter().any(|s| s.is_elastic()) {
        true => launcher_flags(options)?,
        false => Vec::new(),
    };
    let export = k8s::export_running(&project, Flavour::JobSet, delivery.as_ref(), &flags)?;
    let files = k8s::write_manifests(&export, &dir)?;
    let job = KubeJob::from_files(&project, &files)?;
    Ok(Engine::Whole(Box::new(Kubectl {
        job,
        dir,
        files,
        notes: export.notes,
    })))
}

/// The flags of this run that shape an elastic step, for its launcher pod's `hvd run` (the file says the rest):
/// sizes, restarts, timeouts and the blacklist's cooldown; checkpoints only at an `s3://` URL (a directory here is
/// not in the pods).
fn launcher_flags(options: &RunOptions) -> Result<Vec<String>, LaunchError> {
    let mut flags = super::step_flags(options);
    if let Some(dir) = &options.checkpoints {
        match dir.to_str().filter(|d| d.starts_with("s3://")) {
            Some(url) => flags.push(format!("--checkpoints={url}")),
            None => {
                return Err(LaunchError::Engine(format!(
                    "`--checkpoints {}`: under the kubernetes engine the workers run in pods, which do not have a \
                     directory of this machine; give an `s3://bucket/prefix` URL",
                    dir.display()
                )));
            }
        }
    }
    Ok(flags)
}

impl WholeRunEngine for Kubectl {
    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    /// Each elastic step runs under a launcher pod of its own (`engines/k8s/elastic.rs`).
    fn runs_elastic_steps(&self) -> bool {
        true
    }

    /// The manifests and the kubectl commands.
    fn render(&self) -> String {
        let mut out = String::new();
        for file in &self.files {
            out.push_str(&format!("# {}\n", file.display()));
            out.push_str(&std::fs::read_to_string(file).unwrap_or_default());
        }
        out.push_str("\n# hvd runs, with MANIFEST the Secret and the JobSet above:\n");
        for line in commands(&self.job) {
            out.push_str(&format!("#   {line}\n"));
        }
        out
    }

    fn check(&self) -> Result<(), LaunchError> {
        if kubectl_on_path() {
            return Ok(());
        }
        Err(LaunchError::Engine(format!(
            "kubectl is not on PATH: install kubectl and configure it (a kubeconfig) for a cluster with the JobSet \
             controller; the manifests are in {}",
            self.dir.display()
        )))
    }

    fn run(
        &self,
        events: &dyn EventSink,
        interrupts: Interrupts,
    ) -> Result<RunReport, LaunchError> {
        events.event(Event::Note {
            text: format!(
                "applying JobSet `{}` with kubectl and following its pods",
                self.job.name
            ),
        });
        run(&self.job, &self.dir.join("logs"), events, interrupts)
    }
}

/// Whether `kubectl` is on PATH.
pub fn kubectl_on_path() -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("kubectl").is_file()))
}

fn kubectl(argv: &[String], stdin: Option<&[u8]>) -> Result<String, LaunchError> {
    let mut command = Command::new("kubectl");
    command
        .args(argv)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().map_err(|e| {
        LaunchError::Engine(format!(
            "failed to run kubectl (install kubectl and configure it for the cluster): {e}"
        ))
    })?;
    if let (Some(data), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A failed write shows up as kubectl's own error.
        let _ = pipe.write_all(data);
    }
    let out = child
        .wait_with_output()
        .map_err(|e| LaunchError::Engine(format!("failed to wait for kubectl: {e}")))?;
    if !out.status.success() {
        return Err(LaunchError::Engine(format!(
            "`kubectl {}` failed ({}): {}",
            argv.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The JobSet's terminal condition: `Some(true)` Completed, `Some(false)` Failed (with its message).
pub fn jobset_outcome(jobset: &Value) -> Option<(bool, String)> {
    let conditions = jobset["status"]["conditions"].as_array()?;
    for condition in conditions {
        if condition["status"].as_str() != Some("True") {
            continue;
        }
        let message = condition["message"].as_str().unwrap_or("").to_owned();
        match condition["type"].as_str() {
            Some("Completed") => return Some((true, message)),
            Some("Failed") => return Some((false, message)),
            _ => {}
        }
    }
    None
}

/// One pod of the JobSet as `kubectl get pods -o json` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub name: String,
    /// The replicated job (step label).
    pub job: String,
    pub index: u32,
    pub node: String,
    pub phase: String,
    /// The worker container's exit code and finish time, once terminated.
    pub terminated: Option<(i32, String)>,
    /// Whether the worker container has started (running or terminated): its log can be read.
    pub started: bool,
    /// Why the worker container waits (`ErrImagePull: ...`), while it does.
    pub waiting: Option<String>,
    /// The pod was disrupted (evicted, preempted, its node drained or lost: its `DisruptionTarget` condition): an
    /// elastic step's launcher pod so ended is started again by its Job, and its end is not the run's failure.
    pub disrupted: bool,
}

/// Reads the pods of `kubectl get pods -o json`.
pub fn parse_pods(list: &Value) -> Vec<Pod> {
    let mut pods = Vec::new();
    for item in list["items"].as_array().into_iter().flatten() {
        let meta = &item["metadata"];
        let Some(name) = meta["name"].as_str() else {
            continue;
        };
        let index = meta["labels"][INDEX_KEY]
            .as_str()
            .or_else(|| meta["annotations"][INDEX_KEY].as_str())
            .and_then(|i| i.parse().ok())
            .unwrap_or(0);
        let status = item["status"]
            .get("containerStatuses")
            .and_then(Value::as_array)
            .and_then(|s| {
                s.iter()
                    .find(|c| c["name"].as_str() == Some("worker"))
                    .or_else(|| s.first())
            });
        let state = status.map(|s| &s["state"]);
        let terminated = state.and_then(|s| s.get("terminated")).and_then(|t| {
            Some((
                i32::try_from(t["exitCode"].as_i64()?).ok()?,
                t["finishedAt"].as_str().unwrap_or("").to_owned(),
            ))
        });
        let started = terminated.is_some() || state.is_some_and(|s| s.get("running").is_some());
        let waiting = state
            .and_then(|s| s.get("waiting"))
            .and_then(|w| {
                let reason = w["reason"].as_str()?;
                Some(match w["message"].as_str() {
                    Some(m) if !m.is_empty() => format!("{reason}: {m}"),
                    _ => reason.to_owned(),
                })
            })
            // Scheduling problems (no node fits) are pod conditions, not container states.
            .or_else(|| {
                item["status"]["conditions"]
                    .as_array()?
                    .iter()
                    .find(|c| {
                        c["type"].as_str() == Some("PodScheduled")
                            && c["status"].as_str() == Some("False")
                    })
                    .and_then(|c| {
                        Some(format!(
                            "{}: {}",
                            c["reason"].as_str()?,
                            c["message"].as_str().unwrap_or("")
                        ))
                    })
            });
        let disrupted = item["status"]["conditions"]
            .as_array()
            .is_some_and(|conditions| {
                conditions.iter().any(|c| {
                    c["type"].as_str() == Some("DisruptionTarget")
                        && c["status"].as_str() == Some("True")
                })
            });
        pods.push(Pod {
            name: name.to_owned(),
            job: meta["labels"][STEP_LABEL].as_str().unwrap_or("").to_owned(),
            index,
            node: item["spec"]["nodeName"].as_str().unwrap_or("").to_owned(),
            phase: item["status"]["phase"].as_str().unwrap_or("").to_owned(),
            terminated,
            started,
            waiting,
            disrupted,
        });
    }
    pods
}

/// A pod whose log is being followed.
struct Follower {
    pid: u32,
    tail: Arc<Mutex<VecDeque<String>>>,
    done: Arc<std::sync::atomic::AtomicBool>,
}

/// Applies the JobSet and follows it to its end (see the module doc). Each pod's log is also written to
/// `log_dir/<pod>.log`.
pub fn run(
    job: &KubeJob,
    log_dir: &Path,
    events: &dyn EventSink,
    interrupts: Interrupts,
) -> Result<RunReport, LaunchError> {
    fs_err::create_dir_all(log_dir).map_err(|source| LaunchError::Io {
        path: log_dir.to_path_buf(),
        source,
    })?;
    kubectl(&job.delete_previous_argv(), None)?;
    let manifest = serde_json::to_vec_pretty(&job.apply_manifest())
        .map_err(|_| LaunchError::Internal("the JobSet does not serialize"))?;
    kubectl(&job.apply_argv(), Some(&manifest))?;
    let mut report = RunReport::new(crate::report::new_run_id(), log_dir.to_path_buf());
    let mut followers: BTreeMap<String, Follower> = BTreeMap::new();
    let mut seen: BTreeMap<String, Pod> = BTreeMap::new();
    // The waiting reason last shown for each pod.
    let mut shown: BTreeMap<String, String> = BTreeMap::new();
    let mut started_steps: BTreeSet<String> = BTreeSet::new();
    let mut finished_steps: BTreeSet<String> = BTreeSet::new();
    let mut step_started_at: BTreeMap<String, Instant> = BTreeMap::new();
    let mut deleted = false;
    let mut errors = 0u32;
    let mut error: Option<LaunchError> = None;
    std::thread::scope(|scope| {
        let outcome = loop {
            let (count, signal) = interrupts.get();
            if count >= 1 && !deleted {
                deleted = true;
                events.event(Event::Stopping {
                    reason: format!(
                        "got {}: deleting JobSet `{}`",
                        crate::process::signal_name(signal),
                        job.name
                    ),
                });
                let _ = kubectl(&job.delete_argv(), None);
                report.failure = Some(FailureSummary {
                    step: job.name.clone(),
                    cause: Cause::Interrupted { signal },
                    exit_code: u8::try_from(128 + signal).unwrap_or(130),
                    stderr_tail: Vec::new(),
                    log_dir: log_dir.to_path_buf(),
                });
                break None;
            }
            // Every pod seen so far, in its latest state: a failed pod the JobSet controller deletes still counts.
            match get_json(&job.get_pods_argv()) {
                Ok(pods) => {
                    for pod in parse_pods(&pods) {
                        seen.insert(pod.name.clone(), pod);
                    }
                }
                Err(e) if gave_up(&mut errors) => {
                    error = Some(e);
                    break None;
                }
                Err(_) => {
                    std::thread::sleep(POLL);
                    continue;
                }
            }
            for pod in seen.values() {
                // Why a pod does not start (an image that cannot be pulled, no node that fits): the JobSet
                // waits for it without failing, so say so, once per reason.
                if let Some(waiting) = &pod.waiting
                    && shown.get(&pod.name) != Some(waiting)
                {
                    shown.insert(pod.name.clone(), waiting.clone());
                    events.event(Event::Note {
                        text: format!("pod {} is waiting: {waiting}", pod.name),
                    });
                }
                let (step, workers) = job.step_of(&pod.job);
                if pod.started && !followers.contains_key(&pod.name) {
                    if started_steps.insert(step.clone()) {
                        report.ran.push(step.clone());
                        step_started_at.insert(step.clone(), Instant::now());
                        events.event(Event::StepStarted {
                            step: step.clone(),
                            workers,
                            rendezvous: None,
                        });
                    }
                    let launcher = job.launchers.contains(&pod.job);
                    match follow_pod(scope, job, pod, (&step, launcher), log_dir, events) {
                        Ok(follower) => {
                            followers.insert(pod.name.clone(), follower);
                        }
                        Err(e) => error = Some(e),
                    }
                }
            }
            // Steps whose pods all succeeded.
            for (label, (step, workers)) in &job.steps {
                let done = seen
                    .values()
                    .filter(|p| &p.job == label && p.terminated.as_ref().is_some_and(|t| t.0 == 0))
                    .count();
                // An elastic step is done when its launcher pod is.
                let needed = match job.launchers.contains(label) {
                    true => 1,
                    false => workers.unwrap_or(1),
                };
                if done as u32 >= needed && finished_steps.insert(step.clone()) {
                    events.event(Event::StepFinished {
                        step: step.clone(),
                        elapsed: step_started_at
                            .get(step)
                            .map_or(Duration::ZERO, Instant::elapsed),
                    });
                }
            }
            if error.is_some() {
                break None;
            }
            match get_json(&job.get_jobset_argv()) {
                Ok(jobset) => {
                    errors = 0;
                    if let Some(outcome) = jobset_outcome(&jobset) {
                        // The JobSet restarts every job together: each step ran that many more times.
                        if let Some(n) = jobset["status"]["restarts"]
                            .as_u64()
                            .and_then(|n| u32::try_from(n).ok())
                            .filter(|n| *n > 0)
                        {
                            for (step, _) in job.steps.values() {
                                report.restarts.insert(step.clone(), n);
                            }
                        }
                        break Some((outcome, seen.values().cloned().collect::<Vec<_>>()));
                    }
                }
                Err(e) if gave_up(&mut errors) => {
                    error = Some(e);
                    break None;
                }
                Err(_) => {}
            }
            std::thread::sleep(POLL);
        };
        // Let the followers deliver the last lines, then stop those still running.
        let deadline = Instant::now() + LOG_DRAIN;
        while followers
            .values()
            .any(|f| !f.done.load(std::sync::atomic::Ordering::SeqCst))
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        for f in followers.values() {
            if !f.done.load(std::sync::atomic::Ordering::SeqCst) {
                crate::process::signal_group(f.pid, libc::SIGTERM);
            }
        }
        if let Some(((ok, message), pods)) = outcome
            && !ok
        {
            report.failure = Some(failure(job, &pods, &followers, &message, log_dir));
        }
    });
    match error {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

/// Counts one more failed `kubectl get` in a row; true when there were more than [`GET_RETRIES`].
fn gave_up(errors: &mut u32) -> bool {
    *errors += 1;
    *errors > GET_RETRIES
}

fn get_json(argv: &[String]) -> Result<Value, LaunchError> {
    let text = kubectl(argv, None)?;
    serde_json::from_str(&text).map_err(|e| {
        LaunchError::Engine(format!(
            "`kubectl {}` printed no JSON ({e}): {}",
            argv.join(" "),
            text.chars().take(200).collect::<String>()
        ))
    })
}

/// The first pod (by finish time) that exited non-zero, with its exit code and last log lines; without one, the
/// JobSet's own message and exit code 1.
fn failure(
    job: &KubeJob,
    pods: &[Pod],
    followers: &BTreeMap<String, Follower>,
    message: &str,
    log_dir: &Path,
) -> FailureSummary {
    // A lost worker pod of an elastic step is its launcher's to handle: the launcher's own end says how it went. A
    // disrupted launcher pod was started again: the failure is a later pod's.
    let first = pods
        .iter()
        .filter(|p| !job.pools.contains_key(&p.job))
        .filter(|p| !(p.disrupted && job.launchers.contains(&p.job)))
        .filter_map(|p| match &p.terminated {
            Some((code, at)) if *code != 0 => Some((at.clone(), p, *code)),
            _ => None,
        })
        .min_by(|a, b| a.0.cmp(&b.0));
    match first {
        Some((_, pod, code)) => {
            let step = job.step_of(&pod.job).0;
            let mut tail: Vec<String> = followers
                .get(&pod.name)
                .map(|f| {
                    f.tail
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .iter()
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            tail.push(format!(
                "(pod {}: exit code {code}; JobSet `{}` failed{})",
                pod.name,
                job.name,
                if message.is_empty() {
                    String::new()
                } else {
                    format!(": {message}")
                }
            ));
            let exit = WorkerExit::Code(code);
            // An elastic step's launcher pod: its own report (the tail) says which rank failed, or why the step did.
            let cause = match job.launchers.contains(&pod.job) {
                true => Cause::Launcher {
                    job: format!("launcher pod {}", pod.name),
                    exit,
                },
                false => Cause::Worker {
                    rank: pod.index,
                    host: host_of(pod),
                    exit,
                },
            };
            FailureSummary {
                step,
                cause,
                exit_code: exit.code(),
                stderr_tail: tail,
                log_dir: log_dir.to_path_buf(),
            }
        }
        None => FailureSummary {
            step: job.name.clone(),
            cause: Cause::Worker {
                rank: 0,
                host: "?".into(),
                exit: WorkerExit::Code(1),
            },
            exit_code: 1,
            stderr_tail: vec![format!(
                "JobSet `{}` failed without a failed pod: {message}",
                job.name
            )],
            log_dir: log_dir.to_path_buf(),
        },
    }
}

fn host_of(pod: &Pod) -> String {
    if pod.node.is_empty() {
        pod.name.clone()
    } else {
        pod.node.clone()
    }
}

/// Starts `kubectl logs -f` for one pod: every line becomes an [`Event::Line`] of the pod's step and index and is
/// appended to `log_dir/<pod>.log`. An elastic step's launcher pod (`launcher`) writes its ranks' lines as `hvd run`
/// does, `[STEP POD:RANK] TEXT`: those become that rank's lines, the rest (its own notes) notes naming the pod.
fn follow_pod<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    job: &KubeJob,
    pod: &Pod,
    (step, launcher): (&str, bool),
    log_dir: &Path,
    events: &'scope dyn EventSink,
) -> Result<Follower, LaunchError> {
    let mut command = Command::new("kubectl");
    command
        .args(job.logs_argv(&pod.name))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    crate::process::configure_worker(&mut command);
    let mut child = command
        .spawn()
        .map_err(|e| LaunchError::Engine(format!("failed to run `kubectl logs`: {e}")))?;
    let pid = child.id();
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let path: PathBuf = log_dir.join(format!("{}.log", pod.name));
    let mut file = fs_err::File::create(&path).map_err(|source| LaunchError::Io {
        path: path.clone(),
        source,
    })?;
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let (step, host, rank) = (
        Arc::<str>::from(step),
        Arc::<str>::from(host_of(pod).as_str()),
        pod.index,
    );
    let (tail2, done2) = (tail.clone(), done.clone());
    let pod_name = pod.name.clone();
    scope.spawn(move || {
        if let Some(out) = stdout {
            let mut reader = std::io::BufReader::new(out);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let _ = file.write_all(&line);
                        let text = String::from_utf8_lossy(&line)
                            .trim_end_matches(['\n', '\r'])
                            .to_owned();
                        {
                            let mut tail = tail2
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner);
                            if tail.len() == STDERR_TAIL_LINES - 1 {
                                tail.pop_front();
                            }
                            tail.push_back(text.clone());
                        }
                        let relabelled = launcher
                            .then(|| super::console_line(&text))
                            .flatten()
                            .filter(|(s, ..)| *s == &*step);
                        match relabelled {
                            Some((_, at, r, rest)) => events.event(Event::Line {
                                step: step.clone(),
                                host: Arc::from(at),
                                rank: r,
                                stream: Stream::Stdout,
                                text: rest.to_owned(),
                            }),
                            None if launcher => events.event(Event::Note {
                                text: format!(
                                    "{pod_name}: {}",
                                    text.strip_prefix("hvd: ").unwrap_or(&text)
                                ),
                            }),
                            None => events.event(Event::Line {
                                step: step.clone(),
                                host: host.clone(),
                                rank,
                                stream: Stream::Stdout,
                                text,
                            }),
                        }
                    }
                }
            }
        }
        // kubectl's own complaints (a pod deleted under it) go to the console as the pod's stderr.
        if let Some(err) = stderr {
            for text in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                events.event(Event::Line {
                    step: step.clone(),
                    host: host.clone(),
                    rank,
                    stream: Stream::Stderr,
                    text,
                });
            }
        }
        let _ = child.wait();
        done2.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    Ok(Follower { pid, tail, done })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pods_and_conditions_are_read() {
        let list = json!({"items": [
            {"metadata": {"name": "t-train-0-1-x", "labels": {STEP_LABEL: "train", INDEX_KEY: "1"}},
             "spec": {"nodeName": "n1"},
             "status": {"phase": "Failed", "containerStatuses": [
                {"name": "worker", "state": {"terminated": {"exitCode": 3, "finishedAt": "2026-11-30T08:00:00Z"}}}]}},
            {"metadata": {"name": "t-train-0-0-y", "labels": {STEP_LABEL: "train"},
                          "annotations": {INDEX_KEY: "0"}},
             "status": {"phase": "Pending"}},
        ]});
        let pods = parse_pods(&list);
        assert_eq!(pods.len(), 2);
        assert_eq!(
            (pods[0].index, pods[0].terminated.clone(), pods[0].started),
            (1, Some((3, "2026-11-30T08:00:00Z".into())), true)
        );
        assert_eq!(
            (pods[1].index, pods[1].started, pods[1].node.as_str()),
            (0, false, "")
        );
        assert_eq!(pods[0].waiting, None);
        assert!(!pods[0].disrupted && !pods[1].disrupted);
        let pulling = json!({"items": [{"metadata": {"name": "p"}, "status": {"phase": "Pending",
            "containerStatuses": [{"name": "worker", "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}]}}]});
        assert_eq!(
            parse_pods(&pulling)[0].waiting.as_deref(),
            Some("ErrImagePull: not found")
        );
        let unschedulable = json!({"items": [{"metadata": {"name": "p"}, "status": {"phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}]}}]});
        assert_eq!(
            parse_pods(&unschedulable)[0].waiting.as_deref(),
            Some("Unschedulable: 0/3 nodes")
        );
        let done = json!({"status": {"conditions": [
            {"type": "StartupPolicyCompleted", "status": "True"},
            {"type": "Failed", "status": "True", "message": "jobset failed due to reaching max restarts"}]}});
        assert_eq!(
            jobset_outcome(&done),
            Some((false, "jobset failed due to reaching max restarts".into()))
        );
        assert_eq!(jobset_outcome(&json!({"status": {}})), None);
        let evicted = json!({"items": [{"metadata": {"name": "p"}, "status": {"phase": "Failed",
            "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]}}]});
        assert!(parse_pods(&evicted)[0].disrupted);
        assert_eq!(
            jobset_outcome(
                &json!({"status": {"conditions": [{"type": "Completed", "status": "True"}]}})
            ),
            Some((true, String::new()))
        );
    }

    /// The run's failure is the first pod to fail but an evicted launcher pod of an elastic step (its Job started
    /// another in its place): the replacement's end is the one that says why the step failed.
    #[test]
    fn an_evicted_launcher_pod_is_not_the_runs_failure() {
        let pod = |name: &str, job: &str, code: i32, at: &str, disrupted: bool| Pod {
            name: name.into(),
            job: job.into(),
            index: 0,
            node: "n1".into(),
            phase: "Failed".into(),
            terminated: Some((code, at.into())),
            started: true,
            waiting: None,
            disrupted,
        };
        let job = KubeJob {
            name: "t".into(),
            namespace: None,
            manifest: json!({}),
            secret: json!({}),
            steps: [
                ("train".to_owned(), ("train".to_owned(), Some(4))),
                ("train-workers".to_owned(), ("train".to_owned(), Some(4))),
            ]
            .into_iter()
            .collect(),
            extras: vec![],
            launchers: ["train".to_owned()].into_iter().collect(),
            pools: [("train-workers".to_owned(), "train".to_owned())]
                .into_iter()
                .collect(),
        };
        let pods = [
            pod("t-train-0-0-a", "train", 143, "2026-12-03T10:00:00Z", true),
            pod(
                "t-train-workers-0-1-b",
                "train-workers",
                1,
                "2026-12-03T10:30:00Z",
                false,
            ),
            pod("t-train-0-0-c", "train", 3, "2026-12-03T11:00:00Z", false),
        ];
        let failed = failure(&job, &pods, &BTreeMap::new(), "", Path::new("/l"));
        assert_eq!(failed.exit_code, 3, "{failed:?}");
        assert!(
            failed
                .stderr_tail
                .last()
                .is_some_and(|l| l.contains("pod t-train-0-0-c")),
            "{failed:?}"
        );
        // Not disrupted, the first launcher pod's end is the failure.
        let mut first = pods.clone();
        first[0].disrupted = false;
        let failed = failure(&job, &first, &BTreeMap::new(), "", Path::new("/l"));
        assert_eq!(failed.exit_code, 143, "{failed:?}");
    }
}
