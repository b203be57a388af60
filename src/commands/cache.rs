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
