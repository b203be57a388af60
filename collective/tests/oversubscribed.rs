//! The shm wait path when ranks outnumber cores: the test process (and so every rank thread or worker process it
//! starts) is confined to one CPU, so every rank takes the oversubscribed path (brief spin, yields, futex sleep)
//! whatever the machine; the results must be right at every size, and a waiter whose peer dies must be released.

use std::process::{Command, Stdio};
use std::time::Duration;

use hvd_collective::testing::{Backend, LocalJob, process_env};
use hvd_collective::{DType, Error, ReduceOp, bootstrap};

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

/// 4 ranks on one CPU: allreduce through the board (4 B, 2 KiB), the arenas (64 KiB, 1.2 MiB: five chunks) and
/// an allgather through the rings, many times each, every result exact.
#[test]
fn four_ranks_on_one_cpu_get_every_size_right() {
    one_cpu();
    let results = LocalJob::new(4, Backend::Shm)
        .timeout(Duration::from_secs(20))
        .run(|mut comm| -> Result<(), Error> {
            let rank = comm.rank();
            for count in [1usize, 512, 16_384, 300_001] {
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
    let rank = comm.rank();
    let mut one = f32s(&[1.0]);
    comm.allreduce_in_place(&mut one, DType::F32, ReduceOp::Sum)?;
    if rank == 1 {
        // Let the others get into their waits (past spinning and yielding) first.
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: a process killing itself; nothing to clean up.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let count = if scenario == "large" { 300_001 } else { 1 };
    let mut again = f32s(&vec![1.0; count]);
    Ok(
        match comm.allreduce_in_place(&mut again, DType::F32, ReduceOp::Sum) {
            Err(Error::PeerLost { rank, .. }) => format!("lost rank {rank}"),
            other => format!("unexpected {other:?}"),
        },
    )
}

/// 3 rank processes on one CPU; rank 1 is killed while the others wait for it (board and arenas): both are
/// released with the peer-loss error naming it (a survivor that only gave up at its 20 s timeout would say
/// `Timeout`).
#[test]
fn a_killed_peer_releases_oversubscribed_waiters() {
    one_cpu();
    for scenario in ["small", "large"] {
        let dir = tempfile::tempdir().expect("a rendezvous directory");
        let exe = std::env::current_exe().expect("test binary path");
        let children: Vec<_> = (0..3)
            .map(|r| {
                Command::new(&exe)
                    .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
                    .envs(process_env(r, 3, dir.path(), "h"))
                    .env(WORKER, scenario)
                    .env("HVD_COLLECTIVE_TIMEOUT", "20")
                    .env_remove("HVD_COLLECTIVE_BACKEND")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start a worker")
            })
            .collect();
        let out = workers::results(children);
        assert_eq!(out[1], "no result (killed?)", "{scenario}");
        for r in [0, 2] {
            assert_eq!(out[r], "lost rank 1", "{scenario}: rank {r}");
        }
    }
}
