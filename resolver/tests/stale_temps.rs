//! Issue 16 (low): a killed `hvd lock` left its temp files (`.<name>.<pid>.<n>.tmp`) in the metadata cache and
//! next to the lockfile forever. The next run removes the stale ones (an hour old, or a minute old with their
//! writer's pid gone) and keeps everything else: live temps, cache entries, other files' temps, links.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use hvd_resolver::lock;
use hvd_resolver::testing::{FixtureIndex, FixtureOptions, env_of, lock_options};

/// The pid of a process that has ended (a real child, waited for).
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

fn write_aged(path: &Path, age: Duration) {
    std::fs::write(path, b"half written").unwrap();
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(SystemTime::now() - age)
        .unwrap();
}

const HOUR: Duration = Duration::from_secs(3600);
const MINUTES: Duration = Duration::from_secs(300);

/// Every file (not directory) under `dir`, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let t = entry.file_type().unwrap();
            if t.is_dir() {
                stack.push(entry.path());
            } else {
                out.push(entry.path());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_lock_removes_stale_temps_of_the_metadata_cache_once_an_hour() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::helper(FixtureOptions::default());
    let dead = dead_pid();
    let me = std::process::id();
    let bucket = cache.path().join("v1/metadata/ab");
    let http = cache.path().join("v1/http/cd");
    std::fs::create_dir_all(&bucket).unwrap();
    std::fs::create_dir_all(&http).unwrap();
    let old = bucket.join(format!(".ab01.{me}.0.tmp")); // an hour old: stale whatever its pid
    let dead_writer = http.join(format!(".cd01.json.{dead}.3.tmp")); // minutes old, writer gone
    let fresh_dead = bucket.join(format!(".ab02.{dead}.1.tmp")); // writer gone, but seconds old: kept
    let live = bucket.join(format!(".ab03.{me}.2.tmp")); // writer alive, minutes old: kept
    let entry = bucket.join("ab04"); // a cache entry, however old: kept
    let not_ours = bucket.join(".ab05.x.1.tmp"); // not a temp name: kept
    write_aged(&old, 2 * HOUR);
    write_aged(&dead_writer, MINUTES);
    write_aged(&fresh_dead, Duration::ZERO);
    write_aged(&live, MINUTES);
    write_aged(&entry, 100 * HOUR);
    write_aged(&not_ours, 100 * HOUR);
    // A link named like a temp, pointing outside: neither it nor its target is touched.
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("keep");
    write_aged(&target, 2 * HOUR);
    let link = bucket.join(format!(".ab06.{dead}.0.tmp"));
    std::os::unix::fs::symlink(&target, &link).unwrap();

    lock(&env_of(&["helper"]), &lock_options(&index, cache.path())).unwrap();
    assert!(!old.exists(), "an hour-old temp was kept");
    assert!(!dead_writer.exists(), "a temp of a dead writer was kept");
    for kept in [&fresh_dead, &live, &entry, &not_ours, &target] {
        assert!(kept.exists(), "{kept:?} was removed");
    }
    assert!(link.symlink_metadata().is_ok(), "the link was removed");
    // No temp of this lock is left behind.
    let left: Vec<_> = files(cache.path())
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert_eq!(left.len(), 4, "{left:?}"); // fresh_dead, live, not_ours, link

    // Within the hour the cache is not swept again (a lock pays nothing for it)...
    let later = bucket.join(format!(".ab07.{dead}.0.tmp"));
    write_aged(&later, 2 * HOUR);
    lock(&env_of(&["helper"]), &lock_options(&index, cache.path())).unwrap();
    assert!(later.exists());
    // ...and once the last sweep is an hour old, it is.
    write_aged(&cache.path().join("v1/.temp-sweep"), 2 * HOUR);
    lock(&env_of(&["helper"]), &lock_options(&index, cache.path())).unwrap();
    assert!(!later.exists());
}

#[test]
fn writing_a_lockfile_removes_its_stale_temps_only() {
    let cache = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let index = FixtureIndex::helper(FixtureOptions::default());
    let lockfile = lock(&env_of(&["helper"]), &lock_options(&index, cache.path())).unwrap();
    let dead = dead_pid();
    let me = std::process::id();
    let dir = project.path();
    let stale = dir.join(format!(".train.hvd.lock.{dead}.0.tmp"));
    let old = dir.join(format!(".train.hvd.lock.{me}.9.tmp"));
    let live = dir.join(format!(".train.hvd.lock.{me}.1.tmp"));
    let other = dir.join(format!(".other.hvd.lock.{dead}.0.tmp"));
    let user = dir.join("notes.tmp");
    write_aged(&stale, MINUTES);
    write_aged(&old, 2 * HOUR);
    write_aged(&live, MINUTES);
    write_aged(&other, 2 * HOUR);
    write_aged(&user, 2 * HOUR);
    let path = dir.join("train.hvd.lock");
    lockfile.write(&path).unwrap();
    assert!(!stale.exists() && !old.exists());
    for kept in [&live, &other, &user, &path] {
        assert!(kept.exists(), "{kept:?} was removed");
    }
    assert_eq!(std::fs::read_dir(dir).unwrap().count(), 4);
}
