//! Substitution: a store path that is not valid locally is looked up in the caches in order, trusted only with a
//! signature by a trusted key, its references substituted first, its archive downloaded and checked against the
//! record's sha256, unpacked under the path's lock with the hardened extractor, canonicalized and re-hashed
//! against the record's content hash, and renamed into place. Any mismatch refuses the path with it and the cache
//! named, and leaves nothing of it behind.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::backend::Cache;
use super::key::PublicKey;
use super::record::{MAX_RECORD_BYTES, Record, Trust, archive_key, record_key};
use super::{CACHE_INFO, CacheError, parse_cache_info};
use crate::derivation::Derivation;
use crate::error::Result;
use crate::progress::Progress;
use crate::store::{BuildOutput, Store};

/// Paths substituted at the same time.
const PARALLEL: usize = 4;
/// The most paths one closure in the caches may have.
const MAX_CLOSURE: usize = 1 << 16;
/// Download ids of substitutions, apart from the fetcher's.
const ID_BASE: usize = 1 << 40;

static NEXT_ID: AtomicUsize = AtomicUsize::new(ID_BASE);

/// The caches to substitute from and the keys to trust.
pub struct Substituter {
    caches: Vec<Cache>,
    trusted: Vec<PublicKey>,
    runtime: tokio::runtime::Runtime,
    /// Per cache: whether it serves this store (checked once).
    usable: Mutex<Vec<Option<bool>>>,
    substituted: AtomicUsize,
}

impl std::fmt::Debug for Substituter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Substituter")
            .field("caches", &self.caches)
            .field("trusted", &self.trusted)
            .finish_non_exhaustive()
    }
}

impl Substituter {
    /// Caches by URL, in the order they are asked; at least one trusted key is needed.
    pub fn new(urls: &[String], trusted: Vec<PublicKey>) -> Result<Substituter, CacheError> {
        let caches = urls
            .iter()
            .map(|url| Cache::parse(url))
            .collect::<Result<Vec<_>, _>>()?;
        if !caches.is_empty() && trusted.is_empty() {
            return Err(CacheError::Key {
                key: "(none)".into(),
                message:
                    "a cache is given but no trusted key: substitution needs --trusted-key (or \
                          HVD_TRUSTED_KEYS) naming the public key that signed it"
                        .into(),
            });
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        Ok(Substituter {
            usable: Mutex::new(vec![None; caches.len()]),
            caches,
            trusted,
            runtime,
            substituted: AtomicUsize::new(0),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.caches.is_empty()
    }

    /// How many paths this substituter installed so far.
    pub fn substituted(&self) -> usize {
        self.substituted.load(Ordering::Relaxed)
    }

    /// Make the paths of `derivations` valid from the caches where they have them (a few at a time); returns
    /// which ones are valid afterwards. Not found anywhere is not an error; a refused path is.
    pub fn substitute_all(
        &self,
        store: &Store,
        derivations: &[Derivation],
        progress: &dyn Progress,
    ) -> Result<Vec<bool>> {
        let items: Vec<(String, Option<&Derivation>)> = derivations
            .iter()
            .map(|d| (d.path_name(), Some(d)))
            .collect();
        self.substitute_many(store, &items, progress)
    }

    /// [`Substituter::substitute_name`] for each item, [`PARALLEL`] at a time.
    fn substitute_many(
        &self,
        store: &Store,
        items: &[(String, Option<&Derivation>)],
        progress: &dyn Progress,
    ) -> Result<Vec<bool>> {
        in_parallel(items, |(name, known)| {
            self.substitute_name(store, name, *known, progress)
        })
    }

    /// Make the path of `derivation` valid from a cache; `false` when no cache has it (or none usably).
    pub fn substitute(
        &self,
        store: &Store,
        derivation: &Derivation,
        progress: &dyn Progress,
    ) -> Result<bool> {
        self.substitute_name(store, &derivation.path_name(), Some(derivation), progress)
    }

    /// Make store path `name` (`<hash>-<name>-<version>`, e.g. an env's) valid with its closure from the caches, by
    /// its name alone: for a node that has no project, lock or index (`hvd cache pull`). `false` when no cache has it
    /// (or a path of its closure) signed by a trusted key; the caller checks the name first
    /// ([`super::record::check_path_name`]). Holds the store's builders lock ([`Store::lock_builders`]) while it
    /// installs, as a build does, so `hvd gc` cannot delete a reference installed before the path that needs it:
    /// nothing roots them until the caller does.
    pub fn substitute_path_name(
        &self,
        store: &Store,
        name: &str,
        progress: &dyn Progress,
    ) -> Result<bool> {
        let _builders = store.lock_builders()?;
        self.substitute_name(store, name, None, progress)
    }

    /// Substitute `name` with its closure: the records are collected breadth-first over names (each fetched once,
    /// so a shared reference or a cycle costs one look-up), then installed in dependency order, [`PARALLEL`] at a
    /// time. `false` (nothing installed) when a path of the closure is in no cache.
    fn substitute_name(
        &self,
        store: &Store,
        name: &str,
        known: Option<&Derivation>,
        progress: &dyn Progress,
    ) -> Result<bool> {
        if store.is_valid(&store.root().join(name)) {
            return Ok(true);
        }
        let mut found: Vec<(Record, usize)> = Vec::new();
        let mut seen = std::collections::BTreeSet::from([name.to_string()]);
        let mut queue = std::collections::VecDeque::from([(name.to_string(), known)]);
        while let Some((current, known)) = queue.pop_front() {
            if current != name && store.is_valid(&store.root().join(&current)) {
                continue;
            }
            let Some((record, index)) = self.find_record(store, &current, known, progress)? else {
                if current != name {
                    progress.warning(&format!(
                        "{name} needs {current}, which no cache has (signed by a trusted key); not \
                         substituting it"
                    ));
                }
                return Ok(false);
            };
            for reference in &record.references {
                if seen.insert(reference.clone()) {
                    if seen.len() > MAX_CLOSURE {
                        return Err(CacheError::BadRecord {
                            cache: self.caches[index].url().to_string(),
                            name: current,
                            message: format!(
                                "the closure of {name} in the caches has more than {MAX_CLOSURE} paths"
                            ),
                        }
                        .into());
                    }
                    queue.push_back((reference.clone(), None));
                }
            }
            found.push((record, index));
        }
        // Dependency order: a path is installed once every reference of it (other than itself) is.
        let mut pending: Vec<(Record, usize)> = found;
        let mut installed = std::collections::BTreeSet::new();
        while !pending.is_empty() {
            let names: std::collections::BTreeSet<String> =
                pending.iter().map(|(r, _)| r.name.clone()).collect();
            let (ready, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(record, _)| {
                record
                    .references
                    .iter()
                    .all(|r| *r == record.name || !names.contains(r) || installed.contains(r))
            });
            if let Some((record, index)) = rest.first()
                && ready.is_empty()
            {
                return Err(CacheError::BadRecord {
                    cache: self.caches[*index].url().to_string(),
                    name: record.name.clone(),
                    message: format!(
                        "the references of {name} in the caches form a cycle through it"
                    ),
                }
                .into());
            }
            let installed_all = in_parallel(&ready, |(record, index)| {
                self.install(store, &self.caches[*index], record, progress)
            })?;
            if installed_all.contains(&false) {
                return Ok(false);
            }
            installed.extend(ready.into_iter().map(|(r, _)| r.name));
            pending = rest;
        }
        Ok(true)
    }

    /// The first trusted record for `name` among the usable caches, with the cache's index; `None` when no cache
    /// has one. A record that is malformed, names another path or derivation, or has a bad signature by a trusted
    /// key is an error naming the path and the cache.
    fn find_record(
        &self,
        store: &Store,
        name: &str,
        known: Option<&Derivation>,
        progress: &dyn Progress,
    ) -> Result<Option<(Record, usize)>> {
        for (index, cache) in self.caches.iter().enumerate() {
            if !self.usable(index, store, progress) {
                continue;
            }
            let bytes = match self
                .runtime
                .block_on(cache.get(&record_key(name), MAX_RECORD_BYTES))
            {
                Ok(Some(bytes)) => bytes,
                Ok(None) => continue,
                Err(err) => {
                    progress.warning(&format!("{err}; not using it for {name}"));
                    continue;
                }
            };
            let refuse = |message: String| CacheError::BadRecord {
                cache: cache.url().to_string(),
                name: name.to_string(),
                message,
            };
            let record = Record::parse(&bytes).map_err(refuse)?;
            if record.name != name {
                return Err(refuse(format!("it answers for `{}`", record.name)).into());
            }
            if std::path::Path::new(&record.store) != store.root() {
                return Err(refuse(format!(
                    "it was built for the store `{}`, this store is `{}` (its files may name their store's \
                     directory, so it must be the same; the cache's `{CACHE_INFO}` says otherwise, so it was \
                     relabeled or mixes stores)",
                    record.store.escape_debug(),
                    store.root().display()
                ))
                .into());
            }
            if let Some(known) = known
                && &record.derivation != known
            {
                return Err(
                    refuse("its derivation is not the one this build computed".into()).into(),
                );
            }
            match record.trust(&self.trusted) {
                Trust::Trusted(key) => {
                    tracing::debug!("{name} in {} is signed by {key}", cache.url());
                    // A pruned archive withholds the path here: the next cache is asked.
                    match self
                        .runtime
                        .block_on(cache.exists(&archive_key(&record.archive.sha256)))
                    {
                        Ok(true) => return Ok(Some((record, index))),
                        Ok(false) => progress.warning(&format!(
                            "{name} in cache `{}` has a record but not its archive; asking the next cache",
                            cache.url()
                        )),
                        Err(err) => progress.warning(&format!("{err}; not using it for {name}")),
                    }
                }
                Trust::Untrusted => {
                    let signers: Vec<&str> =
                        record.signatures.iter().map(|s| s.key.as_str()).collect();
                    progress.warning(&format!(
                        "{name} in cache `{}` is not signed by a trusted key (signed by: {}); not using it",
                        cache.url(),
                        if signers.is_empty() {
                            "nobody".to_string()
                        } else {
                            signers.join(", ")
                        }
                    ));
                }
                Trust::BadSignature(key) => {
                    return Err(CacheError::BadSignature {
                        cache: cache.url().to_string(),
                        name: name.to_string(),
                        key,
                    }
                    .into());
                }
            }
        }
        Ok(None)
    }

    /// Whether cache `index` serves this store (its `hvd-cache-info` names the same store directory); says why
    /// not once.
    fn usable(&self, index: usize, store: &Store, progress: &dyn Progress) -> bool {
        // The lock is not held across the fetch: a stalling cache must not stall the threads asking others.
        if let Some(known) = self.usable.lock().unwrap_or_else(|e| e.into_inner())[index] {
            return known;
        }
        let cache = &self.caches[index];
        let checked = match self.runtime.block_on(cache.get(CACHE_INFO, 64 << 10)) {
            Ok(Some(bytes)) => match parse_cache_info(&String::from_utf8_lossy(&bytes)) {
                Ok(theirs) if std::path::Path::new(&theirs) == store.root() => Ok(()),
                Ok(theirs) => Err(format!(
                    "it holds paths of the store `{theirs}`, this store is `{}` (paths refer to their store's \
                     directory, so it must be the same)",
                    store.root().display()
                )),
                Err(message) => Err(format!("its `{CACHE_INFO}` is unreadable: {message}")),
            },
            Ok(None) => Err(format!(
                "it has no `{CACHE_INFO}` (not an hvd cache, or empty)"
            )),
            Err(err) => Err(err.to_string()),
        };
        let mut usable = self.usable.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(known) = usable[index] {
            return known; // another thread checked it meanwhile (and said why not)
        }
        let ok = match checked {
            Ok(()) => true,
            Err(message) => {
                progress.warning(&format!(
                    "{}; not using it",
                    CacheError::NotACache {
                        cache: cache.url().to_string(),
                        message
                    }
                ));
                false
            }
        };
        usable[index] = Some(ok);
        ok
    }

    /// Download, verify and install one path whose references are valid; `false` (with a warning) when the cache
    /// has the record but not its archive.
    fn install(
        &self,
        store: &Store,
        cache: &Cache,
        record: &Record,
        progress: &dyn Progress,
    ) -> Result<bool> {
        let name = record.name.clone();
        let version = record.derivation.version.clone();
        progress.step_started("substitute", &record.derivation.name, &version);
        let archive_missing = std::sync::atomic::AtomicBool::new(false);
        let realized = store.realize_checked(
            &record.derivation,
            false,
            |target| {
                // The archive goes to `.tmp/archives/<sha256>.part`, kept when a download stops short so that the
                // next one resumes it; one download of an archive at a time.
                let partials = partial_dir(store)?;
                let sha256 = record.archive.sha256.as_str();
                let _archive_lock = store.lock_path(&format!("archive-{sha256}"))?;
                let archive = partials.join(format!("{sha256}.part"));
                let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
                progress.download_started(id, &name, Some(record.archive.size));
                let downloaded = self.runtime.block_on(cache.download(
                    &archive_key(&record.archive.sha256),
                    &archive,
                    (&record.archive.sha256, record.archive.size),
                    &|bytes| progress.download_progress(id, bytes),
                ));
                progress.download_finished(id);
                // Nothing arrived (a missing archive, a refused read): no partial to resume from.
                if !matches!(downloaded, Ok(Some(_)))
                    && fs_err::metadata(&archive).is_ok_and(|m| m.len() == 0)
                {
                    let _ = fs_err::remove_file(&archive);
                }
                let mismatch = |actual: String, actual_size: u64| CacheError::ArchiveMismatch {
                    cache: cache.url().to_string(),
                    name: name.clone(),
                    expected: record.archive.sha256.to_string(),
                    expected_size: record.archive.size,
                    actual,
                    actual_size,
                };
                let (sha256, size, verified) = match downloaded {
                    Ok(Some(found)) => found,
                    Ok(None) => {
                        archive_missing.store(true, Ordering::Relaxed);
                        return Err(CacheError::Backend {
                            cache: cache.url().to_string(),
                            key: archive_key(&record.archive.sha256),
                            message: format!("(the archive of {name}) is missing"),
                        }
                        .into());
                    }
                    Err(CacheError::TooLarge { .. }) => {
                        let _ = fs_err::remove_file(&archive);
                        return Err(mismatch(
                            "(unknown: longer than the record says)".into(),
                            record.archive.size.saturating_add(1),
                        )
                        .into());
                    }
                    Err(err) => return Err(err.into()),
                };
                if sha256 != record.archive.sha256 || size != record.archive.size {
                    // Not the archive: nothing of it is kept to resume from.
                    let _ = fs_err::remove_file(&archive);
                    return Err(mismatch(sha256.to_string(), size).into());
                }
                // Unpacked from the file that was hashed, through its descriptor: a name swapped since is not
                // read (the descriptor's own path under /proc; the file's name where /proc is not mounted).
                let by_descriptor = std::path::PathBuf::from(format!(
                    "/proc/self/fd/{}",
                    std::os::fd::AsRawFd::as_raw_fd(&verified)
                ));
                let source = if by_descriptor.exists() {
                    by_descriptor
                } else {
                    archive.clone()
                };
                let file_hashes =
                    super::archive::unpack(&source, &target.out).map_err(|source| {
                        CacheError::Unpack {
                            cache: cache.url().to_string(),
                            name: name.clone(),
                            source: Box::new(source),
                        }
                    })?;
                drop(verified);
                fs_err::remove_file(&archive)?;
                Ok(BuildOutput {
                    references: record.references.clone(),
                    file_hashes,
                })
            },
            |info| {
                if info.content_hash != record.content_hash {
                    return Err(CacheError::ContentMismatch {
                        cache: cache.url().to_string(),
                        name: name.clone(),
                        expected: record.content_hash.to_string(),
                        actual: info.content_hash.to_string(),
                    }
                    .into());
                }
                Ok(())
            },
        );
        let realized = match realized {
            Err(err) if archive_missing.load(Ordering::Relaxed) => {
                // A pruned or never-uploaded archive withholds the path, like a missing record: not an error.
                progress.warning(&format!("{err}; not substituting it"));
                progress.step_finished("substitute", &record.derivation.name, &version);
                return Ok(false);
            }
            realized => realized?,
        };
        progress.step_finished("substitute", &record.derivation.name, &version);
        if realized.built {
            self.substituted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(true)
    }

    /// The caches' URLs, in order.
    pub fn caches(&self) -> Vec<String> {
        self.caches.iter().map(|c| c.url().to_string()).collect()
    }
}

/// How long a partial archive nobody appends to is kept for a download to resume.
const PARTIAL_KEPT: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// `<store>/.tmp/archives/`, where archives are downloaded (`<sha256>.part`). The first call of a process removes
/// the partial archives untouched for [`PARTIAL_KEPT`] (abandoned downloads); other names there are left alone.
fn partial_dir(store: &Store) -> Result<std::path::PathBuf> {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    let dir = store.root().join(".tmp").join("archives");
    fs_err::create_dir_all(&dir)?;
    SWEPT.call_once(|| {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > PARTIAL_KEPT);
            let file_name = entry.file_name().to_string_lossy().into_owned();
            // Only hvd's own names: a lock file is made for each one looked at.
            let Some(sha256) = file_name.strip_suffix(".part").filter(|name| {
                name.parse::<hvd_resolver::Sha256>()
                    .is_ok_and(|s| s.as_str() == *name)
            }) else {
                continue;
            };
            // Never under a download that resumes it.
            if old && let Ok(Some(_lock)) = store.try_lock_path(&format!("archive-{sha256}")) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    });
    Ok(dir)
}

/// `run` for each item, [`PARALLEL`] at a time on a fixed set of threads; stops taking new items after an error (the
/// first error is returned).
fn in_parallel<T: Sync>(items: &[T], run: impl Fn(&T) -> Result<bool> + Sync) -> Result<Vec<bool>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<bool>>>> =
        Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..PARALLEL.min(items.len()) {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(index) else {
                        break;
                    };
                    let result = run(item);
                    let failed = result.is_err();
                    results.lock().unwrap_or_else(|e| e.into_inner())[index] = Some(result);
                    if failed {
                        next.store(items.len(), Ordering::Relaxed);
                        break;
                    }
                }
            });
        }
    });
    let mut valid = Vec::new();
    for result in results.into_inner().unwrap_or_else(|e| e.into_inner()) {
        valid.push(result.transpose()?.unwrap_or(false));
    }
    Ok(valid)
}
