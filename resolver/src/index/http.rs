//! Sending index requests: retries with backoff on transient failures, the request and download deadlines, and
//! response bodies read within a size limit.

use std::sync::atomic::Ordering;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{CONTENT_RANGE, HeaderMap, RANGE};

use super::{IndexClient, IndexError};
use crate::deadline::DeadlineExceeded;

const RETRIES: u32 = 3;

/// An error with its causes, joined by `: `: for an error that must travel as text (`reqwest` keeps the useful
/// part, e.g. a TLS failure, in the sources).
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
/// The most bytes of an sdist held in memory to read its PKG-INFO, and of a range answer that is the whole file.
pub(super) const MAX_SDIST_BYTES: u64 = 1 << 30;

pub(super) fn header(headers: &HeaderMap, name: reqwest::header::HeaderName) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// `response` when its status is a success, else [`IndexError::Status`] naming `url`.
pub(super) fn success(
    url: &str,
    response: reqwest::Response,
) -> Result<reqwest::Response, IndexError> {
    let status = response.status();
    if status.is_success() {
        Ok(response)
    } else {
        Err(IndexError::Status {
            url: url.to_string(),
            status: status.as_u16(),
        })
    }
}

impl IndexClient {
    /// Send a GET with retries on transient failures (connect errors, timeouts, 5xx, 429).
    pub(super) async fn send(
        &self,
        url: &str,
        headers: HeaderMap,
    ) -> Result<reqwest::Response, IndexError> {
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
    pub(super) async fn within<T>(
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
    pub(super) fn request_deadline_error(&self, url: &str, what: &str) -> IndexError {
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
    pub(super) async fn send_download(
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
    pub(super) async fn body(
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
    pub(super) async fn paced<T>(
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

    /// GET a byte range. `asked` is the length requested: a 206 answer may not be longer, and must come whole
    /// within the request deadline; a 200 answer (no range support: the whole file) is read up to
    /// [`MAX_SDIST_BYTES`] as a download, at the least speed. `what` names the package for a deadline error.
    pub(super) async fn get_range(
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
        let response = success(url, response)?;
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
}
