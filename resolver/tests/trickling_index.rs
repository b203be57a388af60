//! Issue 16 ("never a hang"): an index host that trickles its answers, a byte at a time well inside the 60 s read
//! timeout, held `hvd lock` for hours. The fixture index (real HTTP on 127.0.0.1) trickles a project page, a
//! wheel's metadata read by range, a PEP 658 metadata file, an artifact hashed because the index lists no sha256,
//! and an sdist read for its PKG-INFO. Each lock must fail with an error naming the URL, the package and the
//! setting to change. The deadlines are set small here; the tests assert on the error, never on the time.

use std::path::Path;
use std::time::Duration;

use hvd_resolver::LockOptions;
use hvd_resolver::deadline::HttpDeadlines;
use hvd_resolver::index::error_chain;
use hvd_resolver::testing::{
    Dist, FixtureIndex, FixtureOptions, env_of, lock_error, lock_options, lock_or_hang,
};

const WHEEL: &str = "helper-1.0-py3-none-any.whl";
/// A byte every 200 ms: far inside any read timeout, far below any useful speed.
const STALL: Duration = Duration::from_millis(200);

/// Lock options with these deadlines.
fn options(index: &FixtureIndex, cache: &Path, deadlines: HttpDeadlines) -> LockOptions {
    LockOptions {
        deadlines: Some(deadlines),
        ..lock_options(index, cache)
    }
}

/// Two seconds per request (ample for the fixture's honest answers on a loaded machine); downloads must then
/// average 1 MB/s (the trickle sends 5 bytes/s).
fn short() -> HttpDeadlines {
    HttpDeadlines {
        request: Duration::from_secs(2),
        min_rate: 1_000_000,
    }
}

fn assert_mentions(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "`{needle}` missing from: {text}");
    }
}

#[test]
fn trickled_project_page_stops_at_the_request_deadline() {
    let cache = tempfile::tempdir().unwrap();
    for html in [false, true] {
        let index = FixtureIndex::helper(FixtureOptions::html(html));
        index.trickle("/simple/helper/", 1, STALL);
        let text = lock_error(env_of(&["helper"]), options(&index, cache.path(), short()));
        assert_mentions(
            &text,
            &[
                &format!("{}helper/", index.url()),
                "the project page of `helper`",
                "took too long",
                "no complete answer within 2 s",
                "HVD_HTTP_TIMEOUT",
            ],
        );
    }
}

/// Metadata read by HTTP range out of the wheel (no PEP 658 file), and a PEP 658 file.
#[test]
fn trickled_metadata_stops_at_the_request_deadline() {
    for core_metadata in [false, true] {
        let cache = tempfile::tempdir().unwrap();
        let index = FixtureIndex::helper(FixtureOptions::core_metadata(core_metadata));
        let path = if core_metadata {
            format!("/files/{WHEEL}.metadata")
        } else {
            format!("/files/{WHEEL}")
        };
        index.trickle(&path, 1, STALL);
        let text = lock_error(env_of(&["helper"]), options(&index, cache.path(), short()));
        assert_mentions(
            &text,
            &[
                &format!("{}{path}", index.base_url()),
                &format!("the metadata of package file `{WHEEL}`"),
                "no complete answer within 2 s",
                "HVD_HTTP_TIMEOUT",
            ],
        );
        // Nothing half-read was cached: the next lock against an honest host succeeds.
        let honest = FixtureIndex::helper(FixtureOptions::core_metadata(core_metadata));
        lock_or_hang(env_of(&["helper"]), options(&honest, cache.path(), short())).unwrap();
    }
}

/// An index that lists no sha256: the whole wheel is streamed and hashed at lock time. A trickle below the least
/// speed stops once the grace period and the time its bytes earned are spent.
#[test]
fn trickled_download_of_a_hashless_index_stops_below_the_least_speed() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::helper(FixtureOptions::core_metadata(true));
    index.list_sha256(WHEEL, None);
    index.trickle(&format!("/files/{WHEEL}"), 1, STALL);
    let text = lock_error(env_of(&["helper"]), options(&index, cache.path(), short()));
    assert_mentions(
        &text,
        &[
            &format!("{}/files/{WHEEL}", index.base_url()),
            &format!("package file `{WHEEL}`, hashed because the index lists no sha256"),
            "below the floor of 1000000 bytes/s after the first 2 s",
            "HVD_DOWNLOAD_MIN_RATE",
        ],
    );
}

/// An sdist is downloaded whole for its PKG-INFO: the same least speed applies.
#[test]
fn trickled_sdist_stops_below_the_least_speed() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::start(
        vec![Dist::sdist("helper", "1.0")],
        FixtureOptions::default(),
    )
    .unwrap();
    index.trickle("/files/helper-1.0.tar.gz", 1, STALL);
    let text = lock_error(env_of(&["helper"]), options(&index, cache.path(), short()));
    assert_mentions(
        &text,
        &[
            &format!("{}/files/helper-1.0.tar.gz", index.base_url()),
            "package file `helper-1.0.tar.gz`, read for its metadata",
            "HVD_DOWNLOAD_MIN_RATE",
        ],
    );
}

/// A slow but honest host: the download takes several times the request deadline, at ten times the least
/// speed, and the lock succeeds with the right digest.
#[test]
fn slow_but_honest_download_finishes_past_the_request_deadline() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::start(
        vec![],
        FixtureOptions {
            core_metadata: true,
            ..FixtureOptions::default()
        },
    )
    .unwrap();
    // The metadata comes from the PEP 658 file, so the wheel's bytes are only hashed: 120 kB sent 2 kB every
    // 50 ms (about 40 kB/s, 3 s in all) against a 4 kB/s floor after a 1 s grace period.
    let bytes = vec![b'w'; 120_000];
    index.add_raw(Dist::wheel("helper", "1.0"), bytes);
    index.list_sha256(WHEEL, None);
    index.trickle(&format!("/files/{WHEEL}"), 2000, Duration::from_millis(50));
    let deadlines = HttpDeadlines {
        request: Duration::from_secs(1),
        min_rate: 4000,
    };
    let lock = lock_or_hang(
        env_of(&["helper"]),
        options(&index, cache.path(), deadlines),
    )
    .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let (bytes, sha) = index.file(WHEEL).unwrap();
    let locked = lock.package("helper").unwrap();
    assert_eq!(locked.artifact.sha256.as_str(), sha);
    assert_eq!(locked.artifact.size, bytes.len() as u64);
}

/// A host without range support answers the metadata read with the whole wheel: that is a download, held to the
/// least speed (not to the request deadline, so a big wheel from such a host can still be locked)...
#[test]
fn trickled_whole_wheel_from_a_host_without_ranges_stops_below_the_least_speed() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::helper(FixtureOptions::ranges(false));
    index.trickle(&format!("/files/{WHEEL}"), 1, STALL);
    let text = lock_error(env_of(&["helper"]), options(&index, cache.path(), short()));
    assert_mentions(
        &text,
        &[
            &format!("{}/files/{WHEEL}", index.base_url()),
            &format!("the metadata of package file `{WHEEL}`"),
            "below the floor of 1000000 bytes/s",
            "HVD_DOWNLOAD_MIN_RATE",
        ],
    );
}

/// ...and a slow but honest one without range support is locked.
#[test]
fn slow_but_honest_host_without_ranges_is_locked() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::start(
        vec![Dist::wheel("helper", "1.0").with_extra_files(40)],
        FixtureOptions {
            ranges: false,
            ..FixtureOptions::default()
        },
    )
    .unwrap();
    let (bytes, sha) = index.file(WHEEL).unwrap();
    // Sixty pieces, 50 ms apart: 3 s in all, three times the grace period, at ten times the least speed.
    let chunk = bytes.len().div_ceil(60);
    index.trickle(&format!("/files/{WHEEL}"), chunk, Duration::from_millis(50));
    let deadlines = HttpDeadlines {
        request: Duration::from_secs(1),
        min_rate: (chunk as u64 * 20) / 10,
    };
    let lock = lock_or_hang(
        env_of(&["helper"]),
        options(&index, cache.path(), deadlines),
    )
    .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let locked = lock.package("helper").unwrap();
    assert_eq!(locked.artifact.sha256.as_str(), sha);
}
