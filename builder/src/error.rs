//! The builder's error type. Variants are the decisions a caller can take (retry a download, fix the lock, ...).

use std::path::PathBuf;

/// Everything that can go wrong while fetching, building or assembling.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error; `fs-err` already put the path into the message.
    #[error(transparent)]
    Io(#[from] std::io::Error),

    #[error(
        "sha256 mismatch for `{url}`: expected {expected}, got {actual}; nothing was installed"
    )]
    HashMismatch {
        url: String,
        expected: String,
        actual: String,
    },

    #[error("failed to download `{url}`: {message}")]
    Download { url: String, message: String },

    #[error(
        "`{url}` is not in the download cache and `--offline` forbids the network; run once without `--offline`"
    )]
    Offline { url: String },

    /// An archive entry that could write, link or read outside its tree, or break a limit; nothing was installed.
    #[error("refusing archive `{archive}`: entry `{entry}` {reason}")]
    UnsafeArchiveEntry {
        archive: PathBuf,
        entry: String,
        reason: String,
    },

    /// A package's archive was refused or could not be installed: names the package, the cause says why.
    #[error("failed to install {name} {version} from `{filename}`; nothing of it was installed")]
    Install {
        name: String,
        version: String,
        filename: String,
        #[source]
        source: Box<Error>,
    },

    #[error("failed to read archive `{archive}`: {message}")]
    Archive { archive: PathBuf, message: String },

    #[error("invalid wheel `{wheel}`: {message}")]
    InvalidWheel { wheel: PathBuf, message: String },

    #[error(
        "no python {version} found (looked at HVD_PYTHON, python{version} on PATH, pyenv's versions, /usr/bin, \
         /usr/local/bin and python3 on PATH); install python{version} or set HVD_PYTHON to one"
    )]
    PythonNotFound { version: String },

    #[error("source build of {name} {version} failed: {message}\nbuild log: {log}\n{tail}")]
    BuildFailed {
        name: String,
        version: String,
        message: String,
        log: PathBuf,
        tail: String,
    },

    #[error(
        "toolchain mismatch: the lock expects {expected}, this machine has {found}; install it or run `hvd lock` again"
    )]
    ToolchainMismatch { expected: String, found: String },

    #[error("toolchain `{name}` not found on PATH; install it or change `env.toolchain`")]
    ToolchainNotFound { name: String },

    /// The lock pins the interpreter's store path by content hash and this machine's interpreter of that version
    /// has other content (or the lock was edited).
    #[error(
        "the lock pins python {version} with content hash {expected}, but python {version} at `{executable}` copied \
         into the store has content hash {found}"
    )]
    InterpreterMismatch {
        version: String,
        executable: PathBuf,
        expected: String,
        found: String,
    },

    /// A binary cache was unusable, or refused a path (which it names, with the cache).
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheError),

    #[error("invalid build input: {0}")]
    Invalid(String),

    #[error(
        "store path metadata `{path}` is unreadable: {message}; remove the path and build again"
    )]
    CorruptPath { path: PathBuf, message: String },
}

/// The builder's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
