//! `hvd exec`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: ExecArgs) -> CommandResult {
    Err(super::not_implemented("exec"))
}
