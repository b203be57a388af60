//! The engine thread: the cycle (cache bits, negotiation through the coordinator), response fusion, execution
//! through `ops`, completion of handles, timeline phases.

mod ops;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::error::{EngineError, Stop};
use super::handles::{Handle, IDLE_INTERVAL, Shared, Slot, TimelineSwap, lock, outcomes};
use super::request::{NONAME, Output, Request};
use crate::cache::{Lookup, ResponseCache};
use crate::config::EngineConfig;
use crate::coordinator::{Coordinator, StallPolicy};
use crate::message::{OpKind, RankMessage, RequestMeta, Response, ResponseList};
use crate::timeline::{EventName, Lanes, Phase, Timeline};
use crate::transport::{
    Topology, allgather_bytes, broadcast_bytes, display_name, fusion_max_tensor_bytes,
};
use hvd_collective::Communicator;
use hvd_collective::time::saturating_add;
use hvd_collective::{DType, ReduceOp};

/// The timeline this rank writes for `path`, if any: like Horovod, rank 0 writes the timeline; a `{rank}` in the
/// path gives every rank a file of its own.
pub(super) fn open_timeline(
    path: &std::path::Path,
    rank: usize,
) -> Result<Option<Timeline>, EngineError> {
    let text = path.to_string_lossy();
    let path = if text.contains("{rank}") {
        std::path::PathBuf::from(text.replace("{rank}", &rank.to_string()))
    } else if rank == 0 {
        path.to_path_buf()
    } else {
        return Ok(None);
    };
    Timeline::create(&path, rank)
        .map(Some)
        .map_err(|e| EngineError::Timeline {
            path: path.display().to_string(),
            source: Arc::new(e),
        })
}

struct Pending {
    request: Request,
    handle: Handle,
    /// A group fused at submission: its members' shapes (handles `handle..handle + len`).
    members: Option<Arc<[Vec<i64>]>>,
    lane: u32,
}

/// The engine thread's state: it owns the transport, the coordinator (rank 0) and the response cache.
pub(super) struct Worker {
    transport: Box<dyn Communicator>,
    /// The communicator's [`display_name`], for the timeline.
    transport_name: String,
    topology: Topology,
    config: EngineConfig,
    shared: Arc<Shared>,
    coordinator: Option<Coordinator>,
    cache: ResponseCache,
    /// Every local request not yet completed, by name.
    pending: HashMap<String, Pending>,
    /// Cache slots of pending requests announced through the bit vector.
    cached_ready: BTreeSet<u32>,
    /// Names to send to the coordinator at the next negotiation.
    uncached: Vec<String>,
    /// Cache slots whose entries disagree with a local request: every rank evicts them.
    invalid: BTreeSet<u32>,
    /// Cache slots whose names sit in the coordinator's table.
    negotiating: HashSet<u32>,
    join_handle: Option<Handle>,
    shutdown: bool,
    /// A join or shutdown that the coordinator has not heard of yet.
    announce: bool,
    /// The last cycle ran something.
    busy: bool,
    last_cycle: Instant,
    fusion: Vec<u8>,
    /// The communicator's [`fusion_max_tensor_bytes`](crate::transport::fusion_max_tensor_bytes).
    fusion_max_tensor_bytes: usize,
    timeline: Option<Timeline>,
    last_negotiation: Instant,
    activity_names: HashMap<OpKind, EventName>,
}

/// A unit of execution: one response, or several fused allreduces.
enum Work {
    Single(Response),
    Fused(Vec<RequestMeta>),
}

impl Worker {
    pub(super) fn new(
        transport: Box<dyn Communicator>,
        config: EngineConfig,
        shared: Arc<Shared>,
        timeline: Option<Timeline>,
    ) -> Worker {
        let topology = transport.topology();
        Worker {
            coordinator: (topology.rank == 0).then(|| Coordinator::new(topology.size)),
            cache: ResponseCache::new(config.cache_capacity),
            fusion_max_tensor_bytes: fusion_max_tensor_bytes(&*transport),
            transport_name: display_name(&*transport),
            transport,
            topology,
            config,
            shared,
            pending: HashMap::new(),
            cached_ready: BTreeSet::new(),
            uncached: Vec::new(),
            invalid: BTreeSet::new(),
            negotiating: HashSet::new(),
            join_handle: None,
            shutdown: false,
            announce: false,
            busy: false,
            last_cycle: Instant::now(),
            fusion: Vec::new(),
            timeline,
            last_negotiation: Instant::now(),
            activity_names: HashMap::new(),
        }
    }

    /// The engine thread's body: cycles until every rank has shut down or a collective fails, then fails whatever
    /// is left.
    pub(super) fn run(mut self) {
        let mut next_cycle = Instant::now();
        let reason = loop {
            self.wait_for_cycle(next_cycle, self.busy);
            self.last_cycle = Instant::now();
            next_cycle = saturating_add(self.last_cycle, self.config.cycle_time);
            match self.cycle() {
                Ok(true) => {}
                Ok(false) => break Stop::Shutdown,
                Err(e) => break e,
            }
        };
        self.stop(reason);
    }

    fn wait_for_cycle(&mut self, deadline: Instant, spin: bool) {
        let idle = self.pending.is_empty()
            && self.join_handle.is_none()
            && !self.shutdown
            && self.uncached.is_empty()
            && self.cached_ready.is_empty();
        if spin && !idle && !self.config.spin_time.is_zero() {
            // Right after a cycle with work the next waiter is likely near: poll before sleeping.
            let until = saturating_add(Instant::now(), self.config.spin_time).min(deadline);
            while Instant::now() < until {
                if self.shared.waiters.load(Ordering::SeqCst) > 0 {
                    return;
                }
                std::thread::yield_now();
            }
        }
        let mut deadline = if idle {
            deadline.max(self.last_cycle + IDLE_INTERVAL)
        } else {
            deadline
        };
        let mut idle = idle;
        let mut q = lock(&self.shared.queue);
        q.idle = idle;
        loop {
            if !q.timeline.is_empty() {
                // Applied at once, not in a cycle: an idle engine must not start a collective for it.
                drop(q);
                self.apply_timeline_swaps();
                q = lock(&self.shared.queue);
                continue;
            }
            let now = Instant::now();
            if idle && !q.items.is_empty() {
                // Woken by a submission: give the tensors that follow it one cycle time to arrive, so they fuse.
                idle = false;
                q.idle = false;
                deadline = saturating_add(now, self.config.cycle_time);
            }
            // A blocked waiter starts the cycle at once, but only when this rank has work: a waiter whose result
            // has just been delivered must not make an idle engine spin through empty cycles (each one a
            // collective that the other ranks' engines must answer) until its thread gets around to leaving.
            let waiter = !idle && self.shared.waiters.load(Ordering::SeqCst) > 0;
            if now >= deadline || waiter || q.shutdown || q.urgent {
                q.idle = false;
                q.sleeping = false;
                q.urgent = false;
                return;
            }
            q.sleeping = true;
            q = self
                .shared
                .queue_cv
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Fails everything pending and refuses later submissions.
    fn stop(&mut self, reason: Stop) {
        let reason = Arc::new(reason);
        // Handles lock first, queue second (as `submit`): a submission either sees `stopped` or is in the queue
        // taken here, so none is left pending forever.
        let mut h = lock(&self.shared.handles);
        h.stopped = Some(reason.clone());
        // Swaps still queued are dropped with the queue lock: their callers hear that the engine stopped.
        let queued = {
            let mut q = lock(&self.shared.queue);
            q.timeline.clear();
            std::mem::take(&mut q.items)
        };
        let err = EngineError::Stopped(reason);
        for s in queued {
            for handle in s.handles() {
                h.slots.insert(handle, Slot::Done(Err(err.clone())));
            }
        }
        for (_, p) in self.pending.drain() {
            for (handle, r) in outcomes(p.handle, p.members, Err(err.clone())) {
                h.slots.insert(handle, Slot::Done(r));
            }
        }
        if let Some(j) = self.join_handle.take() {
            h.slots.insert(j, Slot::Done(Err(err.clone())));
        }
        drop(h);
        self.shared.handles_cv.notify_all();
        if let Some(t) = &mut self.timeline {
            t.close();
        }
    }

    fn complete(&self, handle: Handle, result: Result<Output, EngineError>) {
        self.complete_many(std::iter::once((handle, result)));
    }

    /// Completes several operations under one lock with one wake-up of the waiters.
    fn complete_many(&self, done: impl IntoIterator<Item = (Handle, Result<Output, EngineError>)>) {
        let mut h = lock(&self.shared.handles);
        let mut any = false;
        for (handle, result) in done {
            h.slots.insert(handle, Slot::Done(result));
            any = true;
        }
        drop(h);
        if any {
            self.shared.handles_cv.notify_all();
        }
    }

    /// Applies the queued `start_timeline` / `stop_timeline` calls in order: the timeline being written is closed
    /// (this thread waits until its writer has written everything), then the new one, if any, is created, and the
    /// caller hears the outcome. Operations in flight get lanes in the new timeline (phases that began in the old
    /// one end there without a trace in the new).
    fn apply_timeline_swaps(&mut self) {
        let swaps = std::mem::take(&mut lock(&self.shared.queue).timeline);
        for TimelineSwap { start, done } in swaps {
            if let Some(mut old) = self.timeline.take() {
                old.close();
            }
            let result = match start {
                Some((path, mark_cycles)) => {
                    open_timeline(&path, self.topology.rank).map(|timeline| {
                        self.timeline = timeline;
                        self.config.timeline_mark_cycles = mark_cycles;
                    })
                }
                None => Ok(()),
            };
            let names: Vec<String> = self.pending.keys().cloned().collect();
            for name in names {
                let lane = self.lane(&name);
                if let Some(p) = self.pending.get_mut(&name) {
                    p.lane = lane;
                }
            }
            let _ = done.send(result);
        }
    }

    /// A tensor's timeline lane. Operations the engine named (`<kind>.noname.<n>`, e.g. every `hvd.barrier()`)
    /// share one lane per kind: a lane each would grow the trace and the lane table by one per call.
    fn lane(&mut self, name: &str) -> u32 {
        match &mut self.timeline {
            Some(t) => match name.split_once(NONAME) {
                Some((kind, _)) => t.lane(&format!("{kind} (unnamed)")),
                None => t.lane(name),
            },
            None => 0,
        }
    }

    fn drain(&mut self) {
        let (items, shutdown, swaps) = {
            let mut q = lock(&self.shared.queue);
            (
                std::mem::take(&mut q.items),
                q.shutdown,
                !q.timeline.is_empty(),
            )
        };
        if swaps {
            self.apply_timeline_swaps();
        }
        if shutdown && !self.shutdown {
            self.shutdown = true;
            self.announce = true;
        }
        // One clock read for the whole batch: they were all drained at this moment.
        let ts = self.timeline.as_ref().map_or(0, |t| t.now_us());
        let mut negotiating = LanesByKind::default();
        for s in items {
            let meta = &s.request.meta;
            if meta.kind == OpKind::Join {
                if self.join_handle.is_some() {
                    self.complete(
                        s.handle,
                        Err(EngineError::InvalidRequest("join called twice".into())),
                    );
                } else {
                    self.join_handle = Some(s.handle);
                    self.announce = true;
                }
                continue;
            }
            if self.pending.contains_key(&meta.name) {
                let msg = format!(
                    "tensor `{}` was submitted again before its previous operation completed",
                    meta.name
                );
                self.complete_many(outcomes(
                    s.handle,
                    s.members,
                    Err(EngineError::InvalidRequest(msg)),
                ));
                continue;
            }
            let name = meta.name.clone();
            let lane = self.lane(&name);
            if self.timeline.is_some() {
                negotiating.add(meta.kind, lane);
            }
            let lookup = if meta.kind.cacheable() {
                self.cache.lookup(meta)
            } else {
                Lookup::Miss
            };
            match lookup {
                Lookup::Hit(slot) if !self.negotiating.contains(&slot) => {
                    self.cached_ready.insert(slot);
                }
                Lookup::Stale(slot) => {
                    self.invalid.insert(slot);
                    self.uncached.push(name.clone());
                }
                _ => self.uncached.push(name.clone()),
            }
            self.pending.insert(
                name,
                Pending {
                    request: s.request,
                    handle: s.handle,
                    members: s.members,
                    lane,
                },
            );
        }
        if let Some(t) = &mut self.timeline {
            negotiating.record(t, Phase::Begin, OpKind::negotiate_name, ts);
        }
    }

    /// One engine cycle. Ok(false) when every rank has shut down.
    fn cycle(&mut self) -> Result<bool, Stop> {
        let cycle_start = self.timeline.as_ref().map(|t| t.now_us());
        self.drain();
        let joined = self.join_handle.is_some() || self.shutdown;
        let now = Instant::now();
        let stall_due = self.config.stall_check_time.is_some_and(|check| {
            let quarter = check / 4;
            self.last_negotiation.elapsed() >= quarter
                && (!self.cached_ready.is_empty()
                    || self
                        .coordinator
                        .as_ref()
                        .is_some_and(|c| c.has_older_than(now, quarter)))
        });
        let news = !self.uncached.is_empty() || stall_due || self.announce;

        let slots = self.cache.len();
        let mut vector = vec![0u8; 1 + 2 * slots];
        vector[0] = u8::from(!news);
        for slot in 0..slots {
            let hit = self.cached_ready.contains(&(slot as u32))
                || (joined && self.can_join(slot as u32));
            vector[1 + slot] = u8::from(hit);
            // A joined rank cannot serve a cached broadcast rooted at itself: it invalidates the entry, so that
            // every rank renegotiates it and the coordinator answers with an error instead of everyone waiting.
            let valid =
                !(self.invalid.contains(&(slot as u32)) || joined && self.joined_root(slot as u32));
            vector[1 + slots + slot] = u8::from(valid);
        }
        self.transport
            .allreduce_in_place(&mut vector, DType::U8, ReduceOp::Min)?;
        self.invalid.clear();

        // Stale entries: every rank evicts them, and their local requests go to the coordinator instead.
        let mut negotiate = vector[0] == 0;
        for slot in 0..slots as u32 {
            if vector[1 + slots + slot as usize] == 0 {
                negotiate = true;
                if self.cached_ready.remove(&slot)
                    && let Some(meta) = self.cache.get(slot)
                {
                    self.uncached.push(meta.name.clone());
                }
                self.negotiating.remove(&slot);
                self.cache.evict(slot);
                vector[1 + slot as usize] = 0;
            }
        }
        let mut fast: Vec<Response> = Vec::new();
        for s in (0..slots as u32).filter(|s| vector[1 + *s as usize] == 1) {
            self.cached_ready.remove(&s);
            let Some(cached) = self.cache.get(s) else {
                continue;
            };
            // The local request equals the cached entry (that is what its hit bit said): move its description
            // into the response instead of cloning the cache's (two allocations per tensor on the hot path). A
            // joined rank without a request uses the cache's.
            let meta = match self.pending.get_mut(&cached.name) {
                Some(p) => take_meta(&mut p.request.meta),
                None => cached.clone(),
            };
            fast.push(Response::Execute {
                meta,
                dim0s: Vec::new(),
                splits: Vec::new(),
                joined: Vec::new(),
            });
        }
        let mut did_work = !fast.is_empty();
        self.execute(fast, false)?;

        let mut keep_going = true;
        if negotiate {
            did_work = true;
            let list = self.negotiate()?;
            self.negotiating = list.negotiating.iter().copied().collect();
            self.execute(list.responses, true)?;
            if let Some(reason) = list.abort {
                return Err(Stop::Stalled(reason));
            }
            keep_going = !list.shutdown;
        }
        self.busy = did_work;
        if let Some(t) = &mut self.timeline {
            if did_work
                && self.config.timeline_mark_cycles
                && let Some(ts) = cycle_start
            {
                t.record(Phase::Instant, EventName::Static("CYCLE_START"), 0, ts);
            }
            t.maybe_send();
        }
        Ok(keep_going)
    }

    /// Whether the cached operation in `slot` is a broadcast rooted at this rank.
    fn joined_root(&self, slot: u32) -> bool {
        self.cache
            .get(slot)
            .is_some_and(|m| m.kind == OpKind::Broadcast && m.root as usize == self.topology.rank)
    }

    /// Whether this rank, joined, can take part in the cached operation in `slot` without data.
    fn can_join(&self, slot: u32) -> bool {
        match self.cache.get(slot) {
            Some(m) => m.kind != OpKind::Broadcast || m.root as usize != self.topology.rank,
            None => false,
        }
    }

    fn negotiate(&mut self) -> Result<ResponseList, Stop> {
        self.last_negotiation = Instant::now();
        self.announce = false;
        let requests = std::mem::take(&mut self.uncached)
            .into_iter()
            .filter_map(|n| self.pending.get(&n).map(|p| p.request.meta.clone()))
            .collect();
        let message = RankMessage {
            joined: self.join_handle.is_some() || self.shutdown,
            shutdown: self.shutdown,
            requests,
            cached_ready: self.cached_ready.iter().copied().collect(),
        };
        let all = allgather_bytes(&mut *self.transport, &message.encode())?;
        let list_bytes = match &mut self.coordinator {
            Some(c) => {
                let messages = all
                    .iter()
                    .map(|b| RankMessage::decode(b))
                    .collect::<Result<Vec<_>, _>>()?;
                let stall = StallPolicy {
                    check: self.config.stall_check_time,
                    shutdown: self.config.stall_shutdown_time,
                };
                c.process(messages, &self.cache, Instant::now(), stall)
                    .encode()
            }
            None => Vec::new(),
        };
        let bytes = broadcast_bytes(&mut *self.transport, list_bytes, 0)?;
        Ok(ResponseList::decode(&bytes)?)
    }

    /// Runs responses in order, fusing allreduces. `from_coordinator`: successful ones enter the cache.
    fn execute(&mut self, responses: Vec<Response>, from_coordinator: bool) -> Result<(), Stop> {
        if responses.is_empty() {
            return Ok(());
        }
        if self.timeline.is_some() {
            // Negotiation ends and the queue begins for all of them at once: one event per kind of operation.
            let mut executing = LanesByKind::default();
            for meta in responses.iter().filter_map(|r| match r {
                Response::Execute { meta, .. } => Some(meta),
                _ => None,
            }) {
                if let Some(p) = self.pending.get(&meta.name) {
                    executing.add(meta.kind, p.lane);
                }
            }
            if let Some(t) = &mut self.timeline {
                let ts = t.now_us();
                executing.record(t, Phase::Execute, OpKind::upper, ts);
            }
        }
        for work in self.plan(responses) {
            match work {
                Work::Fused(metas) => {
                    self.run_fused(&metas)?;
                    if from_coordinator {
                        metas.iter().for_each(|m| self.cache.insert(m));
                    }
                }
                Work::Single(Response::Execute {
                    meta,
                    dim0s,
                    splits,
                    ..
                }) => {
                    self.run_single(&meta, &dim0s, &splits)?;
                    if from_coordinator {
                        self.cache.insert(&meta);
                    }
                }
                Work::Single(Response::Error { names, message }) => {
                    for n in names {
                        if let Some(p) = self.pending.remove(&n) {
                            if let Some(t) = &mut self.timeline {
                                t.end(p.lane);
                            }
                            self.complete_many(outcomes(
                                p.handle,
                                p.members,
                                Err(EngineError::Mismatch(message.clone())),
                            ));
                        }
                    }
                }
                Work::Single(Response::JoinDone { last_rank }) => {
                    if let Some(h) = self.join_handle.take() {
                        self.complete(
                            h,
                            Ok(Output {
                                value: i64::from(last_rank),
                                ..Output::default()
                            }),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Groups allreduces with the same dtype, op and scale factors up to the fusion threshold; everything else runs
    /// alone. Deterministic, so every rank forms the same groups.
    fn plan(&self, responses: Vec<Response>) -> Vec<Work> {
        let threshold = self.config.fusion_threshold;
        let mut work: Vec<Work> = Vec::new();
        let mut open: Vec<(usize, usize)> = Vec::new(); // (index in work, bytes so far)
        for r in responses {
            match r {
                // A group fused at submission (`splits` set) always runs fused (staged over its members).
                Response::Execute { meta, .. }
                    if meta.kind == OpKind::Allreduce
                        && (threshold > 0 && meta.bytes() < self.fusion_max_tensor_bytes
                            || !meta.splits.is_empty()) =>
                {
                    let bytes = meta.bytes();
                    let slot = open.iter_mut().find(|(i, total)| {
                        let Work::Fused(group) = &work[*i] else {
                            return false;
                        };
                        let g = &group[0];
                        g.dtype == meta.dtype
                            && g.op == meta.op
                            && g.prescale.to_bits() == meta.prescale.to_bits()
                            && g.postscale.to_bits() == meta.postscale.to_bits()
                            && *total + bytes <= threshold
                    });
                    match slot {
                        Some((i, total)) => {
                            *total += bytes;
                            if let Work::Fused(group) = &mut work[*i] {
                                group.push(meta);
                            }
                        }
                        None => {
                            open.push((work.len(), bytes));
                            work.push(Work::Fused(vec![meta]));
                        }
                    }
                }
                other => work.push(Work::Single(other)),
            }
        }
        work
    }

    fn activity(&mut self, kind: OpKind) -> EventName {
        if let Some(name) = self.activity_names.get(&kind) {
            return name.clone();
        }
        let name = EventName::Owned(format!("{}_{}", self.transport_name, kind.upper()).into());
        self.activity_names.insert(kind, name.clone());
        name
    }

    /// The timeline lanes of `metas` (none without a timeline: no lookups).
    fn lanes_of<'a>(&self, metas: impl IntoIterator<Item = &'a RequestMeta>) -> Lanes {
        if self.timeline.is_none() {
            return Lanes::Group(Arc::from([]));
        }
        Lanes::Group(
            metas
                .into_iter()
                .filter_map(|m| self.pending.get(&m.name).map(|p| p.lane))
                .collect(),
        )
    }

    /// One timeline event for every lane of a group (one push, whatever the group's size).
    fn mark(&mut self, lanes: &Lanes, phase: Phase, name: Option<EventName>) {
        if let Some(t) = &mut self.timeline {
            t.mark(phase, name.unwrap_or(EventName::Static("")), lanes);
        }
    }
}

/// Moves a request's description out, leaving its scalar fields and empty name, shape and splits.
fn take_meta(m: &mut RequestMeta) -> RequestMeta {
    let rest = RequestMeta {
        kind: m.kind,
        name: String::new(),
        dtype: m.dtype,
        shape: Vec::new(),
        op: m.op,
        root: m.root,
        prescale: m.prescale,
        postscale: m.postscale,
        splits: Vec::new(),
    };
    std::mem::replace(m, rest)
}

/// Timeline lanes that reach one phase at one moment, by kind of operation: one event per kind instead of one per
/// tensor (a batch of a hundred submissions costs the engine thread a push or two).
#[derive(Default)]
struct LanesByKind(Vec<(OpKind, Vec<u32>)>);

impl LanesByKind {
    fn add(&mut self, kind: OpKind, lane: u32) {
        match self.0.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, lanes)) => lanes.push(lane),
            None => self.0.push((kind, vec![lane])),
        }
    }

    /// One event per kind: `phase`, named `name(kind)`, on all of that kind's lanes.
    fn record(self, t: &mut Timeline, phase: Phase, name: fn(OpKind) -> &'static str, ts: u64) {
        for (kind, lanes) in self.0 {
            t.record_lanes(
                phase,
                EventName::Static(name(kind)),
                Lanes::Group(lanes.into()),
                ts,
            );
        }
    }
}
