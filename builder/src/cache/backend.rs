//! Where a binary cache lives: a directory (`file://` or an absolute path, read and write), HTTP(S) (read: any
//! static server), S3-compatible object storage (`s3://bucket/prefix`, read and write, through `object_store`).
//! Every read is bounded by the size the caller expects.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use sha2::Digest;

use hvd_resolver::Sha256;
use hvd_resolver::deadline::{DeadlineExceeded, HttpDeadlines};
use tokio::time::Instant;

use super::CacheError;

/// One cache, by the URL the user gave.
#[derive(Clone)]
pub struct Cache {
    url: String,
    backend: Backend,
    /// `HVD_HTTP_TIMEOUT` bounds a whole record or `hvd-cache-info`; archives follow the least-rate rule.
    deadlines: HttpDeadlines,
}

impl std::fmt::Debug for Cache {
    /// The redacted URL only: the backend's base URL may hold `user:token@`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// How long a read may take: a small object whole within the request deadline, an archive by the least-rate rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pace {
    Whole,
    Download,
}

#[derive(Debug, Clone)]
enum Backend {
    Dir(PathBuf),
    Http {
        base: String,
        client: reqwest::Client,
    },
    S3 {
        store: std::sync::Arc<dyn object_store::ObjectStore>,
        prefix: String,
    },
}

/// An S3 client for `bucket` from the standard variables: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
/// `AWS_SESSION_TOKEN`, `AWS_REGION` (or `AWS_DEFAULT_REGION`, default `us-east-1`), and the endpoint of an
/// S3-compatible server from `HVD_S3_ENDPOINT` or `AWS_ENDPOINT_URL`. Without an access key requests are unsigned
/// (a public bucket), never sent to a cloud metadata service.
fn s3_client(bucket: &str) -> Result<std::sync::Arc<dyn object_store::ObjectStore>, String> {
    use crate::env_vars as vars;
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let region = var(vars::AWS_REGION)
        .or_else(|| var(vars::AWS_DEFAULT_REGION))
        .unwrap_or_else(|| "us-east-1".into());
    // No per-request timeout (object_store's 30 s would cut off a large archive): hvd's own deadlines bound each
    // read and write (`HVD_HTTP_TIMEOUT`, `HVD_DOWNLOAD_MIN_RATE`).
    // (Set first: client options replace earlier ones such as `allow_http`.)
    let mut builder = object_store::aws::AmazonS3Builder::new().with_client_options(
        object_store::ClientOptions::new()
            .with_timeout_disabled()
            .with_connect_timeout(Duration::from_secs(30)),
    );
    builder = builder
        .with_bucket_name(bucket)
        .with_region(region)
        .with_virtual_hosted_style_request(false);
    if let Some(endpoint) = var(vars::HVD_S3_ENDPOINT).or_else(|| var(vars::AWS_ENDPOINT_URL)) {
        builder = builder
            .with_allow_http(endpoint.starts_with("http://"))
            .with_endpoint(endpoint);
    }
    match (
        var(vars::AWS_ACCESS_KEY_ID),
        var(vars::AWS_SECRET_ACCESS_KEY),
    ) {
        (Some(id), Some(secret)) => {
            builder = builder
                .with_access_key_id(id)
                .with_secret_access_key(secret);
            if let Some(token) = var(vars::AWS_SESSION_TOKEN) {
                builder = builder.with_token(token);
            }
        }
        _ => builder = builder.with_skip_signature(true),
    }
    let store = builder.build().map_err(|err| err.to_string())?;
    Ok(std::sync::Arc::new(store))
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Cache {
    /// `file:///dir`, `/dir`, `http://host/prefix` or `https://host/prefix`.
    pub fn parse(url: &str) -> Result<Cache, CacheError> {
        let invalid = |message: &str| CacheError::Url {
            url: redact(url),
            message: message.to_string(),
        };
        let backend = if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(invalid(
                    "a file:// cache needs an absolute path (file:///dir)",
                ));
            }
            Backend::Dir(PathBuf::from(path))
        } else if url.starts_with('/') {
            Backend::Dir(PathBuf::from(url))
        } else if url.starts_with("http://") || url.starts_with("https://") {
            let client = reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(30))
                .build()
                .map_err(|err| invalid(&format!("no HTTP client: {err}")))?;
            Backend::Http {
                base: url.trim_end_matches('/').to_string(),
                client,
            }
        } else if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(invalid(
                    "an s3:// cache names its bucket: s3://bucket/prefix",
                ));
            }
            Backend::S3 {
                store: s3_client(bucket).map_err(|err| invalid(&err))?,
                prefix: prefix.trim_matches('/').to_string(),
            }
        } else {
            return Err(invalid(
                "a cache URL starts with file://, http://, https://, s3:// or /",
            ));
        };
        let deadlines = HttpDeadlines::from_env().map_err(|err| invalid(&err.to_string()))?;
        Ok(Cache {
            url: redact(url),
            backend,
            deadlines,
        })
    }

    /// The URL as given, with any `user:password@` replaced by `***@` (for messages).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether this cache can be written (`hvd cache push`).
    pub fn writable(&self) -> bool {
        matches!(self.backend, Backend::Dir(_) | Backend::S3 { .. })
    }

    fn error(&self, key: &str, message: impl std::fmt::Display) -> CacheError {
        CacheError::Backend {
            cache: self.url.clone(),
            key: key.to_string(),
            message: message.to_string(),
        }
    }

    /// The object `key`, `None` when the cache does not have it; more than `limit` bytes is an error.
    pub async fn get(&self, key: &str, limit: u64) -> Result<Option<Vec<u8>>, CacheError> {
        let mut bytes = Vec::new();
        let found = self
            .stream(key, limit, Pace::Whole, 0, |piece| {
                match piece {
                    Piece::Start(_) => bytes.clear(),
                    Piece::Bytes(chunk) => bytes.extend_from_slice(chunk),
                }
                Ok(())
            })
            .await?;
        Ok(found.then_some(bytes))
    }

    /// Stream the object `key`, whose sha256 and size should be `expected`, into the file `partial`, resuming after
    /// the bytes it already holds (a ranged read: HTTP `Range`, S3's ranged GET, a seek in a directory) and hashing
    /// all of it; `None` when the cache does not have it. A connection that breaks after bytes arrived is resumed
    /// at once, [`MAX_ATTEMPTS`] times at most; what arrived stays in `partial` for a later call when it gives up,
    /// and so does the partial when a read fails before its first byte (a connection refused, a timeout, `503`).
    /// A partial shown not to belong to the object (the hash at the end differs after a resume, the cache
    /// refuses the range as past the object's end (`416`) or answers another one) is discarded and the object read
    /// whole once more, with [`MAX_ATTEMPTS`] reads of its own. Returns the
    /// hash and size of what `partial` holds at the end, and the open file they were computed from (to read it
    /// from, not from its name), which the caller compares with the record (after a
    /// mismatch `partial` holds bytes that are not the object: remove it). More than `expected`'s size is an error
    /// (and discards the partial); `progress` gets how many bytes more the file holds than it was last told, so
    /// each byte of the object is counted once over all reads (what a resume starts from first).
    pub async fn download(
        &self,
        key: &str,
        partial: &Path,
        expected: (&Sha256, u64),
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<Option<(Sha256, u64, std::fs::File)>, CacheError> {
        use std::io::{Read, Seek, SeekFrom, Write};
        let (expected_sha256, limit) = expected;
        let mut file = open_partial(partial)?;
        // Whether the whole object was read once more after a partial turned out not to be its start.
        let mut restarted = false;
        // Reads since the partial was last discarded: the whole read after a discard gets attempts of its own.
        let mut attempt = 0u32;
        // How far `progress` was told: each byte of the object is reported once, over all reads.
        let shown = std::cell::Cell::new(0u64);
        let show = |at: u64| {
            if at > shown.get() {
                progress(at - shown.get());
                shown.set(at);
            }
        };
        loop {
            attempt += 1;
            let mut offset = file.metadata()?.len();
            if offset > limit {
                file.set_len(0)?;
                offset = 0;
            }
            let mut hasher = sha2::Sha256::new();
            file.seek(SeekFrom::Start(0))?;
            let mut buffer = vec![0u8; 1 << 20];
            let mut left = offset;
            while left > 0 {
                let n = file.read(&mut buffer[..left.min(1 << 20) as usize])?;
                if n == 0 {
                    break;
                }
                hasher.update(&buffer[..n]);
                left -= n as u64;
            }
            let offset = offset - left;
            if offset > 0 && offset == limit {
                let sha256 = Sha256::from_hasher(hasher.clone());
                // After a discard the caller gets what the whole read brought, to report the mismatch.
                if &sha256 == expected_sha256 || restarted {
                    show(offset);
                    return Ok(Some((sha256, offset, file)));
                }
                tracing::info!(
                    "discarding `{}`: not the archive it is named for",
                    partial.display()
                );
                file.set_len(0)?;
                restarted = true;
                attempt = 0;
                continue;
            }
            file.set_len(offset)?;
            file.seek(SeekFrom::Start(offset))?;
            show(offset);
            // Where this attempt's bytes start (the cache may answer a ranged read whole) and how many arrived.
            let mut start = offset;
            let mut arrived = 0u64;
            let mut reset = false;
            let streamed = self
                .stream(key, limit, Pace::Download, offset, |piece| match piece {
                    Piece::Start(at) if at == offset => Ok(()),
                    Piece::Start(at) => {
                        file.set_len(0)?;
                        file.seek(SeekFrom::Start(0))?;
                        hasher = sha2::Sha256::new();
                        start = 0;
                        reset = true;
                        if at == 0 {
                            Ok(())
                        } else {
                            Err(std::io::Error::other(format!(
                                "answered a read from byte {offset} with bytes from {at}"
                            )))
                        }
                    }
                    Piece::Bytes(chunk) => {
                        file.write_all(chunk)?;
                        hasher.update(chunk);
                        arrived += chunk.len() as u64;
                        show(start + arrived);
                        Ok(())
                    }
                })
                .await;
            match streamed {
                Ok(false) => return Ok(None),
                Ok(true) => {
                    let size = start + arrived;
                    let sha256 = Sha256::from_hasher(hasher);
                    let resumed = start > 0 || attempt > 1;
                    if (&sha256 == expected_sha256 && size == limit) || !resumed || restarted {
                        return Ok(Some((sha256, size, file)));
                    }
                    tracing::info!(
                        "discarding `{}`: the resumed archive is not the one its record names; reading it whole",
                        partial.display()
                    );
                    file.set_len(0)?;
                    restarted = true;
                    attempt = 0;
                }
                Err(err @ CacheError::TooLarge { .. }) => {
                    file.set_len(0)?;
                    return Err(err);
                }
                Err(err) if (arrived > 0 || reset) && attempt < MAX_ATTEMPTS => {
                    tracing::info!(
                        "cache `{}`: reading `{key}` broke off after {} bytes ({err}); resuming",
                        self.url,
                        start + arrived
                    );
                }
                // Nothing arrived (a connection refused, a timeout, `503`): the partial is kept for a later call.
                Err(err) => return Err(err),
            }
        }
    }

    /// Feed the object's bytes to `sink`, from byte `from` when the cache can read from there (else from the
    /// start): first [`Piece::Start`] with where its bytes start, then the bytes; `false` when it does not exist.
    /// More than `limit` bytes in all (counting from byte 0) is an error.
    async fn stream(
        &self,
        key: &str,
        limit: u64,
        pace: Pace,
        from: u64,
        mut sink: impl FnMut(Piece<'_>) -> std::io::Result<()>,
    ) -> Result<bool, CacheError> {
        let count = |received: &mut u64, len: usize| -> Result<(), CacheError> {
            *received = received.saturating_add(len as u64);
            if *received > limit {
                return Err(CacheError::TooLarge {
                    cache: self.url.clone(),
                    key: key.to_string(),
                    limit,
                });
            }
            Ok(())
        };
        let too_large = || CacheError::TooLarge {
            cache: self.url.clone(),
            key: key.to_string(),
            limit,
        };
        match &self.backend {
            Backend::Dir(root) => {
                use std::io::{Read, Seek};
                use std::os::unix::fs::OpenOptionsExt;
                let path = root.join(key);
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                    .open(&path);
                let mut file = match file {
                    Ok(file) => file,
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(false),
                    Err(err) => return Err(self.error(key, err)),
                };
                let metadata = file.metadata().map_err(|err| self.error(key, err))?;
                if !metadata.is_file() {
                    return Err(self.error(key, "is not a regular file"));
                }
                let start = if from <= metadata.len() { from } else { 0 };
                file.seek(std::io::SeekFrom::Start(start))
                    .map_err(|err| self.error(key, err))?;
                sink(Piece::Start(start))?;
                let mut received = start;
                let mut buffer = vec![0u8; 1 << 16];
                loop {
                    let n = file.read(&mut buffer).map_err(|err| self.error(key, err))?;
                    if n == 0 {
                        break;
                    }
                    count(&mut received, n)?;
                    sink(Piece::Bytes(&buffer[..n]))?;
                }
                Ok(true)
            }
            Backend::Http { base, client } => {
                let url = format!("{base}/{key}");
                let mut from = from;
                let (started, response) = loop {
                    let started = Instant::now();
                    let mut request = client.get(&url);
                    if from > 0 {
                        // Byte offsets are the stored object's: never a re-encoded body.
                        request = request
                            .header(reqwest::header::RANGE, format!("bytes={from}-"))
                            .header(reqwest::header::ACCEPT_ENCODING, "identity");
                    }
                    let response = self
                        .within(
                            key,
                            self.deadlines.request_deadline(started),
                            started,
                            0,
                            request.send(),
                        )
                        .await?
                        .map_err(|err| self.error(key, err.without_url()))?;
                    // The range is past the object's end: what the caller has is not its start; the object whole.
                    if from > 0 && response.status() == reqwest::StatusCode::RANGE_NOT_SATISFIABLE {
                        tracing::info!(
                            "cache `{}`: `{key}` has no byte {from}; reading it whole",
                            self.url
                        );
                        from = 0;
                        continue;
                    }
                    break (started, response);
                };
                let status = response.status();
                if status == reqwest::StatusCode::NOT_FOUND
                    || status == reqwest::StatusCode::FORBIDDEN
                {
                    return Ok(false);
                }
                let start = if status == reqwest::StatusCode::PARTIAL_CONTENT {
                    let range = response
                        .headers()
                        .get(reqwest::header::CONTENT_RANGE)
                        .and_then(|v| v.to_str().ok())
                        .and_then(content_range_start);
                    match range {
                        Some(start) if from > 0 => start,
                        _ => {
                            return Err(self.error(
                                key,
                                "answered 206 without a usable Content-Range for the range asked",
                            ));
                        }
                    }
                } else if status.is_success() {
                    0
                } else {
                    return Err(self.error(key, format!("answered {status}")));
                };
                if let Some(length) = response.content_length()
                    && start.saturating_add(length) > limit
                {
                    return Err(too_large());
                }
                sink(Piece::Start(start))?;
                let body = response
                    .bytes_stream()
                    .map(|chunk| chunk.map_err(|err| self.error(key, err.without_url())));
                self.drain(key, pace, started, start, body, count, &mut sink)
                    .await?;
                Ok(true)
            }
            Backend::S3 { store, prefix } => {
                let started = Instant::now();
                let options = object_store::GetOptions {
                    range: (from > 0).then_some(object_store::GetRange::Offset(from)),
                    ..object_store::GetOptions::default()
                };
                let found = match self
                    .within(
                        key,
                        self.deadlines.request_deadline(started),
                        started,
                        0,
                        store.get_opts(&object_path(prefix, key), options),
                    )
                    .await?
                {
                    Ok(found) => found,
                    Err(object_store::Error::NotFound { .. }) => return Ok(false),
                    Err(err) => return Err(self.error(key, err)),
                };
                if found.meta.size > limit {
                    return Err(too_large());
                }
                let start = found.range.start;
                sink(Piece::Start(start))?;
                let body = found
                    .into_stream()
                    .map(|chunk| chunk.map_err(|err| self.error(key, err)));
                self.drain(key, pace, started, start, body, count, &mut sink)
                    .await?;
                Ok(true)
            }
        }
    }

    /// Feed `body`'s chunks to `sink` (after `count` checked the running total), each chunk within the read's
    /// deadline (`pace`, from `started`).
    #[allow(clippy::too_many_arguments)]
    async fn drain<B: AsRef<[u8]>>(
        &self,
        key: &str,
        pace: Pace,
        started: Instant,
        start: u64,
        body: impl futures::Stream<Item = Result<B, CacheError>>,
        count: impl Fn(&mut u64, usize) -> Result<(), CacheError>,
        sink: &mut impl FnMut(Piece<'_>) -> std::io::Result<()>,
    ) -> Result<(), CacheError> {
        let mut body = std::pin::pin!(body);
        let mut received = 0u64;
        // The object's bytes so far, counted against the limit from byte 0.
        let mut total = start;
        while let Some(chunk) = self
            .within(
                key,
                self.next_deadline(pace, started, received),
                started,
                received,
                body.next(),
            )
            .await?
        {
            let chunk = chunk?;
            received += chunk.as_ref().len() as u64;
            count(&mut total, chunk.as_ref().len())?;
            sink(Piece::Bytes(chunk.as_ref()))?;
        }
        Ok(())
    }

    /// When the next chunk of a read started at `started` must have arrived.
    fn next_deadline(&self, pace: Pace, started: Instant, received: u64) -> Instant {
        match pace {
            Pace::Whole => self.deadlines.request_deadline(started),
            Pace::Download => self.deadlines.download_deadline(started, received),
        }
    }

    /// `work` unless `deadline` passes first: then an error naming the cache, the key and the limit.
    async fn within<T>(
        &self,
        key: &str,
        deadline: Instant,
        started: Instant,
        received: u64,
        work: impl std::future::Future<Output = T>,
    ) -> Result<T, CacheError> {
        tokio::time::timeout_at(deadline, work).await.map_err(|_| {
            let reason = if received == 0 && deadline <= self.deadlines.request_deadline(started) {
                DeadlineExceeded::Request {
                    limit: self.deadlines.request,
                }
            } else {
                self.deadlines.too_slow(started, received)
            };
            self.error(
                key,
                format!(
                    "took too long: {reason}; the cache is stalling or the network is too slow"
                ),
            )
        })
    }

    /// Whether the cache has `key`.
    pub async fn exists(&self, key: &str) -> Result<bool, CacheError> {
        match &self.backend {
            Backend::Dir(root) => Ok(fs_err::symlink_metadata(root.join(key)).is_ok()),
            Backend::Http { base, client } => {
                let started = Instant::now();
                let response = self
                    .within(
                        key,
                        self.deadlines.request_deadline(started),
                        started,
                        0,
                        client.head(format!("{base}/{key}")).send(),
                    )
                    .await?
                    .map_err(|err| self.error(key, err.without_url()))?;
                Ok(response.status().is_success())
            }
            Backend::S3 { store, prefix } => {
                let started = Instant::now();
                let head = self
                    .within(
                        key,
                        self.deadlines.request_deadline(started),
                        started,
                        0,
                        store.head(&object_path(prefix, key)),
                    )
                    .await?;
                match head {
                    Ok(_) => Ok(true),
                    Err(object_store::Error::NotFound { .. }) => Ok(false),
                    Err(err) => Err(self.error(key, err)),
                }
            }
        }
    }

    /// Store the file `source` as `key`: the object appears whole or not at all.
    pub async fn put_file(&self, key: &str, source: &Path) -> Result<(), CacheError> {
        match &self.backend {
            Backend::Dir(root) => dir_put(root, key, |temp| {
                let mut from = fs_err::File::open(source)?;
                std::io::copy(&mut from, temp).map(|_| ())
            }),
            Backend::Http { .. } => Err(self.read_only(key)),
            Backend::S3 { store, prefix } => {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                // Large archives go up in parts (multipart upload); the object appears when the upload completes.
                let mut writer =
                    object_store::buffered::BufWriter::new(store.clone(), object_path(prefix, key));
                let mut file = tokio::fs::File::open(source).await.map_err(|err| {
                    std::io::Error::other(format!("failed to open `{}`: {err}", source.display()))
                })?;
                let mut buffer = vec![0u8; 1 << 20];
                // The whole upload gets the grace period plus its size at the least rate.
                let size = file.metadata().await.map(|m| m.len()).unwrap_or(0);
                let deadline = self.deadlines.download_deadline(Instant::now(), size);
                let upload = async {
                    loop {
                        let n = file.read(&mut buffer).await?;
                        if n == 0 {
                            break;
                        }
                        writer.write_all(&buffer[..n]).await?;
                    }
                    writer.shutdown().await
                };
                let written = tokio::time::timeout_at(deadline, upload)
                    .await
                    .unwrap_or_else(|_| {
                        Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            self.upload_too_slow(size),
                        ))
                    });
                if let Err(err) = written {
                    let _ = writer.abort().await;
                    return Err(self.error(key, err));
                }
                Ok(())
            }
        }
    }

    /// Store `bytes` as `key` (see [`Cache::put_file`]).
    pub async fn put_bytes(&self, key: &str, bytes: &[u8]) -> Result<(), CacheError> {
        match &self.backend {
            Backend::Dir(root) => dir_put(root, key, |temp| std::io::Write::write_all(temp, bytes)),
            Backend::Http { .. } => Err(self.read_only(key)),
            Backend::S3 { store, prefix } => {
                let deadline = self
                    .deadlines
                    .download_deadline(Instant::now(), bytes.len() as u64);
                let path = object_path(prefix, key);
                let put = store.put(&path, object_store::PutPayload::from(bytes.to_vec()));
                match tokio::time::timeout_at(deadline, put).await {
                    Ok(put) => put.map(|_| ()).map_err(|err| self.error(key, err)),
                    Err(_) => Err(self.error(key, self.upload_too_slow(bytes.len() as u64))),
                }
            }
        }
    }

    /// Why an upload of `size` bytes was stopped.
    fn upload_too_slow(&self, size: u64) -> String {
        format!(
            "took too long to upload: {size} bytes get {} s plus 1 s per {} bytes (raise HVD_HTTP_TIMEOUT or lower \
             HVD_DOWNLOAD_MIN_RATE); nothing was stored",
            self.deadlines.request.as_secs(),
            self.deadlines.min_rate
        )
    }

    fn read_only(&self, key: &str) -> CacheError {
        self.error(
            key,
            "an HTTP cache is read-only; push to the directory it serves, or to an s3:// bucket",
        )
    }
}

/// Open the partial archive `path` to resume it, or create it (mode 0600); never through a symbolic link. One
/// that is not this user's file alone (another owner, more than one link, writable by group or others) is removed and
/// created anew (`O_CREAT|O_EXCL`): resuming writes into it and unpacks what it holds.
fn open_partial(path: &Path) -> Result<std::fs::File, CacheError> {
    use std::os::unix::fs::OpenOptionsExt;
    let refused = |what, source| CacheError::Partial {
        path: path.to_path_buf(),
        what,
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| {
            if source.raw_os_error() == Some(libc::ELOOP) {
                refused("is a symbolic link (not followed); remove it", source)
            } else {
                refused("could not be opened", source)
            }
        })?;
    let metadata = file
        .metadata()
        .map_err(|source| refused("could not be examined", source))?;
    if !metadata.is_file() {
        return Err(refused(
            "is not a regular file; remove it",
            std::io::Error::from(std::io::ErrorKind::InvalidInput),
        ));
    }
    // Resumed only when it is this user's file alone: not a hard link to another file (its other name would be
    // written through), not another user's, not one others may write (their bytes would be unpacked).
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if metadata.uid() == me && metadata.nlink() == 1 && metadata.mode() & 0o022 == 0 {
        return Ok(file);
    }
    tracing::info!(
        "discarding `{}`: not this user's file alone (owner {}, {} links, mode {:o}); starting anew",
        path.display(),
        metadata.uid(),
        metadata.nlink(),
        metadata.mode() & 0o7777
    );
    drop(file);
    std::fs::remove_file(path).map_err(|source| refused("could not be removed", source))?;
    crate::store::create_new_file(path, 0o600)
        .map_err(|source| refused("could not be created anew", source))
}

/// How often [`Cache::download`] reads an archive whose connection broke off before it gives up (each attempt
/// after the first resumes where the last one stopped); a read whole after a partial was discarded counts anew.
pub const MAX_ATTEMPTS: u32 = 4;

/// What a read feeds its sink: where the object's bytes start (first, once), then the bytes.
enum Piece<'a> {
    Start(u64),
    Bytes(&'a [u8]),
}

/// The first byte of an HTTP `Content-Range: bytes START-END/TOTAL` (TOTAL may be `*`).
fn content_range_start(value: &str) -> Option<u64> {
    let (start, rest) = value.trim().strip_prefix("bytes ")?.split_once('-')?;
    let (end, _total) = rest.split_once('/')?;
    let start: u64 = start.trim().parse().ok()?;
    let end: u64 = end.trim().parse().ok()?;
    (start <= end).then_some(start)
}

/// `url` with the user information of its authority (`user:token@`) replaced by `***@`, so a credential in a cache
/// URL is never printed.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => url.to_string(),
    }
}

/// The object path of `key` under `prefix`.
fn object_path(prefix: &str, key: &str) -> object_store::path::Path {
    if prefix.is_empty() {
        object_store::path::Path::from(key)
    } else {
        object_store::path::Path::from(format!("{prefix}/{key}"))
    }
}

/// Write `key` under `root` through a temp file in the same directory, renamed into place when complete. A shared
/// cache directory may be writable by others: the temp file has an unpredictable name and is created new, never
/// through a link another user planted (`O_CREAT|O_EXCL|O_NOFOLLOW`), and `fill` writes into that descriptor.
fn dir_put(
    root: &Path,
    key: &str,
    fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<(), CacheError> {
    let dest = root.join(key);
    let dir = dest.parent().unwrap_or(root);
    fs_err::create_dir_all(dir)?;
    let base = dest.file_name().unwrap_or_default().to_string_lossy();
    let mut attempt = 0;
    let (temp, mut file) = loop {
        let mut random = [0u8; 8];
        getrandom::fill(&mut random).map_err(|err| {
            std::io::Error::other(format!("no random bytes for a temp name: {err}"))
        })?;
        let temp = dir.join(format!(
            ".{base}.{}.{}.{:016x}.part",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed),
            u64::from_le_bytes(random)
        ));
        match crate::store::create_new_file(&temp, 0o644) {
            Ok(file) => break (temp, file),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists && attempt < 8 => {
                attempt += 1
            }
            Err(err) => return Err(err.into()),
        }
    };
    let written = fill(&mut file)
        .and_then(|_| file.sync_all())
        .and_then(|_| fs_err::rename(&temp, &dest));
    if let Err(err) = written {
        let _ = fs_err::remove_file(&temp);
        return Err(err.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_cache_urls_are_never_shown() {
        assert_eq!(redact("https://user:tok@host/p@x"), "https://***@host/p@x");
        assert_eq!(redact("http://tok@host:8080"), "http://***@host:8080");
        assert_eq!(redact("https://host/a@b"), "https://host/a@b");
        assert_eq!(redact("/dir/a@b"), "/dir/a@b");
        let cache = Cache::parse("https://me:secret@127.0.0.1:1/c").unwrap();
        assert_eq!(cache.url(), "https://***@127.0.0.1:1/c");
        assert!(!format!("{cache:?}").contains("secret"));
        let err = Cache::parse("ftp://me:secret@host/c")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("secret"), "{err}");
    }

    /// Another user of a shared cache directory plants links at the temp names a put would have used (the old
    /// predictable `.<key>.<pid>.<n>.part`) pointing at the pusher's files: the put writes its object, the targets
    /// stay untouched, and no link is followed or replaced.
    #[test]
    fn a_put_never_writes_through_a_link_planted_in_a_shared_cache_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cache");
        std::fs::create_dir(&root).unwrap();
        let victim = dir.path().join("bashrc");
        std::fs::write(&victim, "the user's own file\n").unwrap();
        let next = TEMP_COUNTER.load(Ordering::Relaxed);
        let pid = std::process::id();
        for key in ["x.info", "x.tar.zst"] {
            for n in next..next + 64 {
                std::os::unix::fs::symlink(&victim, root.join(format!(".{key}.{pid}.{n}.part")))
                    .unwrap();
            }
        }
        let source = dir.path().join("archive");
        std::fs::write(&source, "archive bytes").unwrap();
        let cache = Cache::parse(&root.display().to_string()).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime
            .block_on(cache.put_bytes("x.info", b"record"))
            .unwrap();
        runtime
            .block_on(cache.put_file("x.tar.zst", &source))
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "the user's own file\n"
        );
        assert_eq!(std::fs::read(root.join("x.info")).unwrap(), b"record");
        assert_eq!(
            std::fs::read(root.join("x.tar.zst")).unwrap(),
            b"archive bytes"
        );
        let links = std::fs::read_dir(&root)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_type().unwrap().is_symlink())
            .count();
        assert_eq!(links, 128, "a planted link was replaced or removed");
    }

    /// A symbolic link planted as the partial archive: refused saying so, with the operating system's error kept as
    /// the source, and its target untouched.
    #[test]
    fn a_partial_archive_that_is_a_symbolic_link_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cache");
        std::fs::create_dir_all(root.join("archives")).unwrap();
        std::fs::write(root.join("archives/a"), "archive").unwrap();
        let victim = dir.path().join("bashrc");
        std::fs::write(&victim, "the user's own file\n").unwrap();
        let partial = dir.path().join("a.part");
        std::os::unix::fs::symlink(&victim, &partial).unwrap();
        let cache = Cache::parse(&root.display().to_string()).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let sha256 = Sha256::from_hasher(sha2::Sha256::new_with_prefix(b"archive"));
        let err = runtime
            .block_on(cache.download("archives/a", &partial, (&sha256, 7), &|_| {}))
            .unwrap_err();
        assert!(err.to_string().contains("is a symbolic link"), "{err}");
        let source = std::error::Error::source(&err)
            .and_then(|source| source.downcast_ref::<std::io::Error>())
            .map(|source| source.raw_os_error());
        assert_eq!(source, Some(Some(libc::ELOOP)), "{err:?}");
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "the user's own file\n"
        );
    }
}
