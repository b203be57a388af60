//! Step graph, run engines, rendezvous, log multiplexing and failure handling: everything `hvd run` does after the
//! .hvd file is evaluated.
//!
//! - [`run`]: chooses the engine of a run ([`prepare`], [`run`]) from the project and the [`RunOptions`].
//! - [`controller`]: which controllers (gloo, MPI) the env's Horovod talks to, and the engine that follows.
//! - [`engine`]: the engine interface (a supervised engine, or one that owns the whole run) and the [`Plan`].
//! - [`engines`]: one module per engine.
//! - [`graph`]: the step graph (petgraph) and the [`Plan`] built from it.
//! - [`supervisor`]: the local supervisor that executes a plan ([`execute`]).
//! - [`report`]: the [`Event`]s every engine reports during a run and the [`RunReport`] at its end.
//! - [`env`]: the worker environment contract (every variable a worker gets).
//! - [`rendezvous`]: the key-value server every job's workers meet at (protocol in docs/rendezvous.md).
//! - [`process`]: process groups, parent-death handling, the watchdog, the launcher's own signals.
//! - [`state`]: input hashing for skipping unchanged steps.
//! - [`untrusted`]: small files someone else wrote (a rank's report, a pod's note), read as hostile.
//! - [`doctor`]: what this machine offers (`hvd doctor`).
//!
//! ```no_run
//! use hvd_launcher::{Interrupts, RunOptions, execute, plan};
//! # fn demo(project: &hvd_lang::model::Project) -> Result<(), hvd_launcher::LaunchError> {
//! let options = RunOptions { workers: Some(4), ..RunOptions::default() };
//! let plan = plan(project, &options)?;
//! print!("{}", plan.render());
//! let report = execute(&plan, &options, &|event| eprintln!("{event:?}"), Interrupts::none())?;
//! assert!(report.failure.is_none());
//! # Ok(()) }
//! ```

// A library reports through its errors and `tracing`; only the `hvd` binary writes to the terminal.
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod closure;
pub mod controller;
pub mod discovery;
pub mod doctor;
pub mod engine;
pub mod engines;
pub mod env;
pub mod env_vars;
pub mod glibc;
pub mod graph;
pub mod options;
pub mod process;
pub mod rendezvous;
pub mod report;
pub mod run;
pub mod state;
pub mod supervisor;
pub mod untrusted;

pub use engine::{Plan, PlannedStep};
pub use graph::StepGraph;
pub use options::RunOptions;
pub use process::Interrupts;
pub use report::{Cause, Event, EventSink, FailureSummary, RunReport, Stream, WorkerExit};
pub use run::{Run, plan, prepare, run};
pub use supervisor::execute;

use std::path::PathBuf;

/// Why a run could not be planned or carried out (a failing worker is not an error: see [`RunReport::failure`]).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("step `{step}` needs `{need}`, which is not a step of this file")]
    UnknownNeed { step: String, need: String },
    #[error("no step named `{name}` (steps: {})", known.join(", "))]
    UnknownStep { name: String, known: Vec<String> },
    #[error("two steps are named `{0}`")]
    DuplicateStep(String),
    #[error("the steps' `needs` form a cycle through `{0}`")]
    Cycle(String),
    #[error("{0}")]
    Engine(String),
    #[error("step `{0}` has 0 workers; use at least 1")]
    ZeroWorkers(String),
    #[error(
        "step `{step}` is elastic with a minimum of {min} workers but starts only {max}; the minimum must not \
         exceed the workers it starts with (`--min-workers`, `--max-workers`, `workers = {{ min, max }}`)"
    )]
    ElasticRange { step: String, min: u32, max: u32 },
    #[error(
        "steps `{first}` and `{second}` keep their checkpoints at the same place, `{}`: each step's writes would \
         prune the other's; give each step its own `checkpoints`", dir.display()
    )]
    SharedCheckpoints {
        dir: PathBuf,
        first: String,
        second: String,
    },
    #[error("failed to start rank {rank} of step `{step}`: cannot run `{program}`")]
    Spawn {
        step: String,
        rank: u32,
        /// The program that did not start (`srun`, `ssh`, the step's shell).
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to access `{path}`")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to create `{path}`")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to write `{path}`")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot use network interface `{name}`")]
    Interface {
        name: String,
        #[source]
        source: hvd_collective::Error,
    },
    #[error(transparent)]
    Rendezvous(#[from] rendezvous::RendezvousError),
    #[error(transparent)]
    Controller(#[from] controller::Mismatch),
    #[error("internal error: {0}")]
    Internal(&'static str),
}
