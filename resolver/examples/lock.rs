//! Lock requirements for python 3.11 against the configured index and print the pins and timings:
//! `HVD_LOG=hvd_resolver=debug cargo run -p hvd-resolver --example lock -- tensorflow-cpu==2.12.1`.

use std::collections::BTreeMap;

use hvd_lang::model::{Env, PackageRequest};

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("HVD_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let env = Env {
        python: "3.11".into(),
        index: None,
        toolchain: None,
        packages: std::env::args()
            .skip(1)
            .map(|requirement| PackageRequest {
                requirement,
                build: None,
            })
            .collect(),
        variables: BTreeMap::new(),
    };
    let started = std::time::Instant::now();
    match hvd_resolver::lock_detailed(&env, &hvd_resolver::LockOptions::default()) {
        Ok(locked) => {
            for p in &locked.lockfile.packages {
                println!("{}=={} ({})", p.name, p.version, p.artifact.filename);
            }
            eprintln!(
                "{} packages in {:?}; {:?}",
                locked.lockfile.packages.len(),
                started.elapsed(),
                locked.stats
            );
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
