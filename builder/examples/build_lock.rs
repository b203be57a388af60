//! Build the env of a lockfile without the CLI (debugging the builder on its own):
//!
//!     cargo run -p hvd-builder --example build_lock -- train.hvd.lock [--check]
//!
//! Uses `$HVD_STORE` like `hvd build`; prints the env path.

use std::path::PathBuf;

use hvd_builder::{BuildOptions, NoProgress, Store};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: build_lock LOCKFILE [--check]")?);
    let check = args.next().as_deref() == Some("--check");
    let lock = hvd_resolver::Lockfile::read(&path)?;
    let plan = hvd_builder::lockfile::plan_from_lockfile(&lock, "example")?;
    let store = Store::open(Store::default_root())?;
    let options = BuildOptions {
        locked: true,
        ..BuildOptions::default()
    };
    if check {
        for outcome in hvd_builder::check_env(&store, &plan, &options, &NoProgress)? {
            println!(
                "{} {}: {} differing file(s) {:?}",
                outcome.name,
                outcome.version,
                outcome.differing.len(),
                outcome.differing
            );
        }
        return Ok(());
    }
    let start = std::time::Instant::now();
    let built = hvd_builder::build_env(&store, &plan, &options, &NoProgress)?;
    eprintln!(
        "{} packages, {} built, in {:?}",
        built.packages.len(),
        built.packages.iter().filter(|p| p.built).count(),
        start.elapsed()
    );
    println!("{}", built.env.display());
    Ok(())
}
