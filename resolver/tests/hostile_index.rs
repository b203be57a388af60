//! Issue 16: `hvd lock` against a hostile index. The fixture index (real HTTP on 127.0.0.1) plays the attacker:
//! it lists path strings as digests, claims another index's digest, serves a wheel whose central directory lies,
//! and lists no digests at all. Each test checks what the attack aimed at did not happen.

use std::path::Path;

use hvd_resolver::Lockfile;
use hvd_resolver::testing::{
    Dist, FixtureIndex, FixtureOptions, env_of, lock_error, lock_options, lock_or_hang,
};

/// Every sha256 in a lockfile's text is 64 lowercase hex digits.
fn assert_hashes_are_hex(lock: &Lockfile) {
    let text = lock.to_toml();
    for line in text.lines().filter(|l| l.contains("sha256 = ")) {
        let value = line
            .split("sha256 = \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap();
        assert!(
            value.len() == 64
                && value
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{line}"
        );
    }
}

/// Item 1: the listed sha256 became a metadata-cache file name, so `../..` wrote attacker bytes anywhere, and the
/// lockfile recorded it.
#[test]
fn sha256_with_path_traversal_writes_nothing_and_names_the_package() {
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("pwned");
    let cache = tempfile::tempdir().unwrap();
    for html in [false, true] {
        let index = FixtureIndex::helper(FixtureOptions::html(html));
        let hostile = format!("{}{}", "../".repeat(32), target.display());
        index.list_sha256("helper-1.0-py3-none-any.whl", Some(&hostile));
        let text = lock_error(env_of(&["helper"]), lock_options(&index, cache.path()));
        assert!(
            text.contains("helper") && text.contains("not a sha256"),
            "html={html}: {text}"
        );
        assert!(!target.exists(), "html={html}: the attack wrote {target:?}");
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    }
}

/// Item 4: the metadata cache was keyed by the sha256 an index claims, so index A, claiming the digest of index
/// B's `helper==1.0`, planted a dependency on `evilzip` in every later lock of `helper==1.0` against B.
#[test]
fn claimed_sha256_of_another_index_does_not_poison_its_locks() {
    let cache = tempfile::tempdir().unwrap();
    let honest = FixtureIndex::helper(FixtureOptions::default());
    let (_, honest_sha) = honest.file("helper-1.0-py3-none-any.whl").unwrap();
    for core_metadata in [false, true] {
        let hostile = FixtureIndex::start(
            vec![
                Dist::wheel("helper", "1.0").requires(&["evilzip"]),
                Dist::wheel("evilzip", "6.6.6"),
            ],
            FixtureOptions {
                core_metadata,
                ..FixtureOptions::default()
            },
        )
        .unwrap();
        hostile.list_sha256("helper-1.0-py3-none-any.whl", Some(&honest_sha));
        // The attacker's project locks first and fills the shared cache.
        let first =
            lock_or_hang(env_of(&["helper"]), lock_options(&hostile, cache.path())).unwrap();
        assert!(first.package("evilzip").is_some());
        // The victim, same user and cache, locks against the honest index.
        let victim =
            lock_or_hang(env_of(&["helper"]), lock_options(&honest, cache.path())).unwrap();
        assert!(
            victim.package("evilzip").is_none(),
            "core_metadata={core_metadata}: {}",
            victim.to_toml()
        );
        let helper = victim.package("helper").unwrap();
        assert!(helper.dependencies.is_empty(), "{helper:?}");
        assert_eq!(helper.artifact.sha256.as_str(), honest_sha);
        assert_hashes_are_hex(&victim);
    }
}

/// A wheel whose METADATA entry in the central directory points past the end of the file.
fn wheel_with_lying_central_directory(dist: &Dist) -> Vec<u8> {
    let mut bytes = dist.build();
    let name = format!("helper-{}.dist-info/METADATA", dist.version);
    // Central directory entries: signature 0x02014b50, the name at +46, the local header offset at +42.
    let signature = 0x0201_4b50u32.to_le_bytes();
    let at = (0..bytes.len() - 46)
        .find(|&i| bytes[i..i + 4] == signature && bytes[i + 46..].starts_with(name.as_bytes()))
        .expect("the fixture wheel has a METADATA entry");
    bytes[at + 42..at + 46].copy_from_slice(&0x7FFF_FFF0u32.to_le_bytes());
    bytes
}

/// Item 16: a central directory pointing past the end panicked the range reader inside a prefetch task, and
/// `hvd lock` then waited forever for that task.
#[test]
fn central_directory_past_the_end_fails_the_lock_instead_of_hanging() {
    let cache = tempfile::tempdir().unwrap();
    // Small wheels (directory in the first tail read), without range support, and big ones (directory beyond it).
    for (ranges, extra_files) in [(true, 0), (false, 0), (true, 3000)] {
        let index = FixtureIndex::start(
            vec![],
            FixtureOptions {
                ranges,
                ..FixtureOptions::default()
            },
        )
        .unwrap();
        let dist = Dist::wheel("helper", "1.0").with_extra_files(extra_files);
        index.add_raw(dist.clone(), wheel_with_lying_central_directory(&dist));
        let text = lock_error(env_of(&["helper"]), lock_options(&index, cache.path()));
        assert!(
            text.contains("helper-1.0-py3-none-any.whl")
                && (text.contains("outside the file") || text.contains("bad local offset")),
            "ranges={ranges} extra_files={extra_files}: {text}"
        );
    }
}

/// Low item: an index without hashes locked `sha256 = ""`. Now hvd hashes the file while streaming it.
#[test]
fn index_without_hashes_locks_the_digest_hvd_computed() {
    for html in [false, true] {
        let cache = tempfile::tempdir().unwrap();
        let index = FixtureIndex::start(
            vec![
                Dist::wheel("app", "1.0").requires(&["lib"]),
                Dist::sdist("lib", "2.0"),
            ],
            FixtureOptions {
                html,
                ..FixtureOptions::default()
            },
        )
        .unwrap();
        for file in ["app-1.0-py3-none-any.whl", "lib-2.0.tar.gz"] {
            index.list_sha256(file, None);
        }
        let lock = lock_or_hang(env_of(&["app"]), lock_options(&index, cache.path())).unwrap();
        for (name, file) in [
            ("app", "app-1.0-py3-none-any.whl"),
            ("lib", "lib-2.0.tar.gz"),
        ] {
            let (bytes, sha) = index.file(file).unwrap();
            let locked = lock.package(name).unwrap();
            assert_eq!(locked.artifact.sha256.as_str(), sha, "html={html}");
            assert_eq!(locked.artifact.size, bytes.len() as u64, "html={html}");
        }
        assert_hashes_are_hex(&lock);
        Lockfile::parse(&lock.to_toml(), Path::new("t.hvd.lock")).unwrap();
    }
}

/// Lock speed: an index that lists hashes costs no whole-file download of a wheel (only range reads).
#[test]
fn listed_hashes_cost_no_wheel_download() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::start(
        vec![
            Dist::wheel("app", "1.0").requires(&["lib"]),
            Dist::wheel("lib", "2.0"),
        ],
        FixtureOptions::default(),
    )
    .unwrap();
    lock_or_hang(env_of(&["app"]), lock_options(&index, cache.path())).unwrap();
    let whole: Vec<String> = index
        .requests()
        .into_iter()
        .filter(|r| r.contains(".whl") && r.ends_with(" 200"))
        .collect();
    assert!(whole.is_empty(), "{whole:?}");
}

/// An sdist whose bytes do not match the digest the index lists is refused before anything is read out of it
/// (so the cache never holds metadata of bytes the index did not vouch for).
#[test]
fn sdist_not_matching_its_listed_sha256_is_refused() {
    let cache = tempfile::tempdir().unwrap();
    let index =
        FixtureIndex::start(vec![Dist::sdist("lib", "2.0")], FixtureOptions::default()).unwrap();
    index.list_sha256("lib-2.0.tar.gz", Some(&"0".repeat(64)));
    let text = lock_error(env_of(&["lib"]), lock_options(&index, cache.path()));
    assert!(
        text.contains("lib-2.0.tar.gz") && text.contains("does not match the sha256"),
        "{text}"
    );
}

/// PEP 658 metadata that does not match its listed digest is refused.
#[test]
fn core_metadata_not_matching_its_listed_sha256_is_refused() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::helper(FixtureOptions::core_metadata(true));
    index.serve_metadata(
        "helper-1.0-py3-none-any.whl",
        "Metadata-Version: 2.1\nName: helper\nVersion: 1.0\nRequires-Dist: evilzip\n",
    );
    index.list_core_metadata_sha256("helper-1.0-py3-none-any.whl", &"1".repeat(64));
    let text = lock_error(env_of(&["helper"]), lock_options(&index, cache.path()));
    assert!(
        text.contains("helper-1.0-py3-none-any.whl.metadata")
            && text.contains("does not match the sha256"),
        "{text}"
    );
}

/// The range reader's second path (a central directory larger than the first tail read, as in wheels with
/// thousands of files) reads METADATA with checked offsets too, by ranges only: the tail, the directory with what
/// precedes it, and the METADATA entry when a big RECORD pushed it out of that.
#[test]
fn big_central_directory_is_read_by_range() {
    let cache = tempfile::tempdir().unwrap();
    let index = FixtureIndex::start(
        vec![
            Dist::wheel("big", "1.0")
                .requires(&["lib"])
                .with_extra_files(3000),
            Dist::wheel("lib", "1.0"),
        ],
        FixtureOptions::default(),
    )
    .unwrap();
    let (bytes, _) = index.file("big-1.0-py3-none-any.whl").unwrap();
    assert!(bytes.len() > 200_000, "{}", bytes.len());
    let lock = lock_or_hang(env_of(&["big"]), lock_options(&index, cache.path())).unwrap();
    assert!(lock.package("lib").is_some());
    let reads: Vec<String> = index
        .requests()
        .into_iter()
        .filter(|r| r.contains("big-1.0"))
        .collect();
    assert!((2..=3).contains(&reads.len()), "{reads:?}");
    assert!(reads.iter().all(|r| r.ends_with(" 206")), "{reads:?}");
}
