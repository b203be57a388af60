//! `hvd why-depends FILE PACKAGE`: the dependency chain from a requested package to PACKAGE, from the lockfile.

use clap::Args;
use hvd_resolver::Lockfile;

use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct WhyDependsArgs {
    /// The .hvd file (its lockfile is read).
    pub file: std::path::PathBuf,
    /// The package to explain.
    pub package: String,
}

pub fn run(args: WhyDependsArgs) -> CommandResult {
    let path = Lockfile::path_for(&args.file);
    let lock = Lockfile::read(&path).map_err(|err| {
        Failure::from_error_with_help(
            Status::Usage,
            format_args!("failed to read `{}`", path.display()),
            &err,
            "run `hvd lock` first",
        )
    })?;
    match hvd_builder::lockfile::why_depends(&lock, &args.package) {
        Some(chain) => {
            let shown: Vec<String> = chain
                .iter()
                .map(|name| match lock.package(name) {
                    Some(package) => format!("{name} {}", package.version),
                    None => name.clone(),
                })
                .collect();
            println!("{}", shown.join(" -> "));
            Ok(Status::Success)
        }
        None => Err(Failure::new(
            Status::Failure,
            miette::miette!(
                "the env of `{}` does not depend on `{}`",
                args.file.display(),
                args.package
            ),
        )),
    }
}
