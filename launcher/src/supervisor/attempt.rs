//! Watching one attempt of a step: its workers' exits, stopping them (SIGTERM, a grace period, SIGKILL), and an
//! elastic step's rounds, preemption, replacements for lost workers, its wait below the minimum, and its growth and
//! shrinking through host discovery.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::placement::Hosts;
use super::{Job, Outcome, Worker};
use crate::LaunchError;
use crate::discovery::{Blacklist, Discovery, DiscoveryError, HostSlots};
use crate::engine::PlannedStep;
use crate::env::Slot;
use crate::process::signal_group;
use crate::rendezvous::RendezvousServer;
use crate::report::{Cause, Event, FailureSummary, TIMEOUT_EXIT_CODE, WorkerExit};

/// `HVD_DISCOVERY_TIMEOUT`: seconds one run of the discovery script may take (default 10).
pub(super) fn discovery_timeout() -> Result<Duration, LaunchError> {
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

/// The first run(s) of the discovery script of an elastic step: the slots of the workers it starts (at most `max`,
/// on the hosts the script found, made ready first where the engine reaches other hosts). Runs it every second until
/// it finds at least `min` usable slots, for up to `--elastic-timeout` (or what the engine allows its hosts to come
/// up: [`crate::engine::SupervisedEngine::first_hosts_within`]).
pub(super) fn first_discovery(
    job: &Job<'_>,
    engine: &dyn crate::engine::SupervisedEngine,
    step: &PlannedStep,
    discovery: &Discovery,
    hosts: &mut Hosts,
    min: u32,
    max: u32,
) -> Result<Vec<Slot>, LaunchError> {
    let started = Instant::now();
    let (within, flag) = engine.first_hosts_within(step.elastic.timeout);
    let mut last: Option<String> = None;
    loop {
        let found = match discovery.run_now(step.elastic.slots_per_host) {
            Ok(found) => {
                let usable = hosts.usable(
                    job,
                    step,
                    &found,
                    &Blacklist::new(hosts.here()),
                    Some(crate::options::saturating_add(started, within)),
                );
                let n: u32 = usable.iter().fold(0u32, |n, (_, s)| n.saturating_add(*s));
                if n >= min {
                    let mut placed: Vec<Slot> = Vec::new();
                    for host in Hosts::place(&usable, &[], n.min(max) as usize) {
                        let local = placed.iter().filter(|s| s.host == host).count() as u32;
                        placed.push(hosts.slot_on(
                            step,
                            placed.len() as u32,
                            &host,
                            &usable,
                            local,
                        ));
                    }
                    return Ok(placed);
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
        if started.elapsed() >= within || job.stopping() || job.interrupts.get().0 > 0 {
            return Err(LaunchError::Engine(format!(
                "step `{}` did not start: host discovery (`{}`) found no {min} slots within {} s ({flag}); the last \
                 run: {}",
                step.name,
                discovery.script().display(),
                within.as_secs_f64(),
                last.unwrap_or_default()
            )));
        }
        std::thread::sleep(crate::discovery::INTERVAL);
    }
}

/// How many workers an attempt of an elastic step may start past its first ones (replacements for lost workers, and
/// new slots host discovery finds), per slot of the step's maximum: each takes a slot number, a `rank.N` log directory and a
/// supervised entry for the rest of the attempt, and makes `HVD_SIZE` grow.
pub(super) const STARTS_PER_SLOT: usize = 8;

/// The workers started in one attempt past its first ones, against its cap ([`STARTS_PER_SLOT`] per slot of `max`).
#[derive(Debug)]
pub(super) struct Starts {
    started: usize,
    cap: usize,
}

impl Starts {
    pub(super) fn new(max: usize) -> Starts {
        Starts {
            started: 0,
            cap: max.max(1).saturating_mul(STARTS_PER_SLOT),
        }
    }

    /// Counts one more worker; `Err(cap)` when the attempt has started as many as its cap already.
    pub(super) fn take(&mut self) -> Result<(), usize> {
        if self.started >= self.cap {
            return Err(self.cap);
        }
        self.started += 1;
        Ok(())
    }
}

/// When an elastic step may try to start a new worker again after starts failed: [`crate::discovery::INTERVAL`]
/// after the first failure, doubled after each one in a row, at most [`SPAWN_BACKOFF_MAX`]; a start that works resets
/// it.
#[derive(Debug, Default)]
pub(super) struct SpawnBackoff {
    failures: u32,
    until: Option<Instant>,
}

/// The longest wait between two tries to start a new worker after failed starts.
pub(super) const SPAWN_BACKOFF_MAX: Duration = Duration::from_secs(30);

impl SpawnBackoff {
    /// A start failed at `now`: returns how long no new worker is tried.
    pub(super) fn failed(&mut self, now: Instant) -> Duration {
        let wait = crate::discovery::INTERVAL
            .saturating_mul(1 << self.failures.min(16))
            .min(SPAWN_BACKOFF_MAX);
        self.failures += 1;
        self.until = Some(now + wait);
        wait
    }

    /// A start worked.
    pub(super) fn started(&mut self) {
        *self = SpawnBackoff::default();
    }

    /// Whether a new worker may be tried at `now`.
    pub(super) fn ready(&self, now: Instant) -> bool {
        self.until.is_none_or(|until| now >= until)
    }
}

/// Starts the worker of one slot and adds it to the attempt's workers.
pub(super) type SpawnWorker<'a> =
    dyn FnMut(&Slot, &mut Vec<Worker>) -> Result<(), LaunchError> + 'a;

/// Where an elastic step's new workers come from: replacements for lost workers on the step's own hosts and slots,
/// or, with host discovery, the slots the script finds; and how to start one more worker.
pub(super) struct Growth<'a> {
    /// The discovery script; `None`: replacements only, on the step's own hosts and slots.
    pub(super) discovery: Option<&'a mut Discovery>,
    pub(super) hosts: &'a mut Hosts,
    pub(super) spawn: &'a mut SpawnWorker<'a>,
}

/// One attempt of a step, as [`supervise`] watches it.
pub(super) struct Attempt<'a> {
    pub(super) step: &'a PlannedStep,
    pub(super) log_dir: &'a Path,
    pub(super) started: Instant,
    /// A failing rank stops this attempt's workers only, and the step starts again.
    pub(super) restartable: bool,
    /// `Some(min)`: an elastic step; a lost worker does not stop the others while `min` are left.
    pub(super) elastic: Option<u32>,
    /// An elastic step's `HVD_HEARTBEAT_TIMEOUT`: a worker silent for this long is lost.
    pub(super) heartbeat: Option<Duration>,
    /// `HVD_REMOTE_KEEPALIVE`: how often remote workers get a keepalive line (`None`: never).
    pub(super) keepalive: Option<Duration>,
    /// The run's engine, which looks whether the launcher reaches a host when every worker went quiet at once.
    pub(super) engine: std::sync::Arc<dyn crate::engine::SupervisedEngine>,
}

/// An elastic step below its minimum, waiting up to `--elastic-timeout` for workers to come back: since when, the
/// latest round then (the step is back once a later one forms: no round forms below the minimum), and the last worker
/// lost (its slot, host, how it ended).
#[derive(Debug, Clone)]
struct Below {
    since: Instant,
    round: u64,
    rank: u32,
    host: String,
    exit: WorkerExit,
}

/// Whether an elastic step below its minimum since `below` is back to it: a round of at least `min` members formed
/// after the one it was below in (no round forms below the minimum). Says so when it is.
fn back_to_minimum(
    job: &Job<'_>,
    step: &PlannedStep,
    server: &RendezvousServer,
    below: &Below,
    min: u32,
) -> bool {
    let (round, members) = server.elastic_round();
    if round <= below.round || members < min {
        return false;
    }
    job.events.event(Event::Note {
        text: format!(
            "step `{}` is back to {members} workers (minimum {min}); it goes on (elastic)",
            step.name
        ),
    });
    true
}

/// The reason an attempt that stayed below its minimum for `--elastic-timeout` ends.
fn below_minimum_reason(
    job: &Job<'_>,
    step: &PlannedStep,
    below: &Below,
    left: u32,
    min: u32,
) -> String {
    format!(
        "step `{}` has {left} workers, fewer than its minimum of {min}, and no workers came back within {} s \
         (--elastic-timeout); the last one lost was rank {} ({}); stopping the others (grace {} s)",
        step.name,
        step.elastic.timeout.as_secs_f64(),
        below.rank,
        below.exit,
        job.options.grace.as_secs_f64()
    )
}

/// The reason an attempt below its minimum without host discovery (`own_only`) ends at once: every one of the step's
/// own hosts, where its replacements start, is blacklisted past the end of the wait. `None`: one may come back.
fn every_host_blacklisted(
    job: &Job<'_>,
    step: &PlannedStep,
    below: &Below,
    (left, min): (u32, u32),
    (own, blacklist): (&[HostSlots], &Blacklist),
    own_only: bool,
) -> Option<String> {
    let deadline = crate::options::saturating_add(below.since, step.elastic.timeout);
    if !own_only || own.is_empty() || !own.iter().all(|h| blacklist.blocked(&h.host, deadline)) {
        return None;
    }
    let hosts: Vec<&str> = own.iter().map(|h| h.host.as_str()).collect();
    Some(format!(
        "step `{}` has {left} workers, fewer than its minimum of {min}, and none can come back within {} s \
         (--elastic-timeout): every host where a replacement could start ({}) is blacklisted past it; the last one \
         lost was rank {} ({}); stopping the others (grace {} s)",
        step.name,
        step.elastic.timeout.as_secs_f64(),
        hosts.join(", "),
        below.rank,
        below.exit,
        job.options.grace.as_secs_f64()
    ))
}

/// Ends an attempt below its minimum for `reason`: a restart when `restartable` (returns true), else the step fails
/// with the last lost worker's exit code.
fn below_minimum_for_good(
    job: &Job<'_>,
    attempt: (&PlannedStep, &Path, bool),
    below: &Below,
    (left, min): (u32, u32),
    reason: String,
) -> bool {
    let (step, log_dir, restartable) = attempt;
    if restartable {
        job.events.event(Event::Stopping { reason });
        return true;
    }
    job.fail(
        Instant::now(),
        FailureSummary {
            step: step.name.clone(),
            cause: Cause::BelowMinimum {
                rank: below.rank,
                host: below.host.clone(),
                exit: below.exit,
                left,
                min,
            },
            exit_code: below.exit.code(),
            stderr_tail: Vec::new(),
            log_dir: log_dir.to_path_buf(),
        },
        reason,
    );
    false
}

/// How long a worker asked to hand over may take before the ssh engine's wrapper kills it: its
/// `HVD_PREEMPT_GRACE` (the step's, else this process's; default 30 s), plus a margin for its commit and shutdown.
fn preempt_kill_after(step: &PlannedStep) -> Duration {
    let name = crate::env_vars::HVD_PREEMPT_GRACE;
    let grace = step
        .env
        .get(name)
        .cloned()
        .or_else(|| std::env::var(name).ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0)
        .map_or(Duration::from_secs(30), Duration::from_secs_f64);
    grace + Duration::from_secs(10)
}

/// Counts a lost worker against `host` (one that could not start, or was lost or dropped), saying so when that
/// blacklists the host.
fn charge_host(job: &Job<'_>, blacklist: &mut Blacklist, host: &str, when: Instant) {
    if let Some(cooldown) = blacklist.failed(host, when) {
        job.events.event(Event::Note {
            text: format!(
                "host {host} is blacklisted for {} s: {} of its workers were lost or could not start; no new \
                 workers start there until then",
                cooldown.as_secs_f64().round(),
                crate::discovery::BLACKLIST_FAILURES
            ),
        });
    }
}

/// Asks worker `w` of an elastic step to hand over at its next commit (SIGTERM to the rank, not its `sh -c`
/// wrapper): a remote one through its stdin (`PREEMPT`: the host's wrapper kills it after `kill_after`, not after
/// `--grace`), a local one directly.
fn preempt_worker(w: &mut Worker, kill_after: Duration) {
    match w.stdin.take() {
        Some(mut stdin) => crate::engine::send_preempt(&mut stdin, kill_after),
        None => signal_past_wrapper(w.pgid, libc::SIGTERM, true),
    }
}

/// Waits for the workers of one attempt of a step, stopping them when the job stops (or, `restartable`, when one
/// of them fails).
pub(super) fn supervise(
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
        heartbeat,
        keepalive,
        engine,
    } = attempt;
    let this_attempt = (step, log_dir, restartable);
    // An elastic step's workers lost so far (failed, or left out of a round: counted when left out), by slot, and
    // those being stopped because a round formed without them.
    let mut lost = std::collections::BTreeSet::new();
    let mut dropping: Vec<(usize, Instant)> = Vec::new();
    // Whether a lost worker counts against its host (not on spark: every rank has one pretend host).
    let charges_hosts = engine.charges_hosts();
    // Live workers found frozen (no heartbeat for `heartbeat`), stopped as workers a round formed without.
    let mut silent = super::heartbeat::Silent::new(engine);
    // Workers on slots host discovery no longer lists, asked to leave at their next commit (SIGTERM), by slot.
    let mut unlisted = Removing::default();
    // New workers still waiting to join when the training finished: stopped, not counted as lost.
    let mut unneeded = std::collections::BTreeSet::new();
    // Lost workers not replaced yet (without host discovery a replacement only fills a lost worker's place).
    let mut vacancies = 0usize;
    // Below the minimum: waiting for workers to come back since then.
    let mut below: Option<Below> = None;
    // Without host discovery: where replacements run (the step's own hosts and slots; slurm: the allocation's).
    let own: Vec<HostSlots> = growth.as_ref().map_or_else(
        || Hosts::own(step),
        |g| g.hosts.replacement_hosts().to_vec(),
    );
    let mut finishing = false;
    // A rank of a restartable attempt failed: stop this attempt's workers (not the job's).
    let mut restart = false;
    let size = workers.len() as u32;
    let mut terminated_at: Option<Instant> = None;
    let mut killed = false;
    let mut all_ok = true;
    let mut remaining = workers.len();
    // Host discovery: hosts whose workers failed repeatedly, the last warning.
    let mut blacklist = Blacklist::new(step.layout.slots.first().map_or("", |s| s.host.as_str()))
        .with_cooldown(step.elastic.cooldown);
    if !charges_hosts {
        blacklist = blacklist.off();
    }
    let mut last_warning: Option<String> = None;
    let mut starts = Starts::new(step.layout.slots.len());
    let mut backoff = SpawnBackoff::default();
    let mut keepalive = super::keepalive::Keepalive::new(keepalive, Instant::now());
    while remaining > 0 {
        let received = exits.recv_timeout(Duration::from_millis(20));
        keepalive.tick(Instant::now(), workers);
        // New workers are placed only once every exit queued has been handled (this pass waited and none came):
        // placed between two exits, a replacement could go to a host the next one would blacklist.
        let drained = matches!(received, Err(mpsc::RecvTimeoutError::Timeout));
        match received {
            Ok((index, exit, when)) => {
                remaining -= 1;
                let size = workers_started(workers);
                let worker = &mut workers[index];
                worker.exited = Some(exit);
                // A worker that ended well, neither left out nor handing over, finished its training: the step is
                // ending, and discovery starts no worker in its place.
                let ended_well = exit == WorkerExit::Code(0)
                    && !lost.contains(&worker.rank)
                    && rendezvous.is_none_or(|s| !s.elastic_left().contains_key(&worker.rank));
                finishing |= ended_well;
                // A member that finished: no worker that never was one joins from now on (the membership answers
                // it 410; the launcher stops it below).
                if let (true, Some(_), Some(server)) = (ended_well, elastic, rendezvous) {
                    server.finish_elastic(worker.rank);
                }
                // Whatever the worker left behind in its group goes with it.
                signal_group(worker.pgid, libc::SIGKILL);
                if let Some(w) = &job.watchdog {
                    w.unwatch(worker.pgid);
                }
                if let (Some(min), Some(server)) = (elastic, rendezvous) {
                    // The membership's count: not the ones that ended (whatever their status) or were left out,
                    // nor new workers that have not joined a round yet (one may hang before it joins).
                    server.worker_gone(worker.rank);
                    let mut left = server.elastic_alive_members() as u32;
                    // Below the minimum, a round of `min` may have formed since this loop last looked, up to this
                    // worker's end (a replacement joined, its round formed, and it was lost before then: a loaded
                    // machine): the step was back, and this loss begins a new wait, not one begun before that round.
                    if let Some(b) = below.as_ref()
                        && !job.stopping()
                        && !restart
                        && back_to_minimum(job, step, server, b, min)
                    {
                        below = None;
                    }
                    // A worker left out of a round is lost however it ends (a script may exit 0 on SIGTERM).
                    let dropped = lost.contains(&worker.rank);
                    // Preempted: it committed, told the rendezvous it leaves, and exited 0 (hvd.elastic on SIGTERM).
                    // What counts is who was alive when it left (the others may have finished since).
                    let handed_over = server
                        .elastic_left()
                        .get(&worker.rank)
                        .copied()
                        .filter(|_| exit == WorkerExit::Code(0) && !dropped);
                    if let Some(after) = handed_over {
                        left = after as u32;
                    }
                    // Asked to leave because host discovery no longer lists its slot: however it ended, not a loss.
                    let removed = unlisted.removing.contains(&worker.rank) && !dropped;
                    if unneeded.contains(&worker.rank) {
                        continue;
                    }
                    let preempted = handed_over.is_some() && !removed;
                    // Left out of a round and stopped, then the training finished without it (a lost node's rank
                    // whose srun hung until `--elastic-timeout`): its end takes nothing from the members, and the
                    // loss was said when it was left out.
                    if dropped && finishing && !job.stopping() && !restart {
                        let why = match silent.contains(&worker.rank) {
                            true => "found silent (no heartbeat)",
                            false => "left out of the round",
                        };
                        job.events.event(Event::Note {
                            text: format!(
                                "rank {} of step `{}`, {why}, ended ({exit}); the training finished without it",
                                worker.rank, step.name
                            ),
                        });
                        continue;
                    }
                    // Once the attempt is being stopped (to start again, or for good), exits are its doing.
                    if (exit != WorkerExit::Code(0) || dropped || preempted || removed)
                        && !job.stopping()
                        && !restart
                    {
                        let what = match (removed, preempted) {
                            (true, _) => match handed_over {
                                Some(_) => "left: host discovery no longer lists its slot (it committed and \
                                            handed over)"
                                    .to_owned(),
                                None => {
                                    format!("left: host discovery no longer lists its slot ({exit})")
                                }
                            },
                            (false, true) => {
                                job.preempted
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                                    .entry(step.name.clone())
                                    .or_default()
                                    .push(worker.rank);
                                "was preempted: it committed, handed over and left".to_owned()
                            }
                            (false, false) => {
                                lost.insert(worker.rank);
                                vacancies += 1;
                                // A dropped worker's host was charged when it was dropped.
                                if growth.is_some() && !dropped {
                                    charge_host(job, &mut blacklist, &worker.host, when);
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
                        // A preempted worker ends the step as the SIGTERM that preempted it would have.
                        let exit = match preempted {
                            true => WorkerExit::Signal(libc::SIGTERM),
                            false => exit,
                        };
                        let last = Below {
                            since: below.as_ref().map_or(when, |b| b.since),
                            round: below
                                .as_ref()
                                .map_or_else(|| server.elastic_round().0, |b| b.round),
                            rank: worker.rank,
                            host: worker.host.clone(),
                            exit,
                        };
                        // Nothing can come back (an engine that starts no new workers, or, without host discovery,
                        // no lost worker to replace: a preempted one is not): the step ends at once.
                        let discovered = growth.as_ref().is_some_and(|g| g.discovery.is_some());
                        if growth.is_none() || (!discovered && vacancies == 0) {
                            all_ok = false;
                            let reason = format!(
                                "rank {} of step `{}` {what}: {left} of its workers are left, fewer than its \
                                 minimum of {min}; stopping the others (grace {} s)",
                                worker.rank,
                                step.name,
                                job.options.grace.as_secs_f64()
                            );
                            restart |= below_minimum_for_good(
                                job,
                                this_attempt,
                                &last,
                                (left, min),
                                reason,
                            );
                            continue;
                        }
                        // Below the minimum no round forms (the survivors wait in their join): replacements, or
                        // slots host discovery finds, may bring the step back within `--elastic-timeout`.
                        below = Some(last);
                        job.events.event(Event::Note {
                            text: format!(
                                "rank {} of step `{}` {what}: {left} of its workers are left, fewer than its minimum \
                                 of {min}; waiting up to {} s (--elastic-timeout) for {} (elastic)",
                                worker.rank,
                                step.name,
                                step.elastic.timeout.as_secs_f64(),
                                match step.elastic.discovery.is_some() {
                                    false => "replacements",
                                    true => "host discovery to find slots",
                                }
                            ),
                        });
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
                } else if exit != WorkerExit::Code(0) && elastic.is_some() && job.stopping() {
                    // An elastic step's worker ending once the job is stopping is not what failed it: its stop's own
                    // cause is recorded (below its minimum, an interrupt, a timeout). Its exit may be older than
                    // that stop (it waited in the queue while this loop found the step below its minimum), and as the
                    // earliest failure it would be named the root cause ("rank 0 ended first") for a loss the step
                    // was built to take: a worker the launcher itself had found silent and stopped, on a loaded
                    // machine (workers_on_this_machine_that_all_freeze_are_found_not_waited_for).
                    all_ok = false;
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
        // New workers: without host discovery a replacement for each lost worker, on the step's own hosts and slots;
        // with it, new slots start new workers (up to the step's maximum) and workers on slots it no longer lists
        // leave. They join at the members' next commit (or the re-form under way); a run of the script that fails
        // keeps the current workers, with a warning (once per message).
        let polled = match growth.as_mut() {
            _ if job.stopping() || restart || finishing || !drained => None,
            Some(Growth {
                discovery: Some(d), ..
            }) => d.poll(step.elastic.slots_per_host),
            Some(_) if vacancies > 0 && backoff.ready(Instant::now()) => Some(Ok(own.clone())),
            _ => None,
        };
        if let (Some(g), Some(server), Some(min), Some(result)) =
            (growth.as_mut(), rendezvous, elastic, polled)
        {
            let discovered = g.discovery.is_some();
            match result {
                Ok(found) => {
                    last_warning = None;
                    if discovered {
                        remove_unlisted(
                            job,
                            step,
                            workers,
                            (&dropping, &mut unlisted),
                            &g.hosts.listed(&found),
                            min,
                        );
                    }
                    let mut usable = g.hosts.usable(job, step, &found, &blacklist, None);
                    if let Some(timeout) = heartbeat.filter(|_| charges_hosts) {
                        usable = silent.placeable(usable, Instant::now(), timeout);
                    }
                    let total = usable.iter().fold(0u32, |n, (_, s)| n.saturating_add(*s));
                    let cap = step.layout.slots.len();
                    // The live workers' hosts and local ranks. A worker being stopped holds its place until it has
                    // exited (a frozen host's rank may take `--grace` to go).
                    let mut live: Vec<(String, u32)> = workers
                        .iter()
                        .filter(|w| w.exited.is_none() && !unlisted.removing.contains(&w.rank))
                        .map(|w| (w.host.clone(), w.local_rank))
                        .collect();
                    let refs: Vec<&str> = live.iter().map(|(h, _)| h.as_str()).collect();
                    // Up to `max` live workers; a lost one's replacement gets a new slot past every earlier one.
                    let want = match discovered {
                        _ if !backoff.ready(Instant::now()) => 0,
                        true => cap.saturating_sub(live.len()),
                        false => cap.saturating_sub(live.len()).min(vacancies),
                    };
                    let placed = Hosts::place(&usable, &refs, want);
                    for host in placed {
                        if let Err(cap) = starts.take() {
                            all_ok = false;
                            job.fail(
                                Instant::now(),
                                FailureSummary {
                                    step: step.name.clone(),
                                    cause: Cause::StartCap { cap: cap as u32 },
                                    exit_code: 1,
                                    stderr_tail: Vec::new(),
                                    log_dir: log_dir.to_path_buf(),
                                },
                                format!(
                                    "{} has tried to start {cap} workers for step `{}` in this attempt, its cap \
                                     ({STARTS_PER_SLOT} per slot of its maximum of {}), and would try one more; \
                                     stopping the step (grace {} s)",
                                    match discovered {
                                        true => "host discovery",
                                        false => "replacing lost workers",
                                    },
                                    step.name,
                                    step.layout.slots.len(),
                                    job.options.grace.as_secs_f64()
                                ),
                            );
                            break;
                        }
                        let Some(slot) = server.add_elastic_worker() else {
                            break;
                        };
                        let held: Vec<(&str, u32)> =
                            live.iter().map(|(h, l)| (h.as_str(), *l)).collect();
                        let local = Hosts::free_local_rank(&held, &host);
                        let new = g.hosts.slot_on(step, slot, &host, &usable, local);
                        match (g.spawn)(&new, workers) {
                            Ok(()) => {
                                backoff.started();
                                remaining += 1;
                                vacancies = vacancies.saturating_sub(1);
                                live.push((host.clone(), local));
                                job.events.event(Event::Note {
                                    text: match discovered {
                                        true => format!(
                                            "host discovery found {total} slots for step `{}`: started rank {slot} \
                                             on {host}; it joins at the workers' next commit",
                                            step.name
                                        ),
                                        false => format!(
                                            "started rank {slot} of step `{}` on {host} in place of a lost worker; \
                                             it joins the workers' next round",
                                            step.name
                                        ),
                                    },
                                });
                            }
                            Err(e) => {
                                server.worker_gone(slot);
                                let now = Instant::now();
                                let wait = backoff.failed(now);
                                job.events.event(Event::Note {
                                    text: format!(
                                        "warning: could not start rank {slot} of step `{}` for a free slot on \
                                         {host}: {e}; trying again in {} s at the earliest",
                                        step.name,
                                        wait.as_secs()
                                    ),
                                });
                                // A host where workers cannot start is blacklisted as one where they are lost.
                                charge_host(job, &mut blacklist, &host, now);
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
            if let Some(timeout) = heartbeat {
                super::heartbeat::find_silent(job, step, server, workers, timeout, &mut silent);
            }
            for slot in server.elastic_dropped() {
                if let Some(index) = workers
                    .iter()
                    .position(|w| w.rank == slot && w.exited.is_none())
                    && !dropping.iter().any(|(i, _)| *i == index)
                {
                    dropping.push((index, Instant::now()));
                    lost.insert(slot);
                    // Its host is charged now, not when it exits (up to `--grace` later): no new worker is
                    // placed on a host whose workers froze in the meantime.
                    if growth.is_some() {
                        charge_host(job, &mut blacklist, &workers[index].host, Instant::now());
                    }
                    // A silent one was named when it was found.
                    if !silent.contains(&slot) {
                        job.events.event(Event::Note {
                            text: format!(
                                "rank {slot} of step `{}` did not rejoin within {} s; stopping it (elastic)",
                                step.name,
                                step.elastic.timeout.as_secs_f64()
                            ),
                        });
                    }
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
        // The training finished (a member ended well): new workers that never were members will never be taken
        // in, whether they asked to join or are still starting; they have no state to hand over.
        if let (true, Some(server)) = (finishing, rendezvous) {
            for slot in server.elastic_never_members() {
                if let Some(w) = workers
                    .iter()
                    .find(|w| w.rank == slot && w.exited.is_none())
                    && unneeded.insert(slot)
                {
                    job.events.event(Event::Note {
                        text: format!(
                            "rank {slot} of step `{}` never joined, and the training finished; stopping it",
                            step.name
                        ),
                    });
                    signal_group(w.pgid, libc::SIGKILL);
                }
            }
        }
        // Below the minimum: back to it once a round forms (it has at least `min` members: replacements or discovered
        // slots joined; a worker merely started may hang before it joins), or still below after `--elastic-timeout`.
        if let (Some(min), Some(server), Some(b)) = (elastic, rendezvous, below.as_ref())
            && !job.stopping()
            && !restart
        {
            // The workers that count: members of a round, alive (not the new ones still starting).
            let alive = server.elastic_alive_members() as u32;
            if back_to_minimum(job, step, server, b, min) {
                below = None;
            } else if let Some(reason) = every_host_blacklisted(
                job,
                step,
                b,
                (alive, min),
                (&own, &blacklist),
                growth.as_ref().is_some_and(|g| g.discovery.is_none()),
            )
            // Without host discovery, replacements start only on the step's own hosts: when every one of them is
            // blacklisted past the deadline, none can come back in time; else the step is below for good once
            // `--elastic-timeout` has passed.
            .or_else(|| {
                (b.since.elapsed() >= step.elastic.timeout)
                    .then(|| below_minimum_reason(job, step, b, alive, min))
            }) {
                all_ok = false;
                restart |= below_minimum_for_good(job, this_attempt, b, (alive, min), reason);
                below = None;
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
            // An elastic step does without the workers it lost (one may die before it asks) and, once its first
            // round formed, without any that never joined: rounds and `--elastic-timeout` deal with them.
            let missing: Vec<u32> = match elastic {
                Some(_) if server.elastic_round().0 > 0 => Vec::new(),
                Some(_) => (0..size)
                    .filter(|r| {
                        !joined.contains(r)
                            && !lost.contains(r)
                            && workers.iter().any(|w| w.rank == *r && w.exited.is_none())
                    })
                    .collect(),
                None => (0..size).filter(|r| !joined.contains(r)).collect(),
            };
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
                    None if elastic.is_some() => signal_past_wrapper(w.pgid, signal, false),
                    None => signal_group(w.pgid, signal),
                }
            }
            // Survivors waiting below the minimum for a round are answered now, their SIGTERM pending.
            if let Some(server) = rendezvous {
                server.close_elastic_joins();
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
    // Every worker ended while the step was below its minimum, and none came back: it failed.
    if let (Some(min), Some(b)) = (elastic, below.as_ref())
        && !job.stopping()
        && !restart
    {
        all_ok = false;
        let alive = rendezvous.map_or(0, |s| s.elastic_alive() as u32);
        let reason = format!(
            "every worker of step `{}` ended while it was below its minimum of {min}; the last one lost was rank {} \
             ({})",
            step.name, b.rank, b.exit
        );
        restart |= below_minimum_for_good(job, this_attempt, b, (alive, min), reason);
    }
    match (all_ok, restart && !job.stopping()) {
        (true, _) => Outcome::Succeeded,
        (false, true) => Outcome::Restart,
        (false, false) => Outcome::Failed,
    }
}

/// An elastic step's workers on slots host discovery no longer lists: those asked to leave, and those that stay
/// because the step would fall below its minimum (said once each), by slot.
#[derive(Debug, Default)]
struct Removing {
    removing: std::collections::BTreeSet<u32>,
    kept: std::collections::BTreeSet<u32>,
}

/// Asks the live workers of an elastic step on slots host discovery no longer lists (`listed`: its hosts and their
/// slots) to leave at their next commit (SIGTERM: they hand over, as a preempted worker does), the highest slots of a
/// host first, never so many that fewer than `min` would be left (those stay, said once). `gone`: the workers being
/// stopped (left out of a round), and those already asked to leave.
fn remove_unlisted(
    job: &Job<'_>,
    step: &PlannedStep,
    workers: &mut [Worker],
    gone: (&[(usize, Instant)], &mut Removing),
    listed: &[(String, u32)],
    min: u32,
) {
    let (dropping, Removing { removing, kept }) = gone;
    let live: Vec<usize> = (0..workers.len())
        .filter(|i| {
            workers[*i].exited.is_none()
                && !dropping.iter().any(|(d, _)| d == i)
                && !removing.contains(&workers[*i].rank)
        })
        .collect();
    let mut spare = live.len().saturating_sub(min as usize);
    let mut hosts: Vec<String> = Vec::new();
    for i in &live {
        if !hosts.contains(&workers[*i].host) {
            hosts.push(workers[*i].host.clone());
        }
    }
    for host in hosts {
        let slots = listed
            .iter()
            .find(|(h, _)| *h == host)
            .map_or(0, |(_, n)| *n as usize);
        let mut here: Vec<usize> = live
            .iter()
            .copied()
            .filter(|i| workers[*i].host == host)
            .collect();
        // The highest slots (the newest workers) leave first.
        here.sort_by_key(|i| std::cmp::Reverse(workers[*i].rank));
        let excess = here.len().saturating_sub(slots);
        for &i in here.iter().take(excess) {
            if spare == 0 {
                if !kept.insert(workers[i].rank) {
                    break;
                }
                job.events.event(Event::Note {
                    text: format!(
                        "host discovery no longer lists the slot of rank {} of step `{}` on {host}, but it stays: \
                         fewer than the step's minimum of {min} would be left",
                        workers[i].rank, step.name
                    ),
                });
                break;
            }
            spare -= 1;
            let w = &mut workers[i];
            removing.insert(w.rank);
            job.events.event(Event::Note {
                text: format!(
                    "host discovery no longer lists the slot of rank {} of step `{}` on {host}: it leaves at its next \
                     commit (elastic)",
                    w.rank, step.name
                ),
            });
            preempt_worker(w, preempt_kill_after(step));
        }
    }
}

/// Signals a local worker's process group, except its leader when that is the `/bin/sh -c` wrapper of the rank's
/// command: the wrapper ends with the command (with its exit status) instead of dying first, which would end the
/// worker (its group is killed once the worker's process exits) before it unwinds. A group that is only the leader,
/// or led by anything else, gets the signal whole. With `rank_only` (a hand-over request) only the rank gets it: each
/// process of the group that is not a shell and whose parent is a shell of the group or outside it (past the `sh -c`
/// leader, and past a `bash` script's, which may wait for its child before it runs a trap); not the rank's own
/// children (a torch DataLoader's workers die of a SIGTERM, and their death would fail the rank before it commits).
fn signal_past_wrapper(pgid: u32, signal: i32, rank_only: bool) {
    let group: Vec<u32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| stat_field(pid, 2) == Some(pgid))
        .collect();
    let members: Vec<u32> = match rank_only {
        true => group
            .iter()
            .copied()
            .filter(|&pid| {
                !is_shell(pid)
                    && stat_field(pid, 1)
                        .is_none_or(|parent| !group.contains(&parent) || is_shell(parent))
            })
            .collect(),
        false if is_shell(pgid) => group.iter().copied().filter(|&pid| pid != pgid).collect(),
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

/// Whether process `pid` runs a shell (`sh`, `dash`, `bash`, `ash`, `ksh`, `mksh`, `zsh`, `busybox`): a leader a
/// signal meant for the rank must get past.
fn is_shell(pid: u32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| {
        exe.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
            matches!(
                n,
                "sh" | "dash" | "bash" | "ash" | "ksh" | "mksh" | "zsh" | "busybox"
            )
        })
    })
}

/// Field `n` after the command name of `/proc/PID/stat` (0: the state, 1: the parent's pid, 2: the process
/// group), `None` when the process is gone.
fn stat_field(pid: u32, n: usize) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: the fields after it follow the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(n)?.parse().ok()
}

/// How many workers an attempt has started so far (an elastic step's discovery may add some).
fn workers_started(workers: &[Worker]) -> usize {
    workers.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_discovery_starts_at_most_eight_workers_per_slot_of_the_maximum_in_an_attempt() {
        let mut starts = Starts::new(2);
        for _ in 0..16 {
            assert_eq!(starts.take(), Ok(()));
        }
        assert_eq!(starts.take(), Err(16));
        assert_eq!(starts.take(), Err(16));
        // A step without slots still has one's worth.
        let mut starts = Starts::new(0);
        assert_eq!((0..9).filter(|_| starts.take().is_ok()).count(), 8);
    }

    #[test]
    fn failed_starts_wait_a_growing_interval_before_the_next_try() {
        let t = Instant::now();
        let mut b = SpawnBackoff::default();
        assert!(b.ready(t));
        assert_eq!(b.failed(t), crate::discovery::INTERVAL);
        assert!(!b.ready(t));
        assert!(b.ready(t + crate::discovery::INTERVAL));
        assert_eq!(b.failed(t), crate::discovery::INTERVAL * 2);
        assert_eq!(b.failed(t), crate::discovery::INTERVAL * 4);
        for _ in 0..20 {
            b.failed(t);
        }
        assert_eq!(b.failed(t), SPAWN_BACKOFF_MAX);
        b.started();
        assert!(b.ready(t));
        assert_eq!(b.failed(t), crate::discovery::INTERVAL);
    }
}
