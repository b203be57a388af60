//! `env.toolchain = std.gcc { version = "N" }` when the host has no gcc N: `lock()` pins it from a fixture Debian
//! archive (an `InRelease` and a `Packages.gz` served over real HTTP on 127.0.0.1), a relock keeps that pin
//! without asking the archive (even where the host has that gcc), and a version no suite has is refused naming what each suite has.

use std::io::Write;
use std::path::Path;

use hvd_lang::model::Toolchain;
use hvd_resolver::debian::{Archives, pin_gcc};
use hvd_resolver::env_vars::{HVD_DEBIAN_ARCHIVE, HVD_DEBIAN_KEYRING, HVD_DEBIAN_SUITES};
use hvd_resolver::testing::debian::Signer;
use hvd_resolver::testing::file_server::serve_dir;
use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions, env_of, lock_options};
use hvd_resolver::{LockOptions, Lockfile, ResolveError, Sha256, lock};

/// `dists/fixture/` of an archive with gcc 97 (the packages' files are never fetched by a lock).
fn publish(root: &Path, signer: &Signer) {
    publish_with(root, signer, "", "97.2.0-1", "Packages.gz");
}

/// [`publish`] with `origin` as the Release's first lines, gcc-97 at `gcc_version`, and the Release listing the
/// index as `listed` (`Packages.xz`: a name hvd does not read).
fn publish_with(root: &Path, signer: &Signer, origin: &str, gcc_version: &str, listed: &str) {
    let stanza = |name: &str, version: &str, depends: &str| {
        format!(
            "Package: {name}\nVersion: {version}\nArchitecture: amd64\nDepends: {depends}\n\
             Filename: pool/main/{name}_{version}_amd64.deb\nSize: 100\nSHA256: {}\n\n",
            Sha256::of_bytes(name.as_bytes())
        )
    };
    let text = [
        stanza("gcc-97", gcc_version, "libc6 (>= 2.14)"),
        stanza("g++-97", gcc_version, &format!("gcc-97 (= {gcc_version})")),
        stanza("libc6", "2.30-1", ""),
        stanza("libc6-dev", "2.30-1", "libc6 (= 2.30-1)"),
    ]
    .concat();
    let dists = root.join("dists/fixture");
    std::fs::create_dir_all(dists.join("main/binary-amd64")).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(text.as_bytes()).unwrap();
    let gz = gz.finish().unwrap();
    std::fs::write(dists.join("main/binary-amd64/Packages.gz"), &gz).unwrap();
    std::fs::write(
        dists.join("InRelease"),
        signer.clearsign(&format!(
            "{origin}Suite: fixture\nSHA256:\n {} {} main/binary-amd64/{listed}\n",
            Sha256::of_bytes(&gz),
            gz.len(),
        )),
    )
    .unwrap();
}

fn env(version: &str) -> hvd_lang::model::Env {
    let mut env = env_of(&["lib"]);
    env.toolchain = Some(Toolchain {
        name: "gcc".into(),
        version: version.into(),
    });
    env
}

#[test]
fn a_gcc_the_host_lacks_is_locked_from_debian_and_kept_on_relock() {
    let archive = tempfile::tempdir().unwrap();
    let signer = Signer::new();
    publish(archive.path(), &signer);
    let url = serve_dir(archive.path().to_path_buf(), None);
    // SAFETY: set before this test starts any thread that reads the environment; nextest runs each test in its own
    // process, and no other test of this binary reads these variables.
    unsafe {
        std::env::set_var(HVD_DEBIAN_ARCHIVE, &url);
        std::env::set_var(HVD_DEBIAN_SUITES, "nosuch,fixture");
        std::env::set_var(HVD_DEBIAN_KEYRING, &signer.keyring);
    }
    let index =
        FixtureIndex::start(vec![Dist::wheel("lib", "1.0")], FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let options = lock_options(&index, cache.path());
    let locked = lock(&env("97"), &options).unwrap();
    let pin = locked.toolchain.clone().unwrap();
    let debian = pin.debian.clone().unwrap();
    assert_eq!(
        (
            debian.archive.as_str(),
            debian.suite.as_str(),
            debian.version.as_str()
        ),
        (url.as_str(), "fixture", "97.2.0")
    );
    let names: Vec<&str> = pin.debs.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["g++-97", "gcc-97", "libc6", "libc6-dev"]);
    assert!(pin.tools.is_empty());
    let text = locked.to_toml();
    assert_eq!(Lockfile::parse(&text, Path::new("t.lock")).unwrap(), locked);

    // A relock keeps the pin without asking the archive (it is gone now).
    unsafe_set(HVD_DEBIAN_ARCHIVE, "http://127.0.0.1:9");
    let relocked = lock(
        &env("97"),
        &LockOptions {
            existing: Some(locked.clone()),
            ..lock_options(&index, cache.path())
        },
    )
    .unwrap();
    assert_eq!(relocked.to_toml(), text);
    // A teammate with gcc 97 on PATH relocks: the Debian pin is kept, not flipped to their driver; only
    // `--upgrade` asks the host again.
    let bin = tempfile::tempdir().unwrap();
    for tool in ["gcc-97", "g++-97"] {
        let path = bin.path().join(tool);
        std::fs::write(&path, "#!/bin/sh\necho 97.1.0\n").unwrap();
        let mut perms = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&path, perms).unwrap();
    }
    let old_path = std::env::var("PATH").unwrap_or_default();
    unsafe_set("PATH", &format!("{}:{old_path}", bin.path().display()));
    let teammate = lock(
        &env("97"),
        &LockOptions {
            existing: Some(locked.clone()),
            ..lock_options(&index, cache.path())
        },
    )
    .unwrap();
    assert_eq!(teammate.to_toml(), text);
    let upgraded = lock(
        &env("97"),
        &LockOptions {
            existing: Some(locked.clone()),
            upgrade: true,
            ..lock_options(&index, cache.path())
        },
    )
    .unwrap();
    let host = upgraded.toolchain.unwrap();
    assert!(
        host.debian.is_none() && host.tools[0].version == "97.1.0",
        "{host:?}"
    );
    unsafe_set("PATH", &old_path);

    // Without the existing lock the archive is asked, and its failure is named.
    let err = lock(&env("97"), &options).unwrap_err();
    assert!(matches!(err, ResolveError::Debian(_)), "{err}");

    // A version no suite has: the host's and the archive's answers, and what the suite has.
    unsafe_set(HVD_DEBIAN_ARCHIVE, &url);
    let err = lock(&env("96"), &options).unwrap_err().to_string();
    assert!(
        err.contains("gcc 96")
            && err.contains("Nor from Debian")
            && err.contains("fixture has gcc 97"),
        "{err}"
    );
}

fn unsafe_set(name: &str, value: &str) {
    // SAFETY: see the test: one test per process; the lock's threads have ended (`lock` returned).
    unsafe { std::env::set_var(name, value) }
}

#[test]
fn a_failing_source_is_skipped_and_debian_origin_sources_come_first() {
    // In order: a source that answers 403, one that lists only Packages.xz, a third-party one with gcc 97, and a
    // Debian one with gcc 97. Pinning skips the first two and prefers the Debian one.
    let dirs: Vec<tempfile::TempDir> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let signer = Signer::new();
    publish_with(
        dirs[1].path(),
        &signer,
        "Origin: Debian\n",
        "97.2.0-1",
        "Packages.xz",
    );
    publish_with(
        dirs[2].path(),
        &signer,
        "Origin: Someone\n",
        "97.9.0-1",
        "Packages.gz",
    );
    publish_with(
        dirs[3].path(),
        &signer,
        "Origin: Debian\n",
        "97.2.0-1",
        "Packages.gz",
    );
    let urls = vec![
        serve_dir(dirs[0].path().to_path_buf(), Some("403 Forbidden")),
        serve_dir(dirs[1].path().to_path_buf(), None),
        serve_dir(dirs[2].path().to_path_buf(), None),
        serve_dir(dirs[3].path().to_path_buf(), None),
    ];
    let signed = |urls: &[String]| Archives {
        urls: urls.to_vec(),
        suites: vec!["fixture".into()],
        keyrings: urls
            .iter()
            .map(|u| (u.clone(), signer.keyring.clone()))
            .collect(),
    };
    let archives = signed(&urls);
    let cache = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let pin = runtime
        .block_on(pin_gcc("97", &archives, Some((2, 36)), cache.path(), false))
        .unwrap();
    let debian = pin.debian.unwrap();
    assert_eq!(
        (debian.archive.as_str(), debian.version.as_str()),
        (urls[3].as_str(), "97.2.0")
    );
    // Without the Debian one, the third-party source is used.
    let pin = runtime
        .block_on(pin_gcc(
            "97",
            &signed(&urls[..3]),
            Some((2, 36)),
            cache.path(),
            false,
        ))
        .unwrap();
    assert_eq!(pin.debian.unwrap().version, "97.9.0");
    // Only failing sources: the first failure is the error.
    let err = runtime
        .block_on(pin_gcc(
            "97",
            &signed(&urls[..2]),
            Some((2, 36)),
            cache.path(),
            false,
        ))
        .unwrap_err()
        .to_string();
    assert!(err.contains("403"), "{err}");
}

#[test]
fn release_files_must_be_signed_by_the_keyring_and_current() {
    // Each archive but the first is refused; the error names why.
    let signer = Signer::new();
    let stranger = Signer::new();
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let try_pin = |root: &Path| {
        let url = serve_dir(root.to_path_buf(), None);
        let archives = Archives {
            urls: vec![url.clone()],
            suites: vec!["fixture".into()],
            keyrings: [(url, signer.keyring.clone())].into(),
        };
        runtime
            .block_on(pin_gcc("97", &archives, Some((2, 36)), cache.path(), false))
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let case = |name: &str| {
        let root = dir.path().join(name);
        std::fs::create_dir_all(&root).unwrap();
        root
    };
    let good = case("good");
    publish(&good, &signer);
    try_pin(&good).unwrap();

    // Signed by a key not in the source's keyring.
    let other = case("other");
    publish(&other, &stranger);
    let err = try_pin(&other).unwrap_err();
    assert!(err.contains("no valid signature from the keyring"), "{err}");

    // Changed after signing.
    let changed = case("changed");
    publish(&changed, &signer);
    let in_release = changed.join("dists/fixture/InRelease");
    let text = std::fs::read_to_string(&in_release).unwrap();
    std::fs::write(
        &in_release,
        text.replacen("Suite: fixture", "Suite: fixturf", 1),
    )
    .unwrap();
    let err = try_pin(&changed).unwrap_err();
    assert!(err.contains("no valid signature"), "{err}");

    // Not signed: a Release without Release.gpg.
    let unsigned = case("unsigned");
    publish(&unsigned, &signer);
    let dists = unsigned.join("dists/fixture");
    let signed = std::fs::read_to_string(dists.join("InRelease")).unwrap();
    let body = signed
        .split_once("\n\n")
        .unwrap()
        .1
        .split("-----BEGIN PGP SIGNATURE-----")
        .next()
        .unwrap()
        .to_string();
    std::fs::remove_file(dists.join("InRelease")).unwrap();
    std::fs::write(dists.join("Release"), body).unwrap();
    let err = try_pin(&unsigned).unwrap_err();
    assert!(err.contains("it is not signed"), "{err}");

    // Signed, but expired: an old Release replayed.
    let expired = case("expired");
    publish_with(
        &expired,
        &signer,
        "Valid-Until: Sat, 14 Aug 2021 07:50:33 UTC\n",
        "97.2.0-1",
        "Packages.gz",
    );
    let err = try_pin(&expired).unwrap_err();
    assert!(err.contains("past its Valid-Until"), "{err}");
}
