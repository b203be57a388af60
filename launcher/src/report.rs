//! The run's events and its report: what every engine (the supervisor, sbatch, kubectl) tells the caller while a
//! run goes on ([`Event`] through an [`EventSink`]) and when it ends ([`RunReport`]), and the line splitting they share.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use std::net::SocketAddr;

use crate::process::signal_name;

/// Lines of stderr kept per rank for the failure summary.
pub const STDERR_TAIL_LINES: usize = 20;
/// Longest console line; longer ones are split.
const MAX_LINE_BYTES: usize = 64 * 1024;
/// Exit code for a step that ran past its `timeout` or its start timeout (like timeout(1)).
pub const TIMEOUT_EXIT_CODE: u8 = 124;

/// Which output stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// What happens during a run, for the caller to show.
#[derive(Debug, Clone)]
pub enum Event {
    StepSkipped {
        step: String,
    },
    StepStarted {
        step: String,
        workers: Option<u32>,
        rendezvous: Option<SocketAddr>,
    },
    StepFinished {
        step: String,
        elapsed: Duration,
    },
    /// One line of a worker's output (without the line break).
    Line {
        step: Arc<str>,
        host: Arc<str>,
        rank: u32,
        stream: Stream,
        text: String,
    },
    /// The job is being stopped, and why.
    Stopping {
        reason: String,
    },
    /// Something the user should know while waiting (e.g. why a batch job or a pod has not started).
    Note {
        text: String,
    },
    /// The run's jobs were submitted and go on without the launcher (`--detach`): their ids, and where their
    /// output goes.
    Detached {
        job_ids: Vec<String>,
        output_dir: PathBuf,
    },
}

/// Receives [`Event`]s from several threads.
pub trait EventSink: Sync {
    fn event(&self, event: Event);
}

impl<F: Fn(Event) + Sync> EventSink for F {
    fn event(&self, event: Event) {
        self(event)
    }
}

/// How one worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    Code(i32),
    Signal(i32),
    /// The process standing for a remote rank (the slurm engine's srun) exited 0, but the rank never reported
    /// that it finished: its node went away under it.
    Lost,
}

impl WorkerExit {
    /// The exit code `hvd run` passes through: the code, or 128 + signal.
    pub fn code(self) -> u8 {
        match self {
            WorkerExit::Code(c) => u8::try_from(c).unwrap_or(1),
            WorkerExit::Signal(s) => u8::try_from(128 + s).unwrap_or(255),
            WorkerExit::Lost => 1,
        }
    }
}

impl std::fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerExit::Code(c) => write!(f, "exit code {c}"),
            WorkerExit::Signal(s) => write!(f, "killed by {}", signal_name(*s)),
            WorkerExit::Lost => write!(f, "its node was lost: no exit status from it"),
        }
    }
}

/// The root cause of a failed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// The earliest worker to fail.
    Worker {
        rank: u32,
        host: String,
        exit: WorkerExit,
    },
    /// The step ran past its `timeout`.
    Timeout { after: Duration },
    /// Not every rank joined the rendezvous in time.
    StartTimeout { missing: Vec<u32>, after: Duration },
    /// `hvd run` got SIGINT/SIGTERM.
    Interrupted { signal: i32 },
    /// An elastic step lost workers until fewer than its minimum were left; `rank` is the last one lost (its slot).
    BelowMinimum {
        rank: u32,
        host: String,
        exit: WorkerExit,
        left: u32,
        min: u32,
    },
    /// Host discovery of an elastic step would have started more workers in one attempt than its cap.
    StartCap { cap: u32 },
    /// A step that ran under a launcher of its own (`hvd run` in the step's slurm batch job: an elastic step, or one
    /// with restarts) failed; `job` names where, and the launcher's last lines of stderr (the tail) say why.
    Launcher { job: String, exit: WorkerExit },
}

/// What the run's failure summary says.
#[derive(Debug, Clone)]
pub struct FailureSummary {
    pub step: String,
    pub cause: Cause,
    /// `hvd run`'s exit code.
    pub exit_code: u8,
    /// The failing rank's last lines of stderr (empty for causes without a rank).
    pub stderr_tail: Vec<String>,
    /// The failing step's per-rank logs.
    pub log_dir: PathBuf,
}

/// The outcome of a whole run.
#[derive(Debug, Clone)]
pub struct RunReport {
    pub run_id: String,
    /// `.hvd/runs/<run-id>`.
    pub log_dir: PathBuf,
    pub ran: Vec<String>,
    pub skipped: Vec<String>,
    pub failure: Option<FailureSummary>,
    /// The run goes on without the launcher (`--detach`): nothing has finished yet.
    pub detached: bool,
    /// Steps started again after a rank failed (`restarts`, `--max-restarts`), and how many times.
    pub restarts: std::collections::BTreeMap<String, u32>,
    /// Workers (slots) of elastic steps that were preempted (SIGTERM, then their last commit and a hand-over), by
    /// step: not failures.
    pub preempted: std::collections::BTreeMap<String, Vec<u32>>,
}

impl RunReport {
    /// The report of run `run_id` logging under `log_dir` before anything has happened: nothing ran, was skipped or
    /// failed.
    pub fn new(run_id: String, log_dir: PathBuf) -> Self {
        RunReport {
            run_id,
            log_dir,
            ran: Vec::new(),
            skipped: Vec::new(),
            failure: None,
            detached: false,
            restarts: std::collections::BTreeMap::new(),
            preempted: std::collections::BTreeMap::new(),
        }
    }
}

/// A sortable id for a run: UTC time and the launcher's pid.
pub fn new_run_id() -> String {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}-{}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        std::process::id()
    )
}

/// Splits a byte stream into lines at `\n`, `\r\n` and lone `\r` (progress bars); a line longer than
/// `MAX_LINE_BYTES` comes out in pieces of that size.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
    after_cr: bool,
    /// The last piece emitted was cut at `MAX_LINE_BYTES`, or ended at a lone `\r` (a progress bar redrawing its
    /// line): the next one continues its line.
    cut: bool,
}

impl LineSplitter {
    pub fn push(&mut self, data: &[u8], emit: &mut impl FnMut(&[u8])) {
        self.push_pieces(data, &mut |piece, _| emit(piece));
    }

    /// [`LineSplitter::push`], telling `emit` whether a piece continues a line cut before it, at the length limit or
    /// at a lone `\r` (whose rest a reader must not take for a line of its own: its start is whatever the writer put
    /// there; srun, for one, labels only what follows a `\n`).
    pub fn push_pieces(&mut self, data: &[u8], emit: &mut impl FnMut(&[u8], bool)) {
        for &b in data {
            match b {
                b'\n' if self.after_cr => {
                    // `\r\n`: the line ended at its `\r`.
                    self.after_cr = false;
                    self.cut = false;
                }
                b'\n' | b'\r' => {
                    emit(&self.buf, self.cut);
                    self.buf.clear();
                    self.cut = b == b'\r';
                    self.after_cr = b == b'\r';
                }
                _ => {
                    self.after_cr = false;
                    self.buf.push(b);
                    if self.buf.len() >= MAX_LINE_BYTES {
                        emit(&self.buf, self.cut);
                        self.buf.clear();
                        self.cut = true;
                    }
                }
            }
        }
    }

    pub fn finish(&mut self, emit: &mut impl FnMut(&[u8])) {
        self.finish_pieces(&mut |piece, _| emit(piece));
    }

    /// [`LineSplitter::finish`] as [`LineSplitter::push_pieces`] tells it.
    pub fn finish_pieces(&mut self, emit: &mut impl FnMut(&[u8], bool)) {
        if !self.buf.is_empty() {
            emit(&self.buf, self.cut);
            self.buf.clear();
        }
        self.cut = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]]) -> Vec<String> {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        let mut emit = |l: &[u8]| out.push(String::from_utf8_lossy(l).into_owned());
        for c in chunks {
            s.push(c, &mut emit);
        }
        s.finish(&mut emit);
        out
    }

    #[test]
    fn splits_on_newlines_and_carriage_returns() {
        assert_eq!(split(&[b"a\nb\r\nc\rd"]), ["a", "b", "c", "d"]);
        assert_eq!(split(&[b"a\r", b"\nb\n\n"]), ["a", "b", ""]);
        assert_eq!(split(&[b"10%\r20%\r100%\n"]), ["10%", "20%", "100%"]);
    }

    #[test]
    fn exit_codes_pass_through() {
        assert_eq!(WorkerExit::Code(3).code(), 3);
        assert_eq!(WorkerExit::Signal(9).code(), 137);
        assert_eq!(WorkerExit::Signal(9).to_string(), "killed by SIGKILL");
    }

    #[test]
    fn run_ids_sort_by_time() {
        let id = new_run_id();
        assert_eq!(
            id.len(),
            "20260101-000000-".len() + std::process::id().to_string().len()
        );
        assert!(id.starts_with("20"));
    }
}
