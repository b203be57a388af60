//! Pushing: the closure of store paths (following `.hvd-path.json` references) into a cache, each path re-hashed
//! against its recorded content hash, archived, uploaded, then its signed record (so a record never names an
//! archive that is not there). Paths the cache already has are skipped.

use std::collections::{BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::backend::Cache;
use super::key::SecretKey;
use super::record::{MAX_RECORD_BYTES, Record, Trust, archive_key, check_path_name, record_key};
use super::{CACHE_INFO, CacheError, cache_info_text, parse_cache_info};
use crate::error::Result;
use crate::progress::Progress;
use crate::store::Store;

/// Paths pushed at the same time.
const PARALLEL: usize = 4;

/// What [`push`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushReport {
    /// Path names uploaded by this push.
    pub pushed: Vec<String>,
    /// Path names the cache already had.
    pub skipped: Vec<String>,
}

/// The closure of `roots` (store path names) over their references, sorted.
pub fn closure(store: &Store, roots: &[String]) -> Result<Vec<String>> {
    let mut seen = BTreeSet::new();
    let mut queue: VecDeque<String> = roots.iter().cloned().collect();
    while let Some(name) = queue.pop_front() {
        if !seen.insert(name.clone()) {
            continue;
        }
        check_path_name(&name).map_err(|message| CacheError::Push {
            name: name.clone(),
            message,
        })?;
        let path = store.root().join(&name);
        if !store.is_valid(&path) {
            return Err(CacheError::Push {
                name,
                message: "it is not a valid path of this store (build it first)".into(),
            }
            .into());
        }
        queue.extend(store.path_info(&path)?.references);
    }
    Ok(seen.into_iter().collect())
}

/// Push the closure of `roots` into `cache`, signed with `key`.
pub fn push(
    store: &Store,
    roots: &[String],
    cache: &Cache,
    key: &SecretKey,
    progress: &dyn Progress,
) -> Result<PushReport> {
    // gc waits while this holds the builders' lock: no path of the closure disappears under the push.
    let _builders = store.lock_builders()?;
    let names = closure(store, roots)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(check_or_write_info(store, cache))?;
    let report = Mutex::new(PushReport::default());
    let first_error: Mutex<Option<crate::Error>> = Mutex::new(None);
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..PARALLEL.min(names.len()) {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some(name) = names.get(index) else { break };
                    match push_one(store, name, cache, key, &runtime, progress) {
                        Ok(pushed) => {
                            let mut report = report.lock().unwrap_or_else(|e| e.into_inner());
                            if pushed {
                                report.pushed.push(name.clone());
                            } else {
                                report.skipped.push(name.clone());
                            }
                        }
                        Err(err) => {
                            first_error
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .get_or_insert(err);
                            next.store(names.len(), Ordering::Relaxed);
                            break;
                        }
                    }
                }
            });
        }
    });
    if let Some(err) = first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(err);
    }
    let mut report = report.into_inner().unwrap_or_else(|e| e.into_inner());
    report.pushed.sort();
    report.skipped.sort();
    Ok(report)
}

/// A new cache gets its `hvd-cache-info`; an existing one must serve this store.
async fn check_or_write_info(store: &Store, cache: &Cache) -> Result<(), CacheError> {
    if !cache.writable() {
        return Err(CacheError::Url {
            url: cache.url().to_string(),
            message:
                "this kind of cache is read-only; push to a directory (file://) or s3:// bucket"
                    .into(),
        });
    }
    match cache.get(CACHE_INFO, 64 << 10).await? {
        None => {
            cache
                .put_bytes(CACHE_INFO, cache_info_text(store.root()).as_bytes())
                .await
        }
        Some(bytes) => {
            let theirs = parse_cache_info(&String::from_utf8_lossy(&bytes)).map_err(|message| {
                CacheError::NotACache {
                    cache: cache.url().to_string(),
                    message: format!("its `{CACHE_INFO}` is unreadable: {message}"),
                }
            })?;
            if std::path::Path::new(&theirs) != store.root() {
                return Err(CacheError::NotACache {
                    cache: cache.url().to_string(),
                    message: format!(
                        "it holds paths of the store `{theirs}`, this store is `{}`; push to another cache",
                        store.root().display()
                    ),
                });
            }
            Ok(())
        }
    }
}

/// Push one path; `false` when the cache already has its record.
fn push_one(
    store: &Store,
    name: &str,
    cache: &Cache,
    key: &SecretKey,
    runtime: &tokio::runtime::Runtime,
    progress: &dyn Progress,
) -> Result<bool> {
    if runtime.block_on(already_there(cache, name, key))? {
        return Ok(false);
    }
    let path = store.root().join(name);
    let info = store.path_info(&path)?;
    let refuse = |message: String| CacheError::Push {
        name: name.to_string(),
        message,
    };
    if info.derivation.path_name() != name {
        return Err(refuse(format!(
            "its `.hvd-path.json` names the derivation of `{}`",
            info.derivation.path_name()
        ))
        .into());
    }
    progress.step_started("push", &info.derivation.name, &info.derivation.version);
    let actual = crate::hash::content_hash(&crate::hash::manifest(&path)?);
    if actual != info.content_hash {
        return Err(refuse(format!(
            "its files changed after it was built (content hash {actual}, recorded {}); rebuild it with \
             `hvd gc` + `hvd build` before pushing",
            info.content_hash
        ))
        .into());
    }
    let temp = store.temp_dir(&format!("push-{name}"))?;
    let result = (|| -> Result<()> {
        let archive_path: PathBuf = temp.join("archive.tar.zst");
        let archive = super::archive::pack(&path, &archive_path)?;
        let mut record = Record::new(
            store.root(),
            info.derivation.clone(),
            info.content_hash.clone(),
            info.references.clone(),
            archive.clone(),
        );
        record.sign(key);
        let archive_key = archive_key(&archive.sha256);
        runtime.block_on(async {
            if !cache.exists(&archive_key).await? {
                cache.put_file(&archive_key, &archive_path).await?;
            }
            cache.put_bytes(&record_key(name), &record.to_bytes()).await
        })?;
        Ok(())
    })();
    crate::store::remove_tree(&temp)?;
    result?;
    progress.step_finished("push", &info.derivation.name, &info.derivation.version);
    Ok(true)
}

/// Whether the cache already has `name` as this push would leave it: a record that parses, answers for `name`, is
/// signed by `key`, and whose archive is there. Anything else (no record, garbage, another key's record, a pruned
/// archive) is rewritten.
async fn already_there(cache: &Cache, name: &str, key: &SecretKey) -> Result<bool, CacheError> {
    let bytes = match cache.get(&record_key(name), MAX_RECORD_BYTES).await {
        Ok(Some(bytes)) => bytes,
        Ok(None) | Err(CacheError::TooLarge { .. }) => return Ok(false),
        Err(err) => return Err(err),
    };
    let Ok(record) = Record::parse(&bytes) else {
        tracing::info!("{name}: the cache's record is unreadable; rewriting it");
        return Ok(false);
    };
    if record.name != name || !matches!(record.trust(&[key.public()]), Trust::Trusted(_)) {
        tracing::info!(
            "{name}: the cache's record is not signed by `{}`; rewriting it",
            key.name()
        );
        return Ok(false);
    }
    if !cache.exists(&archive_key(&record.archive.sha256)).await? {
        tracing::info!("{name}: the cache's archive is missing; uploading it again");
        return Ok(false);
    }
    Ok(true)
}
