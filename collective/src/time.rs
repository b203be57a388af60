//! Durations that come from outside (a flag, a file, an environment variable) and the deadlines made of them.
//! `Duration::from_secs_f64` panics on a value past `u64::MAX` seconds and `Instant + Duration` on a sum the clock
//! cannot hold, so every such duration is read with [`seconds_in`] (a range, never a panic) and added to an instant
//! with [`saturating_add`].

use std::time::{Duration, Instant};

/// The longest any hvd time setting may be, in seconds (a day): `--grace`, `--start-timeout`, `--elastic-timeout`,
/// `HVD_COLLECTIVE_TIMEOUT`, `HVD_RENDEZVOUS_WAIT`, `HVD_PREEMPT_GRACE`... Longer is a typo, or a way of saying
/// "never" that a day says as well.
pub const DAY_SECONDS: u64 = 24 * 60 * 60;

/// `at + by`, or the latest instant short of it the clock can hold: `by` may be a user's duration (a window, a
/// timeout) that `Instant + Duration` would panic on. Halving `by` until it fits lands at least halfway to the
/// clock's end, far past any deadline hvd means.
pub fn saturating_add(at: Instant, mut by: Duration) -> Instant {
    loop {
        if let Some(t) = at.checked_add(by) {
            return t;
        }
        by /= 2;
    }
}

/// `seconds` as a duration when it is within `low..=high` (both at least 0); `None` for NaN, an infinity, or
/// anything outside, where `Duration::from_secs_f64` would panic or take a typo.
pub fn seconds_in(seconds: f64, low: f64, high: f64) -> Option<Duration> {
    if (low..=high).contains(&seconds) {
        Duration::try_from_secs_f64(seconds).ok()
    } else {
        None
    }
}

/// [`seconds_in`] of a text (spaces around it ignored).
pub fn parse_seconds_in(text: &str, low: f64, high: f64) -> Option<Duration> {
    let seconds = text.trim().parse::<f64>().ok()?;
    seconds_in(seconds, low, high)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A duration no clock holds gives the latest deadline it does, not a panic; one it holds is added exactly.
    #[test]
    fn a_deadline_past_the_clock_saturates() {
        let now = Instant::now();
        assert_eq!(
            saturating_add(now, Duration::from_secs(60)),
            now + Duration::from_secs(60)
        );
        for far in [
            Duration::MAX,
            Duration::from_secs(1 << 63),
            Duration::from_secs_f64(1e19),
        ] {
            let at = saturating_add(now, far);
            assert!(
                at > now + Duration::from_secs(100 * 365 * 24 * 3600),
                "{far:?}"
            );
        }
        assert_eq!(saturating_add(now, Duration::ZERO), now);
    }

    /// Values a `from_secs_f64` would panic on, and values outside the range, are refused; the bounds are in it.
    #[test]
    fn seconds_outside_the_range_are_refused_without_a_panic() {
        let day = DAY_SECONDS as f64;
        for bad in [
            f64::NAN,
            f64::INFINITY,
            -1.0,
            -0.0001,
            1e19,
            1e300,
            day + 0.5,
        ] {
            assert_eq!(seconds_in(bad, 0.0, day), None, "{bad}");
        }
        assert_eq!(seconds_in(0.0, 0.0, day), Some(Duration::ZERO));
        assert_eq!(
            seconds_in(day, 0.0, day),
            Some(Duration::from_secs(DAY_SECONDS))
        );
        assert_eq!(seconds_in(0.5, 1.0, day), None);
        assert_eq!(
            parse_seconds_in(" 2.5 ", 0.0, day),
            Some(Duration::from_millis(2500))
        );
        for bad in ["", "soon", "1e19", "inf", "NaN", "-3"] {
            assert_eq!(parse_seconds_in(bad, 0.0, day), None, "{bad:?}");
        }
    }
}
