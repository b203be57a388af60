//! `hvd check`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: CheckArgs) -> CommandResult {
    Err(super::not_implemented("check"))
}
