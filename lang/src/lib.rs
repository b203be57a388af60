//! The `.hvd` language: parser (nom, byte spans), evaluator, typed model, diagnostics (miette), formatter.
//!
//! Downstream crates use [`load_file`] and the types in [`model`]; nothing else here is a contract.

pub mod model;

use std::path::Path;

/// Every problem found while loading a file (several per run), renderable with miette.
///
/// Placeholder until the evaluator lands: it keeps the signature that downstream crates call.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
#[error("{message}")]
pub struct Diagnostics {
    message: String,
}

/// Parse and evaluate a `.hvd` file (and what it imports) into the typed model.
pub fn load_file(path: &Path) -> Result<model::Project, Diagnostics> {
    Err(Diagnostics { message: format!("cannot evaluate `{}`: the evaluator is not built yet", path.display()) })
}
