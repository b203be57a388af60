//! `hvd init`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct InitArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: InitArgs) -> CommandResult {
    Err(super::not_implemented("init"))
}
