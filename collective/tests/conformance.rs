//! One conformance suite for every communicator: each operation against a naive reference, plus mismatched calls
//! and lost peers. Cross product sampled to stay fast on 2 cores: every op x dtype at an odd size, and every size
//! (0, 1, odd, large) for f32, both in place and out of place, on 1 to 4 ranks.

use std::time::Duration;

use hvd_collective::testing::{Backend, LocalJob};
use hvd_collective::{Communicator, DType, Error, ReduceOp, Thresholds};

const LARGE: usize = 70_001;

/// One module per communicator, each running the whole suite.
macro_rules! suite {
    ($($name:ident => $backend:expr),* $(,)?) => {$(
        mod $name {
            use super::*;
            #[test]
            fn every_op_and_dtype_matches_the_reference() {
                super::every_op_and_dtype_matches_the_reference($backend)
            }
            #[test]
            fn both_allreduce_algorithms_match_the_reference() {
                super::both_allreduce_algorithms_match_the_reference($backend)
            }
            #[test]
            fn mismatched_calls_fail_on_every_rank() {
                super::mismatched_calls_fail_on_every_rank($backend)
            }
            #[test]
            fn a_silent_peer_times_out_naming_it() {
                super::a_silent_peer_times_out_naming_it($backend)
            }
            #[test]
            fn a_departed_peer_is_named() {
                super::a_departed_peer_is_named($backend)
            }
        }
    )*};
}

suite! {
    tcp => Backend::Tcp,
    shm => Backend::Shm,
    hierarchical => Backend::Hierarchical,
}

/// Deterministic small values so float sums of four ranks stay exact in every type.
fn value(dtype: DType, rank: usize, seed: usize, i: usize) -> i64 {
    let v = ((rank * 31 + i * 7 + seed * 13) % 11) as i64;
    if dtype == DType::U8 { v } else { v - 5 }
}

fn encode(dtype: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DType::F16 => out.extend(half::f16::from_f64(v).to_ne_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(v).to_ne_bytes()),
            DType::F32 => out.extend((v as f32).to_ne_bytes()),
            DType::F64 => out.extend(v.to_ne_bytes()),
            DType::I8 => out.extend((v as i64 as i8).to_ne_bytes()),
            DType::U8 => out.extend((v as i64 as u8).to_ne_bytes()),
            DType::I32 => out.extend((v as i64 as i32).to_ne_bytes()),
            DType::I64 => out.extend((v as i64).to_ne_bytes()),
        }
    }
    out
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F16 => half::f16::from_ne_bytes([c[0], c[1]]).to_f64(),
            DType::BF16 => half::bf16::from_ne_bytes([c[0], c[1]]).to_f64(),
            DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
            DType::I8 => c[0] as i8 as f64,
            DType::U8 => c[0] as f64,
            DType::I32 => i32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::I64 => i64::from_ne_bytes(c.try_into().unwrap()) as f64,
        })
        .collect()
}

fn input(dtype: DType, rank: usize, seed: usize, count: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..count)
        .map(|i| value(dtype, rank, seed, i) as f64)
        .collect();
    encode(dtype, &vals)
}

/// The reduction of element `i` over `n` ranks, with integer wrap-around at the dtype's width.
fn reference(dtype: DType, op: ReduceOp, n: usize, seed: usize, i: usize) -> f64 {
    let vals: Vec<i64> = (0..n).map(|r| value(dtype, r, seed, i)).collect();
    let wrap = |x: i64| -> i64 {
        match dtype {
            DType::I8 => x as i8 as i64,
            DType::U8 => x as u8 as i64,
            DType::I32 => x as i32 as i64,
            _ => x,
        }
    };
    let float = dtype.is_float();
    match op {
        ReduceOp::Sum => vals.iter().sum::<i64>() as f64,
        ReduceOp::Average if float => vals.iter().sum::<i64>() as f64 / n as f64,
        ReduceOp::Average => (wrap(vals.iter().sum::<i64>()) / n as i64) as f64,
        ReduceOp::Min => *vals.iter().min().unwrap() as f64,
        ReduceOp::Max => *vals.iter().max().unwrap() as f64,
        ReduceOp::Product if float => vals.iter().map(|v| *v as f64).product(),
        ReduceOp::Product => wrap(vals.iter().fold(1i64, |a, b| a.wrapping_mul(*b))) as f64,
    }
    .pipe(|x| if float { x } else { wrap(x as i64) as f64 })
}

trait Pipe: Sized {
    fn pipe<R>(self, f: impl FnOnce(Self) -> R) -> R {
        f(self)
    }
}
impl<T> Pipe for T {}

fn close(dtype: DType, n: usize, got: f64, want: f64) -> bool {
    let eps = match dtype {
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        DType::F32 => 2e-7,
        DType::F64 => 3e-16,
        _ => return got == want,
    };
    (got - want).abs() <= eps * n as f64 * want.abs().max(1.0)
}

fn check(what: &str, dtype: DType, n: usize, got: &[u8], want: &[f64]) -> Result<(), String> {
    let got = decode(dtype, got);
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if !close(dtype, n, *g, *w) {
            return Err(format!("{what}: element {i} is {g}, expected {w}"));
        }
    }
    Ok(())
}

fn counts_v(n: usize, base: usize) -> Vec<usize> {
    (0..n).map(|r| base + r % 3).collect()
}

/// Runs every operation once on `comm` with `dtype`, `count` elements, in place or not.
fn run_all(
    comm: &mut dyn Communicator,
    dtype: DType,
    count: usize,
    in_place: bool,
    seed: usize,
) -> Result<(), String> {
    let n = comm.size();
    let me = comm.rank();
    let es = dtype.size();
    let tag =
        |op: &str| format!("{op} {dtype} x {count} on {n} ranks (rank {me}, in_place={in_place})");
    let ops: &[ReduceOp] = if count == 7 {
        &ReduceOp::ALL
    } else {
        &[ReduceOp::Sum]
    };
    for (k, &op) in ops.iter().enumerate() {
        let s = seed + k;
        let mine = input(dtype, me, s, count);
        let mut out = vec![0u8; mine.len()];
        if in_place {
            out.copy_from_slice(&mine);
            comm.allreduce_in_place(&mut out, dtype, op)
                .map_err(|e| format!("{}: {e}", tag("allreduce")))?;
        } else {
            comm.allreduce(&mine, &mut out, dtype, op)
                .map_err(|e| format!("{}: {e}", tag("allreduce")))?;
        }
        let want: Vec<f64> = (0..count).map(|i| reference(dtype, op, n, s, i)).collect();
        check(&tag(&format!("allreduce {op}")), dtype, n, &out, &want)?;

        // reducescatter with uneven blocks
        let counts = counts_v(n, count);
        let total: usize = counts.iter().sum();
        let off: usize = counts[..me].iter().sum();
        let send = input(dtype, me, s, total);
        let want: Vec<f64> = (off..off + counts[me])
            .map(|i| reference(dtype, op, n, s, i))
            .collect();
        let mut got = if in_place {
            let mut b = send.clone();
            comm.reducescatter_in_place(&mut b, &counts, dtype, op)
                .map_err(|e| format!("{}: {e}", tag("rs")))?;
            b.truncate(counts[me] * es);
            b
        } else {
            let mut b = vec![0u8; counts[me] * es];
            comm.reducescatter(&send, &mut b, &counts, dtype, op)
                .map_err(|e| format!("{}: {e}", tag("rs")))?;
            b
        };
        check(&tag(&format!("reducescatter {op}")), dtype, n, &got, &want)?;
        got.clear();
    }

    // allgather
    let mine = input(dtype, me, seed, count);
    let want: Vec<f64> = (0..n)
        .flat_map(|r| decode(dtype, &input(dtype, r, seed, count)))
        .collect();
    let mut out = vec![0u8; count * es * n];
    if in_place {
        out[me * count * es..(me + 1) * count * es].copy_from_slice(&mine);
        comm.allgather_in_place(&mut out, dtype)
            .map_err(|e| format!("{}: {e}", tag("allgather")))?;
    } else {
        comm.allgather(&mine, &mut out, dtype)
            .map_err(|e| format!("{}: {e}", tag("allgather")))?;
    }
    check(&tag("allgather"), dtype, n, &out, &want)?;

    // allgatherv
    let counts = counts_v(n, count);
    let mine = input(dtype, me, seed, counts[me]);
    let want: Vec<f64> = (0..n)
        .flat_map(|r| decode(dtype, &input(dtype, r, seed, counts[r])))
        .collect();
    let mut out = vec![0u8; counts.iter().sum::<usize>() * es];
    if in_place {
        let off = counts[..me].iter().sum::<usize>() * es;
        out[off..off + mine.len()].copy_from_slice(&mine);
        comm.allgatherv_in_place(&mut out, &counts, dtype)
            .map_err(|e| format!("{}: {e}", tag("allgatherv")))?;
    } else {
        comm.allgatherv(&mine, &mut out, &counts, dtype)
            .map_err(|e| format!("{}: {e}", tag("allgatherv")))?;
    }
    check(&tag("allgatherv"), dtype, n, &out, &want)?;

    // broadcast from every root
    for root in 0..n {
        let mine = input(dtype, me, seed + root, count);
        let want = decode(dtype, &input(dtype, root, seed + root, count));
        let mut out = vec![0u8; mine.len()];
        if in_place {
            out.copy_from_slice(&mine);
            comm.broadcast(&mut out, dtype, root)
                .map_err(|e| format!("{}: {e}", tag("broadcast")))?;
        } else {
            comm.broadcast_out_of_place(&mine, &mut out, dtype, root)
                .map_err(|e| format!("{}: {e}", tag("broadcast")))?;
        }
        check(
            &tag(&format!("broadcast root {root}")),
            dtype,
            n,
            &out,
            &want,
        )?;
    }

    // alltoall: block j of rank r's send = input(r, seed + j)
    let block = |r: usize, j: usize, c: usize| input(dtype, r, seed + 100 * j, c);
    let send: Vec<u8> = (0..n).flat_map(|j| block(me, j, count)).collect();
    let want: Vec<f64> = (0..n)
        .flat_map(|r| decode(dtype, &block(r, me, count)))
        .collect();
    let mut out = vec![0u8; send.len()];
    if in_place {
        out.copy_from_slice(&send);
        comm.alltoall_in_place(&mut out, dtype)
            .map_err(|e| format!("{}: {e}", tag("alltoall")))?;
    } else {
        comm.alltoall(&send, &mut out, dtype)
            .map_err(|e| format!("{}: {e}", tag("alltoall")))?;
    }
    check(&tag("alltoall"), dtype, n, &out, &want)?;

    // alltoallv: rank r sends count + (r + j) % 3 elements to rank j
    let c = |r: usize, j: usize| count + (r + j) % 3;
    let send_counts: Vec<usize> = (0..n).map(|j| c(me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|r| c(r, me)).collect();
    let send: Vec<u8> = (0..n).flat_map(|j| block(me, j, c(me, j))).collect();
    let want: Vec<f64> = (0..n)
        .flat_map(|r| decode(dtype, &block(r, me, c(r, me))))
        .collect();
    let mut out = vec![0u8; recv_counts.iter().sum::<usize>() * es];
    comm.alltoallv(&send, &send_counts, &mut out, &recv_counts, dtype)
        .map_err(|e| format!("{}: {e}", tag("alltoallv")))?;
    check(&tag("alltoallv"), dtype, n, &out, &want)?;

    comm.barrier()
        .map_err(|e| format!("{}: {e}", tag("barrier")))?;
    Ok(())
}

fn conformance(backend: Backend, n: usize) {
    let results = LocalJob::new(n, backend)
        .timeout(Duration::from_secs(20))
        .run(|mut comm| -> Result<(), String> {
            let c = comm.as_mut();
            for (k, dtype) in DType::ALL.into_iter().enumerate() {
                for in_place in [false, true] {
                    run_all(c, dtype, 7, in_place, k)?;
                }
            }
            for count in [0, 1, LARGE] {
                for in_place in [false, true] {
                    run_all(c, DType::F32, count, in_place, count)?;
                }
            }
            Ok(())
        })
        .expect("start the ranks");
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("{backend:?} with {n} ranks, rank {r}: {e}");
        }
    }
}

fn every_op_and_dtype_matches_the_reference(backend: Backend) {
    {
        for n in 1..=4 {
            conformance(backend, n);
        }
    }
}

/// Both allreduce algorithms at every size: recursive doubling forced for large messages, the ring for small ones.
fn both_allreduce_algorithms_match_the_reference(backend: Backend) {
    {
        for n in [2, 3, 4] {
            for small in [0, usize::MAX] {
                let th = Thresholds {
                    allreduce_small_bytes: small,
                    allgather_small_bytes: small,
                };
                let results = LocalJob::new(n, backend)
                    .thresholds(th)
                    .run(|mut comm| -> Result<(), String> {
                        for count in [1, 5, 7, 4099] {
                            run_all(comm.as_mut(), DType::F32, count, false, count)?;
                            run_all(comm.as_mut(), DType::BF16, count, true, count)?;
                        }
                        Ok(())
                    })
                    .expect("start the ranks");
                for (r, res) in results.into_iter().enumerate() {
                    if let Err(e) = res {
                        panic!("{backend:?} n={n} small={small} rank {r}: {e}");
                    }
                }
            }
        }
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Each case is what every rank calls; all ranks must get a mismatch naming the difference, and the communicator
/// must stay usable afterwards.
fn mismatched_calls_fail_on_every_rank(backend: Backend) {
    type Call = fn(&mut dyn Communicator) -> Result<(), Error>;
    let cases: Vec<(&str, Call, &str)> = vec![
        (
            "different operations",
            |c| {
                let mut b = f32s(&[1.0; 4]);
                if c.rank() == 1 {
                    let mut out = vec![0u8; b.len() * c.size()];
                    c.allgather(&b, &mut out, DType::F32)
                } else {
                    c.allreduce_in_place(&mut b, DType::F32, ReduceOp::Sum)
                }
            },
            "allgather",
        ),
        (
            "different sizes",
            |c| {
                let mut b = f32s(&vec![1.0; 4 + usize::from(c.rank() == 2)]);
                c.allreduce_in_place(&mut b, DType::F32, ReduceOp::Sum)
            },
            "x 5",
        ),
        (
            "different dtypes",
            |c| {
                let mut b = vec![0u8; 8];
                let d = if c.rank() == 0 {
                    DType::F32
                } else {
                    DType::I32
                };
                c.allreduce_in_place(&mut b, d, ReduceOp::Sum)
            },
            "i32",
        ),
        (
            "different roots",
            |c| {
                let mut b = vec![0u8; 8];
                c.broadcast(&mut b, DType::U8, c.rank() % 2)
            },
            "root",
        ),
        (
            "invalid arguments on one rank",
            |c| {
                let b = vec![0u8; 8];
                let mut out = vec![0u8; if c.rank() == 1 { 3 } else { 8 }];
                c.allreduce(&b, &mut out, DType::F32, ReduceOp::Max)
            },
            "rank 1",
        ),
        (
            "alltoallv counts that do not pair up",
            |c| {
                let n = c.size();
                let send_counts = vec![1usize; n];
                let mut recv_counts = vec![1usize; n];
                if c.rank() == 0 {
                    recv_counts[n - 1] = 2;
                }
                let send = vec![0u8; n];
                let mut recv = vec![0u8; recv_counts.iter().sum()];
                c.alltoallv(&send, &send_counts, &mut recv, &recv_counts, DType::U8)
            },
            "expects 2",
        ),
    ];
    {
        for (name, call, needle) in &cases {
            let results = LocalJob::new(3, backend)
                .timeout(Duration::from_secs(10))
                .run(|mut comm| {
                    let err = call(comm.as_mut());
                    let mut after = f32s(&[1.0, 2.0]);
                    let after_ok = comm.allreduce_in_place(&mut after, DType::F32, ReduceOp::Sum);
                    (err, after_ok.map(|()| after))
                })
                .expect("start the ranks");
            for (r, (err, after)) in results.into_iter().enumerate() {
                match err {
                    Err(Error::Mismatch { detail, .. }) => {
                        assert!(
                            detail.contains(needle),
                            "{backend:?} {name}: rank {r}: `{detail}` lacks `{needle}`"
                        )
                    }
                    Err(Error::InvalidArgument { .. })
                        if *name == "invalid arguments on one rank" && r == 1 => {}
                    other => {
                        panic!("{backend:?} {name}: rank {r} got {other:?}, expected a mismatch")
                    }
                }
                assert_eq!(
                    after.expect("communicator usable after a mismatch"),
                    f32s(&[3.0, 6.0]),
                    "{name}"
                );
            }
        }
    }
}

/// A rank that stops calling makes every other rank's operation fail within the timeout, naming it.
fn a_silent_peer_times_out_naming_it(backend: Backend) {
    {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (tx, rx) = (std::sync::Mutex::new(tx), std::sync::Mutex::new(rx));
        let results = LocalJob::new(3, backend)
            .timeout(Duration::from_millis(300))
            .run(|mut comm| {
                if comm.rank() == 2 {
                    // Stay alive but silent until both others have failed.
                    let rx = rx.lock().unwrap();
                    for _ in 0..2 {
                        let _ = rx.recv_timeout(Duration::from_secs(15));
                    }
                    return None;
                }
                let mut b = f32s(&[1.0; 1000]);
                let r = comm.allreduce_in_place(&mut b, DType::F32, ReduceOp::Sum);
                let again = comm.barrier();
                let _ = tx.lock().unwrap().send(());
                Some((r, again))
            })
            .expect("start the ranks");
        for (r, res) in results.into_iter().enumerate().take(2) {
            let (err, again) = res.expect("a survivor");
            match err {
                Err(Error::Timeout { ranks, .. }) => {
                    assert!(ranks.contains(&2), "rank {r}: {ranks:?}")
                }
                Err(Error::PeerLost { rank: 2, .. }) => {}
                other => panic!("{backend:?}: rank {r} got {other:?}"),
            }
            assert!(
                matches!(again, Err(Error::Broken(_))),
                "rank {r}: a broken communicator must stay broken"
            );
        }
    }
}

/// A rank that shuts its communicator down while others still expect data is reported as lost.
fn a_departed_peer_is_named(backend: Backend) {
    {
        let results = LocalJob::new(4, backend)
            .timeout(Duration::from_secs(10))
            .run(|mut comm| {
                if comm.rank() == 1 {
                    drop(comm);
                    return Ok(());
                }
                let mut b = f32s(&[1.0; 100_000]);
                comm.allreduce_in_place(&mut b, DType::F32, ReduceOp::Sum)
            })
            .expect("start the ranks");
        for (r, res) in results.into_iter().enumerate() {
            if r == 1 {
                continue;
            }
            match res {
                Err(Error::PeerLost { rank: 1, .. }) => {}
                other => panic!("{backend:?}: rank {r} got {other:?}"),
            }
        }
    }
}
