//! `hvd why-depends FILE PACKAGE`: the dependency chain from a requested package to PACKAGE, from the lockfile;
//! `python` names the env's interpreter, a store path the env references.

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
    if args.package.eq_ignore_ascii_case("python") && lock.package("python").is_none() {
        return interpreter(&args, &lock);
    }
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

/// `env -> python`: the interpreter store path the built env references (read from the store), else the lock's pin.
fn interpreter(args: &WhyDependsArgs, lock: &Lockfile) -> CommandResult {
    let link = super::build::root_link(&args.file);
    let store = hvd_builder::Store::open(hvd_builder::Store::default_root()).ok();
    let from_store = store.as_ref().and_then(|store| {
        let env = std::fs::canonicalize(&link).ok()?;
        let info = store.path_info(&env).ok()?;
        let env_name = env.file_name()?.to_string_lossy().into_owned();
        info.references.iter().find_map(|name| {
            let path = store.root().join(name);
            let python = hvd_builder::StoredPython::from_path(store, &path).ok()?;
            Some(format!(
                "{env_name} -> python {} ({})",
                python.version,
                python.path.display()
            ))
        })
    });
    if let Some(chain) = from_store {
        println!("{chain}");
        return Ok(Status::Success);
    }
    match &lock.target.installation {
        Some(pin) => {
            let path =
                hvd_builder::interpreter::derivation(&pin.version, &pin.content_hash).path_name();
            println!("env -> python {} ({path}, not built here yet)", pin.version);
            Ok(Status::Success)
        }
        None => Err(Failure::new(
            Status::Failure,
            miette::miette!(
                help = "run `hvd build` (or `hvd lock`, which pins the interpreter)",
                "the env of `{}` is not built and its lock does not pin an interpreter",
                args.file.display()
            ),
        )),
    }
}
