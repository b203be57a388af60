//! `hvd run`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: RunArgs) -> CommandResult {
    Err(super::not_implemented("run"))
}
