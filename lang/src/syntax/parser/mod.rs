//! The parser: nom 8 combinators over `&str`, producing the AST with byte spans.
//!
//! Spans are computed from how much input is left (`src.len() - rest.len()`), so every parser works on
//! plain `&str` suffixes of the source. Errors are collected per top-level item: after a syntax error the
//! parser skips to the next line that starts with an item keyword and goes on, so one run reports several.
//! Nesting is limited ([`MAX_DEPTH`]) so deeply nested input gives an error instead of a stack overflow.
//!
//! This module holds the entry point, error recovery between items, the error types and the parser's state;
//! `tokens` has whitespace, names, keywords and how errors are built, `items` parses items and the attribute
//! sets of blocks, `expr` expressions, `literals` numbers and strings.

mod expr;
mod items;
mod literals;
#[cfg(test)]
mod tests;
mod tokens;

use std::cell::{Cell, RefCell};

use nom::IResult;
use nom::error::{ErrorKind, ParseError};

use super::ast::*;
use tokens::is_ident_char;

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
