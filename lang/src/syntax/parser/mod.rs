//! The parser: nom 8 combinators over `&str`, producing the AST with byte spans.
//!
//! Spans are computed from how much input is left (`src.len() - rest.len()`), so every parser works on
//! plain `&str` suffixes of the source. Errors are collected per top-level item: after a syntax error the
//! parser skips to the next line that starts with an item keyword and goes on, so one run reports several.
//! Nesting is limited ([`MAX_DEPTH`]) so deeply nested input gives an error instead of a stack overflow.
//!
//! This module holds the entry point, error recovery between items and the parser's shared state and tokens;
//! `items` parses items and the attribute sets of blocks, `expr` expressions, `literals` numbers and strings.

mod expr;
mod items;
mod literals;
#[cfg(test)]
mod tests;

use std::cell::{Cell, RefCell};

use nom::bytes::complete::take_while;
use nom::character::complete::{char, satisfy};
use nom::combinator::recognize;
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
    fail(i, len, message, label).map_err(|e| with_help(e, help))
}

/// The error `e` with `help` added.
fn with_help(e: nom::Err<PError>, help: impl Into<String>) -> nom::Err<PError> {
    e.map(|e| PError {
        help: Some(help.into()),
        ..e
    })
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

    /// [`ws`](Self::ws), also setting `multiline` when the whitespace skipped ends a line.
    fn ws_lines(&self, i: &'s str, multiline: &mut bool) -> &'s str {
        let rest = self.ws(i);
        if i[..i.len() - rest.len()].contains('\n') {
            *multiline = true;
        }
        rest
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

    /// The input after the keyword `kw` at `i`, or the error "expected `kw`{context}, found ...".
    fn expect_keyword(
        &self,
        i: &'s str,
        kw: &str,
        context: &str,
    ) -> Result<&'s str, nom::Err<PError>> {
        match self.keyword(i, kw) {
            Some(rest) => Ok(rest),
            None => fail(
                i,
                token_len(i),
                format!("expected `{kw}`{context}, found {}", found(i)),
                format!("expected `{kw}`"),
            ),
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
}
