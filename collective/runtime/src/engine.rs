//! The engine: a background thread per process that owns the transport and runs named collectives submitted from
//! any thread, in the same order on every rank.
//!
//! Each cycle: drain the submission queue; allreduce (min) one byte vector `[no-news, hit bits.., valid bits..]`;
//! run the tensors whose cache bit every rank set (the fast path, no coordinator); if any rank has new requests,
//! a stale cache entry, a join, a shutdown or an old stalled request, run a negotiation round through the
//! coordinator (rank 0) and execute its response list. Execution fuses allreduces of one dtype/op/scale into one
//! staged allreduce over the members' memory (`fused.rs`). See docs/runtime.md for the protocol.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::cache::{Lookup, ResponseCache};
use crate::config::{ConfigError, EngineConfig};
use crate::coordinator::{Coordinator, StallPolicy};
use crate::fused::FusedIo;
use crate::kernels::{elementwise, fill_identity, scale};
use crate::message::{OpKind, RankMessage, RequestMeta, Response, ResponseList};
use crate::timeline::{EventName, Lanes, Phase, Timeline};
use crate::transport::{Topology, Transport, TransportError};
use hvd_collective::{DType, ReduceOp};

/// Errors the engine reports to callers.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The collective failed on every rank (mismatch between ranks, stall shutdown).
    #[error("{0}")]
    Operation(String),
    /// The engine stopped (shut down or a transport failure); every pending and later operation fails.
    #[error("the hvd engine has stopped: {0}")]
    Stopped(String),
    #[error("unknown handle {0}")]
    UnknownHandle(u64),
    #[error(transparent)]
    Config(Arc<ConfigError>),
    #[error("failed to create the timeline `{path}`: {message}")]
    Timeline { path: String, message: String },
}

/// The timeline this rank writes for `path`, if any: like Horovod, rank 0 writes the timeline; a `{rank}` in the
/// path gives every rank a file of its own.
fn open_timeline(path: &std::path::Path, rank: usize) -> Result<Option<Timeline>, EngineError> {
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
            message: e.to_string(),
        })
}

/// `start_timeline` (a path and whether to mark cycles) or `stop_timeline` (`None`), for the engine thread, which
/// closes the timeline being written first (so a new one may reuse its path), then answers.
struct TimelineSwap {
    start: Option<(std::path::PathBuf, bool)>,
    done: std::sync::mpsc::Sender<Result<(), EngineError>>,
}

/// A tensor's input.
#[derive(Clone)]
pub enum Input {
    None,
    /// Caller memory, valid and unchanged until the operation completes.
    Raw(*const u8, usize),
    Owned(Vec<u8>),
    /// The members of a group fused at submission (see [`Engine::enqueue_many`]), in order, and whether some
    /// member's output overlaps another member's input (see [`outputs_overlap_inputs`]).
    Gather(Vec<(*const u8, usize)>, bool),
}

/// Where a result goes.
#[derive(Clone)]
pub enum OutputBuffer {
    /// Caller memory of exactly the result's size, valid until the operation completes (may equal the input).
    Raw(*mut u8, usize),
    /// The engine allocates the result and returns it in [`Output::data`].
    Engine,
    /// The members' caller memory of a group fused at submission, in order.
    Scatter(Vec<(*mut u8, usize)>),
}

// SAFETY: raw buffers are only touched by the engine thread while the operation is pending; the submitter promises
// (C ABI contract) not to free or use them until the handle completes.
unsafe impl Send for Input {}
// SAFETY: as for `Input`.
unsafe impl Send for OutputBuffer {}

/// A submitted operation.
#[derive(Clone)]
pub struct Request {
    pub meta: RequestMeta,
    pub input: Input,
    pub output: OutputBuffer,
}

impl Request {
    /// An allreduce of an owned buffer, result returned by the engine (Rust callers and tests).
    pub fn allreduce(
        name: &str,
        dtype: DType,
        shape: Vec<i64>,
        op: ReduceOp,
        data: Vec<u8>,
    ) -> Request {
        Request {
            meta: meta(OpKind::Allreduce, name, dtype, shape, op),
            input: Input::Owned(data),
            output: OutputBuffer::Engine,
        }
    }

    /// Any operation on an owned buffer, result returned by the engine.
    pub fn owned(
        kind: OpKind,
        name: &str,
        dtype: DType,
        shape: Vec<i64>,
        data: Vec<u8>,
    ) -> Request {
        Request {
            meta: meta(kind, name, dtype, shape, ReduceOp::Sum),
            input: Input::Owned(data),
            output: OutputBuffer::Engine,
        }
    }
}

/// A request description with defaults (sum, root 0, no scaling, even splits).
pub fn meta(kind: OpKind, name: &str, dtype: DType, shape: Vec<i64>, op: ReduceOp) -> RequestMeta {
    RequestMeta {
        kind,
        name: name.to_string(),
        dtype,
        shape,
        op,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        splits: Vec::new(),
    }
}

/// A completed operation's result.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    /// Engine-allocated result (empty when the result went to caller memory).
    pub data: Vec<u8>,
    pub shape: Vec<i64>,
    /// Alltoall: rows received from each rank.
    pub splits: Vec<i64>,
    /// Join: the rank that joined last.
    pub value: i64,
}

pub type Handle = u64;

/// The middle of the names the engine gives unnamed requests.
const NONAME: &str = ".noname.";

/// Hashes handles (consecutive integers) with one multiplication: SipHash would cost more than the map operation,
/// and a grouped submission does a few per tensor.
#[derive(Default, Clone, Copy)]
pub struct HandleHasher(u64);

impl std::hash::Hasher for HandleHasher {
    fn finish(&self) -> u64 {
        // Fibonacci hashing: the high bits (hashbrown's tag) mix every input bit; the low ones still cycle.
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn write_i64(&mut self, n: i64) {
        self.0 = n as u64;
    }
}

/// A map keyed by handles.
pub type HandleMap<V> = HashMap<Handle, V, std::hash::BuildHasherDefault<HandleHasher>>;

struct Submitted {
    request: Request,
    handle: Handle,
    /// A group fused at submission: its members' shapes; their handles are `handle..handle + len`.
    members: Option<Arc<[Vec<i64>]>>,
}

impl Submitted {
    fn single(request: Request, handle: Handle) -> Submitted {
        Submitted {
            request,
            handle,
            members: None,
        }
    }

    /// Every handle this submission answers.
    fn handles(&self) -> std::ops::Range<Handle> {
        let n = self.members.as_ref().map_or(1, |m| m.len());
        self.handle..self.handle + n as u64
    }
}

/// The result of a submission for each of its handles: a fused group's members get their own shapes.
fn outcomes(
    handle: Handle,
    members: Option<Arc<[Vec<i64>]>>,
    result: Result<Output, EngineError>,
) -> Vec<(Handle, Result<Output, EngineError>)> {
    let Some(shapes) = members else {
        return vec![(handle, result)];
    };
    (handle..)
        .zip(shapes.iter())
        .map(|(h, shape)| {
            let r = match &result {
                Ok(_) => Ok(Output {
                    shape: shape.clone(),
                    ..Output::default()
                }),
                Err(e) => Err(e.clone()),
            };
            (h, r)
        })
        .collect()
}

/// Whether some member's output (`outputs[i]`, members back to back in a fused buffer) overlaps memory that is
/// another member's input, or its own input at another position: a transport that writes the first chunk's results
/// before it reads the next chunk would then read results as input (e.g. one array twice in an in-place group).
/// The members of an in-place group (output = input) do not count. Sorted by address, so checking a group of
/// separate arrays costs a sort and a binary search per member.
fn outputs_overlap_inputs(inputs: &[(*const u8, usize)], outputs: &[(*mut u8, usize)]) -> bool {
    // (start address, end address, start address minus position in the fused buffer), sorted by start.
    let mut ins = Vec::with_capacity(inputs.len());
    let mut at = 0usize;
    for &(p, len) in inputs {
        let a = p as usize;
        ins.push((a, a + len, a.wrapping_sub(at)));
        at += len;
    }
    ins.sort_unstable();
    // The largest end among the first i inputs: inputs before a position that end before an output starts are
    // skipped at once.
    let mut max_end = Vec::with_capacity(ins.len());
    for (i, &(_, end, _)) in ins.iter().enumerate() {
        max_end.push(if i == 0 { end } else { end.max(max_end[i - 1]) });
    }
    let mut at = 0usize;
    for &(p, len) in outputs {
        let (o, oe, shift) = (p as usize, p as usize + len, (p as usize).wrapping_sub(at));
        at += len;
        let mut i = ins.partition_point(|&(a, _, _)| a < oe);
        while i > 0 && max_end[i - 1] > o {
            i -= 1;
            let (_, end, input_shift) = ins[i];
            if end > o && input_shift != shift {
                return true;
            }
        }
    }
    false
}

/// Allreduces that a grouped submission may fuse at once: caller memory in and out, below the size that runs alone.
fn groupable(r: &Request, max_tensor_bytes: usize) -> bool {
    r.meta.kind == OpKind::Allreduce
        && matches!(r.input, Input::Raw(..))
        && matches!(r.output, OutputBuffer::Raw(..))
        && (1..max_tensor_bytes).contains(&r.meta.bytes())
}

/// One submission planned from a list of requests: a request alone, or a group fused at submission. `index` is
/// its (first) request's position in the list, so its handle is the list's first handle plus `index`.
#[derive(Clone)]
struct Part {
    request: Request,
    index: usize,
    members: Option<Arc<[Vec<i64>]>>,
}

impl Part {
    fn submitted(self, base: Handle) -> Submitted {
        Submitted {
            request: self.request,
            handle: base + self.index as u64,
            members: self.members,
        }
    }
}

/// Requests validated and fused once, for repeated submission with [`Engine::enqueue_prepared`] (a training
/// loop's gradients, every step: the per-tensor work is done once, not every step).
pub struct PreparedGroup {
    parts: Vec<Part>,
    len: usize,
}

impl PreparedGroup {
    /// Number of requests (and of handles each submission returns).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// FNV-1a over byte strings, each followed by a separator.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn add(&mut self, bytes: &[u8]) {
        for b in bytes.iter().chain([&0xffu8]) {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// A group of allreduces being fused at submission: consecutive requests from `index`.
struct Group {
    requests: Vec<Request>,
    index: usize,
    bytes: usize,
}

impl Group {
    fn accepts(&self, r: &Request, threshold: usize) -> bool {
        let g = &self.requests[0].meta;
        let m = &r.meta;
        g.dtype == m.dtype
            && g.op == m.op
            && g.prescale.to_bits() == m.prescale.to_bits()
            && g.postscale.to_bits() == m.postscale.to_bits()
            && self.bytes + m.bytes() <= threshold
    }

    /// One part: the request itself for a group of one, else one allreduce over all members, whose name is made of
    /// the first and last member's (so every rank that submits the same group names it alike) and whose `splits`
    /// are the members' element counts followed by a digest of their names and shapes (so ranks whose groups
    /// differ inside get a mismatch, not each other's data).
    fn finish(self) -> Part {
        let mut requests = self.requests;
        let index = self.index;
        if requests.len() == 1 {
            return Part {
                request: requests.remove(0),
                index,
                members: None,
            };
        }
        let n = requests.len();
        let first = &requests[0].meta;
        let name = format!(
            "{} .. {} ({n} tensors)",
            first.name,
            requests[n - 1].meta.name
        );
        let mut meta = meta(OpKind::Allreduce, &name, first.dtype, Vec::new(), first.op);
        meta.prescale = first.prescale;
        meta.postscale = first.postscale;
        let mut inputs = Vec::with_capacity(n);
        let mut outputs = Vec::with_capacity(n);
        let mut shapes = Vec::with_capacity(n);
        let mut digest = Fnv::default();
        for r in requests {
            digest.add(r.meta.name.as_bytes());
            for d in &r.meta.shape {
                digest.add(&d.to_le_bytes());
            }
            meta.splits.push(r.meta.elements() as i64);
            if let (Input::Raw(i, len), OutputBuffer::Raw(o, _)) = (r.input, r.output) {
                inputs.push((i, len));
                outputs.push((o, len));
            }
            shapes.push(r.meta.shape);
        }
        meta.shape = vec![meta.splits.iter().sum()];
        meta.splits.push(digest.0 as i64);
        let aliased = outputs_overlap_inputs(&inputs, &outputs);
        Part {
            request: Request {
                meta,
                input: Input::Gather(inputs, aliased),
                output: OutputBuffer::Scatter(outputs),
            },
            index,
            members: Some(shapes.into()),
        }
    }
}

#[derive(Default)]
struct Queue {
    items: Vec<Submitted>,
    shutdown: bool,
    /// The engine sleeps with nothing to do: a submission must wake it.
    idle: bool,
    /// The engine is blocked on `queue_cv` (idle or waiting for the cycle time): a new waiter must wake it.
    sleeping: bool,
    /// A grouped submission arrived: start the next cycle at once (its tensors are already fused; waiting the
    /// cycle time for more would only delay them).
    urgent: bool,
    /// `start_timeline` / `stop_timeline` calls, for the engine thread to apply in order.
    timeline: Vec<TimelineSwap>,
}

/// How long an engine with nothing to do sleeps between cycles. It cannot hold anyone up: every other rank's
/// pending operation needs a submission from this rank first, and a submission wakes it at once. (Cycling every
/// `HVD_CYCLE_TIME` while idle would only burn the CPU that training needs, in collectives that spin.)
const IDLE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

enum Slot {
    Pending,
    Done(Result<Output, EngineError>),
}

struct Shared {
    queue: Mutex<Queue>,
    queue_cv: Condvar,
    handles: Mutex<Handles>,
    handles_cv: Condvar,
    /// Threads blocked in `wait`: while any, the engine cycles without sleeping.
    waiters: AtomicUsize,
    next_handle: AtomicU64,
    noname: AtomicU64,
}

#[derive(Default)]
struct Handles {
    slots: HandleMap<Slot>,
    stopped: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic on another thread must not turn every later call into a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The per-process engine. Dropping it shuts it down.
pub struct Engine {
    shared: Arc<Shared>,
    spin: std::time::Duration,
    fusion_threshold: usize,
    /// The transport's [`Transport::fusion_max_tensor_bytes`].
    fusion_max_tensor_bytes: usize,
    topology: Topology,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Starts the background thread, which owns `transport` from now on.
    pub fn start(
        transport: Box<dyn Transport>,
        config: EngineConfig,
    ) -> Result<Engine, EngineError> {
        let topology = transport.topology();
        let config_spin = config.spin_time;
        let fusion_threshold = config.fusion_threshold;
        let fusion_max_tensor_bytes = transport.fusion_max_tensor_bytes();
        let timeline = match &config.timeline {
            Some(path) => open_timeline(path, topology.rank)?,
            None => None,
        };
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            queue_cv: Condvar::new(),
            handles: Mutex::new(Handles::default()),
            handles_cv: Condvar::new(),
            waiters: AtomicUsize::new(0),
            next_handle: AtomicU64::new(1),
            noname: AtomicU64::new(0),
        });
        let worker = Worker {
            coordinator: (topology.rank == 0).then(|| Coordinator::new(topology.size)),
            cache: ResponseCache::new(config.cache_capacity),
            transport,
            topology,
            config,
            shared: shared.clone(),
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
            fusion_max_tensor_bytes,
            timeline,
            last_negotiation: Instant::now(),
            activity_names: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name("hvd-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Stopped(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            spin: config_spin,
            fusion_threshold,
            fusion_max_tensor_bytes,
            shared,
            topology,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// Submits an operation; the result comes through [`Engine::wait`] / [`Engine::poll`].
    pub fn enqueue(&self, mut request: Request) -> Result<Handle, EngineError> {
        self.name(&mut request);
        validate(&mut request, self.topology.size)?;
        let handle = self.shared.next_handle.fetch_add(1, Ordering::Relaxed);
        self.submit(vec![Submitted::single(request, handle)], false)?;
        Ok(handle)
    }

    /// Submits several operations at once (one lock round and at most one wake-up of the engine thread), so that
    /// they reach the same cycle and fuse. One result per request, in order.
    ///
    /// With fusion on, consecutive allreduces of one dtype, op and scale factors (each below the transport's
    /// `fusion_max_tensor_bytes`, together within the fusion threshold, in and out of caller memory) are fused
    /// right here: the engine negotiates, caches and runs them as one tensor, instead of doing the same bookkeeping
    /// for each member every cycle. Every rank must then submit the same group (as with any collective, the same
    /// calls in the same order); members still get handles and results of their own.
    pub fn enqueue_many(
        &self,
        requests: impl IntoIterator<Item = Request>,
    ) -> Vec<Result<Handle, EngineError>> {
        let (verdicts, parts) = self.plan(requests);
        let base = self
            .shared
            .next_handle
            .fetch_add(verdicts.len() as u64, Ordering::Relaxed);
        let submitted = parts.into_iter().map(|p| p.submitted(base)).collect();
        let stopped = self.submit(submitted, true).err();
        (base..)
            .zip(verdicts)
            .map(|(handle, v)| match (&stopped, v) {
                (_, Err(e)) => Err(e),
                (Some(e), Ok(())) => Err(e.clone()),
                (None, Ok(())) => Ok(handle),
            })
            .collect()
    }

    /// Validates `requests` and fuses them like [`enqueue_many`](Self::enqueue_many) once, for submission again
    /// and again with [`enqueue_prepared`](Self::enqueue_prepared). The first invalid request is the error.
    pub fn prepare(
        &self,
        requests: impl IntoIterator<Item = Request>,
    ) -> Result<PreparedGroup, EngineError> {
        let (verdicts, parts) = self.plan(requests);
        let len = verdicts.len();
        match verdicts.into_iter().find_map(Result::err) {
            Some(e) => Err(e),
            None => Ok(PreparedGroup { parts, len }),
        }
    }

    /// Submits a prepared group: returns the first of its `group.len()` consecutive handles (one per request, in
    /// order). The requests' buffers must be valid, as for any submission, until the handles complete.
    pub fn enqueue_prepared(&self, group: &PreparedGroup) -> Result<Handle, EngineError> {
        let base = self
            .shared
            .next_handle
            .fetch_add(group.len as u64, Ordering::Relaxed);
        self.submit(
            group
                .parts
                .iter()
                .map(|p| p.clone().submitted(base))
                .collect(),
            true,
        )?;
        Ok(base)
    }

    /// Submits a prepared group that is one operation (its requests fused into one, or a single request) with one
    /// handle for all of it: no handle per member to create, complete and release on every step. `None` for a
    /// group of several parts (submit it with [`enqueue_prepared`](Self::enqueue_prepared)).
    pub fn enqueue_prepared_whole(
        &self,
        group: &PreparedGroup,
    ) -> Result<Option<Handle>, EngineError> {
        let [part] = group.parts.as_slice() else {
            return Ok(None);
        };
        let handle = self.shared.next_handle.fetch_add(1, Ordering::Relaxed);
        self.submit(vec![Submitted::single(part.request.clone(), handle)], true)?;
        Ok(Some(handle))
    }

    /// Names an unnamed request uniquely: `<kind>.noname.<n>`.
    fn name(&self, request: &mut Request) {
        if request.meta.name.is_empty() {
            let n = self.shared.noname.fetch_add(1, Ordering::Relaxed);
            request.meta.name = format!("{}{NONAME}{n}", request.meta.kind.name());
        }
    }

    /// Each request's verdict, and the parts to submit: requests alone, or consecutive valid groupable ones fused.
    fn plan(
        &self,
        requests: impl IntoIterator<Item = Request>,
    ) -> (Vec<Result<(), EngineError>>, Vec<Part>) {
        let threshold = self.fusion_threshold;
        let mut verdicts = Vec::new();
        let mut parts = Vec::new();
        let mut group: Option<Group> = None;
        for (index, mut request) in requests.into_iter().enumerate() {
            self.name(&mut request);
            let verdict = validate(&mut request, self.topology.size);
            let fusable = verdict.is_ok()
                && threshold > 0
                && groupable(&request, self.fusion_max_tensor_bytes);
            match &mut group {
                Some(g) if fusable && g.accepts(&request, threshold) => {
                    g.bytes += request.meta.bytes();
                    g.requests.push(request);
                }
                _ => {
                    // A group's members have consecutive handles: anything else ends it.
                    parts.extend(group.take().map(Group::finish));
                    if fusable {
                        group = Some(Group {
                            bytes: request.meta.bytes(),
                            requests: vec![request],
                            index,
                        });
                    } else if verdict.is_ok() {
                        parts.push(Part {
                            request,
                            index,
                            members: None,
                        });
                    }
                }
            }
            verdicts.push(verdict);
        }
        parts.extend(group.take().map(Group::finish));
        (verdicts, parts)
    }

    /// Hands submissions to the engine thread (fails them all once the engine has stopped). `urgent`: a grouped
    /// submission, which starts a cycle at once.
    fn submit(&self, submitted: Vec<Submitted>, urgent: bool) -> Result<(), EngineError> {
        if submitted.is_empty() {
            return Ok(());
        }
        // Handles lock first, queue second (as `Worker::stop`), both held: the engine cannot stop between the check
        // and the push and leave these pending forever.
        let mut h = lock(&self.shared.handles);
        if let Some(reason) = &h.stopped {
            return Err(EngineError::Stopped(reason.clone()));
        }
        for s in &submitted {
            for handle in s.handles() {
                h.slots.insert(handle, Slot::Pending);
            }
        }
        let mut q = lock(&self.shared.queue);
        q.items.extend(submitted);
        q.urgent |= urgent;
        let wake = q.idle || urgent && q.sleeping;
        drop(q);
        drop(h);
        if wake {
            self.shared.queue_cv.notify_one();
        }
        Ok(())
    }

    /// Whether the operation has completed (successfully or not).
    pub fn poll(&self, handle: Handle) -> Result<bool, EngineError> {
        match lock(&self.shared.handles).slots.get(&handle) {
            Some(Slot::Pending) => Ok(false),
            Some(Slot::Done(_)) => Ok(true),
            None => Err(EngineError::UnknownHandle(handle)),
        }
    }

    /// Whether every one of `handles` has completed.
    pub fn poll_all(&self, handles: &[Handle]) -> Result<bool, EngineError> {
        let h = lock(&self.shared.handles);
        for handle in handles {
            match h.slots.get(handle) {
                Some(Slot::Pending) => return Ok(false),
                Some(Slot::Done(_)) => {}
                None => return Err(EngineError::UnknownHandle(*handle)),
            }
        }
        Ok(true)
    }

    /// Blocks until every one of `handles` completes and returns their results in order; the handles are released.
    /// One waiter for the whole group: the engine wakes it once per batch of completions, not once per handle.
    pub fn wait_all(&self, handles: &[Handle]) -> Vec<Result<Output, EngineError>> {
        self.announce_waiter();
        let mut results = Vec::with_capacity(handles.len());
        let mut h = lock(&self.shared.handles);
        let spin_until = Instant::now() + self.spin;
        while results.len() < handles.len() {
            let handle = handles[results.len()];
            match h.slots.get(&handle) {
                None => results.push(Err(EngineError::UnknownHandle(handle))),
                Some(Slot::Done(_)) => {
                    let Some(Slot::Done(result)) = h.slots.remove(&handle) else {
                        unreachable!("checked above")
                    };
                    results.push(result);
                }
                Some(Slot::Pending) if Instant::now() < spin_until => {
                    drop(h);
                    std::thread::yield_now();
                    h = lock(&self.shared.handles);
                }
                Some(Slot::Pending) => {
                    h = self
                        .shared
                        .handles_cv
                        .wait(h)
                        .unwrap_or_else(|e| e.into_inner());
                }
            }
        }
        drop(h);
        self.shared.waiters.fetch_sub(1, Ordering::SeqCst);
        results
    }

    /// Announces a blocked waiter: the engine then starts a cycle at once instead of after the cycle time.
    fn announce_waiter(&self) {
        self.shared.waiters.fetch_add(1, Ordering::SeqCst);
        let q = lock(&self.shared.queue); // so the notification cannot fall between the engine's check and its sleep
        let sleeping = q.sleeping;
        drop(q);
        if sleeping {
            self.shared.queue_cv.notify_one();
        }
    }

    /// Blocks until the operation completes and returns its result; the handle is released.
    pub fn wait(&self, handle: Handle) -> Result<Output, EngineError> {
        self.announce_waiter();
        // Small operations finish within tens of microseconds: yield-spin briefly before sleeping, which saves a
        // futex round trip on the latency path.
        let spin_until = Instant::now() + self.spin;
        let result = loop {
            let h = lock(&self.shared.handles);
            match h.slots.get(&handle) {
                None => break Err(EngineError::UnknownHandle(handle)),
                Some(Slot::Done(_)) => {
                    let mut h = h;
                    let Some(Slot::Done(result)) = h.slots.remove(&handle) else {
                        unreachable!("checked above")
                    };
                    break result;
                }
                Some(Slot::Pending) if Instant::now() < spin_until => {
                    drop(h);
                    std::thread::yield_now();
                }
                Some(Slot::Pending) => {
                    drop(
                        self.shared
                            .handles_cv
                            .wait(h)
                            .unwrap_or_else(|e| e.into_inner()),
                    );
                }
            }
        };
        self.shared.waiters.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// Stops the engine once every rank has asked to (until then this rank takes part as a joined rank, so the
    /// others can finish). Idempotent.
    pub fn shutdown(&self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.queue_cv.notify_one();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }

    /// Starts writing a timeline to `path` (as `HVD_TIMELINE` does at start; a timeline already being written is
    /// closed first, so the same path may be given again). Returns once the engine thread has switched (between
    /// cycles), or the error creating the file. Like Horovod's `start_timeline`, every rank calls it; the ranks
    /// that do not write a timeline just close theirs, if any.
    pub fn start_timeline(
        &self,
        path: &std::path::Path,
        mark_cycles: bool,
    ) -> Result<(), EngineError> {
        self.swap_timeline(Some((path.to_path_buf(), mark_cycles)))
    }

    /// Stops writing the timeline: once this returns, the file is complete (valid JSON, every event written).
    pub fn stop_timeline(&self) -> Result<(), EngineError> {
        self.swap_timeline(None)
    }

    fn swap_timeline(&self, start: Option<(std::path::PathBuf, bool)>) -> Result<(), EngineError> {
        let (done, wait) = std::sync::mpsc::channel();
        {
            // Handles lock first, queue second, as `submit`: a stopping engine either sees this or has stopped.
            let h = lock(&self.shared.handles);
            if let Some(reason) = &h.stopped {
                return Err(EngineError::Stopped(reason.clone()));
            }
            lock(&self.shared.queue)
                .timeline
                .push(TimelineSwap { start, done });
        }
        self.shared.queue_cv.notify_one();
        // The engine answers, or drops the request when it stops.
        wait.recv().unwrap_or_else(|_| {
            Err(EngineError::Stopped(
                self.stopped().unwrap_or_else(|| "stopped".into()),
            ))
        })
    }

    /// Why the engine stopped, if it has.
    pub fn stopped(&self) -> Option<String> {
        lock(&self.shared.handles).stopped.clone()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn validate(request: &mut Request, size: usize) -> Result<(), EngineError> {
    let m = &mut request.meta;
    let bad = |s: String| {
        Err(EngineError::InvalidRequest(format!(
            "tensor `{}`: {s}",
            m.name
        )))
    };
    if m.shape.iter().any(|d| *d < 0) {
        return bad(format!("negative dimension in shape {:?}", m.shape));
    }
    let bytes = m.bytes();
    let input_len = match &request.input {
        Input::None => 0,
        Input::Raw(_, n) => *n,
        Input::Owned(v) => v.len(),
        Input::Gather(parts, _) => parts.iter().map(|(_, n)| n).sum(),
    };
    if !m.splits.is_empty() && m.kind != OpKind::Alltoall {
        return bad(format!("splits apply to alltoall, not {}", m.kind.name()));
    }
    let needs_input = !matches!(m.kind, OpKind::Barrier | OpKind::Join);
    if needs_input && input_len != bytes {
        return bad(format!(
            "buffer of {input_len} bytes does not match shape {:?} of {} ({bytes} bytes)",
            m.shape,
            crate::kernels::dtype_name(m.dtype)
        ));
    }
    let output_len = match &request.output {
        OutputBuffer::Raw(_, n) => Some(*n),
        OutputBuffer::Scatter(parts) => Some(parts.iter().map(|(_, n)| n).sum()),
        OutputBuffer::Engine => None,
    };
    if let Some(n) = output_len {
        let expect = match m.kind {
            OpKind::Allreduce | OpKind::Broadcast => bytes,
            _ => {
                return bad(format!(
                    "{} returns an engine-allocated result, not into caller memory",
                    m.kind.name()
                ));
            }
        };
        if n != expect {
            return bad(format!("output buffer of {n} bytes, expected {expect}"));
        }
    }
    match m.kind {
        OpKind::Broadcast if m.root < 0 || m.root as usize >= size => {
            return bad(format!("root rank {} is not in 0..{size}", m.root));
        }
        OpKind::Allgather | OpKind::Alltoall if m.shape.is_empty() => {
            return bad(format!("{} needs at least one dimension", m.kind.name()));
        }
        OpKind::Alltoall => {
            let dim0 = m.dim0();
            if m.splits.is_empty() {
                if dim0 % size as i64 != 0 {
                    return bad(format!(
                        "first dimension {dim0} is not divisible by {size} ranks; pass explicit splits"
                    ));
                }
                m.splits = vec![dim0 / size as i64; size];
            }
            if m.splits.len() != size
                || m.splits.iter().any(|s| *s < 0)
                || m.splits.iter().sum::<i64>() != dim0
            {
                return bad(format!(
                    "splits {:?} must be {size} non-negative counts summing to the first dimension {dim0}",
                    m.splits
                ));
            }
        }
        _ => {}
    }
    if !m.prescale.is_finite() || !m.postscale.is_finite() {
        return bad("prescale and postscale factors must be finite".into());
    }
    Ok(())
}

struct Pending {
    request: Request,
    handle: Handle,
    /// A group fused at submission: its members' shapes (handles `handle..handle + len`).
    members: Option<Arc<[Vec<i64>]>>,
    lane: u32,
}

struct Worker {
    transport: Box<dyn Transport>,
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
    /// The transport's [`Transport::fusion_max_tensor_bytes`].
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
    fn run(mut self) {
        let mut next_cycle = Instant::now();
        let reason = loop {
            if let Err(e) = self.wait_for_cycle(next_cycle, self.busy) {
                break e;
            }
            self.last_cycle = Instant::now();
            next_cycle = self.last_cycle + self.config.cycle_time;
            match self.cycle() {
                Ok(true) => {}
                Ok(false) => break "shut down".to_string(),
                Err(e) => break e,
            }
        };
        self.stop(&reason);
    }

    fn wait_for_cycle(&mut self, deadline: Instant, spin: bool) -> Result<(), String> {
        let idle = self.pending.is_empty()
            && self.join_handle.is_none()
            && !self.shutdown
            && self.uncached.is_empty()
            && self.cached_ready.is_empty();
        if spin && !idle && !self.config.spin_time.is_zero() {
            // Right after a cycle with work the next waiter is likely near: poll before sleeping.
            let until = (Instant::now() + self.config.spin_time).min(deadline);
            while Instant::now() < until {
                if self.shared.waiters.load(Ordering::SeqCst) > 0 {
                    return Ok(());
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
                deadline = now + self.config.cycle_time;
            }
            // A blocked waiter starts the cycle at once, but only when this rank has work: a waiter whose result
            // has just been delivered must not make an idle engine spin through empty cycles (each one a
            // collective that the other ranks' engines must answer) until its thread gets around to leaving.
            let waiter = !idle && self.shared.waiters.load(Ordering::SeqCst) > 0;
            if now >= deadline || waiter || q.shutdown || q.urgent {
                q.idle = false;
                q.sleeping = false;
                q.urgent = false;
                return Ok(());
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
    fn stop(&mut self, reason: &str) {
        // Handles lock first, queue second (as `submit`): a submission either sees `stopped` or is in the queue
        // taken here, so none is left pending forever.
        let mut h = lock(&self.shared.handles);
        h.stopped = Some(reason.to_string());
        // Swaps still queued are dropped with the queue lock: their callers hear that the engine stopped.
        let queued = {
            let mut q = lock(&self.shared.queue);
            q.timeline.clear();
            std::mem::take(&mut q.items)
        };
        let err = EngineError::Stopped(reason.to_string());
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
            negotiating.record(t, Phase::Begin, negotiate_name, ts);
        }
    }

    /// One engine cycle. Ok(false) when every rank has shut down.
    fn cycle(&mut self) -> Result<bool, String> {
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
            .allreduce(&mut vector, DType::U8, ReduceOp::Min)
            .map_err(fail)?;
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
                return Err(reason);
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

    fn negotiate(&mut self) -> Result<ResponseList, String> {
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
        let all = self
            .transport
            .allgather_bytes(&message.encode())
            .map_err(fail)?;
        let list_bytes = match &mut self.coordinator {
            Some(c) => {
                let messages = all
                    .iter()
                    .map(|b| RankMessage::decode(b))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                let stall = StallPolicy {
                    check: self.config.stall_check_time,
                    shutdown: self.config.stall_shutdown_time,
                };
                c.process(messages, &self.cache, Instant::now(), stall)
                    .encode()
            }
            None => Vec::new(),
        };
        let bytes = self
            .transport
            .broadcast_bytes(list_bytes, 0)
            .map_err(fail)?;
        ResponseList::decode(&bytes).map_err(|e| e.to_string())
    }

    /// Runs responses in order, fusing allreduces. `from_coordinator`: successful ones enter the cache.
    fn execute(&mut self, responses: Vec<Response>, from_coordinator: bool) -> Result<(), String> {
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
                                Err(EngineError::Operation(message.clone())),
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
        let name = EventName::Owned(format!("{}_{}", self.transport.name(), kind.upper()).into());
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

    fn run_fused(&mut self, metas: &[RequestMeta]) -> Result<(), String> {
        if metas.len() == 1 && metas[0].splits.is_empty() {
            return self.run_single(&metas[0], &[], &[]);
        }
        let first = &metas[0];
        let (reduction, average) = elementwise(first.op);
        let post = first.postscale
            * if average {
                1.0 / self.topology.size as f64
            } else {
                1.0
            };
        let total: usize = metas.iter().map(|m| m.bytes()).sum();
        let lanes = self.lanes_of(metas);
        self.mark(&lanes, Phase::End, None); // QUEUE
        self.mark(
            &lanes,
            Phase::Begin,
            Some(EventName::Static("MEMCPY_IN_FUSION_BUFFER")),
        );
        let activity = self.activity(OpKind::Allreduce);
        // The members stay where they are: the transport reads them into its buffers and writes the result back
        // (`FusedIo`); results the engine owns get their buffers here.
        let mut owned: Vec<Option<Vec<u8>>> = vec![None; metas.len()];
        let mut io = FusedIo::new(first.dtype, reduction, post);
        let mut snapshot = false;
        for (m, slot) in metas.iter().zip(owned.iter_mut()) {
            let n = m.bytes();
            let Some(p) = self.pending.get(&m.name) else {
                // A joined rank's missing member: the reduction's identity in, nothing out.
                io.input(std::ptr::null(), n, 1.0);
                io.output(std::ptr::null_mut(), n);
                continue;
            };
            match &p.request.input {
                Input::Gather(parts, aliased) => {
                    for &(ptr, len) in parts {
                        io.input(ptr, len, m.prescale);
                    }
                    snapshot |= *aliased;
                }
                input => {
                    let s = input_slice(input);
                    io.input(s.as_ptr(), s.len(), m.prescale);
                }
            }
            match &p.request.output {
                OutputBuffer::Raw(ptr, len) => io.output(*ptr, *len),
                OutputBuffer::Scatter(parts) => {
                    for &(ptr, len) in parts {
                        io.output(ptr, len);
                    }
                }
                OutputBuffer::Engine => {
                    let buf = slot.insert(vec![0u8; n]);
                    io.output(buf.as_mut_ptr(), n);
                }
            }
        }
        if snapshot {
            io.snapshot_inputs();
        }
        if let Some(t) = &mut self.timeline {
            io.phases(t, lanes.clone(), activity);
        }
        let result = self.transport.allreduce_staged(
            total,
            first.dtype,
            reduction,
            &mut io,
            &mut self.fusion,
        );
        io.finish();
        self.mark(&lanes, Phase::End, None); // the operation
        result.map_err(fail)?;
        let mut done = Vec::with_capacity(metas.len());
        for (m, slot) in metas.iter().zip(owned) {
            if let Some(p) = self.pending.remove(&m.name) {
                let shape = if p.members.is_none() {
                    m.shape.clone()
                } else {
                    Vec::new()
                };
                done.push((
                    p,
                    Output {
                        data: slot.unwrap_or_default(),
                        shape,
                        ..Output::default()
                    },
                ));
            }
        }
        self.complete_many(
            done.into_iter()
                .flat_map(|(p, out)| outcomes(p.handle, p.members, Ok(out))),
        );
        Ok(())
    }

    fn run_single(
        &mut self,
        meta: &RequestMeta,
        dim0s: &[i64],
        splits: &[i64],
    ) -> Result<(), String> {
        let lanes = self.lanes_of([meta]);
        self.mark(&lanes, Phase::End, None); // QUEUE
        let activity = self.activity(meta.kind);
        self.mark(&lanes, Phase::Begin, Some(activity));
        let mut p = self.pending.remove(&meta.name);
        let result = self.collective(meta, p.as_mut(), dim0s, splits);
        self.mark(&lanes, Phase::End, None);
        self.mark(&lanes, Phase::End, None);
        let out = result?;
        if let Some(p) = p {
            self.complete(p.handle, Ok(out));
        }
        Ok(())
    }

    /// One collective for one tensor; `p` is None on a joined rank, which contributes no data.
    fn collective(
        &mut self,
        meta: &RequestMeta,
        p: Option<&mut Pending>,
        dim0s: &[i64],
        splits: &[i64],
    ) -> Result<Output, String> {
        let size = self.topology.size;
        let me = self.topology.rank;
        let esize = meta.dtype.size();
        let row_bytes = meta.row_elements() * esize;
        let mut out = Output {
            shape: meta.shape.clone(),
            ..Output::default()
        };
        let (reduction, average) = elementwise(meta.op);
        let t = &mut self.transport;
        match meta.kind {
            OpKind::Allreduce | OpKind::Broadcast => {
                let n = meta.bytes();
                let mut scratch = Vec::new();
                let buf: &mut [u8] = match p {
                    Some(p) => {
                        let input = input_slice(&p.request.input);
                        let (ptr, len) = match &mut p.request.output {
                            OutputBuffer::Raw(ptr, len) => (*ptr, *len),
                            OutputBuffer::Engine => {
                                out.data = vec![0u8; n];
                                (out.data.as_mut_ptr(), n)
                            }
                            // `plan` sends every fused group through `run_fused`.
                            OutputBuffer::Scatter(_) => {
                                return Err(format!(
                                    "tensor group `{}` reached the single-tensor path",
                                    meta.name
                                ));
                            }
                        };
                        // SAFETY: caller memory validated to be `len` bytes and live until completion, or our Vec.
                        let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
                        if !std::ptr::eq(input.as_ptr(), buf.as_ptr()) {
                            buf.copy_from_slice(input);
                        }
                        if meta.kind == OpKind::Allreduce {
                            scale(buf, meta.dtype, meta.prescale);
                        }
                        buf
                    }
                    None => {
                        scratch.resize(n, 0);
                        if meta.kind == OpKind::Allreduce {
                            fill_identity(&mut scratch, meta.dtype, reduction);
                        }
                        &mut scratch
                    }
                };
                if meta.kind == OpKind::Allreduce {
                    t.allreduce(buf, meta.dtype, reduction).map_err(fail)?;
                    let post = meta.postscale * if average { 1.0 / size as f64 } else { 1.0 };
                    scale(buf, meta.dtype, post);
                } else {
                    t.broadcast(buf, meta.root as usize).map_err(fail)?;
                }
            }
            OpKind::Allgather => {
                let counts: Vec<usize> = dim0s.iter().map(|d| *d as usize * row_bytes).collect();
                let mut recv = vec![0u8; counts.iter().sum()];
                let send = p.map(|p| input_slice(&p.request.input)).unwrap_or(&[]);
                t.allgatherv(send, &counts, &mut recv).map_err(fail)?;
                out.data = recv;
                out.shape[0] = dim0s.iter().sum();
            }
            OpKind::Alltoall => {
                if splits.len() != size * size {
                    return Err(format!(
                        "alltoall of `{}`: the coordinator sent {} split counts for {size} ranks",
                        meta.name,
                        splits.len()
                    ));
                }
                // A joined rank (no `p`) sends nothing: the coordinator gave it zero splits.
                let send_counts: Vec<usize> = (0..size)
                    .map(|s| splits[me * size + s] as usize * row_bytes)
                    .collect();
                let recv_rows: Vec<i64> = (0..size).map(|s| splits[s * size + me]).collect();
                let recv_counts: Vec<usize> =
                    recv_rows.iter().map(|r| *r as usize * row_bytes).collect();
                let mut recv = vec![0u8; recv_counts.iter().sum()];
                let send = p.map(|p| input_slice(&p.request.input)).unwrap_or(&[]);
                t.alltoallv(send, &send_counts, &mut recv, &recv_counts)
                    .map_err(fail)?;
                out.data = recv;
                out.shape[0] = recv_rows.iter().sum();
                out.splits = recv_rows;
            }
            OpKind::Reducescatter => {
                let dim0 = meta.dim0() as usize;
                let rows: Vec<usize> = (0..size)
                    .map(|r| dim0 / size + usize::from(r < dim0 % size))
                    .collect();
                let blocks: Vec<usize> = rows.iter().map(|r| r * meta.row_elements()).collect();
                let mut buf = vec![0u8; meta.bytes()];
                match p {
                    Some(p) => {
                        buf.copy_from_slice(input_slice(&p.request.input));
                        scale(&mut buf, meta.dtype, meta.prescale);
                    }
                    None => fill_identity(&mut buf, meta.dtype, reduction),
                }
                let mut mine = vec![0u8; blocks[me] * esize];
                t.reducescatter(&mut buf, &blocks, &mut mine, meta.dtype, reduction)
                    .map_err(fail)?;
                let post = meta.postscale * if average { 1.0 / size as f64 } else { 1.0 };
                scale(&mut mine, meta.dtype, post);
                out.data = mine;
                if out.shape.is_empty() {
                    out.shape = vec![rows[me] as i64];
                } else {
                    out.shape[0] = rows[me] as i64;
                }
            }
            OpKind::Barrier => t.barrier().map_err(fail)?,
            OpKind::Join => {}
        }
        Ok(out)
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

/// A single buffer's input (a fused group's `Gather` is copied piece by piece in `run_fused` instead).
fn input_slice(input: &Input) -> &[u8] {
    match input {
        Input::None | Input::Gather(..) => &[],
        // SAFETY: the submitter guarantees `len` readable bytes until the operation completes.
        Input::Raw(ptr, len) => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        Input::Owned(v) => v,
    }
}

fn fail(e: TransportError) -> String {
    format!("a collective failed: {e}")
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

fn negotiate_name(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Allreduce => "NEGOTIATE_ALLREDUCE",
        OpKind::Allgather => "NEGOTIATE_ALLGATHER",
        OpKind::Broadcast => "NEGOTIATE_BROADCAST",
        OpKind::Alltoall => "NEGOTIATE_ALLTOALL",
        OpKind::Reducescatter => "NEGOTIATE_REDUCESCATTER",
        OpKind::Barrier => "NEGOTIATE_BARRIER",
        OpKind::Join => "NEGOTIATE_JOIN",
    }
}

#[cfg(test)]
mod tests {
    use super::outputs_overlap_inputs;

    #[test]
    fn outputs_overlapping_other_members_inputs_are_found() {
        let mut mem = vec![0u8; 64];
        let base = mem.as_mut_ptr();
        let at = |i: usize| base.wrapping_add(i);
        let ins = |v: &[(usize, usize)]| {
            v.iter()
                .map(|&(o, n)| (at(o).cast_const(), n))
                .collect::<Vec<_>>()
        };
        let outs = |v: &[(usize, usize)]| v.iter().map(|&(o, n)| (at(o), n)).collect::<Vec<_>>();
        // Separate arrays, in place (members listed out of address order).
        let g = [(16, 8), (0, 8), (40, 4)];
        assert!(!outputs_overlap_inputs(&ins(&g), &outs(&g)));
        // Out of place, the same input twice: inputs are only read.
        assert!(!outputs_overlap_inputs(
            &ins(&[(0, 8), (0, 8)]),
            &outs(&[(16, 8), (24, 8)])
        ));
        // One array twice in place.
        let g = [(0, 8), (16, 8), (0, 8)];
        assert!(outputs_overlap_inputs(&ins(&g), &outs(&g)));
        // A member's output overlapping the next member's input.
        assert!(outputs_overlap_inputs(
            &ins(&[(0, 8), (8, 8)]),
            &outs(&[(4, 8), (32, 8)])
        ));
        // Its own input, shifted.
        assert!(outputs_overlap_inputs(&ins(&[(0, 8)]), &outs(&[(4, 8)])));
        assert!(!outputs_overlap_inputs(&[], &[]));
    }
}
