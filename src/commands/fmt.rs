//! `hvd fmt`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct FmtArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: FmtArgs) -> CommandResult {
    Err(super::not_implemented("fmt"))
}
