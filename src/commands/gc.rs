//! `hvd gc`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct GcArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: GcArgs) -> CommandResult {
    Err(super::not_implemented("gc"))
}
