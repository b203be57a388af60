//! The package index client: PEP 691 JSON with PEP 503 HTML fallback, PEP 658/714 metadata files, METADATA read
//! out of wheels by HTTP range, sdist static metadata, an on-disk HTTP cache with ETag / Cache-Control
//! revalidation, retries with backoff, and `--offline`.
//!
//! This module holds the client's types and its project-page entry point; the rest is split by role:
//! `http` sends requests within their deadlines and size limits, `cache` keeps the on-disk caches, `page` parses
//! project pages, and `artifacts` reads metadata out of artifacts.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use reqwest::Url;
use serde::{Deserialize, Serialize};

use crate::deadline::{BadDeadlineSetting, DeadlineExceeded, HttpDeadlines};
use crate::digest::Sha256;
use crate::metadata;

mod artifacts;
mod cache;
mod http;
mod page;

pub use http::error_chain;
use page::{parse_html_page, parse_json_page};

const SIMPLE_ACCEPT: &str = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01";

/// A failure talking to the index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("failed to fetch `{url}`")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("`{url}` answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("package `{name}` was not found on the index (`{url}` answered 404)")]
    NotFound { name: String, url: String },
    #[error(
        "`{url}` is not in the cache and `--offline` forbids the network; run once without `--offline`"
    )]
    Offline { url: String },
    #[error("failed to parse the index page `{url}`: {message}")]
    Parse { url: String, message: String },
    #[error("failed to read the wheel `{url}`")]
    Zip {
        url: String,
        #[source]
        source: metadata::ZipError,
    },
    #[error("failed to read the sdist `{url}`: {message}")]
    Sdist { url: String, message: String },
    #[error("cache I/O failed")]
    Cache(#[from] std::io::Error),
    #[error("bad index url `{0}`")]
    BadUrl(String),
    #[error(
        "`{url}` does not match the sha256 the index lists for it: expected {expected}, got {actual}; the index or the file was changed, nothing was cached"
    )]
    HashMismatch {
        url: String,
        expected: String,
        actual: String,
    },
    #[error("`{url}` is larger than the {limit} bytes hvd reads for it; refusing it")]
    TooLarge { url: String, limit: u64 },
    #[error("reading `{url}` failed: {message} (an internal error, please report it)")]
    Panicked { url: String, message: String },
    #[error(
        "`{url}` ({what}) took too long: {reason}; the index host is stalling or the network is too slow: retry later, use another index, or raise the limit as said"
    )]
    Deadline {
        url: String,
        /// What was being fetched, naming the package (a project page, a file name).
        what: String,
        reason: DeadlineExceeded,
    },
    #[error(transparent)]
    Setting(#[from] BadDeadlineSetting),
}

/// One file listed on a project page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexFile {
    pub filename: String,
    /// Absolute URL without fragment.
    pub url: String,
    /// The digest the index lists (validated: 64 hex digits).
    pub sha256: Option<Sha256>,
    pub size: Option<u64>,
    pub requires_python: Option<String>,
    pub yanked: bool,
    /// PEP 658/714: `<url>.metadata` is served.
    pub core_metadata: bool,
    /// PEP 658/714: the sha256 of `<url>.metadata`, when the index gives it (checked on download).
    #[serde(default)]
    pub core_metadata_sha256: Option<Sha256>,
}

#[derive(Debug, Clone, Default)]
pub struct ProjectPage {
    pub name: String,
    pub url: String,
    pub files: Vec<IndexFile>,
}

/// Request counters, to prove cache hits in tests and report them.
#[derive(Debug, Default)]
pub struct Stats {
    /// Requests sent over the network (each retry counts).
    pub requests: AtomicU64,
    /// 304 answers to revalidations.
    pub not_modified: AtomicU64,
    /// Served from the cache without any request.
    pub cache_hits: AtomicU64,
    /// Body bytes received.
    pub bytes: AtomicU64,
}

/// Client settings.
#[derive(Debug, Clone)]
pub struct IndexOptions {
    /// The simple-API root.
    pub index_url: String,
    pub cache_dir: PathBuf,
    pub offline: bool,
    /// Extra trusted CA certificates (PEM bundle), e.g. pip's `cert` setting behind a TLS-inspecting proxy.
    pub ca_bundle: Option<PathBuf>,
    /// How long one request may take (see [`crate::deadline`]).
    pub deadlines: HttpDeadlines,
}

/// The cache directory: `$HVD_CACHE_DIR`, else `<user cache dir>/hvd`.
pub(crate) fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(crate::env_vars::HVD_CACHE_DIR).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    dirs::cache_dir()
        .unwrap_or_else(std::env::temp_dir)
        .join("hvd")
}

#[derive(Debug, Clone)]
pub struct IndexClient {
    http: reqwest::Client,
    options: Arc<IndexOptions>,
    pub stats: Arc<Stats>,
}

/// An HTTP client as hvd's fetchers share it: `roots` trusted besides the system's certificates, hvd's user agent,
/// and the connect and read timeouts; each caller adds what is its own.
pub(crate) fn client_builder(roots: Vec<reqwest::Certificate>) -> reqwest::ClientBuilder {
    let mut builder = reqwest::Client::builder();
    for cert in roots {
        builder = builder.add_root_certificate(cert);
    }
    builder
        .user_agent(concat!("hvd/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(15))
        .read_timeout(Duration::from_secs(60))
}

impl IndexClient {
    pub fn new(options: IndexOptions) -> Result<IndexClient, IndexError> {
        let mut options = options;
        if !options.index_url.ends_with('/') {
            options.index_url.push('/');
        }
        Url::parse(&options.index_url)
            .map_err(|_| IndexError::BadUrl(options.index_url.clone()))?;
        let mut roots = Vec::new();
        if let Some(bundle) = &options.ca_bundle {
            let pem = fs_err::read(bundle)?;
            roots =
                reqwest::Certificate::from_pem_bundle(&pem).map_err(|source| IndexError::Http {
                    url: bundle.display().to_string(),
                    source,
                })?;
        }
        let http = client_builder(roots)
            .pool_max_idle_per_host(64)
            .build()
            .map_err(|source| IndexError::Http {
                url: options.index_url.clone(),
                source,
            })?;
        Ok(IndexClient {
            http,
            options: Arc::new(options),
            stats: Arc::default(),
        })
    }

    pub fn index_url(&self) -> &str {
        &self.options.index_url
    }

    pub fn offline(&self) -> bool {
        self.options.offline
    }

    /// The project page of `name` (normalized).
    pub async fn project(&self, name: &str) -> Result<ProjectPage, IndexError> {
        let url = format!("{}{}/", self.options.index_url, name);
        let started = std::time::Instant::now();
        let fetched = self
            .within(
                &url,
                || format!("the project page of `{name}`"),
                self.get_cached(&url, SIMPLE_ACCEPT),
            )
            .await?;
        tracing::debug!(
            url,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "project page"
        );
        let Some((body, content_type)) = fetched else {
            return Err(IndexError::NotFound {
                name: name.to_string(),
                url,
            });
        };
        let base = Url::parse(&url).map_err(|_| IndexError::BadUrl(url.clone()))?;
        let files = if content_type.contains("json") {
            parse_json_page(&body, &base)
        } else {
            parse_html_page(&String::from_utf8_lossy(&body), &base)
        }
        .map_err(|message| IndexError::Parse {
            url: url.clone(),
            message: format!("package `{name}`: {message}"),
        })?;
        Ok(ProjectPage {
            name: name.to_string(),
            url,
            files,
        })
    }
}
