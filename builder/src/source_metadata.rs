//! The resolver's [`SourceMetadataProvider`]: an sdist's metadata built by its own backend in the build sandbox.
//!
//! The build env (the sdist's locked build requirements on the lock's python) is a store path like any other;
//! the hook runs as a source build does (see [`crate::source_build`]): same sandbox, same cleared environment.

use std::path::PathBuf;

use hvd_resolver::source::{BoxError, SourceMetadataRequest};
use hvd_resolver::{SourceMetadataProvider, lockfile::ArtifactKind};

use crate::fetch::{Artifact, Fetcher};
use crate::plan::{BuildOptions, EnvPlan};
use crate::progress::NoProgress;
use crate::source_build::{self, SourceBuildRequest};
use crate::store::Store;

/// Builds sdist metadata with the store at `store_root` (opened on first use: a lock that meets no such sdist
/// never touches the store).
#[derive(Debug, Clone)]
pub struct SandboxedMetadata {
    store_root: PathBuf,
    offline: bool,
}

impl SandboxedMetadata {
    pub fn new(store_root: impl Into<PathBuf>, offline: bool) -> SandboxedMetadata {
        SandboxedMetadata {
            store_root: store_root.into(),
            offline,
        }
    }

    fn build(&self, request: &SourceMetadataRequest<'_>) -> crate::Result<Vec<u8>> {
        let store = Store::open(&self.store_root)?;
        // Held (shared) from before the build env exists until the hook is done: gc (exclusive) cannot remove the
        // build env, which no root names, in between.
        let _builders = store.lock_builders()?;
        let options = BuildOptions {
            offline: self.offline,
            ..BuildOptions::default()
        };
        let packages = request
            .build_packages
            .iter()
            .map(|p| crate::lockfile::package_plan(p, None))
            .collect::<crate::Result<Vec<_>>>()?;
        let plan = EnvPlan {
            name: format!("{}-metadata-build-env", request.name),
            python: request.python.to_string(),
            interpreter: None,
            packages,
            toolchain: None,
            local_packages: Vec::new(),
        };
        let build_env = crate::realize::build_env(&store, &plan, &options, &NoProgress)?;
        let sdist = Artifact {
            url: request.sdist.url.clone(),
            filename: request.sdist.filename.clone(),
            sha256: request.sdist.sha256.clone(),
            size: (request.sdist.size > 0).then_some(request.sdist.size),
        };
        let fetched = Fetcher::new(store.downloads_dir(), self.offline)
            .fetch_all(std::slice::from_ref(&sdist), &NoProgress)?;
        let dir_name = format!(
            "{}-{}-metadata-{}",
            request.name,
            request.version,
            &request.sdist.sha256.as_str()[..16]
        );
        // The same lock a derivation's build directory is held by: a second `hvd lock` of the same sdist waits
        // instead of removing this directory under the running hook, and gc's sweep of `.build` skips it.
        let _dir = store.lock_path(&dir_name)?;
        let build_dir = store.root().join(".build").join(&dir_name);
        let env = Default::default();
        let source = SourceBuildRequest {
            name: request.name,
            version: request.version,
            sdist: &fetched[0],
            sdist_filename: &request.sdist.filename,
            build_env: &build_env.env,
            env: &env,
            store: store.root(),
            toolchain: None,
            cuda: None,
        };
        let metadata = source_build::prepare_metadata(&source, &build_dir)?;
        crate::store::remove_tree(&build_dir)?;
        Ok(metadata)
    }
}

impl SourceMetadataProvider for SandboxedMetadata {
    fn metadata(&self, request: &SourceMetadataRequest<'_>) -> Result<Vec<u8>, BoxError> {
        if request.sdist.kind != ArtifactKind::Sdist {
            return Err(format!("`{}` is not an sdist", request.sdist.filename).into());
        }
        Ok(self.build(request)?)
    }
}
