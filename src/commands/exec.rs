//! `hvd exec FILE -- CMD...`: run a command inside the built env (building it first if needed).

use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use clap::Args;

use super::build::{LockMode, ensure_env};
use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: PathBuf,
    #[command(flatten)]
    pub lock: LockMode,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

pub fn run(args: ExecArgs) -> CommandResult {
    let ready = ensure_env(&args.file, args.lock, false)?;
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| Failure::usage("no command given after `--`"))?;
    // The temporary gc root's descriptor stays open in the command: its env outlives any `hvd gc` while it runs.
    ready.temp_root.keep_across_exec().map_err(|err| {
        Failure::from_error_in(Status::Failure, "failed to keep the env rooted", &err)
    })?;
    let mut command = std::process::Command::new(program);
    command
        .args(rest)
        .envs(ready.variables())
        .env_remove(crate::env_vars::PYTHONHOME);
    // Replace this process, so signals and the exit status are the command's own.
    let err = command.exec();
    Err(Failure::from_error_in(
        Status::Failure,
        format_args!("failed to run `{program}`"),
        &err,
    ))
}
