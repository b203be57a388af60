//! Package index client, PEP 440/508 and wheel tags, PubGrub solver, and the lockfile.
//!
//! Start reading at [`lockfile`] (the data this crate produces) and [`lock`] (the entry point).
//!
//! ```no_run
//! # use hvd_lang::model::Env;
//! # fn demo(env: &Env) -> Result<(), Box<dyn std::error::Error>> {
//! use std::path::Path;
//! use hvd_resolver::lockfile::Lockfile;
//! let lock = Lockfile::read(Path::new("train.hvd.lock"))?;
//! lock.check_against(env)?; // Err(Staleness) names each field that changed
//! # Ok(()) }
//! ```

pub mod lockfile;

pub use lockfile::{Lockfile, LockfileError, Staleness};
