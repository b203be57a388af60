//! The engine with in-process ranks (threads over `LocalTransport`): ordering, fusion, cache, join, errors.

use std::time::Duration;

use hvd_runtime::{
    DType, Engine, EngineConfig, EngineError, ErrorKind, LocalTransport, OpKind, Output, ReduceOp,
    Request, meta,
};

mod common;

use common::{f32s, ranks, to_f32s};

fn allreduce(e: &Engine, name: &str, v: &[f32], op: ReduceOp) -> Result<Vec<f32>, EngineError> {
    let h = e.enqueue(Request::allreduce(
        name,
        DType::F32,
        vec![v.len() as i64],
        op,
        f32s(v),
    ))?;
    Ok(to_f32s(&e.wait(h)?.data))
}

#[test]
fn different_submission_orders_give_the_same_results() {
    for fusion in [0usize, 1 << 20] {
        let config = EngineConfig {
            fusion_threshold: fusion,
            ..EngineConfig::default()
        };
        let results = ranks(3, config, |rank, e| {
            let mut out = Vec::new();
            for step in 0..20 {
                // Each rank submits the 8 tensors in its own order, then waits for all of them.
                let mut order: Vec<usize> = (0..8).collect();
                order.rotate_left((rank * 3 + step) % 8);
                if rank == 1 {
                    order.reverse();
                }
                let handles: Vec<_> = order
                    .iter()
                    .map(|i| {
                        let v: Vec<f32> = (0..*i + 1)
                            .map(|k| (rank * 100 + k + step) as f32)
                            .collect();
                        let name = format!("t{i}");
                        (
                            *i,
                            e.enqueue(Request::allreduce(
                                &name,
                                DType::F32,
                                vec![v.len() as i64],
                                ReduceOp::Sum,
                                f32s(&v),
                            ))
                            .unwrap(),
                        )
                    })
                    .collect();
                let mut got = vec![Vec::new(); 8];
                for (i, h) in handles {
                    got[i] = to_f32s(&e.wait(h).unwrap().data);
                }
                out.push(got);
            }
            out
        });
        for (step, per_step) in results[0].iter().enumerate() {
            for (i, got) in per_step.iter().enumerate() {
                let expect: Vec<f32> = (0..i + 1)
                    .map(|k| (0..3).map(|r| (r * 100 + k + step) as f32).sum())
                    .collect();
                assert_eq!(got, &expect, "fusion {fusion} step {step} tensor {i}");
            }
        }
        assert!(results.iter().all(|r| r == &results[0]));
    }
}

#[test]
fn every_reduce_op_and_scaling() {
    let results = ranks(4, EngineConfig::default(), |rank, e| {
        let v = [rank as f32 + 1.0, -(rank as f32) - 2.0];
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Average,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
        ];
        let mut out: Vec<Vec<f32>> = ops
            .iter()
            .map(|op| allreduce(e, &format!("{op}"), &v, *op).unwrap())
            .collect();
        let mut m = meta(
            OpKind::Allreduce,
            "scaled",
            DType::F32,
            vec![2],
            ReduceOp::Average,
        );
        m.prescale = 2.0;
        m.postscale = 0.5;
        let h = e.enqueue(Request::new(m, f32s(&v))).unwrap();
        out.push(to_f32s(&e.wait(h).unwrap().data));
        out
    });
    let expect = vec![
        vec![10.0, -14.0],
        vec![2.5, -3.5],
        vec![1.0, -5.0],
        vec![4.0, -2.0],
        vec![24.0, 120.0],
        vec![2.5, -3.5],
    ];
    for r in &results {
        assert_eq!(r, &expect);
    }
}

#[test]
fn allgather_broadcast_alltoall_reducescatter_barrier() {
    let results = ranks(3, EngineConfig::default(), |rank, e| {
        let rows = rank + 1;
        let v: Vec<f32> = (0..rows * 2).map(|k| (rank * 10 + k) as f32).collect();
        let h = e
            .enqueue(Request::owned(
                OpKind::Allgather,
                "ag",
                DType::F32,
                vec![rows as i64, 2],
                f32s(&v),
            ))
            .unwrap();
        let ag = e.wait(h).unwrap();
        let mut m = meta(OpKind::Broadcast, "bc", DType::F32, vec![2], ReduceOp::Sum);
        m.root = 2;
        let h = e.enqueue(Request::new(m, f32s(&[rank as f32; 2]))).unwrap();
        let bc = e.wait(h).unwrap();
        let mut m = meta(OpKind::Alltoall, "a2a", DType::F32, vec![3], ReduceOp::Sum);
        m.splits = vec![0, 1, 2];
        let h = e.enqueue(Request::new(m, f32s(&[rank as f32; 3]))).unwrap();
        let a2a = e.wait(h).unwrap();
        let h = e
            .enqueue(Request::owned(
                OpKind::Reducescatter,
                "rs",
                DType::F32,
                vec![4],
                f32s(&[1.0, 2.0, 3.0, 4.0]),
            ))
            .unwrap();
        let rs = e.wait(h).unwrap();
        let h = e
            .enqueue(Request::owned(
                OpKind::Barrier,
                "b",
                DType::U8,
                vec![],
                vec![],
            ))
            .unwrap();
        e.wait(h).unwrap();
        (ag, bc, a2a, rs)
    });
    for (rank, (ag, bc, a2a, rs)) in results.into_iter().enumerate() {
        assert_eq!(ag.shape, vec![6, 2]);
        assert_eq!(
            to_f32s(&ag.data),
            vec![0., 1., 10., 11., 12., 13., 20., 21., 22., 23., 24., 25.]
        );
        assert_eq!(to_f32s(&bc.data), vec![2.0, 2.0]);
        assert_eq!(a2a.splits, vec![rank as i64; 3]);
        assert_eq!(
            to_f32s(&a2a.data),
            (0..3)
                .flat_map(|s| vec![s as f32; rank])
                .collect::<Vec<_>>()
        );
        let blocks = [vec![3.0, 6.0], vec![9.0], vec![12.0]];
        assert_eq!(to_f32s(&rs.data), blocks[rank]);
        assert_eq!(rs.shape, vec![blocks[rank].len() as i64]);
    }
}

#[test]
fn mismatched_shapes_and_dtypes_fail_on_every_rank() {
    let results = ranks(3, EngineConfig::default(), |rank, e| {
        let n = if rank == 2 { 3 } else { 2 };
        let shape_err = allreduce(e, "w", &vec![1.0; n], ReduceOp::Sum).unwrap_err();
        // A mismatch fails the operation, not the engine.
        assert_eq!(shape_err.kind(), ErrorKind::Mismatch);
        assert!(!shape_err.is_fatal());
        let shape_err = shape_err.to_string();
        let (dtype, bytes) = if rank == 1 {
            (DType::I32, vec![0u8; 8])
        } else {
            (DType::F32, vec![0u8; 8])
        };
        let h = e
            .enqueue(Request::allreduce(
                "d",
                dtype,
                vec![2],
                ReduceOp::Sum,
                bytes,
            ))
            .unwrap();
        let dtype_err = e.wait(h).unwrap_err().to_string();
        // The engine keeps working after a mismatch.
        let ok = allreduce(e, "after", &[1.0], ReduceOp::Sum).unwrap();
        (shape_err, dtype_err, ok)
    });
    for (shape_err, dtype_err, ok) in results {
        assert!(
            shape_err.contains("mismatched shapes") && shape_err.contains("rank 2: [3]"),
            "{shape_err}"
        );
        assert!(
            dtype_err.contains("mismatched data types") && dtype_err.contains("rank 1: int32"),
            "{dtype_err}"
        );
        assert_eq!(ok, vec![3.0]);
    }
}

#[test]
fn cached_names_with_changed_shapes_renegotiate() {
    let results = ranks(2, EngineConfig::default(), |rank, e| {
        let mut out = Vec::new();
        for step in 0..6 {
            let n = if step < 3 { 2 } else { 3 };
            out.push(allreduce(e, "g", &vec![(rank + step) as f32; n], ReduceOp::Sum).unwrap());
        }
        out
    });
    for r in results {
        for (step, v) in r.iter().enumerate() {
            let n = if step < 3 { 2 } else { 3 };
            assert_eq!(v, &vec![(2 * step + 1) as f32; n]);
        }
    }
}

#[test]
fn join_with_uneven_data() {
    let results = ranks(3, EngineConfig::default(), |rank, e| {
        // Rank r has r + 2 batches; joined ranks contribute zeros.
        let mut sums = Vec::new();
        for step in 0..rank + 2 {
            sums.push(allreduce(e, "grad", &[1.0, step as f32], ReduceOp::Sum).unwrap());
        }
        let h = e
            .enqueue(Request::owned(OpKind::Join, "", DType::U8, vec![], vec![]))
            .unwrap();
        let last = e.wait(h).unwrap().value;
        // After the join everything works normally again.
        let after = allreduce(e, "after", &[1.0], ReduceOp::Sum).unwrap();
        (sums, last, after)
    });
    for (rank, (sums, last, after)) in results.into_iter().enumerate() {
        assert_eq!(last, 2);
        assert_eq!(after, vec![3.0]);
        for (step, s) in sums.iter().enumerate() {
            let contributing = (0..3).filter(|r| r + 2 > step).count() as f32;
            assert_eq!(
                s,
                &vec![contributing, step as f32 * contributing],
                "rank {rank} step {step}"
            );
        }
    }
}

#[test]
fn a_dead_rank_fails_the_others() {
    let transports = LocalTransport::group(2, Duration::from_secs(10));
    let mut it = transports.into_iter();
    let t0 = it.next().unwrap();
    let t1 = it.next().unwrap();
    t1.kill();
    let e = Engine::start(Box::new(t0), EngineConfig::default()).unwrap();
    let h = e.enqueue(Request::allreduce(
        "x",
        DType::F32,
        vec![1],
        ReduceOp::Sum,
        f32s(&[1.0]),
    ));
    let err = match h {
        Ok(h) => e.wait(h).unwrap_err(),
        Err(err) => err,
    };
    // The collective's own error reaches the caller: its kind, the lost rank, its fatality.
    assert_eq!(err.kind(), ErrorKind::PeerLost, "{err}");
    assert!(
        matches!(
            err.collective(),
            Some(hvd_collective::Error::PeerLost { rank: 1, .. })
        ),
        "{err}"
    );
    assert!(err.is_fatal() && err.collective().is_some_and(|c| c.is_fatal()));
    assert!(std::error::Error::source(&err).is_some());
    assert!(matches!(
        e.enqueue(Request::allreduce(
            "y",
            DType::F32,
            vec![1],
            ReduceOp::Sum,
            f32s(&[1.0])
        )),
        Err(EngineError::Stopped(_))
    ));
    assert!(matches!(
        e.stopped().as_deref(),
        Some(hvd_runtime::Stop::Collective(_))
    ));
    let _: Option<Output> = None;
}

/// A rank that never answers (alive, but silent) fails the others with the timeout kind, not a lost peer.
#[test]
fn a_silent_rank_fails_the_others_with_a_timeout() {
    let mut transports = LocalTransport::group(2, Duration::from_millis(300)).into_iter();
    let t0 = transports.next().unwrap();
    let _silent = transports.next().unwrap();
    let e = Engine::start(Box::new(t0), EngineConfig::default()).unwrap();
    let err = e
        .enqueue(Request::allreduce(
            "x",
            DType::F32,
            vec![1],
            ReduceOp::Sum,
            f32s(&[1.0]),
        ))
        .and_then(|h| e.wait(h))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        matches!(
            err.collective(),
            Some(hvd_collective::Error::Timeout { ranks, .. }) if ranks == &[1]
        ),
        "{err}"
    );
    assert!(err.is_fatal());
}

#[test]
fn invalid_requests_are_rejected_at_once() {
    ranks(1, EngineConfig::default(), |_, e| {
        let err = e
            .enqueue(Request::allreduce(
                "x",
                DType::F32,
                vec![3],
                ReduceOp::Sum,
                vec![0; 8],
            ))
            .unwrap_err();
        assert!(err.to_string().contains("does not match shape"), "{err}");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(!err.is_fatal());
        let err = e
            .enqueue(Request::owned(
                OpKind::Alltoall,
                "a",
                DType::F32,
                vec![],
                vec![0; 4],
            ))
            .unwrap_err();
        assert!(err.to_string().contains("at least one dimension"), "{err}");
    });
}

/// Submits `bufs` (f32 tensors, and an i32 one at index `int_at`) as one grouped call, in place in caller memory,
/// and waits for each member's own handle.
fn grouped_step(
    e: &Engine,
    prefix: &str,
    bufs: &mut [Vec<u8>],
    int_at: usize,
) -> Vec<Result<Output, EngineError>> {
    let requests: Vec<Request> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| {
            let dtype = if i == int_at { DType::I32 } else { DType::F32 };
            {
                let m = meta(
                    OpKind::Allreduce,
                    &format!("{prefix}.{i}"),
                    dtype,
                    vec![(b.len() / 4) as i64],
                    ReduceOp::Sum,
                );
                // SAFETY: `b` is waited for before it is read, written or dropped.
                unsafe { Request::in_caller_memory(m, b.as_ptr(), b.as_mut_ptr(), b.len()) }
            }
        })
        .collect();
    let handles: Vec<_> = e
        .enqueue_many(requests)
        .into_iter()
        .map(|h| h.unwrap())
        .collect();
    handles.into_iter().map(|h| e.wait(h)).collect()
}

#[test]
fn grouped_submissions_fuse_at_submission_and_answer_every_member() {
    // Members: f32 tensors of 1..=4 elements, an i32 one (index 4: it splits the group), more f32 ones and one of
    // 1 MiB (index 7: it runs alone).
    let lens = [1usize, 2, 3, 4, 5, 6, 7, 1 << 18, 2];
    let int_at = 4;
    let results = ranks(3, EngineConfig::default(), |rank, e| {
        let mut out = Vec::new();
        for step in 0..4 {
            let mut bufs: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let v = (rank * 10 + i + step) as f32;
                    if i == int_at {
                        (0..*n).flat_map(|_| (v as i32).to_le_bytes()).collect()
                    } else {
                        f32s(&vec![v; *n])
                    }
                })
                .collect();
            let outputs = grouped_step(e, "g", &mut bufs, int_at);
            let shapes: Vec<Vec<i64>> = outputs.into_iter().map(|o| o.unwrap().shape).collect();
            out.push((bufs, shapes));
        }
        // A group whose member sizes differ on one rank fails on every rank, naming the group.
        let mut bufs: Vec<Vec<u8>> = (0..3)
            .map(|i| f32s(&vec![1.0; if rank == 1 && i == 2 { 5 } else { 4 }]))
            .collect();
        let mut errors: Vec<String> = grouped_step(e, "bad", &mut bufs, usize::MAX)
            .into_iter()
            .map(|r| r.unwrap_err().to_string())
            .collect();
        // So does one whose sizes agree but a member's shape does not ([2, 2] on rank 2, [4] elsewhere).
        let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| f32s(&[1.0; 4])).collect();
        let requests: Vec<Request> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| {
                let shape = if rank == 2 && i == 1 {
                    vec![2, 2]
                } else {
                    vec![4]
                };
                {
                    let m = meta(
                        OpKind::Allreduce,
                        &format!("sh.{i}"),
                        DType::F32,
                        shape,
                        ReduceOp::Sum,
                    );
                    // SAFETY: `b` is waited for before it is read, written or dropped.
                    unsafe { Request::in_caller_memory(m, b.as_ptr(), b.as_mut_ptr(), b.len()) }
                }
            })
            .collect();
        for h in e.enqueue_many(requests) {
            errors.push(e.wait(h.unwrap()).unwrap_err().to_string());
        }
        (out, errors)
    });
    for (rank, (steps, errors)) in results.into_iter().enumerate() {
        for (step, (bufs, shapes)) in steps.iter().enumerate() {
            for (i, b) in bufs.iter().enumerate() {
                let sum = (0..3).map(|r| r * 10 + i + step).sum::<usize>();
                if i == int_at {
                    let got: Vec<i32> = b
                        .chunks_exact(4)
                        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    assert_eq!(
                        got,
                        vec![sum as i32; lens[i]],
                        "rank {rank} step {step} #{i}"
                    );
                } else {
                    assert_eq!(
                        to_f32s(b),
                        vec![sum as f32; lens[i]],
                        "rank {rank} step {step} #{i}"
                    );
                }
                assert_eq!(
                    shapes[i],
                    vec![lens[i] as i64],
                    "rank {rank} step {step} #{i}"
                );
            }
        }
        assert_eq!(errors.len(), 6);
        for err in &errors[..3] {
            assert!(
                err.contains("mismatched tensor groups")
                    && err.contains("bad.0 .. bad.2 (3 tensors)")
                    && err.contains("rank 1: 3 tensors of [4, 4, 5] elements"),
                "rank {rank}: {err}"
            );
        }
        for err in &errors[3..] {
            assert!(
                err.contains("mismatched tensor groups")
                    && err.contains("sh.0 .. sh.2 (3 tensors)")
                    && err.contains("rank 2: 3 tensors of [4, 4, 4] elements, names and shapes"),
                "rank {rank}: {err}"
            );
        }
    }
}

#[test]
fn grouped_submissions_with_a_joined_rank_and_with_fusion_off() {
    for fusion in [0usize, 128 << 20] {
        let config = EngineConfig {
            fusion_threshold: fusion,
            ..EngineConfig::default()
        };
        let results = ranks(3, config, |rank, e| {
            // Rank r submits r + 1 grouped steps, then joins: joined ranks contribute zeros.
            let mut sums = Vec::new();
            for step in 0..rank + 1 {
                let mut bufs: Vec<Vec<u8>> =
                    (0..5).map(|i| f32s(&[(step + i) as f32; 3])).collect();
                for r in grouped_step(e, "j", &mut bufs, usize::MAX) {
                    r.unwrap();
                }
                sums.push(bufs.iter().map(|b| to_f32s(b)[0]).collect::<Vec<f32>>());
            }
            let h = e
                .enqueue(Request::owned(OpKind::Join, "", DType::U8, vec![], vec![]))
                .unwrap();
            e.wait(h).unwrap();
            sums
        });
        for (rank, sums) in results.into_iter().enumerate() {
            for (step, s) in sums.iter().enumerate() {
                let contributing = (0..3).filter(|r| r + 1 > step).count();
                let expect: Vec<f32> = (0..5).map(|i| ((step + i) * contributing) as f32).collect();
                assert_eq!(s, &expect, "fusion {fusion} rank {rank} step {step}");
            }
        }
    }
}

/// Rank 0's end of a two-rank job whose peer is lost in the data phase of the first float allreduce, after the
/// ranks agreed on it (a survivor of a killed worker, as an elastic job sees it): the allreduce fails with the lost
/// peer, and rank 0's own end stops too, so rank 1 fails as well.
struct LosesPeerInData(LocalTransport);

impl hvd_collective::Communicator for LosesPeerInData {
    fn topology(&self) -> hvd_collective::Topology {
        self.0.topology()
    }
    fn backend(&self) -> &'static str {
        "loses-peer-in-data"
    }
    fn allreduce_in_place(
        &mut self,
        data: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> hvd_collective::Result<()> {
        // The engine's own control allreduce (the response cache's bits) is u8; the tensor's is f32.
        if dtype == DType::F32 {
            self.0.kill();
            return Err(hvd_collective::Error::PeerLost {
                rank: 1,
                reason: "lost in the data phase".into(),
            });
        }
        self.0.allreduce_in_place(data, dtype, op)
    }
    fn allgatherv(&mut self, call: hvd_collective::Allgatherv<'_>) -> hvd_collective::Result<()> {
        self.0.allgatherv(call)
    }
    fn broadcast(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> hvd_collective::Result<()> {
        self.0.broadcast(buf, dtype, root)
    }
    fn alltoallv(&mut self, call: hvd_collective::Alltoallv<'_>) -> hvd_collective::Result<()> {
        self.0.alltoallv(call)
    }
    fn reducescatter(
        &mut self,
        call: hvd_collective::Reducescatter<'_>,
    ) -> hvd_collective::Result<()> {
        self.0.reducescatter(call)
    }
    fn barrier(&mut self) -> hvd_collective::Result<()> {
        self.0.barrier()
    }
}

/// Before: the operation being executed was already out of the engine's pending table when its collective failed,
/// so stopping the engine did not fail its handle and the waiter (`hvd.synchronize`) hung forever: a survivor of an
/// elastic job never got to re-form.
#[test]
fn a_peer_lost_in_the_data_phase_fails_the_waiting_allreduce() {
    let mut transports = LocalTransport::group(2, Duration::from_secs(10)).into_iter();
    let ends: Vec<Box<dyn hvd_collective::Communicator>> = vec![
        Box::new(LosesPeerInData(transports.next().unwrap())),
        Box::new(transports.next().unwrap()),
    ];
    let (tx, rx) = std::sync::mpsc::channel();
    for (rank, end) in ends.into_iter().enumerate() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let e = Engine::start(end, EngineConfig::default()).unwrap();
            let result = allreduce(&e, "x", &[1.0], ReduceOp::Sum);
            e.shutdown();
            let _ = tx.send((rank, result.map_err(|err| err.kind())));
        });
    }
    let mut outcomes: Vec<_> = (0..2)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(60))
                .expect("a rank's allreduce neither completed nor failed: its waiter hangs")
        })
        .collect();
    outcomes.sort_by_key(|(rank, _)| *rank);
    assert_eq!(
        outcomes,
        vec![(0, Err(ErrorKind::PeerLost)), (1, Err(ErrorKind::PeerLost))]
    );
}
