//! Where an elastic step's workers may run under host discovery: the hosts the script found, merged by name, less the
//! blacklisted ones; on an engine that reaches other hosts (ssh), a host it was not started with is used once the
//! engine has made it ready (its host check and delivery, on a thread of its own), and is named and skipped when it
//! cannot be.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use super::Job;
use crate::LaunchError;
use crate::discovery::{Blacklist, HostSlots, is_this_machine};
use crate::engine::{Plan, PlannedStep, SupervisedEngine};
use crate::env::Slot;
use crate::report::Event;

/// Whether a host the script found can take workers.
enum Reach {
    Ready,
    /// The engine is making it ready, on a thread of its own.
    Pending(mpsc::Receiver<Result<(), LaunchError>>),
    /// It could not be made ready (named in a warning); skipped for the rest of the attempt.
    Failed,
}

/// The hosts of one attempt of an elastic step with host discovery.
pub(super) struct Hosts {
    /// This machine, as the step's layout names it (the local engine runs every worker here).
    here: String,
    engine: Arc<dyn SupervisedEngine>,
    plan: Plan,
    reach: BTreeMap<String, Reach>,
    /// Hosts the local engine ignores (named once).
    ignored: BTreeSet<String>,
}

impl Hosts {
    pub(super) fn new(plan: &Plan, step: &PlannedStep) -> Hosts {
        Hosts {
            here: step
                .layout
                .slots
                .first()
                .map_or_else(String::new, |s| s.host.clone()),
            engine: plan.engine.clone(),
            plan: plan.clone(),
            reach: BTreeMap::new(),
            ignored: BTreeSet::new(),
        }
    }

    /// This machine's name for the blacklist.
    pub(super) fn here(&self) -> &str {
        &self.here
    }

    /// The hosts of `found` (one run of the script) that can take workers now, with their slots, in the script's
    /// order: on the local engine this machine alone (its names merged; other hosts named once and ignored), on an
    /// engine that reaches other hosts each ready host by name. A host not seen before is made ready first: with
    /// `wait`, here, to the end; else on a thread of its own, and it counts from a later call on. Blacklisted hosts
    /// count for nothing.
    pub(super) fn usable(
        &mut self,
        job: &Job<'_>,
        step: &PlannedStep,
        found: &[HostSlots],
        blacklist: &Blacklist,
        wait: bool,
    ) -> Vec<(String, u32)> {
        let now = Instant::now();
        let remote = self.engine.remote_hosts();
        let mut usable: Vec<(String, u32)> = Vec::new();
        for h in found {
            let host = match (remote, is_this_machine(&h.host, &self.here)) {
                (false, true) => self.here.clone(),
                (false, false) => {
                    if self.ignored.insert(h.host.clone()) {
                        job.events.event(Event::Note {
                            text: format!(
                                "warning: host discovery found host `{}` for step `{}`, but the {} runs every \
                                 worker on this machine ({}); ignored",
                                h.host,
                                step.name,
                                self.engine.name(),
                                self.here
                            ),
                        });
                    }
                    continue;
                }
                (true, _) => h.host.clone(),
            };
            if blacklist.blocked(&h.host, now) || !self.ready(job, step, &host, wait) {
                continue;
            }
            match usable.iter_mut().find(|(u, _)| *u == host) {
                Some((_, n)) => *n = n.saturating_add(h.slots),
                None => usable.push((host, h.slots)),
            }
        }
        usable
    }

    /// Whether `host` is ready for workers; starts making it ready when it is new (see [`Hosts::usable`]).
    fn ready(&mut self, job: &Job<'_>, step: &PlannedStep, host: &str, wait: bool) -> bool {
        if !self.engine.remote_hosts() {
            return true;
        }
        let reach = self.reach.remove(host).unwrap_or_else(|| {
            let (tx, rx) = mpsc::channel();
            let (engine, plan, name) = (self.engine.clone(), self.plan.clone(), host.to_owned());
            let work = move || {
                let _ = tx.send(engine.reach_host(&plan, &name));
            };
            match wait {
                true => work(),
                false => {
                    let spawned = std::thread::Builder::new()
                        .name("hvd-reach-host".into())
                        .spawn(work);
                    if let Err(e) = spawned {
                        let (tx, rx) = mpsc::channel();
                        let _ = tx.send(Err(LaunchError::Engine(format!(
                            "no thread to check it: {e}"
                        ))));
                        return Reach::Pending(rx);
                    }
                }
            }
            Reach::Pending(rx)
        });
        let reach = match reach {
            Reach::Pending(rx) => match rx.try_recv() {
                Ok(Ok(())) => Reach::Ready,
                Ok(Err(e)) => {
                    job.events.event(Event::Note {
                        text: format!(
                            "warning: host discovery found host `{host}` for step `{}`, but it cannot run workers: \
                             {e}; skipped",
                            step.name
                        ),
                    });
                    Reach::Failed
                }
                Err(mpsc::TryRecvError::Empty) => Reach::Pending(rx),
                Err(mpsc::TryRecvError::Disconnected) => Reach::Failed,
            },
            other => other,
        };
        let ready = matches!(reach, Reach::Ready);
        self.reach.insert(host.to_owned(), reach);
        ready
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
        if self.engine.remote_hosts() {
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
