//! The errors the engine reports to callers.

use std::sync::Arc;

use crate::config::ConfigError;

/// Errors the engine reports to callers.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The collective failed on every rank (mismatch between ranks, stall shutdown).
    #[error("{0}")]
    Operation(String),
    /// The engine stopped (shut down or a transport failure); every pending and later operation fails.
    #[error("the hvd engine has stopped: {0}")]
    Stopped(String),
    #[error("unknown handle {0}")]
    UnknownHandle(u64),
    #[error(transparent)]
    Config(Arc<ConfigError>),
    #[error("failed to create the timeline `{path}`: {message}")]
    Timeline { path: String, message: String },
}
