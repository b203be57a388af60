//! `hvd export`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: ExportArgs) -> CommandResult {
    Err(super::not_implemented("export"))
}
