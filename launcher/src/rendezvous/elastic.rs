//! Elastic membership: which of an elastic step's workers form each round of the job, and their ranks in it.
//!
//! Workers are named by their slot (the `HVD_RANK` they were started with, sent as `X-Hvd-Rank`). Every round
//! (`hvd.init()`, and again after `hvd.shutdown()` when a peer was lost) a worker asks to join the round after the
//! last one it was a member of. A round forms once every worker the launcher still counts as alive has asked, or
//! `window` after the first one asked (a live worker that never comes back, e.g. stuck outside any collective, is
//! then left out: [`Membership::dropped`] names it for the launcher to stop). Its members are numbered 0..n in
//! slot order, so every member learns the same size and a distinct rank from the server.
//!
//! Workers come and go between rounds: a worker preempted at a commit tells the server it leaves
//! ([`Membership::leave`]; rounds no longer wait for it, and the launcher reports it as preempted, not lost), and the
//! launcher may start new workers (host discovery: [`Membership::add_worker`]). A new worker asks to join while the
//! others train; it waits, without starting any round's window, until the members re-form at a commit boundary
//! (they see it through [`Membership::status`]), and the next round takes it in.
//!
//! A round never forms with fewer members than the step's minimum ([`Membership::set_minimum`]): below it the
//! members that asked wait (the launcher starts replacements, or ends the step after its timeout). A new worker that
//! has not asked yet is not waited for, nor left out for being slow to start: it joins a later round.
//!
//! Once a member has finished its training ([`Membership::finish`]) no worker that was never a member joins any
//! more: it would train alone, from its initial state, or wait for members that will not re-form. It is answered
//! that it is left out, and the launcher stops it ([`Membership::never_members`]).
//!
//! A live worker that has sent a heartbeat ([`Membership::beat`]) and then sends none for the launcher's heartbeat
//! timeout is frozen (a stopped process, a hung or partitioned node): [`Membership::silence`] counts it gone like a
//! worker left out of a round (the launcher stops it), and the next heartbeats of the latest round's other members
//! are told which of its ranks is lost, so that they fail their collective in flight instead of waiting for it. A
//! worker that said in its join that it beats ([`Membership::will_beat`]: it starts beating once its first round is
//! answered) is counted as heard when a round forms with it, so one that freezes before its first heartbeat is
//! found too.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// What a join request is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Joined {
    /// The worker is rank `rank` of the `size` members of round `generation`.
    Member {
        generation: u64,
        rank: u32,
        size: u32,
    },
    /// Round `generation` formed without this worker (it asked too late, or the launcher counts it as gone).
    LeftOut { generation: u64 },
    /// No round for this worker yet; ask again (a window, if any, ends at the given instant).
    Wait { until: Option<Instant> },
}

/// A refused join request, with the reason the worker is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MembershipError {
    /// The slot is not one of the step's workers.
    NotAWorker { slot: u32, workers: u32 },
    /// The worker claims a round that has not formed.
    Ahead { after: u64, generation: u64 },
    /// A leave from a worker that is not alive (it ended, left already, or a round formed without it).
    NotAlive { slot: u32 },
    /// A leave after the launcher began to stop the step: there is nobody to hand over to.
    Stopping { slot: u32 },
}

impl MembershipError {
    pub(crate) fn reason(&self) -> String {
        match self {
            MembershipError::NotAWorker { slot, workers } => {
                format!(
                    "x-hvd-rank {slot} is not a worker of this elastic step (workers are 0..{workers})"
                )
            }
            MembershipError::Ahead { after, generation } => format!(
                "asked for the round after {after}, but the job's latest round is {generation}"
            ),
            MembershipError::NotAlive { slot } => format!(
                "worker {slot} is not a live worker of this elastic step (it ended, left, or was left out)"
            ),
            MembershipError::Stopping { slot } => format!(
                "the launcher is stopping this elastic step: it takes no hand-over; worker {slot} ends with the step"
            ),
        }
    }
}

/// The membership of one elastic step.
#[derive(Debug)]
pub(crate) struct Membership {
    workers: u32,
    /// How long a round waits, from the first request, for the live workers that have not asked yet (not the first
    /// round: every started worker is waited for, as `--start-timeout` says).
    window: Duration,
    alive: BTreeSet<u32>,
    generation: u64,
    /// The slots of the latest round, in rank order.
    members: Vec<u32>,
    /// Slots asking for the next round, and when the first of them asked.
    pending: BTreeSet<u32>,
    pending_since: Option<Instant>,
    /// Live slots that a round formed without.
    dropped: BTreeSet<u32>,
    /// Slots that were a member of some round (a worker that never was asks as a newcomer).
    were_members: BTreeSet<u32>,
    /// Slots that left on their own (preempted, at a commit), and how many workers were alive after each left.
    left: BTreeMap<u32, usize>,
    /// The launcher is stopping the step (a failure, the minimum, an interrupt): a SIGTERM now means stop, not
    /// preemption.
    stopping: bool,
    /// The fewest members a round forms with (1 unless [`Membership::set_minimum`] says more).
    min: u32,
    /// The launcher has signalled the workers it stops: a worker waiting for a round is answered that none forms.
    closed: bool,
    /// A member finished its training: workers that were never members are left out of every later round.
    finished: bool,
    /// Each live worker's latest heartbeat (only slots below `workers` that are alive: bounded by the workers).
    beats: BTreeMap<u32, Instant>,
    /// Workers that said in their join that they beat (slots below `workers`: bounded by the workers).
    beating: BTreeSet<u32>,
    /// Workers found silent past the heartbeat timeout (also in `dropped`).
    silent: BTreeSet<u32>,
    /// When the launcher last looked for silent workers.
    checked: Option<Instant>,
    /// Every worker that beat went quiet together: the launcher may be cut off from them (its own network), so nobody
    /// is judged until one is heard again (said once per such stretch) but workers on hosts the launcher reaches
    /// ([`Membership::reached`]). Holds each worker's latest heartbeat from before the stretch.
    cut_off: Option<BTreeMap<u32, Instant>>,
    /// Workers on hosts the launcher reached during the present stretch of silence ([`Membership::reached`]): each
    /// is judged on its own silence until a worker is heard again (bounded by the workers).
    reaching: BTreeSet<u32>,
    /// The workers reach the launcher over loopback (its server listens there: the local engine), so no network
    /// stands between them: when they all go quiet together they are frozen, not cut off.
    loopback: bool,
    /// The launcher's heartbeat timeout, told the workers with each heartbeat's answer (they beat often enough for it
    /// whatever their own `HVD_HEARTBEAT_TIMEOUT` says).
    pub(crate) heartbeat: Option<Duration>,
}

/// What the launcher's look for silent workers found ([`Membership::silence`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Silence {
    /// The workers found silent, with how long they were: gone from now on.
    pub quiet: Vec<(u32, Duration)>,
    /// Every worker that beat went quiet for the timeout together (first look of such a stretch only): the launcher,
    /// not they, seems cut off, and nobody was judged.
    pub cut_off: bool,
}

/// What a heartbeat is answered: the latest round and, when one of its members was found silent, that member's rank
/// in the round (its other members' collective in flight waits for a frozen peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Beat {
    pub(crate) generation: u64,
    pub(crate) lost: Option<u32>,
}

impl Membership {
    /// `workers` started workers, slots 0..workers, all alive.
    pub(crate) fn new(workers: u32, window: Duration) -> Membership {
        Membership {
            workers,
            window,
            alive: (0..workers).collect(),
            generation: 0,
            members: Vec::new(),
            pending: BTreeSet::new(),
            pending_since: None,
            dropped: BTreeSet::new(),
            were_members: BTreeSet::new(),
            left: BTreeMap::new(),
            stopping: false,
            min: 1,
            closed: false,
            finished: false,
            beats: BTreeMap::new(),
            beating: BTreeSet::new(),
            silent: BTreeSet::new(),
            checked: None,
            cut_off: None,
            reaching: BTreeSet::new(),
            loopback: false,
            heartbeat: None,
        }
    }

    /// The workers reach the launcher's server over loopback (see `loopback`).
    pub(crate) fn set_loopback(&mut self, loopback: bool) {
        self.loopback = loopback;
    }

    /// Rounds form with at least `min` members; fewer wait for more workers (or for the launcher to stop the step).
    pub(crate) fn set_minimum(&mut self, min: u32) {
        self.min = min.max(1);
    }

    /// The launcher started one more worker: its slot (the next after every slot so far), alive from now on.
    pub(crate) fn add_worker(&mut self) -> u32 {
        let slot = self.workers;
        self.workers += 1;
        self.alive.insert(slot);
        slot
    }

    /// Whether `slot` joins as a newcomer: a live worker, never a member, asking while a round runs without it.
    fn newcomer(&self, slot: u32, after: u64) -> bool {
        after == 0
            && self.generation > 0
            && self.alive.contains(&slot)
            && !self.were_members.contains(&slot)
            && !self.members.contains(&slot)
    }

    /// Worker `slot`, last a member of round `after` (0: none), asks to join the next round.
    pub(crate) fn join(
        &mut self,
        slot: u32,
        after: u64,
        now: Instant,
    ) -> Result<Joined, MembershipError> {
        if slot >= self.workers {
            return Err(MembershipError::NotAWorker {
                slot,
                workers: self.workers,
            });
        }
        if after > self.generation {
            return Err(MembershipError::Ahead {
                after,
                generation: self.generation,
            });
        }
        let newcomer = self.newcomer(slot, after);
        if self.finished && !self.were_members.contains(&slot) {
            return Ok(Joined::LeftOut {
                generation: self.generation,
            });
        }
        if self.generation > after && !newcomer {
            return Ok(self.answer(slot));
        }
        if !self.alive.contains(&slot) {
            return Ok(Joined::LeftOut {
                generation: self.generation,
            });
        }
        let before = self.generation;
        self.pending.insert(slot);
        // A newcomer waits for the members' next re-form: its request starts no window (which would leave out the
        // members, busy training).
        if !newcomer {
            self.pending_since.get_or_insert(now);
        }
        self.try_form(now);
        if newcomer {
            return Ok(match self.generation > before {
                true => self.answer(slot),
                false => Joined::Wait { until: None },
            });
        }
        if self.generation > after {
            return Ok(self.answer(slot));
        }
        // A window already over (the round waits below the minimum) is no instant to wake at.
        Ok(Joined::Wait {
            until: self.window_end().filter(|end| *end > now),
        })
    }

    /// The answer for `slot` about the latest round.
    fn answer(&self, slot: u32) -> Joined {
        match self.members.iter().position(|s| *s == slot) {
            Some(rank) => Joined::Member {
                generation: self.generation,
                rank: rank as u32,
                size: self.members.len() as u32,
            },
            None => Joined::LeftOut {
                generation: self.generation,
            },
        }
    }

    fn window_end(&self) -> Option<Instant> {
        match (self.generation, self.pending_since) {
            (0, _) | (_, None) => None,
            (_, Some(since)) => Some(crate::options::saturating_add(since, self.window)),
        }
    }

    /// Forms the next round when every live worker has asked, or the window is over. Returns whether it did.
    pub(crate) fn try_form(&mut self, now: Instant) -> bool {
        if self.pending.is_empty() {
            return false;
        }
        // Every live worker the round needs: all of them for the first round, then the members of earlier rounds
        // (a new worker that has not asked yet is not waited for: it joins a later round).
        let everyone = self
            .alive
            .iter()
            .filter(|s| self.generation == 0 || self.were_members.contains(s))
            .all(|s| self.pending.contains(s));
        let window_over = self.window_end().is_some_and(|end| now >= end);
        if !everyone && !window_over {
            return false;
        }
        // Past the window: the members that did not ask are left out.
        let left_out: Vec<u32> = self
            .alive
            .difference(&self.pending)
            .filter(|s| self.were_members.contains(s))
            .copied()
            .collect();
        for slot in left_out {
            self.beats.remove(&slot);
            self.alive.remove(&slot);
            self.dropped.insert(slot);
        }
        if (self.pending.len() as u32) < self.min {
            return false;
        }
        self.members = std::mem::take(&mut self.pending).into_iter().collect();
        self.were_members.extend(self.members.iter().copied());
        // A member that beats starts once it has its answer: heard now (plus one heartbeat interval for the answer to
        // reach it), so that it is judged even if it freezes first.
        let first = crate::options::saturating_add(
            now,
            self.heartbeat
                .map_or(Duration::ZERO, hvd_collective::liveness::interval),
        );
        for slot in self.members.iter().filter(|s| self.beating.contains(s)) {
            self.beats.entry(*slot).or_insert(first);
        }
        self.pending_since = None;
        self.generation += 1;
        true
    }

    /// Worker `slot` said in its join that it sends heartbeats from the round it joins on (a runtime from before
    /// heartbeats says nothing, and is judged only once it has beaten: never). Slots that are no worker are ignored.
    pub(crate) fn will_beat(&mut self, slot: u32) {
        if slot < self.workers {
            self.beating.insert(slot);
        }
    }

    /// Worker `slot` says it is alive. Only a live worker's heartbeat counts: one of a worker that ended, left, was
    /// left out or found silent is refused (it does not bring the worker back).
    pub(crate) fn beat(&mut self, slot: u32, now: Instant) -> Result<Beat, MembershipError> {
        self.live_worker(slot)?;
        // A worker heard ends a stretch of silence (a later one is looked into afresh).
        self.reaching.clear();
        // The first worker heard after the launcher was cut off from all: the others' beats are on their way, each
        // is given a whole timeout from now.
        if self.cut_off.take().is_some() {
            self.beats.values_mut().for_each(|at| *at = (*at).max(now));
        }
        self.beats.insert(slot, now);
        Ok(Beat {
            generation: self.generation,
            lost: self
                .members
                .iter()
                .position(|s| self.silent.contains(s))
                .map(|rank| rank as u32),
        })
    }

    /// The live workers whose latest heartbeat is `timeout` or more before `now`, with how long they were silent:
    /// they are gone from now on, as workers left out of a round ([`Membership::dropped`] names them for the launcher
    /// to stop), and a pending round forms without them. A worker that never sent a heartbeat is judged only from
    /// the round it joined saying it beats ([`Membership::will_beat`]).
    ///
    /// The launcher looks many times a second; when it has not looked for half the timeout, it was itself stopped or
    /// starved (its server heard nobody meanwhile), and every worker's silence counts from now instead.
    ///
    /// A worker is judged silent only while another live worker was heard within two heartbeat intervals: when every
    /// worker that beat went quiet together, the launcher is the one cut off (its network), not all of them frozen at
    /// once; nobody is judged, [`Silence::cut_off`] says so once, and each worker's silence counts from the first
    /// heartbeat heard again. A lone worker that beat (the only one left) is judged on its own silence: nothing can
    /// tell the two apart then, and a frozen last worker would otherwise hold the step for ever. Workers that reach
    /// the launcher over loopback ([`Membership::set_loopback`]) are judged each on its own silence too: nothing
    /// can cut them off, and all of them frozen at once would otherwise hold the step for ever; so are, during such a
    /// stretch, the workers on hosts the launcher reached ([`Membership::reached`]).
    pub(crate) fn silence(&mut self, now: Instant, timeout: Duration) -> Silence {
        let away = self
            .checked
            .replace(now)
            .is_some_and(|then| now.saturating_duration_since(then) >= timeout / 2);
        if away {
            self.beats.values_mut().for_each(|at| *at = (*at).max(now));
            return Silence::default();
        }
        let quiet = self.quiet_for(now, timeout);
        if quiet.is_empty() {
            return Silence::default();
        }
        let recent = 2 * hvd_collective::liveness::interval(timeout);
        let others_heard = self
            .beats
            .values()
            .any(|at| now.saturating_duration_since(*at) < recent);
        // A lone worker is judged on its own silence, unless it is held in a stretch that began with others.
        let lone = self.beats.len() == 1 && self.cut_off.is_none();
        if !others_heard && !lone && !self.loopback {
            let first = self.cut_off.is_none();
            if first {
                self.cut_off = Some(self.beats.clone());
            }
            // Workers on hosts the launcher reached are judged on their own silence; the others wait.
            let reaching = &self.reaching;
            let judged: Vec<(u32, Duration)> = quiet
                .into_iter()
                .filter(|(slot, _)| reaching.contains(slot))
                .collect();
            for (slot, at) in self.beats.iter_mut() {
                if !reaching.contains(slot) {
                    *at = (*at).max(now);
                }
            }
            self.judge(&judged, now);
            return Silence {
                quiet: judged,
                cut_off: first,
            };
        }
        self.judge(&quiet, now);
        Silence {
            quiet,
            cut_off: false,
        }
    }

    /// The launcher reached the host of workers `slots` while every worker that beat was quiet
    /// ([`Silence::cut_off`]): it is not cut off from them, they are frozen. Until a worker is heard again each of
    /// them is judged on its own silence, counted from its last heartbeat before the stretch, but no sooner than two
    /// heartbeat intervals from now (a worker whose beats were only held up, the network back as the host answered,
    /// is heard first). Returns whether the stretch was still on (else nothing changes: a worker was heard).
    pub(crate) fn reached(&mut self, slots: &[u32], now: Instant, timeout: Duration) -> bool {
        let Some(before) = &self.cut_off else {
            return false;
        };
        let grace = 2 * hvd_collective::liveness::interval(timeout);
        let earliest = now.checked_sub(timeout.saturating_sub(grace));
        for slot in slots {
            if let (Some(at), Some(beat)) = (before.get(slot), self.beats.get_mut(slot)) {
                *beat = earliest.map_or(*at, |earliest| (*at).max(earliest));
                self.reaching.insert(*slot);
            }
        }
        true
    }

    /// Whether a stretch of silence of every worker is on ([`Silence::cut_off`], no worker heard since).
    pub(crate) fn cut_off(&self) -> bool {
        self.cut_off.is_some()
    }

    /// The live workers whose latest heartbeat is `timeout` or more before `now`, with how long they were silent.
    fn quiet_for(&self, now: Instant, timeout: Duration) -> Vec<(u32, Duration)> {
        self.beats
            .iter()
            .map(|(slot, at)| (*slot, now.saturating_duration_since(*at)))
            .filter(|(_, quiet)| *quiet >= timeout)
            .collect()
    }

    /// `quiet` workers are gone from now on, found silent (see [`Membership::silence`]).
    fn judge(&mut self, quiet: &[(u32, Duration)], now: Instant) {
        for (slot, _) in quiet {
            self.beats.remove(slot);
            self.alive.remove(slot);
            self.pending.remove(slot);
            self.dropped.insert(*slot);
            self.silent.insert(*slot);
        }
        if self.pending.is_empty() {
            self.pending_since = None;
        }
        self.try_form(now);
    }

    /// `Ok` when `slot` is one of the step's workers and alive (not ended, left, left out or found silent).
    fn live_worker(&self, slot: u32) -> Result<(), MembershipError> {
        if slot >= self.workers {
            return Err(MembershipError::NotAWorker {
                slot,
                workers: self.workers,
            });
        }
        if !self.alive.contains(&slot) {
            return Err(MembershipError::NotAlive { slot });
        }
        Ok(())
    }

    /// Worker `slot`'s process exited, its exit not reported yet (its output is drained first, up to `--grace`): it
    /// is judged by that exit, no longer by its silence.
    pub(crate) fn exited(&mut self, slot: u32) {
        self.beats.remove(&slot);
        // Nor is it armed again when a round forms with it (it may have asked to join before it exited).
        self.beating.remove(&slot);
    }

    /// Worker `slot` ended (or was stopped): rounds no longer wait for it.
    pub(crate) fn gone(&mut self, slot: u32, now: Instant) {
        self.beats.remove(&slot);
        self.alive.remove(&slot);
        self.pending.remove(&slot);
        if self.pending.is_empty() {
            self.pending_since = None;
        }
        self.try_form(now);
    }

    /// Worker `slot` leaves on its own (preempted, after its last commit): rounds no longer wait for it, and
    /// [`Membership::left`] names it. Returns how many workers are alive.
    pub(crate) fn leave(&mut self, slot: u32, now: Instant) -> Result<usize, MembershipError> {
        self.live_worker(slot)?;
        // A hand-over the launcher's stop overtook (the stop ended the worker the preempted one waited for in its
        // last step, so that step completed and it committed after the stop began): refused, so the worker ends as
        // stopped, not as preempted with its job going on.
        if self.stopping {
            return Err(MembershipError::Stopping { slot });
        }
        self.gone(slot, now);
        self.left.insert(slot, self.alive.len());
        Ok(self.alive.len())
    }

    /// Worker `slot` ended well. When it was a member of a round, its training is over: from now on no worker that
    /// was never a member joins (those waiting are taken off the next round, and later requests are left out).
    /// Returns whether the training is over.
    pub(crate) fn finish(&mut self, slot: u32, now: Instant) -> bool {
        if self.were_members.contains(&slot) && !self.finished {
            self.finished = true;
            let members = &self.were_members;
            self.pending.retain(|s| members.contains(s));
            if self.pending.is_empty() {
                self.pending_since = None;
            }
            self.try_form(now);
        }
        self.finished
    }

    /// Live workers that were never a member of a round, once a member finished its training (none before): the
    /// launcher stops them, whether they asked to join or not.
    pub(crate) fn never_members(&self) -> BTreeSet<u32> {
        match self.finished {
            false => BTreeSet::new(),
            true => self.alive.difference(&self.were_members).copied().collect(),
        }
    }

    /// Workers that left on their own (preempted), and how many were alive right after each left.
    pub(crate) fn left(&self) -> &BTreeMap<u32, usize> {
        &self.left
    }

    /// The launcher stops the step: the SIGTERMs it sends next are a stop, not a preemption.
    pub(crate) fn stop(&mut self) {
        self.stopping = true;
    }

    /// The launcher has signalled the workers it stops (after [`Membership::stop`]): no round forms any more.
    pub(crate) fn close(&mut self) {
        self.closed = true;
    }

    /// Whether no round forms any more.
    pub(crate) fn closed(&self) -> bool {
        self.closed
    }

    /// Whether the launcher is stopping the step.
    pub(crate) fn stopping(&self) -> bool {
        self.stopping
    }

    /// The latest round, its size, and how many new workers wait to join the next one (the members should re-form
    /// at their next commit to take them in).
    pub(crate) fn status(&self) -> (u64, u32, u32) {
        let waiting = match self.generation {
            0 => 0,
            _ => self
                .pending
                .iter()
                .filter(|s| !self.were_members.contains(s))
                .count() as u32,
        };
        (self.generation, self.members.len() as u32, waiting)
    }

    /// Workers still alive (started, not ended, not left out).
    pub(crate) fn alive(&self) -> usize {
        self.alive.len()
    }

    /// Live workers that were members of a round (before the first round: every live worker, as it waits for all).
    pub(crate) fn alive_members(&self) -> usize {
        match self.generation {
            0 => self.alive.len(),
            _ => self.alive.intersection(&self.were_members).count(),
        }
    }

    /// Live workers a round formed without: the launcher stops them.
    pub(crate) fn dropped(&self) -> &BTreeSet<u32> {
        &self.dropped
    }

    /// The latest round and its size (0, 0 before the first).
    pub(crate) fn latest(&self) -> (u64, u32) {
        (self.generation, self.members.len() as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(generation: u64, rank: u32, size: u32) -> Result<Joined, MembershipError> {
        Ok(Joined::Member {
            generation,
            rank,
            size,
        })
    }

    #[test]
    fn the_first_round_waits_for_every_worker_and_numbers_them_by_slot() {
        let t = Instant::now();
        let mut m = Membership::new(3, Duration::from_secs(1));
        assert_eq!(m.join(2, 0, t), Ok(Joined::Wait { until: None }));
        assert_eq!(m.join(0, 0, t), Ok(Joined::Wait { until: None }));
        // No window in the first round: a slow starter is waited for.
        assert!(!m.try_form(t + Duration::from_secs(60)));
        assert_eq!(m.join(1, 0, t), member(1, 1, 3));
        // The others' repeated requests get the same answer.
        assert_eq!(m.join(2, 0, t), member(1, 2, 3));
        assert_eq!(m.join(0, 0, t), member(1, 0, 3));
    }

    #[test]
    fn after_a_loss_the_survivors_form_the_next_round_with_new_ranks() {
        let t = Instant::now();
        let mut m = Membership::new(4, Duration::from_secs(30));
        for slot in 0..4 {
            m.join(slot, 0, t).unwrap();
        }
        m.gone(1, t);
        assert_eq!(m.alive(), 3);
        assert!(matches!(
            m.join(3, 1, t),
            Ok(Joined::Wait { until: Some(_) })
        ));
        assert!(matches!(m.join(0, 1, t), Ok(Joined::Wait { .. })));
        assert_eq!(m.join(2, 1, t), member(2, 1, 3));
        assert_eq!(m.join(0, 1, t), member(2, 0, 3));
        assert_eq!(m.join(3, 1, t), member(2, 2, 3));
        assert_eq!(m.latest(), (2, 3));
        // The dead worker is told it is out, should it ask.
        assert_eq!(m.join(1, 1, t), Ok(Joined::LeftOut { generation: 2 }));
    }

    #[test]
    fn a_worker_that_dies_while_others_wait_completes_the_round() {
        let t = Instant::now();
        let mut m = Membership::new(3, Duration::from_secs(30));
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
        }
        m.join(0, 1, t).unwrap();
        m.join(1, 1, t).unwrap();
        m.gone(2, t);
        assert_eq!(m.join(0, 1, t), member(2, 0, 2));
    }

    #[test]
    fn a_live_worker_that_does_not_come_back_within_the_window_is_left_out() {
        let t = Instant::now();
        let window = Duration::from_secs(5);
        let mut m = Membership::new(3, window);
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
        }
        m.join(0, 1, t).unwrap();
        m.join(2, 1, t + Duration::from_secs(1)).unwrap();
        assert!(!m.try_form(t + Duration::from_secs(4)));
        assert!(m.try_form(t + window));
        assert_eq!(m.join(2, 1, t), member(2, 1, 2));
        assert_eq!(m.dropped().iter().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!(m.join(1, 1, t), Ok(Joined::LeftOut { generation: 2 }));
    }

    #[test]
    fn a_preempted_worker_leaves_and_the_round_forms_without_it() {
        let t = Instant::now();
        let mut m = Membership::new(3, Duration::from_secs(30));
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
        }
        // The survivors ask first; the leave completes the round at once (no window).
        assert!(matches!(m.join(0, 1, t), Ok(Joined::Wait { .. })));
        assert!(matches!(m.join(2, 1, t), Ok(Joined::Wait { .. })));
        assert_eq!(m.leave(1, t), Ok(2));
        assert_eq!(m.join(0, 1, t), member(2, 0, 2));
        assert_eq!(m.join(2, 1, t), member(2, 1, 2));
        assert_eq!(m.left().get(&1), Some(&2));
        assert!(m.dropped().is_empty());
        // Leaving twice, or a slot that is no worker, is refused.
        assert_eq!(m.leave(1, t), Err(MembershipError::NotAlive { slot: 1 }));
        assert_eq!(
            m.leave(3, t),
            Err(MembershipError::NotAWorker {
                slot: 3,
                workers: 3
            })
        );
    }

    /// Once the launcher stops the step, a hand-over is refused: the worker stays alive (it ends with the step, as
    /// stopped) and is not counted as preempted.
    #[test]
    fn a_leave_after_the_stop_began_is_refused() {
        let t = Instant::now();
        let mut m = Membership::new(3, Duration::from_secs(30));
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
        }
        m.stop();
        assert_eq!(m.leave(1, t), Err(MembershipError::Stopping { slot: 1 }));
        assert!(m.left().is_empty());
        assert_eq!(m.alive.len(), 3);
        assert!(
            MembershipError::Stopping { slot: 1 }
                .reason()
                .contains("the launcher is stopping this elastic step")
        );
    }

    /// Below the minimum the survivors wait (their requests answer "not yet", with no past instant to wake at), and
    /// the round forms once a replacement asks. At or above it, a replacement still starting is not waited for, nor
    /// left out: the round forms without it, and it joins a later one.
    #[test]
    fn below_the_minimum_no_round_forms_until_a_replacement_asks() {
        let t = Instant::now();
        let window = Duration::from_secs(5);
        let mut m = Membership::new(3, window);
        m.set_minimum(3);
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
        }
        m.gone(2, t);
        assert!(matches!(m.join(0, 1, t), Ok(Joined::Wait { .. })));
        let late = t + window * 2;
        assert_eq!(m.join(1, 1, late), Ok(Joined::Wait { until: None }));
        assert!(!m.try_form(late));
        assert_eq!(m.latest(), (1, 3));
        // A replacement asks and the round of 3 forms.
        assert_eq!(m.add_worker(), 3);
        assert_eq!(m.join(0, 1, late), Ok(Joined::Wait { until: None }));
        assert_eq!(m.join(3, 0, late), member(2, 2, 3));
        assert_eq!(m.join(1, 1, late), member(2, 1, 3));
        // Minimum 2 of 3; slot 1 dies and its replacement (4) has not asked: the round of the other two forms at
        // once, and the replacement is not left out, even past the window.
        m.set_minimum(2);
        m.gone(1, late);
        assert_eq!(m.add_worker(), 4);
        assert!(matches!(m.join(0, 2, late), Ok(Joined::Wait { .. })));
        assert_eq!(m.join(3, 2, late), member(3, 1, 2));
        assert!(!m.try_form(late + window * 2));
        assert!(m.dropped().is_empty());
        assert_eq!(m.alive(), 3);
        assert_eq!(m.join(4, 0, late), Ok(Joined::Wait { until: None }));
        assert_eq!(m.status(), (3, 2, 1));
    }

    #[test]
    fn a_new_worker_waits_for_the_members_next_re_form_without_starting_a_window() {
        let t = Instant::now();
        let window = Duration::from_secs(5);
        let mut m = Membership::new(2, window);
        for slot in 0..2 {
            m.join(slot, 0, t).unwrap();
        }
        assert_eq!(m.status(), (1, 2, 0));
        assert_eq!(m.add_worker(), 2);
        // It asks while the members train: it waits, and no window starts (the members are not left out).
        assert_eq!(m.join(2, 0, t), Ok(Joined::Wait { until: None }));
        assert!(!m.try_form(t + window * 10));
        assert_eq!(m.status(), (1, 2, 1));
        // The members see it at a commit and re-form: the next round takes it in.
        assert!(matches!(m.join(0, 1, t), Ok(Joined::Wait { .. })));
        assert_eq!(m.join(1, 1, t), member(2, 1, 3));
        assert_eq!(m.join(2, 0, t), member(2, 2, 3));
        assert_eq!(m.join(0, 1, t), member(2, 0, 3));
        assert_eq!(m.status(), (2, 3, 0));
    }

    /// Once a member finished, a replacement that never was a member is left out whether it asked before or after,
    /// and no round forms with it (min 1: it would train alone from its initial state).
    #[test]
    fn after_a_member_finished_no_worker_that_never_was_one_joins() {
        let t = Instant::now();
        let mut m = Membership::new(2, Duration::from_secs(5));
        for slot in 0..2 {
            m.join(slot, 0, t).unwrap();
        }
        m.gone(1, t);
        assert_eq!(m.join(0, 1, t), member(2, 0, 1));
        assert_eq!(m.add_worker(), 2);
        assert_eq!(m.add_worker(), 3);
        // Slot 2 asks while slot 0 trains; slot 3 has not asked yet.
        assert_eq!(m.join(2, 0, t), Ok(Joined::Wait { until: None }));
        assert!(m.never_members().is_empty());
        // A worker that never was a member ending well says nothing about the training.
        assert!(!m.finish(3, t));
        assert!(m.finish(0, t));
        m.gone(0, t);
        assert_eq!(m.never_members(), BTreeSet::from([2, 3]));
        assert_eq!(m.latest(), (2, 1));
        assert_eq!(m.join(2, 0, t), Ok(Joined::LeftOut { generation: 2 }));
        assert_eq!(m.join(3, 0, t), Ok(Joined::LeftOut { generation: 2 }));
        assert!(!m.try_form(t + Duration::from_secs(60)));
        assert_eq!(m.latest(), (2, 1));
    }

    /// A worker whose process exited (its exit not reported yet: its output is drained first) is no longer judged
    /// by its silence: it ended, maybe well, and is not counted lost for having stopped beating.
    #[test]
    fn a_worker_whose_process_exited_is_not_found_silent() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut m = Membership::new(2, s(3600));
        for slot in 0..2 {
            m.join(slot, 0, t).unwrap();
            m.beat(slot, t).unwrap();
        }
        m.exited(1);
        m.beat(0, t + s(9)).unwrap();
        assert_eq!(m.silence(t + s(10), s(10)), Silence::default());
        assert!(m.dropped().is_empty());
    }

    /// Workers that reach the launcher over loopback and all go quiet together are frozen, not cut off: every one is
    /// judged (the same silence over a network is the launcher cut off, and nobody is).
    #[test]
    fn workers_on_loopback_that_all_go_quiet_are_judged_not_taken_for_a_cut_off_launcher() {
        let t = Instant::now();
        let s = Duration::from_secs;
        for loopback in [false, true] {
            let mut m = Membership::new(3, s(3600));
            m.set_loopback(loopback);
            for slot in 0..3 {
                m.join(slot, 0, t).unwrap();
                m.beat(slot, t).unwrap();
            }
            assert_eq!(m.silence(t + s(4), s(10)), Silence::default());
            assert_eq!(m.silence(t + s(8), s(10)), Silence::default());
            let found = m.silence(t + s(10), s(10));
            match loopback {
                false => assert!(found.cut_off && found.quiet.is_empty(), "{found:?}"),
                true => {
                    assert!(!found.cut_off, "{found:?}");
                    let slots: Vec<u32> = found.quiet.iter().map(|(slot, _)| *slot).collect();
                    assert_eq!(slots, [0, 1, 2]);
                }
            }
        }
    }

    /// A worker that said in its join that it beats is counted heard when its round forms: frozen before its first
    /// heartbeat, it is found silent one timeout later; one that said nothing is never judged, and a slot that is no
    /// worker is not remembered.
    #[test]
    fn a_worker_that_said_it_beats_is_judged_from_its_round_even_before_its_first_beat() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut m = Membership::new(3, s(3600));
        m.will_beat(0);
        m.will_beat(1);
        m.will_beat(7);
        for slot in 0..3 {
            m.join(slot, 0, t + s(5)).unwrap();
        }
        assert!(m.beating.iter().all(|slot| *slot < 3));
        // Formed at t + 5 s; slot 0 beats on, slot 1 froze before its first heartbeat, slot 2 never said it beats.
        m.beat(0, t + s(12)).unwrap();
        assert_eq!(m.silence(t + s(14), s(10)), Silence::default());
        let found = m.silence(t + s(15), s(10));
        assert_eq!(found.quiet, vec![(1, s(10))]);
        assert!(m.dropped().contains(&1) && !m.dropped().contains(&2));

        // With the launcher's timeout known (10 s: a heartbeat every 2 s), the first one is awaited one interval
        // more; a worker whose process exited before its round formed is not armed by it.
        let mut m = Membership::new(3, s(3600));
        m.heartbeat = Some(s(10));
        for slot in 0..3 {
            m.will_beat(slot);
        }
        m.join(0, 0, t).unwrap();
        m.join(2, 0, t).unwrap();
        m.exited(2);
        m.join(1, 0, t + s(5)).unwrap();
        for at in [10, 14, 16] {
            m.beat(0, t + s(at)).unwrap();
            assert_eq!(m.silence(t + s(at), s(10)), Silence::default(), "{at}");
        }
        m.beat(0, t + s(17)).unwrap();
        assert_eq!(m.silence(t + s(17), s(10)).quiet, vec![(1, s(10))]);
    }

    /// A worker that beat and then fell silent past the timeout is gone: the pending round forms without it, the
    /// launcher is told to stop it, the other members' heartbeats name its rank in their round, and its own later
    /// heartbeats (a replayed or forged one, or its own after a thaw) are refused without bringing it back.
    #[test]
    fn a_worker_silent_past_the_heartbeat_timeout_is_gone_and_stays_gone() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut m = Membership::new(3, s(3600));
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
        }
        // Slot 2 never beat: not judged, however long.
        assert_eq!(
            m.beat(0, t),
            Ok(Beat {
                generation: 1,
                lost: None
            })
        );
        m.beat(1, t).unwrap();
        assert!(
            m.silence(t + s(100), s(10))
                .quiet
                .iter()
                .all(|(s, _)| *s != 2)
        );
        let mut m = Membership::new(3, s(3600));
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
            m.beat(slot, t).unwrap();
        }
        m.beat(0, t + s(8)).unwrap();
        m.beat(2, t + s(8)).unwrap();
        assert_eq!(m.silence(t + s(9), s(10)), Silence::default());
        // Slot 0 asks for the next round; slot 1 is silent from t.
        assert!(matches!(m.join(0, 1, t + s(9)), Ok(Joined::Wait { .. })));
        assert_eq!(m.silence(t + s(10), s(10)).quiet, vec![(1, s(10))]);
        assert_eq!(m.dropped(), &BTreeSet::from([1]));
        assert_eq!(
            m.beat(2, t + s(10)),
            Ok(Beat {
                generation: 1,
                lost: Some(1)
            })
        );
        assert_eq!(
            m.beat(1, t + s(11)),
            Err(MembershipError::NotAlive { slot: 1 })
        );
        assert_eq!(m.join(2, 1, t + s(11)), member(2, 1, 2));
        assert_eq!(
            m.join(1, 1, t + s(11)),
            Ok(Joined::LeftOut { generation: 2 })
        );
        // The new round lost none of its members.
        assert_eq!(
            m.beat(0, t + s(11)),
            Ok(Beat {
                generation: 2,
                lost: None
            })
        );
        // The launcher itself was stopped for longer than the timeout: nobody is judged on that silence.
        let mut away = Membership::new(2, s(3600));
        for slot in 0..2 {
            away.join(slot, 0, t).unwrap();
            away.beat(slot, t).unwrap();
        }
        assert_eq!(away.silence(t + s(1), s(10)), Silence::default());
        assert_eq!(away.silence(t + s(60), s(10)), Silence::default());
        assert_eq!(away.silence(t + s(61), s(10)), Silence::default());
        let quiet: Vec<u32> = (62..=71)
            .flat_map(|at| {
                if at % 2 == 1 {
                    away.beat(0, t + s(at)).unwrap();
                }
                away.silence(t + s(at), s(10)).quiet
            })
            .map(|(slot, _)| slot)
            .collect();
        assert_eq!(quiet, vec![1]);
        // Heartbeats of slots that are no worker are refused and remembered nowhere.
        for slot in [3, 7, u32::MAX] {
            assert!(matches!(
                m.beat(slot, t),
                Err(MembershipError::NotAWorker { .. })
            ));
        }
        assert!(m.beats.keys().all(|s| *s < 3));
        // A worker that ended is forgotten.
        m.gone(0, t + s(12));
        assert!(!m.beats.contains_key(&0));
    }

    /// The launcher cut off from every worker (its own network drops their beats; they still reach each other) hears
    /// all of them go quiet together: it judges none of them lost, says so once, and gives each a whole timeout from
    /// the first heartbeat heard again. A worker silent while another is heard is judged as before; so is a lone
    /// worker.
    #[test]
    fn a_launcher_cut_off_from_every_worker_judges_none_of_them() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut m = Membership::new(3, s(3600));
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
            m.beat(slot, t).unwrap();
        }
        // The launcher looks every second and hears nobody for a minute.
        let said: Vec<bool> = (1..=60)
            .map(|at| {
                let found = m.silence(t + s(at), s(10));
                assert!(found.quiet.is_empty(), "{at}: {found:?}");
                found.cut_off
            })
            .collect();
        assert_eq!(said.iter().filter(|c| **c).count(), 1, "{said:?}");
        assert!(said[9], "{said:?}");
        assert_eq!(m.dropped(), &BTreeSet::new());
        // Heard again: slot 0 at once, slot 1 a little later; slot 2 never (it froze meanwhile): judged a whole
        // timeout after the first heartbeat heard, and it alone.
        let mut quiet = Vec::new();
        for at in 61..=75 {
            for slot in [0, 1] {
                if slot == 0 || at >= 63 {
                    m.beat(slot, t + s(at)).unwrap();
                }
            }
            let found = m.silence(t + s(at), s(10));
            assert!(!found.cut_off);
            quiet.extend(found.quiet.into_iter().map(|(slot, _)| (slot, at)));
        }
        assert_eq!(quiet, vec![(2, 71)]);
        // A lone worker that beat: its silence is judged (nothing else could be heard).
        let mut lone = Membership::new(2, s(3600));
        lone.join(0, 0, t).unwrap();
        lone.join(1, 0, t).unwrap();
        lone.beat(0, t).unwrap();
        let found: Vec<u32> = (1..=10)
            .flat_map(|at| lone.silence(t + s(at), s(10)).quiet)
            .map(|(slot, _)| slot)
            .collect();
        assert_eq!(found, vec![0]);
    }

    /// Every worker quiet at once, and then the launcher reaches the host of two of them: those two are judged on
    /// their own silence, from their last heartbeat but no sooner than two beat intervals after the host answered;
    /// the two on a host it did not reach stay held as if it were cut off from them, until one is heard. A worker
    /// heard just after its host answered (the network back) ends the stretch and nobody is judged; a reach after
    /// that changes nothing.
    #[test]
    fn a_launcher_that_reaches_a_host_judges_its_workers_only_and_after_a_grace() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let four = || {
            let mut m = Membership::new(4, s(3600));
            for slot in 0..4 {
                m.join(slot, 0, t).unwrap();
                m.beat(slot, t).unwrap();
            }
            for at in 1..=10 {
                let found = m.silence(t + s(at), s(10));
                assert!(found.quiet.is_empty(), "{at}: {found:?}");
                assert_eq!(found.cut_off, at == 10, "{at}: {found:?}");
            }
            m
        };
        let mut m = four();
        // Slots 0 and 1 are on the host reached at 11 s: judged at 15 s (the 4 s grace), as 10 s silent.
        assert!(m.reached(&[0, 1], t + s(11), s(10)));
        let mut judged = Vec::new();
        for at in 11..=60 {
            let found = m.silence(t + s(at), s(10));
            assert!(!found.cut_off, "{at}: {found:?}");
            judged.extend(found.quiet.into_iter().map(|q| (at, q)));
        }
        assert_eq!(judged, vec![(15, (0, s(10))), (15, (1, s(10)))]);
        assert_eq!(m.dropped(), &BTreeSet::from([0, 1]));
        // Slot 2 heard: the stretch is over; slot 3, still silent, is judged a timeout later by the usual rule.
        m.beat(2, t + s(61)).unwrap();
        let later: Vec<_> = (61..=71)
            .flat_map(|at| {
                m.beat(2, t + s(at)).unwrap();
                m.silence(t + s(at), s(10)).quiet
            })
            .collect();
        assert_eq!(later, vec![(3, s(10))]);

        // Three workers, the third on a host not reached: once the other two are judged it is the last, and still
        // held (the lone worker's rule is for a worker alone from the start of its silence).
        let mut m = Membership::new(3, s(3600));
        for slot in 0..3 {
            m.join(slot, 0, t).unwrap();
            m.beat(slot, t).unwrap();
        }
        for at in 1..=10 {
            m.silence(t + s(at), s(10));
        }
        assert!(m.reached(&[0, 1], t + s(11), s(10)));
        let judged: Vec<u32> = (11..=90)
            .flat_map(|at| m.silence(t + s(at), s(10)).quiet)
            .map(|(slot, _)| slot)
            .collect();
        assert_eq!(judged, vec![0, 1]);

        // The network back as the host answers: a worker heard within the grace ends the stretch, nobody is judged,
        // and a reach after that is no reach.
        let mut m = four();
        assert!(m.reached(&[0, 1], t + s(11), s(10)));
        for at in 12..=20 {
            for slot in 0..4 {
                m.beat(slot, t + s(at)).unwrap();
            }
            assert_eq!(m.silence(t + s(at), s(10)), Silence::default(), "{at}");
        }
        assert!(!m.reached(&[0, 1], t + s(21), s(10)));
        assert_eq!(m.dropped(), &BTreeSet::new());
    }

    #[test]
    fn hostile_requests_are_refused() {
        let t = Instant::now();
        let mut m = Membership::new(2, Duration::from_secs(5));
        assert_eq!(
            m.join(2, 0, t),
            Err(MembershipError::NotAWorker {
                slot: 2,
                workers: 2
            })
        );
        assert_eq!(
            m.join(0, 7, t),
            Err(MembershipError::Ahead {
                after: 7,
                generation: 0
            })
        );
    }
}
