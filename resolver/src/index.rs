//! The package index client: PEP 691 JSON with PEP 503 HTML fallback, PEP 658/714 metadata files, METADATA read
//! out of wheels by HTTP range, sdist static metadata, an on-disk HTTP cache with ETag / Cache-Control
//! revalidation, retries with backoff, and `--offline`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::{
    ACCEPT, CACHE_CONTROL, CONTENT_RANGE, CONTENT_TYPE, ETAG, HeaderMap, IF_MODIFIED_SINCE,
    IF_NONE_MATCH, LAST_MODIFIED, RANGE,
};
use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};
use sha2::Digest;

use crate::deadline::{BadDeadlineSetting, DeadlineExceeded, HttpDeadlines};
use crate::digest::Sha256;
use crate::metadata::{self, CoreMetadata};

const SIMPLE_ACCEPT: &str = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01";
/// Bytes fetched from the end of a wheel in the first range request: the central directory of most wheels fits.
const TAIL_BYTES: u64 = 64 * 1024;
/// Bytes fetched before a central directory that is not in the tail (METADATA usually sits there).
const LEADING_BYTES: u64 = 32 * 1024;
const RETRIES: u32 = 3;
/// The most bytes read for one project page (the largest real pages are a few tens of MB).
const MAX_PAGE_BYTES: u64 = 256 << 20;
/// The most bytes read for one METADATA file (PEP 658) or range answer beyond what was asked.
const MAX_METADATA_BYTES: u64 = 64 << 20;
/// The most bytes of an sdist read into memory for its PKG-INFO, and of any artifact hashed at lock time.
const MAX_ARTIFACT_BYTES: u64 = 4 << 30;
/// The most bytes of an sdist held in memory to read its PKG-INFO.
const MAX_SDIST_BYTES: u64 = 1 << 30;

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

/// A project page of the simple API.
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
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HVD_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    dirs::cache_dir()
        .unwrap_or_else(std::env::temp_dir)
        .join("hvd")
}

#[derive(Debug, Serialize, Deserialize)]
struct CacheMeta {
    url: String,
    etag: Option<String>,
    last_modified: Option<String>,
    content_type: Option<String>,
    /// Seconds since the epoch when the response was last confirmed.
    checked_at: u64,
    max_age: Option<u64>,
    no_cache: bool,
}

/// The index client. Cheap to clone.
#[derive(Debug, Clone)]
pub struct IndexClient {
    http: reqwest::Client,
    options: Arc<IndexOptions>,
    pub stats: Arc<Stats>,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A cache file name: the hex sha256 of `key`. Cache file names are always digests hvd computed, never text
/// from an index, so nothing an index says can steer a write outside the cache.
fn url_key(key: &str) -> String {
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Write a file atomically: readers see the old or the new content, never half. The temp name is unique per
/// process and write (two locks, or two tasks of one lock, never share it) and created exclusively.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let parent = path.parent().unwrap_or(Path::new("."));
    fs_err::create_dir_all(parent)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut file = fs_err::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(bytes)?;
        drop(file);
        fs_err::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// A temp file of [`write_atomic`] untouched this long belongs to a writer that died: a write takes seconds.
const STALE_TEMP: Duration = Duration::from_secs(3600);
/// Sooner when its writer's pid is gone (as this machine's `/proc` sees it; a writer in another pid namespace
/// that shares the directory still has a minute, far more than one write takes).
const STALE_TEMP_DEAD_WRITER: Duration = Duration::from_secs(60);
/// How often the metadata cache is swept for stale temp files (the time is kept in `v1/.temp-sweep`).
const TEMP_SWEEP_EVERY: Duration = Duration::from_secs(3600);

/// The target file name and writer pid of a [`write_atomic`] temp name, `.{target}.{pid}.{n}.tmp`.
fn parse_temp_name(name: &str) -> Option<(&str, u32)> {
    let rest = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let (rest, counter) = rest.rsplit_once('.')?;
    let (target, pid) = rest.rsplit_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if target.is_empty() || !digits(counter) || !digits(pid) {
        return None;
    }
    Some((target, pid.parse().ok()?))
}

/// Whether process `pid`, the writer of a temp file, is gone, where `/proc` can tell (else `false`: assume it
/// lives; this process is never gone). Also the builder's test for partial downloads.
pub fn writer_gone(pid: u32) -> bool {
    pid != std::process::id()
        && Path::new("/proc/self").exists()
        && !Path::new("/proc").join(pid.to_string()).exists()
}

/// Remove the temp files [`write_atomic`] left in `dir` that no live write can own: untouched for an hour, or
/// for a minute when their writer's pid is gone. With `target`, only temps of that file name. Only regular files
/// named like such temps are touched. Returns how many were removed.
pub(crate) fn remove_stale_temps(dir: &Path, target: Option<&str>) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let now = SystemTime::now();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((of, pid)) = name.to_str().and_then(parse_temp_name) else {
            continue;
        };
        if target.is_some_and(|t| t != of) {
            continue;
        }
        // `DirEntry::metadata` does not follow links: only regular files are removed.
        let Some(age) = entry
            .metadata()
            .ok()
            .filter(|m| m.is_file())
            .and_then(|m| m.modified().ok())
            .and_then(|t| now.duration_since(t).ok())
        else {
            continue;
        };
        let stale = age > STALE_TEMP || (age > STALE_TEMP_DEAD_WRITER && writer_gone(pid));
        if stale && std::fs::remove_file(entry.path()).is_ok() {
            tracing::debug!(file = %entry.path().display(), "removed a stale temp file");
            removed += 1;
        }
    }
    removed
}

fn parse_cache_control(headers: &HeaderMap) -> (Option<u64>, bool) {
    let mut max_age = None;
    let mut no_cache = false;
    for v in headers.get_all(CACHE_CONTROL) {
        for part in v.to_str().unwrap_or("").split(',') {
            let part = part.trim().to_ascii_lowercase();
            if let Some(age) = part.strip_prefix("max-age=") {
                max_age = age.trim_matches('"').parse().ok();
            } else if part == "no-cache" || part == "no-store" {
                no_cache = true;
            }
        }
    }
    (max_age, no_cache)
}

fn header(headers: &HeaderMap, name: reqwest::header::HeaderName) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

impl IndexClient {
    pub fn new(options: IndexOptions) -> Result<IndexClient, IndexError> {
        let mut options = options;
        if !options.index_url.ends_with('/') {
            options.index_url.push('/');
        }
        Url::parse(&options.index_url)
            .map_err(|_| IndexError::BadUrl(options.index_url.clone()))?;
        let mut builder = reqwest::Client::builder();
        if let Some(bundle) = &options.ca_bundle {
            let pem = fs_err::read(bundle)?;
            let certs =
                reqwest::Certificate::from_pem_bundle(&pem).map_err(|source| IndexError::Http {
                    url: bundle.display().to_string(),
                    source,
                })?;
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http = builder
            .user_agent(concat!("hvd/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(15))
            .read_timeout(Duration::from_secs(60))
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

    /// Remove stale temp files (see [`remove_stale_temps`]) from the HTTP and metadata caches, at most once per
    /// [`TEMP_SWEEP_EVERY`] per cache directory. Returns how many were removed.
    pub fn remove_stale_temps(&self) -> usize {
        let root = self.options.cache_dir.join("v1");
        let marker = root.join(".temp-sweep");
        let due = std::fs::metadata(&marker)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_none_or(|age| age > TEMP_SWEEP_EVERY);
        if !due || !root.is_dir() {
            return 0;
        }
        let mut removed = 0;
        for kind in ["http", "metadata"] {
            let Ok(buckets) = std::fs::read_dir(root.join(kind)) else {
                continue;
            };
            for bucket in buckets.flatten() {
                if bucket.file_type().is_ok_and(|t| t.is_dir()) {
                    removed += remove_stale_temps(&bucket.path(), None);
                }
            }
        }
        // Written after the sweep: a sweep cut short by a kill is redone by the next run.
        if let Err(err) = write_atomic(&marker, b"") {
            tracing::debug!(%err, "could not record the temp sweep");
        }
        removed
    }

    pub fn index_url(&self) -> &str {
        &self.options.index_url
    }

    pub fn offline(&self) -> bool {
        self.options.offline
    }

    fn cache_path(&self, kind: &str, key: &str) -> PathBuf {
        self.options
            .cache_dir
            .join("v1")
            .join(kind)
            .join(&key[..2])
            .join(key)
    }

    /// Send a GET with retries on transient failures (connect errors, timeouts, 5xx, 429).
    async fn send(&self, url: &str, headers: HeaderMap) -> Result<reqwest::Response, IndexError> {
        let mut attempt = 0;
        loop {
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            let result = self.http.get(url).headers(headers.clone()).send().await;
            let transient = match &result {
                Ok(r) => {
                    r.status().is_server_error() || r.status() == StatusCode::TOO_MANY_REQUESTS
                }
                Err(e) => e.is_connect() || e.is_timeout() || e.is_request() || e.is_body(),
            };
            if transient && attempt < RETRIES {
                attempt += 1;
                tracing::debug!(url, attempt, "transient failure, retrying");
                tokio::time::sleep(Duration::from_millis(200 * (1 << attempt))).await;
                continue;
            }
            return match result {
                Ok(r)
                    if r.status().is_server_error()
                        || r.status() == StatusCode::TOO_MANY_REQUESTS =>
                {
                    Err(IndexError::Status {
                        url: url.to_string(),
                        status: r.status().as_u16(),
                    })
                }
                Ok(r) => Ok(r),
                Err(source) => Err(IndexError::Http {
                    url: url.to_string(),
                    source,
                }),
            };
        }
    }

    /// Run one page or metadata request (`fetch`: sending, retries, reading the body) within the request
    /// deadline; `what` names the package for the error.
    async fn within<T>(
        &self,
        url: &str,
        what: impl FnOnce() -> String,
        fetch: impl std::future::Future<Output = Result<T, IndexError>>,
    ) -> Result<T, IndexError> {
        let limit = self.options.deadlines.request;
        match tokio::time::timeout(limit, fetch).await {
            Ok(result) => result,
            Err(_) => Err(IndexError::Deadline {
                url: url.to_string(),
                what: what(),
                reason: DeadlineExceeded::Request { limit },
            }),
        }
    }

    /// The error of a request that was not answered whole within the request deadline.
    fn request_deadline_error(&self, url: &str, what: &str) -> IndexError {
        IndexError::Deadline {
            url: url.to_string(),
            what: what.to_string(),
            reason: DeadlineExceeded::Request {
                limit: self.options.deadlines.request,
            },
        }
    }

    /// Send the GET of a download (an artifact read whole, or a range answer that may turn out to be one): the
    /// answer's head must come within the request deadline; the body is then paced by [`Self::body`].
    async fn send_download(
        &self,
        url: &str,
        headers: HeaderMap,
        what: &str,
        started: tokio::time::Instant,
    ) -> Result<reqwest::Response, IndexError> {
        let deadline = self.options.deadlines.request_deadline(started);
        match tokio::time::timeout_at(deadline, self.send(url, headers)).await {
            Ok(result) => result,
            Err(_) => Err(self.request_deadline_error(url, what)),
        }
    }

    /// Read a response body, at most `limit` bytes (a hostile server cannot make hvd hold more). With
    /// `download = Some((started, what))` each chunk must come before the download deadline (the grace period plus
    /// the time the bytes so far have earned at the least speed), so a trickling host cannot hold it for long.
    async fn body(
        &self,
        url: &str,
        mut response: reqwest::Response,
        limit: u64,
        download: Option<(tokio::time::Instant, &str)>,
    ) -> Result<Vec<u8>, IndexError> {
        let too_large = || IndexError::TooLarge {
            url: url.to_string(),
            limit,
        };
        if response.content_length().is_some_and(|n| n > limit) {
            return Err(too_large());
        }
        let capacity = response.content_length().unwrap_or(0).min(limit);
        let mut out = Vec::with_capacity(usize::try_from(capacity).unwrap_or(0));
        while let Some(chunk) = self
            .paced(url, response.chunk(), out.len() as u64, download)
            .await?
        {
            self.stats
                .bytes
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
            if (out.len() as u64).saturating_add(chunk.len() as u64) > limit {
                return Err(too_large());
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    /// Await `next` (the next chunk of a body); for a download, only until the download deadline.
    async fn paced<T>(
        &self,
        url: &str,
        next: impl std::future::Future<Output = Result<T, reqwest::Error>>,
        received: u64,
        download: Option<(tokio::time::Instant, &str)>,
    ) -> Result<T, IndexError> {
        let http_error = |source| IndexError::Http {
            url: url.to_string(),
            source,
        };
        let Some((started, what)) = download else {
            return next.await.map_err(http_error);
        };
        let deadlines = &self.options.deadlines;
        let deadline = deadlines.download_deadline(started, received);
        match tokio::time::timeout_at(deadline, next).await {
            Ok(chunk) => chunk.map_err(http_error),
            Err(_) => Err(IndexError::Deadline {
                url: url.to_string(),
                what: what.to_string(),
                reason: deadlines.too_slow(started, received),
            }),
        }
    }

    /// Stream an artifact and hash it, keeping nothing: for indexes that list no sha256, so the lockfile never
    /// records an empty hash. Returns the digest and the size.
    pub async fn artifact_digest(&self, file: &IndexFile) -> Result<(Sha256, u64), IndexError> {
        if self.options.offline {
            return Err(IndexError::Offline {
                url: file.url.clone(),
            });
        }
        let what = format!(
            "package file `{}`, hashed because the index lists no sha256",
            file.filename
        );
        let started = tokio::time::Instant::now();
        let mut response = self
            .send_download(&file.url, HeaderMap::new(), &what, started)
            .await?;
        if !response.status().is_success() {
            return Err(IndexError::Status {
                url: file.url.clone(),
                status: response.status().as_u16(),
            });
        }
        let mut hasher = sha2::Sha256::new();
        let mut size = 0u64;
        while let Some(chunk) = self
            .paced(&file.url, response.chunk(), size, Some((started, &what)))
            .await?
        {
            self.stats
                .bytes
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
            size = size.saturating_add(chunk.len() as u64);
            if size > MAX_ARTIFACT_BYTES {
                return Err(IndexError::TooLarge {
                    url: file.url.clone(),
                    limit: MAX_ARTIFACT_BYTES,
                });
            }
            hasher.update(&chunk);
        }
        Ok((Sha256::from_hasher(hasher), size))
    }

    /// GET through the HTTP cache: fresh entries are served as is, stale ones revalidated with
    /// `If-None-Match` / `If-Modified-Since`. Returns the body and content type; `Ok(None)` on 404.
    async fn get_cached(
        &self,
        url: &str,
        accept: &str,
    ) -> Result<Option<(Vec<u8>, String)>, IndexError> {
        let key = url_key(&format!("{accept}\n{url}"));
        let meta_path = self.cache_path("http", &format!("{key}.json"));
        let body_path = self.cache_path("http", &format!("{key}.body"));
        let cached: Option<CacheMeta> = fs_err::read(&meta_path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .filter(|_| body_path.exists());
        if let Some(meta) = &cached {
            let fresh = !meta.no_cache
                && meta
                    .max_age
                    .is_some_and(|age| now_secs() < meta.checked_at + age);
            if self.options.offline || fresh {
                self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
                let body = fs_err::read(&body_path)?;
                return Ok(Some((body, meta.content_type.clone().unwrap_or_default())));
            }
        } else if self.options.offline {
            return Err(IndexError::Offline {
                url: url.to_string(),
            });
        }
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT, accept.parse().expect("static header"));
        if let Some(meta) = &cached {
            if let Some(etag) = meta.etag.as_deref().and_then(|e| e.parse().ok()) {
                headers.insert(IF_NONE_MATCH, etag);
            }
            if let Some(lm) = meta.last_modified.as_deref().and_then(|e| e.parse().ok()) {
                headers.insert(IF_MODIFIED_SINCE, lm);
            }
        }
        let response = self.send(url, headers).await?;
        let status = response.status();
        let (max_age, no_cache) = parse_cache_control(response.headers());
        if status == StatusCode::NOT_MODIFIED
            && let Some(mut meta) = cached
        {
            self.stats.not_modified.fetch_add(1, Ordering::Relaxed);
            meta.checked_at = now_secs();
            meta.max_age = max_age.or(meta.max_age);
            write_atomic(&meta_path, &serde_json::to_vec(&meta).unwrap_or_default())?;
            let body = fs_err::read(&body_path)?;
            return Ok(Some((body, meta.content_type.unwrap_or_default())));
        }
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(IndexError::Status {
                url: url.to_string(),
                status: status.as_u16(),
            });
        }
        let content_type = header(response.headers(), CONTENT_TYPE).unwrap_or_default();
        let meta = CacheMeta {
            url: url.to_string(),
            etag: header(response.headers(), ETAG),
            last_modified: header(response.headers(), LAST_MODIFIED),
            content_type: Some(content_type.clone()),
            checked_at: now_secs(),
            max_age,
            no_cache,
        };
        let body = self.body(url, response, MAX_PAGE_BYTES, None).await?;
        write_atomic(&body_path, &body)?;
        write_atomic(&meta_path, &serde_json::to_vec(&meta).unwrap_or_default())?;
        Ok(Some((body, content_type)))
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

    /// The metadata-cache key of a file: a digest of what identifies the bytes the entry was read from — this
    /// index, the artifact URL the bytes came from, and the sha256 listed for it. Keyed by the URL, an entry
    /// only ever holds what that URL served (so one index cannot plant metadata for another index's file by
    /// claiming its sha256), and a new listed digest for the same URL is a new entry.
    fn metadata_key(&self, file: &IndexFile, what: &str) -> String {
        let claimed = file.sha256.as_ref().map_or("-", Sha256::as_str);
        url_key(&format!(
            "metadata-v2\n{what}\n{}\n{}\n{claimed}",
            self.options.index_url, file.url
        ))
    }

    /// Metadata is immutable per key (URL and listed sha256), so it is cached forever.
    fn cached_metadata(&self, key: &str) -> Option<Vec<u8>> {
        let b = fs_err::read(self.cache_path("metadata", key)).ok()?;
        self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
        Some(b)
    }

    /// Core metadata of a wheel: PEP 658 file when offered, else METADATA read by range from the wheel.
    pub async fn wheel_metadata(&self, file: &IndexFile) -> Result<CoreMetadata, IndexError> {
        let key = self.metadata_key(file, "wheel");
        if let Some(bytes) = self.cached_metadata(&key) {
            return Ok(CoreMetadata::parse(&String::from_utf8_lossy(&bytes)));
        }
        if self.options.offline {
            return Err(IndexError::Offline {
                url: file.url.clone(),
            });
        }
        let what = || format!("the metadata of package file `{}`", file.filename);
        let mut bytes = None;
        if file.core_metadata {
            let url = format!("{}.metadata", file.url);
            let fetch = async {
                let response = self.send(&url, HeaderMap::new()).await?;
                if !response.status().is_success() {
                    return Ok(None);
                }
                let body = self.body(&url, response, MAX_METADATA_BYTES, None).await?;
                if let Some(expected) = &file.core_metadata_sha256 {
                    check_digest(&url, expected, &Sha256::of_bytes(&body))?;
                }
                Ok(Some(body))
            };
            bytes = self.within(&url, what, fetch).await?;
        }
        let started = std::time::Instant::now();
        let bytes = match bytes {
            Some(b) => b,
            None => self.metadata_by_range(file).await?,
        };
        tracing::debug!(
            file = file.filename,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "wheel metadata"
        );
        write_atomic(&self.cache_path("metadata", &key), &bytes)?;
        Ok(CoreMetadata::parse(&String::from_utf8_lossy(&bytes)))
    }

    /// GET a byte range. `asked` is the length requested: a 206 answer may not be longer, and must come whole
    /// within the request deadline; a 200 answer (no range support: the whole file) is read up to
    /// [`MAX_SDIST_BYTES`] as a download, at the least speed. `what` names the package for a deadline error.
    async fn get_range(
        &self,
        url: &str,
        range: String,
        asked: u64,
        what: &str,
    ) -> Result<(StatusCode, Option<u64>, Vec<u8>), IndexError> {
        let mut headers = HeaderMap::new();
        headers.insert(
            RANGE,
            range
                .parse()
                .map_err(|_| IndexError::BadUrl(url.to_string()))?,
        );
        let started = tokio::time::Instant::now();
        let response = self.send_download(url, headers, what, started).await?;
        let status = response.status();
        if !status.is_success() {
            return Err(IndexError::Status {
                url: url.to_string(),
                status: status.as_u16(),
            });
        }
        let total = header(response.headers(), CONTENT_RANGE).and_then(|cr| {
            cr.rsplit_once('/')
                .and_then(|(_, t)| t.trim().parse::<u64>().ok())
        });
        let body = if status == StatusCode::PARTIAL_CONTENT {
            let deadline = self.options.deadlines.request_deadline(started);
            tokio::time::timeout_at(deadline, self.body(url, response, asked, None))
                .await
                .map_err(|_| self.request_deadline_error(url, what))??
        } else {
            self.body(url, response, MAX_SDIST_BYTES, Some((started, what)))
                .await?
        };
        Ok((status, total, body))
    }

    /// METADATA of a wheel read by HTTP ranges: the tail (central directory), then, if needed, the directory and
    /// what precedes it, then the entry. Every offset comes from the server and is checked against the file size
    /// and the bytes actually received (a lying central directory is an error, never a panic).
    async fn metadata_by_range(&self, file: &IndexFile) -> Result<Vec<u8>, IndexError> {
        let url = file.url.as_str();
        let zip_err = |source| IndexError::Zip {
            url: url.to_string(),
            source,
        };
        let bad = |what: &'static str| IndexError::Zip {
            url: url.to_string(),
            source: metadata::ZipError::Format(what),
        };
        let what = format!("the metadata of package file `{}`", file.filename);
        let (status, total, tail) = self
            .get_range(url, format!("bytes=-{TAIL_BYTES}"), TAIL_BYTES, &what)
            .await?;
        let total = match (status, total) {
            (StatusCode::PARTIAL_CONTENT, Some(total)) => total,
            // No range support: the whole wheel came back, so it can be checked against the listed digest.
            _ => {
                if let Some(expected) = &file.sha256 {
                    check_digest(url, expected, &Sha256::of_bytes(&tail))?;
                }
                return metadata::metadata_from_wheel_bytes(&tail).map_err(zip_err);
            }
        };
        let tail_start = total
            .checked_sub(tail.len() as u64)
            .ok_or_else(|| bad("range answer longer than the file it claims"))?;
        let (cd_offset, cd_size) =
            metadata::find_central_directory(&tail, total).map_err(zip_err)?;
        if cd_size > MAX_METADATA_BYTES {
            return Err(bad("central directory too large"));
        }
        let cd_end = cd_offset + cd_size; // find_central_directory checked it is within the file
        // When the central directory is not in the tail (big wheels), fetch it together with what precedes it:
        // `.dist-info/` is written last, right before the directory, so METADATA usually comes along.
        let (region_start, region) = if cd_offset >= tail_start {
            (tail_start, tail)
        } else {
            let from = cd_offset.saturating_sub(LEADING_BYTES);
            let asked = cd_end - from;
            let (status, _, bytes) = self
                .get_range(
                    url,
                    format!("bytes={from}-{}", cd_end.saturating_sub(1)),
                    asked,
                    &what,
                )
                .await?;
            if status != StatusCode::PARTIAL_CONTENT || bytes.len() as u64 != asked {
                return Err(bad("short range answer"));
            }
            (from, bytes)
        };
        let slice = |from: u64, to: u64| -> Option<&[u8]> {
            let a = usize::try_from(from.checked_sub(region_start)?).ok()?;
            let b = usize::try_from(to.checked_sub(region_start)?).ok()?;
            region.get(a..b)
        };
        let cd = slice(cd_offset, cd_end)
            .ok_or_else(|| bad("short range answer"))?
            .to_vec();
        let entries = metadata::parse_central_directory(&cd).map_err(zip_err)?;
        let entry = metadata::metadata_entry(&entries).map_err(zip_err)?.clone();
        if entry.compressed_size > MAX_METADATA_BYTES {
            return Err(bad("METADATA entry too large"));
        }
        // The local header's extra field may differ from the central one; leave room for it.
        let want = 30 + entry.name.len() as u64 + 1024 + entry.compressed_size;
        let start = entry.local_header_offset;
        if start >= total {
            return Err(bad("METADATA entry offset outside the file"));
        }
        let end = start.saturating_add(want).min(total); // exclusive
        let region_end = region_start + region.len() as u64;
        if let Some(bytes) = slice(start, end.min(region_end))
            && let Ok(data) = metadata::read_local_entry(bytes, &entry)
        {
            return Ok(data);
        }
        let (_, _, local) = self
            .get_range(
                url,
                format!("bytes={start}-{}", end - 1),
                end - start,
                &what,
            )
            .await?;
        metadata::read_local_entry(&local, &entry).map_err(zip_err)
    }

    /// Static metadata of an sdist (`.tar.gz`): downloads it (sdists cannot be read by range).
    /// `Ok(None)` when it has no PKG-INFO.
    pub async fn sdist_metadata(
        &self,
        file: &IndexFile,
    ) -> Result<Option<CoreMetadata>, IndexError> {
        let key = self.metadata_key(file, "sdist");
        if let Some(bytes) = self.cached_metadata(&key) {
            return Ok(Some(CoreMetadata::parse(&String::from_utf8_lossy(&bytes)))
                .filter(|_| !bytes.is_empty()));
        }
        if self.options.offline {
            return Err(IndexError::Offline {
                url: file.url.clone(),
            });
        }
        if !file.filename.ends_with(".tar.gz") {
            return Ok(None);
        }
        let contents = self.download_sdist(file).await?;
        // Store a normalized PKG-INFO (with requires.txt folded in) so the cache answers alone next time, and the
        // build requirements read in the same pass (so locking the sdist's build needs no second download).
        let text = match &contents.metadata {
            Some(m) => render_metadata(m),
            None => String::new(),
        };
        write_atomic(&self.cache_path("metadata", &key), text.as_bytes())?;
        self.store_build_requires(file, &contents.build_requires)?;
        Ok(contents.metadata)
    }

    /// Download a `.tar.gz` sdist and read its PKG-INFO and pyproject build requirements (off the async threads).
    async fn download_sdist(
        &self,
        file: &IndexFile,
    ) -> Result<metadata::SdistContents, IndexError> {
        let what = format!("package file `{}`, read for its metadata", file.filename);
        let started = tokio::time::Instant::now();
        let response = self
            .send_download(&file.url, HeaderMap::new(), &what, started)
            .await?;
        if !response.status().is_success() {
            return Err(IndexError::Status {
                url: file.url.clone(),
                status: response.status().as_u16(),
            });
        }
        let bytes = self
            .body(&file.url, response, MAX_SDIST_BYTES, Some((started, &what)))
            .await?;
        // The whole file is here: check it against the listed digest before anything is read out of it, so the
        // cache only ever holds what was read from the bytes the index vouched for.
        if let Some(expected) = &file.sha256 {
            check_digest(&file.url, expected, &Sha256::of_bytes(&bytes))?;
        }
        let sdist_error = |message: String| IndexError::Sdist {
            url: file.url.clone(),
            message,
        };
        tokio::task::spawn_blocking(move || metadata::read_sdist_targz(&bytes))
            .await
            .map_err(|e| sdist_error(e.to_string()))?
            .map_err(|e| sdist_error(e.to_string()))
    }

    fn store_build_requires(
        &self,
        file: &IndexFile,
        requires: &[String],
    ) -> Result<(), IndexError> {
        let key = self.metadata_key(file, "sdist-build");
        let text: String = requires.iter().map(|r| format!("{r}\n")).collect();
        write_atomic(&self.cache_path("metadata", &key), text.as_bytes())?;
        Ok(())
    }

    /// The PEP 518 build requirements of an sdist: `[build-system] requires` of its pyproject.toml, else the PEP
    /// 517 default ([`metadata::DEFAULT_BUILD_REQUIRES`]). Usually cached by [`Self::sdist_metadata`]'s download.
    /// A `.zip` sdist is not opened: it gets the default.
    pub async fn sdist_build_requires(&self, file: &IndexFile) -> Result<Vec<String>, IndexError> {
        let key = self.metadata_key(file, "sdist-build");
        if let Some(bytes) = self.cached_metadata(&key) {
            return Ok(String::from_utf8_lossy(&bytes)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string)
                .collect());
        }
        if !file.filename.ends_with(".tar.gz") {
            return Ok(metadata::DEFAULT_BUILD_REQUIRES
                .iter()
                .map(|s| s.to_string())
                .collect());
        }
        if self.options.offline {
            return Err(IndexError::Offline {
                url: file.url.clone(),
            });
        }
        let contents = self.download_sdist(file).await?;
        self.store_build_requires(file, &contents.build_requires)?;
        Ok(contents.build_requires)
    }
}

fn check_digest(url: &str, expected: &Sha256, actual: &Sha256) -> Result<(), IndexError> {
    if expected == actual {
        Ok(())
    } else {
        Err(IndexError::HashMismatch {
            url: url.to_string(),
            expected: expected.to_string(),
            actual: actual.to_string(),
        })
    }
}

fn render_metadata(m: &CoreMetadata) -> String {
    let mut s = format!(
        "Metadata-Version: {}\nName: {}\nVersion: {}\n",
        m.metadata_version, m.name, m.version
    );
    if let Some(rp) = &m.requires_python {
        s.push_str(&format!("Requires-Python: {rp}\n"));
    }
    for d in &m.dynamic {
        s.push_str(&format!("Dynamic: {d}\n"));
    }
    for r in &m.requires_dist {
        s.push_str(&format!("Requires-Dist: {r}\n"));
    }
    s
}

#[derive(Deserialize)]
struct JsonPage {
    files: Vec<JsonFile>,
}

#[derive(Deserialize)]
struct JsonFile {
    filename: String,
    url: String,
    #[serde(default)]
    hashes: std::collections::BTreeMap<String, String>,
    #[serde(default, rename = "requires-python")]
    requires_python: Option<String>,
    #[serde(default)]
    yanked: serde_json::Value,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default, rename = "core-metadata")]
    core_metadata: serde_json::Value,
    #[serde(default, rename = "dist-info-metadata")]
    dist_info_metadata: serde_json::Value,
}

fn truthy(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => false,
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::String(_) | serde_json::Value::Object(_) => true,
        _ => false,
    }
}

fn absolute(base: &Url, href: &str) -> Result<(String, Option<String>), String> {
    let mut url = base
        .join(href)
        .map_err(|e| format!("bad file url `{href}`: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "file url `{}` has scheme `{}`; an index may only list http(s) files",
            href.escape_debug(),
            url.scheme()
        ));
    }
    let fragment = url.fragment().map(str::to_string);
    url.set_fragment(None);
    Ok((url.to_string(), fragment))
}

/// A listed sha256, validated where it is parsed: anything but 64 hex digits refuses the page, naming the file.
fn listed_sha256(filename: &str, value: Option<&str>) -> Result<Option<Sha256>, String> {
    value
        .map(|v| {
            v.parse::<Sha256>().map_err(|e| {
                format!(
                    "the sha256 listed for file `{}` is wrong: {e}; refusing the page",
                    filename.escape_debug()
                )
            })
        })
        .transpose()
}

/// The PEP 658/714 metadata digest: `{"sha256": "..."}` (`true` means served, digest unknown).
fn metadata_sha256(filename: &str, v: &serde_json::Value) -> Result<Option<Sha256>, String> {
    match v.get("sha256") {
        Some(serde_json::Value::String(h)) => listed_sha256(filename, Some(h)),
        Some(_) => Err(format!(
            "file `{}` lists a non-string core-metadata sha256; refusing the page",
            filename.escape_debug()
        )),
        None => Ok(None),
    }
}

/// Parse a PEP 691 JSON project page. Listed sha256 digests are validated here (64 hex digits).
pub fn parse_json_page(body: &[u8], base: &Url) -> Result<Vec<IndexFile>, String> {
    let page: JsonPage = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    page.files
        .into_iter()
        .map(|f| {
            let (url, _) = absolute(base, &f.url)?;
            let sha256 = listed_sha256(&f.filename, f.hashes.get("sha256").map(String::as_str))?;
            let core_metadata_sha256 = if truthy(&f.core_metadata) {
                metadata_sha256(&f.filename, &f.core_metadata)?
            } else {
                metadata_sha256(&f.filename, &f.dist_info_metadata)?
            };
            Ok(IndexFile {
                filename: f.filename,
                url,
                sha256,
                size: f.size,
                requires_python: f.requires_python.filter(|s| !s.trim().is_empty()),
                yanked: truthy(&f.yanked),
                core_metadata: truthy(&f.core_metadata) || truthy(&f.dist_info_metadata),
                core_metadata_sha256,
            })
        })
        .collect()
}

fn html_unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

fn attribute(tag: &str, name: &str) -> Option<String> {
    let lower = tag.to_ascii_lowercase();
    let mut from = 0;
    while let Some(pos) = lower[from..].find(name) {
        let at = from + pos;
        from = at + name.len();
        let before_ok = at == 0 || lower.as_bytes()[at - 1].is_ascii_whitespace();
        let rest = tag[at + name.len()..].trim_start();
        if !before_ok {
            continue;
        }
        let Some(rest) = rest.strip_prefix('=') else {
            if rest.starts_with(['>', ' ', '/']) || rest.is_empty() {
                return Some(String::new());
            }
            continue;
        };
        let rest = rest.trim_start();
        let value = if let Some(r) = rest.strip_prefix('"') {
            r.split('"').next().unwrap_or("")
        } else if let Some(r) = rest.strip_prefix('\'') {
            r.split('\'').next().unwrap_or("")
        } else {
            rest.split([' ', '>']).next().unwrap_or("")
        };
        return Some(html_unescape(value));
    }
    None
}

/// Parse a PEP 503 HTML project page (anchors with `data-*` attributes). A `#sha256=` fragment that is not 64
/// hex digits refuses the page.
pub fn parse_html_page(body: &str, base: &Url) -> Result<Vec<IndexFile>, String> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(start) = rest.find("<a ").or_else(|| rest.find("<A ")) {
        let after = &rest[start..];
        let Some(tag_end) = after.find('>') else {
            break;
        };
        let tag = &after[..tag_end];
        let Some(close) = after[tag_end..]
            .find("</a>")
            .or_else(|| after[tag_end..].find("</A>"))
        else {
            break;
        };
        let text = html_unescape(after[tag_end + 1..tag_end + close].trim());
        rest = &after[tag_end + close..];
        let Some(href) = attribute(tag, "href") else {
            continue;
        };
        let Ok((url, fragment)) = absolute(base, &href) else {
            continue;
        };
        let sha256 = listed_sha256(
            &text,
            fragment.as_deref().and_then(|f| f.strip_prefix("sha256=")),
        )?;
        let metadata_attr = attribute(tag, "data-core-metadata")
            .or_else(|| attribute(tag, "data-dist-info-metadata"));
        let core_metadata_sha256 = listed_sha256(
            &text,
            metadata_attr
                .as_deref()
                .and_then(|v| v.strip_prefix("sha256=")),
        )?;
        out.push(IndexFile {
            filename: text,
            url,
            sha256,
            size: None,
            requires_python: attribute(tag, "data-requires-python")
                .filter(|s| !s.trim().is_empty()),
            yanked: attribute(tag, "data-yanked").is_some(),
            core_metadata: metadata_attr.is_some_and(|v| v != "false"),
            core_metadata_sha256,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names_are_recognized_and_nothing_else() {
        assert_eq!(
            parse_temp_name(".train.hvd.lock.4242.7.tmp"),
            Some(("train.hvd.lock", 4242))
        );
        assert_eq!(
            parse_temp_name(".ab12.json.1.0.tmp"),
            Some(("ab12.json", 1))
        );
        for other in [
            "train.hvd.lock",
            "ab12.body",
            ".x.tmp",
            "..1.2.tmp",
            ".x.1.tmp",
            ".x.a.1.tmp",
            ".x.1.b.tmp",
            "x.1.2.tmp",
            ".x.1.2.part",
        ] {
            assert_eq!(parse_temp_name(other), None, "{other}");
        }
    }

    fn hex(c: char) -> String {
        c.to_string().repeat(64)
    }

    #[test]
    fn parses_html_anchors() {
        let base = Url::parse("http://127.0.0.1:9/simple/foo/").unwrap();
        let html = format!(
            r#"<html><body>
<a href="../../files/foo-1.0.tar.gz#sha256={}" data-requires-python="&gt;=3.8">foo-1.0.tar.gz</a><br/>
<a href="http://127.0.0.1:9/files/foo-0.9-py3-none-any.whl" data-yanked="" data-core-metadata="sha256={}">foo-0.9-py3-none-any.whl</a>
</body></html>"#,
            hex('A'),
            hex('c')
        );
        let files = parse_html_page(&html, &base).unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(files[0].url, "http://127.0.0.1:9/files/foo-1.0.tar.gz");
        assert_eq!(
            files[0].sha256.as_ref().map(Sha256::as_str),
            Some(hex('a').as_str())
        );
        assert_eq!(files[0].requires_python.as_deref(), Some(">=3.8"));
        assert!(!files[0].yanked);
        assert!(files[1].yanked && files[1].sha256.is_none() && files[1].core_metadata);
        assert_eq!(
            files[1].core_metadata_sha256.as_ref().map(Sha256::as_str),
            Some(hex('c').as_str())
        );
    }

    #[test]
    fn parses_json_page() {
        let base = Url::parse("http://127.0.0.1:9/simple/foo/").unwrap();
        let body = format!(
            r#"{{"meta":{{"api-version":"1.1"}},"name":"foo","files":[
{{"filename":"foo-1.0-py3-none-any.whl","url":"/files/foo-1.0-py3-none-any.whl","hashes":{{"sha256":"{}"}},"yanked":"broken","size":12,"core-metadata":{{"sha256":"{}"}}}}]}}"#,
            hex('a'),
            hex('b')
        );
        let files = parse_json_page(body.as_bytes(), &base).unwrap();
        assert_eq!(
            files[0].url,
            "http://127.0.0.1:9/files/foo-1.0-py3-none-any.whl"
        );
        assert!(files[0].yanked && files[0].core_metadata);
        assert_eq!(
            files[0].core_metadata_sha256.as_ref().unwrap().as_str(),
            hex('b')
        );
        assert!(parse_json_page(b"{", &base).is_err());
    }

    /// Issue 16 item 1: the listed sha256 became part of a cache file name and of the lockfile.
    #[test]
    fn path_traversal_in_listed_sha256_refuses_the_page() {
        let base = Url::parse("http://127.0.0.1:9/simple/foo/").unwrap();
        for hostile in ["../../../../tmp/hvd-pwned", "/etc/passwd", "", "aa", "zz"] {
            let body = format!(
                r#"{{"files":[{{"filename":"foo-1.0-py3-none-any.whl","url":"/f/foo-1.0-py3-none-any.whl","hashes":{{"sha256":"{hostile}"}}}}]}}"#
            );
            let err = parse_json_page(body.as_bytes(), &base).unwrap_err();
            assert!(
                err.contains("foo-1.0-py3-none-any.whl") && err.contains("not a sha256"),
                "{err}"
            );
            let html =
                format!(r#"<a href="/f/foo-1.0.tar.gz#sha256={hostile}">foo-1.0.tar.gz</a>"#);
            let err = parse_html_page(&html, &base).unwrap_err();
            assert!(
                err.contains("foo-1.0.tar.gz") && err.contains("not a sha256"),
                "{err}"
            );
            let body = format!(
                r#"{{"files":[{{"filename":"foo-1.0-py3-none-any.whl","url":"/f/foo-1.0-py3-none-any.whl","core-metadata":{{"sha256":"{hostile}"}}}}]}}"#
            );
            assert!(parse_json_page(body.as_bytes(), &base).is_err());
        }
    }

    #[test]
    fn json_page_listing_a_local_file_is_refused() {
        let base = Url::parse("http://127.0.0.1:9/simple/foo/").unwrap();
        let body =
            br#"{"files":[{"filename":"foo-1.0-py3-none-any.whl","url":"file:///etc/passwd"}]}"#;
        let err = parse_json_page(body, &base).unwrap_err();
        assert!(err.contains("scheme `file`"), "{err}");
    }

    #[test]
    fn cache_file_names_are_digests_whatever_the_index_says() {
        let cache = std::env::temp_dir().join("hvd-index-unit-cache");
        let client = IndexClient::new(IndexOptions {
            index_url: "http://127.0.0.1:9/simple".into(),
            cache_dir: cache.clone(),
            offline: true,
            ca_bundle: None,
            deadlines: HttpDeadlines::default(),
        })
        .unwrap();
        let file = IndexFile {
            filename: "../../x.whl".into(),
            url: "http://127.0.0.1:9/../../x.whl".into(),
            sha256: Some(Sha256::of_bytes(b"x")),
            size: None,
            requires_python: None,
            yanked: false,
            core_metadata: false,
            core_metadata_sha256: None,
        };
        let key = client.metadata_key(&file, "wheel");
        assert!(key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()));
        let path = client.cache_path("metadata", &key);
        assert!(path.starts_with(cache.join("v1/metadata")));
        // Another index listing the same URL and digest gets another entry.
        let other = IndexClient::new(IndexOptions {
            index_url: "http://127.0.0.1:8/simple".into(),
            cache_dir: cache,
            offline: true,
            ca_bundle: None,
            deadlines: HttpDeadlines::default(),
        })
        .unwrap();
        assert_ne!(other.metadata_key(&file, "wheel"), key);
    }
}
