//! The engine without Python (not a test): 2 in-process ranks over `hvd-collective`'s shm and tcp communicators,
//! 100 x 4 KiB and 100 x 4 KiB..4 MiB allreduces per step with fusion on and off, and a single 4-byte allreduce, next to the raw
//! communicator's 4-byte latency. `cargo run --release -p hvd-runtime --example engine_bench`

use std::time::Instant;

use hvd_collective::DType;
use hvd_collective::testing::{Backend, LocalJob};
use hvd_runtime::{Engine, EngineConfig, OpKind, ReduceOp, Request, meta};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn engine_run(backend: Backend, fusion_threshold: usize, sizes: &[usize]) -> (f64, f64) {
    let comms = LocalJob::new(2, backend)
        .communicators()
        .expect("connect 2 ranks");
    let results: Vec<(f64, f64)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let config = EngineConfig {
                        fusion_threshold,
                        ..EngineConfig::default()
                    };
                    let e = Engine::start(c, config).expect("engine");
                    let mut one = [0u8; 4];
                    let mut lat = Vec::new();
                    for _ in 0..3000 {
                        let t0 = Instant::now();
                        let m = meta(OpKind::Allreduce, "lat", DType::F32, vec![1], ReduceOp::Sum);
                        // SAFETY: `one` is waited for before it is used again.
                        let r = unsafe {
                            Request::in_caller_memory(m, one.as_ptr(), one.as_mut_ptr(), 4)
                        };
                        let h = e.enqueue(r).expect("enqueue");
                        e.wait(h).expect("allreduce");
                        lat.push(t0.elapsed().as_secs_f64());
                    }
                    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|n| vec![0u8; *n]).collect();
                    let mut steps = Vec::new();
                    for _ in 0..20 {
                        let t0 = Instant::now();
                        let hs: Vec<_> = bufs
                            .iter_mut()
                            .enumerate()
                            .map(|(i, b)| {
                                let n = b.len();
                                let m = meta(
                                    OpKind::Allreduce,
                                    &format!("t{i}"),
                                    DType::F32,
                                    vec![n as i64 / 4],
                                    ReduceOp::Sum,
                                );
                                // SAFETY: every buffer is waited for before the next step.
                                let r = unsafe {
                                    Request::in_caller_memory(m, b.as_ptr(), b.as_mut_ptr(), n)
                                };
                                e.enqueue(r).expect("enqueue")
                            })
                            .collect();
                        for h in hs {
                            e.wait(h).expect("allreduce");
                        }
                        steps.push(t0.elapsed().as_secs_f64());
                    }
                    e.shutdown();
                    (median(lat[500..].to_vec()), median(steps))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    results[0]
}

fn raw_latency(backend: Backend) -> f64 {
    let out = LocalJob::new(2, backend)
        .run(|mut comm| {
            let mut x = [0u8; 4];
            let mut t = Vec::new();
            for _ in 0..3000 {
                let t0 = Instant::now();
                comm.allreduce_in_place(&mut x, DType::F32, ReduceOp::Sum)
                    .expect("allreduce");
                t.push(t0.elapsed().as_secs_f64());
            }
            median(t[500..].to_vec())
        })
        .expect("connect 2 ranks");
    out[0]
}

fn main() {
    for (name, backend) in [("shm", Backend::Shm), ("tcp", Backend::Tcp)] {
        let raw = raw_latency(backend);
        let small = vec![4096; 100];
        let (lat, fused) = engine_run(backend, 128 << 20, &small);
        let (_, unfused) = engine_run(backend, 0, &small);
        // 100 tensors from 4 KiB to 4 MiB, geometric.
        let mixed: Vec<usize> = (0..100)
            .map(|i| (1024.0 * 1024f64.powf(i as f64 / 99.0)) as usize * 4)
            .collect();
        let (_, mixed_fused) = engine_run(backend, 128 << 20, &mixed);
        let (_, mixed_unfused) = engine_run(backend, 0, &mixed);
        println!(
            "{name}: 4 B allreduce raw {:.1} us, through the engine {:.1} us (overhead {:.1} us); 100 x 4 KiB per \
             step: fusion on {:.3} ms, off {:.3} ms, speed-up {:.2}x; 100 x 4 KiB..4 MiB: on {:.2} ms, off {:.2} ms",
            raw * 1e6,
            lat * 1e6,
            (lat - raw) * 1e6,
            fused * 1e3,
            unfused * 1e3,
            unfused / fused,
            mixed_fused * 1e3,
            mixed_unfused * 1e3
        );
    }
}
