//! `POST /elastic/v1/beat`: an elastic worker's heartbeat (docs/rendezvous.md), and the launcher's side of it
//! ([`RendezvousServer::elastic_silence`]): a worker that has sent one and then sends none for the heartbeat timeout
//! is frozen (a stopped process, a hung or partitioned node), alive to the OS but lost to the job.
//!
//! A heartbeat is a request from the network: it needs the job token like every `/elastic/v1/` request, and only the
//! process that joined as the slot (its `X-Hvd-Join`) may beat for it, so a forged one cannot keep another worker
//! alive. It is remembered per live slot of the step (a bounded map: a slot must be one of the step's workers) and
//! never brings back a worker that ended, left, or was found silent.

use std::time::{Duration, Instant};

use super::http::{HttpError, Request};
use super::{RendezvousServer, Reply, Shared, valid_join};

/// Worker `slot` (`X-Hvd-Rank`) says it is alive: 200 `v1 <round> <lost>`, `<lost>` being the rank in round
/// `<round>` of a member found silent (its other members fail their collective in flight at once), or `-`. 403 unless
/// `X-Hvd-Join` is the identity the slot joined with; 410 when the worker is not alive (ended, left, left out, found
/// silent); 409 when the step is not elastic; 400 for a slot that is not a worker of the step.
pub(super) fn on_elastic_beat(shared: &Shared, request: &Request) -> Reply {
    if request.method != "POST" {
        return Err(HttpError::new(405, "method must be POST"));
    }
    let slot: u32 = request
        .rank
        .as_deref()
        .ok_or_else(|| HttpError::new(400, "an elastic heartbeat needs x-hvd-rank"))?
        .parse()
        .map_err(|_| HttpError::new(400, "x-hvd-rank must be a non-negative integer"))?;
    let join = request
        .join
        .as_deref()
        .filter(|j| valid_join(j))
        .ok_or_else(|| {
            HttpError::new(
                400,
                "an elastic heartbeat needs x-hvd-join (1-64 characters of [A-Za-z0-9._-]): the identity the worker \
                 joined with",
            )
        })?;
    let mut store = shared.lock();
    if store.elastic.is_none() {
        return Err(HttpError::new(409, "this step is not elastic"));
    }
    if store.identity(slot) != Some(Some(join)) {
        return Err(HttpError(
            403,
            format!(
                "worker {slot} did not join from this process (no join as that slot with this x-hvd-join): only a \
                 worker may send its own heartbeat"
            )
            .into(),
        ));
    }
    let Some(membership) = store.elastic.as_mut() else {
        return Err(HttpError::new(409, "this step is not elastic"));
    };
    let beat = membership.beat(slot, Instant::now()).map_err(|e| match e {
        super::elastic::MembershipError::NotAlive { .. } => HttpError(410, e.reason().into()),
        _ => HttpError(400, e.reason().into()),
    })?;
    let lost = beat.lost.map_or_else(|| "-".to_owned(), |r| r.to_string());
    Ok((200, format!("v1 {} {lost}\n", beat.generation).into_bytes()))
}

impl RendezvousServer {
    /// An elastic job's live workers that have sent a heartbeat and then none for `timeout`, with how long they have
    /// been silent (each named once): from now on they are gone like workers left out of a round
    /// ([`RendezvousServer::elastic_dropped`] names them; stop them), and a pending round forms without them. Empty
    /// when not elastic.
    pub fn elastic_silence(&self, timeout: Duration) -> Vec<(u32, Duration)> {
        let mut store = self.shared.lock();
        let quiet = store
            .elastic
            .as_mut()
            .map(|m| m.silence(Instant::now(), timeout))
            .unwrap_or_default();
        if !quiet.is_empty() {
            self.shared.changed.notify_all();
        }
        quiet
    }
}
