//! `hvd doctor`: report what this machine has for running hvd.

use clap::Args;

use crate::exit::{CommandResult, Status};

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print the findings as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: DoctorArgs) -> CommandResult {
    let probes = hvd_launcher::doctor::probes();
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&probes).unwrap_or_default()
        );
        return Ok(Status::Success);
    }
    let width = probes.iter().map(|p| p.name.len()).max().unwrap_or(0);
    for probe in &probes {
        let mark = if probe.found { "ok  " } else { "--  " };
        println!("{mark}{:width$}  {}", probe.name, probe.detail);
    }
    Ok(Status::Success)
}
