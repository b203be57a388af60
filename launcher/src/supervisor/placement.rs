//! Where an elastic step's workers may run under host discovery: the hosts the script found, merged by name, less the
//! blacklisted ones; on an engine that reaches other hosts (ssh), a host it was not started with is used once the
//! engine has made it ready (its host check and delivery, on a thread of its own), and is named and skipped when it
//! cannot be.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use super::Job;
use crate::LaunchError;
use crate::discovery::{Blacklist, HostSlots, is_this_machine};
use crate::engine::{Plan, PlannedStep};
use crate::env::Slot;
use crate::report::Event;

/// How many hosts the engine makes ready at once (each a thread, and an ssh connection or more).
const IN_FLIGHT: usize = 8;
/// How many distinct hosts one attempt considers: this many per slot of the step's maximum, at least
/// [`HOSTS_AT_LEAST`]; the script's hosts past them are ignored (named in a warning, once).
const HOSTS_PER_SLOT: usize = 4;
const HOSTS_AT_LEAST: usize = 64;

/// Whether a host the script found can take workers.
enum Reach {
    /// Not started yet: [`IN_FLIGHT`] hosts were being made ready.
    Queued,
    /// The engine is making it ready, on a thread of its own.
    Pending(mpsc::Receiver<Result<(), LaunchError>>),
    Ready,
    /// It could not be made ready (named in a warning); skipped for the rest of the attempt.
    Failed,
}

/// The engine's [`crate::engine::SupervisedEngine::reach_host`] for the step's plan.
type ReachHost = Arc<dyn Fn(&str) -> Result<(), LaunchError> + Send + Sync>;

/// The hosts of one attempt of an elastic step with host discovery.
pub(super) struct Hosts {
    /// This machine, as the step's layout names it (the local engine runs every worker here).
    here: String,
    /// Whether the engine reaches other hosts (and makes each ready first).
    remote: bool,
    engine_name: &'static str,
    reach_host: ReachHost,
    /// Whether `reach_host` answers at once (called inline, not on a thread).
    at_once: bool,
    /// Every host considered so far, at most `limit`.
    reach: BTreeMap<String, Reach>,
    /// With host discovery, [`HOSTS_PER_SLOT`] per slot of the step's maximum, at least [`HOSTS_AT_LEAST`]; without
    /// (replacements on the engine's own hosts, e.g. a Slurm allocation's nodes), no limit: the list is the user's.
    limit: usize,
    /// Whether the warning about hosts past `limit` was given.
    capped: bool,
    /// Hosts the local engine ignores (named once).
    ignored: BTreeSet<String>,
    /// Where lost workers are replaced without host discovery, and how many live workers each may hold.
    own: Vec<HostSlots>,
}

impl Hosts {
    /// The hosts of `step` of `plan`; `discovery`: they come from a host discovery script (hostile input, capped).
    pub(super) fn new(plan: &Plan, step: &PlannedStep, discovery: bool) -> Hosts {
        let (engine, plan, growing) = (plan.engine.clone(), plan.clone(), step.clone());
        let own = match engine.replacement_hosts() {
            Some(hosts) => hosts
                .into_iter()
                .map(|(host, slots)| HostSlots { host, slots })
                .collect(),
            None => Hosts::own(step),
        };
        let at_once = engine.reaches_at_once();
        let hosts = Hosts::with(
            step.layout
                .slots
                .first()
                .map_or_else(String::new, |s| s.host.clone()),
            engine.remote_hosts(),
            engine.name(),
            Arc::new(move |host: &str| engine.reach_host(&plan, &growing, host)),
            step.layout.slots.len(),
        );
        Hosts { own, ..hosts }.sourced(discovery, at_once)
    }

    /// These hosts from a discovery script (`discovery`: capped at `limit`, with a warning past it) or the engine's
    /// own (no cap); `at_once`: the engine's `reach_host` is a look-up, called inline.
    fn sourced(self, discovery: bool, at_once: bool) -> Hosts {
        Hosts {
            at_once,
            limit: if discovery { self.limit } else { usize::MAX },
            ..self
        }
    }

    /// [`Hosts::new`] from its parts: a step of at most `max` workers.
    fn with(
        here: String,
        remote: bool,
        engine_name: &'static str,
        reach_host: ReachHost,
        max: usize,
    ) -> Hosts {
        Hosts {
            here,
            remote,
            engine_name,
            reach_host,
            at_once: false,
            reach: BTreeMap::new(),
            limit: max.saturating_mul(HOSTS_PER_SLOT).max(HOSTS_AT_LEAST),
            capped: false,
            ignored: BTreeSet::new(),
            own: Vec::new(),
        }
    }

    /// This machine's name for the blacklist.
    pub(super) fn here(&self) -> &str {
        &self.here
    }

    /// The hosts of `found` (one run of the script) that can take workers now, with their slots, in the script's
    /// order: on the local engine this machine alone (its names merged; other hosts named once and ignored), on an
    /// engine that reaches other hosts each ready host by name. A host not seen before is made ready first, on a
    /// thread of its own, [`IN_FLIGHT`] at a time (the others queued), and counts from a later call on; with `wait`,
    /// this call waits for this run's hosts until that deadline (or the job stops), and a host not ready by then
    /// counts from a later call on. Blacklisted hosts count for nothing.
    pub(super) fn usable(
        &mut self,
        job: &Job<'_>,
        step: &PlannedStep,
        found: &[HostSlots],
        blacklist: &Blacklist,
        wait: Option<Instant>,
    ) -> Vec<(String, u32)> {
        let mut notes = Vec::new();
        let give_up = || job.stopping() || job.interrupts.get().0 > 0;
        let usable = self.usable_noting(&step.name, found, blacklist, wait, &give_up, &mut notes);
        for text in notes {
            job.events.event(Event::Note { text });
        }
        usable
    }

    /// [`Hosts::usable`], its warnings added to `notes`; `give_up`: whether to stop waiting.
    fn usable_noting(
        &mut self,
        step: &str,
        found: &[HostSlots],
        blacklist: &Blacklist,
        wait: Option<Instant>,
        give_up: &dyn Fn() -> bool,
        notes: &mut Vec<String>,
    ) -> Vec<(String, u32)> {
        let now = Instant::now();
        let mut named: Vec<(String, u32)> = Vec::new();
        for h in found {
            let host = match (self.remote, is_this_machine(&h.host, &self.here)) {
                (false, true) => self.here.clone(),
                (false, false) => {
                    if self.ignored.insert(h.host.clone()) {
                        notes.push(format!(
                            "warning: host discovery found host `{}` for step `{step}`, but the {} runs every \
                             worker on this machine ({}); ignored",
                            h.host, self.engine_name, self.here
                        ));
                    }
                    continue;
                }
                (true, _) => h.host.clone(),
            };
            if !blacklist.blocked(&h.host, now) {
                named.push((host, h.slots));
            }
        }
        if self.remote {
            for (host, _) in &named {
                self.consider(step, host, notes);
            }
            loop {
                self.settle(step, notes);
                self.start_queued(step, &named, notes);
                if self.at_once {
                    self.settle(step, notes);
                }
                let settled = named.iter().all(|(h, _)| {
                    !matches!(self.reach.get(h), Some(Reach::Queued | Reach::Pending(_)))
                });
                match wait {
                    Some(deadline) if !settled && Instant::now() < deadline && !give_up() => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    _ => break,
                }
            }
        }
        let mut usable: Vec<(String, u32)> = Vec::new();
        for (host, slots) in named {
            if self.remote && !matches!(self.reach.get(&host), Some(Reach::Ready)) {
                continue;
            }
            match usable.iter_mut().find(|(u, _)| *u == host) {
                Some((_, n)) => *n = n.saturating_add(slots),
                None => usable.push((host, slots)),
            }
        }
        usable
    }

    /// Queues `host` to be made ready when it is new, unless the attempt has considered its limit of hosts already.
    fn consider(&mut self, step: &str, host: &str, notes: &mut Vec<String>) {
        if self.reach.contains_key(host) {
            return;
        }
        if self.reach.len() >= self.limit {
            if !self.capped {
                self.capped = true;
                notes.push(format!(
                    "warning: host discovery found more than {} distinct hosts for step `{step}` ({HOSTS_PER_SLOT} \
                     per slot of its maximum, at least {HOSTS_AT_LEAST}); the others (`{host}` first) are ignored",
                    self.limit
                ));
            }
            return;
        }
        self.reach.insert(host.to_owned(), Reach::Queued);
    }

    /// Takes in the hosts whose making ready has ended.
    fn settle(&mut self, step: &str, notes: &mut Vec<String>) {
        for (host, reach) in self.reach.iter_mut() {
            let Reach::Pending(rx) = reach else { continue };
            *reach = match rx.try_recv() {
                Ok(Ok(())) => Reach::Ready,
                Ok(Err(e)) => {
                    notes.push(format!(
                        "warning: host discovery found host `{host}` for step `{step}`, but it cannot run workers: \
                         {e}; skipped"
                    ));
                    Reach::Failed
                }
                Err(mpsc::TryRecvError::Empty) => continue,
                Err(mpsc::TryRecvError::Disconnected) => Reach::Failed,
            };
        }
    }

    /// Starts making ready the queued hosts of `named`, in its order, up to [`IN_FLIGHT`] at a time.
    fn start_queued(&mut self, step: &str, named: &[(String, u32)], notes: &mut Vec<String>) {
        let mut in_flight = self
            .reach
            .values()
            .filter(|r| matches!(r, Reach::Pending(_)))
            .count();
        for (host, _) in named {
            if in_flight >= IN_FLIGHT {
                return;
            }
            let Some(reach) = self.reach.get_mut(host) else {
                continue;
            };
            if !matches!(reach, Reach::Queued) {
                continue;
            }
            if self.at_once {
                // A look-up (a Slurm allocation's nodes): no thread, settled now.
                let (tx, rx) = mpsc::channel();
                let _ = tx.send((self.reach_host)(host));
                *reach = Reach::Pending(rx);
                continue;
            }
            let (tx, rx) = mpsc::channel();
            let (reach_host, name) = (self.reach_host.clone(), host.clone());
            let spawned = std::thread::Builder::new()
                .name("hvd-reach-host".into())
                .spawn(move || {
                    let _ = tx.send(reach_host(&name));
                });
            *reach = match spawned {
                Ok(_) => {
                    in_flight += 1;
                    Reach::Pending(rx)
                }
                Err(e) => {
                    notes.push(format!(
                        "warning: host discovery found host `{host}` for step `{step}`, but it cannot run workers: \
                         no thread to check it: {e}; skipped"
                    ));
                    Reach::Failed
                }
            };
        }
    }

    /// The slots each host has in `found` (one run of the script), merged by name as [`Hosts::usable`] merges them,
    /// blacklisted hosts and hosts not ready yet included: what the script still lists, for removing the workers on
    /// slots it no longer does. The local engine's other hosts are left out (they run nothing).
    pub(super) fn listed(&self, found: &[HostSlots]) -> Vec<(String, u32)> {
        let mut listed: Vec<(String, u32)> = Vec::new();
        for h in found {
            let host = match (self.remote, is_this_machine(&h.host, &self.here)) {
                (false, true) => self.here.clone(),
                (false, false) => continue,
                (true, _) => h.host.clone(),
            };
            match listed.iter_mut().find(|(l, _)| *l == host) {
                Some((_, n)) => *n = n.saturating_add(h.slots),
                None => listed.push((host, h.slots)),
            }
        }
        listed
    }

    /// Where the engine replaces lost workers without host discovery, with how many live workers each host may
    /// hold: [`Hosts::own`], or the engine's own hosts ([`crate::engine::SupervisedEngine::replacement_hosts`]).
    pub(super) fn replacement_hosts(&self) -> &[HostSlots] {
        &self.own
    }

    /// The step's own hosts and their slots (its layout, in order): where replacements run without host discovery.
    pub(super) fn own(step: &PlannedStep) -> Vec<HostSlots> {
        let mut own: Vec<HostSlots> = Vec::new();
        for slot in &step.layout.slots {
            match own.iter_mut().find(|h| h.host == slot.host) {
                Some(h) => h.slots += 1,
                None => own.push(HostSlots {
                    host: slot.host.clone(),
                    slots: 1,
                }),
            }
        }
        own
    }

    /// The hosts of up to `want` more workers: each usable host filled up to its slots, counting the live workers
    /// there (`live`: their hosts), in the script's order.
    pub(super) fn place(usable: &[(String, u32)], live: &[&str], want: usize) -> Vec<String> {
        let mut placed: Vec<String> = Vec::new();
        for (host, slots) in usable {
            let taken = live.iter().filter(|h| **h == host.as_str()).count();
            for _ in taken..*slots as usize {
                if placed.len() >= want {
                    return placed;
                }
                placed.push(host.clone());
            }
        }
        placed
    }

    /// The local rank for one more worker on `host`: the smallest that no live worker there holds (`live`: their
    /// hosts and local ranks). A lost worker leaves a gap, and its replacement takes it: a count of the live ones
    /// would give a live worker's local rank, so its GPU (`CUDA_VISIBLE_DEVICES`, NCCL's device) to a second one.
    pub(super) fn free_local_rank(live: &[(&str, u32)], host: &str) -> u32 {
        let held: BTreeSet<u32> = live
            .iter()
            .filter(|(h, _)| *h == host)
            .map(|(_, l)| *l)
            .collect();
        // Of the first `held.len() + 1` local ranks one is free.
        (0..=held.len() as u32)
            .find(|l| !held.contains(l))
            .unwrap_or(held.len() as u32)
    }

    /// Slot `rank` of `step` on `host`, with local rank `local` there (see [`Hosts::free_local_rank`]): the layout's
    /// slot, with the host and its cross numbers as host discovery found them when the engine reaches other hosts.
    pub(super) fn slot_on(
        &self,
        step: &PlannedStep,
        rank: u32,
        host: &str,
        usable: &[(String, u32)],
        local: u32,
    ) -> Slot {
        // A replacement past the step's size: `HVD_SIZE` reaches to it (`HVD_RANK` must be below it), with this
        // machine's numbers until the engine's own below.
        let mut slot = step
            .layout
            .slots
            .get(rank as usize)
            .cloned()
            .unwrap_or_else(|| Slot {
                rank,
                size: rank + 1,
                host: self.here.clone(),
                local_rank: local,
                local_size: local + 1,
                cross_rank: 0,
                cross_size: 1,
            });
        slot.local_rank = local;
        slot.local_size = slot.local_size.max(local + 1);
        if self.remote {
            slot.host = host.to_owned();
            slot.local_size = usable
                .iter()
                .find(|(h, _)| h == host)
                .map_or(1, |(_, n)| (*n).max(local + 1));
            slot.cross_rank = usable.iter().position(|(h, _)| h == host).unwrap_or(0) as u32;
            slot.cross_size = usable.len().max(1) as u32;
        }
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A stand-in for the engine's host check: counts the checks running at once (and the most so far), and holds
    /// each until `open`; hosts named `bad*` then fail.
    #[derive(Default)]
    struct Gate {
        running: AtomicUsize,
        most: AtomicUsize,
        open: AtomicBool,
    }

    fn gated(gate: &Arc<Gate>) -> ReachHost {
        let gate = gate.clone();
        Arc::new(move |host: &str| {
            let now = gate.running.fetch_add(1, Ordering::SeqCst) + 1;
            gate.most.fetch_max(now, Ordering::SeqCst);
            while !gate.open.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
            gate.running.fetch_sub(1, Ordering::SeqCst);
            match host.starts_with("bad") {
                true => Err(LaunchError::Engine("unreachable".into())),
                false => Ok(()),
            }
        })
    }

    fn found(hosts: impl IntoIterator<Item = String>) -> Vec<HostSlots> {
        hosts
            .into_iter()
            .map(|host| HostSlots { host, slots: 1 })
            .collect()
    }

    /// Calls `usable` until `done` holds of its answer (at most 30 s).
    fn until(
        hosts: &mut Hosts,
        found: &[HostSlots],
        notes: &mut Vec<String>,
        done: impl Fn(&[(String, u32)]) -> bool,
    ) -> Vec<(String, u32)> {
        let bl = Blacklist::new("here");
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let usable = hosts.usable_noting("train", found, &bl, None, &|| false, notes);
            if done(&usable) || Instant::now() > end {
                return usable;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn at_most_eight_hosts_are_checked_at_once_the_others_wait_their_turn() {
        let gate = Arc::new(Gate::default());
        let mut hosts = Hosts::with("here".into(), true, "ssh engine", gated(&gate), 4);
        let found = found((0..20).map(|i| format!("h{i}")));
        let mut notes = Vec::new();
        let bl = Blacklist::new("here");
        // Found twice while every check is held: 8 run, none more.
        for _ in 0..2 {
            let usable = hosts.usable_noting("train", &found, &bl, None, &|| false, &mut notes);
            assert!(usable.is_empty());
        }
        let end = Instant::now() + Duration::from_secs(30);
        while gate.running.load(Ordering::SeqCst) < IN_FLIGHT && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(gate.running.load(Ordering::SeqCst), IN_FLIGHT);
        gate.open.store(true, Ordering::SeqCst);
        let usable = until(&mut hosts, &found, &mut notes, |u| u.len() == 20);
        assert_eq!(usable.len(), 20, "{usable:?}");
        assert_eq!(gate.most.load(Ordering::SeqCst), IN_FLIGHT);
        assert!(notes.is_empty(), "{notes:?}");
    }

    #[test]
    fn hosts_past_the_limit_are_ignored_with_one_warning() {
        let gate = Arc::new(Gate::default());
        gate.open.store(true, Ordering::SeqCst);
        // A step of at most 2 workers considers 64 hosts (4 per slot, at least 64); of 100, 36 are ignored.
        let mut hosts = Hosts::with("here".into(), true, "ssh engine", gated(&gate), 2);
        let found = found((0..100).map(|i| format!("h{i:03}")));
        let mut notes = Vec::new();
        let usable = until(&mut hosts, &found, &mut notes, |u| u.len() >= 64);
        assert_eq!(usable.len(), 64, "{usable:?}");
        assert_eq!(usable[63].0, "h063");
        let more = until(&mut hosts, &found, &mut notes, |_| true);
        assert_eq!(more.len(), 64);
        assert_eq!(hosts.reach.len(), 64);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("more than 64 distinct hosts for step `train`")
                && notes[0].contains("(`h064` first) are ignored"),
            "{notes:?}"
        );
        // A larger step considers more.
        let hosts = Hosts::with("here".into(), true, "ssh engine", gated(&gate), 40);
        assert_eq!(hosts.limit, 160);
    }

    /// Replacement hosts without host discovery (a 128-node Slurm allocation) are not capped and draw no discovery
    /// warning; an engine whose reach_host is a look-up answers inline, so every host is usable on the first call.
    #[test]
    fn an_engines_own_hosts_are_not_capped_and_a_look_up_needs_no_thread() {
        let caller = std::thread::current().id();
        let elsewhere = Arc::new(AtomicUsize::new(0));
        let counted = elsewhere.clone();
        let reach: ReachHost = Arc::new(move |_: &str| {
            if std::thread::current().id() != caller {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            Ok(())
        });
        let mut hosts =
            Hosts::with("n000".into(), true, "slurm engine", reach, 2).sourced(false, true);
        let nodes = found((0..128).map(|i| format!("n{i:03}")));
        let mut notes = Vec::new();
        let bl = Blacklist::new("n000");
        let usable = hosts.usable_noting("train", &nodes, &bl, None, &|| false, &mut notes);
        assert_eq!(usable.len(), 128, "{usable:?}");
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(elsewhere.load(Ordering::SeqCst), 0);
        // The same hosts from a discovery script are capped, with the warning.
        let gate = Arc::new(Gate::default());
        gate.open.store(true, Ordering::SeqCst);
        let mut hosts =
            Hosts::with("here".into(), true, "ssh engine", gated(&gate), 2).sourced(true, false);
        let usable = until(&mut hosts, &nodes, &mut notes, |u| u.len() >= 64);
        assert_eq!(usable.len(), 64);
        assert!(
            notes
                .iter()
                .any(|n| n.contains("more than 64 distinct hosts")),
            "{notes:?}"
        );
    }

    /// The first run's hosts are checked at once, not one after another, and waited for until the deadline only:
    /// hosts whose check hangs leave the others usable.
    #[test]
    fn the_first_runs_hosts_are_checked_at_once_until_the_deadline() {
        let gate = Arc::new(Gate::default());
        let hang = gate.clone();
        let reach: ReachHost = Arc::new(move |host: &str| match host.starts_with("hang") {
            true => gated(&hang)(host),
            false => Ok(()),
        });
        let mut hosts = Hosts::with("here".into(), true, "ssh engine", reach, 4);
        let found = found(["hang1", "hang2", "hang3", "a", "b"].map(String::from));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut notes = Vec::new();
            let deadline = Instant::now() + Duration::from_millis(500);
            let bl = Blacklist::new("here");
            let usable =
                hosts.usable_noting("train", &found, &bl, Some(deadline), &|| false, &mut notes);
            let _ = tx.send(usable);
        });
        // Checked one after another, the first would never end.
        let usable = rx.recv_timeout(Duration::from_secs(30));
        // All three hanging checks run at once (each is held until the gate opens).
        let end = Instant::now() + Duration::from_secs(30);
        while gate.running.load(Ordering::SeqCst) < 3 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        gate.open.store(true, Ordering::SeqCst);
        let usable = usable.expect("the first run waited past its deadline");
        assert_eq!(usable, [("a".to_owned(), 1), ("b".to_owned(), 1)]);
        assert_eq!(gate.most.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn workers_fill_each_host_up_to_its_slots_in_the_scripts_order() {
        let usable = vec![("a".to_owned(), 2), ("b".to_owned(), 2)];
        assert_eq!(Hosts::place(&usable, &[], 3), ["a", "a", "b"]);
        assert_eq!(Hosts::place(&usable, &["a"], 4), ["a", "b", "b"]);
        assert_eq!(Hosts::place(&usable, &["a", "a", "b"], 4), ["b"]);
        assert_eq!(
            Hosts::place(&usable, &["a", "a", "b", "b"], 4),
            Vec::<String>::new()
        );
        // Workers on a host the script no longer names take no slot of another.
        assert_eq!(Hosts::place(&usable, &["c", "c"], 1), ["a"]);
    }

    #[test]
    fn a_replacement_takes_the_smallest_local_rank_no_live_worker_holds() {
        // Local ranks 0 and 1 on `a`; 0 died: its replacement takes 0, not 1 (a count of the live ones), which the
        // live worker's GPU is.
        assert_eq!(Hosts::free_local_rank(&[("a", 1)], "a"), 0);
        // Local ranks 0-3, 1 died.
        assert_eq!(
            Hosts::free_local_rank(&[("a", 0), ("a", 2), ("a", 3)], "a"),
            1
        );
        // Other hosts' workers hold nothing here; no gap: the next one.
        assert_eq!(Hosts::free_local_rank(&[("b", 0), ("a", 0)], "a"), 1);
        assert_eq!(Hosts::free_local_rank(&[("b", 0)], "a"), 0);
        assert_eq!(Hosts::free_local_rank(&[("a", 1), ("a", 0)], "a"), 2);
    }
}
