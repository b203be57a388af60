//! The local supervisor: runs a [`Plan`] on this machine. Steps start as soon as what they need has finished
//! (independent steps run in parallel); a distributed step gets its own rendezvous server and N worker processes.
//! The first failure anywhere stops everything (SIGTERM to each worker's process group, a grace period, SIGKILL).

use std::collections::{BTreeMap, VecDeque};
use std::io::Read;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::LaunchError;
use crate::discovery::Discovery;
use crate::engine::{Local, Plan, PlannedStep, RankCommand, RankStart, SupervisedEngine};
use crate::env::{RendezvousInfo, STEP_MARKER_VAR, Slot};
use crate::options::RunOptions;
use crate::process::{Interrupts, RunCgroup, Watchdog, configure_worker_in, signal_name};
use crate::rendezvous::{RendezvousServer, new_token};
use crate::report::{
    Cause, Event, EventSink, FailureSummary, LineSplitter, RunReport, STDERR_TAIL_LINES, Stream,
    WorkerExit, new_run_id,
};
use crate::state;

mod attempt;
mod heartbeat;
mod keepalive;
mod placement;
mod reported;
use attempt::{Attempt, Growth, discovery_timeout, first_discovery, supervise};

/// `off` runs without cgroups, contained by the subreaper fallback alone (as on a machine without them); unset,
/// empty or `auto`: a cgroup per run where the machine allows it.
pub const CGROUPS_VAR: &str = "HVD_CGROUPS";

/// Whether [`CGROUPS_VAR`] allows cgroups; any other value than `off`, `auto` or empty is an error naming it.
fn cgroups_wanted() -> Result<bool, LaunchError> {
    match std::env::var(CGROUPS_VAR) {
        Err(std::env::VarError::NotPresent) => Ok(true),
        Ok(v) if v.is_empty() || v == "auto" => Ok(true),
        Ok(v) if v == "off" => Ok(false),
        Ok(v) => Err(LaunchError::Engine(format!(
            "{CGROUPS_VAR}={v:?} is not understood: use `off` (no cgroups: the subreaper fallback) or `auto` \
             (the default)"
        ))),
        Err(std::env::VarError::NotUnicode(v)) => Err(LaunchError::Engine(format!(
            "{CGROUPS_VAR}={v:?} is not understood: use `off` or `auto`"
        ))),
    }
}
/// Why the job is being stopped.
#[derive(Debug, Clone)]
struct Stop {
    at: Instant,
    /// What the workers get first: SIGTERM, or the launcher's own SIGINT passed on (so Python workers see a
    /// KeyboardInterrupt, as they would under a plain Ctrl-C).
    signal: i32,
}

/// State shared by all step threads of one run.
struct Job<'a> {
    options: &'a RunOptions,
    events: &'a dyn EventSink,
    interrupts: Interrupts,
    watchdog: Option<Watchdog>,
    /// Every worker's processes, one group per step (where the machine allows cgroups).
    cgroup: Option<RunCgroup>,
    stop: Mutex<Option<Stop>>,
    /// Failures that happened before the stop began; the earliest is the root cause.
    failures: Mutex<Vec<(Instant, FailureSummary)>>,
    kill_now: AtomicBool,
    /// Steps started again after a rank failed, and how many times.
    restarts: Mutex<BTreeMap<String, u32>>,
    /// Workers of elastic steps that were preempted (committed and left), by step.
    preempted: Mutex<BTreeMap<String, Vec<u32>>>,
    /// Steps whose rank 0 resumed from a checkpoint (the rendezvous key or the `HVD_CHECKPOINT_REPORT` file), and the
    /// commit, of the last attempt that said so.
    resumed: Mutex<BTreeMap<String, u64>>,
}

impl Job<'_> {
    /// Starts stopping the job (once); `failure` is recorded as a candidate root cause when it happened before any
    /// stop began.
    fn fail(&self, when: Instant, failure: FailureSummary, reason: String) {
        let signal = match failure.cause {
            Cause::Interrupted { signal } if signal == libc::SIGINT => libc::SIGINT,
            _ => libc::SIGTERM,
        };
        let mut stop = self
            .stop
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let genuine = stop.as_ref().is_none_or(|s| when <= s.at);
        if genuine {
            self.failures
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push((when, failure));
        }
        if stop.is_none() {
            *stop = Some(Stop { at: when, signal });
            self.events.event(Event::Stopping { reason });
        }
    }

    fn stopping(&self) -> bool {
        self.stop_signal().is_some()
    }

    fn stop_signal(&self) -> Option<i32> {
        let stop = self
            .stop
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        stop.as_ref().map(|s| s.signal)
    }

    fn check_interrupts(&self, step: &str, log_dir: &Path) {
        let (count, signal) = self.interrupts.get();
        if count >= 1 && !self.stopping() {
            self.fail(
                Instant::now(),
                FailureSummary {
                    step: step.to_owned(),
                    cause: Cause::Interrupted { signal },
                    exit_code: u8::try_from(128 + signal).unwrap_or(130),
                    stderr_tail: Vec::new(),
                    log_dir: log_dir.to_path_buf(),
                },
                format!(
                    "got {}: stopping the workers (again to kill them now)",
                    signal_name(signal)
                ),
            );
        }
        if count >= 2 {
            self.kill_now.store(true, Ordering::SeqCst);
        }
    }
}

/// Whether `engine` starts each rank itself on this machine or on hosts it reaches by name (local, ssh, slurm inside
/// an allocation: one job step per rank), so that host discovery's slots may start workers there (on local and ssh:
/// the slurm engine refuses discovery itself; spark places its ranks itself).
fn starts_workers_anywhere(engine: &dyn SupervisedEngine) -> bool {
    engine.name().starts_with("local") || engine.remote_hosts()
}

/// Runs `plan`. Returns when every started process has ended; nothing is left running.
pub fn execute(
    plan: &Plan,
    options: &RunOptions,
    events: &dyn EventSink,
    interrupts: Interrupts,
) -> Result<RunReport, LaunchError> {
    if let Some(script) = &options.host_discovery_script
        && !plan
            .steps
            .iter()
            .any(|s| s.workers.is_some() && s.min_workers.is_some())
    {
        return Err(LaunchError::Engine(format!(
            "`--host-discovery-script {}` needs an elastic step (`workers = {{ min = .., max = .. }}` or \
             `--min-workers`): no step of this run is elastic",
            script.display()
        )));
    }
    // Before anything runs: host discovery (the flag's, or a step's `workers = { discovery }`) starts workers where
    // the engine starts each rank itself.
    if plan
        .steps
        .iter()
        .any(|s| s.elastic.discovery.is_some() && s.min_workers.is_some())
        && !starts_workers_anywhere(plan.engine.as_ref())
    {
        return Err(LaunchError::Engine(format!(
            "host discovery (`--host-discovery-script`, `workers = {{ discovery }}`) runs elastic steps on the local \
             and ssh engines only, not on the {} (its hosts are its allocation or host list)",
            plan.engine.name()
        )));
    }
    // A bad `HVD_REMOTE_KEEPALIVE` of a distributed step stops the run before anything runs, not when that step starts.
    for step in plan.steps.iter().filter(|s| s.workers.is_some()) {
        keepalive::interval(step)?;
    }
    // The engine's checks and files (ssh: the hosts; spark: its driver), when a step is distributed.
    if plan.steps.iter().any(|s| s.workers.is_some()) {
        plan.engine.prepare(plan)?;
    }
    let run_id = new_run_id();
    let log_dir = plan.state_dir.join("runs").join(&run_id);
    fs_err::create_dir_all(&log_dir).map_err(|source| LaunchError::Io {
        path: log_dir.clone(),
        source,
    })?;
    crate::process::become_subreaper();
    let cgroup = match cgroups_wanted()? {
        false => {
            tracing::info!(
                "no cgroup for this run ({CGROUPS_VAR}=off): the subreaper fallback contains it"
            );
            None
        }
        true => match RunCgroup::create() {
            Ok(c) => Some(c),
            Err(reason) => {
                tracing::info!(
                    "no cgroup for this run ({reason}): the launcher, a child subreaper, kills what its steps leave \
                 behind; a process that left its worker's process group survives a launcher killed with SIGKILL"
                );
                None
            }
        },
    };
    // The watchdog also kills, if the launcher dies, what carries this run's step markers (`<run id>/...`).
    let run_marker = format!("{STEP_MARKER_VAR}={run_id}/");
    let watchdog = match Watchdog::start_for(cgroup.as_ref(), Some(&run_marker)) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(
                "no watchdog process ({e}); workers' children may outlive a killed launcher"
            );
            None
        }
    };
    let job = Job {
        options,
        events,
        interrupts,
        watchdog,
        cgroup,
        stop: Mutex::new(None),
        failures: Mutex::new(Vec::new()),
        kill_now: AtomicBool::new(false),
        restarts: Mutex::new(BTreeMap::new()),
        preempted: Mutex::new(BTreeMap::new()),
        resumed: Mutex::new(BTreeMap::new()),
    };
    let mut report = RunReport::new(run_id, log_dir.clone());
    let mut outputs: BTreeMap<String, String> = BTreeMap::new();
    let mut pending: Vec<&PlannedStep> = plan.steps.iter().collect();
    let mut running = 0usize;
    let mut error: Option<LaunchError> = None;

    std::thread::scope(|scope| {
        let (done_tx, done_rx) =
            mpsc::channel::<(String, Result<bool, LaunchError>, Option<String>)>();
        loop {
            // Start every step whose needs are done (skipping unchanged ones), unless the job is stopping.
            let mut started_any = true;
            if running == 0 && interrupts.get().0 > 0 {
                // Interrupted between steps: start nothing more.
                job.check_interrupts(&plan.project, &log_dir);
            }
            while started_any && error.is_none() && !job.stopping() {
                started_any = false;
                let ready: Vec<usize> = pending
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.needs.iter().all(|n| outputs.contains_key(n)))
                    .map(|(i, _)| i)
                    .collect();
                for i in ready.into_iter().rev() {
                    let step = pending.remove(i);
                    let hash = match skip_check(plan, options, step, &outputs) {
                        Ok(h) => h,
                        Err(e) => {
                            error = Some(e);
                            break;
                        }
                    };
                    if let Skip::Unchanged { outputs_hash } = &hash {
                        events.event(Event::StepSkipped {
                            step: step.name.clone(),
                        });
                        report.skipped.push(step.name.clone());
                        outputs.insert(step.name.clone(), outputs_hash.clone());
                        started_any = true;
                        continue;
                    }
                    let input_hash = match hash {
                        Skip::Run { input_hash } => input_hash,
                        Skip::Unchanged { .. } => None,
                    };
                    running += 1;
                    report.ran.push(step.name.clone());
                    let tx = done_tx.clone();
                    let job = &job;
                    let step_log = log_dir.join(&step.name);
                    scope.spawn(move || {
                        // A panic must still report the step as done, or the scheduler would wait forever.
                        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            run_step(job, plan, step, &step_log)
                        }))
                        .unwrap_or(Err(LaunchError::Internal("a step thread panicked")));
                        let _ = tx.send((step.name.clone(), result, input_hash));
                    });
                }
            }
            if running == 0 {
                break;
            }
            let Ok((name, result, input_hash)) = done_rx.recv() else {
                break;
            };
            running -= 1;
            match result {
                Ok(true) => {
                    let step = plan.steps.iter().find(|s| s.name == name);
                    let outputs_hash = step
                        .map(|s| state::hash_paths(&plan.project_dir, &s.outputs))
                        .transpose()
                        .map(Option::unwrap_or_default);
                    match outputs_hash {
                        Ok(outputs_hash) => {
                            if let Some(input_hash) = input_hash {
                                let record = state::StepRecord {
                                    input_hash,
                                    outputs_hash: outputs_hash.clone(),
                                };
                                if let Err(e) = state::store(&plan.state_dir, &name, &record) {
                                    tracing::warn!("could not record step `{name}`: {e}");
                                }
                            }
                            outputs.insert(name, outputs_hash);
                        }
                        Err(e) => error = error.take().or(Some(e)),
                    }
                }
                Ok(false) => {}
                Err(e) => {
                    error = error.take().or(Some(e));
                    // A step that could not even start stops the others too.
                    let mut stop = job
                        .stop
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if stop.is_none() {
                        *stop = Some(Stop {
                            at: Instant::now(),
                            signal: libc::SIGTERM,
                        });
                    }
                }
            }
        }
    });
    // Every step has ended: orphans no running step of this process claims (no marker, e.g. `env -i`, left while
    // other steps ran) end with the run.
    crate::process::end_run();
    for (step, commit) in job
        .resumed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
    {
        events.event(Event::Note {
            text: format!("step `{step}` resumed from checkpoint at commit {commit}"),
        });
    }
    if let Some(e) = error {
        return Err(e);
    }
    let mut failures = job
        .failures
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    failures.sort_by_key(|(when, _)| *when);
    report.failure = failures.into_iter().next().map(|(_, f)| f);
    report.restarts = job
        .restarts
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    report.preempted = job
        .preempted
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Ok(report)
}

enum Skip {
    Unchanged {
        outputs_hash: String,
    },
    /// Run it; record this input hash after success (`None`: the step declares no inputs/outputs, never skipped).
    Run {
        input_hash: Option<String>,
    },
}

fn skip_check(
    plan: &Plan,
    options: &RunOptions,
    step: &PlannedStep,
    upstream: &BTreeMap<String, String>,
) -> Result<Skip, LaunchError> {
    // `--no-deps` leaves out the steps it needs, whose outputs are part of its input hash: it always runs, and its
    // record is not kept (one without them would let a later run skip it after they changed).
    if (step.inputs.is_empty() && step.outputs.is_empty()) || options.no_deps {
        return Ok(Skip::Run { input_hash: None });
    }
    let input_hash = state::input_hash(
        step,
        &plan.project_dir,
        options.env_hash.as_deref(),
        upstream,
    )?;
    if !options.force
        && let Some(record) = state::load(&plan.state_dir, &step.name)
        && record.input_hash == input_hash
        && step
            .outputs
            .iter()
            .all(|o| plan.project_dir.join(o).exists())
    {
        let outputs_hash = state::hash_paths(&plan.project_dir, &step.outputs)?;
        if outputs_hash == record.outputs_hash {
            return Ok(Skip::Unchanged { outputs_hash });
        }
    }
    Ok(Skip::Run {
        input_hash: Some(input_hash),
    })
}

/// One running worker.
struct Worker {
    rank: u32,
    host: String,
    /// Its local rank on `host` (its GPUs): a replacement takes one no live worker there holds.
    local_rank: u32,
    pgid: u32,
    exited: Option<WorkerExit>,
    /// Its process has exited (set before its exit is reported: that waits for its output, up to `--grace`).
    process_gone: Arc<AtomicBool>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// A remote (ssh) rank's stdin: stopping it is writing the signal's name and closing this.
    stdin: Option<std::process::ChildStdin>,
}

/// The command of an engine's launcher (mpirun, srun, a Spark driver) with the worker contract of rank 0, less the
/// rank variables: the launcher gives each rank its own numbers, which the shim reads; rank 0's numbers (or ones
/// this launcher inherited) would be inherited by every rank and read by the shim as theirs.
fn launcher_command(start: &RankStart<'_>, argv: &[String]) -> RankCommand {
    let mut launcher = RankCommand::local_argv(start, argv);
    launcher.command.env(
        crate::engines::shim::GPUS_VAR,
        start.plan.gpus_per_worker.to_string(),
    );
    launcher.command.envs(start.plan.engine.launcher_env(false));
    // The later call for a name wins: these are removed, whether set above or inherited.
    for (name, _) in crate::env::rank_env(start.slot) {
        launcher.command.env_remove(name);
    }
    launcher
}

/// How one attempt of a step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Succeeded,
    /// Failed or stopped; the job's failures say why.
    Failed,
    /// A rank failed and the step may start again: the other ranks were stopped, the job goes on.
    Restart,
}

/// Runs one step to the end, starting it again after a rank failed up to `step.restarts` times (each attempt with
/// `HVD_RESTART_COUNT` set, its own rendezvous server and token, and its logs under `restart.<n>/` of the step's
/// log directory; the first attempt's stay where they always were). `Ok(true)`: every worker succeeded.
fn run_step(
    job: &Job<'_>,
    plan: &Plan,
    step: &PlannedStep,
    log_dir: &Path,
) -> Result<bool, LaunchError> {
    let mut restart = 0u32;
    let stopping = || {
        job.check_interrupts(&step.name, log_dir);
        job.stopping()
    };
    plan.engine.begin_step(plan, step, log_dir, &stopping)?;
    let _session = StepSession {
        engine: plan.engine.as_ref(),
        step,
        interrupts: &job.interrupts,
    };
    if job.stopping() {
        // Interrupted (or another step failed) while the engine readied the step: none of its ranks starts.
        return Ok(false);
    }
    // An elastic step's heartbeat timeout, read once (the step's, else this process's).
    let heartbeat = match step.min_workers.is_some() && step.workers.is_some() {
        true => Some(heartbeat::timeout(step)?),
        false => None,
    };
    loop {
        let mut attempt = step.clone();
        for name in [
            crate::env_vars::HVD_RESTART_COUNT,
            crate::env_vars::TORCHELASTIC_RESTART_COUNT,
        ] {
            attempt.env.insert(name.to_owned(), restart.to_string());
        }
        if let Some(heartbeat) = heartbeat {
            attempt
                .env
                .insert(crate::env_vars::HVD_ELASTIC.to_owned(), "1".to_owned());
            // The server's round window: a worker's join must wait at least this long, or a survivor gives up
            // while the round still waits for a hung peer.
            attempt.env.insert(
                hvd_collective::env_vars::HVD_ELASTIC_TIMEOUT.to_owned(),
                step.elastic.timeout.as_secs_f64().to_string(),
            );
            // How often the workers beat follows the launcher's timeout for a silent one.
            attempt.env.insert(
                hvd_collective::env_vars::HVD_HEARTBEAT_TIMEOUT.to_owned(),
                heartbeat.as_secs_f64().to_string(),
            );
        }
        let attempt_log = match restart {
            0 => log_dir.to_path_buf(),
            n => log_dir.join(format!("restart.{n}")),
        };
        if attempt
            .env
            .contains_key(crate::env_vars::HVD_CHECKPOINT_DIR)
        {
            let file = std::path::absolute(attempt_log.join(CHECKPOINT_REPORT))
                .unwrap_or_else(|_| attempt_log.join(CHECKPOINT_REPORT));
            attempt.env.insert(
                crate::env_vars::HVD_CHECKPOINT_REPORT.to_owned(),
                file.display().to_string(),
            );
            // Rank 0 puts its report at the rendezvous only where it surely reaches the launcher's. Under mpirun
            // (or srun without an elastic step) `HVD_RENDEZVOUS` is 127.0.0.1, on rank 0's host perhaps another
            // process's port, whose listener must not get the token (nor its 200 stand for the report).
            if step.workers.is_some() && plan.engine.rank_zero_reaches_rendezvous() {
                attempt.env.insert(
                    crate::env_vars::HVD_CHECKPOINT_REPORT_RENDEZVOUS.to_owned(),
                    "1".to_owned(),
                );
            }
        }
        let restartable = restart < step.restarts;
        match run_attempt(job, plan, &attempt, &attempt_log, (restartable, heartbeat))? {
            Outcome::Succeeded => return Ok(true),
            Outcome::Restart if !job.stopping() => {
                restart += 1;
                job.restarts
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(step.name.clone(), restart);
                job.events.event(Event::Note {
                    text: format!(
                        "starting step `{}` again (restart {restart} of {}); logs in {}",
                        step.name,
                        step.restarts,
                        log_dir.join(format!("restart.{restart}")).display()
                    ),
                });
            }
            Outcome::Failed | Outcome::Restart => return Ok(false),
        }
    }
}

/// Ends what the engine started for a step ([`SupervisedEngine::begin_step`]) once it is over, however it ended
/// (telling it whether `hvd run` was interrupted).
struct StepSession<'a> {
    engine: &'a dyn SupervisedEngine,
    step: &'a PlannedStep,
    interrupts: &'a Interrupts,
}

impl Drop for StepSession<'_> {
    fn drop(&mut self) {
        self.engine
            .end_step(self.step, self.interrupts.get().0 >= 1);
    }
}

/// The file in an attempt's log directory where its rank 0 says it resumed from a checkpoint (`commit N`).
const CHECKPOINT_REPORT: &str = "checkpoint.resumed";

/// The rendezvous key (`/kv/hvd.checkpoint/resumed`) where rank 0 says it resumed from a checkpoint (`commit N`):
/// it reaches the launcher from any host the rendezvous does (hvd.elastic's `_resume` puts it).
const RESUMED_SCOPE: &str = "hvd.checkpoint";
const RESUMED_KEY: &str = "resumed";

/// The most bytes of a resume report read: `commit ` and a 20-digit number fit with room to spare.
const RESUMED_MAX: usize = 64;

/// The commit the attempt's rank 0 reported resuming from: the rendezvous key ([`RESUMED_KEY`]) it put, which reaches
/// the launcher from any host, else the attempt's `checkpoint.resumed` file (`HVD_CHECKPOINT_REPORT`), for ranks
/// that cannot reach the rendezvous (or have none) but share this file system; only for a step with checkpoints. Both
/// are written by the job, so read as untrusted: at most [`RESUMED_MAX`] bytes of `commit N`; anything else is no
/// report (a warning in the log, which names its length, not its text).
fn reported_resume(step: &PlannedStep, server: Option<&RendezvousServer>) -> Option<u64> {
    if !step.env.contains_key(crate::env_vars::HVD_CHECKPOINT_DIR) {
        return None;
    }
    let (what, text) = match server.and_then(|s| s.value(RESUMED_SCOPE, RESUMED_KEY, RESUMED_MAX)) {
        Some(value) => (
            format!("the rendezvous key {RESUMED_SCOPE}/{RESUMED_KEY}"),
            value.map_err(|len| len.to_string()),
        ),
        None => {
            let file = step.env.get(crate::env_vars::HVD_CHECKPOINT_REPORT)?;
            (file.clone(), read_report(Path::new(file))?)
        }
    };
    let commit = text.as_deref().ok().and_then(parse_resumed);
    if commit.is_none() {
        // Its length only: what the job wrote is not echoed into the run's output.
        let len = text
            .as_ref()
            .map_or_else(String::clone, |t| t.len().to_string());
        tracing::warn!(
            "step `{}`: {what} holds {len} bytes that are not `commit N`; no resume reported",
            step.name
        );
    }
    commit
}

/// `commit N` (one line, N at most a u64), else `None`.
fn parse_resumed(text: &[u8]) -> Option<u64> {
    let commit = std::str::from_utf8(text)
        .ok()?
        .trim()
        .strip_prefix("commit ")?;
    if commit.is_empty() || !commit.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    commit.parse().ok()
}

/// The report file rank 0 wrote (`HVD_CHECKPOINT_REPORT`), when there is one: its bytes, or past [`RESUMED_MAX`]
/// `Err` with its length (a regular file's, from the open descriptor; "more than 64" for anything else). A link is
/// not followed, and a FIFO does not block.
fn read_report(file: &Path) -> Option<Result<Vec<u8>, String>> {
    use crate::untrusted::{Small, read_small};
    let Ok(Small::Read { bytes, file_len }) = read_small(file, RESUMED_MAX as u64 + 1, false)
    else {
        return None;
    };
    Some(if bytes.len() > RESUMED_MAX {
        Err(match file_len {
            Some(len) if len > RESUMED_MAX as u64 => len.to_string(),
            _ => format!("more than {RESUMED_MAX}"),
        })
    } else {
        Ok(bytes)
    })
}

/// Runs one attempt of a step to the end; `restartable`: a failing rank stops only this attempt's workers
/// ([`Outcome::Restart`]) instead of the job.
fn run_attempt(
    job: &Job<'_>,
    plan: &Plan,
    step: &PlannedStep,
    log_dir: &Path,
    (restartable, heartbeat): (bool, Option<Duration>),
) -> Result<Outcome, LaunchError> {
    // Remote ranks are a distributed step's.
    let keepalive = match step.workers {
        Some(_) => keepalive::interval(step)?,
        None => None,
    };
    let started = Instant::now();
    // A step that runs once runs here; a distributed one as its engine says.
    let engine: &dyn SupervisedEngine = match step.workers {
        Some(_) => plan.engine.as_ref(),
        None => &Local,
    };
    let launcher = step.workers.and_then(|n| engine.launcher(plan, step, n));
    let rendezvous = match step.workers {
        Some(_) => Some(start_rendezvous(engine, step)?),
        None => None,
    };
    let mut discovery: Option<Discovery> = None;
    // Where an elastic step's new workers may run (replacements, and hosts discovery finds).
    let mut hosts: Option<placement::Hosts> = None;
    let mut first_slots: Option<Vec<Slot>> = None;
    // An elastic step: the server hands out each round's ranks, and a lost worker does not stop the others.
    let elastic = match (step.min_workers, step.workers, &rendezvous) {
        (Some(_), Some(_), _) if launcher.is_some() => {
            return Err(LaunchError::Engine(format!(
                "step `{}` is elastic, but the {} engine starts its ranks through one launcher process, which \
                 cannot lose a rank and go on; {}",
                step.name,
                engine.name(),
                crate::engine::ELASTIC_ENGINES
            )));
        }
        (Some(min), Some(n), Some((server, _))) => {
            // Replacements run where the engine starts each rank itself: this machine, hosts it reaches (ssh), or the
            // allocation's nodes (slurm: `SupervisedEngine::replacement_hosts`).
            let replaces = engine.replaces_workers();
            if replaces {
                hosts = Some(placement::Hosts::new(plan, step, false));
            }
            // With host discovery, the first run of the script says how many workers start.
            // `execute` refused host discovery on an engine that does not start workers itself.
            // The step's own program, else the engine's (kubernetes in a launcher pod: the step's worker pods).
            let program = match &step.elastic.discovery {
                Some(script) => Some(crate::discovery::Program::script(script)),
                None => engine.discovery(),
            };
            if let Some(program) = program
                && replaces
            {
                let d = Discovery::of(program, plan.project_dir.clone(), discovery_timeout()?);
                let mut found = placement::Hosts::new(plan, step, true);
                first_slots = Some(first_discovery(job, engine, step, &d, &mut found, min, n)?);
                hosts = Some(found);
                discovery = Some(d);
            }
            let first = first_slots.as_ref().map_or(n, |s| s.len() as u32);
            server.set_elastic(first, step.elastic.timeout);
            // Below the minimum no round forms: the survivors wait for replacements, or for the step to end.
            server.set_elastic_minimum(min);
            if let Some(timeout) = heartbeat {
                server.set_elastic_heartbeat(timeout);
            }
            Some(min)
        }
        _ => None,
    };
    let info = rendezvous.as_ref().map(|(s, t)| RendezvousInfo {
        addr: s.addr(),
        token: t.clone(),
    });
    let master_port = crate::env::master_port();
    job.events.event(Event::StepStarted {
        step: step.name.clone(),
        // With host discovery, the workers its first run found slots for.
        workers: first_slots
            .as_ref()
            .map(|s| s.len() as u32)
            .or(step.workers),
        rendezvous: info.as_ref().map(|i| i.addr),
    });

    let step_name: Arc<str> = Arc::from(step.name.as_str());
    let (exit_tx, exit_rx) = mpsc::channel::<(usize, WorkerExit, Instant)>();
    let mut workers: Vec<Worker> = Vec::new();
    let pumps = Pumps::default();
    let pumps = &pumps;
    let step_marker = new_step_marker(log_dir, step);
    // Registered before any worker starts: another step's cleanup leaves this step's processes alone.
    let lease = crate::process::start_step(format!("{STEP_MARKER_VAR}={step_marker}"));
    let step_cgroup = job.cgroup.as_ref().and_then(|c| match c.step(&step.name) {
        Ok(group) => Some(group),
        Err(e) => {
            tracing::warn!(
                "no cgroup for step `{}` ({e}); its escaped processes are found by their environment",
                step.name
            );
            None
        }
    });
    let result = std::thread::scope(|scope| -> Result<Outcome, LaunchError> {
        let mut spawn_error = None;
        // A step an engine launches (mpirun) is one process, supervised in place of its ranks (as rank 0); an
        // elastic step with host discovery starts as many as the script found slots, and more as it finds them.
        let slots = match (&launcher, &first_slots) {
            (Some(_), _) => &step.layout.slots[..step.layout.slots.len().min(1)],
            (None, Some(placed)) => &placed[..],
            (None, None) => &step.layout.slots[..],
        };
        let tagged = launcher.is_some();
        // A launched step's lines are attributed to the host the layout puts their tag's rank on.
        let rank_hosts: Arc<[Arc<str>]> = match tagged {
            true => step
                .layout
                .slots
                .iter()
                .map(|s| Arc::from(s.host.as_str()))
                .collect(),
            false => Arc::from([]),
        };
        let exit_tx = exit_tx;
        let mut spawn_worker =
            |slot: &Slot, workers: &mut Vec<Worker>| -> Result<(), LaunchError> {
                let rank_dir = log_dir.join(format!("rank.{}", slot.rank));
                fs_err::create_dir_all(&rank_dir).map_err(|source| LaunchError::Io {
                    path: rank_dir.clone(),
                    source,
                })?;
                let open = |name: &str| {
                    let path = rank_dir.join(name);
                    fs_err::File::create(&path).map_err(|source| LaunchError::Io { path, source })
                };
                let (stdout_file, stderr_file) = (open("stdout")?, open("stderr")?);
                let start = RankStart {
                    plan,
                    step,
                    slot,
                    rendezvous: info.as_ref(),
                    master_port,
                    marker: &step_marker,
                };
                let RankCommand {
                    mut command,
                    remote,
                    after_token,
                    reports_status,
                } = match &launcher {
                    Some(argv) => launcher_command(&start, argv),
                    None => engine.rank_command(&start)?,
                };
                command.current_dir(&plan.project_dir);
                command
                    .stdin(if remote {
                        Stdio::piped()
                    } else {
                        Stdio::null()
                    })
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                command.env(STEP_MARKER_VAR, &step_marker);
                configure_worker_in(&mut command, step_cgroup.as_ref());
                let nonce = match reports_status && remote {
                    true => Some(new_token().map_err(|source| LaunchError::Io {
                        path: "/dev/urandom".into(),
                        source,
                    })?),
                    false => None,
                };
                let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
                    step: step.name.clone(),
                    rank: slot.rank,
                    program: command.get_program().to_string_lossy().into_owned(),
                    source,
                })?;
                let pgid = child.id();
                // A remote rank's wrapper reads the job token from the first line of its stdin (after the nonce of
                // its status report, when it makes one), then its variables.
                let mut stdin = child.stdin.take();
                let report = match (nonce, stdin.as_mut()) {
                    (Some(nonce), Some(pipe)) => {
                        use std::io::Write as _;
                        let _ = writeln!(pipe, "{nonce}");
                        Some(Arc::new(reported::StatusReport::new(&nonce)))
                    }
                    _ => None,
                };
                if let (Some(pipe), Some(info)) = (stdin.as_mut(), info.as_ref()) {
                    use std::io::Write as _;
                    let _ = writeln!(pipe, "{}", info.token);
                    let _ = pipe.write_all(after_token.as_bytes());
                }
                if let Some(pipe) = stdin.as_ref() {
                    keepalive::never_block(pipe);
                }
                if let Some(w) = &job.watchdog {
                    w.watch(pgid);
                }
                let tail = Arc::new(Mutex::new(VecDeque::new()));
                let host: Arc<str> = Arc::from(slot.host.as_str());
                let pipes = [
                    (
                        child.stdout.take().map(OwnedFd::from),
                        stdout_file,
                        Stream::Stdout,
                        None,
                        None,
                    ),
                    (
                        child.stderr.take().map(OwnedFd::from),
                        stderr_file,
                        Stream::Stderr,
                        Some(tail.clone()),
                        report.clone(),
                    ),
                ];
                for (pipe, file, stream, tail, report) in pipes {
                    let Some(pipe) = pipe else { continue };
                    pumps.live.fetch_add(1, Ordering::SeqCst);
                    let (step, host, rank) = (step_name.clone(), host.clone(), slot.rank);
                    let events = job.events;
                    let rank_hosts = rank_hosts.clone();
                    scope.spawn(move || {
                        let line = LineSource {
                            step: &step,
                            host: &host,
                            rank,
                            stream,
                            tagged,
                            rank_hosts: &rank_hosts,
                        };
                        pump(
                            std::fs::File::from(pipe),
                            pumps,
                            file,
                            &line,
                            events,
                            (tail.as_deref(), report.as_deref()),
                        )
                    });
                }
                let index = workers.len();
                let tx = exit_tx.clone();
                let (stderr_tail, events) = (tail.clone(), job.events);
                let grace = job.options.grace.max(PUMP_DRAIN);
                let (rank, host, step) = (slot.rank, slot.host.clone(), step_name.clone());
                let process_gone = Arc::new(AtomicBool::new(false));
                let gone = Arc::clone(&process_gone);
                scope.spawn(move || {
                    use std::os::unix::process::ExitStatusExt;
                    let exit = match child.wait() {
                        Ok(status) => match (status.code(), status.signal()) {
                            (Some(c), _) => WorkerExit::Code(c),
                            (None, Some(s)) => WorkerExit::Signal(s),
                            (None, None) => WorkerExit::Code(1),
                        },
                        Err(_) => WorkerExit::Code(1),
                    };
                    gone.store(true, Ordering::Release);
                    let when = Instant::now();
                    let exit = match report {
                        Some(report) => {
                            // An exit 0 waits for the pump to read up to the report (a pipe buffer of output
                            // may be ahead of it), up to the grace period; only a pipe held open past the
                            // process gets the short bound.
                            let limit = if exit == WorkerExit::Code(0) {
                                grace
                            } else {
                                PUMP_DRAIN
                            };
                            let exit = reported::settle(exit, report.wait(PUMP_DRAIN, limit));
                            if exit == WorkerExit::Lost {
                                events.event(Event::Note {
                                    text: reported::lost_note(rank, &step, &host, &stderr_tail),
                                });
                            }
                            exit
                        }
                        None => exit,
                    };
                    let _ = tx.send((index, exit, when));
                });
                workers.push(Worker {
                    rank: slot.rank,
                    host: slot.host.clone(),
                    local_rank: slot.local_rank,
                    pgid,
                    exited: None,
                    process_gone,
                    stderr_tail: tail,
                    stdin,
                });
                Ok(())
            };
        for slot in slots {
            if let Err(e) = spawn_worker(slot, &mut workers) {
                spawn_error = Some(e);
                break;
            }
        }
        if spawn_error.is_some() {
            job.kill_now.store(true, Ordering::SeqCst);
        }
        let ok = supervise(
            job,
            Attempt {
                step,
                log_dir,
                started,
                restartable,
                elastic,
                heartbeat,
                keepalive,
                engine: plan.engine.clone(),
            },
            &mut workers,
            &exit_rx,
            rendezvous.as_ref().map(|(s, _)| s),
            hosts.as_mut().map(|hosts| Growth {
                discovery: discovery.as_mut(),
                hosts,
                spawn: &mut spawn_worker,
            }),
        );
        // Whatever a worker started that left its process group (setsid, daemons) ends with the step too: the
        // step's cgroup holds all of it; without one, the orphans the launcher adopted as their subreaper that are
        // this step's (its marker, or no marker while no other step runs) are killed with their descendants.
        if let Some(group) = &step_cgroup {
            group.kill_all();
        }
        crate::process::end_step(lease);
        let drain_deadline = Instant::now() + PUMP_DRAIN;
        while pumps.live.load(Ordering::SeqCst) > 0 && Instant::now() < drain_deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        pumps.abandon.store(true, Ordering::SeqCst);
        match spawn_error {
            Some(e) => Err(e),
            None => Ok(ok),
        }
    });
    // Every pump has finished: the failing rank's stderr tail is complete.
    complete_failures(job, step, &workers, launcher.is_some());
    if let Some(commit) = reported_resume(step, rendezvous.as_ref().map(|(s, _)| s)) {
        job.resumed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(step.name.clone(), commit);
    }
    // Long-polls end and the port is freed only after every worker is gone.
    drop(rendezvous);
    if let Ok(Outcome::Succeeded) = result {
        job.events.event(Event::StepFinished {
            step: step.name.clone(),
            elapsed: started.elapsed(),
        });
    }
    result
}

/// Starts a distributed step's rendezvous where its engine says, with a fresh token.
fn start_rendezvous(
    engine: &dyn SupervisedEngine,
    step: &PlannedStep,
) -> Result<(RendezvousServer, String), LaunchError> {
    let token = new_token().map_err(|source| LaunchError::Io {
        path: "/dev/urandom".into(),
        source,
    })?;
    let (ip, peers) = engine.rendezvous();
    let server = RendezvousServer::start(SocketAddr::new(ip, 0), &token, peers)?;
    server.set_gloo_layout(&step.layout.hosts());
    Ok((server, token))
}

/// The marker of one start of `step` (`<run id>/<step>/<n>`): unique per step start in this process (run ids are
/// per second and pid, so two runs in one second share one), so one step's cleanup never kills another's processes.
fn new_step_marker(log_dir: &Path, step: &PlannedStep) -> String {
    static STEP_STARTS: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}/{}/{}",
        log_dir
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        step.name,
        STEP_STARTS.fetch_add(1, Ordering::Relaxed)
    )
}

/// Gives the failures of `step` the failing rank's stderr tail; for a step an engine launched (`launched`), whose
/// launcher exits with its own code, the rank that failed first and its code, read from the tagged lines.
fn complete_failures(job: &Job<'_>, step: &PlannedStep, workers: &[Worker], launched: bool) {
    let mut failures = job
        .failures
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (_, failure) in failures.iter_mut().filter(|(_, f)| f.step == step.name) {
        if let Cause::Worker { rank, .. } | Cause::BelowMinimum { rank, .. } = failure.cause
            && let Some(worker) = workers.iter().find(|w| w.rank == rank)
        {
            let tail = worker
                .stderr_tail
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            failure.stderr_tail = tail.iter().cloned().collect();
            // mpirun / srun exit with their own code: name the rank that failed first and pass its code on.
            if launched
                && let Some((rank, code)) = crate::engines::failing_rank(&failure.stderr_tail)
                && let Cause::Worker { host, .. } = &failure.cause
            {
                let exit = WorkerExit::Code(code);
                failure.cause = Cause::Worker {
                    rank,
                    host: host.clone(),
                    exit,
                };
                failure.exit_code = exit.code();
                // The launcher's stderr mixes every rank's lines: keep the failing rank's.
                failure.stderr_tail = failure
                    .stderr_tail
                    .iter()
                    .filter_map(|line| crate::engines::untag(line))
                    .filter(|(r, _, _)| *r == rank)
                    .map(|(_, _, text)| text.to_owned())
                    .collect();
            }
        }
    }
    drop(failures);
}

/// Where a pumped line comes from: the step, the worker's host and rank, the stream; `tagged`: the lines carry the
/// real rank in mpirun's / srun's tag, and come from that rank's host in `rank_hosts` (by rank).
#[derive(Clone, Copy)]
struct LineSource<'a> {
    step: &'a Arc<str>,
    host: &'a Arc<str>,
    rank: u32,
    stream: Stream,
    tagged: bool,
    rank_hosts: &'a [Arc<str>],
}

/// Copies one worker stream to its log file and to the event sink, line by line.
fn pump(
    mut pipe: impl Read + std::os::fd::AsRawFd,
    pumps: &Pumps,
    mut file: fs_err::File,
    source: &LineSource<'_>,
    events: &dyn EventSink,
    (tail, report): (
        Option<&Mutex<VecDeque<String>>>,
        Option<&reported::StatusReport>,
    ),
) {
    let LineSource {
        step,
        host,
        rank,
        stream,
        tagged,
        rank_hosts,
    } = *source;
    use std::io::Write;
    let mut splitter = LineSplitter::default();
    let mut emit = |line: &[u8]| {
        // The wrapper's status report is not the rank's output.
        let Some(line) = report.map_or(Some(line), |r| r.strip(line)) else {
            return;
        };
        let text = String::from_utf8_lossy(line).into_owned();
        if let Some(tail) = tail {
            let mut tail = tail
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if tail.len() == STDERR_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(text.clone());
        }
        // A launched step's lines carry the real rank in mpirun's / srun's tag.
        let (rank, stream, text) = match tagged.then(|| crate::engines::untag(&text)).flatten() {
            Some((r, s, rest)) => (r, s.unwrap_or(stream), rest.to_owned()),
            None => (rank, stream, text),
        };
        let host = rank_hosts.get(rank as usize).unwrap_or(host);
        events.event(Event::Line {
            step: step.clone(),
            host: host.clone(),
            rank,
            stream,
            text,
        });
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Poll first so a pipe held open by an escaped grandchild cannot keep the step from ending.
        if !crate::process::wait_readable(pipe.as_raw_fd(), Duration::from_millis(100)) {
            if let Some(report) = report {
                report.idle();
            }
            if pumps.abandon.load(Ordering::SeqCst) {
                break;
            }
            continue;
        }
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let _ = file.write_all(&buf[..n]);
                if let Some(report) = report {
                    report.feed(&buf[..n]);
                }
                splitter.push(&buf[..n], &mut emit);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    splitter.finish(&mut emit);
    let _ = file.flush();
    if let Some(keep) = report.and_then(reported::StatusReport::finish) {
        let _ = file.set_len(keep);
    }
    pumps.live.fetch_sub(1, Ordering::SeqCst);
}

/// The output pumps of one step.
#[derive(Default)]
struct Pumps {
    live: std::sync::atomic::AtomicUsize,
    /// Set when the workers are gone but a pipe is still open (a process that left the worker's process group
    /// holds it): stop reading after what is buffered.
    abandon: AtomicBool,
}

/// How long output pumps may keep reading after every worker of a step ended.
const PUMP_DRAIN: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    /// A report file past the limit is refused with its real length (the warning names it), not the bytes read.
    #[test]
    fn an_oversized_report_file_is_refused_with_its_real_length() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("checkpoint.resumed");
        std::fs::write(&file, vec![b'x'; 1000]).unwrap();
        assert_eq!(read_report(&file), Some(Err("1000".to_owned())));
        std::fs::write(&file, "commit 7\n").unwrap();
        let text = read_report(&file).unwrap().unwrap();
        assert_eq!(parse_resumed(&text), Some(7));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read_report(&link), None);
    }
}
