//! The evaluator: AST -> values. Names are resolved in order (a `let` is visible after its definition),
//! recipes are closures, and every error is recorded as a [`Problem`] while evaluation goes on, so one run
//! reports as many independent errors as it can. A failed sub-expression evaluates to [`Poison`], which
//! its users pass on silently (no cascades of follow-up errors); a name whose definition failed is bound to
//! [`Value::Poison`], so its uses fail silently too.
//!
//! Runaway evaluation is bounded twice: a depth limit (recursive recipes) and a step budget (exponential
//! blow-ups through repeated doubling), both reported as errors.
//!
//! This module holds the evaluator's state and walks a module's items; `value` has the values and scopes,
//! `expr` the expressions, `builtins` the built-in functions, `imports` the imports (read through the
//! [`ImportLoader`] the evaluator is given).

mod builtins;
mod expr;
mod imports;
mod value;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use crate::diagnostics::{FileId, Loc, Problem, Sources};
use crate::loader::ImportLoader;
use crate::syntax::ast::*;
use crate::syntax::parser;

use value::{Closure, Env, Scope, strip_poison};
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

    /// Evaluate the main file. `path` is its canonical path (for import cycles); `dir` resolves imports.
    pub fn eval_main(
        &mut self,
        file: FileId,
        ast: &File,
        canonical: Option<PathBuf>,
        dir: Option<&Path>,
    ) -> MainOut {
        if let Some(p) = canonical {
            self.import_stack.push(p);
        }
        let (_, mut out) = self.eval_module(file, ast, dir, true);
        let mut clean = HashSet::new();
        let blocks = out.blocks.iter_mut().flat_map(|b| &mut b.fields);
        let steps = out.steps.iter_mut().flat_map(|s| &mut s.fields);
        for field in blocks.chain(steps) {
            strip_poison(&mut field.value, &mut clean);
        }
        out
    }

    fn eval_module(
        &mut self,
        file: FileId,
        ast: &File,
        dir: Option<&Path>,
        main: bool,
    ) -> (Rc<Scope>, MainOut) {
        let scope = Rc::new(Scope::default());
        let env = Env::module(file, Rc::clone(&scope));
        let mut out = MainOut::default();

        // Steps are visible everywhere in the main file (for `needs`), so register them first.
        if main {
            for item in &ast.items {
                if let ItemKind::Step { name, .. } = &item.kind {
                    let first = scope.steps.borrow().get(&name.name).copied();
                    if let Some(first) = first {
                        let problem = Problem::new(
                            Self::loc(&env, name.span),
                            format!("duplicate step `{}`", name.name),
                            "defined again here",
                        )
                        .also(first, "first defined here")
                        .help("give each step its own name");
                        self.problems.push(problem);
                    } else {
                        scope
                            .steps
                            .borrow_mut()
                            .insert(name.name.clone(), name.span);
                    }
                }
            }
        }

        let mut seen_blocks: HashMap<&'static str, Span> = HashMap::new();
        for item in &ast.items {
            if self.exhausted {
                break;
            }
            match &item.kind {
                ItemKind::Project(e) => {
                    if !main {
                        self.report(Problem::new(
                            Self::loc(&env, item.span),
                            "`project` in an imported file",
                            "only the main file names the project",
                        ));
                        continue;
                    }
                    if let Some((_, first)) = &out.project {
                        let p = Problem::new(
                            Self::loc(&env, item.span),
                            "`project` is given twice",
                            "second `project`",
                        )
                        .also(first.span, "first here");
                        self.report(p);
                        continue;
                    }
                    if let Ok(sv) = self.eval(e, &env) {
                        match sv.v {
                            Value::Str(s) if !s.trim().is_empty() => {
                                out.project = Some((s.to_string(), Self::loc(&env, e.span)))
                            }
                            Value::Str(_) => {
                                self.report(Problem::new(
                                    Self::loc(&env, e.span),
                                    "the project name is empty",
                                    "empty name",
                                ));
                            }
                            other => {
                                self.report(Problem::new(
                                    Self::loc(&env, e.span),
                                    format!(
                                        "the project name must be a string, found {}",
                                        other.type_name()
                                    ),
                                    "not a string",
                                ));
                            }
                        }
                    }
                }
                ItemKind::ImportStd { alias } => {
                    let name = alias
                        .as_ref()
                        .map_or("std", |a| a.name.as_str())
                        .to_string();
                    let span = alias.as_ref().map_or(item.span, |a| a.span);
                    let value = self.std_module(Self::loc(&env, item.span));
                    self.bind_import(&env, &name, span, value);
                }
                ItemKind::ImportFile {
                    path,
                    path_span,
                    alias,
                } => {
                    let loc = Self::loc(&env, *path_span);
                    let value = match dir {
                        Some(dir) => self.import_file(loc, dir, path),
                        None => {
                            self.report(Problem::new(
                                loc,
                                "the standard library cannot import local files",
                                "here",
                            ));
                            None
                        }
                    };
                    self.bind_import(&env, &alias.name, alias.span, value);
                }
                ItemKind::Let { name, value } => {
                    let defined = scope.globals.borrow().contains_key(&name.name)
                        || scope.imports.borrow().contains_key(&name.name);
                    if defined {
                        self.report(
                            Problem::new(
                                Self::loc(&env, name.span),
                                format!("`{}` is already defined", name.name),
                                "defined again here",
                            )
                            .help("choose another name"),
                        );
                        continue;
                    }
                    let result = self.eval(value, &env);
                    let sv = match result {
                        Ok(Sv {
                            v: Value::Recipe(c),
                            loc,
                        }) if c.name.is_none() => {
                            let named = Closure {
                                def: Rc::clone(&c.def),
                                env: c.env.clone(),
                                name: Some(name.name.clone()),
                            };
                            Sv {
                                v: Value::Recipe(Rc::new(named)),
                                loc,
                            }
                        }
                        Ok(sv) => sv,
                        // Bind the failure, so later uses do not report "unknown name".
                        Err(Poison) => Sv {
                            v: Value::Poison,
                            loc: Self::loc(&env, name.span),
                        },
                    };
                    scope.globals.borrow_mut().insert(name.name.clone(), sv);
                }
                ItemKind::Block {
                    kind,
                    keyword_span,
                    body,
                } => {
                    if !main {
                        self.report(Problem::new(
                            Self::loc(&env, *keyword_span),
                            format!("`{}` block in an imported file", kind.keyword()),
                            "only the main file may have blocks",
                        ).help("move the block into the main file; imported files only define `let`s"));
                        continue;
                    }
                    if let Some(first) = seen_blocks.get(kind.keyword()) {
                        self.report(
                            Problem::new(
                                Self::loc(&env, *keyword_span),
                                format!("duplicate `{}` block", kind.keyword()),
                                "second block",
                            )
                            .also(*first, "first block")
                            .help("merge the two blocks into one"),
                        );
                        continue;
                    }
                    seen_blocks.insert(kind.keyword(), *keyword_span);
                    let fields = self.eval_entries(body, &env, false);
                    out.blocks.push(Block {
                        kind: *kind,
                        keyword: Self::loc(&env, *keyword_span),
                        fields,
                    });
                }
                ItemKind::Step { name, body } => {
                    if !main {
                        self.report(Problem::new(
                            Self::loc(&env, name.span),
                            "step in an imported file",
                            "only the main file may have steps",
                        ));
                        continue;
                    }
                    let fields = self.eval_entries(body, &env, true);
                    out.steps.push(StepOut {
                        name: name.name.clone(),
                        name_loc: Self::loc(&env, name.span),
                        fields,
                    });
                }
            }
        }
        (scope, out)
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
