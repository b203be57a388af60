//! The shm single-copy allreduce between rank processes (this test binary re-run as workers, joined through the
//! launcher's real rendezvous server): off by default, on with `HVD_SHM_CMA=1`, off for everyone when one rank
//! sets `HVD_SHM_CMA=0` or cannot read its peer (a seccomp filter refusing `process_vm_readv`, as a sandbox would), and a rank killed
//! mid-exchange named by the survivor.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hvd_collective::{DType, Error, ReduceOp, bootstrap};
use hvd_launcher::rendezvous::RendezvousServer;

mod log_capture;
mod workers;

const WORKER: &str = "HVD_SINGLE_COPY_TEST_WORKER";
const ON: &str = "large allreduces read peers' memory";
const OFF: &str = "large allreduces use the ring";

/// 4 MiB of f32 per allreduce: past the single copy's 1 MiB threshold, odd so that the blocks are uneven.
const COUNT: usize = (1 << 20) + 3;

/// The worker side: does nothing unless started by [`start`].
#[test]
fn worker() {
    workers::serve(WORKER, |scenario| {
        log_capture::install();
        run_worker(scenario)
    });
}

fn run_worker(scenario: &str) -> Result<String, Error> {
    if scenario == "refuse" && std::env::var("HVD_RANK").as_deref() == Ok("1") {
        refuse_process_vm_readv();
    }
    let mut comm = bootstrap::from_env()?;
    let (rank, size) = (comm.rank(), comm.size());
    if scenario == "die" {
        return die(comm.as_mut(), rank);
    }
    for round in 0..3 {
        let mut buf: Vec<u8> = (0..COUNT)
            .flat_map(|i| ((i % 1000) as f32 + rank as f32).to_ne_bytes())
            .collect();
        comm.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum)?;
        for (i, c) in buf.chunks_exact(4).enumerate() {
            let want = (size * (i % 1000)) as f32 + (size * (size - 1) / 2) as f32;
            let got = f32::from_ne_bytes(c.try_into().unwrap_or_default());
            if got != want {
                return Ok(format!(
                    "round {round}: element {i} is {got}, expected {want}"
                ));
            }
        }
    }
    let path = match (log_capture::logged(ON), log_capture::logged(OFF)) {
        (true, false) => "single copy",
        (false, true) => "ring",
        _ => "unknown",
    };
    Ok(format!("exact via {path}"))
}

/// Rank 1 kills itself from another thread while its main thread runs large allreduces; rank 0 runs them until
/// one fails and reports the error.
fn die(comm: &mut dyn hvd_collective::Communicator, rank: usize) -> Result<String, Error> {
    let mut buf = vec![0u8; 16 << 20];
    comm.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum)?;
    if rank == 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            // SAFETY: a process killing itself; nothing to clean up.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    }
    for _ in 0..100_000 {
        match comm.allreduce_in_place(&mut buf, DType::F32, ReduceOp::Sum) {
            Ok(()) => {}
            Err(Error::PeerLost { rank, .. }) => return Ok(format!("lost rank {rank}")),
            Err(e) => return Ok(format!("unexpected {e}")),
        }
    }
    Ok("never noticed".into())
}

/// Makes `process_vm_readv` fail with EPERM in this thread, as a sandbox's seccomp profile does.
fn refuse_process_vm_readv() {
    // Classic BPF: load the syscall number, return EPERM for process_vm_readv, allow everything else.
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
    let filter = [
        libc::sock_filter {
            code: LD_W_ABS,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: JEQ_K,
            jt: 0,
            jf: 1,
            k: libc::SYS_process_vm_readv as u32,
        },
        libc::sock_filter {
            code: RET_K,
            jt: 0,
            jf: 0,
            k: SECCOMP_RET_ERRNO | libc::EPERM as u32,
        },
        libc::sock_filter {
            code: RET_K,
            jt: 0,
            jf: 0,
            k: SECCOMP_RET_ALLOW,
        },
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: plain prctl calls; `prog` points to a valid filter that outlives the call (the kernel copies it).
    let ok = unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            && libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
            ) == 0
    };
    assert!(
        ok,
        "install the seccomp filter: {}",
        std::io::Error::last_os_error()
    );
}

fn start(rank: usize, size: usize, env: &[(&str, String)], scenario: &str) -> Child {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "worker", "--nocapture", "--test-threads=1"])
        .env(WORKER, scenario)
        .env("HVD_RANK", rank.to_string())
        .env("HVD_SIZE", size.to_string())
        .env("HVD_HOSTNAME", "h")
        .env("HVD_COLLECTIVE_TIMEOUT", "10")
        .env_remove("HVD_COLLECTIVE_BACKEND")
        .env_remove("HVD_SHM_CMA")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("start a worker")
}

/// Runs two workers on one host (shm), `both_env` for both and `rank1_env` for rank 1 only, and returns each one's RESULT line (a worker
/// that gives none in 60 s is killed and reported as hung).
fn run_pair(scenario: &str, both_env: &[(&str, &str)], rank1_env: &[(&str, &str)]) -> Vec<String> {
    run_ranks(2, scenario, both_env, rank1_env)
}

/// [`run_pair`] with `n` workers (`rank1_env` still for rank 1 only).
fn run_ranks(
    n: usize,
    scenario: &str,
    both_env: &[(&str, &str)],
    rank1_env: &[(&str, &str)],
) -> Vec<String> {
    let token = "0123456789abcdef".to_string();
    let srv = RendezvousServer::start_on_loopback(&token).expect("start the rendezvous server");
    let children: Vec<Child> = (0..n)
        .map(|r| {
            let mut env = vec![
                ("HVD_RENDEZVOUS", srv.addr().to_string()),
                ("HVD_JOB_TOKEN", token.clone()),
            ];
            env.extend(both_env.iter().map(|(k, v)| (*k, v.to_string())));
            if r == 1 {
                env.extend(rank1_env.iter().map(|(k, v)| (*k, v.to_string())));
            }
            start(r, n, &env, scenario)
        })
        .collect();
    workers::results(children)
}

const CMA: &[(&str, &str)] = &[("HVD_SHM_CMA", "1")];

/// By default ranks in different processes keep the ring (process_vm_readv was slower than it where measured).
#[test]
fn processes_take_the_ring_by_default() {
    let out = run_pair("ok", &[], &[]);
    assert_eq!(out, ["exact via ring", "exact via ring"]);
}

#[test]
fn processes_read_each_other_with_process_vm_readv_when_asked() {
    let out = run_pair("ok", CMA, &[]);
    assert_eq!(out, ["exact via single copy", "exact via single copy"]);
}

/// Three processes (where the single copy now comes before the arenas) read each other with `process_vm_readv`,
/// segment by segment, when asked: exact.
#[test]
fn three_processes_read_each_other_with_process_vm_readv_when_asked() {
    let out = run_ranks(3, "ok", CMA, &[]);
    assert_eq!(out, ["exact via single copy"; 3]);
}

#[test]
fn one_rank_saying_no_turns_it_off_for_both() {
    let out = run_pair("ok", CMA, &[("HVD_SHM_CMA", "0")]);
    assert_eq!(out, ["exact via ring", "exact via ring"]);
}

#[test]
fn a_rank_refused_process_vm_readv_turns_it_off_for_both() {
    let out = run_pair("refuse", CMA, &[]);
    assert_eq!(out, ["exact via ring", "exact via ring"]);
}

#[test]
fn a_rank_killed_mid_exchange_is_named() {
    let out = run_pair("die", CMA, &[]);
    assert_eq!(out[0], "lost rank 1", "rank 0");
    assert_eq!(out[1], "no result (killed?)", "rank 1");
}
