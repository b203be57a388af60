//! Installing many wheels at once, and big wheels on several threads: a bad wheel among good ones is named and
//! leaves no path, the good paths are whole, and a tree written in parallel with the store's modes is exactly the
//! tree a fresh walk sees (real HTTP on 127.0.0.1, a real store).

#[allow(dead_code)]
mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::{
    FileServer, append_to_zip, build_default, host_python, make_wheel, served_store, walk,
};
use hvd_builder::{EnvPlan, Error, PackagePlan, Store};

struct Fixture {
    _dir: tempfile::TempDir,
    server: FileServer,
    store: Store,
}

fn fixture() -> Fixture {
    let (dir, server, store) = served_store();
    Fixture {
        _dir: dir,
        server,
        store,
    }
}

fn plan(packages: Vec<PackagePlan>) -> EnvPlan {
    EnvPlan {
        name: "many".into(),
        python: host_python(),
        interpreter: None,
        packages,
        toolchain: None,
        local_packages: Vec::new(),
    }
}

/// `files` small modules of `name`, each `size` bytes, spread over a few directories.
fn modules(name: &str, files: usize, size: usize) -> Vec<(String, Vec<u8>)> {
    (0..files)
        .map(|i| {
            let text = format!("# {name} module {i}\nVALUE = {i}\n");
            let data = text.bytes().cycle().take(size.max(text.len())).collect();
            (format!("{name}/sub{}/m{i}.py", i % 5), data)
        })
        .collect()
}

fn wheel_of(dir: &Path, name: &str, files: &[(String, Vec<u8>)]) -> String {
    let members: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(path, data)| (path.as_str(), data.as_slice()))
        .collect();
    make_wheel(dir, name, "1.0", &members, None)
}

/// The store path is whole and canonical: its recorded content hash is what a fresh walk gives, nothing in it is
/// writable, and every mtime is the store's.
fn assert_whole_and_canonical(store: &Store, path: &Path) {
    let info = store.path_info(path).unwrap();
    let fresh = hvd_builder::hash::content_hash(&hvd_builder::hash::manifest(path).unwrap());
    assert_eq!(info.content_hash, fresh, "{}", path.display());
    for entry in walk(path) {
        let meta = std::fs::symlink_metadata(&entry).unwrap();
        assert_eq!(meta.mtime(), 1, "{}", entry.display());
        if !meta.file_type().is_symlink() {
            assert_eq!(
                meta.permissions().mode() & 0o222,
                0,
                "{} is writable",
                entry.display()
            );
        }
    }
}

fn evil_paths(store: &Store) -> Vec<String> {
    store
        .list_paths()
        .unwrap()
        .into_iter()
        .filter(|name| name.contains("-evil-"))
        .collect()
}

/// Nothing left under `.tmp`: a refused install removes its temp directory.
fn assert_no_debris(store: &Store) {
    let left: Vec<_> = std::fs::read_dir(store.root().join(".tmp"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left in .tmp: {left:?}");
}

#[test]
fn a_bad_wheel_among_many_is_named_and_the_others_are_whole() {
    let f = fixture();
    let mut packages = Vec::new();
    for (i, files) in [40, 3, 25, 8, 60, 1].into_iter().enumerate() {
        let name = format!("good{i}");
        let filename = wheel_of(&f.server.root, &name, &modules(&name, files, 2000));
        packages.push(f.server.wheel_plan(&name, "1.0", &filename));
    }
    // In the middle by size (installs go largest first): a file RECORD does not list, a `.pth` python would run.
    let evil = wheel_of(&f.server.root, "evil", &modules("evil", 20, 2000));
    append_to_zip(
        &f.server.root.join(&evil),
        "evil.pth",
        b"import os; os.system('id')\n",
    );
    let mut with_evil = packages.clone();
    with_evil.insert(3, f.server.wheel_plan("evil", "1.0", &evil));

    let err = build_default(&f.store, &plan(with_evil)).unwrap_err();
    let message = hvd_resolver::index::error_chain(&err);
    match &err {
        Error::Install { name, .. } => assert_eq!(name, "evil", "{message}"),
        other => panic!("expected the install of evil to fail, got: {other}"),
    }
    assert!(
        message.contains("`evil.pth` is not listed in RECORD"),
        "{message}"
    );
    assert!(evil_paths(&f.store).is_empty());
    assert!(
        f.store
            .list_paths()
            .unwrap()
            .iter()
            .all(|n| !n.ends_with("-env")),
        "no env may be made"
    );
    assert_no_debris(&f.store);
    // What was installed before the failure stopped the rest is whole.
    for name in f.store.list_paths().unwrap() {
        assert_whole_and_canonical(&f.store, &f.store.root().join(name));
    }

    // Without it, the env builds and reuses those paths.
    let built = build_default(&f.store, &plan(packages.clone())).unwrap();
    for package in &built.packages {
        assert_whole_and_canonical(&f.store, &package.path);
    }
    let out = common::run_python(
        &built.env.join("bin/python"),
        "import good4.sub3.m3 as m; print(m.VALUE)",
    );
    assert_eq!(out, "3");

    // A download that does not match its lock among good ones: named with its URL, nothing of it is kept.
    let mut bad = f.server.wheel_plan("evil", "1.0", &evil);
    bad.name = "evil2".into();
    bad.artifact.sha256 = hvd_builder::Sha256::of_bytes(b"not these bytes");
    let mut with_bad = packages;
    with_bad.insert(2, bad.clone());
    let err = build_default(&f.store, &plan(with_bad)).unwrap_err();
    assert!(
        matches!(err, Error::HashMismatch { .. }) && err.to_string().contains(&bad.artifact.url),
        "{err}"
    );
    assert!(evil_paths(&f.store).is_empty());
    assert!(
        !f.store
            .downloads_dir()
            .join("sha256")
            .join(bad.artifact.sha256.as_str())
            .exists()
    );
    assert_no_debris(&f.store);
}

/// A wheel big enough to be written by several threads: `big` files of `big_size` bytes (compressible, so the
/// archive stays small), small modules, a script.
fn big_wheel(dir: &Path, name: &str, big: usize, big_size: usize) -> String {
    let mut files = modules(name, 200, 3000);
    for i in 0..big {
        let pattern = format!("{name} big file {i} ");
        let mut data = pattern.repeat(big_size / pattern.len() + 1).into_bytes();
        data.truncate(big_size);
        files.push((format!("{name}/lib/big{i}.so"), data));
    }
    files.push((
        format!("{name}-1.0.data/scripts/{name}-tool"),
        b"#!python\nprint('tool')\n".to_vec(),
    ));
    wheel_of(dir, name, &files)
}

#[test]
fn a_big_wheel_written_by_several_threads_is_the_tree_a_walk_sees() {
    let f = fixture();
    // 3 x 7 MiB: above the size from which a wheel's files are written in parallel.
    let filename = big_wheel(&f.server.root, "bigpkg", 3, 7 << 20);
    let built = build_default(
        &f.store,
        &plan(vec![f.server.wheel_plan("bigpkg", "1.0", &filename)]),
    )
    .unwrap();
    let path = &built.packages[0].path;
    assert_whole_and_canonical(&f.store, path);
    let script = std::fs::metadata(path.join("scripts/bigpkg-tool")).unwrap();
    assert_eq!(script.permissions().mode() & 0o777, 0o555);
    let module = std::fs::metadata(path.join("site-packages/bigpkg/sub0/m0.py")).unwrap();
    assert_eq!(module.permissions().mode() & 0o777, 0o444);

    // The same wheel installed outside the store, then canonicalized the store's old way, hashes the same.
    let plain = tempfile::tempdir().unwrap();
    let archive = f.server.root.join(&filename);
    hvd_builder::wheel::install_wheel(&archive, plain.path()).unwrap();
    hvd_builder::store::canonicalize(plain.path()).unwrap();
    let plain_hash =
        hvd_builder::hash::content_hash(&hvd_builder::hash::manifest(plain.path()).unwrap());
    assert_eq!(f.store.path_info(path).unwrap().content_hash, plain_hash);
}

#[test]
fn a_corrupt_or_bombing_big_wheel_stops_every_thread_and_installs_nothing() {
    let f = fixture();
    // A big file whose stored bytes were changed after the archive was made: its CRC fails while it is written.
    let filename = big_wheel(&f.server.root, "evil", 3, 7 << 20);
    let archive = f.server.root.join(&filename);
    let mut bytes = std::fs::read(&archive).unwrap();
    let at = {
        // The files are deflated: find a spot inside the second big file's compressed bytes from the zip itself.
        let zip = zip::ZipArchive::new(std::io::Cursor::new(bytes.clone())).unwrap();
        let index = zip.index_for_name("evil/lib/big1.so").unwrap();
        let mut zip = zip;
        let entry = zip.by_index_raw(index).unwrap();
        (entry.data_start() + entry.compressed_size() / 2) as usize
    };
    bytes[at] ^= 0x55;
    bytes[at + 1] ^= 0x55;
    std::fs::write(&archive, &bytes).unwrap();
    let err = build_default(
        &f.store,
        &plan(vec![f.server.wheel_plan("evil", "1.0", &filename)]),
    )
    .unwrap_err();
    let message = hvd_resolver::index::error_chain(&err);
    assert!(
        matches!(&err, Error::Install { name, .. } if name == "evil"),
        "{message}"
    );
    assert!(message.contains("evil/lib/big1.so"), "{message}");
    assert!(evil_paths(&f.store).is_empty());
    assert_no_debris(&f.store);

    // A bomb split over several big files: the count of written bytes is shared by every thread.
    let bomb = big_wheel(&f.server.root, "evil", 4, 20 << 20);
    let size = std::fs::metadata(f.server.root.join(&bomb)).unwrap().len();
    assert!(size * 100 < 64 << 20, "not dense enough: {size} bytes");
    let err = build_default(
        &f.store,
        &plan(vec![f.server.wheel_plan("evil", "1.0", &bomb)]),
    )
    .unwrap_err();
    let message = hvd_resolver::index::error_chain(&err);
    assert!(message.contains("(a decompression bomb)"), "{message}");
    assert!(evil_paths(&f.store).is_empty());
    assert_no_debris(&f.store);
}
