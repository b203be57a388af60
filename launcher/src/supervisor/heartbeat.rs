//! Heartbeats of an elastic step's workers (docs/running.md, Elastic steps): a worker whose process is alive to the
//! OS but frozen (stopped, a hung or partitioned node: its srun or ssh does not end) stops beating, and once it has
//! been silent for `HVD_HEARTBEAT_TIMEOUT` the launcher counts it lost and stops it, like a worker left out of a round.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use super::{Job, Worker};
use crate::LaunchError;
use crate::engine::{PlannedStep, SupervisedEngine};
use crate::rendezvous::RendezvousServer;
use crate::report::Event;

/// `HVD_HEARTBEAT_TIMEOUT` of `step` (the step's, else this process's; default 10 s, from 1 s to a day), which
/// `hvd run` sets for the step's workers so that they beat often enough.
pub(super) fn timeout(step: &PlannedStep) -> Result<Duration, LaunchError> {
    let name = hvd_collective::env_vars::HVD_HEARTBEAT_TIMEOUT;
    let value = step
        .env
        .get(name)
        .cloned()
        .or_else(|| std::env::var(name).ok());
    hvd_collective::liveness::timeout_from(value.as_deref())
        .map_err(|e| LaunchError::Engine(format!("step `{}`: {e}", step.name)))
}

/// How long the launcher gives a host to answer when every worker went quiet at once (at most the heartbeat timeout).
const PROBE_WITHIN: Duration = Duration::from_secs(30);

/// How many of their hosts it asks at once (a thousand hosts are not a thousand ssh at once).
const PROBED_HOSTS: usize = 8;

/// The workers of an elastic step found silent so far, and when a worker on each host was last found silent; while
/// every worker is quiet at once, whether the launcher reaches their hosts.
pub(super) struct Silent {
    slots: BTreeSet<u32>,
    hosts: BTreeMap<String, Instant>,
    engine: Arc<dyn SupervisedEngine>,
    /// While every worker is quiet at once: the launcher looking whether it reaches their hosts.
    probe: Option<Probe>,
    /// Probes started in the present stretch of silence (the hosts not reached are named after the first only).
    probes: u32,
    /// The hosts the stretch's latest probe did not reach, and when they are asked again: a host slow to answer
    /// then (an overloaded node, a network back a moment later) whose workers stay frozen is found on a later look.
    again: Option<(Instant, Vec<String>)>,
}

/// The hosts' answers (each host once: whether it was reached, `None` when the engine cannot look), how many are
/// still to come, the hosts not reached so far, and how long each host is given.
struct Probe {
    answers: mpsc::Receiver<(String, Option<bool>)>,
    left: usize,
    unreached: Vec<String>,
    within: Duration,
}

impl Silent {
    /// Nothing found yet; `engine` reaches the workers' hosts.
    pub(super) fn new(engine: Arc<dyn SupervisedEngine>) -> Silent {
        Silent {
            slots: BTreeSet::new(),
            hosts: BTreeMap::new(),
            engine,
            probe: None,
            probes: 0,
            again: None,
        }
    }

    /// Asks the engine whether the launcher reaches each of the distinct `hosts` within `within`, on up to
    /// [`PROBED_HOSTS`] threads at once.
    fn probe(&mut self, hosts: impl IntoIterator<Item = String>, within: Duration) {
        let hosts: BTreeSet<String> = hosts.into_iter().collect();
        let count = hosts.len();
        let queue = Arc::new(std::sync::Mutex::new(hosts.into_iter().collect::<Vec<_>>()));
        let (answer, answers) = mpsc::channel();
        for _ in 0..count.min(PROBED_HOSTS) {
            let (engine, answer, queue) = (self.engine.clone(), answer.clone(), queue.clone());
            std::thread::spawn(move || {
                loop {
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
                    let Some(host) = next else { break };
                    let reached = engine.probe_host(&host, within);
                    if answer.send((host, reached)).is_err() {
                        break;
                    }
                }
            });
        }
        self.probe = Some(Probe {
            answers,
            left: count,
            unreached: Vec::new(),
            within,
        });
        self.probes += 1;
    }

    /// The hosts to ask again now (the ones the latest probe of the stretch did not reach), once `again` has come
    /// and no probe is under way; none once the stretch is over (`stretch` false: a worker was heard).
    fn due(&mut self, now: Instant, stretch: bool) -> Option<Vec<String>> {
        if !stretch {
            self.again = None;
            return None;
        }
        match &self.again {
            Some((at, _)) if *at <= now && self.probe.is_none() => {
                self.again.take().map(|(_, h)| h)
            }
            _ => None,
        }
    }

    /// The hosts' answers since the last look (each host once: whether the launcher reached it), and, once every
    /// host has answered, the hosts it could not reach (none when the engine cannot look), which are then asked
    /// again `within` later ([`Silent::due`]).
    fn answers(&mut self) -> (Vec<(String, bool)>, Option<Vec<String>>) {
        let Some(probe) = self.probe.as_mut() else {
            return (Vec::new(), None);
        };
        let mut came = Vec::new();
        while let Ok((host, reached)) = probe.answers.try_recv() {
            probe.left -= 1;
            match reached {
                Some(true) => came.push((host, true)),
                Some(false) => {
                    probe.unreached.push(host.clone());
                    came.push((host, false));
                }
                None => {}
            }
        }
        if probe.left > 0 {
            return (came, None);
        }
        let unreached = std::mem::take(&mut probe.unreached);
        if !unreached.is_empty() {
            self.again = Some((Instant::now() + probe.within, unreached.clone()));
        }
        self.probe = None;
        (came, Some(unreached))
    }

    /// Whether worker `slot` was found silent.
    pub(super) fn contains(&self, slot: &u32) -> bool {
        self.slots.contains(slot)
    }

    /// `usable` (hosts and their slots) less the hosts where a worker was found silent within the last `timeout`:
    /// the host's other workers, frozen with it, went silent at most a heartbeat interval later and are found in
    /// that time; until then the host's charges may not have reached the blacklist's threshold, and a worker found
    /// silent first may already have exited (stopped after `--grace`) and freed its place there.
    pub(super) fn placeable(
        &self,
        usable: Vec<(String, u32)>,
        now: Instant,
        timeout: Duration,
    ) -> Vec<(String, u32)> {
        usable
            .into_iter()
            .filter(|(host, _)| {
                self.hosts
                    .get(host)
                    .is_none_or(|at| now.saturating_duration_since(*at) >= timeout)
            })
            .collect()
    }
}

/// Finds the live workers of an elastic step silent for `timeout` since their last heartbeat and says so; the
/// membership counts them gone (the caller stops them as workers a round formed without, and counts them lost).
/// `silent` collects every worker found so far, and when each host last had one found.
pub(super) fn find_silent(
    job: &Job<'_>,
    step: &PlannedStep,
    server: &RendezvousServer,
    workers: &[Worker],
    timeout: Duration,
    silent: &mut Silent,
) {
    // A worker whose process exited is judged by its exit, reported once its output is drained (up to `--grace`,
    // as long as the default timeout): not found silent in the meantime, and counted lost when it may have finished.
    for w in workers.iter().filter(|w| w.exited.is_none()) {
        if w.process_gone.load(Ordering::Acquire) {
            server.elastic_exited(w.rank);
        }
    }
    let found = server.elastic_silence(timeout);
    if found.cut_off {
        job.events.event(Event::Note {
            text: format!(
                "warning: no worker of step `{}` has sent a heartbeat for {} s ({}): the launcher may be cut off \
                 from them (its network), or they all froze at once; none is counted lost until one is heard again \
                 or the launcher reaches one of their hosts",
                step.name,
                timeout.as_secs_f64(),
                hvd_collective::env_vars::HVD_HEARTBEAT_TIMEOUT,
            ),
        });
        let hosts = workers
            .iter()
            .filter(|w| w.exited.is_none() && !silent.slots.contains(&w.rank))
            .map(|w| w.host.clone())
            .collect::<Vec<_>>();
        silent.probes = 0;
        silent.again = None;
        silent.probe(hosts, timeout.min(PROBE_WITHIN));
    } else if let Some(hosts) = silent.due(Instant::now(), server.elastic_silent_all()) {
        // Hosts not reached before, asked again while their workers are still live and not found silent.
        let live = hosts
            .into_iter()
            .filter(|h| {
                workers
                    .iter()
                    .any(|w| w.exited.is_none() && !silent.slots.contains(&w.rank) && w.host == *h)
            })
            .collect::<Vec<_>>();
        if !live.is_empty() {
            silent.probe(live, timeout.min(PROBE_WITHIN));
        }
    }
    take_answers(job, step, server, workers, timeout, silent);
    for (slot, quiet) in found.quiet {
        let worker = workers.iter().find(|w| w.rank == slot);
        let host = worker.map_or("its host", |w| w.host.as_str());
        if let Some(w) = worker {
            silent.hosts.insert(w.host.clone(), Instant::now());
        }
        job.events.event(Event::Note {
            text: format!(
                "rank {slot} of step `{}` on {host} sent no heartbeat for {} s ({}): lost; stopping it (elastic)",
                step.name,
                quiet.as_secs_f64().round(),
                hvd_collective::env_vars::HVD_HEARTBEAT_TIMEOUT,
            ),
        });
        silent.slots.insert(slot);
    }
}

/// Acts on the hosts' answers to the probe of a stretch of silence that came since the last look: the workers on a
/// host the launcher reached are judged on their own silence from now on (said once per host, while the silence
/// lasts); once every host answered, the ones it could not reach are named.
fn take_answers(
    job: &Job<'_>,
    step: &PlannedStep,
    server: &RendezvousServer,
    workers: &[Worker],
    timeout: Duration,
    silent: &mut Silent,
) {
    let (answers, unreached) = silent.answers();
    for (host, _) in answers.iter().filter(|(_, reached)| *reached) {
        let slots: Vec<u32> = workers
            .iter()
            .filter(|w| w.exited.is_none() && w.host == *host)
            .map(|w| w.rank)
            .collect();
        if server.elastic_reached(&slots, timeout) {
            job.events.event(Event::Note {
                text: format!(
                    "the launcher reached host {host} ({}) while no worker of step `{}` sent a heartbeat: it is not \
                     cut off from it, and the workers there are judged on their own silence from now on",
                    silent.engine.name(),
                    step.name
                ),
            });
        }
    }
    let Some(unreached) = unreached.filter(|u| !u.is_empty() && server.elastic_silent_all()) else {
        return;
    };
    // Asked again a probe's time from now, for as long as the stretch lasts ([`Silent::due`]); named once.
    let within = timeout.min(PROBE_WITHIN);
    if silent.probes == 1 {
        job.events.event(Event::Note {
            text: format!(
                "warning: the launcher could not reach {} within {} s ({}): it seems cut off from them (its \
                 network); the workers of step `{}` there are not counted lost until one is heard again or the \
                 launcher reaches their host (it asks again {} s after each try)",
                unreached.join(", "),
                within.as_secs(),
                silent.engine.name(),
                step.name,
                within.as_secs(),
            ),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine whose hosts answer a probe as listed (after `delay`), and that counts the probes, and the most
    /// probes at once.
    #[derive(Debug)]
    struct Answers(
        BTreeMap<&'static str, (Option<bool>, Duration)>,
        std::sync::Mutex<usize>,
        std::sync::Mutex<(usize, usize)>,
    );

    impl SupervisedEngine for Answers {
        fn name(&self) -> &'static str {
            "test engine"
        }

        fn probe_host(&self, host: &str, _within: Duration) -> Option<bool> {
            *self.1.lock().unwrap() += 1;
            {
                let mut at_once = self.2.lock().unwrap();
                at_once.0 += 1;
                at_once.1 = at_once.1.max(at_once.0);
            }
            let (answer, delay) = self.0[host];
            std::thread::sleep(delay);
            self.2.lock().unwrap().0 -= 1;
            answer
        }
    }

    /// Collects the probe's answers until every host answered (5 s at most): the reached hosts, and the unreached.
    fn outcome(silent: &mut Silent) -> (Vec<String>, Vec<String>) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut reached = Vec::new();
        loop {
            let (came, done) = silent.answers();
            reached.extend(came.into_iter().filter(|(_, r)| *r).map(|(h, _)| h));
            if let Some(unreached) = done {
                assert!(silent.answers().0.is_empty(), "said once");
                return (reached, unreached);
            }
            assert!(Instant::now() < deadline, "no outcome");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Every reached host is named as its answer comes; hosts that cannot be reached are named once all have
    /// answered, however their answers are spread over the looks; an engine that cannot look names none; every host
    /// is asked once, at most `PROBED_HOSTS` at a time.
    #[test]
    fn reached_hosts_are_named_as_they_answer_and_unreached_ones_once_all_answered() {
        let ms = Duration::from_millis;
        let engine = |answers: &[(&'static str, Option<bool>, u64)]| {
            Arc::new(Answers(
                answers.iter().map(|(h, a, d)| (*h, (*a, ms(*d)))).collect(),
                std::sync::Mutex::new(0),
                std::sync::Mutex::new((0, 0)),
            ))
        };
        let hosts = |names: &[&str]| names.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>();
        let mut silent = Silent::new(engine(&[
            ("a", Some(false), 0),
            ("b", None, 0),
            ("c", Some(true), 200),
            ("d", Some(true), 0),
        ]));
        silent.probe(hosts(&["a", "b", "c", "d"]), ms(10));
        assert_eq!(
            outcome(&mut silent),
            (vec!["d".to_owned(), "c".to_owned()], vec!["a".to_owned()])
        );
        // Unreached answers taken on different looks are all named.
        let mut silent = Silent::new(engine(&[
            ("a", Some(false), 0),
            ("b", Some(false), 300),
            ("c", None, 0),
        ]));
        silent.probe(hosts(&["a", "b", "c"]), ms(10));
        std::thread::sleep(ms(100));
        assert!(silent.answers().1.is_none());
        assert_eq!(
            outcome(&mut silent),
            (Vec::new(), vec!["a".to_owned(), "b".to_owned()])
        );
        let mut silent = Silent::new(engine(&[("a", None, 0)]));
        silent.probe(hosts(&["a", "a"]), ms(10));
        assert_eq!(outcome(&mut silent), (Vec::new(), Vec::new()));
        // Twelve hosts, each named twice: twelve probes, at most eight at once.
        let names: Vec<&'static str> = vec![
            "h0", "h1", "h2", "h3", "h4", "h5", "h6", "h7", "h8", "h9", "ha", "hb",
        ];
        let many = engine(
            &names
                .iter()
                .map(|h| (*h, Some(false), 50))
                .collect::<Vec<_>>(),
        );
        let mut silent = Silent::new(many.clone());
        silent.probe(hosts(&names).into_iter().chain(hosts(&names)), ms(10));
        assert_eq!(outcome(&mut silent).1.len(), 12);
        assert_eq!(*many.1.lock().unwrap(), 12);
        assert_eq!(many.2.lock().unwrap().1, PROBED_HOSTS);
    }

    /// The hosts a probe did not reach are asked again a probe's time after it ended, not while another probe is
    /// under way, and only while the stretch of silence lasts (a worker heard ends it: nothing is asked, and nothing
    /// is left to ask in a later stretch).
    #[test]
    fn hosts_not_reached_are_asked_again_while_the_stretch_lasts() {
        let ms = Duration::from_millis;
        let engine = Arc::new(Answers(
            [("a", (Some(false), ms(0))), ("b", (Some(true), ms(0)))]
                .into_iter()
                .collect(),
            std::sync::Mutex::new(0),
            std::sync::Mutex::new((0, 0)),
        ));
        let mut silent = Silent::new(engine.clone());
        let hosts = |names: &[&str]| names.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>();
        silent.probe(hosts(&["a", "b"]), ms(300));
        let ended = Instant::now();
        assert_eq!(outcome(&mut silent), (hosts(&["b"]), hosts(&["a"])));
        assert_eq!(silent.due(ended, true), None);
        assert_eq!(silent.due(ended + ms(200), true), None);
        let later = ended + ms(2000);
        // Not while a probe is under way.
        silent.probe(hosts(&["b"]), ms(300));
        assert_eq!(silent.due(later, true), None);
        outcome(&mut silent);
        assert_eq!(silent.due(later, true), Some(hosts(&["a"])));
        assert_eq!(silent.due(later, true), None, "asked once per probe");
        // Asked again and still not reached: asked again after another probe's time.
        silent.probe(hosts(&["a"]), ms(300));
        outcome(&mut silent);
        assert_eq!(
            silent.due(Instant::now() + ms(400), true),
            Some(hosts(&["a"]))
        );
        assert_eq!(silent.probes, 3);
        // A worker heard ends the stretch: nothing is asked, then or later.
        silent.probe(hosts(&["a"]), ms(300));
        outcome(&mut silent);
        assert_eq!(silent.due(Instant::now() + ms(400), false), None);
        assert_eq!(silent.due(Instant::now() + ms(400), true), None);
        assert_eq!(*engine.1.lock().unwrap(), 5);
    }

    /// A host where a worker was found silent takes no new worker for one heartbeat timeout after that finding
    /// (its other frozen workers are found within it); other hosts, and that host afterwards, take them.
    #[test]
    fn a_host_with_a_silent_worker_is_not_placed_on_for_a_timeout() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut silent = Silent::new(Arc::new(crate::engine::Local));
        silent.slots.insert(2);
        silent.hosts.insert("frozen".to_owned(), t);
        let usable = || vec![("frozen".to_owned(), 2), ("fine".to_owned(), 2)];
        let hosts = |v: Vec<(String, u32)>| v.into_iter().map(|(h, _)| h).collect::<Vec<_>>();
        assert_eq!(hosts(silent.placeable(usable(), t, s(10))), ["fine"]);
        assert_eq!(hosts(silent.placeable(usable(), t + s(9), s(10))), ["fine"]);
        assert_eq!(
            hosts(silent.placeable(usable(), t + s(10), s(10))),
            ["frozen", "fine"]
        );
        assert!(silent.contains(&2) && !silent.contains(&3));
    }
}
