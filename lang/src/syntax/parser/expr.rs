//! Expressions: operators by precedence, unary and postfix forms (fields, calls), primaries, recipes,
//! built-in calls and lists.

use std::rc::Rc;

use nom::Parser as _;
use nom::bytes::complete::tag;

use super::tokens::{fail, fail_help, found, is_ident_start, token_len, with_help};
use super::{MAX_DEPTH, P, PError, PResult, RESERVED};
use crate::syntax::ast::*;

impl<'s> P<'s> {
    pub fn expr(&self, i: &'s str) -> PResult<'s, Expr> {
        let _guard = self.enter(i)?;
        let start = i;
        if let Some(r) = self.keyword(i, "if") {
            let r = self.ws(r);
            let (r, cond) = self.expr(r)?;
            let r = self.ws(r);
            let r = self.expect_keyword(r, "then", "")?;
            let r = self.ws(r);
            let (r, then) = self.expr(r)?;
            let r = self.ws(r);
            let r = self
                .expect_keyword(r, "else", "")
                .map_err(|e| with_help(e, "every `if` needs an `else` branch"))?;
            let r = self.ws(r);
            let (rest, otherwise) = self.expr(r)?;
            let kind = ExprKind::If {
                cond: Box::new(cond),
                then: Box::new(then),
                otherwise: Box::new(otherwise),
            };
            return Ok((
                rest,
                Expr {
                    kind,
                    span: self.span(start, rest),
                },
            ));
        }
        if let Some(r) = self.keyword(i, "recipe") {
            return self.recipe(start, r);
        }
        self.binary(i, 0)
    }

    fn recipe(&self, start: &'s str, r: &'s str) -> PResult<'s, Expr> {
        let r = self.ws(r);
        let open = r;
        let (mut r, ()) = self.expect_char(r, '{', "after `recipe` (the parameter list)")?;
        let mut params: Vec<Param> = Vec::new();
        let mut multiline = false;
        loop {
            r = self.ws_lines(r, &mut multiline);
            if let Some(rest) = r.strip_prefix('}') {
                r = rest;
                break;
            }
            let (rest, name) = self.expect_ident(r, "a parameter name or `}`")?;
            if params.iter().any(|p| p.name.name == name.name) {
                return fail(
                    r,
                    name.span.len() as usize,
                    format!("duplicate parameter `{}`", name.name),
                    "duplicate",
                );
            }
            let mut rest2 = self.ws(rest);
            let mut default = None;
            if let Some(after_eq) = rest2.strip_prefix('=')
                && !after_eq.starts_with('>')
            {
                let (after, value) = self.expr(self.ws(after_eq))?;
                default = Some(value);
                rest2 = after;
            }
            params.push(Param { name, default });
            // Without a comma the next round starts at the same whitespace.
            let after = self.ws_lines(rest2, &mut multiline);
            r = after.strip_prefix(',').unwrap_or(rest2);
        }
        let params_span = self.span(open, r);
        let r = self.ws(r);
        let Ok((r, _)) = tag::<&str, &str, PError>("=>").parse(r) else {
            return fail_help(
                r,
                token_len(r),
                format!(
                    "expected `=>` after the recipe parameters, found {}",
                    found(r)
                ),
                "expected `=>`",
                "a recipe is written `recipe { version, variant = \"cpu\" } => { ... }`",
            );
        };
        let r = self.ws(r);
        let (rest, body) = self.expr(r)?;
        let def = RecipeDef {
            params,
            params_multiline: multiline,
            params_span,
            body,
        };
        Ok((
            rest,
            Expr {
                kind: ExprKind::Recipe(Rc::new(def)),
                span: self.span(start, rest),
            },
        ))
    }

    fn binary(&self, i: &'s str, level: usize) -> PResult<'s, Expr> {
        const LEVELS: [&[(&str, BinOp)]; 4] = [
            &[("||", BinOp::Or)],
            &[("&&", BinOp::And)],
            &[("==", BinOp::Eq), ("!=", BinOp::Ne)],
            &[("+", BinOp::Add)],
        ];
        if level == LEVELS.len() {
            return self.unary(i);
        }
        let start = i;
        let (mut r, mut lhs) = self.binary(i, level + 1)?;
        let mut chain = 0u32;
        loop {
            let after_ws = self.ws(r);
            let Some((op_len, op)) = LEVELS[level]
                .iter()
                .find(|(sym, _)| after_ws.starts_with(sym))
                .map(|(sym, op)| (sym.len(), *op))
            else {
                return Ok((r, lhs));
            };
            chain += 1;
            if self.depth.get() + chain > MAX_DEPTH {
                return fail_help(
                    after_ws,
                    op_len,
                    format!("expression too long (more than {MAX_DEPTH} operators in a row)"),
                    "too long here",
                    "split the expression with `let` bindings",
                );
            }
            let operand = self.ws(&after_ws[op_len..]);
            let (rest, rhs) = self.binary(operand, level + 1)?;
            if matches!(op, BinOp::Eq | BinOp::Ne) && chain > 1 {
                return fail_help(
                    after_ws,
                    op_len,
                    "comparisons cannot be chained",
                    "second comparison",
                    "add parentheses",
                );
            }
            lhs = Expr {
                kind: ExprKind::Binary {
                    op,
                    lhs: Box::new(lhs),
                    rhs: Box::new(rhs),
                },
                span: self.span(start, rest),
            };
            r = rest;
        }
    }

    fn unary(&self, i: &'s str) -> PResult<'s, Expr> {
        if let Some(r) = i.strip_prefix('!') {
            let _guard = self.enter(i)?;
            let (rest, e) = self.unary(self.ws(r))?;
            return Ok((
                rest,
                Expr {
                    kind: ExprKind::Not(Box::new(e)),
                    span: self.span(i, rest),
                },
            ));
        }
        self.postfix(i)
    }

    fn postfix(&self, i: &'s str) -> PResult<'s, Expr> {
        let start = i;
        let (mut r, mut e) = self.primary(i)?;
        let mut chain = 0u32;
        loop {
            let after_ws = self.ws(r);
            let is_field = after_ws.starts_with('.') && after_ws[1..].starts_with(is_ident_start);
            let is_call = after_ws.starts_with('{');
            if !is_field && !is_call {
                return Ok((r, e));
            }
            chain += 1;
            if self.depth.get() + chain > MAX_DEPTH {
                return fail(
                    after_ws,
                    1,
                    format!("expression too long (more than {MAX_DEPTH} accesses in a row)"),
                    "too long here",
                );
            }
            if is_field {
                let (rest, name) = self.ident(&after_ws[1..])?;
                e = Expr {
                    kind: ExprKind::Field {
                        base: Box::new(e),
                        name,
                    },
                    span: self.span(start, rest),
                };
                r = rest;
            } else {
                let (rest, args) = self.attrs(after_ws, "")?;
                e = Expr {
                    kind: ExprKind::Call {
                        callee: Box::new(e),
                        args,
                    },
                    span: self.span(start, rest),
                };
                r = rest;
            }
        }
    }

    fn primary(&self, i: &'s str) -> PResult<'s, Expr> {
        let start = i;
        let Some(c) = i.chars().next() else {
            return fail(
                i,
                0,
                "expected an expression, found end of file",
                "expected an expression",
            );
        };
        match c {
            '(' => {
                let _guard = self.enter(i)?;
                let r = self.ws(&i[1..]);
                let (r, inner) = self.expr(r)?;
                let r = self.ws(r);
                let (rest, ()) = self.expect_char(r, ')', "to close `(`")?;
                Ok((
                    rest,
                    Expr {
                        kind: ExprKind::Paren(Box::new(inner)),
                        span: self.span(start, rest),
                    },
                ))
            }
            '[' => {
                let _guard = self.enter(i)?;
                self.list(i)
            }
            '{' => {
                let _guard = self.enter(i)?;
                let (rest, attrs) = self.attrs(i, "")?;
                Ok((
                    rest,
                    Expr {
                        kind: ExprKind::Attrs(attrs),
                        span: self.span(start, rest),
                    },
                ))
            }
            '"' => {
                let (rest, parts) = self.string(i)?;
                Ok((
                    rest,
                    Expr {
                        kind: ExprKind::Str(parts),
                        span: self.span(start, rest),
                    },
                ))
            }
            c if c.is_ascii_digit()
                || (c == '-' && i[1..].starts_with(|c: char| c.is_ascii_digit())) =>
            {
                self.number(i)
            }
            c if is_ident_start(c) => {
                let (rest, id) = self.ident(i)?;
                let kind = match id.name.as_str() {
                    "true" => ExprKind::Bool(true),
                    "false" => ExprKind::Bool(false),
                    "none" => ExprKind::None,
                    word if RESERVED.contains(&word) => {
                        return fail(
                            i,
                            id.span.len() as usize,
                            format!("expected an expression, found `{word}`"),
                            "expected an expression",
                        );
                    }
                    _ if rest.starts_with('(') => {
                        let _guard = self.enter(i)?;
                        let (rest, args) = self.builtin_args(rest)?;
                        return Ok((
                            rest,
                            Expr {
                                kind: ExprKind::Builtin { name: id, args },
                                span: self.span(start, rest),
                            },
                        ));
                    }
                    _ => ExprKind::Ref(id),
                };
                Ok((
                    rest,
                    Expr {
                        kind,
                        span: self.span(start, rest),
                    },
                ))
            }
            _ => fail(
                i,
                token_len(i),
                format!("expected an expression, found {}", found(i)),
                "expected an expression",
            ),
        }
    }

    fn builtin_args(&self, i: &'s str) -> PResult<'s, Vec<Expr>> {
        let mut r = &i[1..];
        let mut args = Vec::new();
        loop {
            r = self.ws(r);
            if let Some(rest) = r.strip_prefix(')') {
                return Ok((rest, args));
            }
            let (rest, e) = self.expr(r)?;
            args.push(e);
            let after = self.ws(rest);
            if let Some(rest) = after.strip_prefix(',') {
                r = rest;
            } else if let Some(rest) = after.strip_prefix(')') {
                return Ok((rest, args));
            } else {
                return fail(
                    after,
                    token_len(after),
                    format!("expected `,` or `)`, found {}", found(after)),
                    "expected `,` or `)`",
                );
            }
        }
    }

    fn list(&self, i: &'s str) -> PResult<'s, Expr> {
        let start = i;
        let mut r = &i[1..];
        let first = self.ws(r);
        if let Some(after_for) = self.keyword(first, "for") {
            let (r, var, iter) = self.for_head(after_for)?;
            let (r, body) = self.expr(r)?;
            let r = self.ws(r);
            let (rest, ()) = self.expect_char(r, ']', "to close the list")?;
            let kind = ExprKind::ListFor {
                var,
                iter: Box::new(iter),
                body: Box::new(body),
            };
            return Ok((
                rest,
                Expr {
                    kind,
                    span: self.span(start, rest),
                },
            ));
        }
        let mut items = Vec::new();
        let mut multiline = false;
        loop {
            r = self.ws_lines(r, &mut multiline);
            if let Some(rest) = r.strip_prefix(']') {
                return Ok((
                    rest,
                    Expr {
                        kind: ExprKind::List { items, multiline },
                        span: self.span(start, rest),
                    },
                ));
            }
            let (rest, e) = self.expr(r)?;
            items.push(e);
            let after = self.ws_lines(rest, &mut multiline);
            if let Some(rest) = after.strip_prefix(',') {
                r = rest;
            } else if after.starts_with(']') {
                r = after;
            } else {
                return fail_help(
                    after,
                    token_len(after),
                    format!("expected `,` or `]` in the list, found {}", found(after)),
                    "expected `,` or `]`",
                    "separate list items with commas",
                );
            }
        }
    }
}
