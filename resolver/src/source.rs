//! The index-backed [`PackageSource`]: turns project pages into candidates for the target, fetches metadata, and
//! prefetches concurrently (the solver asks one question at a time; the network answers many at once).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::{self, BoxFuture};
use pep440_rs::{Version, VersionSpecifiers};
use pep508_rs::Requirement;
use pubgrub::Ranges;

use crate::digest::Sha256;
use crate::index::{IndexClient, IndexError, IndexFile};
use crate::lockfile::{Artifact, ArtifactKind, Dependency, LockedPackage};
use crate::metadata::CoreMetadata;
use crate::names::{WheelName, normalize_requirement, version_of};
use crate::solver::{self, Candidates, PackageSource, Resolution, SolveError, Unusable};
use crate::tags::{TargetSpec, summarize_python_tags};

/// An error of a [`SourceMetadataProvider`], kept whole as the source of [`SourceError::SourceMetadata`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One sdist whose metadata is not static (PKG-INFO lacks `Requires-Dist`): what building its metadata needs.
#[derive(Debug)]
pub struct SourceMetadataRequest<'a> {
    pub name: &'a str,
    pub version: &'a str,
    pub sdist: &'a Artifact,
    /// The target's interpreter, e.g. `3.11`.
    pub python: &'a str,
    /// The sdist's build requirements (pyproject `[build-system] requires`, else setuptools and wheel), locked
    /// for the target.
    pub build_packages: &'a [LockedPackage],
}

/// Builds the metadata of an sdist whose metadata is not static. The resolver never builds: the builder implements
/// this (its PEP 517 `prepare_metadata_for_build_wheel` in the build sandbox); the resolver caches the answer by the
/// sdist's sha256.
pub trait SourceMetadataProvider: Send + Sync {
    /// The sdist's core metadata: the bytes of the METADATA file its build backend wrote.
    fn metadata(&self, request: &SourceMetadataRequest<'_>) -> Result<Vec<u8>, BoxError>;
}

/// A failure of the index-backed source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Index(#[from] Arc<IndexError>),
    #[error("failed to build the metadata of {name}=={version} from its sdist")]
    SourceMetadata {
        name: String,
        version: String,
        #[source]
        source: BoxError,
    },
    #[error(
        "the build requirements of {name}=={version} (needed to build its metadata) have no solution:\n{message}"
    )]
    MetadataBuildRequirements {
        name: String,
        version: String,
        message: String,
    },
    #[error("{name}=={version} has no usable artifact")]
    NoArtifact { name: String, version: String },
}

/// Progress callback: called with each project name as its page is first requested.
pub type FetchCallback = Arc<dyn Fn(&str) + Send + Sync>;

type PageFuture = future::Shared<BoxFuture<'static, Result<Arc<ProjectVersions>, Arc<IndexError>>>>;
type MetaFuture = future::Shared<BoxFuture<'static, Result<Arc<CoreMetadata>, Arc<IndexError>>>>;

/// A project's versions evaluated for the target.
#[derive(Debug, Default)]
pub struct ProjectVersions {
    pub candidates: Arc<Candidates>,
    /// The chosen artifact per usable version.
    pub artifacts: HashMap<Version, IndexFile>,
}

/// The source the solver reads; `lock` creates one per resolution.
pub struct IndexSource {
    shared: Arc<Shared>,
    runtime: tokio::runtime::Handle,
    source_metadata: Option<Arc<dyn SourceMetadataProvider>>,
    /// How many versions of each package the solver has asked dependencies of (backtracking detector).
    tried: Mutex<HashMap<String, usize>>,
    /// Digests hvd computed itself for files the index lists without one, by URL.
    digests: Mutex<HashMap<String, (Sha256, u64)>>,
    /// What the caller should tell the user, each once (the library never prints).
    warnings: Mutex<BTreeSet<String>>,
    /// Sdists whose metadata is being built (`name==version`): a build requirement that needs its own metadata
    /// built from the same sdist is a cycle, refused instead of recursing without end.
    building: Mutex<BTreeSet<String>>,
}

/// Turn a panic inside an index task into an error of that task. The futures are shared: a panic would poison
/// the shared future and leave every other waiter (the solver thread) waiting forever.
fn no_panic<T: Send + 'static>(
    url: String,
    fut: BoxFuture<'static, Result<T, Arc<IndexError>>>,
) -> BoxFuture<'static, Result<T, Arc<IndexError>>> {
    std::panic::AssertUnwindSafe(fut)
        .catch_unwind()
        .map(move |result| {
            result.unwrap_or_else(|panic| {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a task panicked".into());
                tracing::error!(url, message, "index task panicked");
                Err(Arc::new(IndexError::Panicked { url, message }))
            })
        })
        .boxed()
}

/// When the solver walks down a package's versions (backtracking), fetch this many older versions' metadata at
/// once instead of one round trip per version.
const BACKTRACK_BATCH: usize = 8;

/// What the async prefetch tasks share with the solver thread.
struct Shared {
    client: IndexClient,
    runtime: tokio::runtime::Handle,
    target: Arc<TargetSpec>,
    /// Packages that must come as sdists (they are built from source).
    sdist_only: BTreeSet<String>,
    /// Versions allowed even when yanked (existing pins, PEP 592).
    allow_yanked: HashMap<String, Version>,
    pages: Mutex<HashMap<String, PageFuture>>,
    metadata: Mutex<HashMap<String, MetaFuture>>,
    on_fetch: Option<FetchCallback>,
}

impl IndexSource {
    pub fn new(
        client: IndexClient,
        runtime: tokio::runtime::Handle,
        target: Arc<TargetSpec>,
        sdist_only: BTreeSet<String>,
        allow_yanked: HashMap<String, Version>,
        source_metadata: Option<Arc<dyn SourceMetadataProvider>>,
        on_fetch: Option<FetchCallback>,
    ) -> IndexSource {
        let shared = Arc::new(Shared {
            client,
            runtime: runtime.clone(),
            target,
            sdist_only,
            allow_yanked,
            pages: Mutex::default(),
            metadata: Mutex::default(),
            on_fetch,
        });
        IndexSource {
            shared,
            runtime,
            source_metadata,
            tried: Mutex::default(),
            digests: Mutex::default(),
            warnings: Mutex::default(),
            building: Mutex::default(),
        }
    }

    /// The warnings of this resolution, each once, sorted.
    pub fn warnings(&self) -> Vec<String> {
        let warnings = self.warnings.lock().unwrap_or_else(|p| p.into_inner());
        warnings.iter().cloned().collect()
    }

    /// The lock entries of a resolution: each package's chosen artifact, its digest and its edges.
    pub(crate) fn locked_packages(
        &self,
        resolution: &Resolution,
    ) -> Result<Vec<LockedPackage>, SourceError> {
        let index = self.shared.client.index_url().trim_end_matches('/');
        let mut out = Vec::new();
        for (name, (version, edges)) in &resolution.packages {
            let (file, kind) = self.artifact(name, version)?;
            let (sha256, size) = self.artifact_digest(&file)?;
            out.push(LockedPackage {
                name: name.clone(),
                version: version.to_string(),
                index: index.to_string(),
                artifact: Artifact {
                    kind,
                    filename: file.filename.clone(),
                    url: file.url.clone(),
                    sha256,
                    size,
                },
                dependencies: edges
                    .iter()
                    .filter(|e| resolution.packages.contains_key(&e.name))
                    .map(|e| Dependency {
                        name: e.name.clone(),
                        extras: e.extras.clone(),
                        marker: e.marker.clone(),
                    })
                    .collect(),
            });
        }
        Ok(out)
    }

    /// The metadata of an sdist whose PKG-INFO has no static `Requires-Dist`: built by the
    /// [`SourceMetadataProvider`] with the sdist's build requirements locked for the target (cached by the sdist's
    /// sha256 and the python); without a provider, `fallback` (PKG-INFO's) and a warning.
    fn built_sdist_metadata(
        &self,
        name: &str,
        version: &Version,
        file: &IndexFile,
        fallback: CoreMetadata,
    ) -> Result<CoreMetadata, SourceError> {
        let Some(provider) = &self.source_metadata else {
            self.warnings
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(format!(
                    "the sdist of {name}=={version} declares no static dependencies and no metadata builder was \
                     given: locked as if it had none"
                ));
            return Ok(fallback);
        };
        let python = self.shared.target.to_lock().python;
        let (sha256, size) = self.artifact_digest(file)?;
        if let Some(bytes) = self.shared.client.built_metadata(file, &sha256, &python) {
            tracing::debug!(name, %version, "built metadata of the sdist from the cache");
            return Ok(CoreMetadata::parse(&String::from_utf8_lossy(&bytes)));
        }
        let this = format!("{name}=={version}");
        let _building = Building::enter(&self.building, &this).ok_or_else(|| {
            SourceError::MetadataBuildRequirements {
                name: name.to_string(),
                version: version.to_string(),
                message: format!(
                    "building its metadata needs {this} itself among its build requirements (a cycle): \
                     provide a wheel of one of them"
                ),
            }
        })?;
        let requires: Vec<String> = self
            .runtime
            .block_on(self.shared.client.sdist_build_requires(file))
            .map_err(Arc::new)?
            .iter()
            .map(|r| normalize_requirement(r))
            .collect();
        let words = self.shared.target.describe();
        let markers = &self.shared.target.markers;
        let asked = solver::Asked::all(&requires, &format!("`{this}`'s pyproject.toml"));
        let resolution = solver::solve(self, &asked, &[], markers, &HashMap::new(), &words)
            .map_err(|e| match e {
                SolveError::Source(e) => e,
                other => SourceError::MetadataBuildRequirements {
                    name: name.to_string(),
                    version: version.to_string(),
                    message: other.to_string(),
                },
            })?;
        let build_packages = self.locked_packages(&resolution)?;
        let sdist = Artifact {
            kind: ArtifactKind::Sdist,
            filename: file.filename.clone(),
            url: file.url.clone(),
            sha256: sha256.clone(),
            size,
        };
        let version_text = version.to_string();
        let request = SourceMetadataRequest {
            name,
            version: &version_text,
            sdist: &sdist,
            python: &python,
            build_packages: &build_packages,
        };
        tracing::info!(name, %version, "building the metadata of the sdist");
        let bytes = provider
            .metadata(&request)
            .map_err(|source| SourceError::SourceMetadata {
                name: name.to_string(),
                version: version_text.clone(),
                source,
            })?;
        let metadata = CoreMetadata::parse(&String::from_utf8_lossy(&bytes));
        let same_version = Version::from_str(&metadata.version).is_ok_and(|v| v == *version);
        if crate::names::normalize_name(&metadata.name) != crate::names::normalize_name(name)
            || !same_version
        {
            return Err(SourceError::SourceMetadata {
                name: name.to_string(),
                version: version_text,
                source: format!(
                    "its build backend wrote the metadata of `{} {}`, not of this sdist",
                    metadata.name, metadata.version
                )
                .into(),
            });
        }
        self.shared
            .client
            .store_built_metadata(file, &sha256, &python, &bytes)
            .map_err(Arc::new)?;
        Ok(metadata)
    }

    /// The sha256 and size to lock for a file: what the index lists, or, for an index that lists no sha256, what
    /// hvd computes streaming the file (once per file and lock). Never an empty hash.
    pub fn artifact_digest(&self, file: &IndexFile) -> Result<(Sha256, u64), SourceError> {
        if let Some(sha) = &file.sha256 {
            return Ok((sha.clone(), file.size.unwrap_or(0)));
        }
        if let Some(known) = self
            .digests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&file.url)
        {
            return Ok(known.clone());
        }
        tracing::info!(
            file = file.filename,
            "the index lists no sha256; hashing the file"
        );
        let client = self.shared.client.clone();
        let owned = file.clone();
        let fut = no_panic(
            file.url.clone(),
            async move { client.artifact_digest(&owned).await.map_err(Arc::new) }.boxed(),
        );
        let digest = self.runtime.block_on(fut)?;
        self.digests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(file.url.clone(), digest.clone());
        Ok(digest)
    }

    pub fn client(&self) -> &IndexClient {
        &self.shared.client
    }

    /// Start fetching a project page, and speculatively the metadata of its newest version in `range` and,
    /// recursively, of what that version requires. The solver usually picks exactly those, so by the time it
    /// asks, the answers are in; a wrong guess costs one metadata request.
    pub fn prefetch(&self, name: &str, range: Option<Ranges<Version>>) {
        speculate(&self.shared, name.to_string(), range);
    }

    fn page(&self, name: &str) -> Result<Arc<ProjectVersions>, SourceError> {
        let fut = self.shared.page_future(name);
        Ok(self.runtime.block_on(fut)?)
    }

    /// The chosen artifact of `name==version`.
    pub fn artifact(
        &self,
        name: &str,
        version: &Version,
    ) -> Result<(IndexFile, ArtifactKind), SourceError> {
        let page = self.page(name)?;
        let file = page
            .artifacts
            .get(version)
            .cloned()
            .ok_or_else(|| SourceError::NoArtifact {
                name: name.to_string(),
                version: version.to_string(),
            })?;
        let kind = if file.filename.ends_with(".whl") {
            ArtifactKind::Wheel
        } else {
            ArtifactKind::Sdist
        };
        Ok((file, kind))
    }
}

impl Shared {
    fn page_future(self: &Arc<Self>, name: &str) -> PageFuture {
        let mut pages = self.pages.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = pages.get(name) {
            return f.clone();
        }
        if let Some(cb) = &self.on_fetch {
            cb(name);
        }
        let this = self.clone();
        let owned = name.to_string();
        let fut = async move {
            match this.client.project(&owned).await {
                Ok(page) => {
                    let sdist = this.sdist_only.contains(&owned);
                    let evaluate = {
                        let this = this.clone();
                        let owned = owned.clone();
                        move || {
                            evaluate_files(
                                &owned,
                                &page.files,
                                &this.target,
                                sdist,
                                this.allow_yanked.get(&owned),
                            )
                        }
                    };
                    // Big pages (thousands of files) take a while to evaluate: keep it off the I/O threads.
                    let versions = tokio::task::spawn_blocking(evaluate).await.map_err(|e| {
                        Arc::new(IndexError::Parse {
                            url: owned.clone(),
                            message: e.to_string(),
                        })
                    })?;
                    Ok(Arc::new(versions))
                }
                Err(IndexError::NotFound { .. }) => Ok(Arc::new(ProjectVersions {
                    candidates: Arc::new(Candidates {
                        not_found: true,
                        ..Candidates::default()
                    }),
                    artifacts: HashMap::new(),
                })),
                Err(e) => Err(Arc::new(e)),
            }
        }
        .boxed();
        let fut = no_panic(format!("{}{name}/", self.client.index_url()), fut).shared();
        // Drive it now, so it runs while the solver works on something else.
        self.runtime.spawn(fut.clone());
        pages.insert(name.to_string(), fut.clone());
        fut
    }

    /// The metadata future of a file, and whether this call created it.
    fn metadata_future(self: &Arc<Self>, file: &IndexFile) -> (MetaFuture, bool) {
        let mut metadata = self.metadata.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = metadata.get(&file.url) {
            return (f.clone(), false);
        }
        let client = self.client.clone();
        let owned = file.clone();
        let fut = async move {
            if owned.filename.ends_with(".whl") {
                client
                    .wheel_metadata(&owned)
                    .await
                    .map(Arc::new)
                    .map_err(Arc::new)
            } else {
                let m = client.sdist_metadata(&owned).await.map_err(Arc::new)?;
                Ok(Arc::new(m.unwrap_or_default()))
            }
        }
        .boxed();
        let fut = no_panic(file.url.clone(), fut).shared();
        self.runtime.spawn(fut.clone());
        metadata.insert(file.url.clone(), fut.clone());
        (fut, true)
    }
}

/// See [`IndexSource::prefetch`]. Runs as a detached task; errors surface when the solver asks for real.
fn speculate(shared: &Arc<Shared>, name: String, range: Option<Ranges<Version>>) {
    let page = shared.page_future(&name);
    let shared = shared.clone();
    shared.runtime.clone().spawn(async move {
        let Ok(versions) = page.await else { return };
        let in_range = |v: &&Version| range.as_ref().is_none_or(|r| r.contains(v));
        let usable = &versions.candidates.usable;
        let guess = usable
            .iter()
            .filter(in_range)
            .find(|v| !v.any_prerelease())
            .or_else(|| usable.iter().find(in_range));
        let Some(file) = guess.and_then(|v| versions.artifacts.get(v)) else {
            return;
        };
        let (fut, created) = shared.metadata_future(file);
        if !created {
            return;
        }
        let Ok(meta) = fut.await else { return };
        for req in meta
            .requires_dist
            .iter()
            .filter_map(|r| Requirement::<pep508_rs::VerbatimUrl>::from_str(r).ok())
        {
            if !req.marker.evaluate(&shared.target.markers, &[]) {
                continue;
            }
            let range = match &req.version_or_url {
                Some(pep508_rs::VersionOrUrl::VersionSpecifier(spec)) => {
                    Some(Ranges::from(spec.clone()))
                }
                _ => None,
            };
            speculate(&shared, req.name.to_string(), range);
        }
    });
}

impl PackageSource for IndexSource {
    type Error = SourceError;

    fn candidates(&self, name: &str) -> Result<Arc<Candidates>, SourceError> {
        Ok(self.page(name)?.candidates.clone())
    }

    fn requires(&self, name: &str, version: &Version) -> Result<Arc<Vec<String>>, SourceError> {
        let (file, kind) = self.artifact(name, version)?;
        let (fut, _) = self.shared.metadata_future(&file);
        let tried = {
            let mut tried = self.tried.lock().unwrap_or_else(|p| p.into_inner());
            let count = tried.entry(name.to_string()).or_insert(0);
            *count += 1;
            *count
        };
        if tried >= 2 {
            let page = self.page(name)?;
            let usable = &page.candidates.usable;
            if let Some(pos) = usable.iter().position(|v| v == version) {
                for older in usable.iter().skip(pos + 1).take(BACKTRACK_BATCH) {
                    if let Some(file) = page.artifacts.get(older) {
                        drop(self.shared.metadata_future(file)); // spawned: it runs on
                    }
                }
            }
        }
        let mut meta = (*self.runtime.block_on(fut)?).clone();
        if kind == ArtifactKind::Sdist
            && meta.requires_dist.is_empty()
            && !meta.requires_dist_is_static()
        {
            meta = self.built_sdist_metadata(name, version, &file, meta)?;
        }
        // Start fetching what these requirements name, before the solver asks.
        for req in meta
            .requires_dist
            .iter()
            .filter_map(|r| Requirement::<pep508_rs::VerbatimUrl>::from_str(r).ok())
        {
            if req.marker.evaluate(&self.shared.target.markers, &[]) {
                let range = match &req.version_or_url {
                    Some(pep508_rs::VersionOrUrl::VersionSpecifier(spec)) => {
                        Some(Ranges::from(spec.clone()))
                    }
                    _ => None,
                };
                self.prefetch(req.name.as_ref(), range);
            }
        }
        Ok(Arc::new(meta.requires_dist))
    }
}

/// Group a project's files by version and pick the best artifact of each for the target.
pub(crate) fn evaluate_files(
    name: &str,
    files: &[IndexFile],
    target: &TargetSpec,
    sdist_only: bool,
    allow_yanked: Option<&Version>,
) -> ProjectVersions {
    let mut by_version: BTreeMap<Version, Vec<&IndexFile>> = BTreeMap::new();
    for f in files {
        if let Some(v) = version_of(&f.filename, name) {
            by_version.entry(v).or_default().push(f);
        }
    }
    let python = Version::from_str(&format!(
        "{}.{}.{}",
        target.python.major, target.python.minor, target.python.patch
    ))
    .unwrap_or_else(|_| Version::new([3]));
    let mut candidates = Candidates::default();
    let mut artifacts = HashMap::new();
    for (version, files) in by_version.into_iter().rev() {
        let yank_ok = allow_yanked == Some(&version);
        let live: Vec<&&IndexFile> = files.iter().filter(|f| !f.yanked || yank_ok).collect();
        let python_tags: Vec<String> = files
            .iter()
            .filter_map(|f| WheelName::from_str(&f.filename).ok())
            .flat_map(|w| w.python)
            .collect();
        if live.is_empty() {
            candidates.unusable.push(Unusable {
                version,
                reason: "is yanked".into(),
                python_tags,
            });
            continue;
        }
        let fits_python = |f: &&&IndexFile| {
            f.requires_python.as_deref().is_none_or(|rp| {
                VersionSpecifiers::from_str(rp)
                    .map(|s| s.contains(&python))
                    .unwrap_or(true)
            })
        };
        let fitting: Vec<&&IndexFile> = live.iter().copied().filter(fits_python).collect();
        if fitting.is_empty() {
            let rp = live
                .iter()
                .find_map(|f| f.requires_python.clone())
                .unwrap_or_default();
            candidates.unusable.push(Unusable {
                version,
                reason: format!(
                    "requires python {rp} (the env has {}.{})",
                    target.python.major, target.python.minor
                ),
                python_tags,
            });
            continue;
        }
        let best_wheel = if sdist_only {
            None
        } else {
            fitting
                .iter()
                .filter_map(|f| {
                    Some((
                        target.wheel_score(&WheelName::from_str(&f.filename).ok()?)?,
                        *f,
                    ))
                })
                .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.filename.cmp(&a.1.filename)))
                .map(|(_, f)| *f)
        };
        let sdist = fitting
            .iter()
            .find(|f| f.filename.ends_with(".tar.gz"))
            .or_else(|| fitting.iter().find(|f| f.filename.ends_with(".zip")))
            .map(|f| **f);
        match best_wheel.or(sdist) {
            Some(file) => {
                artifacts.insert(version.clone(), file.clone());
                candidates.usable.push(version);
            }
            None => {
                let reason = if sdist_only {
                    "has no sdist to build from".to_string()
                } else if python_tags.is_empty() {
                    format!("has no wheel for {} and no sdist", target.describe())
                } else {
                    format!(
                        "has no wheel for {} (it has {}) and no sdist",
                        target.describe(),
                        summarize_python_tags(python_tags.clone())
                    )
                };
                candidates.unusable.push(Unusable {
                    version,
                    reason,
                    python_tags,
                });
            }
        }
    }
    ProjectVersions {
        candidates: Arc::new(candidates),
        artifacts,
    }
}

/// `name==version` marked as having its metadata built for as long as this lives.
struct Building<'a> {
    set: &'a Mutex<BTreeSet<String>>,
    key: String,
}

impl<'a> Building<'a> {
    /// `None` when `key` is already being built further up this thread's (or another's) stack.
    fn enter(set: &'a Mutex<BTreeSet<String>>, key: &str) -> Option<Building<'a>> {
        let inserted = set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.to_string());
        inserted.then(|| Building {
            set,
            key: key.to_string(),
        })
    }
}

impl Drop for Building<'_> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 16 item 16: a panicking index task poisoned its shared future and the solver thread, waiting on
    /// another clone of it, hung forever. Now the panic is that task's error.
    #[test]
    fn a_panicking_task_is_an_error_for_every_waiter_not_a_hang() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let fut: BoxFuture<'static, Result<u32, Arc<IndexError>>> = async {
            tokio::task::yield_now().await;
            let offsets: Vec<u64> = vec![1];
            // What the range reader used to do with a lying central directory.
            let at = usize::try_from(offsets[0] + 40).unwrap();
            Ok(u32::from(offsets[at..].is_empty()))
        }
        .boxed();
        let shared = no_panic("http://127.0.0.1:9/files/x.whl".into(), fut).shared();
        // As the source does: one clone driven by a spawned task, another awaited by the solver thread.
        runtime.spawn(shared.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = shared.clone();
        let handle = runtime.handle().clone();
        std::thread::spawn(move || {
            let _ = tx.send(handle.block_on(waiter));
        });
        let result = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the waiter hung on a panicked task");
        let err = result.unwrap_err();
        assert!(
            matches!(&*err, IndexError::Panicked { url, .. } if url.ends_with("x.whl")),
            "{err}"
        );
        assert!(err.to_string().contains("out of range"), "{err}");
    }
}
