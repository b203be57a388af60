//! `hvd graph`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct GraphArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: GraphArgs) -> CommandResult {
    Err(super::not_implemented("graph"))
}
