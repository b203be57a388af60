//! Collective communication for hvd workers: the [`Communicator`] trait and its implementations over shared
//! memory (`shm`), TCP (`tcp`), both at once (`hierarchical`), MPI (feature `mpi`) and NCCL (feature `nccl`),
//! the algorithms they share, and the bootstrap that connects the ranks of a job.
//!
//! Buffers are raw bytes plus a [`DType`], so the runtime can hand over any tensor memory. Every operation first
//! exchanges a small header with every rank, so mismatched calls fail on all ranks with the same message; a dead
//! peer makes pending operations fail within `HVD_COLLECTIVE_TIMEOUT` (default 30 s) with an error naming it.
//!
//! ```
//! use hvd_collective::testing::{Backend, LocalJob};
//! use hvd_collective::{DType, ReduceOp};
//!
//! // Four ranks in this process, each a thread, over TCP on loopback.
//! let out = LocalJob::new(4, Backend::Tcp)
//!     .run(|mut comm| {
//!         let mine: Vec<u8> = [comm.rank() as i32; 3].iter().flat_map(|v| v.to_ne_bytes()).collect();
//!         let mut sum = vec![0u8; mine.len()];
//!         comm.allreduce(&mine, &mut sum, DType::I32, ReduceOp::Sum).unwrap();
//!         i32::from_ne_bytes(sum[..4].try_into().unwrap())
//!     })
//!     .unwrap();
//! assert_eq!(out, [6, 6, 6, 6]);
//! ```
//!
//! Where to read: [`communicator`] (the trait), [`p2p`] (algorithms and the mismatch check), [`transport`] (the
//! point-to-point layer), [`board`] (what the collectives need from memory every rank shares), [`tcp`] and [`shm`]
//! (transports), [`bootstrap`] (joining a job from the environment, with [`job`] and [`rendezvous`]).

// A library reports through its errors and `tracing`; only the `hvd` binary writes to the terminal.
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod board;
pub mod bootstrap;
pub mod communicator;
pub mod config;
pub mod env_vars;
pub mod error;
mod header;
pub mod hierarchical;
pub mod job;
pub mod launch_env;
pub mod liveness;
pub mod mpi_backend;
pub mod nccl;
#[cfg(any(feature = "mpi", feature = "nccl"))]
pub mod negotiated;
pub mod p2p;
pub mod reduce;
pub mod rendezvous;
pub mod shm;
pub mod tcp;
pub mod testing;
pub mod time;
pub mod transport;
pub mod types;
pub mod wire_enum;

pub use communicator::{
    Allgatherv, Alltoallv, Communicator, InPlace, Reducescatter, Staged, StagedAllreduce,
};
pub use config::Thresholds;
pub use error::{Error, Result};
pub use types::{DType, ReduceOp, Topology};

/// Whether this build has the `mpi` backend (cargo feature `mpi`); without it that backend answers
/// [`Error::Unavailable`].
pub const BUILT_WITH_MPI: bool = cfg!(feature = "mpi");
/// Whether this build has the `nccl` backend (cargo feature `nccl`); NCCL itself is loaded at run time.
pub const BUILT_WITH_NCCL: bool = cfg!(feature = "nccl");
