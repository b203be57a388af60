//! Diagnostics: every error found while loading a file, each pointing into its source with labelled spans.

use std::fmt;
use std::sync::Arc;

use miette::{Diagnostic, LabeledSpan, NamedSource, SourceSpan};

use crate::syntax::ast::Span;

/// One source file known to a load: its display name and text.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    pub name: String,
    pub text: Arc<str>,
}

/// Index of a file in [`Sources`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct FileId(pub u32);

/// A span in a particular file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub file: FileId,
    pub span: Span,
}

/// Every source file read during one load.
#[derive(Debug, Default)]
pub(crate) struct Sources {
    files: Vec<Source>,
}

impl Sources {
    pub fn add(&mut self, name: String, text: Arc<str>) -> FileId {
        self.files.push(Source { name, text });
        FileId((self.files.len() - 1) as u32)
    }

    pub fn get(&self, id: FileId) -> &Source {
        &self.files[id.0 as usize]
    }
}

/// A problem found before the model is complete, still in terms of file ids.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub loc: Option<Loc>,
    pub message: String,
    pub label: String,
    pub help: Option<String>,
    /// More labels in the same file.
    pub others: Vec<(Span, String)>,
}

impl Problem {
    pub fn new(loc: Loc, message: impl Into<String>, label: impl Into<String>) -> Self {
        Problem {
            loc: Some(loc),
            message: message.into(),
            label: label.into(),
            help: None,
            others: Vec::new(),
        }
    }

    pub fn without_location(message: impl Into<String>) -> Self {
        Problem {
            loc: None,
            message: message.into(),
            label: String::new(),
            help: None,
            others: Vec::new(),
        }
    }

    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    pub fn maybe_help(mut self, help: Option<String>) -> Self {
        self.help = help;
        self
    }

    pub fn also(mut self, span: Span, label: impl Into<String>) -> Self {
        self.others.push((span, label.into()));
        self
    }

    fn into_error(self, sources: &Sources) -> Error {
        let (src, labels) = match self.loc {
            Some(loc) => {
                let source = sources.get(loc.file);
                let named = NamedSource::new(&source.name, Arc::clone(&source.text));
                let mut labels = vec![LabeledSpan::new_primary_with_span(
                    Some(self.label),
                    to_source_span(loc.span),
                )];
                labels.extend(self.others.into_iter().map(|(span, label)| {
                    LabeledSpan::new_with_span(Some(label), to_source_span(span))
                }));
                (Some(named), labels)
            }
            None => (None, Vec::new()),
        };
        Error {
            message: self.message,
            src,
            labels,
            help: self.help,
        }
    }
}

fn to_source_span(span: Span) -> SourceSpan {
    SourceSpan::new((span.start as usize).into(), span.len() as usize)
}

/// One error: a message, where it is (file and labelled spans) and what to do about it.
#[derive(Debug, Clone)]
pub struct Error {
    message: String,
    src: Option<NamedSource<Arc<str>>>,
    labels: Vec<LabeledSpan>,
    help: Option<String>,
}

impl Error {
    /// The one-line message, e.g. "unknown attribute `worker` in step `train`".
    pub fn message(&self) -> &str {
        &self.message
    }

    /// `file:line:col` of the primary label, 1-based, when the error has a location.
    pub fn location(&self) -> Option<(String, usize, usize)> {
        let src = self.src.as_ref()?;
        let offset = self.labels.first()?.offset();
        let text = src.inner();
        let before = &text[..offset.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        Some((src.name().to_string(), line, col))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl Diagnostic for Error {
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        self.src.as_ref().map(|s| s as &dyn miette::SourceCode)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        if self.labels.is_empty() {
            None
        } else {
            Some(Box::new(self.labels.iter().cloned()))
        }
    }
}

/// At most this many errors are rendered; the rest are counted.
const MAX_SHOWN: usize = 100;

/// Every problem found while loading a file (several per run), renderable with miette.
///
/// Render it with `miette::Report::new(diagnostics)` (each error is a related diagnostic with its own source
/// and labels) or, without colours, with [`Diagnostics::render_plain`].
#[derive(Debug, Clone)]
pub struct Diagnostics {
    file: String,
    errors: Vec<Error>,
}

impl Diagnostics {
    pub(crate) fn from_problems(file: &str, mut problems: Vec<Problem>, sources: &Sources) -> Self {
        // Source order reads best; the sort is stable, so problems at one place keep the order found.
        problems.sort_by_key(|p| p.loc.map(|l| (l.file.0, l.span.start)));
        let total = problems.len();
        let mut errors: Vec<Error> = problems
            .into_iter()
            .take(MAX_SHOWN)
            .map(|p| p.into_error(sources))
            .collect();
        if total > MAX_SHOWN {
            let rest = total - MAX_SHOWN;
            errors.push(Error {
                message: format!(
                    "{rest} more error{} not shown",
                    if rest == 1 { "" } else { "s" }
                ),
                src: None,
                labels: Vec::new(),
                help: Some("fix the errors above first".into()),
            });
        }
        Diagnostics {
            file: file.to_string(),
            errors,
        }
    }

    /// A single error without a source location (e.g. the file cannot be read).
    pub(crate) fn single(file: &str, message: String, help: Option<String>) -> Self {
        Diagnostics {
            file: file.to_string(),
            errors: vec![Error {
                message,
                src: None,
                labels: Vec::new(),
                help,
            }],
        }
    }

    /// The errors, in the order they were found.
    pub fn errors(&self) -> &[Error] {
        &self.errors
    }

    /// Render every error as plain text (no colours, unicode frames, fixed width): for tests and logs.
    pub fn render_plain(&self) -> String {
        let handler =
            miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
                .with_width(100)
                .with_links(false);
        let mut out = String::new();
        for error in &self.errors {
            if handler.render_report(&mut out, error).is_err() {
                out.push_str(&error.message);
            }
            out.push('\n');
        }
        out
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.errors.len() {
            1 => write!(f, "`{}` has 1 error", self.file),
            n => write!(f, "`{}` has {n} errors", self.file),
        }
    }
}

impl std::error::Error for Diagnostics {}

impl Diagnostic for Diagnostics {
    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn Diagnostic> + 'a>> {
        Some(Box::new(self.errors.iter().map(|e| e as &dyn Diagnostic)))
    }
}

/// The candidate closest to `name`, if it is close enough to be a plausible typo.
pub(crate) fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let mut best: Option<(f64, &str)> = None;
    for candidate in candidates {
        if candidate == name {
            continue;
        }
        let score = strsim::jaro_winkler(&name.to_lowercase(), &candidate.to_lowercase());
        if score >= 0.8 && best.is_none_or(|(s, _)| score > s) {
            best = Some((score, candidate));
        }
    }
    best.map(|(_, c)| c)
}

/// "did you mean `x`?" for [`Problem::maybe_help`].
pub(crate) fn suggestion<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    did_you_mean(name, candidates).map(|c| format!("did you mean `{c}`?"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_close_names_only() {
        assert_eq!(
            did_you_mean("worker", ["workers", "run", "needs"]),
            Some("workers")
        );
        assert_eq!(
            did_you_mean("prepar", ["prepare", "train"]),
            Some("prepare")
        );
        assert_eq!(did_you_mean("zzz", ["workers", "run"]), None);
    }
}
