//! The `.hvd` language: parser (nom, byte spans), evaluator, typed model, diagnostics (miette), formatter.
//!
//! Downstream crates use [`load_file`] and the types in [`model`]; the CLI also uses [`format_source`].
//! Tests and the fuzz target read programs from memory with [`load_file_with`] and a [`MemoryLoader`].
//! Nothing else here is a contract: the parser and evaluator are private modules.
//!
//! ```no_run
//! let project = hvd_lang::load_file(std::path::Path::new("train.hvd"))?;
//! for step in &project.steps {
//!     println!("{} needs {:?}", step.name, step.needs);
//! }
//! # Ok::<(), hvd_lang::Diagnostics>(())
//! ```
//!
//! Pipeline: `syntax::parser` turns text into the `syntax::ast` (with error recovery), `eval` turns the
//! AST into values (imports, `let`, recipes; files are read through an [`ImportLoader`]), `lower` checks
//! those values against the model's fields and builds [`model::Project`]. Every stage records problems
//! instead of stopping, and [`Diagnostics`] renders them all. Parsing and evaluation run on a thread with a
//! large stack; the nesting and evaluation limits (`syntax::parser::MAX_DEPTH`, `eval::MAX_EVAL_DEPTH`,
//! `eval::EVAL_BUDGET`) keep them well inside it.

// A library reports through its errors and `tracing`; only the `hvd` binary writes to the terminal.
#![deny(clippy::print_stdout, clippy::print_stderr)]

mod diagnostics;
pub mod env_vars;
mod eval;
mod format;
mod loader;
mod lower;
pub mod model;
mod requires_python;
pub mod stdlib;
mod syntax;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use diagnostics::{Diagnostics, Error};
pub use loader::{FsLoader, ImportLoader, MemoryLoader};

use diagnostics::{Loc, Sources};
use syntax::ast::Span;

/// Stack for the parser/evaluator thread: far more than the depth limits need, so limits, not the stack,
/// decide when nesting is too deep.
const STACK_SIZE: usize = 256 << 20;

/// Parse and evaluate a `.hvd` file (and what it imports) into the typed model.
///
/// Every error found (syntax, names, types, the step graph, imports) is in the returned [`Diagnostics`].
pub fn load_file(path: &Path) -> Result<model::Project, Diagnostics> {
    load_file_with(path, &FsLoader)
}

/// Like [`load_file`], reading the file and its imports through `loader` (e.g. a [`MemoryLoader`]).
pub fn load_file_with(
    path: &Path,
    loader: &dyn ImportLoader,
) -> Result<model::Project, Diagnostics> {
    let text = loader
        .read_to_string(path)
        .map_err(|e| cannot_read(path, &e))?;
    load_source_with(path, &text, loader)
}

/// Like [`load_file`], for text already in memory. `path` names the file in messages and in
/// [`model::Project::file`]; local imports are resolved relative to its directory.
pub fn load_source(path: &Path, text: &str) -> Result<model::Project, Diagnostics> {
    load_source_with(path, text, &FsLoader)
}

/// Like [`load_source`], reading imports through `loader`.
pub fn load_source_with(
    path: &Path,
    text: &str,
    loader: &dyn ImportLoader,
) -> Result<model::Project, Diagnostics> {
    let name = path.display().to_string();
    on_big_stack(&name, || load_inner(path, text, loader))
}

/// Format `.hvd` source in the canonical layout (comments kept). `name` is used in error messages.
/// Fails with the syntax errors when the text does not parse.
pub fn format_source(name: &str, text: &str) -> Result<String, Diagnostics> {
    on_big_stack(name, || {
        let (file, errors) = syntax::parser::parse(text);
        if errors.is_empty() {
            return Ok(format::format_file(text, &file));
        }
        let mut sources = Sources::default();
        let id = sources.add(name.to_string(), Arc::from(text));
        let problems = errors
            .into_iter()
            .map(|e| {
                diagnostics::Problem::new(
                    Loc {
                        file: id,
                        span: e.span,
                    },
                    e.message,
                    e.label,
                )
                .maybe_help(e.help)
            })
            .collect();
        Err(Diagnostics::from_problems(name, problems, &sources))
    })
}

/// Read a `.hvd` file, as a [`Diagnostics`] on failure (for commands that format or check files).
pub fn read(path: &Path) -> Result<String, Diagnostics> {
    FsLoader
        .read_to_string(path)
        .map_err(|e| cannot_read(path, &e))
}

fn cannot_read(path: &Path, e: &std::io::Error) -> Diagnostics {
    Diagnostics::single(
        &path.display().to_string(),
        format!("cannot read the file: {e}"),
        Some("check the path".into()),
    )
}

fn on_big_stack<T: Send>(
    name: &str,
    f: impl FnOnce() -> Result<T, Diagnostics> + Send,
) -> Result<T, Diagnostics> {
    std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name("hvd-lang".into())
            .stack_size(STACK_SIZE)
            .spawn_scoped(scope, f);
        match handle {
            // A panic is a bug; let it propagate (the fuzz target must see it).
            Ok(handle) => handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            Err(e) => Err(Diagnostics::single(
                name,
                format!("cannot start the evaluator thread: {e}"),
                None,
            )),
        }
    })
}

fn load_inner(
    path: &Path,
    text: &str,
    loader: &dyn ImportLoader,
) -> Result<model::Project, Diagnostics> {
    let name = path.display().to_string();
    let mut sources = Sources::default();
    let main = sources.add(name.clone(), Arc::from(text));
    let mut evaluator = eval::Evaluator::new(sources, loader);
    let Some(ast) = evaluator.parse(main) else {
        return Err(Diagnostics::from_problems(
            &name,
            evaluator.problems,
            &evaluator.sources,
        ));
    };
    let canonical = loader.canonicalize(path).ok();
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let out = evaluator.eval_main(main, &ast, canonical, Some(&dir));
    let python_problems = requires_python::check(&out);
    let mut lowerer = lower::Lowerer {
        problems: Vec::new(),
    };
    let project = lowerer.project(
        out,
        path,
        Loc {
            file: main,
            span: Span::new(0, 0),
        },
    );
    let mut problems = evaluator.problems;
    problems.extend(lowerer.problems);
    problems.extend(python_problems);
    match project {
        Some(project) if problems.is_empty() => Ok(project),
        _ => {
            if problems.is_empty() {
                problems.push(diagnostics::Problem::without_location(
                    "the file did not evaluate to a project",
                ));
            }
            Err(Diagnostics::from_problems(
                &name,
                problems,
                &evaluator.sources,
            ))
        }
    }
}
