//! The [`Engine`] handle, called from user threads: submission, waiting and polling, shutdown, timeline switches.

use std::sync::atomic::{AtomicI8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use super::error::{EngineError, Stop};
use super::fusion::{self, Part, PreparedGroup};
use super::handles::{Handle, Handles, Shared, Slot, Submitted, TimelineSwap, lock};
use super::request::{NONAME, Output, Request, validate};
use super::worker::{Worker, open_timeline};
use crate::config::EngineConfig;
use crate::transport::{Topology, fusion_max_tensor_bytes};
use hvd_collective::Communicator;

/// The per-process engine. Dropping it shuts it down.
pub struct Engine {
    shared: Arc<Shared>,
    spin: std::time::Duration,
    fusion_threshold: usize,
    /// The communicator's [`fusion_max_tensor_bytes`](crate::transport::fusion_max_tensor_bytes).
    fusion_max_tensor_bytes: usize,
    topology: Topology,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Starts the background thread, which owns `transport` from now on.
    pub fn start(
        transport: Box<dyn Communicator>,
        config: EngineConfig,
    ) -> Result<Engine, EngineError> {
        let topology = transport.topology();
        let config_spin = config.spin_time;
        let fusion_threshold = config.fusion_threshold;
        let fusion_max_tensor_bytes = fusion_max_tensor_bytes(&*transport);
        let timeline = match &config.timeline {
            Some(path) => open_timeline(path, topology.rank)?,
            None => None,
        };
        let shared = Arc::new(Shared::new());
        let worker = Worker::new(transport, config, shared.clone(), timeline);
        let thread = std::thread::Builder::new()
            .name("hvd-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Stopped(Arc::new(Stop::Spawn(e))))?;
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
        batch_results(base, verdicts, stopped)
    }

    /// Submits several operations at once, each on its own: one lock round and one wake-up of the engine thread,
    /// as [`enqueue_many`](Self::enqueue_many), but nothing is fused at submission, so each is negotiated by its
    /// name like a request from [`enqueue`](Self::enqueue) and fused by the engine with whatever every rank has
    /// ready. For callers that batch per-tensor submissions at points of their own choosing (the Python package's
    /// `allreduce_async_`): ranks may then batch differently without disagreeing on a fused group's name.
    /// One result per request, in order.
    pub fn enqueue_each(
        &self,
        requests: impl IntoIterator<Item = Request>,
    ) -> Vec<Result<Handle, EngineError>> {
        let mut verdicts = Vec::new();
        let mut valid = Vec::new();
        for mut request in requests {
            self.name(&mut request);
            let verdict = validate(&mut request, self.topology.size);
            if verdict.is_ok() {
                valid.push((verdicts.len(), request));
            }
            verdicts.push(verdict);
        }
        let base = self
            .shared
            .next_handle
            .fetch_add(verdicts.len() as u64, Ordering::Relaxed);
        let submitted = valid
            .into_iter()
            .map(|(i, r)| Submitted::single(r, base + i as u64))
            .collect();
        // Urgent: a batch reaches the library once its caller is done adding to it (it waits, or it is old
        // enough), so waiting the cycle time for more would only delay it.
        let stopped = self.submit(submitted, true).err();
        batch_results(base, verdicts, stopped)
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
            None => Ok(PreparedGroup::new(parts, len)),
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

    /// Each request's verdict, and the parts to submit (see [`fusion::plan`]).
    fn plan(
        &self,
        requests: impl IntoIterator<Item = Request>,
    ) -> (Vec<Result<(), EngineError>>, Vec<Part>) {
        fusion::plan(
            requests,
            |r| self.name(r),
            self.topology.size,
            self.fusion_threshold,
            self.fusion_max_tensor_bytes,
        )
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
        let spin_until = hvd_collective::time::saturating_add(Instant::now(), self.spin);
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
                Some(Slot::Pending) => h = self.await_completion(h, spin_until),
            }
        }
        drop(h);
        self.shared.waiters.fetch_sub(1, Ordering::SeqCst);
        results
    }

    /// Blocks until `handles[index]` completes and releases it, then releases the handles after it that have
    /// completed successfully, up to the first that has not (or failed), marking each one 1 in `done`: the
    /// waits for a batch of per-tensor operations whose results are in the caller's memory, where most waits then
    /// find their handle already released and need no call at all. A handle that failed is left for its own wait
    /// (its error is its own). `handles[index]` is marked too: 1 on success, -1 on failure; one already marked is
    /// not waited for again (1: `Ok`, another thread released it; -1: [`EngineError::UnknownHandle`], its error
    /// went to the thread that waited first). `done` is shared by every thread waiting on the same batch and is
    /// only written under the handle table's lock.
    ///
    /// # Panics
    /// If `index` is out of bounds of `handles`, or `done` is shorter than `handles`.
    pub fn wait_batch(
        &self,
        handles: &[Handle],
        index: usize,
        done: &[AtomicI8],
    ) -> Result<(), EngineError> {
        assert!(index < handles.len() && done.len() >= handles.len());
        let handle = handles[index];
        self.announce_waiter();
        let spin_until = hvd_collective::time::saturating_add(Instant::now(), self.spin);
        let mut h = lock(&self.shared.handles);
        let result = loop {
            match done[index].load(Ordering::Relaxed) {
                0 => {}
                1 => break Ok(()),
                _ => break Err(EngineError::UnknownHandle(handle)),
            }
            match h.slots.get(&handle) {
                None => break Err(EngineError::UnknownHandle(handle)),
                Some(Slot::Done(_)) => {
                    let Some(Slot::Done(result)) = h.slots.remove(&handle) else {
                        unreachable!("checked above")
                    };
                    // Release (as below): another thread that reads the mark and then the tensor must not see the
                    // mark before the data on a weakly ordered CPU (free on x86).
                    done[index].store(if result.is_ok() { 1 } else { -1 }, Ordering::Release);
                    break result.map(drop);
                }
                Some(Slot::Pending) => h = self.await_completion(h, spin_until),
            }
        };
        // Only forward and only while they are done: waits in submission order then cost one pass over the batch
        // in all, not one per wait.
        for (next, mark) in handles[index + 1..].iter().zip(&done[index + 1..]) {
            if mark.load(Ordering::Relaxed) != 0 {
                continue;
            }
            if !matches!(h.slots.get(next), Some(Slot::Done(Ok(_)))) {
                break;
            }
            h.slots.remove(next);
            // Release: the engine's writes of this tensor (ordered before this thread by the handle table's
            // lock) come before the mark for another thread that reads the mark (the Python package reads
            // `done` without a call); free on x86, a barrier on aarch64.
            mark.store(1, Ordering::Release);
        }
        drop(h);
        self.shared.waiters.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// Gives up the handle table until a completion may have come: yields the thread while `spin_until` lies
    /// ahead (small operations finish within tens of microseconds), then sleeps on `handles_cv`. Returns the
    /// table locked again.
    fn await_completion<'a>(
        &'a self,
        h: MutexGuard<'a, Handles>,
        spin_until: Instant,
    ) -> MutexGuard<'a, Handles> {
        if Instant::now() < spin_until {
            drop(h);
            std::thread::yield_now();
            lock(&self.shared.handles)
        } else {
            self.shared
                .handles_cv
                .wait(h)
                .unwrap_or_else(|e| e.into_inner())
        }
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
        let spin_until = hvd_collective::time::saturating_add(Instant::now(), self.spin);
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
                self.stopped().unwrap_or_else(|| Arc::new(Stop::Shutdown)),
            ))
        })
    }

    /// Why the engine stopped, if it has.
    pub fn stopped(&self) -> Option<Arc<Stop>> {
        lock(&self.shared.handles).stopped.clone()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One result per request of a batch whose handles start at `base`: its handle, or its verdict's error when it was
/// invalid, or `stopped` when the engine refused the submission.
fn batch_results(
    base: Handle,
    verdicts: Vec<Result<(), EngineError>>,
    stopped: Option<EngineError>,
) -> Vec<Result<Handle, EngineError>> {
    (base..)
        .zip(verdicts)
        .map(|(handle, v)| match (&stopped, v) {
            (_, Err(e)) => Err(e),
            (Some(e), Ok(())) => Err(e.clone()),
            (None, Ok(())) => Ok(handle),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI8, Ordering};
    use std::time::Duration;

    use super::Engine;
    use crate::config::EngineConfig;
    use crate::engine::{EngineError, Request, meta};
    use crate::message::OpKind;
    use crate::transport::LocalTransport;
    use hvd_collective::{DType, ReduceOp};

    const TENSORS: usize = 12;
    /// Its length differs on rank 1: a mismatch for this tensor only.
    const BAD: usize = 7;

    fn len(rank: usize, i: usize) -> usize {
        if i == BAD && rank == 1 { 3 } else { i + 1 }
    }

    /// Ranks that submit the same per-tensor allreduces in batches split differently (rank 0 all at once, rank 1 in
    /// three batches, the last first) get every result, and the waits of a batch release what has completed after
    /// the waited handle, so most waits find their handle marked; the mismatched tensor's error is its own.
    #[test]
    fn batches_split_differently_on_each_rank_complete_and_keep_errors_apart() {
        let transports = LocalTransport::group(2, Duration::from_secs(10));
        let results: Vec<_> = std::thread::scope(|s| {
            let threads: Vec<_> = transports
                .into_iter()
                .enumerate()
                .map(|(rank, t)| {
                    s.spawn(move || {
                        let e = Engine::start(Box::new(t), EngineConfig::default()).unwrap();
                        let mut bufs: Vec<Vec<f32>> = (0..TENSORS)
                            .map(|i| vec![(rank * 100 + i) as f32; len(rank, i)])
                            .collect();
                        let request = |i: usize, b: &mut Vec<f32>| {
                            let m = meta(
                                OpKind::Allreduce,
                                &format!("t.{i}"),
                                DType::F32,
                                vec![b.len() as i64],
                                ReduceOp::Sum,
                            );
                            let p = b.as_mut_ptr().cast::<u8>();
                            // SAFETY: every buffer outlives the waits below and is not touched meanwhile.
                            unsafe { Request::in_caller_memory(m, p, p, b.len() * 4) }
                        };
                        let batches: Vec<Vec<usize>> = if rank == 0 {
                            vec![(0..TENSORS).collect()]
                        } else {
                            vec![(8..12).collect(), (4..8).collect(), (0..4).collect()]
                        };
                        let mut requests: Vec<Vec<Request>> = Vec::new();
                        for batch in &batches {
                            requests
                                .push(batch.iter().map(|&i| request(i, &mut bufs[i])).collect());
                        }
                        let mut outcomes = vec![None; TENSORS];
                        for (batch, requests) in batches.iter().zip(requests) {
                            let handles: Vec<u64> = e
                                .enqueue_each(requests)
                                .into_iter()
                                .map(Result::unwrap)
                                .collect();
                            let done: Vec<AtomicI8> =
                                handles.iter().map(|_| AtomicI8::new(0)).collect();
                            for (k, &i) in batch.iter().enumerate() {
                                let marked = done[k].load(Ordering::Relaxed);
                                let r = e.wait_batch(&handles, k, &done);
                                outcomes[i] = Some((marked, r.map_err(|e| e.to_string())));
                                assert_ne!(done[k].load(Ordering::Relaxed), 0);
                            }
                            // Waited again: an already released success answers at once.
                            if let Some(k) = batch.iter().position(|&i| i != BAD) {
                                assert!(e.wait_batch(&handles, k, &done).is_ok());
                            }
                            if let Some(k) = batch.iter().position(|&i| i == BAD) {
                                assert!(matches!(
                                    e.wait_batch(&handles, k, &done),
                                    Err(EngineError::UnknownHandle(_))
                                ));
                            }
                        }
                        e.shutdown();
                        (bufs, outcomes)
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        for (rank, (bufs, outcomes)) in results.into_iter().enumerate() {
            let mut found_marked = false;
            for (i, outcome) in outcomes.into_iter().enumerate() {
                let (marked, result) = outcome.unwrap();
                found_marked |= marked == 1;
                if i == BAD {
                    let msg = result.unwrap_err();
                    assert!(msg.contains("t.7"), "rank {rank}: {msg}");
                    assert_eq!(bufs[i], vec![(rank * 100 + i) as f32; len(rank, i)]);
                } else {
                    result.unwrap();
                    assert_eq!(
                        bufs[i],
                        vec![(100 + 2 * i) as f32; i + 1],
                        "rank {rank} t.{i}"
                    );
                }
            }
            // Rank 0's one batch completes in one fused operation (the mismatched tensor aside): after its first
            // wait, later handles are found released.
            if rank == 0 {
                assert!(found_marked, "no wait found its handle released");
            }
        }
    }
}
