//! `hvd shell`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct ShellArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: ShellArgs) -> CommandResult {
    Err(super::not_implemented("shell"))
}
