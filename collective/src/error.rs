//! The error type of every communicator.

use std::time::Duration;

/// What can go wrong in a collective. Messages read after "failed to ...".
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Ranks called different operations, or the same one with different sizes, dtypes, reductions or roots.
    /// Every rank of the operation gets this error, with the same text.
    #[error("run matching collectives on every rank: {detail}")]
    Mismatch {
        /// The first rank whose call differs from rank `reference`'s.
        rank: usize,
        /// The rank compared against (the lowest rank of the group).
        reference: usize,
        /// What differs, e.g. "rank 1 called allgather(f32 x 3) but rank 0 called allreduce(f32 x 3, sum)".
        detail: String,
    },
    /// A peer died or left: its connection closed, its process is gone, or another rank reported it lost.
    #[error(
        "complete the collective: rank {rank} is gone ({reason}); the job cannot continue without it"
    )]
    PeerLost { rank: usize, reason: String },
    /// No progress from these ranks within the timeout (`HVD_COLLECTIVE_TIMEOUT`).
    #[error(
        "complete `{op}`: no progress from rank(s) {ranks:?} for {waited:?}; they may be dead or stuck \
         (raise `HVD_COLLECTIVE_TIMEOUT` if they are merely slow)"
    )]
    Timeout {
        op: &'static str,
        ranks: Vec<usize>,
        waited: Duration,
    },
    /// The caller passed buffers or counts that do not fit the operation. Other ranks get a `Mismatch`.
    #[error("run `{op}`: {detail}")]
    InvalidArgument { op: &'static str, detail: String },
    /// An earlier failure left the communicator unusable.
    #[error("use the communicator: it is broken by an earlier failure ({0}); restart the job")]
    Broken(String),
    /// A socket or shared-memory operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The communicator could not be set up (bad environment, unreachable rendezvous, ...).
    #[error("set up the communicator: {0}")]
    Bootstrap(String),
    /// The rendezvous server refused or failed a request.
    #[error("talk to the rendezvous server at `{address}`: {detail}")]
    Rendezvous { address: String, detail: String },
    /// A backend (MPI, NCCL) is not compiled in or its libraries are missing.
    #[error("use the `{backend}` backend: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Whether this error leaves the communicator unusable (a lost peer, a timeout, a broken transport).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::PeerLost { .. } | Error::Timeout { .. } | Error::Broken(_) | Error::Io { .. }
        )
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
