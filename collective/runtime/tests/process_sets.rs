//! Process sets with in-process ranks: sets added collectively through the job's engine, each run by its own
//! engine over its own communicator (in-process transports standing for the rendezvous join), concurrently.

use std::sync::Mutex;
use std::time::Duration;

use hvd_collective::Communicator;
use hvd_runtime::process_set::{ProcessSetError, ProcessSets};
use hvd_runtime::{DType, Engine, EngineConfig, ErrorKind, LocalTransport, ReduceOp, Request};

mod common;

use common::{f32s, ranks, to_f32s};

/// The communicators of a set's members, handed out by position, as the rendezvous join would connect them.
struct Joins {
    members: Mutex<Vec<Option<Box<dyn Communicator>>>>,
    tags: Mutex<Vec<String>>,
}

impl Joins {
    fn new(size: usize) -> Joins {
        Joins {
            members: Mutex::new(
                LocalTransport::group(size, Duration::from_secs(10))
                    .into_iter()
                    .map(|t| Some(Box::new(t) as Box<dyn Communicator>))
                    .collect(),
            ),
            tags: Mutex::new(Vec::new()),
        }
    }

    fn connect(
        &self,
        member: usize,
        size: usize,
        tag: &str,
    ) -> Result<Box<dyn Communicator>, hvd_collective::Error> {
        self.tags.lock().unwrap().push(tag.to_string());
        let mut members = self.members.lock().unwrap();
        assert_eq!(members.len(), size);
        Ok(members[member].take().expect("each member joins once"))
    }

    /// Adds the set `requested` to `sets` through `global`, its members joined through these communicators.
    fn add(
        &self,
        sets: &ProcessSets,
        global: &Engine,
        requested: &[i64],
        config: &EngineConfig,
    ) -> Result<i32, ProcessSetError> {
        sets.add(global, requested, config, &|m, n, t| self.connect(m, n, t))
    }
}

/// Runs `body(rank, job engine)` on `size` in-process ranks.
fn job<T: Send>(size: usize, body: impl Fn(usize, &Engine) -> T + Sync) -> Vec<T> {
    ranks(size, EngineConfig::default(), body)
}

fn allreduce(engine: &Engine, name: &str, values: &[f32]) -> Vec<f32> {
    let r = Request::allreduce(
        name,
        DType::F32,
        vec![values.len() as i64],
        ReduceOp::Sum,
        f32s(values),
    );
    let h = engine.enqueue(r).unwrap();
    to_f32s(&engine.wait(h).unwrap().data)
}

/// Sets {0,1} and {1,2,3} on 4 ranks: the same tensor name in both, different values; rank 1 runs both at once.
/// Each member gets its own set's sum, the sets get ids 1 and 2 on every rank, and the job's engine still works.
#[test]
fn two_overlapping_sets_reduce_concurrently_each_over_its_members() {
    let pair = Joins::new(2);
    let trio = Joins::new(3);
    let results = job(4, |rank, global| {
        let sets = ProcessSets::new();
        let config = EngineConfig::default();
        let a = pair.add(&sets, global, &[1, 0], &config).unwrap();
        let b = trio.add(&sets, global, &[3, 2, 1], &config).unwrap();
        assert_eq!((a, b), (1, 2));
        assert_eq!(sets.get(b).unwrap().ranks(), &[1, 2, 3]);
        assert_eq!(sets.get(b).unwrap().rank_of(rank), rank.checked_sub(1));
        let in_a = sets.get(a).unwrap().engine().cloned();
        let in_b = sets.get(b).unwrap().engine().cloned();
        assert_eq!(in_a.is_some(), rank <= 1);
        assert_eq!(in_b.is_some(), rank >= 1);
        let (sum_a, sum_b) = std::thread::scope(|s| {
            let ta = in_a
                .as_ref()
                .map(|e| s.spawn(move || allreduce(e, "x", &[10.0 * (rank + 1) as f32; 3])));
            let tb = in_b
                .as_ref()
                .map(|e| s.spawn(move || allreduce(e, "x", &[rank as f32; 3])));
            (ta.map(|t| t.join().unwrap()), tb.map(|t| t.join().unwrap()))
        });
        let global_sum = allreduce(global, "g", &[1.0]);
        sets.shutdown().unwrap();
        (sum_a, sum_b, global_sum)
    });
    for (rank, (a, b, g)) in results.into_iter().enumerate() {
        assert_eq!(a, (rank <= 1).then(|| vec![30.0; 3]), "rank {rank}");
        assert_eq!(b, (rank >= 1).then(|| vec![6.0; 3]), "rank {rank}");
        assert_eq!(g, vec![4.0]);
    }
    // Every member joined under one tag per set, the same on all of them, and the two sets' tags differ.
    for joins in [&pair, &trio] {
        let tags = joins.tags.lock().unwrap();
        assert!(tags.iter().all(|t| *t == tags[0]), "{tags:?}");
    }
    assert_ne!(pair.tags.lock().unwrap()[0], trio.tags.lock().unwrap()[0]);
}

/// Ranks that ask for different sets all get the same refusal (nobody joins anything), a refused set spends its id
/// on every rank alike, and the next add works.
#[test]
fn ranks_that_disagree_are_all_refused_and_stay_in_step() {
    let never =
        |_: usize, _: usize, _: &str| -> Result<Box<dyn Communicator>, hvd_collective::Error> {
            panic!("a refused set must not join")
        };
    let results = job(3, |rank, global| {
        let sets = ProcessSets::new();
        let config = EngineConfig::default();
        let asked: &[i64] = if rank == 2 { &[0, 2] } else { &[0, 1] };
        let disagree = sets.add(global, asked, &config, &never).unwrap_err();
        let duplicate = sets.add(global, &[1, 1], &config, &never).unwrap_err();
        let everyone = sets.add(global, &[0, 1, 2], &config, &never).unwrap_err();
        // A set of one rank needs no join.
        let single = sets.add(global, &[rank as i64], &config, &never);
        let single_disagrees = single.is_err();
        let alone = sets.add(global, &[1], &config, &never).unwrap();
        let sum = sets
            .get(alone)
            .unwrap()
            .engine()
            .map(|e| allreduce(e, "x", &[5.0]));
        sets.shutdown().unwrap();
        (disagree, duplicate, everyone, single_disagrees, alone, sum)
    });
    for (rank, (disagree, duplicate, everyone, single_disagrees, alone, sum)) in
        results.into_iter().enumerate()
    {
        assert!(
            matches!(disagree, ProcessSetError::Disagree(_)),
            "{disagree}"
        );
        assert_eq!(disagree.kind(), ErrorKind::Mismatch);
        assert!(
            duplicate.to_string().contains("appears twice"),
            "{duplicate}"
        );
        assert!(
            matches!(everyone, ProcessSetError::Existing(_)),
            "{everyone}"
        );
        assert!(
            single_disagrees,
            "rank {rank}: ranks asking for their own rank disagree"
        );
        // Ids 1 and 2 were spent by the agreed but refused adds (not by the disagreements): alike on every rank.
        assert_eq!(alone, 3);
        assert_eq!(sum, (rank == 1).then(|| vec![5.0]));
    }
}

/// A mismatch inside one set fails that set's operation on its members; the other set and the job go on.
#[test]
fn a_mismatch_in_one_set_leaves_the_others_running() {
    let trio = Joins::new(3);
    let results = job(4, |rank, global| {
        let sets = ProcessSets::new();
        let config = EngineConfig::default();
        let b = trio.add(&sets, global, &[1, 2, 3], &config).unwrap();
        let a = sets
            .add(global, &[0], &config, &|_, _, _| unreachable!())
            .unwrap();
        let mut failed = None;
        if let Some(e) = sets.get(b).unwrap().engine() {
            let len = if rank == 3 { 3 } else { 2 };
            let r = Request::allreduce(
                "bad",
                DType::F32,
                vec![len],
                ReduceOp::Sum,
                f32s(&vec![1.0; len as usize]),
            );
            let h = e.enqueue(r).unwrap();
            failed = Some(e.wait(h).unwrap_err().kind());
            assert_eq!(allreduce(e, "good", &[1.0]), vec![3.0]);
        }
        if let Some(e) = sets.get(a).unwrap().engine() {
            assert_eq!(allreduce(e, "x", &[2.0]), vec![2.0]);
        }
        let g = allreduce(global, "g", &[1.0]);
        sets.remove(global, b).unwrap();
        assert!(matches!(
            sets.remove(global, b),
            Err(ProcessSetError::Unknown(_))
        ));
        assert!(matches!(
            sets.remove(global, 0),
            Err(ProcessSetError::RemoveGlobal)
        ));
        sets.shutdown().unwrap();
        (failed, g)
    });
    for (rank, (failed, g)) in results.into_iter().enumerate() {
        assert_eq!(
            failed,
            (rank >= 1).then_some(ErrorKind::Mismatch),
            "rank {rank}"
        );
        assert_eq!(g, vec![4.0]);
    }
}

/// A stall inside one set (rank 3 never submits what ranks 1 and 2 wait for) is that set's: its stall shutdown
/// fails the operation there, while the job's engine and the other set keep running.
#[test]
fn a_stall_in_one_set_does_not_hang_the_others() {
    let trio = Joins::new(3);
    let results = job(4, |rank, global| {
        let sets = ProcessSets::new();
        let config = EngineConfig {
            stall_check_time: Some(Duration::from_millis(100)),
            stall_shutdown_time: Some(Duration::from_millis(300)),
            ..EngineConfig::default()
        };
        let b = trio.add(&sets, global, &[1, 2, 3], &config).unwrap();
        let a = sets
            .add(global, &[0], &config, &|_, _, _| unreachable!())
            .unwrap();
        let alone = sets
            .get(a)
            .unwrap()
            .engine()
            .map(|e| allreduce(e, "x", &[2.0]));
        let stalled = match sets.get(b).unwrap().engine() {
            Some(e) if rank != 3 => {
                let r =
                    Request::allreduce("late", DType::F32, vec![1], ReduceOp::Sum, f32s(&[1.0]));
                let h = e.enqueue(r).unwrap();
                Some(e.wait(h).unwrap_err().kind())
            }
            _ => None,
        };
        let g = allreduce(global, "g", &[1.0]);
        sets.shutdown().unwrap();
        (stalled, g, alone)
    });
    for (rank, (stalled, g, alone)) in results.into_iter().enumerate() {
        assert_eq!(alone, (rank == 0).then(|| vec![2.0]));
        assert_eq!(
            stalled,
            (rank == 1 || rank == 2).then_some(ErrorKind::Stalled),
            "rank {rank}"
        );
        assert_eq!(g, vec![4.0]);
    }
}

/// Removes are agreed on like adds: ranks that remove two overlapping sets in different orders all get a MISMATCH
/// (nobody shuts an engine down the others are not shutting down, so nothing hangs) and keep both sets; removing
/// them in one order then works; a rank that removes while the others add is refused the same way.
#[test]
fn removes_in_different_orders_are_a_mismatch_not_a_hang() {
    let pair = Joins::new(2);
    let other = Joins::new(2);
    let results = job(3, |rank, global| {
        let sets = ProcessSets::new();
        let config = EngineConfig::default();
        let a = pair.add(&sets, global, &[0, 1], &config).unwrap();
        // Listed in another order on rank 0: the same set (ranks are sorted, as Horovod does).
        let asked: &[i64] = if rank == 0 { &[2, 1] } else { &[1, 2] };
        let b = other.add(&sets, global, asked, &config).unwrap();
        let (first, second) = if rank == 1 { (b, a) } else { (a, b) };
        let swapped = sets.remove(global, first).unwrap_err();
        let still = (sets.get(a).is_ok(), sets.get(b).is_ok());
        let add_vs_remove = if rank == 2 {
            sets.add(global, &[0], &config, &|_, _, _| unreachable!())
                .unwrap_err()
        } else {
            sets.remove(global, second).unwrap_err()
        };
        sets.remove(global, a).unwrap();
        sets.remove(global, b).unwrap();
        let gone = sets.ids();
        let g = allreduce(global, "g", &[1.0]);
        sets.shutdown().unwrap();
        (swapped, still, add_vs_remove, gone, g)
    });
    for (rank, (swapped, still, add_vs_remove, gone, g)) in results.into_iter().enumerate() {
        for e in [&swapped, &add_vs_remove] {
            assert!(
                matches!(e, ProcessSetError::Disagree(_)),
                "rank {rank}: {e}"
            );
            assert_eq!(e.kind(), ErrorKind::Mismatch);
        }
        assert!(swapped.to_string().contains("to remove set"), "{swapped}");
        assert_eq!(
            still,
            (true, true),
            "rank {rank}: a refused remove keeps the sets"
        );
        assert!(gone.is_empty(), "rank {rank}: {gone:?}");
        assert_eq!(g, vec![3.0]);
    }
}

/// A member that never stops the set's engine (it has not reached the shutdown) does not hang the other's
/// shutdown: it gives up after the timeout with an error naming the set, and the job's engine still works.
#[test]
fn a_set_shutdown_a_member_never_joins_is_bounded() {
    let pair = Joins::new(2);
    let first_done = std::sync::Barrier::new(2);
    let results = job(3, |rank, global| {
        let sets = ProcessSets::with_shutdown_timeout(Duration::from_millis(300));
        let config = EngineConfig::default();
        let a = pair.add(&sets, global, &[0, 1], &config).unwrap();
        let out = if rank == 0 {
            let e = sets.shutdown().unwrap_err();
            first_done.wait();
            Some(e)
        } else if rank == 2 {
            sets.shutdown().unwrap();
            None
        } else {
            // Rank 1 holds the set until rank 0 has given up, then stops it (which lets rank 0's engine stop too).
            first_done.wait();
            assert!(sets.get(a).is_ok());
            sets.shutdown().unwrap();
            None
        };
        let g = allreduce(global, "g", &[1.0]);
        (out, g)
    });
    let e = results[0].0.as_ref().unwrap();
    assert!(
        matches!(e, ProcessSetError::ShutdownTimeout { id: 1, .. }),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::Stalled);
    assert!(e.to_string().contains("did not stop within"), "{e}");
    for (_, g) in &results {
        assert_eq!(*g, vec![3.0]);
    }
}
