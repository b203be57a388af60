//! Exit codes of `hvd`, documented in docs/cli.md. Keep the two in step.

/// What a command ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// 0: everything asked for was done.
    Success,
    /// 1: the command ran and failed (a build failed, `fmt --check` found unformatted files, ...).
    Failure,
    /// 2: bad usage or bad input (unknown flag, unknown engine, a .hvd file with errors).
    Usage,
    /// 3: `--locked`/`lock --check`: the lockfile no longer matches the .hvd file.
    LockStale,
    /// 4: `build --check`: a rebuild produced different bytes.
    NotReproducible,
    /// A worker's own exit code, passed through by `hvd run` (128 + signal for signals).
    Worker(u8),
}

impl Status {
    pub fn code(self) -> u8 {
        match self {
            Status::Success => 0,
            Status::Failure => 1,
            Status::Usage => 2,
            Status::LockStale => 3,
            Status::NotReproducible => 4,
            Status::Worker(code) => code,
        }
    }
}

/// A failed command: what to print and how to exit.
#[derive(Debug)]
pub struct Failure {
    pub report: miette::Report,
    pub status: Status,
}

impl Failure {
    pub fn new(status: Status, report: impl Into<miette::Report>) -> Self {
        Failure {
            report: report.into(),
            status,
        }
    }

    pub fn usage(message: impl std::fmt::Display) -> Self {
        Failure::new(Status::Usage, miette::miette!("{message}"))
    }
}

pub type CommandResult = Result<Status, Failure>;

impl Failure {
    /// `error` with its whole `source()` chain, each cause once: a cause whose text its parent's message already
    /// holds (thiserror's `{0}`, `#[error(transparent)]`) is left out. Exit with `status`.
    pub fn from_error(status: Status, error: &(dyn std::error::Error + 'static)) -> Self {
        Failure::new(status, Chain::of(None, error, None))
    }

    /// [`Failure::from_error`] with `context` in front of the top message ("failed to lock: ...").
    pub fn from_error_in(
        status: Status,
        context: impl std::fmt::Display,
        error: &(dyn std::error::Error + 'static),
    ) -> Self {
        Failure::new(status, Chain::of(Some(context.to_string()), error, None))
    }

    /// [`Failure::from_error_in`] with a `help` line under the chain.
    pub fn from_error_with_help(
        status: Status,
        context: impl std::fmt::Display,
        error: &(dyn std::error::Error + 'static),
        help: impl std::fmt::Display,
    ) -> Self {
        Failure::new(
            status,
            Chain::of(Some(context.to_string()), error, Some(help.to_string())),
        )
    }
}

/// The causes of an error, rendered by miette under the top message (`├─▶`, or `Caused by:` without graphics).
#[derive(Debug)]
struct Chain {
    message: String,
    help: Option<String>,
    cause: Option<Box<Cause>>,
}

#[derive(Debug)]
struct Cause {
    message: String,
    next: Option<Box<Cause>>,
}

impl Chain {
    fn of(
        context: Option<String>,
        error: &(dyn std::error::Error + 'static),
        help: Option<String>,
    ) -> miette::Report {
        let top = error.to_string();
        let message = match context {
            Some(context) => format!("{context}: {top}"),
            None => top,
        };
        let mut shown = vec![message.clone()];
        let mut causes = Vec::new();
        let mut source = error.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            let text = text.trim();
            if !text.is_empty() && !shown.iter().any(|s| s.contains(text)) {
                shown.push(text.to_string());
                causes.push(text.to_string());
            }
            source = cause.source();
        }
        let cause = causes.into_iter().rev().fold(None, |next, message| {
            Some(Box::new(Cause { message, next }))
        });
        miette::Report::new(Chain {
            message,
            help,
            cause,
        })
    }
}

impl std::fmt::Display for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Chain {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.as_deref().map(|c| c as _)
    }
}

impl miette::Diagnostic for Chain {
    fn help<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        self.help.as_ref().map(|h| Box::new(h) as _)
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.next.as_deref().map(|c| c as _)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Inner;

    impl std::fmt::Display for Inner {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection refused")
        }
    }

    impl std::error::Error for Inner {}

    /// `embeds`: the message holds the cause's text, as thiserror's `{0}` does.
    #[derive(Debug)]
    struct Outer {
        embeds: bool,
        inner: Inner,
    }

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            if self.embeds {
                write!(f, "bad thing: {}", self.inner)
            } else {
                f.write_str("failed to fetch `http://x/`")
            }
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.inner)
        }
    }

    const FETCH: Outer = Outer {
        embeds: false,
        inner: Inner,
    };

    fn causes(failure: &Failure) -> Vec<String> {
        failure.report.chain().map(|e| e.to_string()).collect()
    }

    #[test]
    fn renders_every_cause_once() {
        let f = Failure::from_error_in(Status::Usage, "failed to lock", &FETCH);
        assert_eq!(
            causes(&f),
            [
                "failed to lock: failed to fetch `http://x/`",
                "connection refused"
            ]
        );
        assert_eq!(f.status, Status::Usage);
        // The parent already says it: not repeated.
        let f = Failure::from_error(
            Status::Failure,
            &Outer {
                embeds: true,
                inner: Inner,
            },
        );
        assert_eq!(causes(&f), ["bad thing: connection refused"]);
        let io = std::io::Error::other(FETCH);
        let f = Failure::from_error(Status::Failure, &io);
        assert_eq!(
            causes(&f),
            ["failed to fetch `http://x/`", "connection refused"]
        );
    }
}
