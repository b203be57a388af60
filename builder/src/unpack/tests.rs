use super::zip_archive::{S_IFLNK, S_IFMT};
use super::*;
use std::path::PathBuf;

fn zip_with(entries: &[(&str, &[u8], Option<u32>)]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.zip");
    let mut writer = zip::ZipWriter::new(fs_err::File::create(&path).unwrap());
    for (name, data, mode) in entries {
        let options = zip::write::SimpleFileOptions::default();
        if mode.is_some_and(|mode| mode & S_IFMT == S_IFLNK) {
            writer
                .add_symlink(*name, std::str::from_utf8(data).unwrap(), options)
                .unwrap();
            continue;
        }
        writer.start_file(*name, options).unwrap();
        writer.write_all(data).unwrap();
    }
    writer.finish().unwrap();
    (dir, path)
}

#[test]
fn names_normalize() {
    assert_eq!(normalize("./a//b/./c").unwrap(), "a/b/c");
    assert_eq!(normalize("a/").unwrap(), "a");
    assert_eq!(normalize("./").unwrap(), "");
    assert!(normalize("/abs").is_err());
    assert!(normalize("a/../b").is_err());
    assert!(normalize("a\0b").is_err());
}

#[test]
fn zip_escapes_are_refused() {
    for bad in ["../evil", "/abs/evil", "a/../../evil"] {
        let (dir, archive) = zip_with(&[("ok.txt", b"x", None), (bad, b"x", None)]);
        let dest = dir.path().join("dest");
        let err = unpack_zip(&archive, &dest, Options::default()).unwrap_err();
        assert!(
            matches!(err, Error::UnsafeArchiveEntry { .. }) && err.to_string().contains(bad),
            "{bad}: {err}"
        );
        assert!(!dir.path().join("evil").exists());
    }
    let (dir, archive) = zip_with(&[("link", b"../../etc", Some(0o120777))]);
    let err = unpack_zip(&archive, &dir.path().join("dest"), Options::default()).unwrap_err();
    assert!(
        err.to_string()
            .contains("`link` is a link to `../../etc`, which resolves outside"),
        "{err}"
    );
    assert!(fs_err::symlink_metadata(dir.path().join("dest/link")).is_err());
}

#[test]
fn zip_unpacks_with_hashes_and_inside_links() {
    let (dir, archive) = zip_with(&[
        ("pkg/l", b"a.py", Some(0o120777)),
        ("pkg/a.py", b"print(1)\n", None),
        ("pkg/sub/up", b"../a.py", Some(0o120777)),
    ]);
    let dest = dir.path().join("dest");
    let extracted = unpack_zip(&archive, &dest, Options::default()).unwrap();
    assert_eq!(
        extracted["pkg/a.py"].sha256,
        Some(Sha256::of_bytes(b"print(1)\n"))
    );
    assert!(extracted["pkg/l"].is_link);
    for link in ["pkg/l", "pkg/sub/up"] {
        assert_eq!(
            fs_err::read_to_string(dest.join(link)).unwrap(),
            "print(1)\n"
        );
    }
}

/// The link check follows the archive's own links as the kernel does: `l -> .` makes `l/l/..` leave the tree.
#[test]
fn link_chains_are_resolved_physically() {
    let (dir, archive) = zip_with(&[
        ("d/l", b".", Some(0o120777)),
        ("d/x", b"l/l/l/../../../outside", Some(0o120777)),
    ]);
    let err = unpack_zip(&archive, &dir.path().join("dest"), Options::default()).unwrap_err();
    assert!(err.to_string().contains("`d/x` is a link to"), "{err}");
    // A loop is refused too.
    let (dir, archive) = zip_with(&[("d/loop", b"loop", Some(0o120777))]);
    let err = unpack_zip(&archive, &dir.path().join("dest"), Options::default()).unwrap_err();
    assert!(err.to_string().contains("part of a link loop"), "{err}");
    // The same chain that stays inside is fine.
    let (dir, archive) = zip_with(&[
        ("d/l", b".", Some(0o120777)),
        ("d/x", b"l/l/l/../f", Some(0o120777)),
        ("f", b"data", None),
    ]);
    unpack_zip(&archive, &dir.path().join("dest"), Options::default()).unwrap();
    assert_eq!(
        fs_err::read_to_string(dir.path().join("dest/d/x")).unwrap(),
        "data"
    );
}

fn tar_gz_with(
    build: impl FnOnce(&mut tar::Builder<flate2::write::GzEncoder<fs_err::File>>),
) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.tar.gz");
    let encoder = flate2::write::GzEncoder::new(
        fs_err::File::create(&path).unwrap(),
        flate2::Compression::fast(),
    );
    let mut builder = tar::Builder::new(encoder);
    build(&mut builder);
    builder.into_inner().unwrap().finish().unwrap();
    (dir, path)
}

#[test]
fn tar_escapes_are_refused() {
    let (dir, archive) = tar_gz_with(|builder| {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        builder
            .append_link(&mut header, "pkg/out", "../..")
            .unwrap();
    });
    let err = unpack_sdist(&archive, "a.tar.gz", &dir.path().join("dest")).unwrap_err();
    assert!(matches!(err, Error::UnsafeArchiveEntry { .. }), "{err}");

    // `..` in a name: the tar crate refuses to build one, so write the raw header bytes.
    let (dir, archive) = tar_gz_with(|builder| {
        let mut header = tar::Header::new_old();
        header.as_old_mut().name[..9].copy_from_slice(b"../escape");
        header.set_size(1);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        header.set_cksum();
        builder.append(&header, &b"x"[..]).unwrap();
    });
    let err = unpack_sdist(&archive, "a.tar.gz", &dir.path().join("dest")).unwrap_err();
    assert!(matches!(err, Error::UnsafeArchiveEntry { .. }), "{err}");
    assert!(!dir.path().join("escape").exists());

    // A fifo has no place in an sdist.
    let (dir, archive) = tar_gz_with(|builder| {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Fifo);
        header.set_size(0);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, "pkg/fifo", &b""[..])
            .unwrap();
    });
    let err = unpack_sdist(&archive, "a.tar.gz", &dir.path().join("dest")).unwrap_err();
    assert!(
        err.to_string().contains("`pkg/fifo` has type Fifo"),
        "{err}"
    );
}
