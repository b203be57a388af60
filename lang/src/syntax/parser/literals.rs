//! Literals: numbers with their size and duration units, and strings with `${...}` interpolation and
//! escapes.

use nom::Parser as _;
use nom::bytes::complete::{tag, take_while1};
use nom::character::complete::{char, digit1};
use nom::combinator::{opt, recognize};
use nom::sequence::pair;

use super::tokens::{fail, fail_help, is_ident_char};
use super::{DURATION_UNITS, P, PError, PResult, SIZE_UNITS};
use crate::syntax::ast::*;

impl<'s> P<'s> {
    pub(super) fn number(&self, i: &'s str) -> PResult<'s, Expr> {
        let (r, digits) =
            recognize((opt(char('-')), digit1, opt(pair(char('.'), digit1)))).parse(i)?;
        let (rest, unit) =
            match take_while1::<_, &str, PError>(|c: char| c.is_ascii_alphabetic()).parse(r) {
                Ok((rest, unit)) => (rest, Some(unit)),
                Err(_) => (r, None),
            };
        if unit.is_none() {
            // `10 GiB`: a unit separated from its number by spaces.
            let spaced = rest.trim_start_matches([' ', '\t']);
            if spaced.len() < rest.len() {
                let word: &str = &spaced[..spaced
                    .find(|c: char| !is_ident_char(c))
                    .unwrap_or(spaced.len())];
                let is_unit = SIZE_UNITS
                    .iter()
                    .chain(DURATION_UNITS.iter())
                    .any(|(u, _)| *u == word);
                // `{ a = 5 m = 3 }` (entries without commas) is an attribute named `m`, not a unit.
                let is_key = spaced[word.len()..].trim_start().starts_with('=');
                if is_unit && !is_key {
                    return fail_help(
                        rest,
                        rest.len() - spaced.len() + word.len(),
                        format!("space between `{digits}` and its unit `{word}`"),
                        "remove this space",
                        format!("write `{digits}{word}`"),
                    );
                }
            }
        }
        let text = &i[..i.len() - rest.len()];
        let is_float = digits.contains('.');
        let value = match unit {
            None if is_float => match digits.parse::<f64>() {
                Ok(f) if f.is_finite() => Number::Float(f),
                _ => {
                    return fail(
                        i,
                        text.len(),
                        format!("invalid number `{text}`"),
                        "invalid number",
                    );
                }
            },
            None => match digits.parse::<i64>() {
                Ok(n) => Number::Int(n),
                Err(_) => {
                    return fail(
                        i,
                        text.len(),
                        format!("integer `{text}` is out of range"),
                        "out of range",
                    );
                }
            },
            Some(unit) => {
                let scale = SIZE_UNITS
                    .iter()
                    .map(|(u, s)| (*u, *s, true))
                    .chain(DURATION_UNITS.iter().map(|(u, s)| (*u, *s, false)))
                    .find(|(u, _, _)| *u == unit);
                let Some((_, scale, is_size)) = scale else {
                    let all: Vec<&str> = SIZE_UNITS
                        .iter()
                        .map(|(u, _)| *u)
                        .chain(DURATION_UNITS.iter().map(|(u, _)| *u))
                        .collect();
                    let help = match crate::diagnostics::did_you_mean(unit, all.iter().copied()) {
                        Some(s) => format!("did you mean `{s}`? sizes take KiB, MiB, GiB, TiB, KB, MB, GB or TB; durations take ms, s, m or h"),
                        None => "sizes take KiB, MiB, GiB, TiB, KB, MB, GB or TB; durations take ms, s, m or h".into(),
                    };
                    let unit_start = &i[digits.len()..];
                    return fail_help(
                        unit_start,
                        unit.len(),
                        format!("unknown unit `{unit}`"),
                        "unknown unit",
                        help,
                    );
                };
                if digits.starts_with('-') {
                    return fail(
                        i,
                        text.len(),
                        format!("`{text}` is negative; sizes and durations cannot be"),
                        "negative",
                    );
                }
                let amount = match digits.parse::<f64>() {
                    Ok(f) if f.is_finite() => f * scale as f64,
                    _ => {
                        return fail(
                            i,
                            text.len(),
                            format!("invalid number `{text}`"),
                            "invalid number",
                        );
                    }
                };
                if amount >= u64::MAX as f64 / 2.0 {
                    return fail(
                        i,
                        text.len(),
                        format!("`{text}` is out of range"),
                        "out of range",
                    );
                }
                let amount = if is_float {
                    amount.round() as u64
                } else {
                    match digits
                        .parse::<u64>()
                        .ok()
                        .and_then(|n| n.checked_mul(scale))
                    {
                        Some(n) => n,
                        None => {
                            return fail(
                                i,
                                text.len(),
                                format!("`{text}` is out of range"),
                                "out of range",
                            );
                        }
                    }
                };
                if is_size {
                    Number::Size(amount)
                } else {
                    Number::Duration(amount)
                }
            }
        };
        Ok((
            rest,
            Expr {
                kind: ExprKind::Number {
                    text: text.to_string(),
                    value,
                },
                span: self.span(i, rest),
            },
        ))
    }

    /// `"..."` with escapes and `${expr}` interpolation.
    pub(super) fn string(&self, i: &'s str) -> PResult<'s, Vec<StrPart>> {
        let open = i;
        let mut r = &i[1..];
        let mut parts = Vec::new();
        let mut lit = String::new();
        loop {
            let Some(c) = r.chars().next() else {
                return fail_help(
                    open,
                    1,
                    "unterminated string",
                    "this string is never closed",
                    "add a closing `\"`",
                );
            };
            match c {
                '"' => {
                    r = &r[1..];
                    break;
                }
                '\\' => {
                    let esc = r[1..].chars().next();
                    let ch = match esc {
                        Some('n') => '\n',
                        Some('t') => '\t',
                        Some('r') => '\r',
                        Some('"') => '"',
                        Some('\\') => '\\',
                        Some('$') => '$',
                        Some(other) => {
                            return fail_help(
                                r,
                                1 + other.len_utf8(),
                                format!("unknown escape `\\{other}`"),
                                "unknown escape",
                                "the escapes are \\n \\t \\r \\\" \\\\ and \\$",
                            );
                        }
                        None => {
                            return fail(
                                open,
                                1,
                                "unterminated string",
                                "this string is never closed",
                            );
                        }
                    };
                    lit.push(ch);
                    r = &r[1 + ch.len_utf8()..];
                }
                '$' if r[1..].starts_with('{') => {
                    if !lit.is_empty() {
                        parts.push(StrPart::Lit(std::mem::take(&mut lit)));
                    }
                    let _guard = self.enter(r)?;
                    let inner = self.ws(&r[2..]);
                    let (after, e) = self.expr(inner)?;
                    let after = self.ws(after);
                    let (after, ()) = self.expect_char(after, '}', "to close `${`")?;
                    parts.push(StrPart::Interp(e));
                    r = after;
                }
                _ => {
                    let (rest, chunk) =
                        take_while1::<_, &str, PError>(|c: char| c != '"' && c != '\\' && c != '$')
                            .parse(r)
                            .or_else(|_: nom::Err<PError>| tag("$").parse(r))?;
                    lit.push_str(chunk);
                    r = rest;
                }
            }
        }
        if !lit.is_empty() {
            parts.push(StrPart::Lit(lit));
        }
        Ok((r, parts))
    }
}
