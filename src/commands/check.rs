//! `hvd check`: parse and evaluate a .hvd file; report every error, or a summary (or the model as JSON).

use clap::Args;

use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,

    /// Print the evaluated model as JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: CheckArgs) -> CommandResult {
    let project = load(&args.file)?;
    if args.json {
        let json = serde_json::to_string_pretty(&project).map_err(|e| {
            Failure::from_error_in(Status::Failure, "failed to serialize the model", &e)
        })?;
        println!("{json}");
        return Ok(Status::Success);
    }
    let builds = project
        .env
        .packages
        .iter()
        .filter(|p| p.build.is_some())
        .count();
    let distributed = project.steps.iter().filter(|s| s.workers.is_some()).count();
    println!(
        "ok: {} (project `{}`): python {}, {} package{} ({} built from source), {} step{} ({} distributed)",
        args.file.display(),
        project.name,
        project.env.python,
        project.env.packages.len(),
        plural(project.env.packages.len()),
        builds,
        project.steps.len(),
        plural(project.steps.len()),
        distributed,
    );
    Ok(Status::Success)
}

/// Load a .hvd file for a command; every error in it becomes one usage failure (exit 2).
pub fn load(file: &std::path::Path) -> Result<hvd_lang::model::Project, Failure> {
    hvd_lang::load_file(file)
        .map_err(|diagnostics| Failure::new(Status::Usage, miette::Report::new(diagnostics)))
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}
