//! Delivering a run to ssh hosts that share no file system with the launcher: the env's closure substituted on each
//! host from the binary caches (`hvd cache pull` over ssh, verified there), and the project's files (the distributed
//! steps' `inputs`, else the project directory) as a content-addressed work directory on each host.

use std::collections::BTreeSet;
use std::io::Read as _;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest as _, Sha256};

use super::SshSetup;
use super::check::CheckReport;
use super::remote::{host_text, timed_out};
use crate::closure::{EnvIdentity, printable};
use crate::engines::shell::quote;

/// The most bytes of project files hvd sends to a host without declared `inputs` (a data set in the project
/// directory should not travel by accident): past it, the user declares the steps' `inputs`.
pub const WORK_FILES_LIMIT: u64 = 512 << 20;
/// The most entries (files, links) of a work directory.
pub const WORK_ENTRIES_LIMIT: usize = 50_000;

/// The project's files the ranks need on a host without the project directory: paths relative to the project
/// directory (regular files and symbolic links, in sorted order) and their content hash, which names the host's work
/// directory (`${XDG_CACHE_HOME:-$HOME/.cache}/hvd/work/<hash>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkFiles {
    pub root: PathBuf,
    pub files: Vec<PathBuf>,
    /// sha256 over every entry's path, kind, executable bit and content (a link's target), hex.
    pub hash: String,
}

impl WorkFiles {
    /// The files of `inputs` (relative paths: files or directories) below `root`, or, when `inputs` is empty, of
    /// the whole project directory but its `.hvd/` and `.git/`. An input that leaves the project directory is
    /// refused; more than [`WORK_FILES_LIMIT`] bytes or [`WORK_ENTRIES_LIMIT`] entries too (declare `inputs`).
    pub fn collect(root: &Path, inputs: &[String]) -> Result<WorkFiles, String> {
        let mut found: BTreeSet<PathBuf> = BTreeSet::new();
        let starts: Vec<PathBuf> = if inputs.is_empty() {
            vec![PathBuf::new()]
        } else {
            let mut starts = Vec::new();
            for input in inputs {
                let path = Path::new(input);
                if path.is_absolute()
                    || path
                        .components()
                        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
                {
                    return Err(format!(
                        "the step input {} is not a path inside the project directory; the ssh engine sends only \
                         the project's own files to a host",
                        printable(input)
                    ));
                }
                inside_project(root, path, input)?;
                starts.push(path.to_path_buf());
            }
            starts
        };
        let mut bytes = 0u64;
        let mut stack = starts;
        while let Some(rel) = stack.pop() {
            let full = root.join(&rel);
            let meta = match fs_err::symlink_metadata(&full) {
                Ok(meta) => meta,
                // A declared input the step has not made yet (an output of an earlier step): nothing to send.
                Err(e)
                    if e.kind() == std::io::ErrorKind::NotFound && !rel.as_os_str().is_empty() =>
                {
                    continue;
                }
                Err(e) => return Err(e.to_string()),
            };
            if meta.is_dir() {
                let top = rel.as_os_str().is_empty();
                for entry in fs_err::read_dir(&full).map_err(|e| e.to_string())? {
                    let entry = entry.map_err(|e| e.to_string())?;
                    let name = entry.file_name();
                    if inputs.is_empty() && top && (name == ".hvd" || name == ".git") {
                        continue;
                    }
                    stack.push(rel.join(name));
                }
            } else if meta.is_file() || meta.file_type().is_symlink() {
                bytes += meta.len();
                found.insert(rel);
            }
            if bytes > WORK_FILES_LIMIT || found.len() > WORK_ENTRIES_LIMIT {
                return Err(format!(
                    "the project directory {} holds more than {} MiB or {} files; the ssh engine copies the files \
                     the ranks need to hosts without it: declare them as the distributed steps' `inputs` (or share \
                     the directory at the same path on every host)",
                    root.display(),
                    WORK_FILES_LIMIT >> 20,
                    WORK_ENTRIES_LIMIT
                ));
            }
        }
        let files: Vec<PathBuf> = found.into_iter().collect();
        let mut hasher = Sha256::new();
        for rel in &files {
            let full = root.join(rel);
            let meta = fs_err::symlink_metadata(&full).map_err(|e| e.to_string())?;
            hasher.update(rel.as_os_str().as_encoded_bytes());
            hasher.update([0]);
            if meta.file_type().is_symlink() {
                let target = fs_err::read_link(&full).map_err(|e| e.to_string())?;
                hasher.update(b"link\0");
                hasher.update(target.as_os_str().as_encoded_bytes());
            } else {
                use std::os::unix::fs::PermissionsExt as _;
                let exec = meta.permissions().mode() & 0o111 != 0;
                hasher.update(if exec { b"exec\0" } else { b"file\0" });
                hasher.update(meta.len().to_le_bytes());
                let mut file = fs_err::File::open(&full).map_err(|e| e.to_string())?;
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = file.read(&mut buf).map_err(|e| e.to_string())?;
                    if n == 0 {
                        break;
                    }
                    hasher.update(&buf[..n]);
                }
            }
            hasher.update([0]);
        }
        let hash = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(WorkFiles {
            root: root.to_path_buf(),
            files,
            hash,
        })
    }
}

/// Refuses `input` (relative to `root`) when a directory on its way is a symbolic link that leads out of the project
/// directory: `tar` and the hashing follow such links, so `data/x` with `data -> /home/me` would send `/home/me/x`.
/// The input itself may be a link: it travels as a link, never as what it points to.
fn inside_project(root: &Path, input: &Path, text: &str) -> Result<(), String> {
    let Some(parent) = input.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return Ok(());
    };
    let real_root = fs_err::canonicalize(root).map_err(|e| e.to_string())?;
    match std::fs::canonicalize(root.join(parent)) {
        Ok(real) if real.starts_with(&real_root) => Ok(()),
        // Not there yet (an output of an earlier step): nothing to send.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Ok(real) => Err(format!(
            "the step input {} leads out of the project directory through a symbolic link (to {}); the ssh engine \
             sends only the project's own files to a host: declare the files inside the project, or share the \
             directory at the same path on every host",
            printable(text),
            printable(&real.display().to_string())
        )),
        Err(e) => Err(format!("the step input {}: {e}", printable(text))),
    }
}

/// The most names [`project_markers`] gives.
const MARKERS_LIMIT: usize = 64;

/// Names (relative to the project directory `root`) that a host's directory at the project's path must hold to be
/// taken as the project: the top of each declared input that exists here, else the project directory's top-level
/// regular files (its scripts and .hvd file; not its directories, which are often a run's outputs), at most
/// [`MARKERS_LIMIT`], UTF-8 names only. The host's files are not compared with these (docs/engines.md).
pub(super) fn project_markers(root: &Path, inputs: &[String]) -> Vec<String> {
    let mut names: BTreeSet<String> = BTreeSet::new();
    if inputs.is_empty() {
        if let Ok(entries) = std::fs::read_dir(root) {
            for entry in entries.flatten() {
                let is_file = entry.file_type().is_ok_and(|t| t.is_file());
                if let (true, Ok(name)) = (is_file, entry.file_name().into_string()) {
                    names.insert(name);
                }
            }
        }
    } else {
        for input in inputs {
            let Some(Component::Normal(top)) = Path::new(input)
                .components()
                .find(|c| !matches!(c, Component::CurDir))
            else {
                continue;
            };
            if let (Ok(_), Some(top)) = (std::fs::symlink_metadata(root.join(input)), top.to_str())
            {
                names.insert(top.to_owned());
            }
        }
    }
    names.into_iter().take(MARKERS_LIMIT).collect()
}

/// The shell words of a host's work directory for `hash` (expanded by the host's shell).
fn work_dir_words(hash: &str) -> String {
    format!("\"${{XDG_CACHE_HOME:-$HOME/.cache}}/hvd/work/{hash}\"")
}

impl SshSetup {
    /// Makes the project's `work` files a work directory on `host` (sent as a tar over ssh, unpacked into a temp
    /// directory, its files read-only, and renamed into place whole), and returns the path there of a fresh
    /// directory for this run made from it (`<hash>.run.XXXXXXXX`, hard links). A work directory already there is
    /// kept only when it has exactly the files sent (names, kinds, executable bits, contents, link targets): one
    /// that is stale or was changed (a rank running as root writes through the hard links, a user edits it) is
    /// replaced.
    pub(super) fn send_work(&self, host: &str, work: &WorkFiles) -> Result<PathBuf, String> {
        let w = work_dir_words(&work.hash);
        // The cached copy's files are read-only; each run gets a directory of its own with hard links to them, so one
        // run's outputs never show up in another's, and two runs never share a working directory. `same A B`: the
        // two trees have the same entries (kind, executable bit, name) and contents (`diff -r --no-dereference`:
        // file bytes and link targets); where `diff` cannot tell, or `find` has no `-printf` (busybox: both listings
        // would be empty, so equal), the copy is replaced. A stale copy is removed after making its directories
        // writable (all `rm -rf` needs): not followed when it is a symbolic link, and its files (hard links a running
        // run may share) are left read-only.
        let script = format!(
            "w={w}; same() {{ find . -maxdepth 0 -printf '' >/dev/null 2>&1 || return 1; \
             diff -r --no-dereference -q \"$1\" \"$2\" >/dev/null 2>&1 && \
             [ \"$(cd \"$1\" && find . \\( -type f -perm -u+x -printf 'x %P\\n' \\) -o -printf '%y %P\\n' | \
             LC_ALL=C sort)\" = \"$(cd \"$2\" && find . \\( -type f -perm -u+x -printf 'x %P\\n' \\) -o \
             -printf '%y %P\\n' | LC_ALL=C sort)\" ]; }}; mkdir -p \"${{w%/*}}\" || exit 1; \
             t=\"$w.tmp.$$\"; rm -rf \"$t\"; mkdir \"$t\" && tar -C \"$t\" --no-same-owner -xf - && \
             find \"$t\" -type f -exec chmod a-w {{}} + && \
             : > \"$t/.hvd-work\" || {{ rm -rf \"$t\"; exit 1; }}; \
             if [ -f \"$w/.hvd-work\" ] && same \"$t\" \"$w\"; then rm -rf \"$t\"; else \
             if [ -e \"$w\" ] || [ -L \"$w\" ]; then o=\"$w.stale.$$\"; mv -T \"$w\" \"$o\" && \
             {{ [ -L \"$o\" ] || find \"$o\" -type d ! -perm -u+w -exec chmod u+w {{}} + 2>/dev/null; \
             rm -rf \"$o\"; }} || \
             {{ echo \"hvd: cannot replace the stale work directory $w\" >&2; rm -rf \"$t\"; exit 1; }}; fi; \
             mv -T \"$t\" \"$w\" 2>/dev/null || rm -rf \"$t\"; fi; \
             [ -f \"$w/.hvd-work\" ] || exit 1; r=$(mktemp -d \"$w.run.XXXXXXXX\") && \
             cp -al \"$w/.\" \"$r/\" && rm -f \"$r/.hvd-work\" || exit 1; echo \"hvd-work:$r\""
        );
        // Names come from a file list on stdin, verbatim (a name starting with `-` is a name, not an option), each
        // below `./`.
        let mut tar = Command::new("tar")
            .arg("-C")
            .arg(&work.root)
            .args([
                "--null",
                "--no-recursion",
                "--verbatim-files-from",
                "-T",
                "-",
                "-cf",
                "-",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("failed to run tar: {e}"))?;
        let mut list = Vec::new();
        for file in &work.files {
            list.extend_from_slice(b"./");
            list.extend_from_slice(file.as_os_str().as_encoded_bytes());
            list.push(0);
        }
        let names = tar.stdin.take();
        let feeder = std::thread::spawn(move || {
            if let Some(mut stdin) = names {
                let _ = std::io::Write::write_all(&mut stdin, &list);
            }
        });
        let Some(archive) = tar.stdout.take() else {
            return Err("tar has no output pipe".into());
        };
        let out = self.unpack_on(host, &script, archive, &mut tar);
        let _ = feeder.join();
        let tar_out = tar.wait_with_output().map_err(|e| format!("tar: {e}"))?;
        let out = out?;
        if out.timed_out {
            return Err(timed_out(
                host,
                "copying the project's files",
                self.deadlines.copy,
            ));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let dir = stdout
            .lines()
            .find_map(|l| l.strip_prefix("hvd-work:"))
            .map(PathBuf::from);
        match dir {
            Some(dir)
                if tar_out.status.success()
                    && out.status.success()
                    && dir.is_absolute()
                    && !dir
                        .as_os_str()
                        .as_encoded_bytes()
                        .iter()
                        .any(u8::is_ascii_control) =>
            {
                Ok(dir)
            }
            _ => Err(format!(
                "copying the project's files ({} files) to a work directory on host `{host}` failed: {}{}",
                work.files.len(),
                host_text(&tar_out.stderr),
                host_text(&out.stderr)
            )),
        }
    }

    /// Pulls the env `env` (a store path) on `host` with its `hvd` there, `hvd worker-env --once --pull=ENV
    /// --cache=URL... --trusted-key=KEY... -- /bin/sh -c SCRIPT`: the host fetches the env's closure from the caches
    /// and verifies every path (signature by a trusted key, archive sha256, content hash) before it becomes valid
    /// there, then runs the check script `script` while the shim's temporary gc root holds the env (an `hvd gc`
    /// there cannot remove it between the pull and the check). Fails naming the host and what the pull said.
    pub(super) fn pull_and_check(
        &self,
        host: &str,
        hvd: &str,
        env: &Path,
        script: &str,
        local: Option<&EnvIdentity>,
    ) -> Result<CheckReport, String> {
        let name = env
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let through = self
            .pull_through(Some(env), hvd)
            .map_err(|e| e.to_string())?;
        let remote = format!(
            "exec {} /bin/sh -c {}",
            through
                .iter()
                .map(|w| quote(w))
                .collect::<Vec<_>>()
                .join(" "),
            quote(script)
        );
        self.read_check(host, &remote, local, Some(&name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_files_are_the_inputs_or_the_project_and_hash_by_content() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join(".hvd/runs")).unwrap();
        std::fs::create_dir_all(d.join("src")).unwrap();
        std::fs::write(d.join(".hvd/runs/log"), "x").unwrap();
        std::fs::write(d.join("train.py"), "print(1)").unwrap();
        std::fs::write(d.join("src/a.py"), "a").unwrap();
        std::fs::write(d.join("-n"), "dash").unwrap();
        let all = WorkFiles::collect(d, &[]).unwrap();
        let names: Vec<String> = all.files.iter().map(|f| f.display().to_string()).collect();
        assert_eq!(names, ["-n", "src/a.py", "train.py"]);
        let some = WorkFiles::collect(d, &["src".into(), "missing-yet".into()]).unwrap();
        assert_eq!(some.files, [PathBuf::from("src/a.py")]);
        assert_ne!(some.hash, all.hash);
        // Content, not time, names the work directory.
        let again = WorkFiles::collect(d, &[]).unwrap();
        assert_eq!(again.hash, all.hash);
        std::fs::write(d.join("src/a.py"), "b").unwrap();
        assert_ne!(WorkFiles::collect(d, &[]).unwrap().hash, all.hash);
        // A directory on the way that is a link out of the project: refused, naming the input.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(outside.path(), d.join("data")).unwrap();
        let err = WorkFiles::collect(d, &["data/secret".into()]).unwrap_err();
        assert!(
            err.contains("`data/secret` leads out of the project"),
            "{err}"
        );
        std::fs::create_dir(d.join("real")).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.join("real/up")).unwrap();
        let err = WorkFiles::collect(d, &["real/up/secret".into()]).unwrap_err();
        assert!(err.contains("leads out of the project"), "{err}");
        // A link inside the project is followed; a link as the input itself travels as a link.
        std::os::unix::fs::symlink("src", d.join("code")).unwrap();
        let via = WorkFiles::collect(d, &["code/a.py".into(), "data".into()]).unwrap();
        assert_eq!(
            via.files,
            [PathBuf::from("code/a.py"), PathBuf::from("data")]
        );
        for bad in ["../etc", "/etc", "src/../../x"] {
            let err = WorkFiles::collect(d, &[bad.into()]).unwrap_err();
            assert!(
                err.contains("not a path inside the project directory"),
                "{err}"
            );
        }
    }
}
