//! The coordinator (rank 0): collects the requests of every rank across cycles, decides what runs and in which
//! order, checks that ranks agree, and inspects stalls.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::cache::ResponseCache;
use crate::message::{OpKind, RankMessage, RequestMeta, Response, ResponseList};

struct TableEntry {
    metas: Vec<Option<RequestMeta>>,
    first_seen: Instant,
}

pub struct Coordinator {
    size: usize,
    /// Requests not yet submitted by every rank, in first-seen order (that order is the execution order).
    table: Vec<(String, TableEntry)>,
    joined: Vec<bool>,
    shutdown: Vec<bool>,
    last_joined: u32,
    /// Cache slots some rank has ready: since when, and which ranks.
    cached_seen: BTreeMap<u32, (Instant, Vec<bool>)>,
    last_warning: HashMap<String, Instant>,
}

/// Stall inspector settings.
#[derive(Debug, Clone, Copy)]
pub struct StallPolicy {
    pub check: Option<Duration>,
    pub shutdown: Option<Duration>,
}

impl Coordinator {
    pub fn new(size: usize) -> Coordinator {
        Coordinator {
            size,
            table: Vec::new(),
            joined: vec![false; size],
            shutdown: vec![false; size],
            last_joined: 0,
            cached_seen: BTreeMap::new(),
            last_warning: HashMap::new(),
        }
    }

    /// Whether the table holds requests older than `age` (rank 0 then forces a negotiation to inspect them).
    pub fn has_older_than(&self, now: Instant, age: Duration) -> bool {
        self.table
            .iter()
            .any(|(_, e)| now.duration_since(e.first_seen) >= age)
            || self
                .cached_seen
                .values()
                .any(|(t, _)| now.duration_since(*t) >= age)
    }

    /// One negotiation round: every rank's message in rank order -> the list every rank executes.
    pub fn process(
        &mut self,
        messages: Vec<RankMessage>,
        cache: &ResponseCache,
        now: Instant,
        stall: StallPolicy,
    ) -> ResponseList {
        let mut responses = Vec::new();
        for (rank, m) in messages.iter().enumerate() {
            if m.joined && !self.joined[rank] {
                self.last_joined = rank as u32;
            }
            self.joined[rank] = m.joined;
            self.shutdown[rank] = m.shutdown;
        }
        for (rank, m) in messages.into_iter().enumerate() {
            for req in m.requests {
                let idx = match self.table.iter().position(|(n, _)| *n == req.name) {
                    Some(i) => i,
                    None => {
                        let entry = TableEntry {
                            metas: vec![None; self.size],
                            first_seen: now,
                        };
                        self.table.push((req.name.clone(), entry));
                        self.table.len() - 1
                    }
                };
                let entry = &mut self.table[idx].1;
                if entry.metas[rank].is_some() {
                    let name = req.name.clone();
                    self.table.remove(idx);
                    responses.push(Response::Error {
                        names: vec![name.clone()],
                        message: format!(
                            "rank {rank} submitted tensor `{name}` twice before it completed"
                        ),
                    });
                    continue;
                }
                entry.metas[rank] = Some(req);
            }
            let mut seen = vec![false; self.size];
            seen[rank] = true;
            for slot in m.cached_ready {
                self.cached_seen
                    .entry(slot)
                    .or_insert((now, vec![false; self.size]))
                    .1[rank] = true;
            }
        }
        // Slots nobody reports any more have run (or been invalidated).
        self.cached_seen
            .retain(|_, (_, ranks)| ranks.iter().any(|r| *r));

        let present: Vec<bool> = (0..self.size)
            .map(|r| self.joined[r] || self.shutdown[r])
            .collect();
        let mut i = 0;
        while i < self.table.len() {
            let entry = &self.table[i].1;
            let ready = entry
                .metas
                .iter()
                .zip(&present)
                .all(|(m, p)| m.is_some() || *p);
            if ready {
                let (name, entry) = self.table.remove(i);
                responses.push(self.decide(&name, entry.metas));
                self.last_warning.remove(&name);
            } else {
                i += 1;
            }
        }
        if self.joined.iter().any(|j| *j) && present.iter().all(|p| *p) {
            responses.push(Response::JoinDone {
                last_rank: self.last_joined,
            });
            self.joined.iter_mut().for_each(|j| *j = false);
        }
        let negotiating = self
            .table
            .iter()
            .filter_map(|(n, _)| cache.slot_of(n))
            .collect();
        let abort = self.inspect_stalls(cache, now, stall);
        // Cached-slot reports are a snapshot of this round; the next negotiation sends them again.
        for (_, ranks) in self.cached_seen.values_mut() {
            ranks.iter_mut().for_each(|r| *r = false);
        }
        ResponseList {
            responses,
            negotiating,
            shutdown: self.shutdown.iter().all(|s| *s),
            abort,
        }
    }

    fn decide(&self, name: &str, metas: Vec<Option<RequestMeta>>) -> Response {
        let error = |message: String| Response::Error {
            names: vec![name.to_string()],
            message,
        };
        let submitted: Vec<(usize, &RequestMeta)> = metas
            .iter()
            .enumerate()
            .filter_map(|(r, m)| m.as_ref().map(|m| (r, m)))
            .collect();
        let joined: Vec<u32> = (0..self.size as u32)
            .filter(|r| metas[*r as usize].is_none())
            .collect();
        let Some(&(r0, first)) = submitted.first() else {
            return error(format!("tensor `{name}` was submitted by no rank"));
        };
        let describe = |f: &dyn Fn(&RequestMeta) -> String| -> String {
            submitted
                .iter()
                .map(|(r, m)| format!("rank {r}: {}", f(m)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if submitted.iter().any(|(_, m)| m.kind != first.kind) {
            return error(format!(
                "mismatched operations for tensor `{name}`: {}",
                describe(&|m| m.kind.name().to_string())
            ));
        }
        let op = first.kind.name();
        if submitted.iter().any(|(_, m)| m.dtype != first.dtype) {
            return error(format!(
                "mismatched data types in {op} of tensor `{name}`: {}",
                describe(&|m| crate::kernels::dtype_name(m.dtype).to_string())
            ));
        }
        if first.kind == OpKind::Allreduce
            && submitted.iter().any(|(_, m)| m.splits != first.splits)
        {
            // Groups fused at submission carry their members' sizes: name them rather than the totals.
            return error(format!(
                "mismatched tensor groups in allreduce `{name}` (every rank must submit the same tensors together): {}",
                describe(&|m| describe_members(&m.splits))
            ));
        }
        let shapes = || describe(&|m| format!("{:?}", m.shape));
        match first.kind {
            OpKind::Allreduce | OpKind::Reducescatter | OpKind::Broadcast => {
                if submitted.iter().any(|(_, m)| m.shape != first.shape) {
                    return error(format!(
                        "mismatched shapes in {op} of tensor `{name}`: {}",
                        shapes()
                    ));
                }
            }
            OpKind::Allgather | OpKind::Alltoall => {
                if submitted.iter().any(|(_, m)| {
                    m.shape.len() != first.shape.len() || m.shape[1..] != first.shape[1..]
                }) {
                    return error(format!(
                        "mismatched shapes in {op} of tensor `{name}` (all dimensions but the first must agree): {}",
                        shapes()
                    ));
                }
            }
            OpKind::Barrier | OpKind::Join => {}
        }
        if matches!(first.kind, OpKind::Allreduce | OpKind::Reducescatter) {
            if submitted.iter().any(|(_, m)| m.op != first.op) {
                return error(format!(
                    "mismatched reduce operations in {op} of tensor `{name}`: {}",
                    describe(&|m| m.op.name().to_string())
                ));
            }
            if submitted.iter().any(|(_, m)| {
                m.prescale.to_bits() != first.prescale.to_bits()
                    || m.postscale.to_bits() != first.postscale.to_bits()
            }) {
                return error(format!(
                    "mismatched prescale/postscale factors in {op} of tensor `{name}`: {}",
                    describe(&|m| format!("{}/{}", m.prescale, m.postscale))
                ));
            }
        }
        let mut dim0s = Vec::new();
        let mut splits = Vec::new();
        match first.kind {
            OpKind::Broadcast => {
                if submitted.iter().any(|(_, m)| m.root != first.root) {
                    return error(format!(
                        "mismatched root ranks in broadcast of tensor `{name}`: {}",
                        describe(&|m| m.root.to_string())
                    ));
                }
                if metas[first.root as usize].is_none() {
                    return error(format!(
                        "the root rank {} of broadcast `{name}` has joined and has no data to send",
                        first.root
                    ));
                }
            }
            OpKind::Allgather => {
                dim0s = metas
                    .iter()
                    .map(|m| m.as_ref().map_or(0, |m| m.dim0()))
                    .collect();
            }
            OpKind::Alltoall => {
                // A joined rank sends no rows (and drops what it receives), as it contributes no rows to an
                // allgather.
                for m in &metas {
                    match m {
                        Some(m) => splits.extend_from_slice(&m.splits),
                        None => splits.extend(std::iter::repeat_n(0, self.size)),
                    }
                }
            }
            _ => {}
        }
        let _ = r0;
        Response::Execute {
            meta: first.clone(),
            dim0s,
            splits,
            joined,
        }
    }

    fn inspect_stalls(
        &mut self,
        cache: &ResponseCache,
        now: Instant,
        stall: StallPolicy,
    ) -> Option<String> {
        let check = stall.check?;
        // rank -> tensors it has not submitted while others wait for it, with the longest wait.
        let mut missing: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        let mut longest = Duration::ZERO;
        let mut warn_names = Vec::new();
        let mut stalled = |name: &str,
                           waited: Duration,
                           have: &dyn Fn(usize) -> bool,
                           last: &mut HashMap<String, Instant>| {
            if waited < check {
                return;
            }
            if stall.shutdown.is_none_or(|s| waited < s)
                && last
                    .get(name)
                    .is_some_and(|t| now.duration_since(*t) < check)
            {
                return;
            }
            for r in 0..self.size {
                if !have(r) && !self.joined[r] {
                    missing.entry(r).or_default().push(name.to_string());
                }
            }
            longest = longest.max(waited);
            warn_names.push(name.to_string());
        };
        for (name, e) in &self.table {
            stalled(
                name,
                now.duration_since(e.first_seen),
                &|r| e.metas[r].is_some(),
                &mut self.last_warning,
            );
        }
        for (slot, (since, ranks)) in &self.cached_seen {
            if let Some(meta) = cache.get(*slot) {
                stalled(
                    &meta.name,
                    now.duration_since(*since),
                    &|r| ranks[r],
                    &mut self.last_warning,
                );
            }
        }
        if missing.is_empty() {
            return None;
        }
        for n in warn_names {
            self.last_warning.insert(n, now);
        }
        let detail = missing
            .iter()
            .map(|(r, names)| format!("rank {r} has not submitted [{}]", names.join(", ")))
            .collect::<Vec<_>>()
            .join("; ");
        let message = format!(
            "stalled for {:.1} s: some ranks submitted tensors that other ranks have not: {detail}. Check that every \
             rank calls the same collectives with the same names",
            longest.as_secs_f64()
        );
        if stall.shutdown.is_some_and(|s| longest >= s) {
            tracing::error!(target: "hvd", "{message}; stopping (HVD_STALL_SHUTDOWN_TIME exceeded)");
            return Some(format!("{message} (HVD_STALL_SHUTDOWN_TIME exceeded)"));
        }
        tracing::warn!(target: "hvd", "{message}");
        None
    }
}

/// A fused group's members for an error message: their count, (the first few) element counts and the digest of
/// their names and shapes (the last entry of `splits`).
fn describe_members(splits: &[i64]) -> String {
    let Some((digest, sizes)) = splits.split_last() else {
        return "one tensor".into();
    };
    let shown: Vec<String> = sizes.iter().take(8).map(i64::to_string).collect();
    let more = if sizes.len() > 8 { ", ..." } else { "" };
    format!(
        "{} tensors of [{}{more}] elements, names and shapes {:016x}",
        sizes.len(),
        shown.join(", "),
        *digest as u64
    )
}
