//! The `file:DIR` rendezvous against another local user and against leftovers of an earlier job: files are the
//! user's only (0600, in a 0700 `DIR/hvd`, written under a fresh name and renamed), a directory someone else could
//! write into is refused with an error that names it and says what to do, and a stale file of another job is
//! ignored while the real one is awaited, then named when the wait ends.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use hvd_collective::bootstrap::{KeyValueClient, Rendezvous};

fn client(dir: &Path, rank: usize, job: Option<&str>) -> KeyValueClient {
    Rendezvous::Directory(dir.to_path_buf())
        .client(rank)
        .with_job(job)
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn rendezvous_files_are_the_users_only() {
    let dir = tempfile::tempdir().unwrap();
    let rdv = dir.path().join("rdv");
    // The most permissive umask: whatever is private below is private because hvd made it so.
    // SAFETY: umask has no preconditions; restored below (the other tests here create nothing with default modes).
    let old = unsafe { libc::umask(0) };
    let put = client(&rdv, 0, None).put("addr.0", b"v1 host0 127.0.0.1:5");
    let key = client(&rdv, 0, None).put("tcp.key", &[b'a'; 64]);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    put.unwrap();
    key.unwrap();
    assert_eq!(mode(&rdv), 0o700, "a missing DIR is created 0700");
    assert_eq!(mode(&rdv.join("hvd")), 0o700);
    for f in ["addr.0", "tcp.key"] {
        assert_eq!(mode(&rdv.join("hvd").join(f)), 0o600, "{f}");
    }
    let names: Vec<String> = std::fs::read_dir(rdv.join("hvd"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "no temporary file is left: {names:?}");
    let got = client(&rdv, 1, None)
        .get("addr.0", Duration::from_secs(5))
        .unwrap();
    assert_eq!(got, b"v1 host0 127.0.0.1:5");
}

#[test]
fn a_directory_others_can_write_is_refused() {
    for (what, make) in [
        ("DIR", 0o777u32),
        ("DIR group-writable", 0o770),
        ("DIR/hvd", 0o777),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let bad = if what == "DIR/hvd" {
            let scope = dir.path().join("hvd");
            std::fs::create_dir(&scope).unwrap();
            scope
        } else {
            dir.path().to_path_buf()
        };
        std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(make)).unwrap();
        let e = client(dir.path(), 0, None)
            .put("addr.0", b"v1 h 127.0.0.1:5")
            .expect_err(what)
            .to_string();
        assert!(
            e.contains(&bad.display().to_string())
                && e.contains("writable by its group or others")
                && e.contains("chmod go-w"),
            "{what}: {e}"
        );
        let e = client(dir.path(), 1, None)
            .get("addr.0", Duration::from_millis(50))
            .expect_err(what)
            .to_string();
        assert!(e.contains("writable by its group or others"), "{what}: {e}");
        assert!(
            !dir.path().join("hvd").join("addr.0").exists(),
            "{what}: nothing written"
        );
    }
}

#[test]
fn a_directory_of_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: geteuid has no preconditions.
    let foreign = if unsafe { libc::geteuid() } == 0 {
        // As root: a directory handed to `nobody`.
        let d = dir.path().join("theirs");
        std::fs::create_dir(&d).unwrap();
        std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
        d
    } else {
        // Otherwise the root directory: owned by root, not group or other writable.
        Path::new("/").to_path_buf()
    };
    let owner = std::fs::metadata(&foreign).unwrap().uid();
    let e = client(&foreign, 0, None)
        .put("addr.0", b"v1 h 127.0.0.1:5")
        .expect_err("another user's directory")
        .to_string();
    assert!(
        e.contains(&foreign.display().to_string())
            && e.contains(&format!("belongs to uid {owner}"))
            && e.contains("mktemp -d"),
        "{e}"
    );
    assert!(!foreign.join("hvd").exists());
}

#[test]
fn a_stale_file_of_an_earlier_job_is_not_read() {
    let dir = tempfile::tempdir().unwrap();
    // An earlier job (id 41) left rank 1's address and its key behind.
    client(dir.path(), 1, Some("41"))
        .put("addr.1", b"v1 old 127.0.0.1:1")
        .unwrap();
    client(dir.path(), 0, Some("41"))
        .put("tcp.key", &[b'0'; 64])
        .unwrap();
    // Job 42 does not take them; when its wait ends, it names the file and the other job.
    let e = client(dir.path(), 0, Some("42"))
        .get("addr.1", Duration::from_millis(200))
        .expect_err("a stale address")
        .to_string();
    assert!(
        e.contains(&dir.path().join("hvd").join("addr.1").display().to_string())
            && e.contains("another job (job id `41`, this job is `42`)")
            && e.contains("its own directory"),
        "{e}"
    );
    // The stale file is ignored while job 42's own rank 1 is awaited: its value, published later, is read.
    let value = std::thread::scope(|s| {
        let reader =
            s.spawn(|| client(dir.path(), 1, Some("42")).get("tcp.key", Duration::from_secs(20)));
        std::thread::sleep(Duration::from_millis(100));
        client(dir.path(), 0, Some("42"))
            .put("tcp.key", &[b'f'; 64])
            .unwrap();
        reader.join().unwrap()
    });
    assert_eq!(
        value.unwrap(),
        vec![b'f'; 64],
        "job 42's own key, not job 41's"
    );
    // A file that is not a rendezvous file at all is refused, named.
    std::fs::write(dir.path().join("hvd").join("addr.2"), b"v1 h 127.0.0.1:5").unwrap();
    let e = client(dir.path(), 0, Some("42"))
        .get("addr.2", Duration::from_millis(100))
        .expect_err("not a rendezvous file")
        .to_string();
    assert!(
        e.contains("addr.2") && e.contains("not an hvd rendezvous file"),
        "{e}"
    );
}
