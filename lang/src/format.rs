//! The formatter: prints the AST in one canonical layout and puts the comments back.
//!
//! Layout rules (see docs/language.md):
//! - one item per line; blank lines between items and entries are kept, at most one in a row;
//! - a list, attribute set, block or parameter list stays on one line if the source had it on one line and
//!   it holds no comment; otherwise each entry goes on its own line, indented by two spaces, list items with a
//!   trailing comma, and the `=` of the entries of one attribute set aligned;
//! - single spaces around `=`, `=>` and operators, `{ a = 1 }` and `[1, 2]` inside;
//! - strings are re-escaped canonically; numbers are printed as written.
//!
//! Comments are attached by position: a comment on the same line after something stays there (trailing,
//! with the spacing before it kept, since people align such comments),
//! every other comment goes on its own line before the next thing printed at a line start. Because the
//! one-line/multi-line choice is read from newlines between tokens (never inside strings), printing the
//! output again gives the same output.

use crate::syntax::ast::*;

const INDENT: &str = "  ";

pub(crate) fn format_file(src: &str, file: &File) -> String {
    let mut p = Printer {
        src,
        comments: &file.comments,
        next: 0,
        out: String::new(),
        indent: 0,
    };
    let mut cursor: Option<u32> = None;
    for item in &file.items {
        p.leading(item.span.start, cursor);
        p.item(item);
        let end = p.trailing(item.span.end);
        p.out.push('\n');
        cursor = Some(end);
    }
    p.leading(src.len() as u32, cursor);
    let trimmed = p.out.trim_end();
    if trimmed.is_empty() {
        String::new()
    } else {
        format!("{trimmed}\n")
    }
}

struct Printer<'a> {
    src: &'a str,
    comments: &'a [Span],
    /// Index of the first comment not printed yet.
    next: usize,
    out: String,
    indent: usize,
}

impl Printer<'_> {
    fn text(&self, span: Span) -> &str {
        self.src
            .get(span.start as usize..span.end as usize)
            .unwrap_or("")
    }

    /// Whether the source between two offsets holds an empty line.
    fn blank_between(&self, from: u32, to: u32) -> bool {
        let gap = self.src.get(from as usize..to as usize).unwrap_or("");
        let mut newlines = 0;
        for c in gap.chars() {
            match c {
                '\n' => {
                    newlines += 1;
                    if newlines >= 2 {
                        return true;
                    }
                }
                ' ' | '\t' | '\r' => {}
                _ => newlines = 0,
            }
        }
        false
    }

    fn newline_between(&self, from: u32, to: u32) -> bool {
        self.src
            .get(from as usize..to as usize)
            .is_some_and(|gap| gap.contains('\n'))
    }

    /// Whether a comment not printed yet lies between the children of a bracketed construct (`span` is from
    /// the opening to the closing bracket, `children` the spans inside). Comments nested deeper don't count:
    /// they belong to the children.
    fn has_comment_between(&self, span: Span, children: impl Iterator<Item = Span>) -> bool {
        let mut from = span.start + 1;
        let unprinted = &self.comments[self.next.min(self.comments.len())..];
        let in_gap = |a: u32, b: u32| unprinted.iter().any(|c| c.start >= a && c.start < b);
        for child in children {
            if in_gap(from, child.start) {
                return true;
            }
            from = child.end;
        }
        in_gap(from, span.end.saturating_sub(1))
    }

    fn push_indent(&mut self) {
        for _ in 0..self.indent {
            self.out.push_str(INDENT);
        }
    }

    /// At a line start: print the comments before `before` on their own lines. `cursor` is the end of the
    /// previous thing in the same container (`None` at its start: no blank line there).
    fn leading(&mut self, before: u32, cursor: Option<u32>) {
        self.leading_inner(before, cursor, false);
    }

    /// Before a closing bracket: like [`Self::leading`], without a blank line at the end.
    fn leading_closing(&mut self, before: u32, cursor: Option<u32>) {
        self.leading_inner(before, cursor, true);
    }

    fn leading_inner(&mut self, before: u32, mut cursor: Option<u32>, closing: bool) {
        while let Some(&c) = self.comments.get(self.next) {
            if c.start >= before {
                break;
            }
            if cursor.is_some_and(|cur| self.blank_between(cur, c.start)) {
                self.out.push('\n');
            }
            self.push_indent();
            let text = self.text(c).to_string();
            self.out.push_str(&text);
            self.out.push('\n');
            cursor = Some(c.end);
            self.next += 1;
        }
        if !closing && cursor.is_some_and(|cur| self.blank_between(cur, before)) {
            self.out.push('\n');
        }
    }

    /// After something at `after`: print a comment that follows it on the same source line.
    fn trailing(&mut self, after: u32) -> u32 {
        // Comments inside what was just printed (if any were not placed) come first in order; skip none.
        if let Some(&c) = self.comments.get(self.next)
            && c.start >= after
            && self
                .src
                .get(after as usize..c.start as usize)
                .is_some_and(|gap| gap.chars().all(|ch| matches!(ch, ' ' | '\t' | ',')))
        {
            // Keep the author's spacing before a trailing comment (people align them), at least one space.
            let gap = self.src.get(after as usize..c.start as usize).unwrap_or("");
            let spaces = gap
                .chars()
                .rev()
                .take_while(|ch| *ch == ' ' || *ch == '\t')
                .count()
                .max(1);
            for _ in 0..spaces {
                self.out.push(' ');
            }
            let text = self.text(c).to_string();
            self.out.push_str(&text);
            self.next += 1;
            return c.end;
        }
        after
    }

    fn item(&mut self, item: &Item) {
        match &item.kind {
            ItemKind::Project(e) => {
                self.out.push_str("project ");
                self.expr(e);
            }
            ItemKind::ImportStd { alias } => {
                self.out.push_str("import std");
                if let Some(alias) = alias {
                    self.out.push_str(" as ");
                    self.out.push_str(&alias.name);
                }
            }
            ItemKind::ImportFile { path, alias, .. } => {
                self.out.push_str("import ");
                self.out.push_str(&quote(&[StrPart::Lit(path.clone())]));
                self.out.push_str(" as ");
                self.out.push_str(&alias.name);
            }
            ItemKind::Let { name, value } => {
                self.out.push_str("let ");
                self.out.push_str(&name.name);
                self.out.push_str(" = ");
                self.expr(value);
            }
            ItemKind::Block { kind, body, .. } => {
                self.out.push_str(kind.keyword());
                self.out.push(' ');
                self.attrs(body);
            }
            ItemKind::Step { name, body } => {
                self.out.push_str("step ");
                self.out.push_str(&name.name);
                self.out.push(' ');
                self.attrs(body);
            }
        }
    }

    fn key_text(&mut self, key: &Key) -> String {
        match &key.kind {
            KeyKind::Ident(name) => name.clone(),
            KeyKind::Str(parts) => self.quoted(parts),
        }
    }

    fn attrs(&mut self, a: &Attrs) {
        let commented = self.has_comment_between(a.span, a.entries.iter().map(|e| e.span));
        if a.entries.is_empty() && !commented {
            self.out.push_str("{}");
            return;
        }
        let multiline = a.multiline || commented;
        if !multiline {
            self.out.push_str("{ ");
            for (n, entry) in a.entries.iter().enumerate() {
                if n > 0 {
                    self.out.push_str(", ");
                }
                self.entry(entry, 0);
            }
            self.out.push_str(" }");
            return;
        }
        let width = a
            .entries
            .iter()
            .filter_map(|e| match &e.kind {
                EntryKind::Field { key, .. } => Some(self.key_width(key)),
                EntryKind::For { .. } => None,
            })
            .max()
            .unwrap_or(0);
        self.out.push('{');
        let mut cursor = Some(self.trailing(a.span.start + 1));
        // The first entry never gets a blank line before it.
        let mut first = true;
        self.out.push('\n');
        self.indent += 1;
        for entry in &a.entries {
            self.leading(entry.span.start, if first { None } else { cursor });
            first = false;
            self.push_indent();
            self.entry(entry, width);
            cursor = Some(self.trailing(entry.span.end));
            self.out.push('\n');
        }
        self.leading_closing(
            a.span.end.saturating_sub(1),
            if a.entries.is_empty() { None } else { cursor },
        );
        self.indent -= 1;
        self.push_indent();
        self.out.push('}');
    }

    fn key_width(&self, key: &Key) -> usize {
        match &key.kind {
            KeyKind::Ident(name) => name.chars().count(),
            // Quoted keys are printed canonically; measure that form.
            KeyKind::Str(parts) => {
                let mut scratch = Printer {
                    src: self.src,
                    comments: &[],
                    next: 0,
                    out: String::new(),
                    indent: 0,
                };
                scratch.quoted(parts).chars().count()
            }
        }
    }

    fn entry(&mut self, entry: &Entry, width: usize) {
        match &entry.kind {
            EntryKind::Field { key, value } => {
                let k = self.key_text(key);
                let pad = width.saturating_sub(k.chars().count());
                self.out.push_str(&k);
                for _ in 0..pad {
                    self.out.push(' ');
                }
                self.out.push_str(" = ");
                self.expr(value);
            }
            EntryKind::For {
                var,
                iter,
                key,
                value,
            } => {
                self.out.push_str("for ");
                self.out.push_str(&var.name);
                self.out.push_str(" in ");
                self.expr(iter);
                self.out.push_str(": ");
                let k = self.key_text(key);
                self.out.push_str(&k);
                self.out.push_str(" = ");
                self.expr(value);
            }
        }
    }

    fn expr(&mut self, e: &Expr) {
        match &e.kind {
            ExprKind::None => self.out.push_str("none"),
            ExprKind::Bool(b) => self.out.push_str(if *b { "true" } else { "false" }),
            ExprKind::Number { text, .. } => self.out.push_str(text),
            ExprKind::Str(parts) => {
                let q = self.quoted(parts);
                self.out.push_str(&q);
            }
            ExprKind::Ref(id) => self.out.push_str(&id.name),
            ExprKind::List { items, multiline } => self.list(e.span, items, *multiline),
            ExprKind::ListFor { var, iter, body } => {
                self.out.push_str("[for ");
                self.out.push_str(&var.name);
                self.out.push_str(" in ");
                self.expr(iter);
                self.out.push_str(": ");
                self.expr(body);
                self.out.push(']');
            }
            ExprKind::Attrs(a) => self.attrs(a),
            ExprKind::Field { base, name } => {
                self.expr(base);
                self.out.push('.');
                self.out.push_str(&name.name);
            }
            ExprKind::Call { callee, args } => {
                self.expr(callee);
                self.out.push(' ');
                self.attrs(args);
            }
            ExprKind::Builtin { name, args } => {
                self.out.push_str(&name.name);
                self.out.push('(');
                self.on_one_line(args);
                self.out.push(')');
            }
            ExprKind::Not(inner) => {
                self.out.push('!');
                self.expr(inner);
            }
            ExprKind::Binary { op, lhs, rhs } => {
                self.expr(lhs);
                // A chain the author broke over lines stays broken before the operator.
                if self.newline_between(lhs.span.end, rhs.span.start) {
                    self.out.push('\n');
                    self.indent += 1;
                    self.push_indent();
                    self.indent -= 1;
                } else {
                    self.out.push(' ');
                }
                self.out.push_str(op.symbol());
                self.out.push(' ');
                self.expr(rhs);
            }
            ExprKind::If {
                cond,
                then,
                otherwise,
            } => {
                self.out.push_str("if ");
                self.expr(cond);
                self.out.push_str(" then ");
                self.expr(then);
                self.out.push_str(" else ");
                self.expr(otherwise);
            }
            ExprKind::Recipe(def) => self.recipe(def),
            ExprKind::Paren(inner) => {
                self.out.push('(');
                self.expr(inner);
                self.out.push(')');
            }
        }
    }

    /// `a, b, c`: expressions separated by commas on one line.
    fn on_one_line(&mut self, exprs: &[Expr]) {
        for (n, e) in exprs.iter().enumerate() {
            if n > 0 {
                self.out.push_str(", ");
            }
            self.expr(e);
        }
    }

    fn list(&mut self, span: Span, items: &[Expr], multiline: bool) {
        let commented = self.has_comment_between(span, items.iter().map(|i| i.span));
        if items.is_empty() && !commented {
            self.out.push_str("[]");
            return;
        }
        if !(multiline || commented) {
            self.out.push('[');
            self.on_one_line(items);
            self.out.push(']');
            return;
        }
        self.out.push('[');
        let mut cursor = Some(self.trailing(span.start + 1));
        self.out.push('\n');
        self.indent += 1;
        for (n, item) in items.iter().enumerate() {
            self.leading(item.span.start, if n == 0 { None } else { cursor });
            self.push_indent();
            self.expr(item);
            self.out.push(',');
            cursor = Some(self.trailing(item.span.end));
            self.out.push('\n');
        }
        self.leading_closing(
            span.end.saturating_sub(1),
            if items.is_empty() { None } else { cursor },
        );
        self.indent -= 1;
        self.push_indent();
        self.out.push(']');
    }

    fn recipe(&mut self, def: &RecipeDef) {
        self.out.push_str("recipe ");
        let span = def.params_span;
        let commented = self.has_comment_between(
            span,
            def.params.iter().map(|p| {
                Span::new(
                    p.name.span.start,
                    p.default.as_ref().map_or(p.name.span.end, |d| d.span.end),
                )
            }),
        );
        if def.params.is_empty() && !commented {
            self.out.push_str("{}");
        } else if !(def.params_multiline || commented) {
            self.out.push_str("{ ");
            for (n, param) in def.params.iter().enumerate() {
                if n > 0 {
                    self.out.push_str(", ");
                }
                self.param(param);
            }
            self.out.push_str(" }");
        } else {
            self.out.push('{');
            let mut cursor = Some(self.trailing(span.start + 1));
            self.out.push('\n');
            self.indent += 1;
            for (n, param) in def.params.iter().enumerate() {
                self.leading(param.name.span.start, if n == 0 { None } else { cursor });
                self.push_indent();
                self.param(param);
                self.out.push(',');
                let end = param
                    .default
                    .as_ref()
                    .map_or(param.name.span.end, |d| d.span.end);
                cursor = Some(self.trailing(end));
                self.out.push('\n');
            }
            self.leading_closing(
                span.end.saturating_sub(1),
                if def.params.is_empty() { None } else { cursor },
            );
            self.indent -= 1;
            self.push_indent();
            self.out.push('}');
        }
        if self.newline_between(span.end, def.body.span.start) {
            // A body the author put on its own line stays there, one level deeper.
            self.out.push_str(" =>\n");
            self.indent += 1;
            self.push_indent();
            self.expr(&def.body);
            self.indent -= 1;
        } else {
            self.out.push_str(" => ");
            self.expr(&def.body);
        }
    }

    fn param(&mut self, param: &Param) {
        self.out.push_str(&param.name.name);
        if let Some(default) = &param.default {
            self.out.push_str(" = ");
            self.expr(default);
        }
    }

    fn quoted(&mut self, parts: &[StrPart]) -> String {
        // Interpolated expressions print through the same printer, into a scratch buffer.
        let mut s = String::from("\"");
        for part in parts {
            match part {
                StrPart::Lit(text) => s.push_str(&escape(text)),
                StrPart::Interp(e) => {
                    let saved = std::mem::take(&mut self.out);
                    self.expr(e);
                    let inner = std::mem::replace(&mut self.out, saved);
                    s.push_str("${");
                    s.push_str(&inner);
                    s.push('}');
                }
            }
        }
        s.push('"');
        s
    }
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '$' if chars.peek() == Some(&'{') => out.push_str("\\$"),
            c => out.push(c),
        }
    }
    out
}

fn quote(parts: &[StrPart]) -> String {
    let mut s = String::from("\"");
    for part in parts {
        if let StrPart::Lit(text) = part {
            s.push_str(&escape(text));
        }
    }
    s.push('"');
    s
}

#[cfg(test)]
mod tests {
    use crate::format_source;

    fn fmt(src: &str) -> String {
        format_source("test.hvd", src).expect("parses")
    }

    #[test]
    fn aligns_and_keeps_comments() {
        let src = "# head\nlet a=1   # one\n\n\n\nenv {\n python = \"3.11\" # py\n    # before packages\n packages=[ \"a\",\n\"b\" ] }\n";
        let want = "# head\nlet a = 1   # one\n\nenv {\n  python   = \"3.11\" # py\n  # before packages\n  packages = [\n    \"a\",\n    \"b\",\n  ]\n}\n";
        assert_eq!(fmt(src), want);
        assert_eq!(fmt(want), want);
    }

    #[test]
    fn single_line_stays_single_line() {
        let src = "resources {gpus=4,cpus=12,mem=10GiB}\nlet l=[1,2 , 3]\n";
        assert_eq!(
            fmt(src),
            "resources { gpus = 4, cpus = 12, mem = 10GiB }\nlet l = [1, 2, 3]\n"
        );
    }

    #[test]
    fn strings_are_escaped_canonically() {
        let src = "let s = \"a\\\"b\\${x}${ y }\tz\"\n";
        assert_eq!(fmt(src), "let s = \"a\\\"b\\${x}${y}\\tz\"\n");
    }

    #[test]
    fn the_stdlib_is_formatted() {
        for (name, text) in crate::stdlib::FILES {
            assert_eq!(&fmt(text), text, "stdlib/{name} is not in canonical layout");
        }
    }
}
