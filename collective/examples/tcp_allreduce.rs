//! The tcp backend's cost on its own (not a test): the start of a 2-rank job (listen, connect, handshake) and the
//! median time of a 4-byte and a 64 MiB f32 sum allreduce, the slowest rank per iteration, pinned rank threads,
//! the same method as `hvd bench allreduce`.
//! `cargo run --release -p hvd-collective --example tcp_allreduce`

use std::time::Instant;

use hvd_collective::testing::{Backend, LocalJob};
use hvd_collective::{Communicator, DType, ReduceOp};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median over iterations of the slowest rank's time for one allreduce of `bytes`.
fn measure(comm: &mut dyn Communicator, bytes: usize, iters: usize) -> f64 {
    let mut buf: Vec<u8> = (0..bytes / 4).flat_map(|_| 1.0f32.to_ne_bytes()).collect();
    for _ in 0..(iters / 5).clamp(1, 200) {
        comm.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum)
            .expect("warm-up");
    }
    comm.barrier().expect("barrier");
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        comm.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum)
            .expect("allreduce");
        times.push(t.elapsed().as_secs_f64());
    }
    let mut slowest = times.clone();
    // The slowest rank's time per iteration.
    comm.allreduce_in_place(as_bytes(&mut slowest), DType::F64, ReduceOp::Max)
        .expect("gather times");
    median(slowest)
}

fn as_bytes(v: &mut [f64]) -> &mut [u8] {
    // SAFETY: f64 has no invalid bit patterns and u8 has alignment 1; the slice covers exactly `v`'s bytes.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

fn main() {
    let job = LocalJob::new(2, Backend::Tcp).pin_threads(true);
    let starts: Vec<f64> = (0..20)
        .map(|_| {
            let t = Instant::now();
            let comms = job.communicators().expect("connect 2 ranks");
            let s = t.elapsed().as_secs_f64();
            drop(comms);
            s
        })
        .collect();
    println!(
        "job start (2 ranks, listen + connect + handshake): median {:.1} us",
        median(starts) * 1e6
    );
    let rows = job
        .run(|mut comm| {
            [(4usize, 20_000usize), (64 << 20, 20)]
                .map(|(bytes, iters)| (bytes, measure(comm.as_mut(), bytes, iters)))
        })
        .expect("run");
    for (bytes, secs) in rows[0] {
        println!("allreduce {bytes} B over tcp: median {:.2} us", secs * 1e6);
    }
}
