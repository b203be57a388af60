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
use crate::discovery::{Blacklist, Discovery, DiscoveryError, HostSlots};
use crate::engine::{Local, Plan, PlannedStep, RankCommand, RankStart, SupervisedEngine};
use crate::env::{RendezvousInfo, STEP_MARKER_VAR, Slot};
use crate::options::RunOptions;
use crate::process::{
    Interrupts, RunCgroup, Watchdog, configure_worker_in, signal_group, signal_name,
};
use crate::rendezvous::{RendezvousServer, new_token};
use crate::report::{
    Cause, Event, EventSink, FailureSummary, LineSplitter, RunReport, STDERR_TAIL_LINES, Stream,
    TIMEOUT_EXIT_CODE, WorkerExit, new_run_id,
};
use crate::state;

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

/// Runs `plan`. Returns when every started process has ended; nothing is left running.
pub fn execute(
    plan: &Plan,
    options: &RunOptions,
    events: &dyn EventSink,
    interrupts: Interrupts,
) -> Result<RunReport, LaunchError> {
    // The engine's checks and files (ssh: the hosts; spark: its driver), when a step is distributed.
    if plan.steps.iter().any(|s| s.workers.is_some()) {
        plan.engine.prepare(plan)?;
    }
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
    };
    let mut report = RunReport {
        run_id,
        log_dir: log_dir.clone(),
        ran: Vec::new(),
        skipped: Vec::new(),
        failure: None,
        detached: false,
        restarts: BTreeMap::new(),
        preempted: BTreeMap::new(),
    };
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
    if step.inputs.is_empty() && step.outputs.is_empty() {
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
    pgid: u32,
    exited: Option<WorkerExit>,
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
    loop {
        let mut attempt = step.clone();
        for name in [
            crate::env_vars::HVD_RESTART_COUNT,
            crate::env_vars::TORCHELASTIC_RESTART_COUNT,
        ] {
            attempt.env.insert(name.to_owned(), restart.to_string());
        }
        if step.min_workers.is_some() && step.workers.is_some() {
            attempt
                .env
                .insert(crate::env_vars::HVD_ELASTIC.to_owned(), "1".to_owned());
            // The server's round window: a worker's join must wait at least this long, or a survivor gives up
            // while the round still waits for a hung peer.
            attempt.env.insert(
                hvd_collective::env_vars::HVD_ELASTIC_TIMEOUT.to_owned(),
                job.options.elastic_timeout.as_secs_f64().to_string(),
            );
        }
        let attempt_log = match restart {
            0 => log_dir.to_path_buf(),
            n => log_dir.join(format!("restart.{n}")),
        };
        let restartable = restart < step.restarts;
        match run_attempt(job, plan, &attempt, &attempt_log, restartable)? {
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

/// Runs one attempt of a step to the end; `restartable`: a failing rank stops only this attempt's workers
/// ([`Outcome::Restart`]) instead of the job.
fn run_attempt(
    job: &Job<'_>,
    plan: &Plan,
    step: &PlannedStep,
    log_dir: &Path,
    restartable: bool,
) -> Result<Outcome, LaunchError> {
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
    let mut first_workers: Option<u32> = None;
    // An elastic step: the server hands out each round's ranks, and a lost worker does not stop the others.
    let elastic = match (step.min_workers, step.workers, &rendezvous) {
        (Some(_), Some(_), _) if launcher.is_some() => {
            return Err(LaunchError::Engine(format!(
                "step `{}` is elastic, but the {} engine starts its ranks through one launcher process, which \
                 cannot lose a rank and go on; run elastic steps on the local or ssh engine",
                step.name,
                engine.name()
            )));
        }
        (Some(min), Some(n), Some((server, _))) => {
            // With host discovery, the first run of the script says how many workers start.
            if let Some(script) = &job.options.host_discovery_script {
                if !engine.name().starts_with("local") {
                    return Err(LaunchError::Engine(format!(
                        "step `{}`: host discovery (`--host-discovery-script`) runs elastic steps on the local engine \
                         only, not on the {} (its hosts are its host list)",
                        step.name,
                        engine.name()
                    )));
                }
                let d = Discovery::new(
                    script.clone(),
                    plan.project_dir.clone(),
                    discovery_timeout()?,
                );
                first_workers = Some(first_discovery(job, step, &d, min, n)?);
                discovery = Some(d);
            }
            server.set_elastic(first_workers.unwrap_or(n), job.options.elastic_timeout);
            Some(min)
        }
        _ => None,
    };
    let info = rendezvous.as_ref().map(|(s, t)| RendezvousInfo {
        addr: s.addr(),
        token: t.clone(),
    });
    let master_port = crate::env::free_port().unwrap_or(29500);
    job.events.event(Event::StepStarted {
        step: step.name.clone(),
        // With host discovery, the workers its first run found slots for.
        workers: first_workers.or(step.workers),
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
        let slots = match &launcher {
            Some(_) => &step.layout.slots[..step.layout.slots.len().min(1)],
            None => {
                let n = first_workers.map_or(step.layout.slots.len(), |n| n as usize);
                &step.layout.slots[..n.min(step.layout.slots.len())]
            }
        };
        let tagged = launcher.is_some();
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
                let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
                    step: step.name.clone(),
                    rank: slot.rank,
                    program: command.get_program().to_string_lossy().into_owned(),
                    source,
                })?;
                let pgid = child.id();
                // A remote rank's wrapper reads the job token from the first line of its stdin.
                let mut stdin = child.stdin.take();
                if let (Some(pipe), Some(info)) = (stdin.as_mut(), info.as_ref()) {
                    use std::io::Write as _;
                    let _ = writeln!(pipe, "{}", info.token);
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
                    ),
                    (
                        child.stderr.take().map(OwnedFd::from),
                        stderr_file,
                        Stream::Stderr,
                        Some(tail.clone()),
                    ),
                ];
                for (pipe, file, stream, tail) in pipes {
                    let Some(pipe) = pipe else { continue };
                    pumps.live.fetch_add(1, Ordering::SeqCst);
                    let (step, host, rank) = (step_name.clone(), host.clone(), slot.rank);
                    let events = job.events;
                    scope.spawn(move || {
                        let line = LineSource {
                            step: &step,
                            host: &host,
                            rank,
                            stream,
                            tagged,
                        };
                        pump(
                            std::fs::File::from(pipe),
                            pumps,
                            file,
                            &line,
                            events,
                            tail.as_deref(),
                        )
                    });
                }
                let index = workers.len();
                let tx = exit_tx.clone();
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
                    let _ = tx.send((index, exit, Instant::now()));
                });
                workers.push(Worker {
                    rank: slot.rank,
                    host: slot.host.clone(),
                    pgid,
                    exited: None,
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
            },
            &mut workers,
            &exit_rx,
            rendezvous.as_ref().map(|(s, _)| s),
            discovery.as_mut().map(|d| Growth {
                discovery: d,
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

/// `HVD_DISCOVERY_TIMEOUT`: seconds one run of the discovery script may take (default 10).
fn discovery_timeout() -> Result<Duration, LaunchError> {
    let name = crate::env_vars::HVD_DISCOVERY_TIMEOUT;
    match std::env::var(name) {
        Err(_) => Ok(Duration::from_secs(10)),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0 && *s <= 3600.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                LaunchError::Engine(format!(
                    "{name}={v:?} is not a number of seconds above 0 (at most 3600)"
                ))
            }),
    }
}

/// The slots the script found on this machine (the local engine runs every worker here) and not blacklisted. Other
/// hosts are named once (`ignored` remembers them).
fn local_slots(
    job: &Job<'_>,
    step: &PlannedStep,
    hosts: &[HostSlots],
    blacklist: &Blacklist,
    ignored: &mut std::collections::BTreeSet<String>,
) -> u32 {
    let here = step.layout.slots.first().map_or("", |s| s.host.as_str());
    let now = Instant::now();
    let mut slots = 0u32;
    for h in hosts {
        if !crate::discovery::is_this_machine(&h.host, here) {
            if ignored.insert(h.host.clone()) {
                job.events.event(Event::Note {
                    text: format!(
                        "warning: host discovery found host `{}` for step `{}`, but the local engine runs every \
                         worker on this machine ({here}); ignored",
                        h.host, step.name
                    ),
                });
            }
            continue;
        }
        if !blacklist.blocked(&h.host, now) {
            slots = slots.saturating_add(h.slots);
        }
    }
    slots
}

/// The warning for a run of the script that gave no hosts.
fn discovery_warning(e: &DiscoveryError) -> String {
    let mut text = format!("warning: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text.push_str("; keeping the current hosts");
    text
}

/// The first run(s) of the discovery script of an elastic step: how many workers it starts (the slots found, at most
/// `max`). Runs it every second until it finds at least `min` slots, for up to `--elastic-timeout`.
fn first_discovery(
    job: &Job<'_>,
    step: &PlannedStep,
    discovery: &Discovery,
    min: u32,
    max: u32,
) -> Result<u32, LaunchError> {
    let started = Instant::now();
    let mut ignored = std::collections::BTreeSet::new();
    let mut last: Option<String> = None;
    loop {
        let found = match discovery.run_now() {
            Ok(hosts) => {
                let n = local_slots(job, step, &hosts, &Blacklist::default(), &mut ignored);
                if n >= min {
                    return Ok(n.min(max));
                }
                format!(
                    "host discovery found {n} slots for step `{}`, fewer than its minimum of {min}; waiting",
                    step.name
                )
            }
            Err(e) => discovery_warning(&e),
        };
        if last.as_deref() != Some(found.as_str()) {
            job.events.event(Event::Note {
                text: found.clone(),
            });
        }
        last = Some(found);
        if started.elapsed() >= job.options.elastic_timeout
            || job.stopping()
            || job.interrupts.get().0 > 0
        {
            return Err(LaunchError::Engine(format!(
                "step `{}` did not start: host discovery (`{}`) found no {min} slots within {} s (--elastic-timeout); \
                 the last run: {}",
                step.name,
                discovery.script().display(),
                job.options.elastic_timeout.as_secs_f64(),
                last.unwrap_or_default()
            )));
        }
        std::thread::sleep(crate::discovery::INTERVAL);
    }
}

/// Starts the worker of one slot and adds it to the attempt's workers.
type SpawnWorker<'a> = dyn FnMut(&Slot, &mut Vec<Worker>) -> Result<(), LaunchError> + 'a;

/// An elastic step's growth through host discovery: the script, and how to start one more worker.
struct Growth<'a> {
    discovery: &'a mut Discovery,
    spawn: &'a mut SpawnWorker<'a>,
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

/// One attempt of a step, as [`supervise`] watches it.
struct Attempt<'a> {
    step: &'a PlannedStep,
    log_dir: &'a Path,
    started: Instant,
    /// A failing rank stops this attempt's workers only, and the step starts again.
    restartable: bool,
    /// `Some(min)`: an elastic step; a lost worker does not stop the others while `min` are left.
    elastic: Option<u32>,
}

/// Waits for the workers of one attempt of a step, stopping them when the job stops (or, `restartable`, when one
/// of them fails).
fn supervise(
    job: &Job<'_>,
    attempt: Attempt<'_>,
    workers: &mut Vec<Worker>,
    exits: &mpsc::Receiver<(usize, WorkerExit, Instant)>,
    rendezvous: Option<&RendezvousServer>,
    mut growth: Option<Growth<'_>>,
) -> Outcome {
    let Attempt {
        step,
        log_dir,
        started,
        restartable,
        elastic,
    } = attempt;
    // An elastic step's workers lost so far (failed, or left out of a round: counted when left out), by slot, and
    // those being stopped because a round formed without them.
    let mut lost = std::collections::BTreeSet::new();
    let mut dropping: Vec<(usize, Instant)> = Vec::new();
    // A rank of a restartable attempt failed: stop this attempt's workers (not the job's).
    let mut restart = false;
    let size = workers.len() as u32;
    let mut terminated_at: Option<Instant> = None;
    let mut killed = false;
    let mut all_ok = true;
    let mut remaining = workers.len();
    // Host discovery: hosts whose workers failed repeatedly, hosts the local engine ignores, the last warning.
    let mut blacklist = Blacklist::new(step.layout.slots.first().map_or("", |s| s.host.as_str()));
    let mut ignored = std::collections::BTreeSet::new();
    let mut last_warning: Option<String> = None;
    while remaining > 0 {
        match exits.recv_timeout(Duration::from_millis(20)) {
            Ok((index, exit, when)) => {
                remaining -= 1;
                let size = workers_started(workers);
                let worker = &mut workers[index];
                worker.exited = Some(exit);
                // Whatever the worker left behind in its group goes with it.
                signal_group(worker.pgid, libc::SIGKILL);
                if let Some(w) = &job.watchdog {
                    w.unwatch(worker.pgid);
                }
                if let (Some(min), Some(server)) = (elastic, rendezvous) {
                    // The membership's count: not the ones that ended (whatever their status) or were left out.
                    let mut left = server.worker_gone(worker.rank) as u32;
                    // A worker left out of a round is lost however it ends (a script may exit 0 on SIGTERM).
                    let dropped = lost.contains(&worker.rank);
                    // Preempted: it committed, told the rendezvous it leaves, and exited 0 (hvd.elastic on SIGTERM).
                    // What counts is who was alive when it left (the others may have finished since).
                    let handed_over = server.elastic_left().get(&worker.rank).copied();
                    let preempted =
                        exit == WorkerExit::Code(0) && !dropped && handed_over.is_some();
                    if preempted && let Some(after) = handed_over {
                        left = after as u32;
                    }
                    // Once the attempt is being stopped (to start again, or for good), exits are its doing.
                    if (exit != WorkerExit::Code(0) || dropped || preempted)
                        && !job.stopping()
                        && !restart
                    {
                        let what = match preempted {
                            true => {
                                job.preempted
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                                    .entry(step.name.clone())
                                    .or_default()
                                    .push(worker.rank);
                                "was preempted: it committed, handed over and left".to_owned()
                            }
                            false => {
                                lost.insert(worker.rank);
                                if growth.is_some()
                                    && let Some(cooldown) = blacklist.failed(&worker.host, when)
                                {
                                    job.events.event(Event::Note {
                                        text: format!(
                                            "host {} is blacklisted for {} s: {} of its workers were lost; host \
                                             discovery starts no new workers there until then",
                                            worker.host,
                                            cooldown.as_secs(),
                                            crate::discovery::BLACKLIST_FAILURES
                                        ),
                                    });
                                }
                                format!("was lost ({exit})")
                            }
                        };
                        if left >= min {
                            job.events.event(Event::Note {
                                text: format!(
                                    "rank {} of step `{}` {what}; {left} of its {size} workers go on (elastic, \
                                     minimum {min})",
                                    worker.rank, step.name
                                ),
                            });
                            continue;
                        }
                        all_ok = false;
                        // A preempted worker ends the step as the SIGTERM that preempted it would have.
                        let exit = match preempted {
                            true => WorkerExit::Signal(libc::SIGTERM),
                            false => exit,
                        };
                        let cause = Cause::BelowMinimum {
                            rank: worker.rank,
                            host: worker.host.clone(),
                            exit,
                            left,
                            min,
                        };
                        let reason = format!(
                            "rank {} of step `{}` {what}: {left} of its workers are left, fewer than its minimum of \
                             {min}; stopping the others (grace {} s)",
                            worker.rank,
                            step.name,
                            job.options.grace.as_secs_f64()
                        );
                        if restartable {
                            restart = true;
                            job.events.event(Event::Stopping { reason });
                        } else {
                            job.fail(
                                when,
                                FailureSummary {
                                    step: step.name.clone(),
                                    cause,
                                    exit_code: exit.code(),
                                    stderr_tail: Vec::new(),
                                    log_dir: log_dir.to_path_buf(),
                                },
                                reason,
                            );
                        }
                        continue;
                    }
                }
                if exit != WorkerExit::Code(0) && restartable && !job.stopping() {
                    all_ok = false;
                    if !restart {
                        restart = true;
                        job.events.event(Event::Stopping {
                            reason: format!(
                                "rank {} of step `{}` failed ({exit}); stopping the other workers (grace {} s) to \
                                 start the step again",
                                worker.rank,
                                step.name,
                                job.options.grace.as_secs_f64()
                            ),
                        });
                    }
                } else if exit != WorkerExit::Code(0) {
                    all_ok = false;
                    job.fail(
                        when,
                        FailureSummary {
                            step: step.name.clone(),
                            cause: Cause::Worker { rank: worker.rank, host: worker.host.clone(), exit },
                            exit_code: exit.code(),
                            stderr_tail: Vec::new(),
                            log_dir: log_dir.to_path_buf(),
                        },
                        format!(
                            "rank {} of step `{}` failed ({exit}); stopping the other workers (grace {} s)",
                            worker.rank,
                            step.name,
                            job.options.grace.as_secs_f64()
                        ),
                    );
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        job.check_interrupts(&step.name, log_dir);
        // Host discovery: new slots on this machine start new workers (up to the step's maximum), which join at the
        // members' next commit; a run that fails keeps the current workers, with a warning (once per message).
        if let (Some(g), Some(server)) = (growth.as_mut(), rendezvous)
            && !job.stopping()
            && !restart
            && let Some(result) = g.discovery.poll()
        {
            match result {
                Ok(hosts) => {
                    last_warning = None;
                    let found = local_slots(job, step, &hosts, &blacklist, &mut ignored) as usize;
                    let cap = step.layout.slots.len();
                    let mut live = workers
                        .iter()
                        .enumerate()
                        .filter(|(i, w)| {
                            w.exited.is_none() && !dropping.iter().any(|(d, _)| d == i)
                        })
                        .count();
                    while live < found.min(cap) && workers.len() < cap {
                        let Some(slot) = server.add_elastic_worker() else {
                            break;
                        };
                        match (g.spawn)(&step.layout.slots[slot as usize], workers) {
                            Ok(()) => {
                                remaining += 1;
                                live += 1;
                                job.events.event(Event::Note {
                                    text: format!(
                                        "host discovery found {found} slots for step `{}`: started rank {slot}; it \
                                         joins at the workers' next commit",
                                        step.name
                                    ),
                                });
                            }
                            Err(e) => {
                                server.worker_gone(slot);
                                job.events.event(Event::Note {
                                    text: format!(
                                        "warning: could not start rank {slot} of step `{}` for a slot host \
                                         discovery found: {e}",
                                        step.name
                                    ),
                                });
                                break;
                            }
                        }
                    }
                }
                Err(e) => {
                    let text = discovery_warning(&e);
                    if last_warning.as_deref() != Some(text.as_str()) {
                        job.events.event(Event::Note { text: text.clone() });
                    }
                    last_warning = Some(text);
                }
            }
        }
        // Live workers a round of an elastic step formed without (they did not ask to join in time): stop them;
        // they count as lost.
        if let (Some(_), Some(server)) = (elastic, rendezvous) {
            for slot in server.elastic_dropped() {
                if let Some(index) = workers
                    .iter()
                    .position(|w| w.rank == slot && w.exited.is_none())
                    && !dropping.iter().any(|(i, _)| *i == index)
                {
                    dropping.push((index, Instant::now()));
                    lost.insert(slot);
                    job.events.event(Event::Note {
                        text: format!(
                            "rank {slot} of step `{}` did not rejoin within {} s; stopping it (elastic)",
                            step.name,
                            job.options.elastic_timeout.as_secs_f64()
                        ),
                    });
                    let w = &mut workers[index];
                    match w.stdin.take() {
                        Some(mut stdin) => crate::engine::send_stop(&mut stdin, libc::SIGTERM),
                        None => signal_group(w.pgid, libc::SIGTERM),
                    }
                }
            }
            for (index, since) in &dropping {
                let w = &workers[*index];
                if w.exited.is_none() && since.elapsed() >= job.options.grace {
                    signal_group(w.pgid, libc::SIGKILL);
                }
            }
        }
        if let Some(limit) = step.timeout
            && started.elapsed() > limit
            && !job.stopping()
        {
            all_ok = false;
            job.fail(
                Instant::now(),
                FailureSummary {
                    step: step.name.clone(),
                    cause: Cause::Timeout { after: limit },
                    exit_code: TIMEOUT_EXIT_CODE,
                    stderr_tail: Vec::new(),
                    log_dir: log_dir.to_path_buf(),
                },
                format!(
                    "step `{}` ran past its timeout of {} s; stopping it",
                    step.name,
                    limit.as_secs_f64()
                ),
            );
        }
        if let (Some(limit), Some(server)) = (job.options.start_timeout, rendezvous)
            && started.elapsed() > limit
            && !job.stopping()
        {
            let joined = server.joined_ranks();
            let missing: Vec<u32> = (0..size).filter(|r| !joined.contains(r)).collect();
            if !missing.is_empty() {
                all_ok = false;
                job.fail(
                    Instant::now(),
                    FailureSummary {
                        step: step.name.clone(),
                        cause: Cause::StartTimeout { missing: missing.clone(), after: limit },
                        exit_code: TIMEOUT_EXIT_CODE,
                        stderr_tail: Vec::new(),
                        log_dir: log_dir.to_path_buf(),
                    },
                    format!("ranks {missing:?} of step `{}` did not join the rendezvous in time; stopping", step.name),
                );
            }
        }
        if let Some(signal) = job.stop_signal().or(restart.then_some(libc::SIGTERM))
            && terminated_at.is_none()
        {
            all_ok = false;
            terminated_at = Some(Instant::now());
            // Before the signal: an elastic worker's SIGTERM handler asks, and stops rather than hands over.
            if let Some(server) = rendezvous {
                server.stop_elastic();
            }
            for w in workers.iter_mut().filter(|w| w.exited.is_none()) {
                match w.stdin.take() {
                    // ssh exits once the remote wrapper has stopped the rank; SIGKILL after the grace period.
                    Some(mut stdin) => crate::engine::send_stop(&mut stdin, signal),
                    // An elastic worker unwinds on SIGTERM (hvd.elastic): its `sh -c` wrapper must outlive it.
                    None if elastic.is_some() => signal_past_wrapper(w.pgid, signal),
                    None => signal_group(w.pgid, signal),
                }
            }
        }
        let grace_over = terminated_at.is_some_and(|t| t.elapsed() >= job.options.grace);
        if !killed && (grace_over || job.kill_now.load(Ordering::SeqCst)) {
            killed = true;
            terminated_at.get_or_insert_with(Instant::now);
            for w in workers.iter().filter(|w| w.exited.is_none()) {
                signal_group(w.pgid, libc::SIGKILL);
            }
        }
    }
    match (all_ok, restart && !job.stopping()) {
        (true, _) => Outcome::Succeeded,
        (false, true) => Outcome::Restart,
        (false, false) => Outcome::Failed,
    }
}

/// Signals a local worker's process group, except its leader when that is the `/bin/sh -c` wrapper of the rank's
/// command: the wrapper ends with the command (with its exit status) instead of dying first, which would end the
/// worker (its group is killed once the worker's process exits) before it unwinds. A group that is only the leader,
/// or led by anything else, gets the signal whole.
fn signal_past_wrapper(pgid: u32, signal: i32) {
    let leader_is_sh = std::fs::read_link(format!("/proc/{pgid}/exe"))
        .ok()
        .zip(std::fs::canonicalize("/bin/sh").ok())
        .is_some_and(|(exe, sh)| exe == sh);
    let members: Vec<u32> = match leader_is_sh {
        true => std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| pid != pgid && process_group(pid) == Some(pgid))
            .collect(),
        false => Vec::new(),
    };
    if members.is_empty() {
        signal_group(pgid, signal);
        return;
    }
    for pid in members {
        if let Ok(pid) = libc::pid_t::try_from(pid) {
            // SAFETY: plain syscall with integer arguments, to a member of the worker's own process group.
            unsafe {
                libc::kill(pid, signal);
            }
        }
    }
}

/// The process group of `pid` (`/proc/PID/stat`, the field after the parent's pid), `None` when it is gone.
fn process_group(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: the fields after it follow the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// How many workers an attempt has started so far (an elastic step's discovery may add some).
fn workers_started(workers: &[Worker]) -> usize {
    workers.len()
}

/// Where a pumped line comes from: the step, the worker's host and rank, the stream; `tagged`: the lines carry the
/// real rank in mpirun's / srun's tag.
#[derive(Clone, Copy)]
struct LineSource<'a> {
    step: &'a Arc<str>,
    host: &'a Arc<str>,
    rank: u32,
    stream: Stream,
    tagged: bool,
}

/// Copies one worker stream to its log file and to the event sink, line by line.
fn pump(
    mut pipe: impl Read + std::os::fd::AsRawFd,
    pumps: &Pumps,
    mut file: fs_err::File,
    source: &LineSource<'_>,
    events: &dyn EventSink,
    tail: Option<&Mutex<VecDeque<String>>>,
) {
    let LineSource {
        step,
        host,
        rank,
        stream,
        tagged,
    } = *source;
    use std::io::Write;
    let mut splitter = LineSplitter::default();
    let mut emit = |line: &[u8]| {
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
            if pumps.abandon.load(Ordering::SeqCst) {
                break;
            }
            continue;
        }
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let _ = file.write_all(&buf[..n]);
                splitter.push(&buf[..n], &mut emit);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    splitter.finish(&mut emit);
    let _ = file.flush();
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
