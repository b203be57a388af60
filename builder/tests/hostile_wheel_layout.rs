//! A wheel names its own `.dist-info` directory, and the wheel layout builds destinations from it
//! (`.data/headers` -> `include/<name>/`). An attack found in review: a `..-1.0.dist-info` made
//! `include/../site-packages/_hvd_pycache.pth` a link whose target passed the inside check, and the env assembly then
//! wrote through it, outside the store. These tests play that wheel and the general form of it: a layout that maps
//! an entry to a path with `..` in it.

use std::io::Write;
use std::path::{Path, PathBuf};

use hvd_builder::unpack;
use hvd_builder::wheel::install_wheel;

/// A wheel with `members` (name, bytes or link target, is a link) and a RECORD listing each of them (hash-less: the
/// layout must refuse before RECORD is ever read).
fn wheel(dir: &Path, file_name: &str, members: &[(&str, &str, bool)]) -> PathBuf {
    let path = dir.join(file_name);
    let mut zip = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
    let options = zip::write::SimpleFileOptions::default();
    for (name, data, is_link) in members {
        if *is_link {
            zip.add_symlink(*name, *data, options).unwrap();
        } else {
            zip.start_file(*name, options).unwrap();
            zip.write_all(data.as_bytes()).unwrap();
        }
    }
    zip.finish().unwrap();
    path
}

/// Every entry below `dir`, recursively, links included (not followed).
fn listing(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            out.push(entry.path());
            if entry.file_type().unwrap().is_dir() {
                stack.push(entry.path());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn dist_info_named_dot_dot_is_refused_and_nothing_lands_outside() {
    let root = tempfile::tempdir().unwrap();
    let outside = root.path().join("outside");
    let store = outside.join("store");
    let out = store.join("p-pkg");
    std::fs::create_dir_all(&out).unwrap();
    let wheel = wheel(
        root.path(),
        "evilpkg-1.0-py3-none-any.whl",
        &[
            ("..-1.0.dist-info/METADATA", "Name: evilpkg\n", false),
            ("..-1.0.dist-info/RECORD", "", false),
            (
                "evilpkg-1.0.data/headers/site-packages/_hvd_pycache.pth",
                "../../../pwned",
                true,
            ),
            ("evilpkg-1.0.data/headers/x.h", "int x;\n", false),
        ],
    );
    let err = install_wheel(&wheel, &out).expect_err("the wheel must be refused");
    let message = err.to_string();
    assert!(
        message.contains("..-1.0.dist-info") && message.contains("distribution name"),
        "{message}"
    );
    assert!(!root.path().join("pwned").exists());
    assert!(!outside.join("pwned").exists());
    assert_eq!(
        listing(&store),
        std::slice::from_ref(&out),
        "nothing next to the path being built"
    );
    assert!(
        listing(&out).is_empty(),
        "nothing installed: {:?}",
        listing(&out)
    );
}

#[test]
fn a_layout_that_maps_an_entry_above_the_tree_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("tree");
    std::fs::create_dir_all(&out).unwrap();
    let archive = wheel(
        root.path(),
        "a.zip",
        &[
            ("pkg/file.txt", "data", false),
            ("pkg/link", "file.txt", true),
        ],
    );
    for dest in ["include/../escaped", "../escaped", "a/./b", "a//b", "/abs"] {
        let layout =
            |name: &str| -> Result<Option<String>, String> { Ok(Some(format!("{dest}/{name}"))) };
        let options = unpack::Options {
            layout: Some(&layout),
            ..unpack::Options::default()
        };
        let err = unpack::unpack_zip(&archive, &out, options).expect_err(dest);
        assert!(
            err.to_string().contains("not a plain relative path"),
            "{dest}: {err}"
        );
        assert!(!root.path().join("escaped").exists(), "{dest}");
        assert!(listing(&out).is_empty(), "{dest}: {:?}", listing(&out));
    }
}

/// Review: RECORD was read whole, whatever its size (the ratio limit alone let one inflate to gigabytes). A stored
/// (uncompressed) RECORD of 65 MiB passes the ratio limit and must still be refused, unread.
#[test]
fn a_record_beyond_its_limit_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("p-pkg");
    std::fs::create_dir_all(&out).unwrap();
    let path = root.path().join("big-1.0-py3-none-any.whl");
    let mut zip = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    zip.start_file("big-1.0.dist-info/METADATA", stored)
        .unwrap();
    zip.write_all(b"Name: big\n").unwrap();
    zip.start_file("big-1.0.dist-info/RECORD", stored).unwrap();
    let line = format!("big/{},sha256=x,1\n", "a".repeat(100));
    let mut written = 0usize;
    while written <= 65 << 20 {
        zip.write_all(line.as_bytes()).unwrap();
        written += line.len();
    }
    zip.finish().unwrap();
    let err = install_wheel(&path, &out).expect_err("refused");
    assert!(err.to_string().contains("at most"), "{err}");
}
