//! What a closure still needs from the host's C library: the newest glibc that one of its wheels' `manylinux` tags
//! asks for, checked against the glibc of every host before a rank starts there (the lock is made for the glibc of
//! the machine that locked it, and a cluster's nodes may be older); and the shared libraries beyond glibc that its
//! interpreter loads from the host (`lib/hvd-host-libraries` of the interpreter's store path), looked up where the
//! dynamic linker looks.

use std::path::{Path, PathBuf};

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

/// A shared library that an interpreter of the closure loads from the host, and which of its files need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLibrary {
    /// e.g. `libssl.so.3`.
    pub soname: String,
    /// Files of the interpreter's store path that need it, e.g. `lib/python3.11/lib-dynload/_ssl....so`.
    pub needed_by: Vec<String>,
    /// The interpreter's store path name.
    pub interpreter: String,
}

/// Read at most this much of an interpreter path's list.
pub(crate) const MAX_HOST_LIBRARIES_BYTES: u64 = 1 << 20;

impl HostLibrary {
    /// The list of the interpreter path `interpreter` (`<soname> <file>...` a line). A line whose soname is not a
    /// plain file name (`/`, `..`, control characters, empty) is skipped: it could not name a library anyway.
    pub fn parse(interpreter: &str, text: &str) -> Vec<HostLibrary> {
        text.lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let soname = fields.next()?;
                let plain = !soname.contains('/')
                    && soname != ".."
                    && soname != "."
                    && soname.len() <= 255
                    && soname.bytes().all(|b| b.is_ascii_graphic());
                plain.then(|| HostLibrary {
                    soname: soname.to_owned(),
                    needed_by: fields.map(str::to_owned).collect(),
                    interpreter: interpreter.to_owned(),
                })
            })
            .collect()
    }

    /// Whether the interpreter itself needs it (its executable or libpython): without it nothing starts. Otherwise
    /// only the extension modules that need it fail to import.
    pub fn essential(&self) -> bool {
        self.needed_by
            .iter()
            .any(|file| file.starts_with("bin/") || file.starts_with("lib/libpython"))
    }
}

/// The dynamic linker's configuration: this file, then every `*.conf` of [`LD_SO_CONF_DIR`].
pub const LD_SO_CONF: &str = "/etc/ld.so.conf";
/// See [`LD_SO_CONF`].
pub const LD_SO_CONF_DIR: &str = "/etc/ld.so.conf.d";

/// The directories the dynamic linker searches on this machine without `LD_LIBRARY_PATH` or a `RUNPATH`: those
/// of [`LD_SO_CONF`] and `LD_SO_CONF_DIR/*.conf`, then the default and multiarch ones ([`library_dirs_from`]).
pub fn library_dirs() -> Vec<PathBuf> {
    let mut configs = vec![PathBuf::from(LD_SO_CONF)];
    if let Ok(entries) = std::fs::read_dir(LD_SO_CONF_DIR) {
        let mut more: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "conf"))
            .collect();
        more.sort();
        configs.extend(more);
    }
    let texts: Vec<String> = configs
        .iter()
        .filter_map(|config| std::fs::read_to_string(config).ok())
        .collect();
    library_dirs_from(texts.iter().flat_map(|t| t.lines()))
}

/// The directories the dynamic linker searches on a machine whose configuration files (see [`LD_SO_CONF`]) hold
/// `lines`, in order: every line that is an absolute path, then the default and multiarch directories. The one rule
/// for this machine ([`library_dirs`]) and for ssh hosts, whose configuration the host check reads there.
pub fn library_dirs_from<'a>(lines: impl IntoIterator<Item = &'a str>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = lines
        .into_iter()
        .map(str::trim)
        .filter(|line| line.starts_with('/'))
        .map(PathBuf::from)
        .collect();
    dirs.extend(default_library_dirs());
    dirs
}

/// The directories the dynamic linker searches whatever its configuration: the multiarch and plain `lib` ones.
pub fn default_library_dirs() -> Vec<PathBuf> {
    let multiarch = format!("{}-linux-gnu", std::env::consts::ARCH);
    let mut dirs = Vec::new();
    for dir in ["/lib", "/usr/lib", "/lib64", "/usr/lib64"] {
        dirs.push(Path::new(dir).join(&multiarch));
        dirs.push(PathBuf::from(dir));
    }
    dirs
}

/// Of `needs`, those no directory of [`library_dirs`] has.
pub fn missing_here(needs: &[HostLibrary]) -> Vec<&HostLibrary> {
    missing_among(needs, &library_dirs(), |path| path.exists())
}

/// Of `needs`, those that no directory of `dirs` has, as `exists` tells for `<dir>/<soname>`.
pub fn missing_among<'a>(
    needs: &'a [HostLibrary],
    dirs: &[PathBuf],
    exists: impl Fn(&Path) -> bool,
) -> Vec<&'a HostLibrary> {
    needs
        .iter()
        .filter(|need| !dirs.iter().any(|dir| exists(&dir.join(&need.soname))))
        .collect()
}

/// The problem with `missing` libraries on `where_`: an error when the interpreter itself needs one (it cannot
/// start); a warning (logged) naming the modules that will not import otherwise.
pub fn host_library_problem(missing: &[&HostLibrary], where_: &str) -> Option<String> {
    let mut problems = Vec::new();
    for need in missing {
        let files = need.needed_by.join(", ");
        if need.essential() {
            problems.push(format!(
                "{where_} lacks the shared library `{}` that the env's interpreter {} needs to start ({files}): \
                 install it (the system package that ships it), or run on hosts that have it",
                need.soname, need.interpreter
            ));
        } else {
            tracing::warn!(
                "{where_} lacks the shared library `{}` that the env's interpreter {} loads for {files}: those \
                 modules will fail to import there",
                need.soname,
                need.interpreter
            );
        }
    }
    (!problems.is_empty()).then(|| problems.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_libraries_parse_find_and_tell_essential_from_optional() {
        let text = "libssl.so.3 lib/python3.11/lib-dynload/_ssl.so\n\
                    libhvd-no-such-library.so.7 bin/python3.11\n\
                    libhvd-no-such-module-library.so.1 lib/python3.11/lib-dynload/_x.so\n\
                    ../../etc/passwd bin/python3.11\n\
                    libm.so.6 lib/libpython3.11.so.1.0\n";
        let needs = HostLibrary::parse("abc-python-3.11.7", text);
        assert_eq!(
            needs.len(),
            4,
            "the line that is a path is skipped: {needs:?}"
        );
        assert!(!needs[0].essential());
        assert!(needs[1].essential());
        assert!(needs[3].essential(), "libpython needs it");
        let missing = missing_here(&needs);
        let names: Vec<&str> = missing.iter().map(|m| m.soname.as_str()).collect();
        assert_eq!(
            names,
            [
                "libhvd-no-such-library.so.7",
                "libhvd-no-such-module-library.so.1"
            ],
            "libm (glibc) is found where the dynamic linker looks"
        );
        let problem = host_library_problem(&missing, "host `a`").unwrap();
        assert!(
            problem.contains("host `a` lacks the shared library `libhvd-no-such-library.so.7`")
        );
        assert!(problem.contains("abc-python-3.11.7") && problem.contains("bin/python3.11"));
        assert!(
            !problem.contains("no-such-module"),
            "a module's library only warns: {problem}"
        );
        assert_eq!(host_library_problem(&missing[1..], "host `a`"), None);
    }

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
