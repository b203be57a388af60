//! `hvd gc [--dry-run]`: remove store paths that no project's `.hvd/env` link and no running `hvd run`/`exec`/`shell`
//! reaches.

use clap::Args;
use hvd_builder::Store;

use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct GcArgs {
    /// Only report what would be removed.
    #[arg(long)]
    pub dry_run: bool,
}

pub fn run(args: GcArgs) -> CommandResult {
    let fail = |err: hvd_builder::Error| {
        Failure::from_error_in(Status::Failure, "failed to collect garbage", &err)
    };
    let store = Store::open(Store::default_root()).map_err(fail)?;
    let report = hvd_builder::gc::collect_garbage(&store, args.dry_run).map_err(fail)?;
    let verb = if args.dry_run {
        "would remove"
    } else {
        "removed"
    };
    for name in &report.dead {
        println!("{verb} {}", store.root().join(name).display());
    }
    eprintln!(
        "{verb} {} store path(s), {:.1} MiB; {} live ({} kept by running processes)",
        report.dead.len(),
        report.bytes as f64 / (1024.0 * 1024.0),
        report.live.len(),
        report.temp_roots
    );
    Ok(Status::Success)
}
