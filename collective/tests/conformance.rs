//! One conformance suite for every communicator: each operation against a naive reference, plus mismatched calls
//! and lost peers. Cross product sampled to stay fast on 2 cores: every op x dtype at an odd size, and every size
//! (0, 1, odd, large) for f32, both in place and out of place, on 1 to 4 ranks.

use std::time::Duration;

use hvd_collective::testing::{Backend, LocalJob, two_level_rounds};
use hvd_collective::{
    Alltoallv, Communicator, DType, Error, ReduceOp, StagedAllreduce, Thresholds,
};

mod common;
use common::{LARGE, check, decode, encode, run_all};

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
            fn staged_allreduce_matches_the_reference() {
                super::staged_allreduce_matches_the_reference($backend)
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

/// Every allreduce algorithm at every size: recursive doubling forced for large messages, the ring for small ones,
/// and on shm with 3 and 4 ranks the arenas at every size, or never.
fn both_allreduce_algorithms_match_the_reference(backend: Backend) {
    {
        for n in [2, 3, 4] {
            for (small, arena) in [(0, 3), (usize::MAX, 3), (0, 0), (usize::MAX, 0)] {
                let th = Thresholds {
                    allreduce_direct_bytes: small,
                    allreduce_deposit_bytes: small,
                    allreduce_small_bytes: small,
                    allgather_small_bytes: small,
                    allreduce_arena_ranks: arena,
                };
                let results = LocalJob::new(n, backend)
                    .thresholds(th)
                    .run(|mut comm| -> Result<(), String> {
                        for count in [1, 5, 7, 4099, 100_003] {
                            run_all(comm.as_mut(), DType::F32, count, false, count)?;
                            run_all(comm.as_mut(), DType::BF16, count, true, count)?;
                        }
                        Ok(())
                    })
                    .expect("start the ranks");
                for (r, res) in results.into_iter().enumerate() {
                    if let Err(e) = res {
                        panic!("{backend:?} n={n} small={small} arena={arena} rank {r}: {e}");
                    }
                }
            }
        }
    }
}

/// A staged allreduce's input and output as pieces of uneven sizes (a fused group's tensors), so that the
/// backend's ranges (chunks, blocks) start and end inside pieces.
struct Pieces {
    inputs: Vec<Vec<u8>>,
    outputs: Vec<Vec<u8>>,
}

impl Pieces {
    fn new(data: &[u8], esize: usize) -> Pieces {
        let mut inputs = Vec::new();
        let mut at = 0;
        for k in 0.. {
            if at == data.len() {
                break;
            }
            let len = ((1 + k * 37 % 1500) * esize).min(data.len() - at);
            inputs.push(data[at..at + len].to_vec());
            at += len;
        }
        let outputs = inputs.iter().map(|p| vec![0u8; p.len()]).collect();
        Pieces { inputs, outputs }
    }

    fn each(
        pieces: &mut [Vec<u8>],
        offset: usize,
        len: usize,
        mut f: impl FnMut(&mut [u8], usize),
    ) {
        let mut at = 0;
        for p in pieces {
            let (start, end) = (offset.max(at), (offset + len).min(at + p.len()));
            if start < end {
                f(&mut p[start - at..end - at], start - offset);
            }
            at += p.len();
        }
    }

    fn joined(&self) -> Vec<u8> {
        self.outputs.concat()
    }
}

impl hvd_collective::Staged for Pieces {
    fn read(&mut self, offset: usize, dst: &mut [u8]) {
        let len = dst.len();
        Self::each(&mut self.inputs, offset, len, |p, at| {
            dst[at..at + p.len()].copy_from_slice(p)
        });
    }

    fn write(&mut self, offset: usize, src: &[u8]) {
        Self::each(&mut self.outputs, offset, src.len(), |p, at| {
            p.copy_from_slice(&src[at..at + p.len()])
        });
    }
}

/// A staged allreduce (a fused group in its members' memory) at sizes from eager to several arena chunks, with the
/// arenas on and off, between plain allreduces; on shm, a rank that stages while another does not is a mismatch.
fn staged_allreduce_matches_the_reference(backend: Backend) {
    for n in 1..=4 {
        for arena in [3, 0] {
            let th = Thresholds {
                allreduce_arena_ranks: arena,
                ..Thresholds::default()
            };
            let results = LocalJob::new(n, backend)
                .thresholds(th)
                .timeout(Duration::from_secs(20))
                .run(|mut comm| -> Result<(), String> {
                    let c = comm.as_mut();
                    let me = c.rank();
                    let mut scratch = Vec::new();
                    for (k, count) in [0, 7, 600, 4099, 100_003, 200_000].into_iter().enumerate() {
                        for op in [ReduceOp::Sum, ReduceOp::Max] {
                            let dtype = if k % 2 == 0 { DType::F32 } else { DType::I32 };
                            let seed = k * 10 + op as usize;
                            let mut io = Pieces::new(&common::input(dtype, me, seed, count), dtype.size());
                            let tag = format!("staged {op} {dtype} x {count} on {n} ranks (rank {me}, arena={arena})");
                            c.allreduce_staged(StagedAllreduce {
                                len: count * dtype.size(),
                                dtype,
                                op,
                                io: &mut io,
                                scratch: &mut scratch,
                            })
                                .map_err(|e| format!("{tag}: {e}"))?;
                            let want: Vec<f64> =
                                (0..count).map(|i| common::reference(dtype, op, n, seed, i)).collect();
                            common::check(&tag, dtype, n, &io.joined(), &want)?;
                            common::run_all(c, DType::F32, 5, false, seed)?;
                        }
                    }
                    if backend == Backend::Shm && arena > 0 && n > 1 {
                        let data = f32s(&[1.0; 1000]);
                        let r = if me == 1 {
                            c.allreduce_staged(StagedAllreduce {
                                len: data.len(),
                                dtype: DType::F32,
                                op: ReduceOp::Sum,
                                io: &mut Pieces::new(&data, 4),
                                scratch: &mut scratch,
                            })
                        } else {
                            c.allreduce_in_place(&mut data.clone(), DType::F32, ReduceOp::Sum)
                        };
                        match r {
                            Err(Error::Mismatch { .. }) => {}
                            other => return Err(format!("staging on rank 1 alone gave {other:?}")),
                        }
                        common::run_all(c, DType::F32, 5, false, 1)?;
                    }
                    Ok(())
                })
                .expect("start the ranks");
            for (r, res) in results.into_iter().enumerate() {
                if let Err(e) = res {
                    panic!("{backend:?} n={n} arena={arena} rank {r}: {e}");
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
    mismatched_calls_fail_on_every_rank_of(backend, 3, None)
}

/// [`mismatched_calls_fail_on_every_rank`] on `n` ranks, on the given simulated hosts (hierarchical backend).
fn mismatched_calls_fail_on_every_rank_of(backend: Backend, n: usize, hosts: Option<Vec<usize>>) {
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
                c.alltoallv(Alltoallv {
                    send: &send,
                    send_counts: &send_counts,
                    recv: &mut recv,
                    recv_counts: &recv_counts,
                    dtype: DType::U8,
                })
            },
            "expects 2",
        ),
    ];
    {
        for (name, call, needle) in &cases {
            let mut job = LocalJob::new(n, backend);
            if let Some(h) = &hosts {
                job = job.hosts(h.clone());
            }
            let results = job
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
                let k = n as f32;
                assert_eq!(
                    after.expect("communicator usable after a mismatch"),
                    f32s(&[k, 2.0 * k]),
                    "{name}"
                );
            }
        }
    }
}

/// Ranks spread over hosts with the same number on each exchange headers (and a direct allreduce's data) first in
/// the host, then across hosts with the host's headers and sum (`two_level`). Every op x dtype (the small allreduce
/// through that path), the allreduce with the direct path on and off, and every mismatch, on host layouts where
/// the hosts hold 2 or 3 ranks, there are 2 or 3 hosts, and hosts are not in rank order; and on the tcp backend.
/// Float allreduces of non-integer values (whose sums depend on the order of the additions) give every rank the
/// same bits. Each rank checks that the two-level exchange ran (and on a layout with unequal hosts, that it did
/// not: the flat exchange), and that an alltoallv sends its counts across hosts once, not again with its verdicts.
#[test]
fn hierarchical_two_level_exchange_on_every_layout() {
    let h = Backend::Hierarchical;
    let layouts: [(Backend, &[usize], bool); 6] = [
        (h, &[0, 0, 1, 1], true),
        (h, &[1, 0, 0, 1], true),
        (h, &[0, 1, 2, 2, 1, 0], true),
        (h, &[0, 0, 1, 1, 1, 0], true),
        // The tcp backend with ranks on several hosts takes the same two levels, over tcp inside the host too.
        (Backend::Tcp, &[1, 0, 0, 1], true),
        // Unequal hosts: no hierarchy, the flat exchange.
        (h, &[0, 0, 1], false),
    ];
    for (backend, hosts, two_level) in layouts {
        let n = hosts.len();
        let what = |direct: usize| format!("{backend:?} hosts {hosts:?} direct={direct}");
        for direct in [usize::MAX, 0] {
            let th = Thresholds {
                allreduce_direct_bytes: direct,
                ..Thresholds::default()
            };
            let results = LocalJob::new(n, backend)
                .hosts(hosts.to_vec())
                .thresholds(th)
                .timeout(Duration::from_secs(20))
                .run(|mut comm| -> Result<Vec<Vec<u8>>, String> {
                    let c = comm.as_mut();
                    for (k, dtype) in DType::ALL.into_iter().enumerate() {
                        run_all(c, dtype, 7, k % 2 == 0, k)?;
                    }
                    for count in [0, 1, 511, 4099] {
                        run_all(c, DType::F32, count, count % 2 == 0, count)?;
                    }
                    let (exchanges, _) = two_level_rounds();
                    if (exchanges > 0) != two_level {
                        return Err(format!(
                            "{exchanges} two-level exchanges, expected {}",
                            if two_level { "some" } else { "none" }
                        ));
                    }
                    alltoallv_counts_once(c, two_level)?;
                    inexact_sums(c)
                })
                .expect("start the ranks");
            let mut first: Option<Vec<Vec<u8>>> = None;
            for (r, res) in results.into_iter().enumerate() {
                let sums = res.unwrap_or_else(|e| panic!("{}, rank {r}: {e}", what(direct)));
                match &first {
                    None => first = Some(sums),
                    Some(f) => {
                        for (k, (a, b)) in f.iter().zip(&sums).enumerate() {
                            assert!(
                                a == b,
                                "{}: allreduce #{k}: rank {r} got other bits than rank 0",
                                what(direct)
                            );
                        }
                    }
                }
            }
        }
        mismatched_calls_fail_on_every_rank_of(backend, n, Some(hosts.to_vec()));
    }
}

/// One valid alltoallv with different counts for each pair: two header rounds (its header, then its verdicts),
/// of which only the first is followed by a round of counts across hosts (`two_level`), or none of each.
fn alltoallv_counts_once(c: &mut dyn Communicator, two_level: bool) -> Result<(), String> {
    let (n, me) = (c.size(), c.rank());
    let count = |from: usize, to: usize| 1 + (3 * from + to) % 4;
    let send_counts: Vec<usize> = (0..n).map(|j| count(me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|j| count(j, me)).collect();
    let send: Vec<u8> = (0..n)
        .flat_map(|j| vec![(me * 16 + j) as u8; count(me, j)])
        .collect();
    let mut recv = vec![0u8; recv_counts.iter().sum()];
    let before = two_level_rounds();
    c.alltoallv(Alltoallv {
        send: &send,
        send_counts: &send_counts,
        recv: &mut recv,
        recv_counts: &recv_counts,
        dtype: DType::U8,
    })
    .map_err(|e| format!("alltoallv: {e}"))?;
    let after = two_level_rounds();
    let want: Vec<u8> = (0..n)
        .flat_map(|j| vec![(j * 16 + me) as u8; count(j, me)])
        .collect();
    if recv != want {
        return Err(format!("alltoallv received {recv:?}, expected {want:?}"));
    }
    let rounds = (after.0 - before.0, after.1 - before.1);
    let expected = if two_level { (2, 1) } else { (0, 0) };
    if rounds != expected {
        return Err(format!(
            "alltoallv ran {rounds:?} two-level exchanges and rounds of counts, expected {expected:?}"
        ));
    }
    Ok(())
}

/// Sums and averages of non-integer floats of mixed signs and magnitudes (where the order of the additions shows
/// in the bits) at sizes through the direct path and the algorithms, each checked against the f64 reference;
/// returns every result, for the caller to compare bit for bit across ranks.
fn inexact_sums(c: &mut dyn Communicator) -> Result<Vec<Vec<u8>>, String> {
    let (n, me) = (c.size(), c.rank());
    let value = |r: usize, i: usize| -> f64 {
        let x = ((r * 131 + i * 71) % 997) as f64 / 997.0 + 0.1;
        let scale = [1e-2, 1.0, 3.7, 1e2][(r + i) % 4];
        if (r + i).is_multiple_of(3) {
            -x * scale
        } else {
            x * scale
        }
    };
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
        for count in [7, 4099, LARGE] {
            for op in [ReduceOp::Sum, ReduceOp::Average] {
                let inputs: Vec<Vec<u8>> = (0..n)
                    .map(|r| encode(dtype, &(0..count).map(|i| value(r, i)).collect::<Vec<_>>()))
                    .collect();
                let mut data = inputs[me].clone();
                let tag = format!("{dtype:?} x {count} {op:?} of non-integers");
                c.allreduce_in_place(&mut data, dtype, op)
                    .map_err(|e| format!("{tag}: {e}"))?;
                let exact: Vec<Vec<f64>> = inputs.iter().map(|b| decode(dtype, b)).collect();
                let want: Vec<f64> = (0..count)
                    .map(|i| {
                        let sum: f64 = exact.iter().map(|v| v[i]).sum();
                        if op == ReduceOp::Average {
                            sum / n as f64
                        } else {
                            sum
                        }
                    })
                    .collect();
                check(&tag, dtype, n, &data, &want)?;
                out.push(data);
            }
        }
    }
    Ok(out)
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

mod log_capture;

/// Set (to the log text the run must show) in a child of this test binary that runs [`single_copy_worker`].
const SINGLE_COPY_WORKER: &str = "HVD_CONFORMANCE_SINGLE_COPY";

/// Large shm allreduces (past 32 KiB, where rank threads reach one another's buffers) with the single copy on
/// (`HVD_SHM_CMA=1`) and forced off (`HVD_SHM_CMA=0`: the ring, or the arenas from 3 ranks), each in a child process
/// of this binary so that the setting reaches no other test; the child also checks in the library's log which path
/// ran.
#[test]
fn shm_large_allreduces_with_and_without_the_single_copy() {
    for (cma, path) in [
        ("1", "large allreduces read peers' memory"),
        ("0", "large allreduces use the ring"),
    ] {
        let exe = std::env::current_exe().expect("test binary path");
        let out = std::process::Command::new(exe)
            .args(["--exact", "single_copy_worker", "--nocapture"])
            .args(["--test-threads=1"])
            .env(SINGLE_COPY_WORKER, path)
            .env("HVD_SHM_CMA", cma)
            .output()
            .expect("run the worker");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("SINGLE COPY CHECKED"),
            "HVD_SHM_CMA={cma}: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The child side of [`shm_large_allreduces_with_and_without_the_single_copy`]; does nothing in a plain run.
#[test]
fn single_copy_worker() {
    let Ok(path) = std::env::var(SINGLE_COPY_WORKER) else {
        return;
    };
    log_capture::install();
    large_allreduces_match_exactly();
    assert!(
        log_capture::logged(&path),
        "the log never said `{path}`: {:?}",
        log_capture::messages()
    );
    println!("SINGLE COPY CHECKED");
}

/// Every op on 2 ranks and sums on 3 and 4 (where the single copy comes before the arenas) at sizes from just over
/// 32 KiB (2 ranks) or around 4 KiB (3 and 4) and over 1 MiB, odd element counts so that blocks are uneven, in place and out of place, twice each, with
/// a staged allreduce (arenas, same step counter) and a small one in between; every element exactly the reference
/// (integer values).
fn large_allreduces_match_exactly() {
    for n in [2, 3, 4] {
        let th = Thresholds::default();
        let results = LocalJob::new(n, Backend::Shm)
            .thresholds(th)
            .timeout(Duration::from_secs(20))
            .run(|mut comm| -> Result<(), String> {
                let me = comm.rank();
                let cases: &[(DType, usize, &[ReduceOp])] = if n == 2 {
                    &[
                        (DType::F32, 8_195, &ReduceOp::ALL),
                        (DType::F32, 262_147, &ReduceOp::ALL),
                        (DType::I32, 300_001, &ReduceOp::ALL),
                        (DType::BF16, 524_291, &[ReduceOp::Sum]),
                        (DType::F64, 131_075, &[ReduceOp::Max]),
                        (DType::I8, 1_048_583, &[ReduceOp::Sum]),
                    ]
                } else {
                    // Just under and just over the 4 KiB the single copy takes from with 3 or more ranks.
                    &[
                        (DType::I32, 1_021, &[ReduceOp::Sum]),
                        (DType::I32, 1_027, &[ReduceOp::Sum, ReduceOp::Max]),
                        (DType::F32, 3_001, &[ReduceOp::Sum]),
                        (DType::I32, 8_195, &[ReduceOp::Sum, ReduceOp::Max]),
                        (DType::F32, 400_003, &[ReduceOp::Sum]),
                    ]
                };
                for (k, &(dtype, count, ops)) in cases.iter().enumerate() {
                    for (j, &op) in ops.iter().enumerate() {
                        let seed = 3 * k + j;
                        let want: Vec<f64> = (0..count)
                            .map(|i| common::reference(dtype, op, n, seed, i))
                            .collect();
                        let tag = format!("{op} {dtype} x {count} on {n} ranks (rank {me})");
                        let mine = common::input(dtype, me, seed, count);
                        let mut buf = mine.clone();
                        comm.allreduce_in_place(&mut buf, dtype, op)
                            .map_err(|e| format!("{tag}: {e}"))?;
                        exactly(&tag, dtype, &buf, &want)?;
                        let mut out = vec![0u8; mine.len()];
                        comm.allreduce(&mine, &mut out, dtype, op)
                            .map_err(|e| format!("{tag}, out of place: {e}"))?;
                        exactly(&tag, dtype, &out, &want)?;
                        // In between: a small allreduce, and a staged one through the arenas (2 ranks).
                        let mut small = f32s(&[1.0; 3]);
                        comm.allreduce_in_place(&mut small, DType::F32, ReduceOp::Sum)
                            .map_err(|e| format!("{tag}, small: {e}"))?;
                        let mut staged = mine.clone();
                        comm.allreduce_staged(StagedAllreduce {
                            len: staged.len(),
                            dtype,
                            op,
                            io: &mut hvd_collective::InPlace(&mut staged),
                            scratch: &mut Vec::new(),
                        })
                        .map_err(|e| format!("{tag}, staged: {e}"))?;
                        exactly(&format!("{tag}, staged"), dtype, &staged, &want)?;
                    }
                }
                Ok(())
            })
            .expect("start the ranks");
        for (r, res) in results.into_iter().enumerate() {
            if let Err(e) = res {
                panic!("shm n={n} rank {r}: {e}");
            }
        }
    }
}

fn exactly(what: &str, dtype: DType, got: &[u8], want: &[f64]) -> Result<(), String> {
    let got = common::decode(dtype, got);
    match got.iter().zip(want).position(|(g, w)| g != w) {
        Some(i) => Err(format!(
            "{what}: element {i} is {}, expected {}",
            got[i], want[i]
        )),
        None if got.len() != want.len() => Err(format!("{what}: {} elements", got.len())),
        None => Ok(()),
    }
}
