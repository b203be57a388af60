//! The naive reference every communicator is compared with (shared by the conformance and MPI suites).

#![allow(dead_code, reason = "each test binary uses part of the harness")]

use hvd_collective::{Allgatherv, Alltoallv, Communicator, DType, ReduceOp, Reducescatter};

pub const LARGE: usize = 70_001;

/// Deterministic small values so float sums of four ranks stay exact in every type.
pub fn value(dtype: DType, rank: usize, seed: usize, i: usize) -> i64 {
    let v = ((rank * 31 + i * 7 + seed * 13) % 11) as i64;
    if dtype == DType::U8 { v } else { v - 5 }
}

pub fn encode(dtype: DType, vals: &[f64]) -> Vec<u8> {
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

pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
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

pub fn input(dtype: DType, rank: usize, seed: usize, count: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..count)
        .map(|i| value(dtype, rank, seed, i) as f64)
        .collect();
    encode(dtype, &vals)
}

/// The reduction of element `i` over `n` ranks, with integer wrap-around at the dtype's width.
pub fn reference(dtype: DType, op: ReduceOp, n: usize, seed: usize, i: usize) -> f64 {
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

pub trait Pipe: Sized {
    fn pipe<R>(self, f: impl FnOnce(Self) -> R) -> R {
        f(self)
    }
}
impl<T> Pipe for T {}

pub fn close(dtype: DType, n: usize, got: f64, want: f64) -> bool {
    let eps = match dtype {
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        DType::F32 => 2e-7,
        DType::F64 => 3e-16,
        _ => return got == want,
    };
    (got - want).abs() <= eps * n as f64 * want.abs().max(1.0)
}

pub fn check(what: &str, dtype: DType, n: usize, got: &[u8], want: &[f64]) -> Result<(), String> {
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

pub fn counts_v(n: usize, base: usize) -> Vec<usize> {
    (0..n).map(|r| base + r % 3).collect()
}

/// Runs every operation once on `comm` with `dtype`, `count` elements, in place or not.
pub fn run_all(
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
            comm.reducescatter(Reducescatter {
                send: &send,
                recv: &mut b,
                counts: &counts,
                dtype,
                op,
            })
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
        comm.allgatherv(Allgatherv {
            send: &mine,
            recv: &mut out,
            counts: &counts,
            dtype,
        })
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
    comm.alltoallv(Alltoallv {
        send: &send,
        send_counts: &send_counts,
        recv: &mut out,
        recv_counts: &recv_counts,
        dtype,
    })
    .map_err(|e| format!("{}: {e}", tag("alltoallv")))?;
    check(&tag("alltoallv"), dtype, n, &out, &want)?;

    comm.barrier()
        .map_err(|e| format!("{}: {e}", tag("barrier")))?;
    Ok(())
}
