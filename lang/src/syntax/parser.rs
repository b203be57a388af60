//! The parser: nom 8 combinators over `&str`, producing the AST with byte spans.
//!
//! Spans are computed from how much input is left (`src.len() - rest.len()`), so every parser works on
//! plain `&str` suffixes of the source. Errors are collected per top-level item: after a syntax error the
//! parser skips to the next line that starts with an item keyword and goes on, so one run reports several.
//! Nesting is limited ([`MAX_DEPTH`]) so deeply nested input gives an error instead of a stack overflow.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use nom::bytes::complete::{tag, take_while, take_while1};
use nom::character::complete::{char, digit1, satisfy};
use nom::combinator::{opt, recognize};
use nom::error::{ErrorKind, ParseError};
use nom::sequence::pair;
use nom::{IResult, Parser as _};

use super::ast::*;

/// Deepest nesting of expressions (brackets, operators, calls) accepted.
pub const MAX_DEPTH: u32 = 200;
/// After this many syntax errors in one file the parser stops.
pub const MAX_ERRORS: usize = 50;

/// A syntax error at a byte span.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntaxError {
    pub span: Span,
    pub message: String,
    pub label: String,
    pub help: Option<String>,
}

/// The nom error type: where the error is (as the length of the remaining input) and what to say.
#[derive(Debug, Clone)]
pub struct PError {
    rest_len: usize,
    len: usize,
    message: String,
    label: String,
    help: Option<String>,
}

impl ParseError<&str> for PError {
    fn from_error_kind(input: &str, kind: ErrorKind) -> Self {
        PError {
            rest_len: input.len(),
            len: 0,
            message: format!("unexpected input ({})", kind.description()),
            label: "here".into(),
            help: None,
        }
    }

    fn append(_input: &str, _kind: ErrorKind, other: Self) -> Self {
        other
    }

    fn or(self, other: Self) -> Self {
        // Keep the error that got furthest into the input.
        if other.rest_len < self.rest_len {
            other
        } else {
            self
        }
    }
}

type PResult<'s, T> = IResult<&'s str, T, PError>;

/// Parse a whole file. Returns the AST of every item that parsed and all syntax errors.
pub fn parse(src: &str) -> (File, Vec<SyntaxError>) {
    let p = P {
        src,
        depth: Cell::new(0),
        comments: RefCell::new(Vec::new()),
        recovered: RefCell::new(Vec::new()),
    };
    let mut items = Vec::new();
    let mut errors = Vec::new();
    let mut i = p.ws(src);
    while !i.is_empty() {
        let result = p.item(i);
        errors.extend(
            p.recovered
                .borrow_mut()
                .drain(..)
                .map(|e| p.syntax_error(e)),
        );
        match result {
            Ok((rest, item)) => {
                items.push(item);
                i = p.ws(rest);
                if errors.len() >= MAX_ERRORS {
                    break;
                }
            }
            Err(nom::Err::Error(e) | nom::Err::Failure(e)) => {
                let at = src.len() - e.rest_len;
                errors.push(p.syntax_error(e));
                if errors.len() >= MAX_ERRORS {
                    break;
                }
                let mut from = at.max(src.len() - i.len() + 1).min(src.len());
                while !src.is_char_boundary(from) {
                    from += 1;
                }
                let resume = recover(src, from);
                i = p.ws(&src[resume..]);
            }
            Err(nom::Err::Incomplete(_)) => {
                errors.push(SyntaxError {
                    span: Span::new(src.len() as u32, src.len() as u32),
                    message: "unexpected end of file".into(),
                    label: "here".into(),
                    help: None,
                });
                break;
            }
        }
        p.depth.set(0);
    }
    errors.sort_by_key(|e| e.span.start);
    errors.truncate(MAX_ERRORS);
    let mut comments = p.comments.into_inner();
    comments.sort_by_key(|c| c.start);
    comments.dedup();
    (File { items, comments }, errors)
}

const ITEM_KEYWORDS: [&str; 7] = [
    "project",
    "import",
    "let",
    "env",
    "resources",
    "step",
    "cluster",
];

/// The byte offset of the next line at or after `from` that starts (in column 0) with an item keyword.
fn recover(src: &str, from: usize) -> usize {
    let mut pos = from;
    while pos < src.len() {
        let Some(nl) = src[pos..].find('\n') else {
            return src.len();
        };
        pos += nl + 1;
        let line = &src[pos..];
        for kw in ITEM_KEYWORDS {
            if let Some(rest) = line.strip_prefix(kw)
                && !rest.starts_with(is_ident_char)
            {
                return pos;
            }
        }
    }
    src.len()
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

/// Words that cannot be used as names in expressions.
pub const RESERVED: [&str; 9] = [
    "if", "then", "else", "true", "false", "none", "recipe", "for", "in",
];

pub const SIZE_UNITS: [(&str, u64); 8] = [
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
];

pub const DURATION_UNITS: [(&str, u64); 4] =
    [("ms", 1), ("s", 1_000), ("m", 60_000), ("h", 3_600_000)];

struct P<'s> {
    src: &'s str,
    depth: Cell<u32>,
    comments: RefCell<Vec<Span>>,
    /// Errors inside block bodies that the parser recovered from (it went on with the next entry).
    recovered: RefCell<Vec<PError>>,
}

/// Decrements the nesting depth when dropped.
struct DepthGuard<'a>(&'a Cell<u32>);

impl Drop for DepthGuard<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

fn fail<T>(
    i: &str,
    len: usize,
    message: impl Into<String>,
    label: impl Into<String>,
) -> Result<T, nom::Err<PError>> {
    Err(nom::Err::Failure(PError {
        rest_len: i.len(),
        len,
        message: message.into(),
        label: label.into(),
        help: None,
    }))
}

fn fail_help<T>(
    i: &str,
    len: usize,
    message: impl Into<String>,
    label: impl Into<String>,
    help: impl Into<String>,
) -> Result<T, nom::Err<PError>> {
    Err(nom::Err::Failure(PError {
        rest_len: i.len(),
        len,
        message: message.into(),
        label: label.into(),
        help: Some(help.into()),
    }))
}

/// A short description of what starts at `i`, for "expected X, found Y".
fn found(i: &str) -> String {
    if i.is_empty() {
        return "end of file".into();
    }
    let c = i.chars().next().unwrap_or(' ');
    if is_ident_start(c) {
        let word: String = i.chars().take_while(|c| is_ident_char(*c)).collect();
        return format!("`{word}`");
    }
    if c == '\n' {
        return "end of line".into();
    }
    format!("`{c}`")
}

fn token_len(i: &str) -> usize {
    match i.chars().next() {
        None => 0,
        Some(c) if is_ident_start(c) => i
            .chars()
            .take_while(|c| is_ident_char(*c))
            .map(char::len_utf8)
            .sum(),
        Some('\n') => 0,
        Some(c) => c.len_utf8(),
    }
}

impl<'s> P<'s> {
    fn off(&self, i: &str) -> u32 {
        (self.src.len() - i.len()) as u32
    }

    fn span(&self, start: &str, end: &str) -> Span {
        Span::new(self.off(start), self.off(end))
    }

    fn syntax_error(&self, e: PError) -> SyntaxError {
        let start = self.src.len() - e.rest_len;
        // Labels must cover whole characters (a one-byte length may start a multi-byte one).
        let mut end = (start + e.len).min(self.src.len());
        while !self.src.is_char_boundary(end) {
            end += 1;
        }
        SyntaxError {
            span: Span::new(start as u32, end as u32),
            message: e.message,
            label: e.label,
            help: e.help,
        }
    }

    fn enter(&self, i: &str) -> Result<DepthGuard<'_>, nom::Err<PError>> {
        let d = self.depth.get() + 1;
        if d > MAX_DEPTH {
            return fail_help(
                i,
                1,
                format!("nesting too deep (more than {MAX_DEPTH} levels)"),
                "too deep here",
                "split the expression with `let` bindings",
            );
        }
        self.depth.set(d);
        Ok(DepthGuard(&self.depth))
    }

    /// Skip whitespace and comments, remembering the comments.
    fn ws(&self, mut i: &'s str) -> &'s str {
        loop {
            i = i.trim_start_matches([' ', '\t', '\r', '\n']);
            if i.starts_with('#') {
                let end = i.find('\n').unwrap_or(i.len());
                let start = self.off(i);
                let text = i[..end].trim_end();
                self.comments
                    .borrow_mut()
                    .push(Span::new(start, start + text.len() as u32));
                i = &i[end..];
            } else {
                return i;
            }
        }
    }

    fn ident(&self, i: &'s str) -> PResult<'s, Ident> {
        let (rest, name) =
            recognize(pair(satisfy(is_ident_start), take_while(is_ident_char))).parse(i)?;
        Ok((
            rest,
            Ident {
                name: name.to_string(),
                span: self.span(i, rest),
            },
        ))
    }

    /// An identifier, or a failure saying what was expected instead.
    fn expect_ident(&self, i: &'s str, what: &str) -> PResult<'s, Ident> {
        match self.ident(i) {
            Ok(ok) => Ok(ok),
            Err(_) => fail(
                i,
                token_len(i),
                format!("expected {what}, found {}", found(i)),
                format!("expected {what}"),
            ),
        }
    }

    fn keyword(&self, i: &'s str, kw: &str) -> Option<&'s str> {
        let rest = i.strip_prefix(kw)?;
        if rest.starts_with(is_ident_char) {
            None
        } else {
            Some(rest)
        }
    }

    fn expect_char(&self, i: &'s str, c: char, context: &str) -> PResult<'s, ()> {
        match char::<&str, PError>(c).parse(i) {
            Ok((rest, _)) => Ok((rest, ())),
            Err(_) => fail(
                i,
                token_len(i),
                format!("expected `{c}` {context}, found {}", found(i)),
                format!("expected `{c}`"),
            ),
        }
    }

    fn item(&self, i: &'s str) -> PResult<'s, Item> {
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
    fn attrs(&self, i: &'s str, context: &str) -> PResult<'s, Attrs> {
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
            let before = r;
            r = self.ws(r);
            if before[..before.len() - r.len()].contains('\n') {
                multiline = true;
            }
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
            let after = self.ws(r);
            if let Some(rest) = after.strip_prefix(',') {
                if r[..r.len() - after.len()].contains('\n') {
                    multiline = true;
                }
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
    fn for_head(&self, r: &'s str) -> Result<(&'s str, Ident, Expr), nom::Err<PError>> {
        let r = self.ws(r);
        let (r, var) = self.expect_ident(r, "a variable name after `for`")?;
        let r = self.ws(r);
        let Some(r) = self.keyword(r, "in") else {
            return fail(
                r,
                token_len(r),
                format!("expected `in` after `for {}`, found {}", var.name, found(r)),
                "expected `in`",
            );
        };
        let r = self.ws(r);
        let (r, iter) = self.expr(r)?;
        let r = self.ws(r);
        let (r, ()) = self.expect_char(r, ':', "after the list of a `for`")?;
        Ok((self.ws(r), var, iter))
    }

    pub fn expr(&self, i: &'s str) -> PResult<'s, Expr> {
        let _guard = self.enter(i)?;
        let start = i;
        if let Some(r) = self.keyword(i, "if") {
            let r = self.ws(r);
            let (r, cond) = self.expr(r)?;
            let r = self.ws(r);
            let Some(r) = self.keyword(r, "then") else {
                return fail(
                    r,
                    token_len(r),
                    format!("expected `then`, found {}", found(r)),
                    "expected `then`",
                );
            };
            let r = self.ws(r);
            let (r, then) = self.expr(r)?;
            let r = self.ws(r);
            let Some(r) = self.keyword(r, "else") else {
                return fail_help(
                    r,
                    token_len(r),
                    format!("expected `else`, found {}", found(r)),
                    "expected `else`",
                    "every `if` needs an `else` branch",
                );
            };
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
            let before = r;
            r = self.ws(r);
            if before[..before.len() - r.len()].contains('\n') {
                multiline = true;
            }
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
            let after = self.ws(rest2);
            r = match after.strip_prefix(',') {
                Some(rest) => {
                    if rest2[..rest2.len() - after.len()].contains('\n') {
                        multiline = true;
                    }
                    rest
                }
                None => rest2,
            };
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
            let before = r;
            r = self.ws(r);
            if before[..before.len() - r.len()].contains('\n') {
                multiline = true;
            }
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
            let after = self.ws(rest);
            if rest[..rest.len() - after.len()].contains('\n') {
                multiline = true;
            }
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

    fn number(&self, i: &'s str) -> PResult<'s, Expr> {
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
    fn string(&self, i: &'s str) -> PResult<'s, Vec<StrPart>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(src: &str) -> File {
        let (file, errors) = parse(src);
        assert!(errors.is_empty(), "{errors:?}");
        file
    }

    #[test]
    fn parses_the_basic_items() {
        let file = ok(
            "project \"x\"\nimport std\nlet a = 1\nstep s { run = \"a\" }\nenv { python = \"3.11\" }\n",
        );
        assert_eq!(file.items.len(), 5);
    }

    #[test]
    fn numbers_with_units() {
        let file = ok("let a = 10GiB\nlet b = 1.5h\nlet c = -3\nlet d = 250ms\n");
        let values: Vec<Number> = file
            .items
            .iter()
            .map(|item| match &item.kind {
                ItemKind::Let {
                    value:
                        Expr {
                            kind: ExprKind::Number { value, .. },
                            ..
                        },
                    ..
                } => *value,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            values,
            vec![
                Number::Size(10 << 30),
                Number::Duration(5_400_000),
                Number::Int(-3),
                Number::Duration(250)
            ]
        );
    }

    #[test]
    fn spaced_unit_is_an_error_but_a_key_named_like_a_unit_is_not() {
        let (_, errors) = parse("let a = 10 GiB\n");
        assert_eq!(errors[0].message, "space between `10` and its unit `GiB`");
        ok("let a = { x = 5 m = 3 }\n");
    }

    #[test]
    fn bad_unit_is_an_error_with_a_hint() {
        let (_, errors) = parse("let a = 10Gb\n");
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].message, "unknown unit `Gb`");
        assert!(
            errors[0].help.as_deref().unwrap_or("").contains("`GB`"),
            "{errors:?}"
        );
    }

    #[test]
    fn recovers_and_reports_several_errors() {
        let (file, errors) = parse("let a = \nlet b = 2\nstep { }\nlet c = [1 2]\n");
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert_eq!(file.items.len(), 1);
    }

    #[test]
    fn recovers_inside_a_block() {
        let src =
            "step a {\n  run = [1 2]\n  needs = [\n    b c\n  ]\n  workers = 3\n}\nlet x = \n";
        let (file, errors) = parse(src);
        let lines: Vec<u32> = errors
            .iter()
            .map(|e| src[..e.span.start as usize].matches('\n').count() as u32 + 1)
            .collect();
        assert_eq!(lines, [2, 4, 9], "{errors:?}");
        assert_eq!(file.items.len(), 1);
    }

    #[test]
    fn multibyte_characters_never_split() {
        for src in [
            "é",
            "let a = é",
            "ééé\nlet b = 1",
            "let a = [é",
            "step ü { run = \"x\" }",
        ] {
            let (_, errors) = parse(src);
            assert!(!errors.is_empty(), "{src}");
            for e in errors {
                assert!(
                    src.is_char_boundary(e.span.start as usize)
                        && src.is_char_boundary(e.span.end as usize)
                );
            }
        }
        let deep = format!("let a = {}é", "(".repeat(300));
        let errors = parse_on_big_stack(deep.clone());
        assert!(
            errors
                .iter()
                .all(|e| deep.is_char_boundary(e.span.end as usize))
        );
    }

    #[test]
    fn comments_are_collected() {
        let file = ok("# top\nlet a = 1 # trailing\nlet s = \"# not a comment\"\n");
        assert_eq!(file.comments.len(), 2);
    }

    /// Parse on a thread with the stack `load_file` gives the parser (debug builds use big frames).
    fn parse_on_big_stack(src: String) -> Vec<SyntaxError> {
        std::thread::Builder::new()
            .stack_size(crate::STACK_SIZE)
            .spawn(move || parse(&src).1)
            .expect("spawn")
            .join()
            .expect("no panic")
    }

    #[test]
    fn deep_nesting_is_an_error() {
        let errors = parse_on_big_stack(format!("let a = {}", "[".repeat(100_000)));
        assert!(errors[0].message.contains("nesting too deep"), "{errors:?}");
        let errors = parse_on_big_stack(format!("let a = 1{}", " + 1".repeat(100_000)));
        assert!(errors[0].message.contains("too long"), "{errors:?}");
        let errors = parse_on_big_stack(format!("let a = {}1", "!".repeat(100_000)));
        assert!(errors[0].message.contains("nesting too deep"), "{errors:?}");
    }

    #[test]
    fn interpolation() {
        let file = ok("let a = \"x${b}y\\${z}\"\n");
        let ItemKind::Let { value, .. } = &file.items[0].kind else {
            panic!()
        };
        let ExprKind::Str(parts) = &value.kind else {
            panic!()
        };
        assert_eq!(parts.len(), 3);
        assert!(matches!(&parts[2], StrPart::Lit(s) if s == "y${z}"));
    }
}
