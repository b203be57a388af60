//! Imports: binding an imported module's name, the embedded standard library, and local files (cycles,
//! caching, where the text comes from).

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use super::Evaluator;
use super::value::{Env, Sv, Value};
use crate::diagnostics::{Loc, Problem};
use crate::syntax::ast::Span;

impl Evaluator<'_> {
    pub(super) fn bind_import(&mut self, env: &Env, name: &str, span: Span, value: Option<Sv>) {
        let defined = env.module.globals.borrow().contains_key(name)
            || env.module.imports.borrow().contains_key(name);
        if defined {
            self.report(Problem::new(
                Self::loc(env, span),
                format!("`{name}` is already defined"),
                "imported again here",
            ));
            return;
        }
        // A failed import is bound all the same, so later uses do not report "unknown name".
        let value = value.unwrap_or(Sv {
            v: Value::Poison,
            loc: Self::loc(env, span),
        });
        env.module
            .imports
            .borrow_mut()
            .insert(name.to_string(), value);
    }

    /// The `std` attribute set: every `let` of every embedded stdlib file.
    pub(super) fn std_module(&mut self, at: Loc) -> Option<Sv> {
        if let Some(cached) = &self.std {
            return cached.clone();
        }
        let mut all = BTreeMap::new();
        let mut ok = true;
        for (name, text) in crate::stdlib::FILES {
            let id = self.sources.add(format!("std/{name}"), Arc::from(*text));
            let Some(ast) = self.parse(id) else {
                ok = false;
                continue;
            };
            let (scope, _) = self.eval_module(id, &ast, None, false);
            for (k, v) in scope.globals.borrow().iter() {
                if !k.starts_with('_') {
                    all.insert(k.clone(), v.clone());
                }
            }
        }
        let value = ok.then(|| Sv {
            v: Value::Attrs(Rc::new(all)),
            loc: at,
        });
        self.std = Some(value.clone());
        value
    }

    pub(super) fn import_file(&mut self, at: Loc, dir: &Path, rel: &str) -> Option<Sv> {
        let joined = normalize(&dir.join(rel));
        let canonical = match self.loader.canonicalize(&joined) {
            Ok(p) => p,
            Err(e) => {
                self.report(
                    Problem::new(
                        at,
                        format!(
                            "cannot import `{rel}`: {e} (looked for `{}`)",
                            joined.display()
                        ),
                        "imported here",
                    )
                    .help("import paths are relative to the importing file"),
                );
                return None;
            }
        };
        if let Some(pos) = self.import_stack.iter().position(|p| *p == canonical) {
            let mut chain: Vec<String> = self.import_stack[pos..]
                .iter()
                .map(|p| file_name(p))
                .collect();
            chain.push(file_name(&canonical));
            self.report(
                Problem::new(
                    at,
                    format!("import cycle: {}", chain.join(" -> ")),
                    "this import closes the cycle",
                )
                .help("move what both files need into a third file that imports neither"),
            );
            return None;
        }
        if let Some(cached) = self.modules.get(&canonical) {
            return cached.clone().map(|sv| Sv { loc: at, ..sv });
        }
        let text = match self.loader.read_to_string(&canonical) {
            Ok(t) => t,
            Err(e) => {
                self.report(Problem::new(
                    at,
                    format!("cannot import `{rel}`: {e}"),
                    "imported here",
                ));
                return None;
            }
        };
        let id = self
            .sources
            .add(joined.display().to_string(), Arc::from(text));
        let result = match self.parse(id) {
            Some(ast) => {
                self.import_stack.push(canonical.clone());
                let sub_dir = joined.parent().map(Path::to_path_buf).unwrap_or_default();
                let (scope, _) = self.eval_module(id, &ast, Some(&sub_dir), false);
                self.import_stack.pop();
                let globals = scope.globals.borrow().clone();
                Some(Sv {
                    v: Value::Attrs(Rc::new(globals)),
                    loc: at,
                })
            }
            None => None,
        };
        self.modules.insert(canonical, result.clone());
        result
    }
}

fn normalize(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}
