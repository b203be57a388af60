//! What a closure still needs from the host's C library: the newest glibc that one of its wheels' `manylinux` tags
//! asks for, checked against the glibc of every host before a rank starts there (the lock is made for the glibc of
//! the machine that locked it, and a cluster's nodes may be older).

/// The glibc a wheel needs, and which wheel: the newest among an env's closure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlibcNeed {
    /// `(major, minor)`, e.g. `(2, 17)`.
    pub version: (u64, u64),
    /// The wheel's file name, for the message.
    pub wheel: String,
}

impl GlibcNeed {
    /// The need of one store path from its `.hvd-path.json`: only a path of kind `wheel` with a manylinux tag has
    /// one.
    pub fn of_path(info: &serde_json::Value) -> Option<GlibcNeed> {
        let derivation = &info["derivation"];
        if derivation["kind"].as_str() != Some("wheel") {
            return None;
        }
        let wheel = derivation["inputs"]["artifact.filename"].as_str()?;
        Some(GlibcNeed {
            version: wheel_glibc(wheel)?,
            wheel: wheel.to_owned(),
        })
    }

    /// The problem with running on a host whose glibc is `host`, if any. `None` for `host`: it could not be told
    /// (no `getconf`, another C library): not refused, since a false refusal would stop a job that may run; a
    /// warning says so.
    pub fn problem(&self, host: Option<(u64, u64)>, where_: &str) -> Option<String> {
        let (major, minor) = self.version;
        match host {
            Some(have) if have >= self.version => None,
            Some((a, b)) => Some(format!(
                "{where_} has glibc {a}.{b}, but the env's wheel `{}` needs glibc {major}.{minor}: run on hosts \
                 with glibc {major}.{minor} or newer, or lock on a machine with the oldest glibc of the cluster \
                 (`hvd lock` picks wheels for the glibc of the machine it runs on)",
                self.wheel
            )),
            None => {
                tracing::warn!(
                    "could not tell the glibc of {where_} (`getconf GNU_LIBC_VERSION` did not answer); the env's \
                     wheel `{}` needs glibc {major}.{minor}",
                    self.wheel
                );
                None
            }
        }
    }
}

/// The oldest glibc among a wheel's platform tags (`torch-2.1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl`
/// -> 2.17: any one tag that the host satisfies is enough); `None` when a tag needs no glibc (`any`, `linux_x86_64`)
/// or the name is not a wheel's.
pub fn wheel_glibc(filename: &str) -> Option<(u64, u64)> {
    let stem = filename.strip_suffix(".whl")?;
    let platforms = stem.rsplit('-').next()?;
    let mut oldest: Option<(u64, u64)> = None;
    for tag in platforms.split('.') {
        let need = manylinux_glibc(tag)?;
        oldest = Some(oldest.map_or(need, |o| o.min(need)));
    }
    oldest
}

/// The glibc a `manylinux` platform tag stands for (PEP 600 `manylinux_X_Y_ARCH` and the PEP 513/571/599 aliases).
fn manylinux_glibc(tag: &str) -> Option<(u64, u64)> {
    for (alias, version) in [
        ("manylinux1_", (2, 5)),
        ("manylinux2010_", (2, 12)),
        ("manylinux2014_", (2, 17)),
    ] {
        if tag.starts_with(alias) {
            return Some(version);
        }
    }
    let mut parts = tag.strip_prefix("manylinux_")?.splitn(3, '_');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    parts.next()?;
    Some((major, minor))
}

/// `"2.36"` (as `getconf GNU_LIBC_VERSION` prints after `glibc `) as `(2, 36)`.
pub fn parse_version(text: &str) -> Option<(u64, u64)> {
    let (major, rest) = text.trim().split_once('.')?;
    let minor: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// This machine's glibc, from the C library this process runs on.
pub fn host() -> Option<(u64, u64)> {
    // SAFETY: gnu_get_libc_version takes no arguments and returns a pointer to a static NUL-terminated string.
    let version = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) };
    parse_version(version.to_str().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wheel_needs_the_oldest_glibc_of_its_tags() {
        assert_eq!(
            wheel_glibc("t-2.1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"),
            Some((2, 17))
        );
        assert_eq!(
            wheel_glibc("t-1-cp311-cp311-manylinux_2_28_x86_64.manylinux_2_34_x86_64.whl"),
            Some((2, 28))
        );
        assert_eq!(
            wheel_glibc("n-1-cp36-cp36m-manylinux1_x86_64.whl"),
            Some((2, 5))
        );
        assert_eq!(
            wheel_glibc("n-1-cp36-cp36m-manylinux2010_x86_64.whl"),
            Some((2, 12))
        );
        assert_eq!(wheel_glibc("p-1-py3-none-any.whl"), None);
        assert_eq!(wheel_glibc("p-1-cp311-cp311-linux_x86_64.whl"), None);
        // One tag without a glibc need makes the wheel need none.
        assert_eq!(
            wheel_glibc("p-1-py3-none-manylinux_2_17_x86_64.any.whl"),
            None
        );
        assert_eq!(wheel_glibc("p-1-cp311-cp311-manylinux_2_x86_64.whl"), None);
        assert_eq!(wheel_glibc("not-a-wheel.tar.gz"), None);
    }

    #[test]
    fn versions_as_getconf_prints_them() {
        assert_eq!(parse_version("2.36"), Some((2, 36)));
        assert_eq!(parse_version(" 2.17\n"), Some((2, 17)));
        assert_eq!(parse_version("2.35-0ubuntu3"), Some((2, 35)));
        assert_eq!(parse_version("x.y"), None);
        assert_eq!(parse_version(""), None);
        // This machine is glibc-based (Debian).
        assert!(host().is_some_and(|v| v >= (2, 17)));
    }

    #[test]
    fn the_problem_names_the_host_the_wheel_and_the_fix() {
        let need = GlibcNeed {
            version: (2, 34),
            wheel: "torch-2-cp311-cp311-manylinux_2_34_x86_64.whl".into(),
        };
        assert_eq!(need.problem(Some((2, 36)), "host `a`"), None);
        assert_eq!(need.problem(Some((2, 34)), "host `a`"), None);
        let old = need.problem(Some((2, 31)), "host `a`").unwrap();
        assert!(old.contains("host `a` has glibc 2.31"), "{old}");
        assert!(
            old.contains("torch-2-cp311-cp311-manylinux_2_34_x86_64.whl"),
            "{old}"
        );
        assert!(old.contains("glibc 2.34 or newer"), "{old}");
        // A host whose glibc cannot be told is not refused (a warning says so).
        assert_eq!(need.problem(None, "host `b`"), None);
    }
}
