//! A rank's own exit status, reported in its output by the wrapper on its node ([`RankCommand::reports_status`]).
//!
//! A process that stands for a rank on another machine (the slurm engine's `srun` of one task) may exit 0 without
//! the rank having finished: Slurm 22.05's srun does after "Node failure". So such a rank counts as finished only
//! when its wrapper said so: after the rank's command (and everything it left) has ended, the wrapper writes
//! `hvd-rank-status NONCE CODE` as the last line of its stderr, NONCE a random value the launcher wrote on the rank's
//! stdin (never in its environment or on a command line, so the rank's own output cannot carry it, nor can a copy of
//! an earlier run's logs). The launcher's stderr pump scans the raw stream for it (chunks and line lengths do not
//! matter), keeps it out of the rank's lines and log file, and the exit counts as the rank's only with it.
//!
//! [`RankCommand::reports_status`]: crate::engine::RankCommand::reports_status

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::report::WorkerExit;

/// The report's first word.
pub const REPORT_WORD: &str = "hvd-rank-status";
/// The most digits an exit code has in a report (`0`..`255`; longer is not a report).
const MAX_DIGITS: usize = 3;

/// One rank's report, as its stderr pump finds it.
pub struct StatusReport {
    /// `hvd-rank-status NONCE `.
    prefix: Vec<u8>,
    state: Mutex<Scan>,
    changed: Condvar,
}

#[derive(Default)]
struct Scan {
    /// The stream's bytes not yet known to hold no report (at most a report's length).
    carry: Vec<u8>,
    /// Where `carry` starts in the stream.
    carry_at: u64,
    /// The stream's length so far.
    total: u64,
    /// The reported code, and where its report starts and ends in the stream.
    found: Option<(i32, u64, u64)>,
    /// The stream ended (or its pump gave up).
    done: bool,
    /// Since when the pump has found nothing to read (`None` while data comes or the pump is busy with it).
    idle_since: Option<Instant>,
}

impl StatusReport {
    pub fn new(nonce: &str) -> StatusReport {
        StatusReport {
            prefix: format!("{REPORT_WORD} {nonce} ").into_bytes(),
            state: Mutex::new(Scan::default()),
            changed: Condvar::new(),
        }
    }

    fn scan(&self) -> std::sync::MutexGuard<'_, Scan> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Scans the next bytes of the stream.
    pub fn feed(&self, data: &[u8]) {
        let mut scan = self.scan();
        scan.idle_since = None;
        scan.total += data.len() as u64;
        scan.carry.extend_from_slice(data);
        let mut from = 0;
        loop {
            let Some(at) = find(&scan.carry[from..], &self.prefix).map(|i| from + i) else {
                // Keep what could be the start of a report.
                let keep = (self.prefix.len() - 1).min(scan.carry.len() - from);
                from = scan.carry.len() - keep;
                break;
            };
            let rest = &scan.carry[at + self.prefix.len()..];
            let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
            if digits == rest.len() && digits <= MAX_DIGITS {
                // The report so far: wait for its end.
                from = at;
                break;
            }
            if (1..=MAX_DIGITS).contains(&digits) && rest[digits] == b'\n' {
                let code = std::str::from_utf8(&rest[..digits])
                    .ok()
                    .and_then(|d| d.parse().ok())
                    .unwrap_or(1);
                let start = scan.carry_at + at as u64;
                let end = start + (self.prefix.len() + digits + 1) as u64;
                scan.found = Some((code, start, end));
                from = at + self.prefix.len() + digits + 1;
                continue;
            }
            from = at + 1;
        }
        scan.carry.drain(..from);
        scan.carry_at += from as u64;
        if scan.found.is_some() {
            self.changed.notify_all();
        }
    }

    /// The stream has ended: returns the length the rank's log file keeps when the report was its last line
    /// (the report is cut off), else `None`.
    pub fn finish(&self) -> Option<u64> {
        let mut scan = self.scan();
        scan.done = true;
        self.changed.notify_all();
        match scan.found {
            Some((_, start, end)) if end == scan.total => Some(start),
            _ => None,
        }
    }

    /// `line` without the report (what the rank printed before it on that line), or `None` when nothing is left.
    pub fn strip<'a>(&self, line: &'a [u8]) -> Option<&'a [u8]> {
        match find(line, &self.prefix) {
            Some(0) => None,
            Some(at) => Some(&line[..at]),
            None => Some(line),
        }
    }

    /// The pump polled the stream and found nothing to read.
    pub fn idle(&self) {
        let mut scan = self.scan();
        if scan.idle_since.is_none() {
            scan.idle_since = Some(Instant::now());
        }
    }

    /// The code the rank reported, waiting for its stream to end or the report to come: up to `limit` in all, but
    /// only up to `idle` once the pump waits for data that does not come (the rank's process has exited, so
    /// something else holds the stream open). A pump still busy with what the stream held (up to a pipe buffer
    /// of output ahead of the report, a slow sink) is waited for up to `limit`.
    pub fn wait(&self, idle: Duration, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        let deadline = start + limit;
        let mut scan = self.scan();
        while scan.found.is_none() && !scan.done {
            let now = Instant::now();
            let idle_over = scan
                .idle_since
                .is_some_and(|since| now >= since.max(start) + idle);
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() || idle_over {
                break;
            }
            // Woken by the report or the end; the pump's idling is checked every tenth of a second.
            scan = self
                .changed
                .wait_timeout(scan, left.min(Duration::from_millis(100)))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        scan.found.map(|(code, _, _)| code)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The rank's exit from its process's (`exit`) and what it reported: an exit 0 without the report of 0 is
/// [`WorkerExit::Lost`] (its node went away under it); a failure stays what its process said.
pub fn settle(exit: WorkerExit, reported: Option<i32>) -> WorkerExit {
    match (exit, reported) {
        (WorkerExit::Code(0), None) => WorkerExit::Lost,
        (WorkerExit::Code(0), Some(code)) if code != 0 => WorkerExit::Code(code),
        (exit, _) => exit,
    }
}

/// Why a rank's process said it ended, when it said: the last `srun: error:` line of its stderr tail (its node
/// failed, its step was cancelled).
pub fn launcher_reason(tail: &[String]) -> Option<&str> {
    tail.iter()
        .rev()
        .map(|l| l.trim())
        .find(|l| l.starts_with("srun: error:"))
}

/// What the launcher says of rank `rank` of `step` on `host` when its srun exited 0 without its report (with srun's
/// reason from the rank's stderr tail when it printed one).
pub fn lost_note(rank: u32, step: &str, host: &str, tail: &Mutex<VecDeque<String>>) -> String {
    let tail = tail
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let lines: Vec<String> = tail.iter().cloned().collect();
    drop(tail);
    let said = match launcher_reason(&lines) {
        Some(reason) => format!("it said `{reason}`"),
        None => "it gave no reason".to_owned(),
    };
    format!(
        "rank {rank} of step `{step}` on node {host} is lost: its srun exited 0, but the rank's command never \
         reported its exit status ({said}); it counts as lost, not finished"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(nonce: &str, code: u8) -> String {
        format!("{REPORT_WORD} {nonce} {code}\n")
    }

    /// The report is found however the stream is cut into reads, and cut off the end of the log.
    #[test]
    fn the_report_is_found_across_any_chunking() {
        let stream = format!("a line\npartial{}", report("n0nce", 0));
        for size in 1..=stream.len() {
            let r = StatusReport::new("n0nce");
            for chunk in stream.as_bytes().chunks(size) {
                r.feed(chunk);
            }
            assert_eq!(r.finish(), Some("a line\npartial".len() as u64), "{size}");
            assert_eq!(r.wait(Duration::ZERO, Duration::ZERO), Some(0), "{size}");
        }
    }

    /// What the rank prints cannot pass for its report: a report with another nonce (an earlier run's log, a
    /// guess), one without its newline, one with a code too long, or nothing at all; the last report counts.
    #[test]
    fn only_a_complete_report_with_this_ranks_nonce_counts() {
        let cases: [(String, Option<i32>); 6] = [
            (report("other", 0), None),
            (format!("{REPORT_WORD} n0nce 0"), None),
            (format!("{REPORT_WORD} n0nce 0000\n"), None),
            (format!("{REPORT_WORD} n0nce \n"), None),
            (String::from("done\n"), None),
            (
                format!("{}x\n{}", report("n0nce", 3), report("n0nce", 0)),
                Some(0),
            ),
        ];
        for (stream, want) in cases {
            let r = StatusReport::new("n0nce");
            r.feed(stream.as_bytes());
            r.finish();
            assert_eq!(r.wait(Duration::ZERO, Duration::ZERO), want, "{stream:?}");
        }
    }

    #[test]
    fn an_exit_0_counts_only_with_the_report_of_0() {
        assert_eq!(settle(WorkerExit::Code(0), None), WorkerExit::Lost);
        assert_eq!(settle(WorkerExit::Code(0), Some(0)), WorkerExit::Code(0));
        assert_eq!(settle(WorkerExit::Code(0), Some(3)), WorkerExit::Code(3));
        assert_eq!(settle(WorkerExit::Code(3), None), WorkerExit::Code(3));
        assert_eq!(
            settle(WorkerExit::Signal(9), Some(0)),
            WorkerExit::Signal(9)
        );
        let tail = [
            "srun: error: Node failure on n2".to_owned(),
            "hello".to_owned(),
        ];
        assert_eq!(
            launcher_reason(&tail),
            Some("srun: error: Node failure on n2")
        );
        assert_eq!(launcher_reason(&tail[1..]), None);
    }

    #[test]
    fn strip_keeps_what_came_before_the_report() {
        let r = StatusReport::new("n0nce");
        let line = format!("partial{REPORT_WORD} n0nce 0");
        assert_eq!(r.strip(line.as_bytes()), Some(&b"partial"[..]));
        assert_eq!(r.strip(format!("{REPORT_WORD} n0nce 0").as_bytes()), None);
        assert_eq!(r.strip(b"other"), Some(&b"other"[..]));
    }

    /// Waiting ends when the stream ends, report or not.
    #[test]
    fn wait_returns_when_the_stream_ends() {
        let r = std::sync::Arc::new(StatusReport::new("n0nce"));
        let pump = {
            let r = r.clone();
            std::thread::spawn(move || {
                r.feed(b"x\n");
                r.finish();
            })
        };
        assert_eq!(
            r.wait(Duration::from_secs(60), Duration::from_secs(60)),
            None
        );
        pump.join().unwrap();
    }

    /// A pump still busy with the output ahead of the report (a slow sink) is waited for past the short bound; one
    /// that waits for data nobody writes (something else holds the pipe open) only up to it.
    #[test]
    fn a_busy_pump_is_waited_for_and_an_idle_one_is_not() {
        let short = Duration::from_millis(200);
        let r = std::sync::Arc::new(StatusReport::new("n0nce"));
        let pump = {
            let r = r.clone();
            std::thread::spawn(move || {
                r.feed(&vec![b'x'; 64 * 1024]);
                // Emitting those lines to a slow sink takes longer than the short bound.
                std::thread::sleep(short * 5);
                r.feed(report("n0nce", 0).as_bytes());
                r.finish();
            })
        };
        assert_eq!(r.wait(short, Duration::from_secs(60)), Some(0));
        pump.join().unwrap();

        let r = StatusReport::new("n0nce");
        r.feed(b"x\n");
        r.idle();
        assert_eq!(r.wait(short, Duration::from_secs(60)), None);
    }
}
