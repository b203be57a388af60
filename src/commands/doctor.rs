//! `hvd doctor`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: DoctorArgs) -> CommandResult {
    Err(super::not_implemented("doctor"))
}
