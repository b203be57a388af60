//! The resolution target (interpreter + platform), marker environments, and wheel tag compatibility.

use pep508_rs::{MarkerEnvironment, MarkerEnvironmentBuilder};

use crate::lockfile::Target;
use crate::names::WheelName;

/// Why a target could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("`env.python = \"{0}\"` is not a python version like \"3.11\"")]
    BadPython(String),
}

/// A parsed `major.minor[.patch]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PythonVersion {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
}

impl PythonVersion {
    pub fn parse(text: &str) -> Result<PythonVersion, TargetError> {
        let bad = || TargetError::BadPython(text.to_string());
        let parts: Vec<&str> = text.trim().split('.').collect();
        if parts.len() < 2 || parts.len() > 3 {
            return Err(bad());
        }
        let num = |s: &str| s.parse::<u64>().map_err(|_| bad());
        Ok(PythonVersion {
            major: num(parts[0])?,
            minor: num(parts[1])?,
            patch: parts.get(2).map(|p| num(p)).transpose()?.unwrap_or(0),
        })
    }
}

/// The host's platform facts that wheel tags and markers depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    /// `sys.platform`: `linux`, `darwin`, ...
    pub os: String,
    /// `platform.machine()`: `x86_64`, `aarch64`, ...
    pub arch: String,
    /// glibc `(major, minor)` when the host uses glibc.
    pub glibc: Option<(u64, u64)>,
}

impl Platform {
    /// The machine we run on. glibc's version comes from `ldd --version` (no libc call needed).
    pub fn host() -> Platform {
        let os = match std::env::consts::OS {
            "macos" => "darwin",
            other => other,
        }
        .to_string();
        let arch = std::env::consts::ARCH.to_string();
        let glibc = if os == "linux" { host_glibc() } else { None };
        Platform { os, arch, glibc }
    }
}

fn host_glibc() -> Option<(u64, u64)> {
    let out = std::process::Command::new("ldd")
        .arg("--version")
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next()?;
    if !first.to_ascii_lowercase().contains("glibc") && !first.contains("GNU libc") {
        return None;
    }
    let last = first.split_whitespace().last()?;
    let (major, minor) = last.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Everything resolution evaluates against: markers and accepted wheel tags.
#[derive(Debug, Clone)]
pub struct TargetSpec {
    pub python: PythonVersion,
    pub platform: Platform,
    pub markers: MarkerEnvironment,
}

impl TargetSpec {
    pub fn new(python: &str, platform: Platform) -> Result<TargetSpec, TargetError> {
        let py = PythonVersion::parse(python)?;
        let python_version = format!("{}.{}", py.major, py.minor);
        let python_full = format!("{}.{}.{}", py.major, py.minor, py.patch);
        let (system, os_name) = match platform.os.as_str() {
            "linux" => ("Linux", "posix"),
            "darwin" => ("Darwin", "posix"),
            "win32" | "windows" => ("Windows", "nt"),
            other => (other, "posix"),
        };
        let markers = MarkerEnvironment::try_from(MarkerEnvironmentBuilder {
            implementation_name: "cpython",
            implementation_version: &python_full,
            os_name,
            platform_machine: &platform.arch,
            platform_python_implementation: "CPython",
            platform_release: "",
            platform_system: system,
            platform_version: "",
            python_full_version: &python_full,
            python_version: &python_version,
            sys_platform: &platform.os,
        })
        .map_err(|_| TargetError::BadPython(python.to_string()))?;
        Ok(TargetSpec {
            python: py,
            platform,
            markers,
        })
    }

    pub(crate) fn interpreter_tag(&self) -> String {
        format!("cp{}{}", self.python.major, self.python.minor)
    }

    /// The target as recorded in the lockfile.
    pub(crate) fn to_lock(&self) -> Target {
        Target {
            python: format!("{}.{}", self.python.major, self.python.minor),
            python_full: format!(
                "{}.{}.{}",
                self.python.major, self.python.minor, self.python.patch
            ),
            interpreter: self.interpreter_tag(),
            abi: self.interpreter_tag(),
            os: self.platform.os.clone(),
            arch: self.platform.arch.clone(),
            glibc: self.platform.glibc.map(|(a, b)| format!("{a}.{b}")),
            platforms: self.platform_summary(),
            installation: None,
        }
    }

    fn platform_summary(&self) -> Vec<String> {
        let arch = &self.platform.arch;
        let mut out = Vec::new();
        if self.platform.os == "linux" {
            if let Some((a, b)) = self.platform.glibc {
                out.push(format!("manylinux_{a}_{b}_{arch}"));
            }
            out.push(format!("linux_{arch}"));
        }
        out.push("any".into());
        out
    }

    /// Words for messages: "cp311 on manylinux x86_64".
    pub fn describe(&self) -> String {
        let plat = if self.platform.os == "linux" && self.platform.glibc.is_some() {
            format!("manylinux {}", self.platform.arch)
        } else {
            format!("{} {}", self.platform.os, self.platform.arch)
        };
        format!("{} on {plat}", self.interpreter_tag())
    }

    /// How good a platform tag is for this target (`None`: not installable here). Higher is better.
    fn platform_score(&self, tag: &str) -> Option<u32> {
        if tag == "any" {
            return Some(1);
        }
        let arch = &self.platform.arch;
        if self.platform.os != "linux" {
            return None;
        }
        if tag == format!("linux_{arch}") {
            return Some(2);
        }
        let glibc = self.platform.glibc?;
        let (major, minor) = match tag {
            t if t == format!("manylinux1_{arch}") => (2, 5),
            t if t == format!("manylinux2010_{arch}") => (2, 12),
            t if t == format!("manylinux2014_{arch}") => (2, 17),
            t => {
                let rest = t
                    .strip_prefix("manylinux_")?
                    .strip_suffix(arch.as_str())?
                    .strip_suffix('_')?;
                let (a, b) = rest.split_once('_')?;
                (a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)
            }
        };
        if (major, minor) <= glibc {
            Some(10 + u32::try_from(minor).unwrap_or(0))
        } else {
            None
        }
    }

    /// How good a (python tag, abi tag) pair is (`None`: not usable by the target interpreter).
    fn interpreter_score(&self, py: &str, abi: &str) -> Option<u32> {
        let (major, minor) = (self.python.major, self.python.minor);
        let cp = format!("cp{major}{minor}");
        if py == cp && (abi == cp || abi == format!("{cp}m")) {
            return Some(1000);
        }
        if let Some(v) = py.strip_prefix("cp") {
            let (pm, pn) = split_py_version(v)?;
            if abi == "abi3" && pm == major && pn <= minor {
                return Some(800 + u32::try_from(pn).unwrap_or(0));
            }
            if abi == "none" && py == cp {
                return Some(700);
            }
            return None;
        }
        if let Some(v) = py.strip_prefix("py") {
            if abi != "none" {
                return None;
            }
            if v == major.to_string() {
                return Some(500);
            }
            let (pm, pn) = split_py_version(v)?;
            if pm == major && pn <= minor {
                return Some(600 + u32::try_from(pn).unwrap_or(0));
            }
        }
        None
    }

    /// The score of a wheel for this target: `None` when it does not install here, else higher is better.
    pub(crate) fn wheel_score(&self, wheel: &WheelName) -> Option<u32> {
        let mut best: Option<u32> = None;
        for py in &wheel.python {
            for abi in &wheel.abi {
                let Some(i) = self.interpreter_score(py, abi) else {
                    continue;
                };
                for plat in &wheel.platform {
                    if let Some(p) = self.platform_score(plat) {
                        let score = i * 1000 + p;
                        best = Some(best.map_or(score, |b| b.max(score)));
                    }
                }
            }
        }
        best
    }
}

/// `"311"` -> (3, 11), `"3"` -> None (no minor).
pub(crate) fn split_py_version(v: &str) -> Option<(u64, u64)> {
    if v.len() < 2 || !v.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let major = v[..1].parse().ok()?;
    let minor = v[1..].parse().ok()?;
    Some((major, minor))
}

/// Summarize interpreter tags of a set of wheels for messages: `cp27, cp34..cp36`.
pub fn summarize_python_tags(tags: impl IntoIterator<Item = String>) -> String {
    let mut cp: Vec<(u64, u64)> = Vec::new();
    let mut other: Vec<String> = Vec::new();
    for t in tags {
        match t.strip_prefix("cp").and_then(split_py_version) {
            Some(v) => cp.push(v),
            None => other.push(t),
        }
    }
    cp.sort();
    cp.dedup();
    other.sort();
    other.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cp.len() {
        let mut j = i;
        while j + 1 < cp.len() && cp[j + 1].0 == cp[j].0 && cp[j + 1].1 == cp[j].1 + 1 {
            j += 1;
        }
        let s = |v: (u64, u64)| format!("cp{}{}", v.0, v.1);
        if j > i {
            parts.push(format!("{}..{}", s(cp[i]), s(cp[j])));
        } else {
            parts.push(s(cp[i]));
        }
        i = j + 1;
    }
    parts.extend(other);
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> TargetSpec {
        let platform = Platform {
            os: "linux".into(),
            arch: "x86_64".into(),
            glibc: Some((2, 36)),
        };
        TargetSpec::new("3.11", platform).unwrap()
    }

    fn score(name: &str) -> Option<u32> {
        target().wheel_score(&name.parse().unwrap())
    }

    /// A hostile index listed `panicpkg-1.0-cpé1-none-any.whl`: the solver's python-tag hint sliced `é1` by byte and
    /// `hvd lock` panicked. Such a name is no wheel name at all.
    #[test]
    fn wheel_names_with_non_ascii_or_path_characters_are_refused() {
        for name in [
            "panicpkg-1.0-cp\u{e9}1-none-any.whl",
            "p-1.0-py3-none-any/../x.whl",
            "p-1.0-py3-none-a ny.whl",
        ] {
            assert!(name.parse::<WheelName>().is_err(), "{name}");
        }
        assert!(
            "p-1.0+local-1-cp311-cp311-manylinux_2_17_x86_64.whl"
                .parse::<WheelName>()
                .is_ok()
        );
        assert_eq!(split_py_version("\u{e9}1"), None);
    }

    #[test]
    fn wheel_compatibility() {
        assert!(score("a-1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl").is_some());
        assert!(score("a-1-cp311-cp311-manylinux1_x86_64.whl").is_some());
        assert!(score("a-1-cp311-cp311-manylinux_2_38_x86_64.whl").is_none());
        assert!(score("a-1-cp311-cp311-manylinux_2_17_aarch64.whl").is_none());
        assert!(score("a-1-cp36-cp36m-manylinux1_x86_64.whl").is_none());
        assert!(score("a-1-cp312-abi3-manylinux1_x86_64.whl").is_none());
        assert!(score("a-1-cp38-abi3-linux_x86_64.whl").is_some());
        assert!(score("a-1-py3-none-any.whl").is_some());
        assert!(score("a-1-py2.py3-none-any.whl").is_some());
        assert!(score("a-1-py2-none-any.whl").is_none());
        assert!(score("a-1-cp311-cp311-win_amd64.whl").is_none());
        // Best first: exact ABI > abi3 > pure; newer manylinux > older.
        assert!(
            score("a-1-cp311-cp311-manylinux1_x86_64.whl")
                > score("a-1-cp38-abi3-manylinux1_x86_64.whl")
        );
        assert!(score("a-1-cp38-abi3-manylinux1_x86_64.whl") > score("a-1-py3-none-any.whl"));
        assert!(
            score("a-1-cp311-cp311-manylinux_2_28_x86_64.whl")
                > score("a-1-cp311-cp311-manylinux2014_x86_64.whl")
        );
    }

    #[test]
    fn summarizes_tags() {
        let tags = ["cp36", "cp27", "cp34", "cp35", "py3"].map(String::from);
        assert_eq!(summarize_python_tags(tags), "cp27, cp34..cp36, py3");
    }

    #[test]
    fn bad_python_is_an_error() {
        assert!(PythonVersion::parse("three").is_err());
        assert!(PythonVersion::parse("3").is_err());
        assert_eq!(PythonVersion::parse("3.11.4").unwrap().patch, 4);
    }
}
