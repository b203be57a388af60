//! The on-disk caches of the index client: project pages under HTTP revalidation (ETag, Last-Modified,
//! Cache-Control), metadata cached forever under a digest key, and the periodic sweep of stale temp files.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::StatusCode;
use reqwest::header::{
    ACCEPT, CACHE_CONTROL, CONTENT_TYPE, ETAG, HeaderMap, IF_MODIFIED_SINCE, IF_NONE_MATCH,
    LAST_MODIFIED,
};
use serde::{Deserialize, Serialize};
use sha2::Digest;

use super::http::{header, success};
use super::{IndexClient, IndexError, IndexFile};
use crate::digest::Sha256;
use crate::temp_files::{WRITE_SUFFIX, remove_stale_temps, write_atomic};

/// The most bytes read for one project page (the largest real pages are a few tens of MB).
const MAX_PAGE_BYTES: u64 = 256 << 20;
/// How often the caches are swept for stale temp files (the time is kept in `v1/.temp-sweep`).
const TEMP_SWEEP_EVERY: Duration = Duration::from_secs(3600);

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

impl IndexClient {
    /// Remove stale temp files (see [`remove_stale_temps`]) from the HTTP
    /// and metadata caches, at most once an hour per cache directory (the time of the last sweep is kept in
    /// `v1/.temp-sweep`). Returns how many were removed.
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
        for kind in ["http", "metadata", super::artifacts::BUILT_METADATA] {
            let Ok(buckets) = std::fs::read_dir(root.join(kind)) else {
                continue;
            };
            for bucket in buckets.flatten() {
                if bucket.file_type().is_ok_and(|t| t.is_dir()) {
                    removed += remove_stale_temps(&bucket.path(), WRITE_SUFFIX, None);
                }
            }
        }
        // Written after the sweep: a sweep cut short by a kill is redone by the next run.
        if let Err(err) = write_atomic(&marker, b"") {
            tracing::debug!(%err, "could not record the temp sweep");
        }
        removed
    }

    pub(super) fn cache_path(&self, kind: &str, key: &str) -> PathBuf {
        self.options
            .cache_dir
            .join("v1")
            .join(kind)
            .join(&key[..2])
            .join(key)
    }

    /// GET through the HTTP cache: fresh entries are served as is, stale ones revalidated with
    /// `If-None-Match` / `If-Modified-Since`. Returns the body and content type; `Ok(None)` on 404.
    pub(super) async fn get_cached(
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
        let response = success(url, response)?;
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

    /// The metadata-cache key of a file: a digest of what identifies the bytes the entry was read from — this
    /// index, the artifact URL the bytes came from, and the sha256 listed for it. Keyed by the URL, an entry
    /// only ever holds what that URL served (so one index cannot plant metadata for another index's file by
    /// claiming its sha256), and a new listed digest for the same URL is a new entry.
    pub(super) fn metadata_key(&self, file: &IndexFile, what: &str) -> String {
        let claimed = file.sha256.as_ref().map_or("-", Sha256::as_str);
        url_key(&format!(
            "metadata-v2\n{what}\n{}\n{}\n{claimed}",
            self.options.index_url, file.url
        ))
    }

    /// Metadata is immutable per key (URL and listed sha256), so it is cached forever.
    pub(super) fn cached_metadata(&self, key: &str) -> Option<Vec<u8>> {
        let b = fs_err::read(self.cache_path("metadata", key)).ok()?;
        self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deadline::HttpDeadlines;
    use crate::index::IndexOptions;

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
