//! `POST /elastic/v1/beat`: an elastic worker's heartbeat (docs/rendezvous.md), and the launcher's side of it
//! ([`RendezvousServer::elastic_silence`]): a worker that has sent one and then sends none for the heartbeat timeout
//! is frozen (a stopped process, a hung or partitioned node), alive to the OS but lost to the job.
//!
//! A heartbeat is a request from the network: it needs the job token like every `/elastic/v1/` request, and only the
//! process that joined as the slot (its `X-Hvd-Join`) may beat for it, so a forged one cannot keep another worker
//! alive. It is remembered per live slot of the step (a bounded map: a slot must be one of the step's workers) and
//! never brings back a worker that ended, left, or was found silent.

use std::time::{Duration, Instant};

use super::elastic::Silence;
use super::http::Request;
use super::{RendezvousServer, Reply, Shared, as_elastic_worker};

/// Worker `slot` (`X-Hvd-Rank`) says it is alive: 200 `v1 <round> <lost> <timeout>`, `<lost>` being the rank in round
/// `<round>` of a member found silent (its other members fail their collective in flight at once), or `-`, and
/// `<timeout>` the launcher's heartbeat timeout in milliseconds (`-` when not set), which the worker beats often
/// enough for. 413 for a
/// body (a heartbeat has none: refused before anything is read); 403 unless `X-Hvd-Join` is the identity the slot
/// joined with (a slot that never joined, whether or not it is one of the step's, included); 410 when the worker is
/// not alive (ended, left, left out, found silent); 409 when the step is not elastic.
pub(super) fn on_elastic_beat(shared: &Shared, request: &Request) -> Reply {
    let (beat, timeout) = as_elastic_worker(shared, request, "heartbeat", |slot, membership| {
        Ok((membership.beat(slot, Instant::now())?, membership.heartbeat))
    })?;
    let lost = beat.lost.map_or_else(|| "-".to_owned(), |r| r.to_string());
    let timeout = timeout.map_or_else(|| "-".to_owned(), |t| t.as_millis().to_string());
    Ok((
        200,
        format!("v1 {} {lost} {timeout}\n", beat.generation).into_bytes(),
    ))
}

impl RendezvousServer {
    /// The heartbeat timeout the launcher judges an elastic step's workers by (set after
    /// [`RendezvousServer::set_elastic`]): each heartbeat's answer tells it, so that a worker whose own
    /// `HVD_HEARTBEAT_TIMEOUT` is longer (its script or its host's environment changed it) still beats often enough.
    /// Nothing when not elastic.
    pub fn set_elastic_heartbeat(&self, timeout: Duration) {
        if let Some(membership) = self.shared.lock().elastic.as_mut() {
            membership.heartbeat = Some(timeout);
        }
    }

    /// Elastic worker `slot`'s process exited; its exit is reported later (after its output is drained, up to
    /// `--grace`): it is no longer judged by its heartbeats, so it is not found silent in the meantime and counted
    /// lost when it may have finished. Nothing when not elastic.
    pub fn elastic_exited(&self, slot: u32) {
        if let Some(membership) = self.shared.lock().elastic.as_mut() {
            membership.exited(slot);
        }
    }

    /// An elastic job's live workers that have sent a heartbeat and then none for `timeout`, with how long they have
    /// been silent (each named once): from now on they are gone like workers left out of a round
    /// ([`RendezvousServer::elastic_dropped`] names them; stop them), and a pending round forms without them. Nobody
    /// is judged while every worker that beat is quiet at once (the launcher is the one cut off: `cut_off` says so on
    /// the first look of such a stretch). Nothing when not elastic.
    pub fn elastic_silence(&self, timeout: Duration) -> Silence {
        let mut store = self.shared.lock();
        let found = store
            .elastic
            .as_mut()
            .map(|m| m.silence(Instant::now(), timeout))
            .unwrap_or_default();
        if !found.quiet.is_empty() {
            self.shared.changed.notify_all();
        }
        found
    }

    /// The launcher reached the host of an elastic job's workers `slots` while every worker was quiet (after
    /// [`RendezvousServer::elastic_silence`] said `cut_off`): they are judged by `elastic_silence` on their own
    /// silence from now on, two heartbeat intervals from now at the earliest, until a worker is heard again. Returns
    /// whether that silence was still on (`false`: a worker was heard meanwhile, or not elastic).
    pub fn elastic_reached(&self, slots: &[u32], timeout: Duration) -> bool {
        let mut store = self.shared.lock();
        store
            .elastic
            .as_mut()
            .is_some_and(|m| m.reached(slots, Instant::now(), timeout))
    }

    /// Whether every worker of an elastic job that beat is quiet at once (a stretch that
    /// [`RendezvousServer::elastic_silence`] said `cut_off` of, no worker heard since).
    pub fn elastic_silent_all(&self) -> bool {
        self.shared
            .lock()
            .elastic
            .as_ref()
            .is_some_and(|m| m.cut_off())
    }
}
