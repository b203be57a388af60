//! What the user threads and the engine thread share: the submission queue (user -> engine, with timeline
//! switches) and the handle table (engine -> user), each under its own mutex with a condition variable.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::error::{EngineError, Stop};
use super::request::{Output, Request};

pub type Handle = u64;

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

pub(super) struct Submitted {
    pub(super) request: Request,
    pub(super) handle: Handle,
    /// A group fused at submission: its members' shapes; their handles are `handle..handle + len`.
    pub(super) members: Option<Arc<[Vec<i64>]>>,
}

impl Submitted {
    pub(super) fn single(request: Request, handle: Handle) -> Submitted {
        Submitted {
            request,
            handle,
            members: None,
        }
    }

    /// Every handle this submission answers.
    pub(super) fn handles(&self) -> std::ops::Range<Handle> {
        let n = self.members.as_ref().map_or(1, |m| m.len());
        self.handle..self.handle + n as u64
    }
}

/// The result of a submission for each of its handles: a fused group's members get their own shapes.
pub(super) fn outcomes(
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

/// `start_timeline` (a path and whether to mark cycles) or `stop_timeline` (`None`), for the engine thread, which
/// closes the timeline being written first (so a new one may reuse its path), then answers.
pub(super) struct TimelineSwap {
    pub(super) start: Option<(std::path::PathBuf, bool)>,
    pub(super) done: std::sync::mpsc::Sender<Result<(), EngineError>>,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) items: Vec<Submitted>,
    pub(super) shutdown: bool,
    /// The engine sleeps with nothing to do: a submission must wake it.
    pub(super) idle: bool,
    /// The engine is blocked on `queue_cv` (idle or waiting for the cycle time): a new waiter must wake it.
    pub(super) sleeping: bool,
    /// A grouped submission arrived: start the next cycle at once (its tensors are already fused; waiting the
    /// cycle time for more would only delay them).
    pub(super) urgent: bool,
    /// `start_timeline` / `stop_timeline` calls, for the engine thread to apply in order.
    pub(super) timeline: Vec<TimelineSwap>,
}

/// How long an engine with nothing to do sleeps between cycles. It cannot hold anyone up: every other rank's
/// pending operation needs a submission from this rank first, and a submission wakes it at once. (Cycling every
/// `HVD_CYCLE_TIME` while idle would only burn the CPU that training needs, in collectives that spin.)
pub(super) const IDLE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

pub(super) enum Slot {
    Pending,
    Done(Result<Output, EngineError>),
}

pub(super) struct Shared {
    pub(super) queue: Mutex<Queue>,
    pub(super) queue_cv: Condvar,
    pub(super) handles: Mutex<Handles>,
    pub(super) handles_cv: Condvar,
    /// Threads blocked in `wait`: while any, the engine cycles without sleeping.
    pub(super) waiters: AtomicUsize,
    pub(super) next_handle: AtomicU64,
    pub(super) noname: AtomicU64,
}

#[derive(Default)]
pub(super) struct Handles {
    pub(super) slots: HandleMap<Slot>,
    pub(super) stopped: Option<Arc<Stop>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic on another thread must not turn every later call into a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(super) fn new() -> Shared {
        Shared {
            queue: Mutex::new(Queue::default()),
            queue_cv: Condvar::new(),
            handles: Mutex::new(Handles::default()),
            handles_cv: Condvar::new(),
            waiters: AtomicUsize::new(0),
            next_handle: AtomicU64::new(1),
            noname: AtomicU64::new(0),
        }
    }
}
