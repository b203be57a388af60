//! gc and the store's lock files: gc unlinks the lock files no one holds (one is left behind for every path and cache
//! archive ever locked), keeps the held ones, and a lock taken while gc unlinks its file still excludes every other
//! holder (real flocks, threads each with their own open file, gc running in between).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use hvd_builder::Store;
use hvd_builder::gc::collect_garbage;

#[test]
fn gc_removes_the_lock_files_no_one_holds_and_keeps_held_ones() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    let locks = store.root().join(".locks");
    let stale = format!("archive-{}", "ab".repeat(32));
    drop(store.lock_path(&stale).unwrap());
    drop(
        store
            .lock_path("0123456789abcdef0123456789abcdef-gone-1.0")
            .unwrap(),
    );
    let held = store
        .lock_path(&format!("archive-{}", "cd".repeat(32)))
        .unwrap();
    let lock_files = || {
        let mut names: Vec<String> = std::fs::read_dir(&locks)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(lock_files().len(), 3);

    // A dry run counts them and removes nothing.
    let report = collect_garbage(&store, true).unwrap();
    assert_eq!(report.free_locks, 2);
    assert_eq!(lock_files().len(), 4, "{:?}", lock_files()); // gc.lock too now

    let report = collect_garbage(&store, false).unwrap();
    assert_eq!(report.free_locks, 2);
    assert_eq!(
        lock_files(),
        [
            format!("archive-{}.lock", "cd".repeat(32)),
            "gc.lock".into()
        ]
    );
    // The held lock still excludes: no one else gets it while it is held, and it is removable once released.
    let file =
        std::fs::File::open(locks.join(format!("archive-{}.lock", "cd".repeat(32)))).unwrap();
    assert!(matches!(
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock),
        Err((_, nix::errno::Errno::EWOULDBLOCK))
    ));
    drop(held);
    assert_eq!(collect_garbage(&store, false).unwrap().free_locks, 1);
    assert_eq!(lock_files(), ["gc.lock"]);
}

#[test]
fn a_lock_excludes_every_other_holder_while_gc_unlinks_lock_files() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    let name = format!("archive-{}", "ef".repeat(32));
    let inside = AtomicUsize::new(0);
    let overlaps = AtomicUsize::new(0);
    let entries = AtomicUsize::new(0);
    let removed = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let lockers: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    for _ in 0..150 {
                        let _lock = store.lock_path(&name).unwrap();
                        if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        entries.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_micros(200));
                        inside.fetch_sub(1, Ordering::SeqCst);
                        std::thread::yield_now();
                    }
                })
            })
            .collect();
        scope.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                let report = collect_garbage(&store, false).unwrap();
                removed.fetch_add(report.free_locks, Ordering::SeqCst);
            }
        });
        // The lockers end on their own (all 450 entries, or a panic, which the scope then raises); then gc stops.
        while !lockers.iter().all(|l| l.is_finished()) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        stop.store(true, Ordering::SeqCst);
    });
    assert_eq!(entries.load(Ordering::SeqCst), 450);
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert!(
        removed.load(Ordering::SeqCst) > 0,
        "gc never found the lock free: the race was not exercised"
    );
}
