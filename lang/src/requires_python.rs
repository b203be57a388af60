//! The env's python against the packages' `requires_python`: a recipe result may say
//! `requires_python = { min = "3.6", why = "..." }` (or `none`), and a python older than `min` is an error naming
//! the package, both versions and the recipe's reason (e.g. std.horovod from 0.20.0 on, docs/eras.md).

use std::collections::BTreeMap;

use crate::diagnostics::{Loc, Problem};
use crate::eval::{MainOut, Sv, Value, type_error};
use crate::syntax::ast::BlockKind;

/// Every package of the `env` block whose `requires_python.min` is above the env's `python`. A python or
/// package that lowering rejects anyway is skipped here (it reports those).
pub(crate) fn check(out: &MainOut) -> Vec<Problem> {
    let mut problems = Vec::new();
    let Some(env) = out.blocks.iter().find(|b| b.kind == BlockKind::Env) else {
        return problems;
    };
    let field = |name: &str| {
        env.fields
            .iter()
            .find(|f| f.key == name)
            .and_then(|f| f.value.as_ref())
    };
    let Some(python) = field("python").and_then(python_text) else {
        return problems;
    };
    let Some(have) = minor_version(&python) else {
        return problems;
    };
    let Some(Sv {
        v: Value::List(items),
        loc: list,
    }) = field("packages")
    else {
        return problems;
    };
    for item in items.iter() {
        let Value::Attrs(map) = &item.v else {
            continue;
        };
        let Some(rp) = map.get("requires_python") else {
            continue;
        };
        // A recipe result made in another file (the stdlib) is pointed at through the user's list.
        let at = if item.loc.file == list.file {
            item.loc
        } else {
            *list
        };
        if let Err(problem) = check_one(map, rp, &python, have, at) {
            problems.push(problem);
        }
    }
    problems
}

fn check_one(
    map: &BTreeMap<String, Sv>,
    rp: &Sv,
    python: &str,
    have: (u32, u32),
    at: Loc,
) -> Result<(), Problem> {
    let req = match &map.get("requirement").map(|r| &r.v) {
        Some(Value::Str(s)) => s.to_string(),
        _ => return Ok(()),
    };
    let fields = match &rp.v {
        Value::None => return Ok(()),
        Value::Attrs(fields) => fields,
        _ => {
            return Err(type_error(
                rp,
                "an attribute set",
                "`requires_python` is none or `{ min = \"3.6\", why = \"...\" }`",
            ));
        }
    };
    let min = match fields.get("min").map(|m| &m.v) {
        Some(Value::Str(s)) => s.to_string(),
        _ => {
            return Err(Problem::new(
                rp.loc,
                "`requires_python` has no `min` string",
                "in this `requires_python`",
            )
            .help("write `requires_python = { min = \"3.6\" }`"));
        }
    };
    let Some(wanted) = minor_version(&min) else {
        return Err(Problem::new(
            rp.loc,
            format!("`{min}` is not a python version"),
            "in this `requires_python`",
        )
        .help("write it like \"3.6\""));
    };
    if have >= wanted {
        return Ok(());
    }
    let problem = Problem::new(
        at,
        format!("`{req}` needs python >= {min}; this env has python {python}"),
        format!("`{req}` is in here"),
    );
    Err(match fields.get("why").map(|w| &w.v) {
        Some(Value::Str(why)) => problem.help(why.to_string()),
        _ => problem,
    })
}

/// `python = "3.11"` or `python = std.python { version = "3.11" }`.
fn python_text(v: &Sv) -> Option<String> {
    match &v.v {
        Value::Str(s) => Some(s.to_string()),
        Value::Attrs(map) => match map.get("version").map(|v| &v.v) {
            Some(Value::Str(s)) => Some(s.to_string()),
            _ => None,
        },
        _ => None,
    }
}

/// `"3.11"` or `"3.11.9"` -> `(3, 11)`; `None` for anything else.
fn minor_version(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::minor_version;

    #[test]
    fn minor_versions_compare_numerically() {
        assert_eq!(minor_version("3.11.9"), Some((3, 11)));
        assert!(minor_version("3.10").unwrap() > minor_version("3.6").unwrap());
        assert!(minor_version("2.7").unwrap() < minor_version("3.6").unwrap());
        assert_eq!(minor_version("3"), None);
        assert_eq!(minor_version("three.six"), None);
    }
}
