//! A step's `workers`: a count, or an elastic range with the rest of the elastic configuration
//! (`workers = { min = 2, max = 8, discovery = "./discover.sh", slots_per_host = 4, elastic_timeout = 60s,
//! cooldown = [60s, 10m] }`), each setting the file's form of an `hvd run` flag.

use super::Lowerer;
use crate::diagnostics::{Problem, suggestion};
use crate::eval::{Sv, Value, type_error};
use crate::model::{COOLDOWN_SECONDS, Elastic};
use hvd_env_vars::ELASTIC_TIMEOUT_SECONDS;

/// The keys of an elastic range: the range, then its settings.
const RANGE: [&str; 2] = ["min", "max"];
const SETTINGS: [&str; 4] = ["discovery", "slots_per_host", "elastic_timeout", "cooldown"];

impl Lowerer {
    /// `workers = N`, or an elastic range `workers = { min = a, max = b, .. }` with its settings: (workers, min
    /// workers, the elastic settings).
    pub(super) fn workers(&mut self, v: &Sv) -> (Option<u32>, Option<u32>, Elastic) {
        let Value::Attrs(map) = &v.v else {
            return match v.v {
                Value::Int(_) => (self.count(v, 1), None, Elastic::default()),
                _ => {
                    self.report(type_error(
                        v,
                        "an integer or `{ min = .., max = .. }`",
                        "write `workers = 4`, or `workers = { min = 2, max = 8 }` for an elastic step",
                    ));
                    (None, None, Elastic::default())
                }
            };
        };
        let mut min = None;
        let mut max = None;
        let mut elastic = Elastic::default();
        let mut bad = false;
        for (key, item) in map.iter() {
            match key.as_str() {
                "min" => min = self.count(item, 1),
                "max" => max = self.count(item, 1),
                "discovery" => elastic.discovery = self.discovery(item),
                "slots_per_host" => elastic.slots_per_host = self.count(item, 1),
                "elastic_timeout" => elastic.elastic_timeout_ms = self.elastic_timeout(item),
                "cooldown" => elastic.cooldown_seconds = self.cooldown(item),
                _ => {
                    bad = true;
                    let help = suggestion(key, RANGE.into_iter().chain(SETTINGS))
                        .unwrap_or_else(|| {
                            "an elastic range has `min` and `max`, and may have `discovery`, `slots_per_host`, \
                             `elastic_timeout` and `cooldown`"
                                .to_owned()
                        });
                    self.report(
                        Problem::new(
                            item.loc,
                            format!("unknown field `{key}` in `workers`"),
                            "unknown field",
                        )
                        .help(help),
                    );
                }
            }
        }
        // A setting without the range: the step would not be elastic, and the setting would do nothing.
        let setting = SETTINGS.into_iter().find(|s| map.contains_key(*s));
        for (name, value) in [("min", min), ("max", max)] {
            if value.is_none() && !map.contains_key(name) {
                bad = true;
                let help = match setting {
                    Some(s) => format!(
                        "`{s}` is for an elastic step, whose range needs both: \
                         `workers = {{ min = 2, max = 8, {s} = .. }}`"
                    ),
                    None => {
                        "an elastic range needs both: `workers = { min = 2, max = 8 }`".to_owned()
                    }
                };
                self.report(
                    Problem::new(v.loc, format!("`workers` has no `{name}`"), "this range")
                        .help(help),
                );
            }
        }
        if let Some(item) = map.get("slots_per_host")
            && !map.contains_key("discovery")
        {
            bad = true;
            self.report(
                Problem::new(
                    item.loc,
                    "`slots_per_host` without `discovery`",
                    "nothing names hosts alone",
                )
                .help(
                    "`slots_per_host` gives the slots of a host the discovery program prints without `:slots`: \
                     add `discovery = \"./discover.sh\"`, or remove it",
                ),
            );
        }
        match (min, max) {
            (Some(lo), Some(hi)) if lo > hi => {
                self.report(
                    Problem::new(
                        v.loc,
                        format!("`workers` has `min = {lo}` above `max = {hi}`"),
                        "an empty range",
                    )
                    .help("the step starts with `max` workers and goes on while `min` are alive"),
                );
                (None, None, Elastic::default())
            }
            (Some(lo), Some(hi)) if !bad => (Some(hi), Some(lo), elastic),
            _ => (None, None, Elastic::default()),
        }
    }

    /// `discovery = "./discover.sh"`: a program's path, relative to the .hvd file's directory (or absolute).
    fn discovery(&mut self, v: &Sv) -> Option<String> {
        let path = self.string(v, "the discovery program")?;
        let what = if path.trim().is_empty() {
            "an empty path"
        } else if path.contains('\0') {
            "a path with a NUL byte"
        } else {
            return Some(path);
        };
        self.report(
            Problem::new(v.loc, format!("`discovery` is {what}"), "this value").help(
                "name the program that prints `host:slots` lines, relative to this file's directory, e.g. \
                 `discovery = \"./discover.sh\"`",
            ),
        );
        None
    }

    /// A duration (milliseconds), or a diagnostic showing `example`.
    fn duration(&mut self, v: &Sv, example: &str) -> Option<u64> {
        match v.v {
            Value::Duration(ms) => Some(ms),
            Value::Int(_) => {
                self.report(type_error(
                    v,
                    "a duration",
                    &format!("durations take an explicit unit, e.g. `{example}`"),
                ));
                None
            }
            _ => {
                self.report(type_error(
                    v,
                    "a duration",
                    &format!("write a duration with its unit, e.g. `{example}`"),
                ));
                None
            }
        }
    }

    /// `elastic_timeout = 60s`: within [`ELASTIC_TIMEOUT_SECONDS`] (the range `--elastic-timeout` and the workers'
    /// `HVD_ELASTIC_TIMEOUT` take, so a file that checks runs).
    fn elastic_timeout(&mut self, v: &Sv) -> Option<u64> {
        let ms = self.duration(v, "60s")?;
        let (low, high) = ELASTIC_TIMEOUT_SECONDS;
        let why = if ms < low * 1000 {
            "shorter, a new round would leave out every worker but the first to rejoin"
        } else if ms > high * 1000 {
            "a step below its minimum waits this long before it fails; a day is the most hvd takes"
        } else {
            return Some(ms);
        };
        self.report(
            Problem::new(
                v.loc,
                format!("`elastic_timeout` is {}, out of range", seconds_text(ms)),
                format!("expected from {low}s to {high}s"),
            )
            .help(format!("{why}; e.g. `elastic_timeout = 60s`")),
        );
        None
    }

    /// `cooldown = [60s, 10m]`: two durations of whole seconds within [`COOLDOWN_SECONDS`], the first at most the
    /// second.
    fn cooldown(&mut self, v: &Sv) -> Option<(u64, u64)> {
        const HELP: &str = "write `cooldown = [MIN, MAX]`, e.g. `[60s, 10m]`: MIN the first time a host is \
                            blacklisted, doubled each time again, at most MAX";
        let Value::List(items) = &v.v else {
            self.report(type_error(v, "a list of two durations", HELP));
            return None;
        };
        if items.len() != 2 {
            self.report(
                Problem::new(
                    v.loc,
                    format!("`cooldown` has {} value(s), not 2", items.len()),
                    "this list",
                )
                .help(HELP),
            );
            return None;
        }
        let (low, high) = COOLDOWN_SECONDS;
        let mut bounds = Vec::new();
        for item in items.iter() {
            let Some(ms) = self.duration(item, "60s") else {
                continue;
            };
            let problem = if ms % 1000 != 0 {
                Some((
                    format!("`{ms}ms` is not a whole number of seconds"),
                    "a cooldown is whole seconds".to_owned(),
                ))
            } else if ms / 1000 < low || ms / 1000 > high {
                Some((
                    format!("`{}s` is out of range", ms / 1000),
                    format!("expected from {low}s to {high}s"),
                ))
            } else {
                None
            };
            match problem {
                Some((message, label)) => self.report(Problem::new(item.loc, message, label)),
                None => bounds.push(ms / 1000),
            }
        }
        match bounds[..] {
            [min, max] if min > max => {
                self.report(
                    Problem::new(
                        v.loc,
                        format!(
                            "`cooldown` has its first value ({min}s) above its second ({max}s)"
                        ),
                        "an empty range",
                    )
                    .help(HELP),
                );
                None
            }
            [min, max] => Some((min, max)),
            _ => None,
        }
    }
}

/// `ms` as seconds, fractions only when it has them: `1.5s`, `1080000000s`.
fn seconds_text(ms: u64) -> String {
    match ms % 1000 {
        0 => format!("{}s", ms / 1000),
        _ => format!("{}s", ms as f64 / 1000.0),
    }
}
