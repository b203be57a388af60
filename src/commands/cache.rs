//! `hvd cache keygen` and `hvd cache push`: signing keys and uploading an env's closure to a binary cache; the
//! caches and trusted keys `hvd build` substitutes from (`--cache`, `--trusted-key`, `HVD_CACHES`,
//! `HVD_TRUSTED_KEYS`).

use std::path::PathBuf;

use clap::{Args, Subcommand};
use hvd_builder::cache::{Cache, PublicKey, SecretKey, Substituter};

use super::build::{LockMode, TerminalProgress, build_failure, ensure_env_with};
use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct CacheArgs {
    #[command(subcommand)]
    command: CacheCommand,
}

#[derive(Debug, Subcommand)]
enum CacheCommand {
    /// Write a new signing key pair: `DIR/NAME.secret` (mode 0600, keep it private) and `DIR/NAME.public`.
    Keygen(KeygenArgs),
    /// Upload the closure of FILE's built env (the env and every path it references) into a cache, signed.
    Push(PushArgs),
}

#[derive(Debug, Args)]
struct KeygenArgs {
    /// The key's name; signatures carry it (letters, digits, `.`, `_`, `-`).
    name: String,
    /// Where to write the two files.
    #[arg(long, default_value = ".")]
    out: PathBuf,
}

#[derive(Debug, Args)]
struct PushArgs {
    /// The .hvd file whose env to push (built first when needed).
    #[arg(default_value = "train.hvd")]
    file: PathBuf,
    /// The cache: `file:///dir` or `/dir`, or `s3://bucket/prefix`; default: the first `--cache`, then the
    /// first of `HVD_CACHES`; never the file's `cluster { caches }` (a project file does not choose where a push goes).
    #[arg(long, value_name = "URL")]
    to: Option<String>,
    /// The secret key file to sign with (`hvd cache keygen`).
    #[arg(long, value_name = "SECRETKEYFILE")]
    key: PathBuf,
    #[command(flatten)]
    lock: LockMode,
    #[command(flatten)]
    caches: CacheOptions,
}

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
    /// The cache URLs: the flags, then `HVD_CACHES` (space-separated), then the file's `cluster { caches }`.
    pub fn urls(&self, project: &hvd_lang::model::Project) -> Vec<String> {
        let mut urls = self.caches.clone();
        urls.extend(hvd_builder::cache::caches_from_env());
        if let Some(cluster) = &project.cluster {
            urls.extend(cluster.caches.iter().cloned());
        }
        let mut seen = std::collections::BTreeSet::new();
        urls.retain(|url| seen.insert(url.clone()));
        urls
    }

    /// The substituter for these caches, `None` when there are none; `offline` keeps only directory caches.
    pub fn substituter(
        &self,
        project: &hvd_lang::model::Project,
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

fn cache_usage(err: hvd_builder::cache::CacheError) -> Failure {
    Failure::from_error_with_help(
        Status::Usage,
        "cannot use the binary caches",
        &err,
        "see `hvd cache --help` and docs/store.md (\"Binary cache\")",
    )
}

pub fn run(args: CacheArgs) -> CommandResult {
    match args.command {
        CacheCommand::Keygen(args) => keygen(args),
        CacheCommand::Push(args) => push(args),
    }
}

fn keygen(args: KeygenArgs) -> CommandResult {
    let (secret, public) =
        hvd_builder::cache::key::write_key_pair(&args.name, &args.out).map_err(cache_usage)?;
    eprintln!(
        "wrote the secret key {} (keep it private: it signs what `hvd cache push` uploads) and the public key {} \
         (give it to `hvd build --trusted-key`)",
        secret.display(),
        public.display()
    );
    println!("{}", public.display());
    Ok(Status::Success)
}

fn push(args: PushArgs) -> CommandResult {
    let key = SecretKey::read(&args.key).map_err(cache_usage)?;
    // The destination comes from the user's command line or environment only: a project file (perhaps from
    // someone else's pull request) must not choose where the env and this key's signatures go.
    let url = match args.to.clone().or_else(|| {
        args.caches
            .caches
            .first()
            .cloned()
            .or_else(|| hvd_builder::cache::caches_from_env().into_iter().next())
    }) {
        Some(url) => url,
        None => {
            return Err(Failure::usage(
                "no cache to push to: give `--to URL` (or `--cache URL` or HVD_CACHES); \
                 the file's `cluster { caches }` is never a push destination",
            ));
        }
    };
    let ready = ensure_env_with(&args.file, args.lock, false, &args.caches)?;
    let cache = Cache::parse(&url).map_err(cache_usage)?;
    let store =
        hvd_builder::Store::open(hvd_builder::Store::default_root()).map_err(build_failure)?;
    let env_name = ready
        .build
        .env
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let progress = TerminalProgress::new();
    let report =
        hvd_builder::cache::push(&store, &[env_name], &cache, &key, &progress).map_err(|err| {
            Failure::from_error_with_help(
                Status::Failure,
                format_args!("failed to push to `{}`", cache.url()),
                &err,
                "run with -v for details",
            )
        })?;
    progress.clear();
    eprintln!(
        "pushed {} store path(s) to {} ({} already there), signed by `{}`",
        report.pushed.len(),
        cache.url(),
        report.skipped.len(),
        key.name()
    );
    for name in &report.pushed {
        println!("{name}");
    }
    Ok(Status::Success)
}
