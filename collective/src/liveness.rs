//! An elastic worker's heartbeat to the launcher, and what it brings back.
//!
//! A worker of an elastic step (`HVD_ELASTIC=1`) starts, at its first join, a thread of its own that tells the
//! launcher's rendezvous server it is alive (`POST /elastic/v1/beat`, docs/rendezvous.md) every [`interval`] of the
//! launcher's heartbeat timeout (`HVD_HEARTBEAT_TIMEOUT`). The thread is Rust, independent of Python's GIL: a worker
//! busy in a long computation still beats; a frozen one (a stopped process, a hung or partitioned node) does not,
//! and the launcher counts it lost once it has been silent for the timeout. It beats for the life of the process,
//! across its re-forms (a worker waiting in its join is alive too), and stops when the server says the worker is no
//! longer one of the step's (it ended, was left out, or was found silent).
//!
//! A worker that hears nothing from the launcher for [`orphaned_after`] (the round window, at least three heartbeat
//! timeouts and 10 s) ends itself: the launcher is gone without a word (its machine or pod lost: no connection's end
//! reaches the ranks' hosts, whose sshd or kubelet keep the sessions for hours) or cut off from this worker, and
//! either way no round can form again and the launcher, if alive, has counted it lost (its ssh gives up after a
//! minute). Training on, the worker would hold its host (its GPUs) and write checkpoints beside a new launcher's.
//!
//! The answer names the rank of a member of the latest round the launcher found silent: when that round is the one
//! this process is in ([`enter_round`]), its collective in flight cannot complete (the frozen peer neither sends nor
//! dies), so the transports' waits fail it at once with [`Error::PeerLost`] ([`check`]), instead of after
//! `HVD_COLLECTIVE_TIMEOUT`, and the worker re-forms without it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::env_vars;
use crate::error::{Error, Result};

/// `HVD_HEARTBEAT_TIMEOUT` when unset, in seconds.
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 10;
/// The shortest heartbeat timeout, in seconds (shorter, a loaded machine's scheduling delays read as a freeze).
pub const MIN_TIMEOUT_SECONDS: u64 = 1;

/// The heartbeat timeout of `HVD_HEARTBEAT_TIMEOUT`'s value (`None`: unset, the default): seconds, fractions allowed,
/// from [`MIN_TIMEOUT_SECONDS`] to a day. The launcher and the workers read it with this one function.
pub fn timeout_from(value: Option<&str>) -> Result<Duration> {
    let Some(v) = value else {
        return Ok(Duration::from_secs(DEFAULT_TIMEOUT_SECONDS));
    };
    let day = crate::time::DAY_SECONDS;
    crate::time::parse_seconds_in(v, MIN_TIMEOUT_SECONDS as f64, day as f64).ok_or_else(|| {
        Error::Bootstrap(format!(
            "`{}={v}` is not a number of seconds from {MIN_TIMEOUT_SECONDS} to at most {day} (a day)",
            env_vars::HVD_HEARTBEAT_TIMEOUT
        ))
    })
}

/// How long a worker goes on without an answer to its heartbeats before it ends itself ([`start`]): the round
/// window `window` (`HVD_ELASTIC_TIMEOUT`; 60 s when unknown), at least three heartbeat `timeout`s and 10 s, so
/// that a launcher slow to answer on a loaded machine is not taken for a gone one.
pub fn orphaned_after(window: Option<Duration>, timeout: Duration) -> Duration {
    window
        .unwrap_or(Duration::from_secs(60))
        .max(timeout * 3)
        .max(Duration::from_secs(10))
}

/// A worker's failed heartbeats in a row, and whether they have lasted long enough to end it.
#[derive(Debug, Clone, Copy)]
struct Hearing {
    within: Duration,
    /// How many heartbeats have failed in a row.
    failed: u32,
    /// How long they have failed: from the first one's beginning to the last one's, each gap between two of them
    /// counted up to [`Hearing::gap_cap`].
    silence: Duration,
    /// When the last heartbeat (answered or not) began.
    last: Option<Instant>,
}

/// Heartbeats that must fail in a row, besides the time, before a worker ends.
const ORPHANED_FAILURES: u32 = 3;

impl Hearing {
    fn new(within: Duration) -> Hearing {
        Hearing {
            within,
            failed: 0,
            silence: Duration::ZERO,
            last: None,
        }
    }

    /// The most of one gap between two heartbeats that counts: two beats (on the cadence a gap is one; a beat is
    /// answered within one or fails). A longer gap is this process stopped (SIGSTOP, Ctrl-Z, a paused machine), not
    /// the launcher silent: after a stop the failing must go on for nearly the whole window; slow beats still add up.
    fn gap_cap(every: Duration) -> Duration {
        every * 2
    }

    /// The heartbeat begun at `began` was answered.
    fn answered(&mut self, began: Instant) {
        self.failed = 0;
        self.silence = Duration::ZERO;
        self.last = Some(began);
    }

    /// The heartbeat begun at `began` failed (`every`: the cadence): `Some(silence)` once the failures in a row have
    /// lasted `within` ([`Hearing::silence`]) and there are three of them at least.
    fn failed(&mut self, began: Instant, every: Duration) -> Option<Duration> {
        if self.failed > 0
            && let Some(last) = self.last
        {
            self.silence += began
                .saturating_duration_since(last)
                .min(Self::gap_cap(every));
        }
        self.last = Some(began);
        self.failed += 1;
        (self.silence >= self.within && self.failed >= ORPHANED_FAILURES).then_some(self.silence)
    }
}

/// How a worker whose launcher is gone ends ([`orphaned_after`]): its exit code.
pub const ORPHANED_EXIT: i32 = 1;

/// How often a worker beats for the launcher's `timeout`: five times per timeout, at most every 2 s (the timeout is
/// [`MIN_TIMEOUT_SECONDS`] at least, so at least every 200 ms: no lower bound is needed).
pub fn interval(timeout: Duration) -> Duration {
    (timeout / 5).min(Duration::from_secs(2))
}

/// Which round this process is a member of, and whether the launcher found one of its members silent.
struct Membership {
    /// The elastic round this process is a member of (0: none).
    round: AtomicU64,
    /// The number of members of `round` (stored first): a rank the launcher names is below it.
    size: AtomicU64,
    /// A round the launcher said a member of is silent (0: none), and that member's rank in it (stored first).
    broken_round: AtomicU64,
    broken_rank: AtomicU64,
}

impl Membership {
    const fn new() -> Membership {
        Membership {
            round: AtomicU64::new(0),
            size: AtomicU64::new(0),
            broken_round: AtomicU64::new(0),
            broken_rank: AtomicU64::new(0),
        }
    }

    fn enter(&self, round: u64, size: usize) {
        self.size.store(size as u64, Ordering::Release);
        self.round.store(round, Ordering::Release);
    }

    #[inline]
    fn check(&self) -> Result<()> {
        let broken = self.broken_round.load(Ordering::Acquire);
        if broken == 0 || broken != self.round.load(Ordering::Acquire) {
            return Ok(());
        }
        Err(Error::PeerLost {
            rank: self.broken_rank.load(Ordering::Acquire) as usize,
            reason: format!(
                "it sent the launcher no heartbeat for {} (frozen: a stopped process, or a hung or unreachable \
                 node)",
                env_vars::HVD_HEARTBEAT_TIMEOUT
            ),
        })
    }

    /// Records the launcher's answer: round `round`'s member of rank `lost` is silent. A rank the round does not have
    /// (a broken or hostile answer) is ignored: no member's wait fails for it.
    fn broken(&self, round: u64, lost: u64) {
        if round != 0
            && round == self.round.load(Ordering::Acquire)
            && lost < self.size.load(Ordering::Acquire)
        {
            self.broken_rank.store(lost, Ordering::Release);
            self.broken_round.store(round, Ordering::Release);
        }
    }
}

static THIS_PROCESS: Membership = Membership::new();
static STARTED: AtomicBool = AtomicBool::new(false);

/// This process is a member of elastic round `round`, of `size` members, from now on: only a silent member of that
/// round fails its operations.
pub(crate) fn enter_round(round: u64, size: usize) {
    THIS_PROCESS.enter(round, size);
}

/// Whether this process is a member of an elastic round (its waits for a peer should ask [`check`] now and then).
pub(crate) fn in_round() -> bool {
    THIS_PROCESS.round.load(Ordering::Acquire) != 0
}

/// The transports' waits, and the start-up's (the round's address exchange at the rendezvous, the tcp handshakes,
/// the shared memory attach), ask this while a peer has not answered: [`Error::PeerLost`] once the launcher found a
/// member of this process's round silent. Two atomic loads when nothing is wrong.
#[inline]
pub fn check() -> Result<()> {
    THIS_PROCESS.check()
}

/// What the launcher answered one heartbeat (docs/rendezvous.md, `POST /elastic/v1/beat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    /// The launcher's latest round.
    pub round: u64,
    /// The rank in `round` of a member the launcher found silent.
    pub lost: Option<u64>,
    /// The launcher's heartbeat timeout (bounded as `HVD_HEARTBEAT_TIMEOUT`), when it said one.
    pub timeout: Option<Duration>,
}

/// What one heartbeat brought back: `Some`, the launcher's answer; `None`, the launcher no longer counts this worker
/// (the heartbeat stops).
pub type BeatAnswer = Result<Option<Answer>>;

/// The answer to a heartbeat, `v1 <round> <lost rank or -> <timeout ms or ->` (a launcher before the timeout field:
/// without it); `None` when malformed. A timeout out of `HVD_HEARTBEAT_TIMEOUT`'s bounds is brought within them.
pub fn parse_answer(text: &str) -> Option<Answer> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    let (round, lost, timeout) = match fields.as_slice() {
        ["v1", round, lost] => (round, lost, &"-"),
        ["v1", round, lost, timeout] => (round, lost, timeout),
        _ => return None,
    };
    let number = |field: &str| match field {
        "-" => Some(None),
        n => n.parse::<u64>().ok().map(Some),
    };
    let bounds = (
        Duration::from_secs(MIN_TIMEOUT_SECONDS),
        Duration::from_secs(crate::time::DAY_SECONDS),
    );
    Some(Answer {
        round: round.parse().ok()?,
        lost: number(lost)?,
        timeout: number(timeout)?.map(|ms| Duration::from_millis(ms).clamp(bounds.0, bounds.1)),
    })
}

/// Starts this process's heartbeat thread (once; later calls do nothing): it calls `beat` (one request to the
/// launcher's server as this worker, [`crate::rendezvous::KeyValueClient::elastic_beat`], given the interval as its
/// timeouts) every [`interval`] of `timeout`, or of the launcher's timeout when its answers name a shorter one (this
/// process's `HVD_HEARTBEAT_TIMEOUT` may have been changed by its script or its host's environment), until `beat`
/// answers that the launcher no longer counts this worker.
/// The beats keep a fixed cadence (each starts one interval after the previous one started, at once when that one
/// took longer), so a slow one delays the next by at most its own excess. When beats have failed in a row for
/// `orphaned` ([`orphaned_after`]; three at least, a gap past the cadence counted as a few beats: [`Hearing`]), the
/// process says why on stderr and ends with [`ORPHANED_EXIT`] at once (`_exit`: its other threads may be anywhere, a
/// script waiting outside any collective among them). Nothing is logged on a failed beat: a log line may block on a
/// stderr nobody reads any more, and the check would never come.
pub(crate) fn start(
    timeout: Duration,
    orphaned: Duration,
    mut beat: impl FnMut(Duration) -> BeatAnswer + Send + 'static,
) {
    if STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    let mut every = interval(timeout);
    let spawned = std::thread::Builder::new()
        .name("hvd-heartbeat".into())
        .spawn(move || {
            let mut next = Instant::now();
            let mut hearing = Hearing::new(orphaned);
            loop {
                let began = Instant::now();
                match beat(every) {
                    Ok(Some(answer)) => {
                        hearing.answered(began);
                        if let Some(lost) = answer.lost {
                            THIS_PROCESS.broken(answer.round, lost);
                        }
                        every = beat_every(timeout, answer.timeout);
                    }
                    Ok(None) => {
                        tracing::debug!(
                            "the launcher no longer counts this worker; heartbeat stopped"
                        );
                        return;
                    }
                    Err(e) => {
                        if let Some(silence) = hearing.failed(began, every) {
                            orphaned_end(silence, &e);
                        }
                    }
                }
                next = cadence(next, every, Instant::now());
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
            }
        });
    if let Err(e) = spawned {
        STARTED.store(false, Ordering::Release);
        tracing::warn!(error = %e, "could not start the heartbeat thread");
    }
}

/// Ends this worker, whose launcher has not answered for `silence` (the last failure: `error`): says why on stderr
/// from a thread of its own and `_exit`s once that is written, at the latest a second later (a rank's stderr is often
/// its ssh or exec stream, which nobody reads once the launcher is gone: a write there may block for ever).
fn orphaned_end(silence: Duration, error: &Error) -> ! {
    let text = format!(
        "hvd: the launcher has not answered this worker's heartbeats for {:.0} s ({error}): it is gone or cut off, \
         and no round can form without it; ending this worker (exit code {ORPHANED_EXIT}; its work since its last \
         checkpoint is lost)\n",
        silence.as_secs_f64()
    );
    let (said, written) = std::sync::mpsc::channel();
    let _ = std::thread::Builder::new()
        .name("hvd-orphaned".into())
        .spawn(move || {
            // Straight to the descriptor: no lock another thread may hold, nothing buffered; on after a partial write
            // or an interrupted one.
            let mut rest = text.as_bytes();
            while !rest.is_empty() {
                // SAFETY: writes bytes of `text`, which lives until the call returns, to descriptor 2.
                let n = unsafe { libc::write(2, rest.as_ptr().cast(), rest.len()) };
                match usize::try_from(n) {
                    Ok(n) if n > 0 => rest = &rest[n.min(rest.len())..],
                    _ if std::io::Error::last_os_error().kind()
                        == std::io::ErrorKind::Interrupted => {}
                    _ => break,
                }
            }
            let _ = said.send(());
        });
    let _ = written.recv_timeout(Duration::from_secs(1));
    // SAFETY: _exit takes an integer and does not return; nothing of this process is used after it.
    unsafe { libc::_exit(ORPHANED_EXIT) }
}

/// How often to beat for this process's `own` timeout and the one the launcher said (`launcher`): for the shorter.
fn beat_every(own: Duration, launcher: Option<Duration>) -> Duration {
    interval(launcher.map_or(own, |t| t.min(own)))
}

/// When the heartbeat after the one due at `due` is: one `every` later, or `now` when that has passed (a slow beat
/// is not made up for with a burst).
fn cadence(due: Instant, every: Duration, now: Instant) -> Instant {
    (due + every).max(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker ends once its heartbeats have failed in a row for the round window (never sooner than three
    /// heartbeat timeouts or 10 s), three of them at least; an answer starts it over, and a stop (a gap far past the
    /// cadence) counts for a few beats only.
    #[test]
    fn a_worker_unanswered_for_the_round_window_is_orphaned() {
        let s = Duration::from_secs;
        assert_eq!(orphaned_after(None, s(10)), s(60));
        assert_eq!(orphaned_after(Some(s(5)), s(4)), s(12));
        assert_eq!(orphaned_after(Some(s(1)), s(1)), s(10));
        assert_eq!(orphaned_after(Some(s(300)), s(10)), s(300));
        let t = Instant::now();
        let at = |secs: u64| t + s(secs);
        let every = s(2);
        let mut hearing = Hearing::new(s(12));
        // Failing from 0 s on, every 2 s: the third failure is at 4 s, the failing has lasted 12 s at 12 s.
        for secs in (0..12).step_by(2) {
            assert_eq!(hearing.failed(at(secs), every), None, "{secs}");
        }
        assert_eq!(hearing.failed(at(12), every), Some(s(12)));
        // An answer starts it over.
        hearing.answered(at(14));
        for secs in (16..28).step_by(2) {
            assert_eq!(hearing.failed(at(secs), every), None, "{secs}");
        }
        assert_eq!(hearing.failed(at(28), every), Some(s(12)));
        // A stop (a gap far past the cadence) counts for two beats, 4 s, however long it was: the failing must go on
        // for 8 s after it.
        let mut hearing = Hearing::new(s(12));
        hearing.answered(at(0));
        assert_eq!(hearing.failed(at(2), every), None);
        for secs in (62..70).step_by(2) {
            assert_eq!(hearing.failed(at(secs), every), None, "{secs}");
        }
        assert_eq!(hearing.failed(at(70), every), Some(s(12)));
        // Slow beats (each failing after 10 s) still add up, 4 s each.
        let mut hearing = Hearing::new(s(12));
        for secs in [0, 10, 20] {
            assert_eq!(hearing.failed(at(secs), every), None, "{secs}");
        }
        assert_eq!(hearing.failed(at(30), every), Some(s(12)));
        // Two failures are not enough, however long they last.
        let mut hearing = Hearing::new(s(1));
        assert_eq!(hearing.failed(at(0), every), None);
        assert_eq!(hearing.failed(at(9), every), None);
        assert_eq!(hearing.failed(at(11), every), Some(s(6)));
    }

    #[test]
    fn the_timeout_is_bounded_and_the_interval_follows_it() {
        let s = Duration::from_secs;
        assert_eq!(timeout_from(None).unwrap(), s(10));
        assert_eq!(
            timeout_from(Some(" 2.5 ")).unwrap(),
            Duration::from_millis(2500)
        );
        for bad in ["0", "0.5", "-1", "nan", "inf", "1e19", "86401", "soon", ""] {
            let e = timeout_from(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("HVD_HEARTBEAT_TIMEOUT"), "{bad}: {e}");
        }
        assert_eq!(interval(s(10)), s(2));
        assert_eq!(interval(s(3600)), s(2));
        assert_eq!(interval(s(1)), Duration::from_millis(200));
    }

    /// The answer names the launcher's timeout, bounded like the variable; a malformed one is refused whole.
    #[test]
    fn the_answer_carries_the_launchers_timeout() {
        let a = |round, lost, timeout| {
            Some(Answer {
                round,
                lost,
                timeout,
            })
        };
        let ms = Duration::from_millis;
        assert_eq!(parse_answer("v1 3 - 2500\n"), a(3, None, Some(ms(2500))));
        assert_eq!(parse_answer("v1 3 1 -\n"), a(3, Some(1), None));
        assert_eq!(parse_answer("v1 3 -"), a(3, None, None));
        assert_eq!(parse_answer("v1 3 - 0"), a(3, None, Some(ms(1000))));
        assert_eq!(
            parse_answer("v1 3 - 18446744073709551615"),
            a(3, None, Some(Duration::from_secs(crate::time::DAY_SECONDS)))
        );
        for bad in [
            "",
            "v1",
            "v1 x -",
            "v1 3 x",
            "v1 3 - x",
            "v1 3 - -1",
            "v2 3 - 5",
            "v1 3 - 5 6",
        ] {
            assert_eq!(parse_answer(bad), None, "{bad}");
        }
    }

    /// A worker beats for the shorter of its own timeout and the launcher's: one whose `HVD_HEARTBEAT_TIMEOUT` was
    /// raised (its script, its host's environment) is still not judged silent by the launcher's.
    #[test]
    fn a_worker_beats_for_the_shorter_of_its_timeout_and_the_launchers() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(beat_every(s(3600), Some(s(5))), s(1));
        assert_eq!(beat_every(s(5), Some(s(3600))), s(1));
        assert_eq!(beat_every(s(5), None), s(1));
        assert_eq!(beat_every(s(3600), Some(s(1))), ms(200));
    }

    /// Beats keep their cadence: a beat that took part of the interval does not push the next one back, and one
    /// that took longer is followed at once, not by a burst.
    #[test]
    fn beats_keep_a_fixed_cadence() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(cadence(t, s(2), t + ms(1500)), t + s(2));
        assert_eq!(cadence(t + s(2), s(2), t + s(2) + ms(10)), t + s(4));
        assert_eq!(cadence(t, s(2), t + s(5)), t + s(5));
        assert_eq!(cadence(t + s(5), s(2), t + s(5)), t + s(7));
    }

    /// Only a silent member of this process's own round fails the waits: not one of an earlier round (the process
    /// has re-formed since), nor before any round.
    #[test]
    fn only_a_silent_member_of_this_round_fails_the_waits() {
        let m = Membership::new();
        assert!(m.check().is_ok());
        m.broken(3, 1);
        assert!(m.check().is_ok());
        m.enter(3, 2);
        m.broken(3, 1);
        match m.check() {
            Err(Error::PeerLost { rank: 1, reason }) => {
                assert!(reason.contains("heartbeat"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        m.enter(4, 3);
        assert!(m.check().is_ok());
        m.broken(3, 2);
        assert!(m.check().is_ok());
        // The process-wide state is untouched: no round, nothing broken.
        assert!(check().is_ok());
    }

    /// A hostile or broken answer naming a rank the round does not have (`u64::MAX` would become rank `usize::MAX`,
    /// whose `+ 1` in the shared memory abort word overflows) fails no wait; a real member named after it still does.
    #[test]
    fn a_lost_rank_outside_the_round_is_ignored() {
        let m = Membership::new();
        m.enter(5, 3);
        for hostile in [3, 4, u64::from(u32::MAX), u64::MAX] {
            m.broken(5, hostile);
            assert!(m.check().is_ok(), "{hostile}");
        }
        let hostile = parse_answer("v1 5 18446744073709551615 -").unwrap();
        m.broken(hostile.round, hostile.lost.unwrap());
        assert!(m.check().is_ok());
        m.broken(5, 2);
        assert!(matches!(m.check(), Err(Error::PeerLost { rank: 2, .. })));
    }
}
