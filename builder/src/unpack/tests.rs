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

/// A zip of `entries` stored (uncompressed, so that sizes and names sit at known places), as bytes.
fn stored_zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (name, data) in entries {
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        writer.start_file(*name, options).unwrap();
        writer.write_all(data).unwrap();
    }
    writer.finish().unwrap().into_inner()
}

fn le16(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes([b[at], b[at + 1]]) as usize
}

/// The offsets of the central directory's headers of a zip without a comment.
fn central_headers(b: &[u8]) -> Vec<usize> {
    let end = b.len() - 22;
    assert_eq!(&b[end..end + 4], b"PK\x05\x06");
    let mut at = u32::from_le_bytes(b[end + 16..end + 20].try_into().unwrap()) as usize;
    let mut headers = Vec::new();
    for _ in 0..le16(b, end + 10) {
        headers.push(at);
        at += 46 + le16(b, at + 28) + le16(b, at + 30) + le16(b, at + 32);
    }
    headers
}

/// Unpacks `bytes` as a zip, expecting a refusal that says `says`; nothing may be left in the destination.
fn refused_zip(what: &str, bytes: &[u8], says: &str) {
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("a.zip");
    fs_err::write(&archive, bytes).unwrap();
    let dest = dir.path().join("dest");
    let err = unpack_zip(&archive, &dest, Options::default()).expect_err(what);
    assert!(err.to_string().contains(says), "{what}: {err}");
}

/// What another zip reader may see differently from this one is refused, each with what differs: a name twice in
/// the central directory (the zip crate keeps one), more headers than the end record lists, data before the first
/// entry or after the end record, a local header that names another file, compresses otherwise or has other sizes,
/// bytes no listed entry covers (an entry a reader from the front sees, the central directory does not list), and
/// an entry that unpacks to more or fewer bytes than its central directory says. The untouched archive unpacks.
#[test]
fn zips_other_readers_would_read_otherwise_are_refused() {
    let honest = stored_zip(&[("a.txt", b"first"), ("b.txt", b"second")]);
    let [first, second] = central_headers(&honest)[..] else {
        panic!("two headers")
    };
    let second_local =
        u32::from_le_bytes(honest[second + 42..second + 46].try_into().unwrap()) as usize;
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("honest.zip");
    fs_err::write(&archive, &honest).unwrap();
    unpack_zip(&archive, &dir.path().join("dest"), Options::default()).unwrap();

    let mut twice = honest.clone();
    twice[second + 46] = b'a';
    twice[second_local + 30] = b'a';
    refused_zip(
        "a name twice",
        &twice,
        "names `a.txt` twice in its central directory",
    );

    let mut fewer = honest.clone();
    let end = fewer.len() - 22;
    fewer[end + 8..end + 10].copy_from_slice(&1u16.to_le_bytes());
    fewer[end + 10..end + 12].copy_from_slice(&1u16.to_le_bytes());
    refused_zip(
        "an extra header",
        &fewer,
        "has 2 headers in its central directory, but its end record lists 1",
    );

    let prepended = [vec![b'j'; 64], honest.clone()].concat();
    refused_zip(
        "prepended",
        &prepended,
        "has 64 bytes of other data before its first entry",
    );

    let appended = [honest.clone(), vec![b'j'; 64]].concat();
    refused_zip("appended", &appended, "other data follows it");

    let mut renamed = honest.clone();
    renamed[second_local + 30] = b'c';
    refused_zip(
        "a local name",
        &renamed,
        "`b.txt` is named `c.txt` in its local header",
    );

    let mut method = honest.clone();
    method[second_local + 8..second_local + 10].copy_from_slice(&8u16.to_le_bytes());
    refused_zip(
        "a local method",
        &method,
        "is compressed with method 8 by its local header, 0 by its central directory",
    );

    let mut sizes = honest.clone();
    sizes[second_local + 22..second_local + 26].copy_from_slice(&5u32.to_le_bytes());
    refused_zip(
        "local sizes",
        &sizes,
        "has sizes 6/5 (compressed/unpacked) in its local header, 6/6 in its central directory",
    );

    // The first entry's central header dropped: its local header and data stay at the front.
    let mut hidden = honest.clone();
    let header_len = second - first;
    hidden.drain(first..second);
    let end = hidden.len() - 22;
    hidden[end + 8..end + 10].copy_from_slice(&1u16.to_le_bytes());
    hidden[end + 10..end + 12].copy_from_slice(&1u16.to_le_bytes());
    let size = u32::from_le_bytes(hidden[end + 12..end + 16].try_into().unwrap()) as usize;
    hidden[end + 12..end + 16].copy_from_slice(&((size - header_len) as u32).to_le_bytes());
    refused_zip(
        "an entry only a reader from the front sees",
        &hidden,
        &format!("has {second_local} bytes at 0..{second_local} that belong to no entry it lists"),
    );

    // An entry whose central and local headers both say one byte less, or one more, than it holds.
    for (declared, says) in [
        (
            5u32,
            "unpacks to more than the 5 bytes its central directory says",
        ),
        (7, "unpacks to 6 bytes, but its central directory says 7"),
    ] {
        let mut lying = honest.clone();
        lying[second + 24..second + 28].copy_from_slice(&declared.to_le_bytes());
        lying[second_local + 22..second_local + 26].copy_from_slice(&declared.to_le_bytes());
        refused_zip(&format!("declared {declared}"), &lying, says);
    }
}
