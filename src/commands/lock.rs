//! `hvd lock`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct LockArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: LockArgs) -> CommandResult {
    Err(super::not_implemented("lock"))
}
