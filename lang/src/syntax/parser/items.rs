//! Items (`project`, `import`, `let`, blocks, steps) and attribute sets: their entries, keys, `for`
//! entries, and recovery to the next entry after an error inside a multi-line set.

use super::tokens::{fail, fail_help, found, is_ident_start, token_len};
use super::{P, PError, PResult, RESERVED};
use crate::syntax::ast::*;

impl<'s> P<'s> {
    pub(super) fn item(&self, i: &'s str) -> PResult<'s, Item> {
        let start = i;
        if let Some(r) = self.keyword(i, "project") {
            let r = self.ws(r);
            if !r.starts_with('"') {
                return fail_help(
                    r,
                    token_len(r),
                    format!("expected the project name as a string, found {}", found(r)),
                    "expected a string",
                    "write it like `project \"imagenet\"`",
                );
            }
            let (rest, e) = self.expr(r)?;
            return Ok((
                rest,
                Item {
                    kind: ItemKind::Project(e),
                    span: self.span(start, rest),
                },
            ));
        }
        if let Some(r) = self.keyword(i, "import") {
            let r = self.ws(r);
            if let Some(after_std) = self.keyword(r, "std") {
                let (rest, alias) = self.import_alias(after_std, false)?;
                return Ok((
                    rest,
                    Item {
                        kind: ItemKind::ImportStd { alias },
                        span: self.span(start, rest),
                    },
                ));
            }
            if r.starts_with('"') {
                let (after_path, parts) = self.string(r)?;
                let path_span = self.span(r, after_path);
                let path = match parts.as_slice() {
                    [] => String::new(),
                    [StrPart::Lit(s)] => s.clone(),
                    _ => {
                        return fail(
                            r,
                            path_span.len() as usize,
                            "an import path cannot be interpolated",
                            "here",
                        );
                    }
                };
                let (rest, alias) = self.import_alias(after_path, true)?;
                let alias = alias.unwrap_or_else(|| Ident {
                    name: String::new(),
                    span: path_span,
                });
                return Ok((
                    rest,
                    Item {
                        kind: ItemKind::ImportFile {
                            path,
                            path_span,
                            alias,
                        },
                        span: self.span(start, rest),
                    },
                ));
            }
            return fail_help(
                r,
                token_len(r),
                format!(
                    "expected `std` or a file path after `import`, found {}",
                    found(r)
                ),
                "expected `std` or a path",
                "write `import std` or `import \"./common.hvd\" as common`",
            );
        }
        if let Some(r) = self.keyword(i, "let") {
            let r = self.ws(r);
            let (r, name) = self.expect_ident(r, "a name after `let`")?;
            if RESERVED.contains(&name.name.as_str()) {
                return fail(
                    r,
                    0,
                    format!("`{}` is a reserved word and cannot be a name", name.name),
                    "reserved",
                );
            }
            let r = self.ws(r);
            let (r, ()) = self.expect_char(r, '=', &format!("after `let {}`", name.name))?;
            let r = self.ws(r);
            let (rest, value) = self.expr(r)?;
            return Ok((
                rest,
                Item {
                    kind: ItemKind::Let { name, value },
                    span: self.span(start, rest),
                },
            ));
        }
        for kind in [BlockKind::Env, BlockKind::Resources, BlockKind::Cluster] {
            if let Some(r) = self.keyword(i, kind.keyword()) {
                let keyword_span = self.span(i, r);
                let r = self.ws(r);
                let (rest, body) = self.block_body(r, &format!("after `{}`", kind.keyword()))?;
                return Ok((
                    rest,
                    Item {
                        kind: ItemKind::Block {
                            kind,
                            keyword_span,
                            body,
                        },
                        span: self.span(start, rest),
                    },
                ));
            }
        }
        if let Some(r) = self.keyword(i, "step") {
            let r = self.ws(r);
            let (r, name) = self.expect_ident(r, "the step name after `step`")?;
            let r = self.ws(r);
            let (rest, body) = self.block_body(r, &format!("after `step {}`", name.name))?;
            return Ok((
                rest,
                Item {
                    kind: ItemKind::Step { name, body },
                    span: self.span(start, rest),
                },
            ));
        }
        fail_help(
            i,
            token_len(i),
            format!(
                "expected `project`, `import`, `let`, `env`, `resources`, `step` or `cluster`, found {}",
                found(i)
            ),
            "not the start of an item",
            "every line at the top level starts a declaration such as `let x = 1` or `step train { ... }`",
        )
    }

    fn import_alias(&self, i: &'s str, required: bool) -> PResult<'s, Option<Ident>> {
        let r = self.ws(i);
        if let Some(r) = self.keyword(r, "as") {
            let r = self.ws(r);
            let (rest, alias) = self.expect_ident(r, "a name after `as`")?;
            return Ok((rest, Some(alias)));
        }
        if required {
            return fail_help(
                r,
                token_len(r),
                format!(
                    "expected `as NAME` after the import path, found {}",
                    found(r)
                ),
                "expected `as`",
                "write `import \"./common.hvd\" as common`",
            );
        }
        Ok((i, None))
    }

    /// The body of a top-level block: like [`Self::attrs`], but after a syntax error in one entry it goes on
    /// with the next entry (the next line indented like the failed one), so one run reports errors in
    /// several entries of a block.
    fn block_body(&self, i: &'s str, context: &str) -> PResult<'s, Attrs> {
        self.attrs_inner(i, context, true)
    }

    /// `{ entries }`
    pub(super) fn attrs(&self, i: &'s str, context: &str) -> PResult<'s, Attrs> {
        self.attrs_inner(i, context, false)
    }

    /// Where to go on after a failed entry that starts at `entry` (at the start of its line): the next line
    /// with the same indentation that starts a name, or the `}` of the block on a less indented line.
    fn resume_after(&self, entry: &'s str, error: &PError) -> Option<&'s str> {
        let entry_at = self.src.len() - entry.len();
        let line_start = self.src[..entry_at].rfind('\n').map_or(0, |n| n + 1);
        let line = &self.src[line_start..entry_at];
        let indent = &line[..line.len() - line.trim_start_matches([' ', '\t']).len()];
        let error_at = (self.src.len() - error.rest_len).max(entry_at);
        let mut pos = error_at;
        loop {
            pos += self.src[pos..].find('\n')? + 1;
            let line = &self.src[pos..];
            let trimmed = line.trim_start_matches([' ', '\t']);
            let width = line.len() - trimmed.len();
            if trimmed.is_empty() || trimmed.starts_with(['\n', '\r', '#']) {
                continue;
            }
            if width == indent.len() && trimmed.starts_with(is_ident_start) {
                return Some(trimmed);
            }
            if width < indent.len() {
                return trimmed.starts_with('}').then_some(trimmed);
            }
        }
    }

    fn attrs_inner(&self, i: &'s str, context: &str, recover: bool) -> PResult<'s, Attrs> {
        let open = i;
        let (mut r, ()) = self.expect_char(i, '{', context)?;
        let mut entries = Vec::new();
        let mut multiline = false;
        loop {
            r = self.ws_lines(r, &mut multiline);
            if let Some(rest) = r.strip_prefix('}') {
                return Ok((
                    rest,
                    Attrs {
                        entries,
                        multiline,
                        span: self.span(open, rest),
                    },
                ));
            }
            let (rest, entry) = match self.entry(r) {
                Ok(ok) => ok,
                Err(nom::Err::Failure(e) | nom::Err::Error(e)) if recover => {
                    match self.resume_after(r, &e) {
                        Some(resume) => {
                            self.recovered.borrow_mut().push(e);
                            r = resume;
                            continue;
                        }
                        None => return Err(nom::Err::Failure(e)),
                    }
                }
                Err(e) => return Err(e),
            };
            entries.push(entry);
            r = rest;
            // Without a comma the next round starts at the same whitespace.
            let after = self.ws_lines(r, &mut multiline);
            if let Some(rest) = after.strip_prefix(',') {
                r = rest;
            }
        }
    }

    fn key(&self, i: &'s str) -> PResult<'s, Key> {
        if i.starts_with('"') {
            let (rest, parts) = self.string(i)?;
            return Ok((
                rest,
                Key {
                    kind: KeyKind::Str(parts),
                    span: self.span(i, rest),
                },
            ));
        }
        match self.ident(i) {
            Ok((rest, id)) => Ok((
                rest,
                Key {
                    kind: KeyKind::Ident(id.name),
                    span: id.span,
                },
            )),
            Err(_) if i.starts_with('=') => fail_help(
                i,
                1,
                "expected an attribute name or `}`, found `=`",
                "expected `name = value`",
                "the value before this may be unfinished: a line ending in `+` takes the next name as its operand",
            ),
            Err(_) => fail(
                i,
                token_len(i),
                format!("expected an attribute name or `}}`, found {}", found(i)),
                "expected `name = value`",
            ),
        }
    }

    fn entry(&self, i: &'s str) -> PResult<'s, Entry> {
        let start = i;
        if let Some(r) = self.keyword(i, "for") {
            let (r, var, iter) = self.for_head(r)?;
            let (r, key) = self.key(r)?;
            let (r, value) = self.entry_value(r, &key)?;
            return Ok((
                r,
                Entry {
                    kind: EntryKind::For {
                        var,
                        iter,
                        key,
                        value,
                    },
                    span: self.span(start, r),
                },
            ));
        }
        let (r, key) = self.key(i)?;
        let (r, value) = self.entry_value(r, &key)?;
        Ok((
            r,
            Entry {
                kind: EntryKind::Field { key, value },
                span: self.span(start, r),
            },
        ))
    }

    fn entry_value(&self, r: &'s str, key: &Key) -> PResult<'s, Expr> {
        let r = self.ws(r);
        let what = match &key.kind {
            KeyKind::Ident(name) => format!("after `{name}`"),
            KeyKind::Str(_) => "after the attribute name".to_string(),
        };
        if r.starts_with(':') {
            return fail_help(
                r,
                1,
                format!("expected `=` {what}, found `:`"),
                "expected `=`",
                "attributes are written `name = value`",
            );
        }
        let (r, ()) = self.expect_char(r, '=', &what)?;
        let r = self.ws(r);
        self.expr(r)
    }

    /// After `for`: ` x in expr:`
    pub(super) fn for_head(&self, r: &'s str) -> Result<(&'s str, Ident, Expr), nom::Err<PError>> {
        let r = self.ws(r);
        let (r, var) = self.expect_ident(r, "a variable name after `for`")?;
        let r = self.ws(r);
        let r = self.expect_keyword(r, "in", &format!(" after `for {}`", var.name))?;
        let r = self.ws(r);
        let (r, iter) = self.expr(r)?;
        let r = self.ws(r);
        let (r, ()) = self.expect_char(r, ':', "after the list of a `for`")?;
        Ok((self.ws(r), var, iter))
    }
}
