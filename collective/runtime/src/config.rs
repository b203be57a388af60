//! Engine settings and the environment variables they come from (declared in [`crate::env_vars`]).
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `HVD_FUSION_THRESHOLD` | 134217728 | fusion buffer size in bytes; 0 disables fusion |
//! | `HVD_CYCLE_TIME` | 1 | milliseconds between engine cycles (a blocking wait starts a cycle at once); at most a day |
//! | `HVD_CACHE_CAPACITY` | 1024 | response cache entries; 0 disables the cached fast path |
//! | `HVD_STALL_CHECK_TIME` | 60 | seconds before the stall inspector warns, at most a day; 0 disables it |
//! | `HVD_STALL_SHUTDOWN_TIME` | unset | seconds after which a stalled tensor stops the job with an error, at most a day |
//! | `HVD_TIMELINE` | unset | path of a Chrome-trace JSON timeline, written by rank 0 (`{rank}` in the path: one file per rank) |
//! | `HVD_TIMELINE_MARK_CYCLES` | 1 | mark engine cycles that did work in the timeline (0: off) |
//! | `HVD_SPIN_TIME` | 0 | microseconds a waiter (and the engine after a busy cycle) polls before sleeping; helps latency on idle cores, hurts on oversubscribed ones |
//! | `HVD_LOG_LEVEL` | warn | level of the runtime's stderr log when loaded through the C ABI |
//!
//! Each `HVD_X` also accepts Horovod's spelling `HOROVOD_X` so existing launch scripts keep working.

use std::path::PathBuf;
use std::time::Duration;

use hvd_collective::time::{DAY_SECONDS, parse_seconds_in};

use crate::env_vars;

/// A setting that could not be parsed.
#[derive(Debug, thiserror::Error)]
#[error("invalid value `{value}` for `{name}`: expected {expected}")]
pub struct ConfigError {
    pub name: String,
    pub value: String,
    pub expected: &'static str,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub fusion_threshold: usize,
    pub cycle_time: Duration,
    pub cache_capacity: usize,
    pub stall_check_time: Option<Duration>,
    pub stall_shutdown_time: Option<Duration>,
    pub timeline: Option<PathBuf>,
    pub timeline_mark_cycles: bool,
    pub spin_time: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            fusion_threshold: 128 * 1024 * 1024,
            cycle_time: Duration::from_millis(1),
            cache_capacity: 1024,
            stall_check_time: Some(Duration::from_secs(60)),
            stall_shutdown_time: None,
            timeline: None,
            timeline_mark_cycles: true,
            spin_time: Duration::ZERO,
        }
    }
}

fn lookup(lookup_env: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<(String, String)> {
    if let Some(v) = lookup_env(name).filter(|v| !v.is_empty()) {
        return Some((name.to_string(), v));
    }
    let horovod = name.replacen("HVD_", env_vars::HOROVOD_PREFIX, 1);
    lookup_env(&horovod)
        .filter(|v| !v.is_empty())
        .map(|v| (horovod, v))
}

/// A time setting: `value` in seconds from 0 to a day ([`DAY_SECONDS`]); never a panic (`from_secs_f64` panics past
/// `u64::MAX` seconds), never a duration an `Instant` cannot add.
fn seconds(name: &str, value: &str) -> Result<Duration, ConfigError> {
    parse_seconds_in(value, 0.0, DAY_SECONDS as f64).ok_or_else(|| ConfigError {
        name: name.into(),
        value: value.into(),
        expected: "a number of seconds from 0 to 86400 (a day)",
    })
}

impl EngineConfig {
    /// Reads the settings from the process environment.
    pub fn from_env() -> Result<EngineConfig, ConfigError> {
        EngineConfig::from_lookup(&|k| std::env::var(k).ok())
    }

    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<EngineConfig, ConfigError> {
        let mut c = EngineConfig::default();
        if let Some((name, v)) = lookup(env, env_vars::HVD_FUSION_THRESHOLD) {
            c.fusion_threshold = v.trim().parse().map_err(|_| ConfigError {
                name,
                value: v.clone(),
                expected: "a number of bytes",
            })?;
        }
        if let Some((name, v)) = lookup(env, env_vars::HVD_CYCLE_TIME) {
            c.cycle_time =
                parse_seconds_in(&v, 0.0, DAY_SECONDS as f64 * 1000.0).ok_or_else(|| {
                    ConfigError {
                        name,
                        value: v.clone(),
                        expected: "a number of milliseconds from 0 to 86400000 (a day)",
                    }
                })? / 1000;
        }
        if let Some((name, v)) = lookup(env, env_vars::HVD_CACHE_CAPACITY) {
            c.cache_capacity = v.trim().parse().map_err(|_| ConfigError {
                name,
                value: v.clone(),
                expected: "a count",
            })?;
        }
        if let Some((name, v)) = lookup(env, env_vars::HVD_STALL_CHECK_TIME) {
            let d = seconds(&name, &v)?;
            c.stall_check_time = (!d.is_zero()).then_some(d);
        }
        if let Some((name, v)) = lookup(env, env_vars::HVD_STALL_SHUTDOWN_TIME) {
            let d = seconds(&name, &v)?;
            c.stall_shutdown_time = (!d.is_zero()).then_some(d);
        }
        // `DYNAMIC` is Horovod's value for "no timeline until `start_timeline`" (which hvd allows anyway), not a file
        // name: Horovod scripts that set it for `hvd.start_timeline` would otherwise trace every step into ./DYNAMIC.
        if let Some((_, v)) = lookup(env, env_vars::HVD_TIMELINE)
            && v != "DYNAMIC"
        {
            c.timeline = Some(PathBuf::from(v));
        }
        if let Some((name, v)) = lookup(env, env_vars::HVD_SPIN_TIME) {
            let us: u64 = v.trim().parse().map_err(|_| ConfigError {
                name,
                value: v.clone(),
                expected: "microseconds",
            })?;
            c.spin_time = Duration::from_micros(us);
        }
        if let Some((_, v)) = lookup(env, env_vars::HVD_TIMELINE_MARK_CYCLES) {
            c.timeline_mark_cycles = !matches!(v.trim(), "0" | "false" | "no");
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_hvd_and_horovod_spellings() {
        let env = |k: &str| match k {
            "HVD_FUSION_THRESHOLD" => Some("0".to_string()),
            "HOROVOD_CYCLE_TIME" => Some("2.5".to_string()),
            "HVD_STALL_CHECK_TIME" => Some("0".to_string()),
            "HVD_STALL_SHUTDOWN_TIME" => Some("3".to_string()),
            _ => None,
        };
        let c = EngineConfig::from_lookup(&env).unwrap();
        assert_eq!(c.fusion_threshold, 0);
        assert_eq!(c.cycle_time, Duration::from_micros(2500));
        assert_eq!(c.stall_check_time, None);
        assert_eq!(c.stall_shutdown_time, Some(Duration::from_secs(3)));
        assert_eq!(c.timeline, None);
    }

    /// Horovod's `HOROVOD_TIMELINE=DYNAMIC` (set so that `hvd.start_timeline` may be called later) starts no
    /// timeline and writes no file named `DYNAMIC`; any other value is the timeline's path.
    #[test]
    fn a_dynamic_timeline_is_no_file() {
        for name in ["HOROVOD_TIMELINE", "HVD_TIMELINE"] {
            let env = |k: &str| (k == name).then(|| "DYNAMIC".to_string());
            assert_eq!(
                EngineConfig::from_lookup(&env).unwrap().timeline,
                None,
                "{name}"
            );
            let env = |k: &str| (k == name).then(|| "/tmp/t.json".to_string());
            assert_eq!(
                EngineConfig::from_lookup(&env).unwrap().timeline,
                Some(PathBuf::from("/tmp/t.json"))
            );
        }
    }

    #[test]
    fn bad_values_name_the_variable() {
        let env = |k: &str| (k == "HVD_CYCLE_TIME").then(|| "soon".to_string());
        let e = EngineConfig::from_lookup(&env).unwrap_err().to_string();
        assert!(e.contains("HVD_CYCLE_TIME") && e.contains("soon"), "{e}");
    }

    /// Time settings past a day are refused by name: `1e20` panicked in `from_secs_f64` when the runtime loaded,
    /// and a cycle time the clock cannot add to `now` would have panicked in the engine thread.
    #[test]
    fn time_settings_past_a_day_are_refused_without_a_panic() {
        for (name, bad, want) in [
            ("HVD_STALL_CHECK_TIME", "1e20", "from 0 to 86400 (a day)"),
            (
                "HOROVOD_STALL_SHUTDOWN_TIME",
                "1e19",
                "from 0 to 86400 (a day)",
            ),
            ("HVD_STALL_CHECK_TIME", "86401", "from 0 to 86400 (a day)"),
            ("HVD_STALL_SHUTDOWN_TIME", "NaN", "from 0 to 86400 (a day)"),
            ("HVD_CYCLE_TIME", "1e22", "from 0 to 86400000 (a day)"),
            ("HOROVOD_CYCLE_TIME", "-1", "from 0 to 86400000 (a day)"),
        ] {
            let env = |k: &str| (k == name).then(|| bad.to_string());
            let e = EngineConfig::from_lookup(&env).unwrap_err().to_string();
            assert!(
                e.contains(&format!("invalid value `{bad}` for `{name}`")) && e.contains(want),
                "{e}"
            );
        }
        let env = |k: &str| match k {
            "HVD_STALL_CHECK_TIME" => Some("86400".to_string()),
            "HVD_CYCLE_TIME" => Some("86400000".to_string()),
            _ => None,
        };
        let c = EngineConfig::from_lookup(&env).unwrap();
        assert_eq!(c.stall_check_time, Some(Duration::from_secs(86_400)));
        assert_eq!(c.cycle_time, Duration::from_secs(86_400));
    }
}
