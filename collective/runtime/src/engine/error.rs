//! The errors the engine reports to callers, and their kinds (what a caller can do about each). A message says
//! what failed at its own layer; the cause is its `source()` (the C ABI writes the whole chain).

use std::sync::Arc;

use crate::config::ConfigError;
use crate::message::DecodeError;

/// Errors the engine reports to callers.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The ranks' requests for an operation disagree (name submitted twice, operation, dtype, shape, root, group;
    /// a broadcast rooted at a joined rank): the coordinator failed it on every rank, and the job goes on.
    #[error("{0}")]
    Mismatch(String),
    /// The engine stopped; every pending and later operation fails with the reason (the source).
    #[error("the hvd engine has stopped")]
    Stopped(#[source] Arc<Stop>),
    #[error("unknown handle {0}")]
    UnknownHandle(u64),
    #[error(transparent)]
    Config(Arc<ConfigError>),
    #[error("failed to create the timeline `{path}`")]
    Timeline {
        path: String,
        #[source]
        source: Arc<std::io::Error>,
    },
}

/// Why the engine stopped.
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    /// Every rank asked to shut down.
    #[error("shut down")]
    Shutdown,
    /// A collective failed (a lost peer, a timeout, a broken connection): the transport cannot go on.
    #[error("a collective failed")]
    Collective(#[source] hvd_collective::Error),
    /// A rank did not submit what the others wait for within `HVD_STALL_SHUTDOWN_TIME` (the coordinator's text).
    #[error("{0}")]
    Stalled(String),
    /// A peer sent negotiation bytes this rank cannot read.
    #[error(transparent)]
    Protocol(#[from] DecodeError),
    #[error("cannot start the engine thread")]
    Spawn(#[source] std::io::Error),
    /// The engine's own state disagrees with what the coordinator sent (a bug).
    #[error("{0}")]
    Internal(String),
}

impl From<hvd_collective::Error> for Stop {
    fn from(e: hvd_collective::Error) -> Stop {
        Stop::Collective(e)
    }
}

hvd_collective::wire_enum! {
    /// What kind of failure an error is, for callers that act on it: the C ABI reports it (`enum hvd_error_kind`
    /// in hvd.h, whose codes are these discriminants: never renumber) and the Python package raises one exception
    /// class per kind.
    pub enum ErrorKind: i32 {
        /// A bad argument or request, refused on this rank before anything ran.
        InvalidArgument = 1,
        /// The ranks' requests disagree: the operation failed on every rank, and the job goes on.
        Mismatch,
        /// A peer died or left: the job cannot go on.
        PeerLost,
        /// No progress from some rank within the collective timeout: the job cannot go on.
        Timeout,
        /// A rank did not submit an operation the others wait for within `HVD_STALL_SHUTDOWN_TIME`.
        Stalled,
        /// The engine is not running: not initialized, or shut down.
        NotInitialized,
        /// Anything else that stops the job: a broken connection, an I/O error, a malformed message, a bug.
        Internal,
    }
}

impl ErrorKind {
    /// The kind of a collective's failure.
    pub fn of_collective(e: &hvd_collective::Error) -> ErrorKind {
        match e {
            hvd_collective::Error::PeerLost { .. } => ErrorKind::PeerLost,
            hvd_collective::Error::Timeout { .. } => ErrorKind::Timeout,
            _ => ErrorKind::Internal,
        }
    }
}

impl Stop {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Stop::Shutdown => ErrorKind::NotInitialized,
            Stop::Collective(e) => ErrorKind::of_collective(e),
            Stop::Stalled(_) => ErrorKind::Stalled,
            Stop::Protocol(_) | Stop::Spawn(_) | Stop::Internal(_) => ErrorKind::Internal,
        }
    }
}

impl EngineError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            EngineError::InvalidRequest(_)
            | EngineError::UnknownHandle(_)
            | EngineError::Config(_)
            | EngineError::Timeline { .. } => ErrorKind::InvalidArgument,
            EngineError::Mismatch(_) => ErrorKind::Mismatch,
            EngineError::Stopped(stop) => stop.kind(),
        }
    }

    /// Whether the engine is unusable after this error: it has stopped, and every later operation fails too.
    pub fn is_fatal(&self) -> bool {
        matches!(self, EngineError::Stopped(_))
    }

    /// The collective's failure behind this error, if it is one (e.g. `PeerLost { rank, .. }`).
    pub fn collective(&self) -> Option<&hvd_collective::Error> {
        match self {
            EngineError::Stopped(stop) => match &**stop {
                Stop::Collective(e) => Some(e),
                _ => None,
            },
            _ => None,
        }
    }
}
