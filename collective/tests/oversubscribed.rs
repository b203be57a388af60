//! The shm wait path when ranks outnumber cores: the test process (and so every rank thread or worker process it
//! starts) is confined to one CPU, so every rank takes the oversubscribed path (brief spin, yields, futex sleep)
//! whatever the machine; the results must be right at every size, and a waiter whose peer dies must be released.

use std::process::{Command, Stdio};
use std::time::Duration;

use hvd_collective::testing::{Backend, LocalJob, deposited_allreduces, process_env};
use hvd_collective::{
    Communicator, DType, Error, InPlace, ReduceOp, StagedAllreduce, Thresholds, bootstrap,
};

mod workers;

const WORKER: &str = "HVD_OVERSUBSCRIBED_TEST_WORKER";

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Confines this process to the first CPU it may run on; threads and processes it starts afterwards inherit that.
fn one_cpu() {
    // SAFETY: cpu_set_t is plain data; sched_{get,set}affinity read and write it for the calling thread (pid 0).
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut allowed),
            0
        );
        let first = (0..libc::CPU_SETSIZE as usize)
            .find(|c| libc::CPU_ISSET(*c, &allowed))
            .expect("a CPU to run on");
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(first, &mut one);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &one),
            0
        );
    }
    assert_eq!(
        std::thread::available_parallelism().map(|n| n.get()).ok(),
        Some(1)
    );
}

/// 4 ranks on one CPU: allreduce through the board (4 B, 2 KiB, and the deposits: 4 KiB, 16 KiB), the single copy
/// (16 KiB + 4 B, 64 KiB, 1.2 MiB) and an allgather through the rings, many times each, every result exact.
#[test]
fn four_ranks_on_one_cpu_get_every_size_right() {
    one_cpu();
    let results = LocalJob::new(4, Backend::Shm)
        .timeout(Duration::from_secs(20))
        .run(|mut comm| -> Result<(), Error> {
            let rank = comm.rank();
            for count in [1usize, 512, 1024, 4096, 4097, 16_384, 300_001] {
                let rounds = if count > 10_000 { 5 } else { 200 };
                for round in 0..rounds {
                    let mine: Vec<f32> = (0..count)
                        .map(|i| (rank + 1) as f32 * ((i + round) % 7) as f32)
                        .collect();
                    let mut buf = f32s(&mine);
                    comm.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum)?;
                    for (i, c) in buf.chunks_exact(4).enumerate() {
                        let want = 10.0 * ((i + round) % 7) as f32;
                        let got = f32::from_ne_bytes(c.try_into().unwrap());
                        assert_eq!(
                            got, want,
                            "rank {rank}, {count} elements, round {round}, element {i}"
                        );
                    }
                }
            }
            let send = f32s(&[rank as f32; 1000]);
            let mut all = vec![0u8; send.len() * 4];
            comm.allgather(&send, &mut all, DType::F32)?;
            for (r, block) in all.chunks_exact(send.len()).enumerate() {
                assert_eq!(block, f32s(&[r as f32; 1000]), "rank {rank}: block {r}");
            }
            Ok(())
        })
        .expect("start the ranks");
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// What every rank of [`deposits_are_used_only_when_every_rank_made_one`] computes: `rounds` allreduces of
/// `count` elements with each op, in place and staged (the engine's fused groups; Average there is the in-place
/// call), every result checked (the values differ from one operation to the next, so a deposit read from the wrong
/// operation shows); the first wrong one is the error.
fn deposit_rounds(comm: &mut dyn Communicator, count: usize, rounds: usize) -> Result<(), String> {
    let rank = comm.rank();
    let n = comm.size();
    let mut scratch = Vec::new();
    for round in 0..rounds {
        for (k, (op, staged)) in [
            (ReduceOp::Sum, false),
            (ReduceOp::Average, false),
            (ReduceOp::Max, false),
            (ReduceOp::Sum, true),
            (ReduceOp::Max, true),
        ]
        .into_iter()
        .enumerate()
        {
            let value = |r: usize, i: usize| ((r * 7 + i * 3 + round * 5 + k * 11) % 13) as f32;
            let mut buf = f32s(&(0..count).map(|i| value(rank, i)).collect::<Vec<_>>());
            let done = if staged {
                comm.allreduce_staged(StagedAllreduce {
                    len: buf.len(),
                    dtype: DType::F32,
                    op,
                    io: &mut InPlace(&mut buf),
                    scratch: &mut scratch,
                })
            } else {
                comm.allreduce_in_place(&mut buf, DType::F32, op)
            };
            done.map_err(|e| format!("round {round}, {op:?}, staged {staged}: {e}"))?;
            for (i, c) in buf.chunks_exact(4).enumerate() {
                let all = (0..n).map(|r| value(r, i));
                let want = match op {
                    ReduceOp::Max => all.fold(0.0, f32::max),
                    ReduceOp::Average => all.sum::<f32>() / n as f32,
                    _ => all.sum(),
                };
                let got = f32::from_ne_bytes(c.try_into().unwrap());
                if got != want {
                    return Err(format!(
                        "round {round}, {op:?}, staged {staged}, {count} elements: element {i} is {got}, not {want}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Ranks on one CPU deposit allreduces of 4-16 KiB on the board with their headers (every one of them reduced out
/// of the deposits, `deposited_allreduces`, and none of 16 KiB + 4 B, past the threshold); one rank that does not (`allreduce_deposit_bytes` 0: its own setting,
/// as a rank's own verdict on its cores could differ) makes every rank take the usual path (none), with the same
/// results. Rank threads here, rank processes (one with
/// `HVD_ALLREDUCE_DEPOSIT_BYTES=0`) in [`deposits_between_processes_are_used_only_when_every_rank_made_one`].
#[test]
fn deposits_are_used_only_when_every_rank_made_one() {
    one_cpu();
    // The default threshold whatever the environment says: 4096 floats are the most 4 ranks deposit.
    let depositing = Thresholds {
        allreduce_deposit_bytes: 49152,
        ..Thresholds::from_env()
    };
    for refuser in [None, Some(2)] {
        let mut job = LocalJob::new(4, Backend::Shm)
            .timeout(Duration::from_secs(20))
            .thresholds(depositing);
        if let Some(r) = refuser {
            let refusing = Thresholds {
                allreduce_deposit_bytes: 0,
                ..depositing
            };
            job = job.rank_thresholds(r, refusing);
        }
        let results = job
            .run(|mut comm| {
                let before = deposited_allreduces();
                for count in [1024, 3001, 4096] {
                    deposit_rounds(comm.as_mut(), count, 20)?;
                }
                let deposited = deposited_allreduces() - before;
                // One float past the threshold: the usual path, not counted.
                deposit_rounds(comm.as_mut(), 4097, 2)?;
                match deposited_allreduces() - before - deposited {
                    0 => Ok::<u64, String>(deposited),
                    past => Err(format!(
                        "{past} allreduces of 4097 floats went through the deposits"
                    )),
                }
            })
            .expect("start the ranks");
        let want = if refuser.is_some() { 0 } else { 3 * 20 * 5 };
        for (r, res) in results.into_iter().enumerate() {
            let used = res.unwrap_or_else(|e| panic!("refuser {refuser:?}: rank {r}: {e}"));
            assert_eq!(
                used, want,
                "refuser {refuser:?}: rank {r}'s allreduces out of the deposits"
            );
        }
    }
}

/// 4 rank threads on one CPU; rank 1 leaves while the others wait for it in a small and a large allreduce.
#[test]
fn a_departed_peer_releases_oversubscribed_waiters() {
    one_cpu();
    for count in [1usize, 300_001] {
        let results = LocalJob::new(4, Backend::Shm)
            .timeout(Duration::from_secs(20))
            .run(|mut comm| {
                if comm.rank() == 1 {
                    // Let the others get into their waits first.
                    std::thread::sleep(Duration::from_millis(100));
                    drop(comm);
                    return Ok(());
                }
                let mut b = f32s(&vec![1.0; count]);
                comm.allreduce_in_place(&mut b, DType::F32, ReduceOp::Sum)
            })
            .expect("start the ranks");
        for (r, res) in results.into_iter().enumerate() {
            match (r, res) {
                (1, _) | (_, Err(Error::PeerLost { rank: 1, .. })) => {}
                (_, other) => panic!("{count} elements: rank {r} got {other:?}"),
            }
        }
    }
}

/// The worker side of [`a_killed_peer_releases_oversubscribed_waiters`]: does nothing unless started by it.
#[test]
fn worker() {
    workers::serve(WORKER, run_worker);
}

fn run_worker(scenario: &str) -> Result<String, Error> {
    let mut comm = bootstrap::from_env()?;
    if scenario == "deposits" {
        for count in [1024, 3001, 4096] {
            if let Err(e) = deposit_rounds(comm.as_mut(), count, 20) {
                return Ok(e);
            }
        }
        return Ok(format!(
            "right, {} out of the deposits",
            deposited_allreduces()
        ));
    }
    let rank = comm.rank();
    let mut one = f32s(&[1.0]);
    comm.allreduce_in_place(&mut one, DType::F32, ReduceOp::Sum)?;
    if rank == 1 {
        // Let the others get into their waits (past spinning and yielding) first.
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: a process killing itself; nothing to clean up.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let count = match scenario {
        "large" => 300_001,
        "deposit" => 3001,
        _ => 1,
    };
    let mut again = f32s(&vec![1.0; count]);
    Ok(
        match comm.allreduce_in_place(&mut again, DType::F32, ReduceOp::Sum) {
            Err(Error::PeerLost { rank, .. }) => format!("lost rank {rank}"),
            other => format!("unexpected {other:?}"),
        },
    )
}

/// 3 rank processes on one CPU (a named segment) deposit allreduces of 4-16 KiB (the default
/// `HVD_ALLREDUCE_DEPOSIT_BYTES`), then again with rank 1 refusing to (`HVD_ALLREDUCE_DEPOSIT_BYTES=0`): every
/// result right either way, every allreduce out of the deposits in the first, none in the second.
#[test]
fn deposits_between_processes_are_used_only_when_every_rank_made_one() {
    one_cpu();
    for refusing in [false, true] {
        let out = three_workers("deposits", |r| {
            let bytes = if r == 1 && refusing { "0" } else { "49152" };
            vec![("HVD_ALLREDUCE_DEPOSIT_BYTES", bytes)]
        });
        let want = if refusing { 0 } else { 3 * 20 * 5 };
        for (r, line) in out.iter().enumerate() {
            assert_eq!(
                line,
                &format!("right, {want} out of the deposits"),
                "rank 1 refusing: {refusing}; rank {r}"
            );
        }
    }
}

/// 3 rank processes on one CPU; rank 1 is killed while the others wait for it (board, deposits, arenas): both are
/// released with the peer-loss error naming it (a survivor that only gave up at its 20 s timeout would say
/// `Timeout`).
#[test]
fn a_killed_peer_releases_oversubscribed_waiters() {
    one_cpu();
    for scenario in ["small", "deposit", "large"] {
        let out = three_workers(scenario, |_| Vec::new());
        assert_eq!(out[1], "no result (killed?)", "{scenario}");
        for r in [0, 2] {
            assert_eq!(out[r], "lost rank 1", "{scenario}: rank {r}");
        }
    }
}

/// Runs `scenario` on 3 rank processes of this test binary (on one host, shm, a 20 s collective timeout), rank `r`
/// with the variables `env(r)` besides, and returns each one's RESULT line.
fn three_workers(
    scenario: &str,
    env: impl Fn(usize) -> Vec<(&'static str, &'static str)>,
) -> Vec<String> {
    let dir = tempfile::tempdir().expect("a rendezvous directory");
    let exe = std::env::current_exe().expect("test binary path");
    let children: Vec<_> = (0..3)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
                .envs(process_env(r, 3, dir.path(), "h"))
                .env(WORKER, scenario)
                .envs(env(r))
                .env("HVD_COLLECTIVE_TIMEOUT", "20")
                .env_remove("HVD_COLLECTIVE_BACKEND")
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("start a worker")
        })
        .collect();
    workers::results(children)
}
