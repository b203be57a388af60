//! Overall deadlines for HTTP requests, so a host that trickles bytes (one just inside each read timeout) cannot
//! stall `hvd lock` or a download for hours.
//!
//! - A request for a page or a metadata file must be answered whole within [`HttpDeadlines::request`]
//!   (`HVD_HTTP_TIMEOUT`, seconds; default 300), retries included.
//! - A download (an artifact hashed at lock time, a wheel or sdist the builder fetches) gets the same time, plus
//!   `1 / min_rate` seconds for every byte received (`HVD_DOWNLOAD_MIN_RATE`, bytes per second; default 32768):
//!   once past the first [`HttpDeadlines::request`] seconds, it must average at least `min_rate`. A slow but
//!   honest download of any size finishes; one that falls below the floor stops with [`DeadlineExceeded`].

use std::time::Duration;

use tokio::time::Instant;

use crate::env_vars::{
    HVD_DOWNLOAD_MIN_RATE as DOWNLOAD_MIN_RATE_ENV, HVD_HTTP_TIMEOUT as HTTP_TIMEOUT_ENV,
};

/// How long requests may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpDeadlines {
    /// A whole page or metadata request, retries included; also the grace period of a download.
    pub request: Duration,
    /// The least average speed of a download after the grace period, in bytes per second (at least 1).
    pub min_rate: u64,
}

impl Default for HttpDeadlines {
    fn default() -> Self {
        HttpDeadlines {
            request: Duration::from_secs(300),
            min_rate: 32 * 1024,
        }
    }
}

/// A deadline setting that is not a positive whole number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}=`{value}` is not valid: {expected}; unset it to use the default ({default})")]
pub struct BadDeadlineSetting {
    pub name: &'static str,
    pub value: String,
    pub expected: &'static str,
    pub default: String,
}

/// What part of a request took too long.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeadlineExceeded {
    #[error(
        "no complete answer within {} s (the limit for one request; raise it with {HTTP_TIMEOUT_ENV}=<seconds>)",
        .limit.as_secs_f64()
    )]
    Request { limit: Duration },
    #[error(
        "only {received} bytes arrived in {} s, below the floor of {min_rate} bytes/s after the first {} s (lower it with {DOWNLOAD_MIN_RATE_ENV}=<bytes per second>, or raise {HTTP_TIMEOUT_ENV}=<seconds>)",
        .elapsed.as_secs(), .grace.as_secs_f64()
    )]
    TooSlow {
        received: u64,
        elapsed: Duration,
        min_rate: u64,
        grace: Duration,
    },
}

/// A setting that must be a positive whole number: `None` where unset or empty, an error naming it otherwise.
pub fn positive_setting(
    name: &'static str,
    value: Option<std::ffi::OsString>,
    expected: &'static str,
    default: String,
) -> Result<Option<u64>, BadDeadlineSetting> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let text = value.to_string_lossy();
    match text.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(BadDeadlineSetting {
            name,
            value: text.chars().take(40).flat_map(char::escape_debug).collect(),
            expected,
            default,
        }),
    }
}

/// `started + wait`, or a century after `started` where that sum passes what an `Instant` holds (`Instant +
/// Duration` panics on overflow; a deadline that far never fires).
fn far_after(started: Instant, wait: Duration) -> Instant {
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    started
        .checked_add(wait.min(century))
        .or_else(|| started.checked_add(Duration::from_secs(24 * 3600)))
        .unwrap_or(started)
}

impl HttpDeadlines {
    /// The defaults, overridden by `HVD_HTTP_TIMEOUT` and `HVD_DOWNLOAD_MIN_RATE` where set (empty means unset).
    pub fn from_env() -> Result<HttpDeadlines, BadDeadlineSetting> {
        Self::from_values(
            std::env::var_os(HTTP_TIMEOUT_ENV),
            std::env::var_os(DOWNLOAD_MIN_RATE_ENV),
        )
    }

    fn from_values(
        timeout: Option<std::ffi::OsString>,
        min_rate: Option<std::ffi::OsString>,
    ) -> Result<HttpDeadlines, BadDeadlineSetting> {
        let default = HttpDeadlines::default();
        let mut out = default;
        if let Some(secs) = positive_setting(
            HTTP_TIMEOUT_ENV,
            timeout,
            "expected a whole number of seconds, at least 1",
            format!("{} s", default.request.as_secs()),
        )? {
            out.request = Duration::from_secs(secs);
        }
        if let Some(rate) = positive_setting(
            DOWNLOAD_MIN_RATE_ENV,
            min_rate,
            "expected a whole number of bytes per second, at least 1",
            format!("{} bytes/s", default.min_rate),
        )? {
            out.min_rate = rate;
        }
        Ok(out)
    }

    /// When a request started at `started` must be answered whole (`HVD_HTTP_TIMEOUT` takes any whole number of
    /// seconds: one past what an `Instant` holds is a deadline that never fires, not a panic).
    pub fn request_deadline(&self, started: Instant) -> Instant {
        far_after(started, self.request)
    }

    /// When a download started at `started`, with `received` bytes so far, must have received its next byte:
    /// the grace period plus `received / min_rate` seconds.
    pub fn download_deadline(&self, started: Instant, received: u64) -> Instant {
        let earned = Duration::try_from_secs_f64(received as f64 / self.min_rate.max(1) as f64)
            .unwrap_or(Duration::MAX);
        far_after(started, self.request.saturating_add(earned))
    }

    /// The error for a download stopped at its deadline.
    pub fn too_slow(&self, started: Instant, received: u64) -> DeadlineExceeded {
        DeadlineExceeded::TooSlow {
            received,
            elapsed: started.elapsed(),
            min_rate: self.min_rate,
            grace: self.request,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `HVD_HTTP_TIMEOUT=18446744073709551615` (any whole number is taken): the deadlines are far away, not a
    /// panic on `Instant + Duration`.
    #[test]
    fn a_timeout_past_what_an_instant_holds_is_a_far_deadline() {
        let deadlines =
            HttpDeadlines::from_values(Some(u64::MAX.to_string().into()), Some("1".into()))
                .unwrap();
        let now = Instant::now();
        assert!(deadlines.request_deadline(now) > now + Duration::from_secs(365 * 24 * 3600));
        assert!(
            deadlines.download_deadline(now, u64::MAX) > now + Duration::from_secs(365 * 24 * 3600)
        );
    }

    #[test]
    fn settings_parse_and_bad_values_are_named() {
        assert_eq!(
            HttpDeadlines::from_values(None, None).unwrap(),
            HttpDeadlines::default()
        );
        assert_eq!(
            HttpDeadlines::from_values(Some("7".into()), Some(" 100 ".into())).unwrap(),
            HttpDeadlines {
                request: Duration::from_secs(7),
                min_rate: 100
            }
        );
        assert_eq!(
            HttpDeadlines::from_values(Some("".into()), None).unwrap(),
            HttpDeadlines::default()
        );
        for bad in ["0", "-3", "1.5", "ten"] {
            let err = HttpDeadlines::from_values(Some(bad.into()), None).unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains(HTTP_TIMEOUT_ENV) && text.contains(bad) && text.contains("300 s"),
                "{text}"
            );
            let err = HttpDeadlines::from_values(None, Some(bad.into())).unwrap_err();
            assert!(err.to_string().contains(DOWNLOAD_MIN_RATE_ENV), "{err}");
        }
    }

    #[test]
    fn a_download_earns_time_by_the_bytes_it_receives() {
        let d = HttpDeadlines {
            request: Duration::from_secs(10),
            min_rate: 1000,
        };
        let start = Instant::now();
        assert_eq!(
            d.download_deadline(start, 0),
            start + Duration::from_secs(10)
        );
        assert_eq!(
            d.download_deadline(start, 5000),
            start + Duration::from_secs(15)
        );
        // A 500 MB download at the floor has 10 s + 500_000 s; nothing overflows at the largest sizes.
        assert_eq!(
            d.download_deadline(start, 500_000_000),
            start + Duration::from_secs(500_010)
        );
        let _ = d.download_deadline(start, u64::MAX);
    }
}
