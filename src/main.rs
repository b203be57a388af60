//! The `hvd` command-line tool: one declarative file to a reproducible, distributed training run.
//!
//! This binary only parses arguments, calls into the library crates and renders their results; see
//! ARCHITECTURE.md for the crate map. Each subcommand lives in `src/commands/<name>.rs` with its own
//! argument struct, so commands can grow without touching each other.

mod commands;
mod env_vars;
mod exit;
mod runtime;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::exit::Status;

/// Turn one declarative file into a reproducible, distributed training run.
#[derive(Debug, Parser)]
#[command(name = "hvd", version, about, propagate_version = true)]
struct Cli {
    /// More output (repeat for more); also settable with `HVD_LOG=debug`.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a starter `train.hvd` and training script.
    Init(commands::init::InitArgs),
    /// Validate a .hvd file; `--json` prints the evaluated model.
    Check(commands::check::CheckArgs),
    /// Format a .hvd file in the canonical layout.
    Fmt(commands::fmt::FmtArgs),
    /// Resolve the env into `FILE.lock`.
    Lock(commands::lock::LockArgs),
    /// Build the locked env into the store.
    Build(commands::build::BuildArgs),
    /// Binary caches: signing keys and pushing an env's closure (`hvd build --cache` substitutes from them).
    Cache(commands::cache::CacheArgs),
    /// Open a shell inside the built env.
    Shell(commands::shell::ShellArgs),
    /// Run a command inside the built env.
    Exec(commands::exec::ExecArgs),
    /// Run the step graph.
    Run(Box<commands::run::RunArgs>),
    /// Print the step graph.
    Graph(commands::graph::GraphArgs),
    /// Export the project for another system (e.g. Kubernetes manifests).
    Export(commands::export::ExportArgs),
    /// Remove store paths that no project root reaches.
    Gc(commands::gc::GcArgs),
    /// Show why the env depends on a package.
    WhyDepends(commands::why_depends::WhyDependsArgs),
    /// Benchmarks of the collective runtime.
    Bench(commands::bench::BenchArgs),
    /// Report what this machine has for running hvd.
    Doctor(commands::doctor::DoctorArgs),
    /// The worker shim engines run in front of each rank (maps MPI/Slurm/Kubernetes ranks to HVD_*).
    #[command(hide = true)]
    WorkerEnv(commands::run::WorkerEnvArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            // clap prints help and version to stdout with exit 0; usage errors exit 2 like ours.
            let _ = err.print();
            return ExitCode::from(if err.use_stderr() {
                Status::Usage.code()
            } else {
                0
            });
        }
    };
    init_tracing(cli.verbose);
    let result = match cli.command {
        Command::Init(args) => commands::init::run(args),
        Command::Check(args) => commands::check::run(args),
        Command::Fmt(args) => commands::fmt::run(args),
        Command::Lock(args) => commands::lock::run(args),
        Command::Build(args) => commands::build::run(args),
        Command::Cache(args) => commands::cache::run(args),
        Command::Shell(args) => commands::shell::run(args),
        Command::Exec(args) => commands::exec::run(args),
        Command::Run(args) => commands::run::run(*args, cli.verbose),
        Command::Graph(args) => commands::graph::run(args),
        Command::Export(args) => commands::export::run(args),
        Command::Gc(args) => commands::gc::run(args),
        Command::WhyDepends(args) => commands::why_depends::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Doctor(args) => commands::doctor::run(args),
        Command::WorkerEnv(args) => commands::run::worker_env(args),
    };
    match result {
        Ok(status) => ExitCode::from(status.code()),
        Err(failure) => {
            // Not eprintln!: it panics when stderr is closed, and the exit code must survive that.
            let _ = writeln!(std::io::stderr(), "{:?}", failure.report);
            ExitCode::from(failure.status.code())
        }
    }
}

fn init_tracing(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter =
        EnvFilter::try_from_env(env_vars::HVD_LOG).unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
