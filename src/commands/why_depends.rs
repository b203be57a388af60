//! `hvd why-depends`.

use clap::Args;

use crate::exit::CommandResult;

#[derive(Debug, Args)]
pub struct WhyDependsArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,
}

pub fn run(_args: WhyDependsArgs) -> CommandResult {
    Err(super::not_implemented("why-depends"))
}
