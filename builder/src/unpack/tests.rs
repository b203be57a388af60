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

/// CRC-32 (IEEE), bit by bit: the few bytes of a handmade archive.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// An entry of [`handmade`]: stored, with these flags and extra fields.
struct Handmade<'a> {
    name: &'a str,
    data: &'a [u8],
    flags: u16,
    central_extra: Vec<u8>,
}

impl<'a> Handmade<'a> {
    fn plain(name: &'a str, data: &'a [u8]) -> Self {
        Handmade {
            name,
            data,
            flags: 0,
            central_extra: Vec::new(),
        }
    }
}

/// A zip written field by field (stored entries, the end record with `comment`), for layouts no writer makes.
fn handmade(entries: &[Handmade<'_>], comment: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for e in entries {
        let offset = out.len() as u32;
        let (crc, size, name) = (crc32(e.data), e.data.len() as u32, e.name.as_bytes());
        let mut fixed = Vec::new();
        fixed.extend_from_slice(&20u16.to_le_bytes()); // version needed
        fixed.extend_from_slice(&e.flags.to_le_bytes());
        fixed.extend_from_slice(&0u16.to_le_bytes()); // stored
        fixed.extend_from_slice(&[0; 4]); // time, date
        fixed.extend_from_slice(&crc.to_le_bytes());
        fixed.extend_from_slice(&size.to_le_bytes());
        fixed.extend_from_slice(&size.to_le_bytes());
        fixed.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(b"PK\x03\x04");
        out.extend_from_slice(&fixed);
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(e.data);
        central.extend_from_slice(b"PK\x01\x02");
        central.extend_from_slice(&(0x0300u16 | 20).to_le_bytes()); // made by: unix
        central.extend_from_slice(&fixed);
        central.extend_from_slice(&(e.central_extra.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0; 6]); // comment length, disk, internal attributes
        central.extend_from_slice(&(0o100644u32 << 16).to_le_bytes());
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(name);
        central.extend_from_slice(&e.central_extra);
    }
    let start = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(b"PK\x05\x06");
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&start.to_le_bytes());
    out.extend_from_slice(&(comment.len() as u16).to_le_bytes());
    out.extend_from_slice(comment);
    out
}

/// What the zip crate or pip's `zipfile` reads otherwise than the headers say, in records the first test's patches
/// cannot reach: a Unicode path extra field that renames an entry (the crate takes it, `zipfile` does not), an end
/// record whose directory size places the directory elsewhere for `zipfile`, a second end record in the comment (the
/// one `zipfile` takes), a zip64 locator's signature where `zipfile` looks for one, a data descriptor, and flags
/// that differ between the headers. An honest archive with a comment and one written with zip64 records unpack.
#[test]
fn zip_records_other_readers_take_otherwise_are_refused() {
    let ok = |bytes: &[u8]| {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("a.zip");
        fs_err::write(&archive, bytes).unwrap();
        unpack_zip(&archive, &dir.path().join("dest"), Options::default()).map(|x| x.len())
    };
    let plain = [
        Handmade::plain("a.txt", b"first"),
        Handmade::plain("b.txt", b"second"),
    ];
    assert_eq!(ok(&handmade(&plain, b"")).unwrap(), 2);
    assert_eq!(ok(&handmade(&plain, b"an honest comment")).unwrap(), 2);

    let mut unicode = vec![1u8];
    unicode.extend_from_slice(&crc32(b"b.txt").to_le_bytes());
    unicode.extend_from_slice(b"evil.pth");
    let mut extra = 0x7075u16.to_le_bytes().to_vec();
    extra.extend_from_slice(&(unicode.len() as u16).to_le_bytes());
    extra.extend_from_slice(&unicode);
    let renamed = [
        Handmade::plain("a.txt", b"first"),
        Handmade {
            central_extra: extra,
            ..Handmade::plain("b.txt", b"second")
        },
    ];
    refused_zip(
        "a Unicode path",
        &handmade(&renamed, b""),
        "is named so by an extra field; its header names `b.txt`",
    );

    let mut shrunk = handmade(&plain, b"");
    let end = shrunk.len() - 22;
    let size = u32::from_le_bytes(shrunk[end + 12..end + 16].try_into().unwrap());
    shrunk[end + 12..end + 16].copy_from_slice(&(size - 1).to_le_bytes());
    refused_zip(
        "a directory size",
        &shrunk,
        "has an end record that does not describe",
    );

    let mut fake = handmade(&plain, b"");
    let real_end = fake[fake.len() - 22..].to_vec();
    let comment = [b"xx".as_slice(), &real_end].concat();
    refused_zip(
        "an end record in the comment",
        &handmade(&plain, &comment),
        "another end record's signature in its end record or comment",
    );
    fake.truncate(0);

    // A signature that straddles the real end record's comment length (0x4b50, "PK") and its comment; the record it
    // starts says its own comment runs past the file, so the zip crate falls back to the real one (`zipfile` would
    // not).
    let mut straddled = [b"\x05\x06".as_slice(), &vec![0u8; 0x4b50 - 2]].concat();
    straddled[18..20].copy_from_slice(&0xffffu16.to_le_bytes());
    refused_zip(
        "an end record straddling the comment",
        &handmade(&plain, &straddled),
        "another end record's signature in its end record or comment",
    );

    let mut locator = b"PK\x06\x07".to_vec();
    locator.resize(20, 0);
    let mut extra = 0xcafeu16.to_le_bytes().to_vec();
    extra.extend_from_slice(&(locator.len() as u16).to_le_bytes());
    extra.extend_from_slice(&locator);
    let before_end = [
        Handmade::plain("a.txt", b"first"),
        Handmade {
            central_extra: extra,
            ..Handmade::plain("b.txt", b"second")
        },
    ];
    refused_zip(
        "a locator's signature",
        &handmade(&before_end, b""),
        "looks like a zip64 locator",
    );

    let described = [
        Handmade::plain("a.txt", b"first"),
        Handmade {
            flags: 0x8,
            ..Handmade::plain("b.txt", b"second")
        },
    ];
    refused_zip(
        "a data descriptor",
        &handmade(&described, b""),
        "`b.txt` with a data descriptor",
    );

    let mut flagged = handmade(&plain, b"");
    let second_local = 30 + 5 + 5;
    flagged[second_local + 6] = 0x00;
    flagged[second_local + 7] = 0x08; // UTF-8 names, in the local header only
    refused_zip(
        "local flags",
        &flagged,
        "has flags 0x0800 in its local header, 0x0000 in its central directory",
    );

    // zip64 records (the crate writes them for an entry said to be large): unpack as any other.
    let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = zip::write::SimpleFileOptions::default().large_file(true);
    writer.start_file("big.txt", options).unwrap();
    writer.write_all(b"not that big").unwrap();
    let zip64 = writer.finish().unwrap().into_inner();
    assert_eq!(ok(&zip64).unwrap(), 1, "zip64");
}
