//! Heartbeats of an elastic step's workers (docs/running.md, Elastic steps): a worker whose process is alive to the
//! OS but frozen (stopped, a hung or partitioned node: its srun or ssh does not end) stops beating, and once it has
//! been silent for `HVD_HEARTBEAT_TIMEOUT` the launcher counts it lost and stops it, like a worker left out of a round.

use std::collections::BTreeSet;
use std::time::Duration;

use super::{Job, Worker};
use crate::LaunchError;
use crate::engine::PlannedStep;
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

/// Finds the live workers of an elastic step silent for `timeout` since their last heartbeat and says so; the
/// membership counts them gone (the caller stops them as workers a round formed without, and counts them lost).
/// `silent` collects every slot found so far.
pub(super) fn find_silent(
    job: &Job<'_>,
    step: &PlannedStep,
    server: &RendezvousServer,
    workers: &[Worker],
    timeout: Duration,
    silent: &mut BTreeSet<u32>,
) {
    let found = server.elastic_silence(timeout);
    if found.cut_off {
        job.events.event(Event::Note {
            text: format!(
                "warning: no worker of step `{}` has sent a heartbeat for {} s ({}): the launcher seems cut off from \
                 them (its network), not they all frozen at once; none is counted lost until they are heard again",
                step.name,
                timeout.as_secs_f64(),
                hvd_collective::env_vars::HVD_HEARTBEAT_TIMEOUT
            ),
        });
    }
    for (slot, quiet) in found.quiet {
        let host = workers
            .iter()
            .find(|w| w.rank == slot)
            .map_or("its host", |w| w.host.as_str());
        job.events.event(Event::Note {
            text: format!(
                "rank {slot} of step `{}` on {host} sent no heartbeat for {} s ({}): lost; stopping it (elastic)",
                step.name,
                quiet.as_secs_f64().round(),
                hvd_collective::env_vars::HVD_HEARTBEAT_TIMEOUT
            ),
        });
        silent.insert(slot);
    }
}
