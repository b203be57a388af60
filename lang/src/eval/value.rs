//! Runtime values and the scopes names are looked up in: a value with its source location, recipes as
//! closures over their environment, a module's names, and how values compare and are described in errors.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::rc::Rc;

use crate::diagnostics::{FileId, Loc, Problem};
use crate::syntax::ast::{RecipeDef, Span};

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
    /// What a name is bound to when its definition failed (the failure is already reported): using the
    /// name fails silently instead of reporting "unknown name". Only bindings hold it (a module's `let`s
    /// and imports, so also an imported module's attribute set); evaluating an expression never gives
    /// it, and [`strip_poison`] keeps it out of what lowering sees.
    Poison,
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
            Value::Poison => "a failed value",
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
    pub(super) def: Rc<RecipeDef>,
    pub(super) env: Env,
    pub(super) name: Option<String>,
}

/// Marker for "this evaluation failed and the failure is already reported".
#[derive(Debug, Clone, Copy)]
pub(crate) struct Poison;

/// The names of one module: its `let`s, its imports and (in the main file) its steps.
#[derive(Debug, Default)]
pub(crate) struct Scope {
    pub(super) globals: RefCell<BTreeMap<String, Sv>>,
    pub(super) imports: RefCell<BTreeMap<String, Sv>>,
    pub(super) steps: RefCell<BTreeMap<String, Span>>,
}

/// One local name (a recipe parameter or a `for` variable), in a linked list that closures share.
#[derive(Debug)]
struct Local {
    name: String,
    value: Sv,
    next: Option<Rc<Local>>,
}

/// Where a name is looked up: the locals innermost first, then the module's `let`s, imports and steps.
#[derive(Debug, Clone)]
pub(crate) struct Env {
    pub(super) file: FileId,
    pub(super) module: Rc<Scope>,
    locals: Option<Rc<Local>>,
}

impl Env {
    /// The top-level environment of a module.
    pub(super) fn module(file: FileId, module: Rc<Scope>) -> Env {
        Env {
            file,
            module,
            locals: None,
        }
    }

    pub(super) fn with(&self, name: &str, value: Sv) -> Env {
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

    pub(super) fn lookup(&self, name: &str) -> Option<Sv> {
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

    pub(super) fn names(&self) -> Vec<String> {
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

/// Whether two values are equal (`==`, `contains`); [`Poison`] when either holds a [`Value::Poison`], so a
/// comparison with a failed binding fails silently instead of giving an answer.
pub(super) fn values_equal(a: &Value, b: &Value) -> Result<bool, Poison> {
    Ok(match (a, b) {
        (Value::Poison, _) | (_, Value::Poison) => return Err(Poison),
        (Value::None, Value::None) => true,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::Int(x), Value::Int(y)) => x == y,
        (Value::Float(x), Value::Float(y)) => x == y,
        (Value::Int(x), Value::Float(y)) | (Value::Float(y), Value::Int(x)) => (*x as f64) == *y,
        (Value::Str(x), Value::Str(y)) => x == y,
        (Value::Size(x), Value::Size(y)) | (Value::Duration(x), Value::Duration(y)) => x == y,
        (Value::Step(x), Value::Step(y)) => x == y,
        (Value::List(x), Value::List(y)) => {
            if x.len() != y.len() {
                return Ok(false);
            }
            for (a, b) in x.iter().zip(y.iter()) {
                if !values_equal(&a.v, &b.v)? {
                    return Ok(false);
                }
            }
            true
        }
        (Value::Attrs(x), Value::Attrs(y)) => {
            if x.len() != y.len() {
                return Ok(false);
            }
            for ((ka, va), (kb, vb)) in x.iter().zip(y.iter()) {
                if ka != kb || !values_equal(&va.v, &vb.v)? {
                    return Ok(false);
                }
            }
            true
        }
        (Value::Recipe(x), Value::Recipe(y)) => Rc::ptr_eq(x, y),
        _ => false,
    })
}

/// Lowering gets no [`Value::Poison`]: a block's or step's value that holds one anywhere (a failed `let` of
/// an imported module passed on whole) becomes `None`, a value that failed to evaluate, which lowering passes
/// over silently. Lists and attribute sets shared between values are walked once (`clean` remembers those
/// without poison), and the walk keeps its own stack, so neither sharing nor deep nesting makes it expensive.
pub(super) fn strip_poison(value: &mut Option<Sv>, clean: &mut HashSet<*const ()>) {
    if value.as_ref().is_some_and(|v| holds_poison(&v.v, clean)) {
        *value = None;
    }
}

fn holds_poison(value: &Value, clean: &mut HashSet<*const ()>) -> bool {
    let mut walked = HashSet::new();
    let mut todo = vec![value];
    while let Some(value) = todo.pop() {
        let key = match value {
            Value::Poison => return true,
            Value::List(items) => Rc::as_ptr(items).cast::<()>(),
            Value::Attrs(map) => Rc::as_ptr(map).cast::<()>(),
            _ => continue,
        };
        if clean.contains(&key) || !walked.insert(key) {
            continue;
        }
        match value {
            Value::List(items) => todo.extend(items.iter().map(|sv| &sv.v)),
            Value::Attrs(map) => todo.extend(map.values().map(|sv| &sv.v)),
            _ => {}
        }
    }
    clean.extend(walked);
    false
}
