//! The built-in functions (`contains`, `upper`, `lower`, `join`, `len`, `fail`): arity, argument types
//! and results.

use super::value::{Env, Poison, Sv, Value, type_error, values_equal};
use super::{Evaluator, R};
use crate::diagnostics::{Loc, Problem, suggestion};
use crate::syntax::ast::{Expr, Ident};

impl Evaluator<'_> {
    pub(super) fn builtin(&mut self, name: &Ident, args: &[Expr], env: &Env, loc: Loc) -> R {
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
                    let mut found = false;
                    for x in items.iter() {
                        if values_equal(&x.v, &item.v)? {
                            found = true;
                            break;
                        }
                    }
                    Value::Bool(found)
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
}
