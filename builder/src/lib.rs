//! The content-addressed store: derivations, fetch/verify/unpack, sandboxed builds, env assembly, gc.
//!
//! The CLI maps a lockfile onto an [`EnvPlan`] and calls [`build_env`]:
//!
//! ```no_run
//! use hvd_builder::{BuildOptions, EnvPlan, NoProgress, Store, build_env};
//! # fn plan() -> EnvPlan { unimplemented!() }
//! let store = Store::open(Store::default_root())?;
//! let built = build_env(&store, &plan(), &BuildOptions::default(), &NoProgress)?;
//! println!("{}", built.env.join("bin/python").display());
//! # Ok::<(), hvd_builder::Error>(())
//! ```
//!
//! Store layout and hashing: docs/store.md. Where to start reading: [`realize`] (the flow), [`store`] (atomic
//! paths and locks), [`derivation`] (what a hash covers).

// A library reports through its errors and `tracing`; only the `hvd` binary writes to the terminal.
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod cache;
pub mod cuda;
pub mod debian;
pub mod derivation;
pub mod env;
pub mod env_vars;
pub mod error;
pub mod fetch;
pub mod gc;
pub mod hash;
pub mod interpreter;
pub mod lockfile;
pub mod plan;
pub mod progress;
pub mod python;
pub mod realize;
pub mod source_build;
pub mod source_metadata;
pub mod store;
pub mod toolchain;
pub mod unpack;
pub mod wheel;

pub use error::{Error, Result};
pub use fetch::Artifact;
pub use hvd_resolver::Sha256;
pub use interpreter::{InterpreterPin, StoredPython};
pub use plan::{BuildOptions, EnvPlan, LocalPackage, PackagePlan, SourceBuildPlan};
pub use progress::{NoProgress, Progress};
pub use realize::{CheckOutcome, EnvBuild, PackageOutcome, build_env, build_env_with, check_env};
pub use store::Store;
pub use toolchain::Toolchain;
