//! Where a command that builds substitutes store paths from: the caches and trusted keys of `--cache`,
//! `--trusted-key`, `HVD_CACHES`, `HVD_TRUSTED_KEYS` and the file's `cluster { caches }` (`hvd build`, `exec`,
//! `shell`, `run` and `cache push` share these options).

use clap::Args;
use hvd_builder::cache::{PublicKey, Substituter};

use crate::exit::{Failure, Status};

/// Where `hvd build` (and `push`, when it builds) substitutes from.
#[derive(Debug, Clone, Default, Args)]
pub struct CacheOptions {
    /// A binary cache to substitute store paths from (`file:///dir`, `http(s)://...`, `s3://bucket/prefix`);
    /// repeatable, asked in order, before those of `HVD_CACHES` and the file's `cluster { caches }`.
    #[arg(long = "cache", value_name = "URL")]
    pub caches: Vec<String>,
    /// A public key whose signatures are trusted: a key file, or `NAME:BASE64`; repeatable, with `HVD_TRUSTED_KEYS`.
    #[arg(long = "trusted-key", value_name = "PUBKEYFILE|NAME:BASE64")]
    pub trusted_keys: Vec<String>,
}

impl CacheOptions {
    /// The cache URLs: the flags, then `HVD_CACHES` (space-separated), then the file's `cluster { caches }` (when
    /// there is a file).
    pub fn urls(&self, project: Option<&hvd_lang::model::Project>) -> Vec<String> {
        let mut urls = self.caches.clone();
        urls.extend(hvd_builder::cache::caches_from_env());
        if let Some(cluster) = project.and_then(|p| p.cluster.as_ref()) {
            urls.extend(cluster.caches.iter().cloned());
        }
        let mut seen = std::collections::BTreeSet::new();
        urls.retain(|url| seen.insert(url.clone()));
        urls
    }

    /// The substituter for these caches, `None` when there are none; `offline` keeps only directory caches.
    pub fn substituter(
        &self,
        project: Option<&hvd_lang::model::Project>,
        offline: bool,
    ) -> Result<Option<Substituter>, Failure> {
        let mut urls = self.urls(project);
        if offline {
            urls.retain(|url| {
                let local = url.starts_with("file://") || url.starts_with('/');
                if !local {
                    tracing::info!(
                        "--offline: not asking the cache {}",
                        hvd_builder::cache::backend::redact(url)
                    );
                }
                local
            });
        }
        if urls.is_empty() {
            return Ok(None);
        }
        let mut keys = self.trusted_keys.clone();
        keys.extend(hvd_builder::cache::trusted_keys_from_env());
        let from_user = self
            .caches
            .iter()
            .chain(&hvd_builder::cache::caches_from_env())
            .any(|url| urls.contains(url));
        if keys.is_empty() && !from_user {
            // Only the file names caches: the user did not ask for them, so no key is a reason to skip, not fail.
            eprintln!(
                "warning: not using the caches of the file's `cluster {{ caches }}` ({}): no trusted key is \
                 configured (give --trusted-key or HVD_TRUSTED_KEYS)",
                urls.iter()
                    .map(|url| hvd_builder::cache::backend::redact(url))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            return Ok(None);
        }
        let trusted = keys
            .iter()
            .map(|key| PublicKey::from_arg(key))
            .collect::<Result<Vec<_>, _>>()
            .map_err(cache_usage)?;
        Substituter::new(&urls, trusted)
            .map(Some)
            .map_err(cache_usage)
    }
}

impl CacheOptions {
    /// The trusted keys (flags, then `HVD_TRUSTED_KEYS`) as `NAME:BASE64` texts, for commands that run elsewhere (a
    /// key file here may not exist on a node).
    pub fn trusted_key_texts(&self) -> Result<Vec<String>, Failure> {
        let mut keys = self.trusted_keys.clone();
        keys.extend(hvd_builder::cache::trusted_keys_from_env());
        keys.iter()
            .map(|key| PublicKey::from_arg(key).map(|k| k.to_text()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(cache_usage)
    }
}

pub fn cache_usage(err: hvd_builder::cache::CacheError) -> Failure {
    Failure::from_error_with_help(
        Status::Usage,
        "cannot use the binary caches",
        &err,
        "see `hvd cache --help` and docs/store.md (\"Binary cache\")",
    )
}
