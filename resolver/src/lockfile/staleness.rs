//! Staleness: whether a lock still matches its env, field by field, so the error can name each change.

use std::fmt;
use std::str::FromStr;

use hvd_lang::model::Env;

use super::write::{inline_list, inline_map, quote, requested_build_inline};
use super::{LockedBuild, Lockfile, Request, SCHEMA_VERSION, env_hash};
use crate::names::normalize_name;

impl Lockfile {
    /// Whether this lock still satisfies `env`. The error lists every requested field that changed.
    pub fn check_against(&self, env: &Env) -> Result<(), Staleness> {
        let now = Request::from_env(env);
        let mut changes = Vec::new();
        if self.version != SCHEMA_VERSION {
            changes.push(FieldChange {
                field: "version".into(),
                now: SCHEMA_VERSION.to_string(),
                was: self.version.to_string(),
            });
        }
        diff_requests(&now, &self.request, &mut changes);
        if changes.is_empty() {
            // The echo matches the file: what the builder runs must match it too.
            diff_builds(&now, &self.builds, &mut changes);
        }
        if changes.is_empty() && self.env_hash != env_hash(env) {
            // Same echo, different hash: the normalization changed between hvd versions.
            changes.push(FieldChange {
                field: "env-hash".into(),
                now: env_hash(env),
                was: self.env_hash.clone(),
            });
        }
        if changes.is_empty() {
            Ok(())
        } else {
            Err(Staleness { changes })
        }
    }
}

/// One requested field that no longer matches the lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldChange {
    /// e.g. `env.packages[2]`, `env.python`, `env.packages[1].build.requires`.
    pub field: String,
    /// The value in the file now (`(none)` when removed).
    pub now: String,
    /// The value recorded in the lock (`(none)` when added).
    pub was: String,
}

impl fmt::Display for FieldChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} was {}", self.field, self.now, self.was)
    }
}

/// The lock no longer matches the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staleness {
    pub changes: Vec<FieldChange>,
}

impl fmt::Display for Staleness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the lockfile is out of date: ")?;
        for (i, c) in self.changes.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{c}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Staleness {}

fn shown(s: Option<&str>) -> String {
    match s {
        Some(s) => quote(s),
        None => "(none)".into(),
    }
}

/// The recipe fields of every `[[build]]` (what the builder runs) against what the file asks now: a package's
/// recipe, or for an sdist built without one no variables, nothing to compile against and build isolation (what
/// is installed for the build is `[[build.package]]`, not `requires`, so that is not compared here). The
/// request echo alone is not enough: the builder reads `[[build]]`, so a lockfile in a pull request could
/// otherwise carry build variables the file never asked for.
fn diff_builds(now: &Request, builds: &[LockedBuild], out: &mut Vec<FieldChange>) {
    for b in builds {
        let recipe = now
            .packages
            .iter()
            .filter(|p| {
                pep508_rs::Requirement::<pep508_rs::VerbatimUrl>::from_str(&p.requirement)
                    .is_ok_and(|r| normalize_name(r.name.as_ref()) == b.package)
            })
            .find_map(|p| p.build.clone());
        let base = format!("build.{}", b.package);
        let mut push = |field: &str, n: String, w: String| {
            if n != w {
                out.push(FieldChange {
                    field: format!("{base}.{field}"),
                    now: n,
                    was: w,
                });
            }
        };
        let expected = recipe.unwrap_or_default();
        push("env", inline_map(&expected.env), inline_map(&b.env));
        push(
            "against",
            inline_list(&expected.against),
            inline_list(&b.against),
        );
        push(
            "no-build-isolation",
            expected.no_build_isolation.to_string(),
            b.no_build_isolation.to_string(),
        );
    }
}

fn diff_requests(now: &Request, was: &Request, out: &mut Vec<FieldChange>) {
    let mut push = |field: String, n: Option<&str>, w: Option<&str>| {
        if n != w {
            out.push(FieldChange {
                field,
                now: shown(n),
                was: shown(w),
            });
        }
    };
    push("env.python".into(), Some(&now.python), Some(&was.python));
    push(
        "env.index".into(),
        now.index.as_deref(),
        was.index.as_deref(),
    );
    push(
        "env.toolchain".into(),
        now.toolchain.as_deref(),
        was.toolchain.as_deref(),
    );
    let len = now.packages.len().max(was.packages.len());
    for i in 0..len {
        let n = now.packages.get(i);
        let w = was.packages.get(i);
        push(
            format!("env.packages[{i}]"),
            n.map(|p| p.requirement.as_str()),
            w.map(|p| p.requirement.as_str()),
        );
        let nb = n.and_then(|p| p.build.as_ref());
        let wb = w.and_then(|p| p.build.as_ref());
        match (nb, wb) {
            (None, None) => {}
            (Some(nb), Some(wb)) => {
                let base = format!("env.packages[{i}].build");
                if nb.requires != wb.requires {
                    push(
                        format!("{base}.requires"),
                        Some(&inline_list(&nb.requires)),
                        Some(&inline_list(&wb.requires)),
                    );
                }
                if nb.env != wb.env {
                    push(
                        format!("{base}.env"),
                        Some(&inline_map(&nb.env)),
                        Some(&inline_map(&wb.env)),
                    );
                }
                if nb.against != wb.against {
                    push(
                        format!("{base}.against"),
                        Some(&inline_list(&nb.against)),
                        Some(&inline_list(&wb.against)),
                    );
                }
                if nb.no_build_isolation != wb.no_build_isolation {
                    push(
                        format!("{base}.no_build_isolation"),
                        Some(&nb.no_build_isolation.to_string()),
                        Some(&wb.no_build_isolation.to_string()),
                    );
                }
            }
            (nb, wb) => push(
                format!("env.packages[{i}].build"),
                nb.map(requested_build_inline).as_deref(),
                wb.map(requested_build_inline).as_deref(),
            ),
        }
    }
    let keys: std::collections::BTreeSet<&String> =
        now.variables.keys().chain(was.variables.keys()).collect();
    for k in keys {
        push(
            format!("env.variables.{k}"),
            now.variables.get(k).map(String::as_str),
            was.variables.get(k).map(String::as_str),
        );
    }
}
