//! The evaluator: AST -> values. Names are resolved in order (a `let` is visible after its definition),
//! recipes are closures, and every error is recorded as a [`Problem`] while evaluation goes on, so one run
//! reports as many independent errors as it can. A failed sub-expression evaluates to [`Poison`], which
//! its users pass on silently (no cascades of follow-up errors).
//!
//! Runaway evaluation is bounded twice: a depth limit (recursive recipes) and a step budget (exponential
//! blow-ups through repeated doubling), both reported as errors.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use crate::diagnostics::{FileId, Loc, Problem, Sources, suggestion};
use crate::syntax::ast::*;
use crate::syntax::parser;

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

#[derive(Debug, Clone)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    /// Bytes.
    Size(u64),
    /// Milliseconds.
    Duration(u64),
    List(Rc<Vec<Sv>>),
    Attrs(Rc<BTreeMap<String, Sv>>),
    Recipe(Rc<Closure>),
    /// A reference to a step by name (steps are in scope in the main file).
    Step(Rc<str>),
}

impl Value {
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "none",
            Value::Bool(_) => "a bool",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a float",
            Value::Str(_) => "a string",
            Value::Size(_) => "a size",
            Value::Duration(_) => "a duration",
            Value::List(_) => "a list",
            Value::Attrs(_) => "an attribute set",
            Value::Recipe(_) => "a recipe",
            Value::Step(_) => "a step",
        }
    }
}

/// A value and the source location of the expression that produced it.
#[derive(Debug, Clone)]
pub(crate) struct Sv {
    pub v: Value,
    pub loc: Loc,
}

#[derive(Debug)]
pub(crate) struct Closure {
    def: Rc<RecipeDef>,
    env: Env,
    name: Option<String>,
}

/// Marker for "this evaluation failed and the failure is already reported".
#[derive(Debug, Clone, Copy)]
pub(crate) struct Poison;

type R = Result<Sv, Poison>;

/// The names of one module: its `let`s, its imports and (in the main file) its steps.
#[derive(Debug, Default)]
pub(crate) struct Scope {
    globals: RefCell<BTreeMap<String, Sv>>,
    imports: RefCell<BTreeMap<String, Sv>>,
    steps: RefCell<BTreeMap<String, Span>>,
}

#[derive(Debug)]
struct Local {
    name: String,
    value: Sv,
    next: Option<Rc<Local>>,
}

#[derive(Debug, Clone)]
struct Env {
    file: FileId,
    module: Rc<Scope>,
    locals: Option<Rc<Local>>,
}

impl Env {
    fn with(&self, name: &str, value: Sv) -> Env {
        let local = Local {
            name: name.to_string(),
            value,
            next: self.locals.clone(),
        };
        Env {
            file: self.file,
            module: Rc::clone(&self.module),
            locals: Some(Rc::new(local)),
        }
    }

    fn lookup(&self, name: &str) -> Option<Sv> {
        let mut cur = self.locals.as_deref();
        while let Some(local) = cur {
            if local.name == name {
                return Some(local.value.clone());
            }
            cur = local.next.as_deref();
        }
        if let Some(v) = self.module.globals.borrow().get(name) {
            return Some(v.clone());
        }
        if let Some(v) = self.module.imports.borrow().get(name) {
            return Some(v.clone());
        }
        if self.module.steps.borrow().contains_key(name) {
            // Steps evaluate to references; the location is filled in by the caller.
            return Some(Sv {
                v: Value::Step(name.into()),
                loc: Loc {
                    file: self.file,
                    span: Span::default(),
                },
            });
        }
        None
    }

    fn names(&self) -> Vec<String> {
        let mut names = Vec::new();
        let mut cur = self.locals.as_deref();
        while let Some(local) = cur {
            names.push(local.name.clone());
            cur = local.next.as_deref();
        }
        names.extend(self.module.globals.borrow().keys().cloned());
        names.extend(self.module.imports.borrow().keys().cloned());
        names.extend(self.module.steps.borrow().keys().cloned());
        names
    }
}

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

pub(crate) struct Evaluator {
    pub sources: Sources,
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

impl Evaluator {
    pub fn new(sources: Sources) -> Self {
        Evaluator {
            sources,
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
        let (_, out) = self.eval_module(file, ast, dir, true);
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
        let env = Env {
            file,
            module: Rc::clone(&scope),
            locals: None,
        };
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
                        // Bind a poisoned marker so later uses do not report "unknown name".
                        Err(Poison) => poison_marker(Self::loc(&env, name.span)),
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

    fn bind_import(&mut self, env: &Env, name: &str, span: Span, value: Option<Sv>) {
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
        let value = value.unwrap_or_else(|| poison_marker(Self::loc(env, span)));
        env.module
            .imports
            .borrow_mut()
            .insert(name.to_string(), value);
    }

    /// The `std` attribute set: every `let` of every embedded stdlib file.
    fn std_module(&mut self, at: Loc) -> Option<Sv> {
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

    fn import_file(&mut self, at: Loc, dir: &Path, rel: &str) -> Option<Sv> {
        let joined = normalize(&dir.join(rel));
        let canonical = match std::fs::canonicalize(&joined) {
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
        let text = match fs_err::read_to_string(&canonical) {
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

    /// Evaluate the entries of a block, call or attribute set, keeping each key's location.
    fn eval_entries(&mut self, attrs: &Attrs, env: &Env, step: bool) -> Vec<Field> {
        let mut fields: Vec<Field> = Vec::new();
        let mut seen: HashMap<String, Span> = HashMap::new();
        for entry in &attrs.entries {
            if self.exhausted {
                break;
            }
            match &entry.kind {
                EntryKind::Field { key, value } => {
                    let Ok(name) = self.eval_key(key, env) else {
                        continue;
                    };
                    let needs = step && name == "needs";
                    self.in_needs = needs;
                    let value = self.eval(value, env).ok();
                    self.in_needs = false;
                    self.push_field(&mut fields, &mut seen, env, name, key.span, value);
                }
                EntryKind::For {
                    var,
                    iter,
                    key,
                    value,
                } => {
                    let Ok(list) = self.eval(iter, env) else {
                        continue;
                    };
                    let Value::List(items) = &list.v else {
                        self.report(type_error(&list, "a list", "`for` iterates over a list"));
                        continue;
                    };
                    for item in items.iter() {
                        if self.charge(1, Self::loc(env, entry.span)).is_err() {
                            break;
                        }
                        let inner = env.with(&var.name, item.clone());
                        let Ok(name) = self.eval_key(key, &inner) else {
                            continue;
                        };
                        let value = self.eval(value, &inner).ok();
                        self.push_field(&mut fields, &mut seen, env, name, key.span, value);
                    }
                }
            }
        }
        fields
    }

    fn push_field(
        &mut self,
        fields: &mut Vec<Field>,
        seen: &mut HashMap<String, Span>,
        env: &Env,
        name: String,
        key_span: Span,
        value: Option<Sv>,
    ) {
        if let Some(first) = seen.get(&name) {
            let mut problem = Problem::new(
                Self::loc(env, key_span),
                format!("duplicate attribute `{name}`"),
                "given again here",
            );
            if *first != key_span {
                problem = problem.also(*first, "first given here");
            }
            self.report(problem.help("give each attribute once"));
            return;
        }
        seen.insert(name.clone(), key_span);
        fields.push(Field {
            key: name,
            key_loc: Self::loc(env, key_span),
            value,
        });
    }

    fn eval_key(&mut self, key: &Key, env: &Env) -> Result<String, Poison> {
        match &key.kind {
            KeyKind::Ident(name) => Ok(name.clone()),
            KeyKind::Str(parts) => {
                let s = self.eval_string(parts, env, key.span)?;
                Ok(s)
            }
        }
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

    fn eval(&mut self, e: &Expr, env: &Env) -> R {
        let loc = Self::loc(env, e.span);
        self.charge(1, loc)?;
        if self.depth >= MAX_EVAL_DEPTH {
            self.exhausted = true;
            return Err(self.report(
                Problem::new(
                    loc,
                    format!("evaluation too deep (more than {MAX_EVAL_DEPTH} levels)"),
                    "while evaluating this",
                )
                .help("a recipe probably calls itself without end"),
            ));
        }
        self.depth += 1;
        let result = self.eval_inner(e, env, loc);
        self.depth -= 1;
        result
    }

    fn eval_inner(&mut self, e: &Expr, env: &Env, loc: Loc) -> R {
        let value = match &e.kind {
            ExprKind::None => Value::None,
            ExprKind::Bool(b) => Value::Bool(*b),
            ExprKind::Number { value, .. } => match *value {
                Number::Int(n) => Value::Int(n),
                Number::Float(f) => Value::Float(f),
                Number::Size(n) => Value::Size(n),
                Number::Duration(n) => Value::Duration(n),
            },
            ExprKind::Str(parts) => Value::Str(self.eval_string(parts, env, e.span)?.into()),
            ExprKind::Ref(id) => return self.lookup(id, env, loc),
            ExprKind::List { items, .. } => {
                let mut out = Vec::with_capacity(items.len());
                let mut poisoned = false;
                for item in items {
                    match self.eval(item, env) {
                        Ok(v) => out.push(v),
                        Err(Poison) => poisoned = true,
                    }
                    if self.exhausted {
                        return Err(Poison);
                    }
                }
                if poisoned {
                    return Err(Poison);
                }
                Value::List(Rc::new(out))
            }
            ExprKind::ListFor { var, iter, body } => {
                let list = self.eval(iter, env)?;
                let Value::List(items) = &list.v else {
                    return Err(self.report(type_error(
                        &list,
                        "a list",
                        "`for` iterates over a list",
                    )));
                };
                let mut out = Vec::with_capacity(items.len());
                for item in items.iter() {
                    let inner = env.with(&var.name, item.clone());
                    out.push(self.eval(body, &inner)?);
                }
                Value::List(Rc::new(out))
            }
            ExprKind::Attrs(attrs) => {
                let fields = self.eval_entries(attrs, env, false);
                let mut map = BTreeMap::new();
                let mut poisoned = false;
                for f in fields {
                    match f.value {
                        Some(v) => {
                            map.insert(f.key, v);
                        }
                        None => poisoned = true,
                    }
                }
                if poisoned || self.exhausted {
                    return Err(Poison);
                }
                Value::Attrs(Rc::new(map))
            }
            ExprKind::Field { base, name } => {
                let b = self.eval(base, env)?;
                let Value::Attrs(map) = &b.v else {
                    let help = match &b.v {
                        Value::Recipe(_) => {
                            "a recipe must be called first, e.g. `std.jax { version = \"0.4.30\" }`"
                        }
                        _ => "only attribute sets have attributes",
                    };
                    return Err(self.report(
                        Problem::new(
                            Self::loc(env, name.span),
                            format!("cannot read `.{}` of {}", name.name, b.v.type_name()),
                            "not an attribute set",
                        )
                        .help(help),
                    ));
                };
                match map.get(&name.name) {
                    Some(v) if result_is_poison(v) => return Err(Poison),
                    Some(v) => return Ok(v.clone()),
                    None => {
                        let help =
                            suggestion(&name.name, map.keys().map(String::as_str)).or_else(|| {
                                (map.len() <= 12 && !map.is_empty()).then(|| {
                                    format!(
                                        "it has {}",
                                        map.keys()
                                            .map(|k| format!("`{k}`"))
                                            .collect::<Vec<_>>()
                                            .join(", ")
                                    )
                                })
                            });
                        let what = match &base.kind {
                            ExprKind::Ref(id) => format!("`{}`", id.name),
                            _ => "this attribute set".to_string(),
                        };
                        return Err(self.report(
                            Problem::new(
                                Self::loc(env, name.span),
                                format!("unknown attribute `{}` in {what}", name.name),
                                "not found",
                            )
                            .maybe_help(help),
                        ));
                    }
                }
            }
            ExprKind::Call { callee, args } => return self.call(callee, args, env, loc),
            ExprKind::Builtin { name, args } => return self.builtin(name, args, env, loc),
            ExprKind::Not(inner) => {
                let v = self.eval(inner, env)?;
                match v.v {
                    Value::Bool(b) => Value::Bool(!b),
                    _ => return Err(self.report(type_error(&v, "a bool", "`!` negates a bool"))),
                }
            }
            ExprKind::Binary { op, lhs, rhs } => return self.binary(*op, lhs, rhs, env, loc),
            ExprKind::If {
                cond,
                then,
                otherwise,
            } => {
                let c = self.eval(cond, env)?;
                return match c.v {
                    Value::Bool(true) => self.eval(then, env),
                    Value::Bool(false) => self.eval(otherwise, env),
                    _ => Err(self.report(type_error(
                        &c,
                        "a bool",
                        "an `if` condition must be `true` or `false`",
                    ))),
                };
            }
            ExprKind::Recipe(def) => Value::Recipe(Rc::new(Closure {
                def: Rc::clone(def),
                env: env.clone(),
                name: None,
            })),
            ExprKind::Paren(inner) => return self.eval(inner, env).map(|sv| Sv { loc, ..sv }),
        };
        Ok(Sv { v: value, loc })
    }

    fn lookup(&mut self, id: &Ident, env: &Env, loc: Loc) -> R {
        match env.lookup(&id.name) {
            Some(sv) if result_is_poison(&sv) => Err(Poison),
            Some(Sv {
                v: Value::Step(name),
                ..
            }) => Ok(Sv {
                v: Value::Step(name),
                loc,
            }),
            Some(sv) => Ok(sv),
            None if self.in_needs => {
                let steps: Vec<String> = env.module.steps.borrow().keys().cloned().collect();
                let help =
                    suggestion(&id.name, steps.iter().map(String::as_str)).unwrap_or_else(|| {
                        format!(
                            "`needs` lists steps defined in this file: {}",
                            list_names(&steps)
                        )
                    });
                Err(self.report(
                    Problem::new(
                        loc,
                        format!("unknown step `{}` in `needs`", id.name),
                        "no such step",
                    )
                    .help(help),
                ))
            }
            None => {
                let names = env.names();
                let mut help = suggestion(&id.name, names.iter().map(String::as_str));
                if help.is_none() && id.name == "std" {
                    help = Some("add `import std` at the top of the file".into());
                }
                if help.is_none()
                    && crate::stdlib::FILES
                        .iter()
                        .any(|(f, _)| f.trim_end_matches(".hvd") == id.name)
                {
                    help = Some(format!(
                        "the standard library's recipe is `std.{}` (after `import std`)",
                        id.name
                    ));
                }
                if help.is_none() {
                    help = Some(format!("to write text, quote it: \"{}\"", id.name));
                }
                Err(self.report(
                    Problem::new(loc, format!("unknown name `{}`", id.name), "not defined")
                        .maybe_help(help),
                ))
            }
        }
    }

    fn call(&mut self, callee: &Expr, args: &Attrs, env: &Env, loc: Loc) -> R {
        let f = self.eval(callee, env)?;
        let Value::Recipe(closure) = &f.v else {
            let fields = self.eval_entries(args, env, false);
            drop(fields);
            return Err(self.report(
                Problem::new(
                    Self::loc(env, callee.span),
                    format!("cannot call {}", f.v.type_name()),
                    "not a recipe",
                )
                .help("only recipes take `{ ... }` arguments"),
            ));
        };
        let recipe_name = closure.name.clone().unwrap_or_else(|| "recipe".into());
        let fields = self.eval_entries(args, env, false);
        let mut poisoned = false;
        let mut given: HashMap<String, Sv> = HashMap::new();
        let param_names: Vec<&str> = closure
            .def
            .params
            .iter()
            .map(|p| p.name.name.as_str())
            .collect();
        for field in fields {
            if !param_names.contains(&field.key.as_str()) {
                let help =
                    suggestion(&field.key, param_names.iter().copied()).unwrap_or_else(|| {
                        format!("`{recipe_name}` takes {}", list_names(&param_names))
                    });
                self.report(
                    Problem::new(
                        field.key_loc,
                        format!("`{recipe_name}` has no parameter `{}`", field.key),
                        "unknown parameter",
                    )
                    .help(help),
                );
                poisoned = true;
                continue;
            }
            match field.value {
                Some(v) => {
                    given.insert(field.key, v);
                }
                None => poisoned = true,
            }
        }
        let mut inner = closure.env.clone();
        let mut missing = Vec::new();
        for param in &closure.def.params {
            let value = match given.remove(&param.name.name) {
                Some(v) => v,
                None => match &param.default {
                    Some(default) => match self.eval(default, &inner) {
                        Ok(v) => v,
                        Err(Poison) => {
                            poisoned = true;
                            continue;
                        }
                    },
                    None => {
                        missing.push(param.name.name.clone());
                        continue;
                    }
                },
            };
            inner = inner.with(&param.name.name, value);
        }
        if !missing.is_empty() {
            let list = list_names(&missing);
            let example = missing
                .iter()
                .map(|m| format!("{m} = ..."))
                .collect::<Vec<_>>()
                .join(", ");
            self.report(
                Problem::new(
                    loc,
                    format!("missing parameter {list} in call to `{recipe_name}`"),
                    "in this call",
                )
                .help(format!("add {{ {example} }}")),
            );
            return Err(Poison);
        }
        if poisoned {
            return Err(Poison);
        }
        self.call_stack.push(loc);
        let result = self.eval(&closure.def.body, &inner);
        self.call_stack.pop();
        result
    }

    fn builtin(&mut self, name: &Ident, args: &[Expr], env: &Env, loc: Loc) -> R {
        const BUILTINS: [(&str, usize); 6] = [
            ("contains", 2),
            ("upper", 1),
            ("lower", 1),
            ("join", 2),
            ("len", 1),
            ("fail", 1),
        ];
        let Some((_, arity)) = BUILTINS.iter().find(|(n, _)| *n == name.name) else {
            let help = suggestion(&name.name, BUILTINS.iter().map(|(n, _)| *n))
                .unwrap_or_else(|| "the built-in functions are `contains`, `upper`, `lower`, `join`, `len` and `fail`".into());
            return Err(self.report(
                Problem::new(
                    Self::loc(env, name.span),
                    format!("unknown function `{}`", name.name),
                    "not a built-in function",
                )
                .help(help),
            ));
        };
        if args.len() != *arity {
            return Err(self.report(Problem::new(
                loc,
                format!(
                    "`{}` takes {arity} argument{}, found {}",
                    name.name,
                    if *arity == 1 { "" } else { "s" },
                    args.len()
                ),
                "wrong number of arguments",
            )));
        }
        let mut values = Vec::with_capacity(args.len());
        for a in args {
            values.push(self.eval(a, env)?);
        }
        let value = match (name.name.as_str(), values.as_slice()) {
            ("contains", [list, item]) => match &list.v {
                Value::List(items) => {
                    self.charge(items.len() as u64, loc)?;
                    Value::Bool(items.iter().any(|x| values_equal(&x.v, &item.v)))
                }
                Value::Str(s) => match &item.v {
                    Value::Str(needle) => Value::Bool(s.contains(&**needle)),
                    _ => {
                        return Err(self.report(type_error(
                            item,
                            "a string",
                            "a string contains strings",
                        )));
                    }
                },
                Value::Attrs(map) => match &item.v {
                    Value::Str(key) => Value::Bool(map.contains_key(&**key)),
                    _ => {
                        return Err(self.report(type_error(
                            item,
                            "a string",
                            "an attribute set contains names",
                        )));
                    }
                },
                _ => return Err(self.report(type_error(list, "a list", "`contains(list, item)`"))),
            },
            ("upper" | "lower", [s]) => match &s.v {
                Value::Str(text) => Value::Str(
                    if name.name == "upper" {
                        text.to_uppercase()
                    } else {
                        text.to_lowercase()
                    }
                    .into(),
                ),
                _ => {
                    return Err(self.report(type_error(
                        s,
                        "a string",
                        "changes the case of a string",
                    )));
                }
            },
            ("join", [list, sep]) => {
                let (Value::List(items), Value::Str(sep_text)) = (&list.v, &sep.v) else {
                    return Err(self.report(Problem::new(
                        loc,
                        "`join` takes a list of strings and a separator string",
                        "wrong arguments",
                    )));
                };
                let mut parts = Vec::with_capacity(items.len());
                for item in items.iter() {
                    match &item.v {
                        Value::Str(s) => parts.push(s.to_string()),
                        _ => {
                            return Err(self.report(type_error(
                                item,
                                "a string",
                                "`join` joins strings",
                            )));
                        }
                    }
                }
                let joined = parts.join(sep_text);
                self.charge(1 + joined.len() as u64 / 64, loc)?;
                Value::Str(joined.into())
            }
            ("fail", [message]) => {
                let text = match &message.v {
                    Value::Str(s) => s.to_string(),
                    other => format!("failed with {}", other.type_name()),
                };
                // Point at the user's call of the recipe that failed, not into the recipe.
                let at = self.call_stack.first().copied().unwrap_or(loc);
                return Err(self.report(Problem::new(at, text, "in this call")));
            }
            ("len", [x]) => match &x.v {
                Value::List(items) => Value::Int(items.len() as i64),
                Value::Str(s) => Value::Int(s.chars().count() as i64),
                Value::Attrs(map) => Value::Int(map.len() as i64),
                _ => {
                    return Err(self.report(type_error(
                        x,
                        "a list, string or attribute set",
                        "`len` counts elements",
                    )));
                }
            },
            _ => return Err(Poison),
        };
        Ok(Sv { v: value, loc })
    }

    fn binary(&mut self, op: BinOp, lhs: &Expr, rhs: &Expr, env: &Env, loc: Loc) -> R {
        let a = self.eval(lhs, env)?;
        if matches!(op, BinOp::And | BinOp::Or) {
            let Value::Bool(x) = a.v else {
                return Err(self.report(type_error(
                    &a,
                    "a bool",
                    &format!("`{}` combines bools", op.symbol()),
                )));
            };
            if (op == BinOp::And && !x) || (op == BinOp::Or && x) {
                return Ok(Sv {
                    v: Value::Bool(x),
                    loc,
                });
            }
            let b = self.eval(rhs, env)?;
            return match b.v {
                Value::Bool(y) => Ok(Sv {
                    v: Value::Bool(y),
                    loc,
                }),
                _ => Err(self.report(type_error(
                    &b,
                    "a bool",
                    &format!("`{}` combines bools", op.symbol()),
                ))),
            };
        }
        let b = self.eval(rhs, env)?;
        let value = match op {
            BinOp::Eq => Value::Bool(values_equal(&a.v, &b.v)),
            BinOp::Ne => Value::Bool(!values_equal(&a.v, &b.v)),
            BinOp::Add => match (&a.v, &b.v) {
                (Value::Int(x), Value::Int(y)) => match x.checked_add(*y) {
                    Some(n) => Value::Int(n),
                    None => return Err(self.report(Problem::new(loc, "integer overflow", "here"))),
                },
                (Value::Float(x), Value::Float(y)) => Value::Float(x + y),
                (Value::Int(x), Value::Float(y)) | (Value::Float(y), Value::Int(x)) => {
                    Value::Float(*x as f64 + y)
                }
                (Value::Size(x), Value::Size(y)) | (Value::Duration(x), Value::Duration(y)) => {
                    let Some(n) = x.checked_add(*y) else {
                        return Err(self.report(Problem::new(loc, "overflow", "here")));
                    };
                    if matches!(a.v, Value::Size(_)) {
                        Value::Size(n)
                    } else {
                        Value::Duration(n)
                    }
                }
                (Value::Str(x), Value::Str(y)) => {
                    let len = x.len() + y.len();
                    self.charge(1 + len as u64 / 64, loc)?;
                    if len > MAX_STRING {
                        return Err(self.report(Problem::new(loc, "string too long", "here")));
                    }
                    Value::Str(format!("{x}{y}").into())
                }
                (Value::List(x), Value::List(y)) => {
                    self.charge((x.len() + y.len()) as u64, loc)?;
                    let mut out = Vec::with_capacity(x.len() + y.len());
                    out.extend(x.iter().cloned());
                    out.extend(y.iter().cloned());
                    Value::List(Rc::new(out))
                }
                (Value::Attrs(x), Value::Attrs(y)) => {
                    self.charge((x.len() + y.len()) as u64, loc)?;
                    let mut out = (**x).clone();
                    out.extend(y.iter().map(|(k, v)| (k.clone(), v.clone())));
                    Value::Attrs(Rc::new(out))
                }
                _ => {
                    return Err(self.report(
                        Problem::new(loc, format!("cannot add {} and {}", a.v.type_name(), b.v.type_name()), "here")
                            .also(a.loc.span, a.v.type_name())
                            .help("`+` joins two strings, lists or attribute sets, or adds numbers of one kind"),
                    ));
                }
            },
            BinOp::And | BinOp::Or => return Err(Poison),
        };
        Ok(Sv { v: value, loc })
    }

    fn eval_string(&mut self, parts: &[StrPart], env: &Env, span: Span) -> Result<String, Poison> {
        let mut out = String::new();
        for part in parts {
            match part {
                StrPart::Lit(s) => out.push_str(s),
                StrPart::Interp(e) => {
                    let v = self.eval(e, env)?;
                    match &v.v {
                        Value::Str(s) => out.push_str(s),
                        Value::Int(n) => out.push_str(&n.to_string()),
                        Value::Float(f) => out.push_str(&f.to_string()),
                        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
                        Value::Size(n) | Value::Duration(n) => out.push_str(&n.to_string()),
                        Value::Step(name) => out.push_str(name),
                        _ => {
                            return Err(self.report(
                                Problem::new(v.loc, format!("cannot put {} into a string", v.v.type_name()), "interpolated here")
                                    .help("only strings, numbers, bools, sizes, durations and steps can be interpolated"),
                            ));
                        }
                    }
                    if out.len() > MAX_STRING {
                        return Err(self.report(Problem::new(
                            Self::loc(env, span),
                            "string too long",
                            "here",
                        )));
                    }
                }
            }
        }
        self.charge(1 + out.len() as u64 / 64, Self::loc(env, span))?;
        Ok(out)
    }
}

/// Names for a message: "`a`, `b` or `c`".
pub(crate) fn list_names<S: AsRef<str>>(names: &[S]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{}`", n.as_ref())).collect();
    match quoted.len() {
        0 => "nothing".into(),
        1 => quoted[0].clone(),
        n => format!("{} or {}", quoted[..n - 1].join(", "), quoted[n - 1]),
    }
}

pub(crate) fn type_error(sv: &Sv, expected: &str, why: &str) -> Problem {
    Problem::new(
        sv.loc,
        format!("expected {expected}, found {}", sv.v.type_name()),
        format!("this is {}", sv.v.type_name()),
    )
    .help(why.to_string())
}

pub(crate) fn values_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::None, Value::None) => true,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::Int(x), Value::Int(y)) => x == y,
        (Value::Float(x), Value::Float(y)) => x == y,
        (Value::Int(x), Value::Float(y)) | (Value::Float(y), Value::Int(x)) => (*x as f64) == *y,
        (Value::Str(x), Value::Str(y)) => x == y,
        (Value::Size(x), Value::Size(y)) | (Value::Duration(x), Value::Duration(y)) => x == y,
        (Value::Step(x), Value::Step(y)) => x == y,
        (Value::List(x), Value::List(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y.iter())
                    .all(|(a, b)| values_equal(&a.v, &b.v))
        }
        (Value::Attrs(x), Value::Attrs(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y.iter())
                    .all(|((ka, va), (kb, vb))| ka == kb && values_equal(&va.v, &vb.v))
        }
        (Value::Recipe(x), Value::Recipe(y)) => Rc::ptr_eq(x, y),
        _ => false,
    }
}

/// A binding whose definition failed: using it fails silently (the failure is already reported).
fn poison_marker(loc: Loc) -> Sv {
    Sv {
        v: Value::Step(POISON.into()),
        loc,
    }
}

const POISON: &str = "\u{0}poison";

fn result_is_poison(sv: &Sv) -> bool {
    matches!(&sv.v, Value::Step(name) if &**name == POISON)
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
