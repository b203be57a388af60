//! `hvd build`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct BuildArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: BuildArgs) -> CommandResult {
    Err(super::not_implemented("build"))
}
