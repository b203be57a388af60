//! One module per subcommand. Each has an `Args` struct (clap) and a `run` function.

pub mod bench;
pub mod build;
pub mod cache;
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
pub mod substitute;
pub mod why_depends;
