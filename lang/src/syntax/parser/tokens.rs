//! Tokens and the pieces every parser shares: whitespace and comments, names, keywords, expected characters,
//! the nesting guard, spans, and how a syntax error is built and described ("expected X, found Y").

use std::cell::Cell;

use nom::Parser as _;
use nom::bytes::complete::take_while;
use nom::character::complete::{char, satisfy};
use nom::combinator::recognize;
use nom::sequence::pair;

use super::{MAX_DEPTH, P, PError, PResult, SyntaxError};
use crate::syntax::ast::{Ident, Span};

pub(super) fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

pub(super) fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

/// Decrements the nesting depth when dropped.
pub(super) struct DepthGuard<'a>(&'a Cell<u32>);

impl Drop for DepthGuard<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

pub(super) fn fail<T>(
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

pub(super) fn fail_help<T>(
    i: &str,
    len: usize,
    message: impl Into<String>,
    label: impl Into<String>,
    help: impl Into<String>,
) -> Result<T, nom::Err<PError>> {
    fail(i, len, message, label).map_err(|e| with_help(e, help))
}

/// The error `e` with `help` added.
pub(super) fn with_help(e: nom::Err<PError>, help: impl Into<String>) -> nom::Err<PError> {
    e.map(|e| PError {
        help: Some(help.into()),
        ..e
    })
}

/// A short description of what starts at `i`, for "expected X, found Y".
pub(super) fn found(i: &str) -> String {
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

pub(super) fn token_len(i: &str) -> usize {
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
    pub(super) fn off(&self, i: &str) -> u32 {
        (self.src.len() - i.len()) as u32
    }

    pub(super) fn span(&self, start: &str, end: &str) -> Span {
        Span::new(self.off(start), self.off(end))
    }

    pub(super) fn syntax_error(&self, e: PError) -> SyntaxError {
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

    pub(super) fn enter(&self, i: &str) -> Result<DepthGuard<'_>, nom::Err<PError>> {
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
    pub(super) fn ws(&self, mut i: &'s str) -> &'s str {
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
    pub(super) fn ws_lines(&self, i: &'s str, multiline: &mut bool) -> &'s str {
        let rest = self.ws(i);
        if i[..i.len() - rest.len()].contains('\n') {
            *multiline = true;
        }
        rest
    }

    pub(super) fn ident(&self, i: &'s str) -> PResult<'s, Ident> {
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
    pub(super) fn expect_ident(&self, i: &'s str, what: &str) -> PResult<'s, Ident> {
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

    pub(super) fn keyword(&self, i: &'s str, kw: &str) -> Option<&'s str> {
        let rest = i.strip_prefix(kw)?;
        if rest.starts_with(is_ident_char) {
            None
        } else {
            Some(rest)
        }
    }

    /// The input after the keyword `kw` at `i`, or the error "expected `kw`{context}, found ...".
    pub(super) fn expect_keyword(
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

    pub(super) fn expect_char(&self, i: &'s str, c: char, context: &str) -> PResult<'s, ()> {
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
