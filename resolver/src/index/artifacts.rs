//! Metadata read out of the artifacts an index lists: PEP 658 metadata files, a wheel's METADATA by HTTP range,
//! an sdist's PKG-INFO and build requirements, and an artifact hashed whole when the index lists no sha256.

use std::sync::atomic::Ordering;

use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use sha2::Digest;

use super::http::{MAX_SDIST_BYTES, success};
use super::{IndexClient, IndexError, IndexFile};
use crate::digest::Sha256;
use crate::metadata::{self, CoreMetadata};
use crate::temp_files::write_atomic;

/// Bytes fetched from the end of a wheel in the first range request: the central directory of most wheels fits.
const TAIL_BYTES: u64 = 64 * 1024;
/// Bytes fetched before a central directory that is not in the tail (METADATA usually sits there).
const LEADING_BYTES: u64 = 32 * 1024;
/// The most bytes read for one METADATA file (PEP 658) or range answer beyond what was asked.
const MAX_METADATA_BYTES: u64 = 64 << 20;
/// The most bytes of any artifact hashed at lock time.
const MAX_ARTIFACT_BYTES: u64 = 4 << 30;

impl IndexClient {
    /// Stream an artifact and hash it, keeping nothing: for indexes that list no sha256, so the lockfile never
    /// records an empty hash. Returns the digest and the size.
    pub(crate) async fn artifact_digest(
        &self,
        file: &IndexFile,
    ) -> Result<(Sha256, u64), IndexError> {
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
        let response = self
            .send_download(&file.url, HeaderMap::new(), &what, started)
            .await?;
        let mut response = success(&file.url, response)?;
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

    /// Core metadata of a wheel: PEP 658 file when offered, else METADATA read by range from the wheel.
    pub(crate) async fn wheel_metadata(
        &self,
        file: &IndexFile,
    ) -> Result<CoreMetadata, IndexError> {
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
    pub(crate) async fn sdist_metadata(
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
        let response = success(&file.url, response)?;
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
    pub(crate) async fn sdist_build_requires(
        &self,
        file: &IndexFile,
    ) -> Result<Vec<String>, IndexError> {
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

impl IndexClient {
    /// The metadata an sdist's build backend produced earlier for `python` (e.g. `3.11`): keyed like all index
    /// metadata (this index, the file's URL, the listed digest) plus the sdist's sha256 and the python, so one
    /// index's build (with its build requirements) never answers for another index.
    pub(crate) fn built_metadata(
        &self,
        file: &IndexFile,
        sdist: &Sha256,
        python: &str,
    ) -> Option<Vec<u8>> {
        let path = self.cache_path(
            BUILT_METADATA,
            &self.built_metadata_key(file, sdist, python),
        );
        let bytes = fs_err::read(path).ok()?;
        self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
        Some(bytes)
    }

    /// Keep what [`Self::built_metadata`] answers next time (an atomic write: a reader sees all of it or none).
    pub(crate) fn store_built_metadata(
        &self,
        file: &IndexFile,
        sdist: &Sha256,
        python: &str,
        bytes: &[u8],
    ) -> Result<(), IndexError> {
        let key = self.built_metadata_key(file, sdist, python);
        write_atomic(&self.cache_path(BUILT_METADATA, &key), bytes)?;
        Ok(())
    }

    /// A built sdist's metadata depends on where it came from (the index chose its build requirements), the
    /// sdist's bytes and the interpreter its `setup.py` ran on.
    fn built_metadata_key(&self, file: &IndexFile, sdist: &Sha256, python: &str) -> String {
        self.metadata_key(file, &format!("built-v2\n{}\n{python}", sdist.as_str()))
    }
}

/// The cache kind (`v1/<kind>/`) of metadata built from sdists.
pub(super) const BUILT_METADATA: &str = "built-metadata";

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
