//! `hvd bench`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: BenchArgs) -> CommandResult {
    Err(super::not_implemented("bench"))
}
