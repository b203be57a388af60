//! The signed binary cache: store paths as archives plus signed records in a directory, over HTTP(S) or in S3,
//! pushed from one store and substituted into another (docs/store.md, "Binary cache").
//!
//! Roles: [`key`] (ed25519 keys and their text form), [`record`] (what a cache says about a path, and what is
//! signed), [`archive`] (a path's deterministic archive), [`backend`] (where a cache lives), [`substitute`]
//! (verified installation into a store), [`push`] (uploading a closure).

pub mod archive;
pub mod backend;
pub mod key;
pub mod push;
pub mod record;
pub mod substitute;

pub use backend::Cache;
pub use key::{PublicKey, SecretKey};
pub use push::{PushReport, push};
pub use substitute::Substituter;

/// The file at a cache's root that says what it is: `format: 1` and `store: <the store directory it serves>`.
pub const CACHE_INFO: &str = "hvd-cache-info";
/// The cache layout this hvd reads and writes.
pub const CACHE_FORMAT: u32 = 1;

/// What can go wrong reading, writing or trusting a cache. Every refusal names the store path and the cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(transparent)]
    Io(#[from] std::io::Error),

    #[error("key `{key}`: {message}")]
    Key { key: String, message: String },

    #[error("invalid cache `{url}`: {message}")]
    Url { url: String, message: String },

    #[error("cache `{cache}`: `{key}` {message}")]
    Backend {
        cache: String,
        key: String,
        message: String,
    },

    #[error("cache `{cache}`: `{key}` is larger than the {limit} bytes expected")]
    TooLarge {
        cache: String,
        key: String,
        limit: u64,
    },

    #[error("cache `{cache}` is not usable: {message}")]
    NotACache { cache: String, message: String },

    #[error(
        "refusing {name} from cache `{cache}`: its record is unusable: {message}; nothing was installed"
    )]
    BadRecord {
        cache: String,
        name: String,
        message: String,
    },

    #[error(
        "refusing {name} from cache `{cache}`: its signature by the trusted key `{key}` does not verify (the record \
         was changed after it was signed, or forged); nothing was installed"
    )]
    BadSignature {
        cache: String,
        name: String,
        key: String,
    },

    #[error(
        "refusing {name} from cache `{cache}`: its archive has sha256 {actual} ({actual_size} bytes), the signed \
         record says {expected} ({expected_size} bytes); nothing was installed"
    )]
    ArchiveMismatch {
        cache: String,
        name: String,
        expected: String,
        expected_size: u64,
        actual: String,
        actual_size: u64,
    },

    #[error(
        "refusing {name} from cache `{cache}`: the unpacked tree has content hash {actual}, the signed record says \
         {expected}; nothing was installed"
    )]
    ContentMismatch {
        cache: String,
        name: String,
        expected: String,
        actual: String,
    },

    #[error(
        "refusing {name} from cache `{cache}`: its archive could not be unpacked; nothing was installed"
    )]
    Unpack {
        cache: String,
        name: String,
        #[source]
        source: Box<crate::Error>,
    },

    #[error("cannot push {name}: {message}")]
    Push { name: String, message: String },

    /// The partial archive a download resumes (`<store>/.tmp/archives/<sha256>.part`) cannot be used.
    #[error("partial archive `{path}` {what}")]
    Partial {
        path: std::path::PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// The cache URLs of `HVD_CACHES` (space-separated), in order.
pub fn caches_from_env() -> Vec<String> {
    words_of(crate::env_vars::HVD_CACHES)
}

/// The trusted keys of `HVD_TRUSTED_KEYS` (space-separated key files or `NAME:BASE64`).
pub fn trusted_keys_from_env() -> Vec<String> {
    words_of(crate::env_vars::HVD_TRUSTED_KEYS)
}

fn words_of(variable: &str) -> Vec<String> {
    std::env::var(variable)
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Parse a cache's [`CACHE_INFO`]: its store directory.
pub(crate) fn parse_cache_info(text: &str) -> Result<String, String> {
    let mut format = None;
    let mut store = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (key, value) = line
            .split_once(':')
            .ok_or_else(|| format!("line `{}` is not `key: value`", line.escape_debug()))?;
        match key.trim() {
            "format" => format = Some(value.trim().to_string()),
            "store" => store = Some(value.trim().to_string()),
            _ => {}
        }
    }
    match format.as_deref() {
        Some(f) if f == CACHE_FORMAT.to_string() => {}
        Some(other) => {
            return Err(format!(
                "it has format {other}; this hvd reads format {CACHE_FORMAT}"
            ));
        }
        None => return Err("it has no `format:` line".into()),
    }
    store.ok_or_else(|| "it has no `store:` line".into())
}

/// The [`CACHE_INFO`] of a cache serving `store`.
pub(crate) fn cache_info_text(store: &std::path::Path) -> String {
    format!("format: {CACHE_FORMAT}\nstore: {}\n", store.display())
}
