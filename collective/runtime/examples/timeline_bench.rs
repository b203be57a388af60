//! How fast the timeline writer turns events into the trace file (not a test): records phases the way the engine
//! does (begin/end pairs on a tensor's lane, a fused group's events on 100 lanes at once), closes the timeline
//! (which waits until everything is written) and prints nanoseconds per written event, on the engine thread and in
//! total.
//!
//! `cargo run --release -p hvd-runtime --example timeline_bench [events, default 2000000]`

use std::sync::Arc;
use std::time::Instant;

use hvd_runtime::timeline::{EventName, Lanes, Phase, Timeline};

fn main() {
    let target: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2_000_000);
    let dir = tempfile::tempdir().expect("a temporary directory");
    for (label, fused) in [
        ("one lane per event", false),
        ("fused group of 100 lanes", true),
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
