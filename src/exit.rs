//! Exit codes of `hvd`, documented in docs/cli.md. Keep the two in step.

/// What a command ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// 0: everything asked for was done.
    Success,
    /// 1: the command ran and failed (a build failed, `fmt --check` found unformatted files, ...).
    Failure,
    /// 2: bad usage or bad input (unknown flag, a .hvd file with errors, a command not implemented yet).
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
