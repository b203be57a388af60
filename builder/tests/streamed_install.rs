//! #22 §4: a big wheel is unpacked while it downloads (its central directory read ahead by a range request), and
//! kept only once the whole file matched its locked sha256 and size and the end read ahead equals the file's end.
//! The hosts here are real HTTP servers on 127.0.0.1 playing honest, rangeless and hostile file hosts.

#[allow(dead_code)]
mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{host_python, walk, write_wheel};
use hvd_builder::{Artifact, EnvPlan, Error, PackagePlan, Sha256, Store};

/// How the file host answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Host {
    /// Range requests answered with 206 and the file's bytes; the body's last megabyte waits until the store shows
    /// the wheel's first module unpacked (or 60 s), so an install that streams is seen to.
    Honest,
    /// Range requests answered with 206 and the file's bytes; the body's last megabyte waits until the store's
    /// temp area holds the wheel's first module (or 60 s): an entry was written before the download ended.
    Ranges,
    /// Range requests answered with 200 and the whole file, as a host without ranges does.
    NoRanges,
    /// The range answer's bytes differ from the file's end (one byte of the central directory changed); the body
    /// waits as for `Ranges`.
    OtherTail,
    /// The body differs from the locked file in one byte past its middle and waits as for `Ranges`; the range
    /// answer is the file's.
    CorruptBody,
    /// The body stops after half of the file (the connection closes).
    Truncated,
    /// The range answer is gzip-encoded (`Content-Encoding: gzip`, whatever the request accepted); the body's last
    /// megabyte waits up to 3 s for the first module to be unpacked (it must not be: the answer is refused).
    GzipTail,
    /// As `Ranges`, but the body's last megabyte waits at most 3 s for the first module: an archive refused before
    /// it writes any (the install then waits for the body's verdict) costs no more.
    Refused,
    /// The whole body is sent without a length, and the connection is held open (the download not over, so not
    /// verified) until the wheel's tree is unpacked to its RECORD in the store's temp area, or committed (or 60 s).
    Held,
}

struct Served {
    url: String,
    /// Range requests answered.
    ranges: Arc<AtomicUsize>,
    /// The first module was on disk in the store's temp area before the body's end was sent.
    streamed: Arc<AtomicBool>,
}

/// The first module of the big wheel, as it lies in a store path being built.
const FIRST: &str = "out/site-packages/big/m0.bin";

/// Whether some temp dir of the store holds [`FIRST`].
fn unpacking(store: &Path) -> bool {
    std::fs::read_dir(store.join(".tmp"))
        .map(|dirs| {
            dirs.filter_map(|d| d.ok())
                .any(|d| d.path().join(FIRST).exists())
        })
        .unwrap_or(false)
}

/// Whether the store's temp area holds the big wheel's whole tree (its RECORD, the last entry, is written), or the
/// wheel's path was committed.
fn unpacked_whole(store: &Path) -> bool {
    let entries = |dir: &Path| {
        std::fs::read_dir(dir)
            .map(|d| d.filter_map(|e| e.ok()).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    entries(&store.join(".tmp")).iter().any(|d| {
        d.path()
            .join("out/site-packages/big-1.0.dist-info/RECORD")
            .exists()
    }) || entries(store).iter().any(|d| {
        let name = d.file_name().to_string_lossy().into_owned();
        !name.starts_with('.') && name.contains("-big-1.0")
    })
}

/// Whether the store has a temp dir for the big wheel's path (it stays until the download's end is known).
fn installing(store: &Path) -> bool {
    std::fs::read_dir(store.join(".tmp"))
        .map(|dirs| {
            dirs.filter_map(|d| d.ok())
                .any(|d| d.file_name().to_string_lossy().contains("-big-1.0."))
        })
        .unwrap_or(false)
}

fn serve(file: Vec<u8>, filename: &str, host: Host, store: PathBuf) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/{filename}", listener.local_addr().unwrap());
    let ranges = Arc::new(AtomicUsize::new(0));
    let streamed = Arc::new(AtomicBool::new(false));
    let (counter, seen) = (ranges.clone(), streamed.clone());
    let file = Arc::new(file);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let (file, counter, seen, store) =
                (file.clone(), counter.clone(), seen.clone(), store.clone());
            std::thread::spawn(move || {
                let range = requested_range(&stream);
                let len = file.len();
                if let Some(start) = range.filter(|_| host != Host::NoRanges) {
                    counter.fetch_add(1, Ordering::SeqCst);
                    let mut body = file[start..].to_vec();
                    if host == Host::OtherTail {
                        // A byte of the last entry's name in the central directory (before the 22-byte end record).
                        let at = body.len() - 22 - 10;
                        body[at] ^= 0x20;
                    }
                    let encoding = if host == Host::GzipTail {
                        let mut encoder =
                            flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                        encoder.write_all(&body).unwrap();
                        body = encoder.finish().unwrap();
                        "Content-Encoding: gzip\r\n"
                    } else {
                        ""
                    };
                    let head = format!(
                        "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{}/{len}\r\n{encoding}Content-Length: {}\r\nConnection: close\r\n\r\n",
                        len - 1,
                        body.len()
                    );
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(&body);
                    return;
                }
                let mut body = file.to_vec();
                if host == Host::CorruptBody {
                    let at = len / 2 + 12_345;
                    body[at] ^= 1;
                }
                let head = if host == Host::Held {
                    "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".to_string()
                } else {
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
                };
                let _ = stream.write_all(head.as_bytes());
                let send = if host == Host::Truncated {
                    len / 2
                } else {
                    len
                };
                let last = if host == Host::Held {
                    send
                } else {
                    send.saturating_sub(1 << 20)
                };
                for chunk in body[..last].chunks(256 << 10) {
                    if stream.write_all(chunk).is_err() {
                        return;
                    }
                }
                let started: fn(&Path) -> bool = match host {
                    Host::Honest => unpacking,
                    Host::Ranges => unpacking,
                    Host::OtherTail | Host::CorruptBody => installing,
                    Host::Held => unpacked_whole,
                    Host::GzipTail | Host::Refused => unpacking,
                    _ => |_| true,
                };
                let wait = if matches!(host, Host::GzipTail | Host::Refused) {
                    3
                } else {
                    60
                };
                let deadline = Instant::now() + Duration::from_secs(wait);
                while !started(&store) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(2));
                }
                seen.store(started(&store), Ordering::SeqCst);
                let _ = stream.write_all(&body[last..send]);
            });
        }
    });
    Served {
        url,
        ranges,
        streamed,
    }
}

/// A wheel past the streaming threshold (made once per test process): 40 modules of 1 MB of bytes that do not
/// compress, plus one small one.
fn big_wheel() -> &'static (String, Vec<u8>) {
    static WHEEL: std::sync::OnceLock<(String, Vec<u8>)> = std::sync::OnceLock::new();
    WHEEL.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        make_big_wheel(dir.path())
    })
}

fn make_big_wheel(dir: &Path) -> (String, Vec<u8>) {
    make_big_wheel_valued(dir, 1)
}

/// [`make_big_wheel`] whose `big/__init__.py` says `VALUE = {value}`.
fn make_big_wheel_valued(dir: &Path, value: u32) -> (String, Vec<u8>) {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let modules: Vec<(String, Vec<u8>)> = (0..40)
        .map(|i| {
            let data = (0..(1 << 20))
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            (format!("big/m{i}.bin"), data)
        })
        .collect();
    let mut files: Vec<(&str, &[u8], bool)> = modules
        .iter()
        .map(|(p, d)| (p.as_str(), d.as_slice(), false))
        .collect();
    let init = format!("VALUE = {value}\n");
    files.push(("big/__init__.py", init.as_bytes(), false));
    let filename = write_wheel(dir, "big", "big", "1.0", &files, None);
    let bytes = std::fs::read(dir.join(&filename)).unwrap();
    (filename, bytes)
}

struct Fixture {
    _dir: tempfile::TempDir,
    store: Store,
    served: Served,
    plan: EnvPlan,
    bytes: Vec<u8>,
}

fn fixture(host: Host) -> Fixture {
    fixture_of(host, |_| {})
}

/// [`fixture`] serving the big wheel changed by `patch` (and locked as changed).
fn fixture_of(host: Host, patch: impl Fn(&mut Vec<u8>)) -> Fixture {
    let (filename, bytes) = big_wheel();
    let mut bytes = bytes.clone();
    patch(&mut bytes);
    fixture_serving(host, filename, bytes.clone(), bytes)
}

/// A store and a host serving `served` as `filename`, locked to the sha256 and size of `locked`.
fn fixture_serving(host: Host, filename: &str, served: Vec<u8>, locked: Vec<u8>) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    let bytes = locked;
    let served = serve(served, filename, host, store.root().to_path_buf());
    let package = PackagePlan {
        name: "big".into(),
        version: "1.0".into(),
        artifact: Artifact {
            url: served.url.clone(),
            filename: filename.to_string(),
            sha256: Sha256::of_bytes(&bytes),
            size: Some(bytes.len() as u64),
        },
        dependencies: Vec::new(),
        build: None,
    };
    let plan = EnvPlan {
        name: "streamed".into(),
        python: host_python(),
        interpreter: None,
        packages: vec![package],
        toolchain: None,
        local_packages: Vec::new(),
    };
    Fixture {
        _dir: dir,
        store,
        served,
        plan,
        bytes,
    }
}

/// No path of the wheel and nothing left in the store's temp area; the download cache does not hold the file.
fn assert_nothing_installed(f: &Fixture) {
    let paths = common::paths_besides_interpreters(&f.store);
    assert!(!paths.iter().any(|p| p.contains("big")), "{paths:?}");
    let left: Vec<_> = std::fs::read_dir(f.store.root().join(".tmp"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
    let cached = f
        .store
        .downloads_dir()
        .join("sha256")
        .join(Sha256::of_bytes(&f.bytes).as_str());
    assert!(!cached.exists());
}

fn build(f: &Fixture) -> Result<hvd_builder::EnvBuild, Error> {
    common::build_default(&f.store, &f.plan)
}

/// An error with its causes, as the command line shows them.
fn chain(err: &Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

#[test]
fn a_big_wheel_is_unpacked_while_it_downloads_and_is_the_same_tree() {
    let f = fixture(Host::Honest);
    let built = build(&f).unwrap();
    assert_eq!(f.served.ranges.load(Ordering::SeqCst), 1);
    assert!(
        f.served.streamed.load(Ordering::SeqCst),
        "the first module was not unpacked before the download's end"
    );
    let path = &built.packages[0].path;
    // The same tree and content hash as an install of the complete file (another store, no range answered).
    let other = fixture(Host::NoRanges);
    let again = build(&other).unwrap();
    assert_eq!(other.served.ranges.load(Ordering::SeqCst), 0);
    let info = f.store.path_info(path).unwrap();
    let other_info = other.store.path_info(&again.packages[0].path).unwrap();
    assert_eq!(info.content_hash, other_info.content_hash);
    assert_eq!(
        std::fs::read(path.join("site-packages/big/m39.bin")).unwrap(),
        std::fs::read(again.packages[0].path.join("site-packages/big/m39.bin")).unwrap()
    );
}

/// A host whose range answer is not the file's end (a byte of the central directory's last name changed): what was
/// unpacked from it is discarded, and the wheel is installed from the verified file, the same tree as from an
/// honest host.
#[test]
fn a_range_answer_that_differs_from_the_files_end_is_discarded_for_the_verified_file() {
    let f = fixture(Host::OtherTail);
    let built = build(&f).unwrap();
    assert_eq!(f.served.ranges.load(Ordering::SeqCst), 1);
    assert!(f.served.streamed.load(Ordering::SeqCst));
    let left: Vec<_> = std::fs::read_dir(f.store.root().join(".tmp"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
    let honest = fixture(Host::NoRanges);
    let again = build(&honest).unwrap();
    let info = f.store.path_info(&built.packages[0].path).unwrap();
    let honest_info = honest.store.path_info(&again.packages[0].path).unwrap();
    assert_eq!(info.content_hash, honest_info.content_hash);
}

/// Little-endian fields of a zip.
fn u16_at(bytes: &[u8], at: usize) -> usize {
    u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize
}

fn u32_at(bytes: &[u8], at: usize) -> usize {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize
}

/// Remove the central directory's last record (the archive has no comment): its entry stays in the stream only.
fn drop_last_central_record(bytes: &mut Vec<u8>) {
    let end = bytes.len() - 22;
    assert_eq!(
        u32_at(bytes, end),
        0x0605_4b50,
        "no end record without a comment"
    );
    let (entries, size, offset) = (
        u16_at(bytes, end + 10),
        u32_at(bytes, end + 12),
        u32_at(bytes, end + 16),
    );
    let (mut at, mut last) = (offset, offset);
    for _ in 0..entries {
        last = at;
        at += 46 + u16_at(bytes, at + 28) + u16_at(bytes, at + 30) + u16_at(bytes, at + 32);
    }
    let removed = at - last;
    bytes.drain(last..at);
    let end = end - removed;
    bytes[end + 8..end + 10].copy_from_slice(&((entries - 1) as u16).to_le_bytes());
    bytes[end + 10..end + 12].copy_from_slice(&((entries - 1) as u16).to_le_bytes());
    bytes[end + 12..end + 16].copy_from_slice(&((size - removed) as u32).to_le_bytes());
}

/// A change made to the served wheel's bytes.
type Patch = dyn Fn(&mut Vec<u8>);

/// What a build of a hostile variant gives: the wheel path's content hash and files, or the error (with its causes)
/// after which nothing is left in the store's temporary directory.
fn outcome(host: Host, patch: &Patch) -> Result<(String, Vec<String>), String> {
    let f = fixture_of(host, patch);
    let built = match build(&f) {
        Ok(built) => built,
        Err(e) => {
            if host == Host::Refused {
                assert!(f.served.ranges.load(Ordering::SeqCst) >= 1, "not streamed");
            }
            let left: Vec<_> = std::fs::read_dir(f.store.root().join(".tmp"))
                .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
                .unwrap_or_default();
            assert!(left.is_empty(), "{left:?}");
            return Err(chain(&e));
        }
    };
    if host == Host::Ranges {
        assert!(
            f.served.streamed.load(Ordering::SeqCst),
            "no entry was written before the download's end"
        );
    }
    let path = &built.packages[0].path;
    let info = f.store.path_info(path).unwrap();
    let mut files: Vec<String> = walk(path)
        .into_iter()
        .map(|p| p.strip_prefix(path).unwrap().display().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    files.sort();
    Ok((info.content_hash.to_string(), files))
}

/// Archives whose local headers and central directory disagree, that carry bytes no entry they list covers (an
/// entry only a reader from the front would see), or data after the end record are refused, alike streamed and
/// from the complete file, naming what differs, and leave nothing (before, the central directory decided and they
/// installed: another reader of the same wheel could have seen other files).
#[test]
fn hostile_layouts_are_refused_alike_streamed_and_from_the_complete_file() {
    let stream_only = |bytes: &mut Vec<u8>| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.whl");
        std::fs::write(&path, &bytes).unwrap();
        common::append_to_zip(&path, "big/evil.py", b"print('only in the stream')\n");
        *bytes = std::fs::read(&path).unwrap();
        drop_last_central_record(bytes);
    };
    let variants: Vec<(&str, Box<Patch>, &str)> = vec![
        // The first local header names `big/m0.bix`; the central directory `big/m0.bin`.
        (
            "a local name",
            Box::new(|b: &mut Vec<u8>| b[30 + 9] = b'x'),
            "`big/m0.bin` is named `big/m0.bix` in its local header",
        ),
        // The first local header's sizes say 1 byte.
        (
            "local sizes",
            Box::new(|b: &mut Vec<u8>| {
                b[18..22].copy_from_slice(&1u32.to_le_bytes());
                b[22..26].copy_from_slice(&1u32.to_le_bytes());
            }),
            "has sizes 1/1 (compressed/unpacked) in its local header",
        ),
        (
            "an entry only in the stream",
            Box::new(stream_only),
            "that belong to no entry it lists",
        ),
        (
            "data after the end record",
            Box::new(|b: &mut Vec<u8>| b.extend_from_slice(&[b'j'; 1000])),
            "other data follows it",
        ),
    ];
    for (what, patch, says) in &variants {
        for host in [Host::Refused, Host::NoRanges] {
            match outcome(host, patch.as_ref()) {
                Ok((_, files)) => panic!("{what} ({host:?}): installed {files:?}"),
                Err(e) => assert!(e.contains(says), "{what} ({host:?}): {e}"),
            }
        }
    }
    // The entry only in the stream was really in it: listed, it installs.
    let listed = |bytes: &mut Vec<u8>| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.whl");
        std::fs::write(&path, &bytes).unwrap();
        common::append_to_zip(&path, "big/evil.py", b"print('listed')\n");
        *bytes = std::fs::read(&path).unwrap();
    };
    let err = outcome(Host::NoRanges, &listed).unwrap_err();
    assert!(
        err.contains("`big/evil.py` is not listed in RECORD"),
        "{err}"
    );
}

#[test]
fn a_corrupt_body_unpacked_while_streaming_is_a_hash_mismatch_and_installs_nothing() {
    let f = fixture(Host::CorruptBody);
    let err = build(&f).unwrap_err();
    assert!(matches!(err, Error::HashMismatch { .. }), "{err}");
    assert!(f.served.streamed.load(Ordering::SeqCst));
    assert_nothing_installed(&f);
}

#[test]
fn a_truncated_download_unpacked_while_streaming_installs_nothing() {
    let f = fixture(Host::Truncated);
    let err = chain(&build(&f).unwrap_err());
    assert!(err.contains("big-1.0-py3-none-any.whl"), "{err}");
    assert_nothing_installed(&f);
}

/// A host serving another valid wheel of the same size (its range answer and body agree: the end read ahead is the
/// served file's end) for a lock that names the original, holding the connection open after the last byte: the
/// whole tree is unpacked (to its RECORD) before the download ends, so only the hash gate keeps it out. The build
/// is a hash mismatch with nothing installed.
#[test]
fn another_valid_wheel_of_the_locked_size_is_a_hash_mismatch_though_it_unpacked_cleanly() {
    let (filename, original) = big_wheel();
    let dir = tempfile::tempdir().unwrap();
    let other = (2..10)
        .map(|value| make_big_wheel_valued(dir.path(), value).1)
        .find(|other| other.len() == original.len())
        .expect("a wheel of the same size with another VALUE");
    assert_ne!(&other, original);
    let f = fixture_serving(Host::Held, filename, other, original.clone());
    let err = build(&f).unwrap_err();
    assert!(
        matches!(&err, Error::HashMismatch { url, .. } if url.ends_with(filename.as_str())),
        "{}",
        chain(&err)
    );
    assert_eq!(f.served.ranges.load(Ordering::SeqCst), 1);
    assert!(
        f.served.streamed.load(Ordering::SeqCst),
        "the wheel was not unpacked whole before the download's end"
    );
    assert_nothing_installed(&f);
}

/// Bytes in the files under `dir`.
fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// A host that sends the first `front` bytes of `file`'s body, then nothing until `release` is set, then the rest;
/// range requests are answered with the file's end.
fn serve_stalling(file: Vec<u8>, filename: &str, front: usize, release: Arc<AtomicBool>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/{filename}", listener.local_addr().unwrap());
    let file = Arc::new(file);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let (file, release) = (file.clone(), release.clone());
            std::thread::spawn(move || {
                let range = requested_range(&stream);
                let len = file.len();
                if let Some(start) = range {
                    let head = format!(
                        "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{}/{len}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        len - 1,
                        len - start
                    );
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(&file[start..]);
                    return;
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
                );
                let _ = stream.write_all(head.as_bytes());
                if stream.write_all(&file[..front]).is_err() {
                    return;
                }
                while !release.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let _ = stream.write_all(&file[front..]);
            });
        }
    });
    url
}

/// The attack on the disk before the hash check: a big "wheel" whose first entry is a deflate bomb (1 GiB of zeros
/// in about 1 MiB), its body stalled after 2 MiB, locked to a hash it will never match. Before the verdict the
/// extraction may write at most 16 MiB + 100 bytes per body byte received (here at most 216 MiB), however long the
/// host stalls; once the body ends the hash mismatch is the error, naming the wheel, and nothing is left.
#[test]
fn a_bomb_in_a_stalled_download_writes_no_more_than_the_body_allows_before_the_hash_check() {
    const ZEROS: usize = 1 << 30;
    const FRONT: usize = 2 << 20;
    const CAP: u64 = (16 << 20) + 100 * FRONT as u64;
    let dir = tempfile::tempdir().unwrap();
    let filename = "big-1.0-py3-none-any.whl";
    let path = dir.path().join(filename);
    {
        let mut writer = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
        let deflated = zip::write::SimpleFileOptions::default()
            .compression_level(Some(9))
            .large_file(true);
        writer.start_file("big/bomb.bin", deflated).unwrap();
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..ZEROS / zeros.len() {
            writer.write_all(&zeros).unwrap();
        }
        let stored = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        writer.start_file("big/pad.bin", stored).unwrap();
        writer.write_all(&vec![7u8; 36 << 20]).unwrap();
        for name in ["METADATA", "WHEEL", "RECORD"] {
            writer
                .start_file(format!("big-1.0.dist-info/{name}"), stored)
                .unwrap();
            writer.write_all(b"x\n").unwrap();
        }
        writer.finish().unwrap();
    }
    let file = std::fs::read(&path).unwrap();
    let release = Arc::new(AtomicBool::new(false));
    let url = serve_stalling(file.clone(), filename, FRONT, release.clone());
    let store = Store::open(dir.path().join("store")).unwrap();
    let plan = EnvPlan {
        name: "bomb".into(),
        python: host_python(),
        interpreter: None,
        packages: vec![PackagePlan {
            name: "big".into(),
            version: "1.0".into(),
            artifact: Artifact {
                url,
                filename: filename.into(),
                sha256: Sha256::of_bytes(b"the wheel the lock names"),
                size: Some(file.len() as u64),
            },
            dependencies: Vec::new(),
            build: None,
        }],
        toolchain: None,
        local_packages: Vec::new(),
    };
    let temp = store.root().join(".tmp");
    let watcher = std::thread::spawn(move || {
        // Until the bomb is being written, then a while longer: the most written under the store's temp area.
        let (mut most, mut since) = (0u64, None::<Instant>);
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline
            && since.is_none_or(|t| t.elapsed() < Duration::from_secs(3))
        {
            most = most.max(bytes_under(&temp));
            if most > 0 && since.is_none() {
                since = Some(Instant::now());
            }
            if most > CAP {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        release.store(true, Ordering::SeqCst);
        most
    });
    let err = common::build_default(&store, &plan).unwrap_err();
    let most = watcher.join().unwrap();
    assert!(most > 0, "nothing was unpacked while the body was stalled");
    assert!(
        most <= CAP,
        "{most} bytes were written before the download was verified (at most {CAP} may be)"
    );
    assert!(
        matches!(&err, Error::HashMismatch { url, .. } if url.ends_with(filename)),
        "{}",
        chain(&err)
    );
    let paths = common::paths_besides_interpreters(&store);
    assert!(!paths.iter().any(|p| p.contains("big")), "{paths:?}");
    let left: Vec<_> = std::fs::read_dir(store.root().join(".tmp"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}

/// A central directory whose second entry points at the first entry's local header (two names for one deflate
/// stream: the way a small archive is made to unpack many times its size) is refused, naming the entry.
#[test]
fn entries_that_share_archive_bytes_are_refused() {
    let f = fixture_of(Host::NoRanges, |bytes: &mut Vec<u8>| {
        let end = bytes.len() - 22;
        let directory = u32_at(bytes, end + 16);
        let second = directory
            + 46
            + u16_at(bytes, directory + 28)
            + u16_at(bytes, directory + 30)
            + u16_at(bytes, directory + 32);
        let first_offset = bytes[directory + 42..directory + 46].to_vec();
        bytes[second + 42..second + 46].copy_from_slice(&first_offset);
    });
    let err = chain(&build(&f).unwrap_err());
    for needle in ["big/m1.bin", "overlap another entry"] {
        assert!(err.contains(needle), "`{needle}` missing from: {err}");
    }
    let paths = common::paths_besides_interpreters(&f.store);
    assert!(!paths.iter().any(|p| p.contains("big")), "{paths:?}");
}

/// A range answer in an encoding (gzip, though the request asked for none) is not the file's bytes as they are: the
/// wheel is not streamed from it (nothing unpacked while the body waits) and installs from the complete file.
#[test]
fn an_encoded_range_answer_is_not_streamed_from() {
    let f = fixture(Host::GzipTail);
    let built = build(&f).unwrap();
    assert_eq!(f.served.ranges.load(Ordering::SeqCst), 1);
    assert!(
        !f.served.streamed.load(Ordering::SeqCst),
        "the wheel was unpacked from a gzip-encoded range answer"
    );
    assert!(
        built.packages[0]
            .path
            .join("site-packages/big/m39.bin")
            .exists()
    );
}

/// Reads a request's head from `stream` and returns the start of its `Range: bytes=START-`, if it asks for one.
fn requested_range(stream: &std::net::TcpStream) -> Option<usize> {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut range = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            return range;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(value) = lower.strip_prefix("range: bytes=") {
            range = value.trim().trim_end_matches('-').parse::<usize>().ok();
        }
    }
}
