//! `hvd cache keygen` and `hvd cache push`: signing keys and uploading an env's closure to a binary cache.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use hvd_builder::cache::{Cache, SecretKey};

use super::build::{LockMode, TerminalProgress, build_failure, ensure_env_with};
use super::substitute::{CacheOptions, cache_usage};
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
    /// Make store paths valid here from the caches, by name, with everything they reference (what a node does before
    /// its ranks start: no project file, lock or package index needed). Prints each path.
    Pull(PullArgs),
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

#[derive(Debug, Args)]
struct PullArgs {
    /// Store paths to get: a name (`<hash>-<name>-<version>`) or a path in this store (`$HVD_STORE/<name>`).
    #[arg(required = true, value_name = "PATH")]
    paths: Vec<String>,
    /// The store to pull into (default `HVD_STORE`, else the user's data dir): a store path is valid only in the
    /// store directory it was built for.
    #[arg(long, value_name = "DIR")]
    store: Option<std::path::PathBuf>,
    #[command(flatten)]
    caches: CacheOptions,
}

pub fn run(args: CacheArgs) -> CommandResult {
    match args.command {
        CacheCommand::Keygen(args) => keygen(args),
        CacheCommand::Push(args) => push(args),
        CacheCommand::Pull(args) => pull(args),
    }
}

fn pull(args: PullArgs) -> CommandResult {
    let root = args
        .store
        .clone()
        .unwrap_or_else(hvd_builder::Store::default_root);
    let store = hvd_builder::Store::open(root).map_err(build_failure)?;
    let mut names = Vec::new();
    for given in &args.paths {
        let path = std::path::Path::new(given);
        let name = if path.components().count() > 1 {
            if path.parent() != Some(store.root()) {
                return Err(Failure::usage(format!(
                    "`{given}` is not a path in this store ({}); give the store path's name, or set HVD_STORE to \
                     the store it belongs to (a store path is only valid at the store directory it was built for)",
                    store.root().display()
                )));
            }
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        } else {
            given.clone()
        };
        hvd_builder::cache::record::check_path_name(&name).map_err(|message| {
            Failure::usage(format!(
                "`hvd cache pull`: not a store path name: {message}"
            ))
        })?;
        names.push(name);
    }
    let Some(substituter) = args.caches.substituter(None, false)? else {
        return Err(Failure::usage(
            "no cache to pull from: give `--cache URL` (or HVD_CACHES) and `--trusted-key` (or HVD_TRUSTED_KEYS)",
        ));
    };
    let progress = TerminalProgress::new();
    // Held (shared) for the whole pull, as a build holds it: `hvd gc` (exclusive) waits until every printed path is
    // installed with its closure, instead of deleting a reference installed first (nothing roots it yet).
    let _builders = store.lock_builders().map_err(build_failure)?;
    for name in &names {
        let found = substituter
            .substitute_path_name(&store, name, &progress)
            .map_err(build_failure)?;
        if !found {
            let caches: Vec<String> = substituter
                .caches()
                .iter()
                .map(|url| hvd_builder::cache::backend::redact(url))
                .collect();
            return Err(Failure::new(
                Status::Failure,
                miette::miette!(
                    "{name} is in none of the caches ({}) with a signature by a trusted key, nor is everything it \
                     references: push it from a machine that has it (`hvd cache push`), or check --cache and \
                     --trusted-key",
                    caches.join(", ")
                ),
            ));
        }
        println!("{}", store.root().join(name).display());
    }
    Ok(Status::Success)
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
