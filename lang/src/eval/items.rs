//! The items of a module, in order: `project`, imports, `let`s, blocks and steps (the last two only in the
//! main file), and what the main file hands to lowering.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::value::{Closure, Env, Scope, Sv, Value, strip_poison};
use super::{Block, Evaluator, MainOut, Poison, StepOut};
use crate::diagnostics::{FileId, Problem};
use crate::syntax::ast::*;

impl Evaluator<'_> {
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

    pub(super) fn eval_module(
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
}
