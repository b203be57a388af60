//! `hvd graph`: print the step graph of a .hvd file as Graphviz dot or Mermaid.

use std::fmt::Write as _;

use clap::{Args, ValueEnum};
use hvd_lang::model::{Project, Step};

use crate::exit::{CommandResult, Status};

#[derive(Debug, Args)]
pub struct GraphArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,

    /// Output format.
    #[arg(long, value_enum, default_value_t = GraphFormat::Dot)]
    pub format: GraphFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum GraphFormat {
    /// Graphviz (`hvd graph | dot -Tsvg > graph.svg`).
    Dot,
    /// Mermaid flowchart (renders in Markdown on most forges).
    Mermaid,
}

pub fn run(args: GraphArgs) -> CommandResult {
    let project = super::check::load(&args.file)?;
    let text = match args.format {
        GraphFormat::Dot => dot(&project),
        GraphFormat::Mermaid => mermaid(&project),
    };
    print!("{text}");
    Ok(Status::Success)
}

fn label(step: &Step) -> String {
    match step.workers {
        Some(1) => format!("{} (1 worker)", step.name),
        Some(n) => format!("{} ({n} workers)", step.name),
        None => step.name.clone(),
    }
}

fn escape(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"")
}

fn dot(project: &Project) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph \"{}\" {{", escape(&project.name));
    let _ = writeln!(out, "  rankdir=LR;");
    let _ = writeln!(out, "  node [shape=box];");
    for step in &project.steps {
        let _ = writeln!(
            out,
            "  \"{}\" [label=\"{}\"];",
            escape(&step.name),
            escape(&label(step))
        );
    }
    for step in &project.steps {
        for need in &step.needs {
            let _ = writeln!(out, "  \"{}\" -> \"{}\";", escape(need), escape(&step.name));
        }
    }
    out.push_str("}\n");
    out
}

fn mermaid(project: &Project) -> String {
    let mut out = String::from("flowchart LR\n");
    // Step names are identifiers ([A-Za-z0-9_-]), valid Mermaid node ids as they are.
    for step in &project.steps {
        let _ = writeln!(
            out,
            "  {}[\"{}\"]",
            step.name,
            label(step).replace('"', "#quot;")
        );
    }
    for step in &project.steps {
        for need in &step.needs {
            let _ = writeln!(out, "  {need} --> {}", step.name);
        }
    }
    out
}
