//! Temp files written next to their target and renamed into place: their unique names, the atomic write, and the
//! sweep of temps a killed writer left behind (the resolver's caches and lockfiles, the builder's downloads).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// The temp-file suffix of [`write_atomic`].
pub(crate) const WRITE_SUFFIX: &str = "tmp";

/// A temp file untouched this long belongs to a writer that died: a live writer writes at least every read
/// timeout (at most two minutes) or fails.
const STALE_TEMP: Duration = Duration::from_secs(3600);
/// Sooner when its writer's pid is gone (as this machine's `/proc` sees it; a writer in another pid namespace
/// that shares the directory still has a minute, far more than a writer waits between two writes).
const STALE_TEMP_DEAD_WRITER: Duration = Duration::from_secs(60);

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temp name for `target` in the same directory, `.{target}.{pid}.{n}.{suffix}`: unique per process and call
/// (two writers, or two tasks of one process, never share it), and recognized by [`remove_stale_temps`].
pub fn temp_name(target: &str, suffix: &str) -> String {
    format!(
        ".{target}.{}.{}.{suffix}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Write a file atomically: readers see the old or the new content, never half. The temp file
/// ([`temp_name`], suffix [`WRITE_SUFFIX`]) is created exclusively and removed when the write fails.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let parent = path.parent().unwrap_or(Path::new("."));
    fs_err::create_dir_all(parent)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(temp_name(&name, WRITE_SUFFIX));
    let result = (|| {
        let mut file = fs_err::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(bytes)?;
        drop(file);
        fs_err::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The target file name and writer pid of a [`temp_name`] with `suffix`, `.{target}.{pid}.{n}.{suffix}`.
fn parse_temp_name<'a>(name: &'a str, suffix: &str) -> Option<(&'a str, u32)> {
    let rest = name
        .strip_prefix('.')?
        .strip_suffix(suffix)?
        .strip_suffix('.')?;
    let (rest, counter) = rest.rsplit_once('.')?;
    let (target, pid) = rest.rsplit_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if target.is_empty() || !digits(counter) || !digits(pid) {
        return None;
    }
    Some((target, pid.parse().ok()?))
}

/// Whether process `pid`, the writer of a temp file, is gone, where `/proc` can tell (else `false`: assume it
/// lives; this process is never gone).
fn writer_gone(pid: u32) -> bool {
    pid != std::process::id()
        && Path::new("/proc/self").exists()
        && !Path::new("/proc").join(pid.to_string()).exists()
}

/// Remove the temp files ([`temp_name`] with `suffix`) in `dir` that no live writer can own: untouched for an
/// hour, or for a minute when their writer's pid is gone. With `target`, only temps of that file name. Only
/// regular files named like such temps are touched. Returns how many were removed.
pub fn remove_stale_temps(dir: &Path, suffix: &str, target: Option<&str>) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let now = SystemTime::now();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((of, pid)) = name.to_str().and_then(|n| parse_temp_name(n, suffix)) else {
            continue;
        };
        if target.is_some_and(|t| t != of) {
            continue;
        }
        // `DirEntry::metadata` does not follow links: only regular files are removed.
        let Some(age) = entry
            .metadata()
            .ok()
            .filter(|m| m.is_file())
            .and_then(|m| m.modified().ok())
            .and_then(|t| now.duration_since(t).ok())
        else {
            continue;
        };
        let stale = age > STALE_TEMP || (age > STALE_TEMP_DEAD_WRITER && writer_gone(pid));
        if stale && std::fs::remove_file(entry.path()).is_ok() {
            tracing::debug!(file = %entry.path().display(), "removed a stale temp file");
            removed += 1;
        }
    }
    removed
}

/// [`remove_stale_temps`] of every temp in `dir`, the first time this process asks for `dir` and `suffix`
/// (later calls return 0 at once): for a directory many calls write into, such as the download cache.
pub fn remove_stale_temps_once(dir: &Path, suffix: &str) -> usize {
    static SWEPT: Mutex<BTreeSet<(PathBuf, String)>> = Mutex::new(BTreeSet::new());
    let first = SWEPT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .insert((dir.to_path_buf(), suffix.to_string()));
    if first {
        remove_stale_temps(dir, suffix, None)
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names_are_recognized_and_nothing_else() {
        assert_eq!(
            parse_temp_name(".train.hvd.lock.4242.7.tmp", "tmp"),
            Some(("train.hvd.lock", 4242))
        );
        assert_eq!(
            parse_temp_name(".ab12.json.1.0.tmp", "tmp"),
            Some(("ab12.json", 1))
        );
        assert_eq!(
            parse_temp_name(".abc.123.0.part", "part"),
            Some(("abc", 123))
        );
        let made = temp_name("x.whl", "part");
        assert_eq!(
            parse_temp_name(&made, "part"),
            Some(("x.whl", std::process::id()))
        );
        assert_ne!(temp_name("x.whl", "part"), made);
        for other in [
            "train.hvd.lock",
            "ab12.body",
            ".x.tmp",
            "..1.2.tmp",
            ".x.1.tmp",
            ".x.a.1.tmp",
            ".x.1.b.tmp",
            "x.1.2.tmp",
            ".x.1.2.part",
            ".x.1.2tmp",
        ] {
            assert_eq!(parse_temp_name(other, "tmp"), None, "{other}");
        }
        assert_eq!(parse_temp_name(".x.1.2.tmp", "part"), None);
    }

    #[test]
    fn a_directory_is_swept_once_per_process() {
        let dir = tempfile::tempdir().unwrap();
        let stale = |n: u32| {
            let path = dir.path().join(format!(".abc.1.{n}.part"));
            std::fs::write(&path, b"half").unwrap();
            std::fs::File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_modified(SystemTime::now() - 2 * STALE_TEMP)
                .unwrap();
            path
        };
        let first = stale(0);
        assert_eq!(remove_stale_temps_once(dir.path(), "part"), 1);
        assert!(!first.exists());
        let second = stale(1);
        assert_eq!(remove_stale_temps_once(dir.path(), "part"), 0);
        assert!(second.exists());
        // Another suffix is another sweep; the plain sweep always runs.
        assert_eq!(remove_stale_temps_once(dir.path(), "tmp"), 0);
        assert_eq!(remove_stale_temps(dir.path(), "part", None), 1);
        assert!(!second.exists());
    }
}
