//! The `nccl` backend. Without CUDA (CI) it must say so clearly instead of crashing; with a GPU
//! (`collective/gpu-check.sh`) it runs the conformance cases at world size 1, the unique id travelling through a
//! directory rendezvous, and on 2 ranks (threads, one GPU each) when the machine has 2 GPUs.

#![cfg(feature = "nccl")]

use std::time::Duration;

use hvd_collective::bootstrap::{self, BackendChoice, JobEnv, Rendezvous};
use hvd_collective::nccl::{NcclCommunicator, available, new_id};
use hvd_collective::{Communicator, DType, Error, Topology};

mod common;
use common::{LARGE, run_all};

/// `None` (and a note) when this machine has no usable CUDA + NCCL; the error must then be `Unavailable`.
fn gpus() -> Option<usize> {
    match available() {
        Ok(n) => Some(n),
        Err(e) => {
            assert!(
                matches!(
                    e,
                    Error::Unavailable {
                        backend: "nccl",
                        ..
                    }
                ),
                "{e:?}"
            );
            eprintln!("no CUDA/NCCL here ({e}); GPU cases skipped");
            None
        }
    }
}

#[test]
fn without_a_gpu_the_backend_is_unavailable_not_a_crash() {
    if gpus().is_some() {
        return;
    }
    let job = JobEnv {
        rank: 0,
        size: 1,
        hostname: "h".into(),
        rendezvous: None,
        source: "hvd",
    };
    let err = bootstrap::connect(&job, BackendChoice::Nccl, Duration::from_secs(1))
        .err()
        .expect("an error");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.to_string().contains("nccl"), "{err}");
}

fn all_cases(c: &mut dyn Communicator) -> Result<(), String> {
    for (k, dtype) in DType::ALL.into_iter().enumerate() {
        for in_place in [false, true] {
            run_all(c, dtype, 7, in_place, k)?;
        }
    }
    for count in [0, 1, LARGE] {
        run_all(c, DType::F32, count, false, count)?;
    }
    Ok(())
}

#[test]
fn world_size_one_with_the_id_exchanged_through_a_rendezvous() {
    if gpus().is_none() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let job = JobEnv {
        rank: 0,
        size: 1,
        hostname: "h".into(),
        rendezvous: Some(Rendezvous::Directory(dir.path().to_path_buf())),
        source: "hvd",
    };
    let mut comm = bootstrap::connect(&job, BackendChoice::Nccl, Duration::from_secs(30))
        .expect("join over NCCL");
    assert_eq!(comm.backend(), "nccl");
    assert!(
        dir.path()
            .join("hvd")
            .join(hvd_collective::rendezvous::Round::FIRST.key("nccl.id"))
            .exists(),
        "the id went through the rendezvous"
    );
    all_cases(comm.as_mut()).expect("conformance on one GPU");
}

#[test]
fn two_ranks_on_two_gpus() {
    match gpus() {
        Some(n) if n >= 2 => {}
        _ => return,
    }
    let id = new_id().expect("an NCCL id");
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let topo = Topology::single_host(r, 2);
                    let mut c = NcclCommunicator::new(topo, r, id).map_err(|e| e.to_string())?;
                    all_cases(&mut c)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}
