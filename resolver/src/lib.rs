//! Package index client, PEP 440/508 and wheel tags, PubGrub solver, and the lockfile.
//!
//! Start reading at [`lockfile`] (the data this crate produces) and [`lock()`] (the entry point):
//! `lock` builds a [`tags::TargetSpec`], asks the [`index`] for project pages through a [`source::IndexSource`]
//! (which prefetches concurrently and caches on disk), runs the PubGrub [`solver`], and records the result.
//! The resolver never builds: sdists without static metadata go through [`SourceMetadataProvider`].
//!
//! ```no_run
//! # use hvd_lang::model::Env;
//! # fn demo(env: &Env) -> Result<(), Box<dyn std::error::Error>> {
//! use std::path::Path;
//! use hvd_resolver::{LockOptions, Lockfile};
//! let lock = hvd_resolver::lock(env, &LockOptions::default())?;
//! lock.write(Path::new("train.hvd.lock"))?;
//! let again = Lockfile::read(Path::new("train.hvd.lock"))?;
//! again.check_against(env)?; // Err(Staleness) names each field that changed
//! # Ok(()) }
//! ```

// A library reports through its errors and `tracing`; only the `hvd` binary writes to the terminal.
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod deadline;
pub mod debian;
pub mod digest;
pub mod env_vars;
pub mod index;
pub mod lock;
pub mod lockfile;
pub mod metadata;
pub mod names;
mod pip_config;
pub mod solver;
pub mod source;
pub mod tags;
pub mod temp_files;
#[cfg(feature = "testing")]
pub mod testing;

pub use digest::Sha256;
pub use lock::{LockOptions, LockStats, Locked, ResolveError, lock, lock_detailed};
pub use lockfile::{Lockfile, LockfileError, Staleness};
pub use source::{BoxError, SourceMetadataProvider, SourceMetadataRequest};
