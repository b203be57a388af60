//! One module per subcommand. Each has an `Args` struct (clap) and a `run` function.

pub mod bench;
pub mod build;
pub mod check;
pub mod doctor;
pub mod exec;
pub mod export;
pub mod fmt;
pub mod gc;
pub mod graph;
pub mod init;
pub mod lock;
pub mod run;
pub mod shell;
pub mod why_depends;

use crate::exit::Failure;

/// The failure every command returns until it is built: exit code 2 and a clear message.
pub fn not_implemented(command: &str) -> Failure {
    Failure::usage(format!("`hvd {command}` is not implemented yet"))
}
