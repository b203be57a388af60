//! The conformance suite on the `mpi` backend: this test binary re-run under OpenMPI's `mpirun` with 2 and 3
//! ranks. Skipped (with a note) when `mpirun` is not installed.

#![cfg(feature = "mpi")]

use std::process::Command;

use hvd_collective::mpi_backend::MpiCommunicator;
use hvd_collective::{Communicator, DType, Error, ReduceOp};

mod common;
use common::{LARGE, run_all};

const WORKER: &str = "HVD_COLLECTIVE_MPI_WORKER";

/// The rank side, started by `mpirun`; does nothing otherwise.
#[test]
fn mpi_worker() {
    if std::env::var(WORKER).is_err() {
        return;
    }
    let result = (|| -> Result<String, String> {
        let mut comm = MpiCommunicator::new().map_err(|e| e.to_string())?;
        let c: &mut dyn Communicator = &mut comm;
        for (k, dtype) in DType::ALL.into_iter().enumerate() {
            for in_place in [false, true] {
                run_all(c, dtype, 7, in_place, k)?;
            }
        }
        for count in [0, 1, LARGE] {
            run_all(c, DType::F32, count, false, count)?;
        }
        // A mismatch is reported on every rank and leaves the communicator usable.
        let mut b = vec![0u8; 8 + 4 * usize::from(c.rank() == 1)];
        match c.allreduce_in_place(&mut b, DType::F32, ReduceOp::Sum) {
            Err(Error::Mismatch { detail, .. }) if detail.contains("rank 1") => {}
            other => return Err(format!("expected a mismatch naming rank 1, got {other:?}")),
        }
        c.barrier().map_err(|e| e.to_string())?;
        Ok(format!(
            "ok rank {} of {} on {}",
            c.rank(),
            c.size(),
            c.backend()
        ))
    })();
    let code = match result {
        Ok(line) => {
            println!("\nRESULT {line}");
            0
        }
        Err(e) => {
            println!("\nRESULT error: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn mpirun(np: usize) {
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("mpirun not found: skipping the MPI suite (install OpenMPI to run it)");
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let out = Command::new("mpirun")
        .args(["-np", &np.to_string(), "--oversubscribe"])
        .args(["-x", WORKER])
        .arg(exe)
        .args(["--exact", "mpi_worker", "--nocapture", "--test-threads=1"])
        .env(WORKER, "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl", "self,vader")
        .output()
        .expect("run mpirun");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let results: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .collect();
    assert!(
        out.status.success()
            && results.len() == np
            && results.iter().all(|r| r.starts_with("ok rank")),
        "mpirun -np {np}: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..np {
        assert!(
            results.contains(&format!("ok rank {r} of {np} on mpi").as_str()),
            "{results:?}"
        );
    }
}

/// One test, so that two `mpirun`s never run at once (OpenMPI's launcher runs out of resources then).
#[test]
fn conformance_under_mpirun_with_2_and_3_ranks() {
    mpirun(2);
    mpirun(3);
}
