//! The evaluator: AST -> values. Names are resolved in order (a `let` is visible after its definition),
//! recipes are closures, and every error is recorded as a [`Problem`] while evaluation goes on, so one run
//! reports as many independent errors as it can. A failed sub-expression evaluates to [`Poison`], which
//! its users pass on silently (no cascades of follow-up errors); a name whose definition failed is bound to
//! [`Value::Poison`], so its uses fail silently too.
//!
//! Runaway evaluation is bounded twice: a depth limit (recursive recipes) and a step budget (exponential
//! blow-ups through repeated doubling), both reported as errors.
//!
//! This module holds the evaluator's state, its error reporting and its step budget; `items` walks a
//! module's items, `value` has the values and scopes, `expr` the expressions, `builtins` the built-in
//! functions, `imports` the imports (read through the [`ImportLoader`] the evaluator is given).

mod builtins;
mod expr;
mod imports;
mod items;
mod value;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::diagnostics::{FileId, Loc, Problem, Sources};
use crate::loader::ImportLoader;
use crate::syntax::ast::*;
use crate::syntax::parser;

use value::Env;
pub(crate) use value::{Poison, Sv, Value, list_names, type_error};

/// Deepest evaluation recursion (nested expressions plus recipe calls).
pub const MAX_EVAL_DEPTH: u32 = 1_000;
/// Evaluation steps (expressions evaluated plus list, string and attribute-set elements built) allowed
/// for any input, plus [`EVAL_BUDGET_PER_BYTE`] for each byte of source read: a legitimately large file
/// needs steps in proportion to its size, a runaway one (recursion, repeated doubling) grows without bound.
pub const EVAL_BUDGET: u64 = 1_000_000;
/// Extra evaluation steps per byte of source (a plain `let` line takes well under one step per byte).
pub const EVAL_BUDGET_PER_BYTE: u64 = 4;
/// Longest string evaluation may build.
const MAX_STRING: usize = 64 << 20;

type R = Result<Sv, Poison>;

/// One `key = value` of a block, with where the key is.
#[derive(Debug)]
pub(crate) struct Field {
    pub key: String,
    pub key_loc: Loc,
    /// `None` when the value failed to evaluate (already reported).
    pub value: Option<Sv>,
}

#[derive(Debug)]
pub(crate) struct Block {
    pub kind: BlockKind,
    pub keyword: Loc,
    pub fields: Vec<Field>,
}

#[derive(Debug)]
pub(crate) struct StepOut {
    pub name: String,
    pub name_loc: Loc,
    pub fields: Vec<Field>,
}

/// What evaluating the main file produced.
#[derive(Debug, Default)]
pub(crate) struct MainOut {
    pub project: Option<(String, Loc)>,
    pub blocks: Vec<Block>,
    pub steps: Vec<StepOut>,
}

pub(crate) struct Evaluator<'a> {
    pub sources: Sources,
    /// Where imported files are read from.
    loader: &'a dyn ImportLoader,
    pub problems: Vec<Problem>,
    budget_left: u64,
    budget_total: u64,
    depth: u32,
    exhausted: bool,
    std: Option<Option<Sv>>,
    modules: HashMap<PathBuf, Option<Sv>>,
    import_stack: Vec<PathBuf>,
    /// Set while evaluating a step's `needs`, to word unknown names as unknown steps.
    in_needs: bool,
    /// Where the recipe calls being evaluated were made, outermost first.
    call_stack: Vec<Loc>,
}

impl<'a> Evaluator<'a> {
    pub fn new(sources: Sources, loader: &'a dyn ImportLoader) -> Self {
        Evaluator {
            sources,
            loader,
            problems: Vec::new(),
            budget_left: EVAL_BUDGET,
            budget_total: EVAL_BUDGET,
            depth: 0,
            exhausted: false,
            std: None,
            modules: HashMap::new(),
            import_stack: Vec::new(),
            in_needs: false,
            call_stack: Vec::new(),
        }
    }

    fn report(&mut self, mut problem: Problem) -> Poison {
        // An error inside a recipe from another file: say which call of the user's led there.
        if let (Some(at), Some(call)) = (problem.loc, self.call_stack.first())
            && at.file != call.file
        {
            let source = self.sources.get(call.file);
            let before = &source.text[..(call.span.start as usize).min(source.text.len())];
            let line = before.matches('\n').count() + 1;
            let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            let note = format!("while evaluating the call at {}:{line}:{col}", source.name);
            problem.help = Some(match problem.help.take() {
                Some(help) => format!("{help} ({note})"),
                None => note,
            });
        }
        let duplicate = self
            .problems
            .iter()
            .any(|p| p.loc == problem.loc && p.message == problem.message);
        if !duplicate {
            self.problems.push(problem);
        }
        Poison
    }

    fn loc(env: &Env, span: Span) -> Loc {
        Loc {
            file: env.file,
            span,
        }
    }

    /// Parse source text; syntax errors become problems. `None` when there were any.
    pub fn parse(&mut self, file: FileId) -> Option<File> {
        let text = Arc::clone(&self.sources.get(file).text);
        let extra = EVAL_BUDGET_PER_BYTE.saturating_mul(text.len() as u64);
        self.budget_left = self.budget_left.saturating_add(extra);
        self.budget_total = self.budget_total.saturating_add(extra);
        let (ast, errors) = parser::parse(&text);
        if errors.is_empty() {
            return Some(ast);
        }
        for e in errors {
            let problem =
                Problem::new(Loc { file, span: e.span }, e.message, e.label).maybe_help(e.help);
            self.problems.push(problem);
        }
        None
    }

    fn charge(&mut self, amount: u64, at: Loc) -> Result<(), Poison> {
        if self.exhausted {
            return Err(Poison);
        }
        match self.budget_left.checked_sub(amount) {
            Some(left) => {
                self.budget_left = left;
                Ok(())
            }
            None => {
                self.exhausted = true;
                Err(self.report(
                    Problem::new(
                        at,
                        format!(
                            "evaluation takes too long (more than {} steps)",
                            self.budget_total
                        ),
                        "while evaluating this",
                    )
                    .help(
                        "look for a recipe that calls itself or a list that doubles over and over",
                    ),
                ))
            }
        }
    }
}
