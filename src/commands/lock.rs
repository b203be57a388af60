//! `hvd lock`: resolve the env of a .hvd file into `FILE.lock` (docs/lockfile.md).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use hvd_resolver::{LockOptions, Lockfile, ResolveError};

use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct LockArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: PathBuf,

    /// Do not write; exit 3 when the lockfile is missing or no longer matches the file.
    #[arg(long)]
    pub check: bool,

    /// Ignore every existing pin and take the newest allowed versions.
    #[arg(long, conflicts_with = "check")]
    pub upgrade: bool,

    /// Ignore the existing pin of this package (repeatable).
    #[arg(
        long = "upgrade-package",
        value_name = "NAME",
        conflicts_with = "check"
    )]
    pub upgrade_package: Vec<String>,

    /// Use only the cache; never touch the network.
    #[arg(long)]
    pub offline: bool,

    /// Print a JSON summary on stdout (for CI).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: LockArgs) -> CommandResult {
    let project = super::check::load(&args.file)?;
    let lock_path = Lockfile::path_for(&args.file);
    let existing = if lock_path.exists() {
        match Lockfile::read(&lock_path) {
            Ok(lock) => Some(lock),
            // A newer schema must not be silently overwritten by an older hvd.
            Err(err @ hvd_resolver::LockfileError::NewerSchema { .. }) => {
                return Err(Failure::from_error(Status::Usage, &err));
            }
            Err(err) if args.check => {
                return Err(Failure::from_error(Status::LockStale, &err));
            }
            Err(err) => {
                tracing::warn!("ignoring unreadable lockfile: {err}");
                None
            }
        }
    } else {
        None
    };

    if args.check {
        return check(&args, &lock_path, existing, &project.env);
    }

    let progress = progress_bar(args.json);
    let on_fetch: Option<hvd_resolver::source::FetchCallback> = progress.clone().map(|bar| {
        let f: hvd_resolver::source::FetchCallback = Arc::new(move |name: &str| {
            bar.inc_length(1);
            bar.inc(1);
            bar.set_message(name.to_string());
        });
        f
    });
    let options = LockOptions {
        offline: args.offline,
        upgrade: args.upgrade,
        upgrade_packages: args.upgrade_package.clone(),
        existing: existing.clone(),
        on_fetch,
        source_metadata: Some(super::build::sdist_metadata_builder(args.offline)),
        ..LockOptions::default()
    };
    let result = hvd_resolver::lock_detailed(&project.env, &options);
    if let Some(bar) = &progress {
        bar.finish_and_clear();
    }
    let mut locked = result.map_err(resolve_failure)?;
    super::build::pin_interpreter(&mut locked.lockfile, &lock_path, args.upgrade)?;
    let text = locked.lockfile.to_toml();
    let unchanged = std::fs::read_to_string(&lock_path).is_ok_and(|old| old == text);
    if !unchanged {
        locked.lockfile.write(&lock_path).map_err(|e| {
            Failure::from_error_in(
                Status::Failure,
                format_args!("failed to write `{}`", lock_path.display()),
                &e,
            )
        })?;
    }
    for warning in &locked.warnings {
        eprintln!("warning: {warning}");
    }
    let changes = pin_changes(existing.as_ref(), &locked.lockfile);
    if args.json {
        let summary = serde_json::json!({
            "lockfile": lock_path.display().to_string(),
            "written": !unchanged,
            "index": locked.index_url,
            "packages": locked.lockfile.packages.len(),
            "builds": locked.lockfile.builds.len(),
            "changes": changes,
            "warnings": locked.warnings,
            "requests": locked.stats,
        });
        println!("{summary}");
    } else {
        let verb = if unchanged { "unchanged" } else { "wrote" };
        eprintln!(
            "{verb} {}: {} packages, {} source build{} ({} requests, {} revalidated, {} from cache)",
            lock_path.display(),
            locked.lockfile.packages.len(),
            locked.lockfile.builds.len(),
            if locked.lockfile.builds.len() == 1 {
                ""
            } else {
                "s"
            },
            locked.stats.requests,
            locked.stats.not_modified,
            locked.stats.cache_hits,
        );
        for change in &changes {
            eprintln!("  {change}");
        }
    }
    Ok(Status::Success)
}

fn check(
    args: &LockArgs,
    lock_path: &std::path::Path,
    existing: Option<Lockfile>,
    env: &hvd_lang::model::Env,
) -> CommandResult {
    let Some(lock) = existing else {
        if args.json {
            println!(
                "{}",
                serde_json::json!({"lockfile": lock_path.display().to_string(), "fresh": false, "changes": [{"field": "lockfile", "now": "(none)", "was": "(none)"}]})
            );
        }
        return Err(Failure::new(
            Status::LockStale,
            miette::miette!(
                help = "run `hvd lock`",
                "`{}` does not exist",
                lock_path.display()
            ),
        ));
    };
    match lock.check_against(env) {
        Ok(()) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"lockfile": lock_path.display().to_string(), "fresh": true, "changes": []})
                );
            } else {
                eprintln!("{} is up to date", lock_path.display());
            }
            Ok(Status::Success)
        }
        Err(staleness) => {
            if args.json {
                let changes: Vec<_> = staleness
                    .changes
                    .iter()
                    .map(|c| serde_json::json!({"field": c.field, "now": c.now, "was": c.was}))
                    .collect();
                println!(
                    "{}",
                    serde_json::json!({"lockfile": lock_path.display().to_string(), "fresh": false, "changes": changes})
                );
            }
            let lines: Vec<String> = staleness.changes.iter().map(|c| format!("  {c}")).collect();
            Err(Failure::new(
                Status::LockStale,
                miette::miette!(
                    help = "run `hvd lock` and commit the lockfile",
                    "`{}` is out of date:\n{}",
                    lock_path.display(),
                    lines.join("\n")
                ),
            ))
        }
    }
}

/// `+ name version`, `- name version`, `~ name old -> new` between two locks.
fn pin_changes(old: Option<&Lockfile>, new: &Lockfile) -> Vec<String> {
    let Some(old) = old else { return Vec::new() };
    let mut out = Vec::new();
    for p in &new.packages {
        match old.package(&p.name) {
            None => out.push(format!("+ {} {}", p.name, p.version)),
            Some(o) if o.version != p.version => {
                out.push(format!("~ {} {} -> {}", p.name, o.version, p.version));
            }
            Some(_) => {}
        }
    }
    for o in &old.packages {
        if new.package(&o.name).is_none() {
            out.push(format!("- {} {}", o.name, o.version));
        }
    }
    out
}

fn progress_bar(json: bool) -> Option<indicatif::ProgressBar> {
    if json || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} resolving: {pos} projects {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(Duration::from_millis(120));
    Some(bar)
}

fn resolve_failure(err: ResolveError) -> Failure {
    let status = match &err {
        ResolveError::Target(_)
        | ResolveError::NoSolution(_)
        | ResolveError::BadRequirement { .. }
        | ResolveError::Toolchain(_)
        | ResolveError::NoIndex(_) => Status::Usage,
        _ => Status::Failure,
    };
    // The whole cause chain: the URL is in the outer error, the network reason in the inner one.
    Failure::from_error_in(status, "failed to lock", &err)
}
