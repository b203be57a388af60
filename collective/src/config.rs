//! Settings read from the environment (names and defaults in [`crate::env_vars`]): the algorithm thresholds, the
//! operation timeout, and the number parser they share.

use std::time::Duration;

use crate::env_vars;
use crate::error::{Error, Result};

/// Size thresholds that pick the algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    pub allreduce_direct_bytes: usize,
    /// See [`env_vars::HVD_ALLREDUCE_DEPOSIT_BYTES`] (each rank's own: ranks need not agree on it).
    pub allreduce_deposit_bytes: usize,
    pub allreduce_small_bytes: usize,
    pub allgather_small_bytes: usize,
    /// See [`env_vars::HVD_ALLREDUCE_ARENA_RANKS`].
    pub allreduce_arena_ranks: usize,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            allreduce_direct_bytes: 16 << 10,
            allreduce_deposit_bytes: 48 << 10,
            allreduce_small_bytes: 32 << 10,
            allgather_small_bytes: 256 << 10,
            allreduce_arena_ranks: 3,
        }
    }
}

impl Thresholds {
    /// Defaults overridden by `HVD_ALLREDUCE_DIRECT_BYTES`, `HVD_ALLREDUCE_DEPOSIT_BYTES`,
    /// `HVD_ALLREDUCE_SMALL_BYTES`, `HVD_ALLGATHER_SMALL_BYTES` and `HVD_ALLREDUCE_ARENA_RANKS` (bad values are
    /// ignored with a warning so a typo cannot stop a job).
    pub fn from_env() -> Thresholds {
        let d = Thresholds::default();
        Thresholds {
            allreduce_direct_bytes: env_usize(env_vars::HVD_ALLREDUCE_DIRECT_BYTES)
                .unwrap_or(d.allreduce_direct_bytes),
            allreduce_deposit_bytes: env_usize(env_vars::HVD_ALLREDUCE_DEPOSIT_BYTES)
                .unwrap_or(d.allreduce_deposit_bytes),
            allreduce_small_bytes: env_usize(env_vars::HVD_ALLREDUCE_SMALL_BYTES)
                .unwrap_or(d.allreduce_small_bytes),
            allgather_small_bytes: env_usize(env_vars::HVD_ALLGATHER_SMALL_BYTES)
                .unwrap_or(d.allgather_small_bytes),
            allreduce_arena_ranks: env_usize(env_vars::HVD_ALLREDUCE_ARENA_RANKS)
                .unwrap_or(d.allreduce_arena_ranks),
        }
    }
}

/// Default per-rank block of one ring segment of a large allreduce (see [`env_vars::HVD_ALLREDUCE_CHUNK_BYTES`]).
pub const DEFAULT_ALLREDUCE_CHUNK_BYTES: usize = 256 << 10;

/// The allreduce segment block size from `HVD_ALLREDUCE_CHUNK_BYTES`, else the default.
pub fn allreduce_chunk_bytes_from_env() -> usize {
    env_usize(env_vars::HVD_ALLREDUCE_CHUNK_BYTES).unwrap_or(DEFAULT_ALLREDUCE_CHUNK_BYTES)
}

pub(crate) fn env_usize(name: &str) -> Option<usize> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => {
            tracing::warn!(variable = name, value = %v, "ignoring a value that is not a whole number");
            None
        }
    }
}

/// The operation timeout from `HVD_COLLECTIVE_TIMEOUT` (seconds, fractions allowed, above 0 and at most a day),
/// default 30 s.
pub fn timeout_from_env() -> Result<Duration> {
    timeout_of(std::env::var(env_vars::HVD_COLLECTIVE_TIMEOUT).ok())
}

/// [`timeout_from_env`] of the variable's value (`None`: unset).
fn timeout_of(value: Option<String>) -> Result<Duration> {
    let Some(v) = value else {
        return Ok(Duration::from_secs(30));
    };
    let day = crate::time::DAY_SECONDS;
    crate::time::parse_seconds_in(&v, 0.0, day as f64)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            Error::Bootstrap(format!(
                "`{}={v}` is not a number of seconds above 0 and at most {day} (a day)",
                env_vars::HVD_COLLECTIVE_TIMEOUT
            ))
        })
}

#[cfg(test)]
mod timeout_tests {
    use super::*;

    /// `HVD_COLLECTIVE_TIMEOUT` past a day (`1e19` once reached `Instant + timeout` in the bootstrap, a panic; `1e20`
    /// panicked in `from_secs_f64`), 0, negative or not a number is refused by name; a day and fractions are taken.
    #[test]
    fn the_collective_timeout_is_bounded() {
        for bad in [
            "1e19", "1e20", "86400.5", "0", "-1", "NaN", "inf", "soon", "",
        ] {
            let err = timeout_of(Some(bad.into())).unwrap_err().to_string();
            assert!(
                err.contains(&format!(
                    "`HVD_COLLECTIVE_TIMEOUT={bad}` is not a number of seconds above 0 and at most 86400"
                )),
                "{err}"
            );
        }
        assert_eq!(timeout_of(None).unwrap(), Duration::from_secs(30));
        assert_eq!(
            timeout_of(Some("86400".into())).unwrap(),
            Duration::from_secs(86_400)
        );
        assert_eq!(
            timeout_of(Some(" 0.25 ".into())).unwrap(),
            Duration::from_millis(250)
        );
    }
}
