//! How fast the timeline writer turns events into the trace file (not a test): records phases the way the engine
//! does (begin/end pairs on a tensor's lane, a fused group's events on 100 lanes at once), closes the timeline
//! (which waits until everything is written) and prints nanoseconds per written event, on the engine thread and in
//! total.
//!
//! `cargo run --release -p hvd-runtime --example timeline_bench [events, default 2000000]`
//!
//! The third pattern is the benchmark's per-tensor step as the engine records it (see `per_tensor_step`).

use std::sync::Arc;
use std::time::Instant;

use hvd_runtime::timeline::{EventName, Lanes, Phase, Timeline};

fn main() {
    let target: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2_000_000);
    let dir = tempfile::tempdir().expect("a temporary directory");
    for (label, mode) in [
        ("one lane per event", Mode::OneLane),
        ("fused group of 100 lanes", Mode::Fused),
        (
            "per-tensor step (100 tensors fused by the engine)",
            Mode::PerTensor,
        ),
    ] {
        let path = dir.path().join("timeline.json");
        let mut t = Timeline::create(&path, 0).expect("create the timeline");
        let lanes: Vec<u32> = (0..100).map(|i| t.lane(&format!("grad.{i}"))).collect();
        let group = Lanes::Group(Arc::from(lanes.clone()));
        let activity = EventName::Owned(Arc::from("SHM_ALLREDUCE"));
        let phases = [
            EventName::Static("QUEUE"),
            EventName::Static("MEMCPY_IN_FUSION_BUFFER"),
            activity,
            EventName::Static("MEMCPY_OUT_FUSION_BUFFER"),
        ];
        let started = Instant::now();
        let mut written = 0u64;
        let mut step = 0usize;
        while written < target {
            if mode == Mode::PerTensor {
                written += per_tensor_step(&mut t, &lanes, &group, &phases);
                t.maybe_send();
                continue;
            }
            let fused = mode == Mode::Fused;
            let l = if fused {
                group.clone()
            } else {
                Lanes::One(lanes[step % 100])
            };
            let n = if fused { 100 } else { 1 };
            for name in &phases {
                let ts = t.now_us();
                t.record_lanes(Phase::Begin, name.clone(), l.clone(), ts);
                t.record_lanes(Phase::End, EventName::Static(""), l.clone(), ts + 1);
                written += n;
            }
            t.maybe_send();
            step += 1;
        }
        let recorded = started.elapsed();
        t.close();
        let total = started.elapsed();
        let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        println!(
            "{label}: {written} events ({:.1} MB): {:.0} ns per event on the engine thread, {:.0} ns per event \
             until written",
            bytes as f64 / 1e6,
            recorded.as_nanos() as f64 / written as f64,
            total.as_nanos() as f64 / written as f64,
        );
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    OneLane,
    Fused,
    PerTensor,
}

/// One step of 100 tensors submitted one by one and fused by the engine, recorded as the engine does: each batch
/// of submissions the engine drains (ten of ten here) begins its tensors' negotiation with one event, one event
/// moves them all to the queue, then the fused operation's phases once for all 100 lanes. Returns the events it
/// writes (6 per tensor).
fn per_tensor_step(t: &mut Timeline, lanes: &[u32], group: &Lanes, phases: &[EventName; 4]) -> u64 {
    let ts = t.now_us();
    for (i, batch) in lanes.chunks(10).enumerate() {
        let batch = Lanes::Group(Arc::from(batch));
        t.record_lanes(
            Phase::Begin,
            EventName::Static("NEGOTIATE_ALLREDUCE"),
            batch,
            ts + i as u64,
        );
    }
    let ready = t.now_us() + 100;
    t.record_lanes(
        Phase::Execute,
        EventName::Static("ALLREDUCE"),
        group.clone(),
        ready,
    );
    t.record_lanes(Phase::End, EventName::Static(""), group.clone(), ready + 5);
    for (k, name) in phases[1..].iter().enumerate() {
        let at = ready + 10 * (k as u64 + 1);
        t.record_lanes(Phase::Begin, name.clone(), group.clone(), at);
        t.record_lanes(Phase::End, EventName::Static(""), group.clone(), at + 7);
    }
    t.record_lanes(Phase::End, EventName::Static(""), group.clone(), ready + 50);
    6 * lanes.len() as u64
}
