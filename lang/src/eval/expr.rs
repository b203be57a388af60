//! Expressions: evaluating each kind of expression, the entries of blocks and attribute sets, names,
//! recipe calls, operators and string interpolation.

use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use super::value::{Closure, Env, Poison, Sv, Value, list_names, type_error, values_equal};
use super::{Evaluator, Field, MAX_EVAL_DEPTH, MAX_STRING, R};
use crate::diagnostics::{Loc, Problem, suggestion};
use crate::syntax::ast::*;

impl Evaluator<'_> {
    /// Evaluate the entries of a block, call or attribute set, keeping each key's location.
    pub(super) fn eval_entries(&mut self, attrs: &Attrs, env: &Env, step: bool) -> Vec<Field> {
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

    pub(super) fn push_field(
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

    pub(super) fn eval_key(&mut self, key: &Key, env: &Env) -> Result<String, Poison> {
        match &key.kind {
            KeyKind::Ident(name) => Ok(name.clone()),
            KeyKind::Str(parts) => {
                let s = self.eval_string(parts, env, key.span)?;
                Ok(s)
            }
        }
    }

    pub(super) fn eval(&mut self, e: &Expr, env: &Env) -> R {
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
                    Some(Sv {
                        v: Value::Poison, ..
                    }) => return Err(Poison),
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

    pub(super) fn lookup(&mut self, id: &Ident, env: &Env, loc: Loc) -> R {
        match env.lookup(&id.name) {
            Some(Sv {
                v: Value::Poison, ..
            }) => Err(Poison),
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

    pub(super) fn call(&mut self, callee: &Expr, args: &Attrs, env: &Env, loc: Loc) -> R {
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

    pub(super) fn binary(&mut self, op: BinOp, lhs: &Expr, rhs: &Expr, env: &Env, loc: Loc) -> R {
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
            BinOp::Eq => Value::Bool(values_equal(&a.v, &b.v)?),
            BinOp::Ne => Value::Bool(!values_equal(&a.v, &b.v)?),
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

    pub(super) fn eval_string(
        &mut self,
        parts: &[StrPart],
        env: &Env,
        span: Span,
    ) -> Result<String, Poison> {
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
                        Value::Poison => return Err(Poison),
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
