//! Rounds of the rendezvous against the real launcher server: a rank that joins the job again (`hvd.init()` after
//! `hvd.shutdown()`) meets under its new round's keys only. It never reads an address of an earlier round (nor one
//! under the old round-less key), and beginning a round deletes what the rank stored in its previous one.

use std::net::TcpListener;
use std::time::Duration;

use hvd_collective::bootstrap::{self, BackendChoice, JobEnv, Rendezvous};
use hvd_collective::{Communicator, DType, ReduceOp};
use hvd_launcher::rendezvous::RendezvousServer;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// The launcher's rendezvous server on loopback, as `hvd run` starts it for a local job.
fn server() -> RendezvousServer {
    RendezvousServer::start_on_loopback(TOKEN).unwrap()
}

fn job(rank: usize, rendezvous: &Rendezvous) -> JobEnv {
    JobEnv {
        rank,
        size: 2,
        hostname: "localhost".into(),
        rendezvous: Some(rendezvous.clone()),
        source: "hvd",
    }
}

/// Both ranks join over `backend` (as threads of this process: each counts its own rounds) and allreduce.
fn both_join(rendezvous: &Rendezvous, backend: BackendChoice) {
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let mut comm: Box<dyn Communicator> = bootstrap::connect(
                        &job(rank, rendezvous),
                        backend,
                        Duration::from_secs(30),
                    )
                    .unwrap();
                    let mut data = ((rank + 1) as f32).to_le_bytes();
                    comm.allreduce_in_place(&mut data, DType::F32, ReduceOp::Sum)
                        .unwrap();
                    f32::from_le_bytes(data)
                })
            })
            .collect();
        for r in ranks {
            assert_eq!(r.join().unwrap(), 3.0);
        }
    });
}

#[test]
fn a_rank_of_round_2_never_reads_an_address_of_round_1() {
    let server = server();
    let rendezvous = Rendezvous::Http {
        address: server.addr().to_string(),
        token: Some(TOKEN.into()),
    };
    both_join(&rendezvous, BackendChoice::Tcp);
    // Rank 1's address of round 1, and under the round-less key, now point at a listener that records connections.
    let trap = TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let stale = format!("v1 localhost {}", trap.local_addr().unwrap());
    let raw = rendezvous.client(1);
    for key in ["r1.addr.1", "addr.1"] {
        raw.put(key, stale.as_bytes()).unwrap();
    }
    // Round 2 of rank 0 alone: rank 1 has not joined it, so rank 0 waits for round 2's address and gives up.
    let e = bootstrap::connect(
        &job(0, &rendezvous),
        BackendChoice::Tcp,
        Duration::from_secs(2),
    )
    .err()
    .expect("rank 0 joined round 2 without rank 1");
    assert!(
        e.to_string().contains("no rank stored `r2.addr.1`")
            && e.to_string().contains("join 2 of the job by this rank"),
        "{e}"
    );
    assert!(
        trap.accept().is_err(),
        "rank 0 connected to rank 1's address of round 1"
    );
}

#[test]
fn ranks_join_again_and_again_over_shm_and_tcp_keeping_two_rounds_of_keys() {
    let dir = tempfile::tempdir().unwrap();
    let server = server();
    for rendezvous in [
        Rendezvous::Http {
            address: server.addr().to_string(),
            token: Some(TOKEN.into()),
        },
        Rendezvous::Directory(dir.path().join("rdv")),
    ] {
        for backend in [
            BackendChoice::Shm,
            BackendChoice::Tcp,
            BackendChoice::Shm,
            BackendChoice::Tcp,
        ] {
            both_join(&rendezvous, backend);
        }
        // Round 4 is the latest: its keys and round 3's are there, rounds 1 and 2's are deleted.
        let raw = rendezvous.client(0);
        for rank in 0..2 {
            for (round, kept) in [(1, false), (2, false), (3, true), (4, true)] {
                let got = raw.get(&format!("r{round}.addr.{rank}"), Duration::from_millis(100));
                assert_eq!(
                    got.is_ok(),
                    kept,
                    "{rendezvous:?}: round {round}'s address of rank {rank}: {got:?}"
                );
            }
        }
    }
    let files: Vec<String> = std::fs::read_dir(dir.path().join("rdv/hvd"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !files.is_empty()
            && files
                .iter()
                .all(|f| f.starts_with("r3.") || f.starts_with("r4.")),
        "files of earlier rounds are left: {files:?}"
    );
}
