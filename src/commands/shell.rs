//! `hvd shell FILE`: an interactive shell inside the built env.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use clap::Args;

use super::build::{LockMode, ensure_env};
use crate::env_vars;
use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct ShellArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: PathBuf,
    #[command(flatten)]
    pub lock: LockMode,
}

pub fn run(args: ShellArgs) -> CommandResult {
    let ready = ensure_env(&args.file, args.lock, false)?;
    let shell = std::env::var(env_vars::SHELL)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "/bin/sh".into());
    // The temporary gc root's descriptor stays open in the shell: its env outlives any `hvd gc` while it runs.
    ready.temp_root.keep_across_exec().map_err(|err| {
        Failure::from_error_in(Status::Failure, "failed to keep the env rooted", &err)
    })?;
    eprintln!(
        "entering {} (exit the shell to leave)",
        ready.build.env.display()
    );
    let err = std::process::Command::new(&shell)
        .envs(ready.variables())
        .env(env_vars::HVD_ENV, &ready.build.env)
        .env_remove(env_vars::PYTHONHOME)
        .exec();
    Err(Failure::from_error_in(
        Status::Failure,
        format_args!("failed to start `{shell}`"),
        &err,
    ))
}
