//! Finding the base interpreter for `env.python` on this machine.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};

/// A base interpreter an env is layered on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpreter {
    /// The real executable (`sys.executable` of the interpreter itself, not a pyenv shim).
    pub executable: PathBuf,
    /// Full version, e.g. `3.11.7`.
    pub version: String,
    /// `major.minor`, e.g. `3.11`.
    pub short_version: String,
}

impl Interpreter {
    /// Ask `candidate` who it is; `None` when it does not run.
    pub fn probe(candidate: &Path) -> Option<Interpreter> {
        let output = Command::new(candidate)
            // `-E -s -S` rather than `-I`, which python 2.7 rejects (`import sys` cannot be shadowed by the cwd).
            .args([
                "-E",
                "-s",
                "-S",
                "-c",
                "import sys; print(sys.executable); print('%d.%d.%d' % sys.version_info[:3])",
            ])
            .stdin(std::process::Stdio::null())
            .output()
            .ok()?;
        if !output.status.success() {
            return None;
        }
        let text = String::from_utf8(output.stdout).ok()?;
        let mut lines = text.lines();
        let executable = PathBuf::from(lines.next()?.trim());
        let version = lines.next()?.trim().to_string();
        let short_version = version.split('.').take(2).collect::<Vec<_>>().join(".");
        if executable.as_os_str().is_empty() {
            return None;
        }
        Some(Interpreter {
            executable,
            version,
            short_version,
        })
    }

    /// Whether this interpreter satisfies a request like `3.11` or `3.11.7`.
    pub fn matches(&self, request: &str) -> bool {
        self.version == request || self.version.starts_with(&format!("{request}."))
    }

    /// Find an interpreter for `request` (`3.11`, `3.11.7`): `HVD_PYTHON` first, then `pythonX.Y` on PATH (pyenv's
    /// versions, newest first, in place of a shims directory), pyenv's versions, /usr/bin, /usr/local/bin, then
    /// `python3` on PATH. [`Error::PythonNotFound`] lists the same order.
    pub fn find(request: &str) -> Result<Interpreter> {
        let short: String = request.split('.').take(2).collect::<Vec<_>>().join(".");
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(explicit) = std::env::var_os("HVD_PYTHON") {
            candidates.push(PathBuf::from(explicit));
        }
        let exe = format!("python{short}");
        let pyenv_root = std::env::var_os("PYENV_ROOT")
            .map(PathBuf::from)
            .or_else(|| dirs::home_dir().map(|home| home.join(".pyenv")));
        let mut pyenv_versions: Vec<PathBuf> = Vec::new();
        if let Some(versions) = pyenv_root.map(|root| root.join("versions"))
            && let Ok(entries) = fs_err::read_dir(&versions)
        {
            let mut names: Vec<_> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name())
                .collect();
            names.sort();
            names.reverse();
            pyenv_versions.extend(
                names
                    .into_iter()
                    .map(|name| versions.join(name).join("bin").join(&exe)),
            );
        }
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                if dir.ends_with("shims") && dir.join(&exe).is_file() {
                    // pyenv's shims are shell scripts costing ~50 ms a call: probe pyenv's versions (newest
                    // first) at the shim's place in PATH instead.
                    candidates.append(&mut pyenv_versions.clone());
                } else {
                    candidates.push(dir.join(&exe));
                }
            }
        }
        candidates.extend(pyenv_versions);
        candidates.push(PathBuf::from("/usr/bin").join(&exe));
        candidates.push(PathBuf::from("/usr/local/bin").join(&exe));
        candidates.push(PathBuf::from("python3"));
        for candidate in candidates {
            if candidate.components().count() > 1 && !candidate.is_file() {
                continue;
            }
            if let Some(found) = Interpreter::probe(&candidate)
                && found.matches(request)
            {
                return Ok(found);
            }
        }
        Err(Error::PythonNotFound {
            version: request.to_string(),
        })
    }
}
