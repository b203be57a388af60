//! Resumable substitution (#18): an archive download cut off mid-body resumes from where it stopped (HTTP `Range`),
//! within one substitution and across runs (the partial archive kept under `<store>/.tmp/archives/`); a partial that
//! is not the archive's start (planted, or a cache that answers the resumed read with other bytes) is discarded and
//! the archive read whole, verified by its full hash; nothing half-installed either way.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hvd_builder::cache::{Cache, SecretKey, Substituter, push};
use hvd_builder::derivation::{Derivation, DerivationKind};
use hvd_builder::store::BuildOutput;
use hvd_builder::{NoProgress, Store};

/// How the test server answers a request for an archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Every read (whole or ranged) sends at most `n` bytes of its body, then closes the connection.
    CutAfter(usize),
    /// Whole reads are cut after `n` bytes; ranged reads are served.
    CutWholeOnly(usize),
    /// Ranged reads get other bytes (as many as asked); whole reads are served.
    ForgeRanges,
    /// Every archive read is answered `503 Service Unavailable`.
    Unavailable,
    /// Ranged archive reads are answered `416 Range Not Satisfiable`; whole reads are served.
    RefuseRanges,
    /// Everything is served.
    Serve,
}

/// The requests a [`Server`] saw: `METHOD PATH` and the first byte a `Range` header asked for.
type Log = Arc<Mutex<Vec<(String, Option<u64>)>>>;

/// A static server of `root` whose archive reads follow `mode`; records each request (`METHOD PATH`) and the first
/// byte its `Range` header asks for.
struct Server {
    base: String,
    mode: Arc<Mutex<Mode>>,
    /// Modes for the next archive reads, one each, before `mode` applies again.
    script: Arc<Mutex<std::collections::VecDeque<Mode>>>,
    log: Log,
}

fn serve(root: PathBuf, mode: Mode) -> Server {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let mode = Arc::new(Mutex::new(mode));
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let script = Arc::new(Mutex::new(std::collections::VecDeque::new()));
    let (m, l, sc) = (mode.clone(), log.clone(), script.clone());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            let _ = reader.read_line(&mut request);
            let mut range = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) <= 2 {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(value) = lower.strip_prefix("range: bytes=") {
                    range = value.trim().trim_end_matches('-').parse::<u64>().ok();
                }
            }
            let path = request.split_whitespace().nth(1).unwrap_or("/").to_string();
            let head = request.starts_with("HEAD");
            let method = request.split_whitespace().next().unwrap_or("").to_string();
            l.lock().unwrap().push((format!("{method} {path}"), range));
            let archive = path.contains("/archives/");
            let scripted = if archive && !head {
                sc.lock().unwrap().pop_front()
            } else {
                None
            };
            let mode = scripted.unwrap_or(*m.lock().unwrap());
            let Ok(body) = std::fs::read(root.join(path.trim_start_matches('/'))) else {
                let _ = stream.write_all(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
                continue;
            };
            let refusal = match mode {
                Mode::Unavailable if archive && !head => Some("503 Service Unavailable"),
                Mode::RefuseRanges if archive && !head && range.is_some() => {
                    Some("416 Range Not Satisfiable")
                }
                _ => None,
            };
            if let Some(status) = refusal {
                let _ = stream.write_all(
                    format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                        .as_bytes(),
                );
                continue;
            }
            let (status, from, mut bytes) = match range {
                Some(from) if archive && (from as usize) < body.len() => {
                    let mut rest = body[from as usize..].to_vec();
                    if mode == Mode::ForgeRanges {
                        rest.iter_mut().for_each(|b| *b = !*b);
                    }
                    ("206 Partial Content", Some(from), rest)
                }
                _ => ("200 OK", None, body.clone()),
            };
            let total = body.len();
            let mut out = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
                bytes.len()
            );
            if let Some(from) = from {
                out.push_str(&format!(
                    "Content-Range: bytes {from}-{}/{total}\r\n",
                    total - 1
                ));
            }
            out.push_str("\r\n");
            let cut = match mode {
                Mode::CutAfter(n) if archive => Some(n),
                Mode::CutWholeOnly(n) if archive && from.is_none() => Some(n),
                _ => None,
            };
            if let Some(n) = cut {
                bytes.truncate(n.min(bytes.len().saturating_sub(1)));
            }
            let _ = stream.write_all(out.as_bytes());
            if !head {
                let _ = stream.write_all(&bytes);
            }
            let _ = stream.flush();
            // Closing with the body short: the client sees the connection drop mid-body.
        }
    });
    Server {
        base,
        mode,
        script,
        log,
    }
}

/// A store with one pushed path (`noise`: 2 MiB that do not compress, so the archive is about as large), its
/// directory cache, and the path's name; the path is then removed from the store (gc: no root keeps it).
fn pushed(dir: &Path) -> (Store, PathBuf, String, SecretKey) {
    let store = Store::open(dir.join("store")).unwrap();
    let derivation = Derivation::new(DerivationKind::Local, "noise", "1.0").input("test", "resume");
    let realized = store
        .realize(&derivation, false, |target| {
            let mut bytes = vec![0u8; 2 << 20];
            // A simple generator: deterministic, incompressible enough for zstd.
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            for b in bytes.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            std::fs::create_dir_all(target.out.join("data")).unwrap();
            std::fs::write(target.out.join("data/noise.bin"), &bytes).unwrap();
            Ok(BuildOutput::default())
        })
        .unwrap();
    let name = realized
        .path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let key = SecretKey::generate("resume-test").unwrap();
    let cache_dir = dir.join("cache");
    push(
        &store,
        std::slice::from_ref(&name),
        &Cache::parse(&cache_dir.display().to_string()).unwrap(),
        &key,
        &NoProgress,
    )
    .unwrap();
    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    assert!(!realized.path.exists());
    (store, cache_dir, name, key)
}

/// The archive's file in the cache and its size.
fn archive_of(cache: &Path) -> (PathBuf, u64) {
    let entry = std::fs::read_dir(cache.join("archives"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let size = std::fs::metadata(&entry).unwrap().len();
    (entry, size)
}

fn partials(store: &Store) -> Vec<(PathBuf, u64)> {
    std::fs::read_dir(store.root().join(".tmp/archives"))
        .map(|entries| {
            entries
                .map(|e| {
                    let path = e.unwrap().path();
                    let len = std::fs::metadata(&path).unwrap().len();
                    (path, len)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The ranged reads of the archive the server saw: their first bytes.
fn ranges(server: &Server) -> Vec<u64> {
    server
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(path, _)| path.contains("/archives/"))
        .filter_map(|(_, range)| *range)
        .collect()
}

fn substitute(
    store: &Store,
    server: &Server,
    name: &str,
    key: &SecretKey,
) -> hvd_builder::Result<bool> {
    let substituter =
        Substituter::new(std::slice::from_ref(&server.base), vec![key.public()]).unwrap();
    substituter.substitute_path_name(store, name, &NoProgress)
}

#[test]
fn an_archive_cut_off_mid_body_resumes_where_it_stopped_in_the_same_run_and_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let (store, cache, name, key) = pushed(dir.path());
    let (_, size) = archive_of(&cache);
    assert!(size > 1 << 20, "the archive is {size} bytes");
    let half = (size / 2) as usize;

    // The first read breaks off after half the archive: the substitution resumes it at once, from about there.
    let server = serve(cache.clone(), Mode::CutWholeOnly(half));
    assert!(substitute(&store, &server, &name, &key).unwrap());
    assert!(store.is_valid(&store.root().join(&name)));
    let resumed = ranges(&server);
    assert_eq!(resumed.len(), 1, "{:?}", server.log.lock().unwrap());
    assert!(
        resumed[0] > 0 && resumed[0] <= half as u64,
        "resumed from {resumed:?}"
    );
    assert!(partials(&store).is_empty(), "{:?}", partials(&store));

    // Every read breaks off: the run gives up, keeping what arrived; the next run resumes from there.
    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    *server.mode.lock().unwrap() = Mode::CutAfter(200_000);
    server.log.lock().unwrap().clear();
    let err = substitute(&store, &server, &name, &key)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&server.base), "{err}");
    assert!(!store.root().join(&name).exists(), "nothing half-installed");
    let kept = partials(&store);
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(
        kept[0].1 >= 400_000,
        "each attempt resumed the last: {kept:?}"
    );
    *server.mode.lock().unwrap() = Mode::Serve;
    server.log.lock().unwrap().clear();
    assert!(substitute(&store, &server, &name, &key).unwrap());
    assert_eq!(
        ranges(&server),
        [kept[0].1],
        "the next run read only the rest"
    );
    assert!(store.is_valid(&store.root().join(&name)));
    assert!(partials(&store).is_empty());
}

/// The attacker: a cache that answers the resumed read with other bytes, and a partial archive planted in the store.
/// Either is caught by the full hash, discarded, and the archive read whole; a cache whose whole archive is wrong
/// too is refused naming the path, with nothing installed and nothing kept.
#[test]
fn a_partial_that_is_not_the_archives_start_is_discarded_and_the_archive_read_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (store, cache, name, key) = pushed(dir.path());
    let (archive, size) = archive_of(&cache);
    let sha256 = archive
        .file_name()
        .unwrap()
        .to_string_lossy()
        .replace(".tar.zst", "");
    let partial = store
        .root()
        .join(".tmp/archives")
        .join(format!("{sha256}.part"));

    // A correct first half from an earlier run; the cache forges what follows.
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    let bytes = std::fs::read(&archive).unwrap();
    plant(&partial, &bytes[..bytes.len() / 2]);
    let server = serve(cache.clone(), Mode::ForgeRanges);
    assert!(substitute(&store, &server, &name, &key).unwrap());
    assert_eq!(ranges(&server), [size / 2], "it resumed first");
    let whole = server
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(line, range)| {
            line.starts_with("GET ") && line.contains("/archives/") && range.is_none()
        })
        .count();
    assert_eq!(whole, 1, "then read it whole");
    assert!(store.is_valid(&store.root().join(&name)));
    assert!(partials(&store).is_empty());

    // A planted partial as long as the archive, of other bytes: discarded without a ranged read.
    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    plant(&partial, &vec![7u8; size as usize]);
    server.log.lock().unwrap().clear();
    *server.mode.lock().unwrap() = Mode::Serve;
    assert!(substitute(&store, &server, &name, &key).unwrap());
    assert!(ranges(&server).is_empty());
    assert!(partials(&store).is_empty());

    // The cache's archive itself is another one: refused naming the path, nothing installed, nothing kept.
    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    let mut forged = bytes.clone();
    let middle = forged.len() / 2;
    forged[middle + 200] ^= 1;
    std::fs::set_permissions(
        &archive,
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    std::fs::write(&archive, &forged).unwrap();
    plant(&partial, &bytes[..middle + 100]);
    let err = substitute(&store, &server, &name, &key)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&name) && err.contains("nothing was installed"),
        "{err}"
    );
    assert!(!store.root().join(&name).exists());
    assert!(partials(&store).is_empty(), "{:?}", partials(&store));
}

/// Write `bytes` to `partial` as hvd would have (mode 0600).
fn plant(partial: &Path, bytes: &[u8]) {
    let _ = std::fs::remove_file(partial);
    std::fs::write(partial, bytes).unwrap();
    std::fs::set_permissions(partial, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
}

/// The partial archive of `cache`'s archive in `store`, its directory created.
fn partial_of(store: &Store, cache: &Path) -> PathBuf {
    let (archive, _) = archive_of(cache);
    let sha256 = archive
        .file_name()
        .unwrap()
        .to_string_lossy()
        .replace(".tar.zst", "");
    let dir = store.root().join(".tmp/archives");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{sha256}.part"))
}

/// The flaky network resuming exists for: a cache that fails the resumed read before any byte (`503`) keeps the
/// partial for the next run, which resumes from it; a cache that refuses the range (`416`) gets the archive read
/// whole.
#[test]
fn a_failed_resumed_read_keeps_the_partial_and_a_refused_range_reads_the_archive_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (store, cache, name, key) = pushed(dir.path());
    let (archive, _) = archive_of(&cache);
    let partial = partial_of(&store, &cache);
    let bytes = std::fs::read(&archive).unwrap();
    let half = bytes.len() / 2;
    plant(&partial, &bytes[..half]);
    std::fs::set_permissions(
        &partial,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();

    let server = serve(cache.clone(), Mode::Unavailable);
    let err = substitute(&store, &server, &name, &key)
        .unwrap_err()
        .to_string();
    assert!(err.contains("503"), "{err}");
    assert_eq!(partials(&store), [(partial.clone(), half as u64)], "kept");
    *server.mode.lock().unwrap() = Mode::Serve;
    server.log.lock().unwrap().clear();
    assert!(substitute(&store, &server, &name, &key).unwrap());
    assert_eq!(ranges(&server), [half as u64], "the next run resumed it");
    assert!(store.is_valid(&store.root().join(&name)));

    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    plant(&partial, &bytes[..half]);
    server.script.lock().unwrap().push_back(Mode::RefuseRanges);
    server.log.lock().unwrap().clear();
    assert!(substitute(&store, &server, &name, &key).unwrap());
    let reads: Vec<_> = server
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(line, _)| line.starts_with("GET ") && line.contains("/archives/"))
        .map(|(_, range)| *range)
        .collect();
    assert_eq!(reads, [Some(half as u64), None], "refused, then read whole");
    assert!(store.is_valid(&store.root().join(&name)));
    assert!(partials(&store).is_empty());
}

/// The attacker: a hard link to another file of the user's, planted as the partial archive (with the archive's
/// true start, so resuming would append to it). The partial is replaced by a new file; the other file is untouched.
#[test]
fn a_partial_archive_that_is_a_hard_link_is_replaced_never_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let (store, cache, name, key) = pushed(dir.path());
    let (archive, _) = archive_of(&cache);
    let partial = partial_of(&store, &cache);
    let bytes = std::fs::read(&archive).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::set_permissions(&victim, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::hard_link(&victim, &partial).unwrap();

    let server = serve(cache.clone(), Mode::Serve);
    assert!(substitute(&store, &server, &name, &key).unwrap());
    assert!(store.is_valid(&store.root().join(&name)));
    assert!(
        std::fs::read(&victim).unwrap() == bytes[..bytes.len() / 2],
        "the other file was written through the link"
    );
    assert!(
        ranges(&server).is_empty(),
        "not resumed from the planted file"
    );
    assert!(partials(&store).is_empty());

    // Group- or world-writable: not resumed either.
    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    plant(&partial, &bytes[..bytes.len() / 2]);
    std::fs::set_permissions(
        &partial,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    server.log.lock().unwrap().clear();
    assert!(substitute(&store, &server, &name, &key).unwrap());
    assert!(
        ranges(&server).is_empty(),
        "not resumed from a writable file"
    );
}

/// Reads that break off use up every attempt but the last, and the last completes with bytes that are not the
/// archive's: the partial is discarded and the archive still read whole (that read has attempts of its own).
#[test]
fn a_resume_found_wrong_on_the_last_attempt_still_reads_the_archive_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (store, cache, name, key) = pushed(dir.path());
    let (archive, _) = archive_of(&cache);
    let partial = partial_of(&store, &cache);
    let bytes = std::fs::read(&archive).unwrap();
    let step = 100_000;
    plant(&partial, &bytes[..step]);
    let server = serve(cache.clone(), Mode::Serve);
    let mut script =
        vec![Mode::CutAfter(step); hvd_builder::cache::backend::MAX_ATTEMPTS as usize - 1];
    script.push(Mode::ForgeRanges);
    *server.script.lock().unwrap() = script.into();

    assert!(substitute(&store, &server, &name, &key).unwrap());
    let expected: Vec<u64> = (1..=hvd_builder::cache::backend::MAX_ATTEMPTS as u64)
        .map(|n| n * step as u64)
        .collect();
    assert_eq!(ranges(&server), expected);
    assert!(store.is_valid(&store.root().join(&name)));
    assert!(partials(&store).is_empty());
}

/// Progress counts each byte of the archive once, however many reads it took (a planted start, two reads that break
/// off, then the rest).
#[test]
fn download_progress_counts_each_byte_once_across_resumed_reads() {
    let dir = tempfile::tempdir().unwrap();
    let (store, cache, _name, _key) = pushed(dir.path());
    let (archive, size) = archive_of(&cache);
    let partial = partial_of(&store, &cache);
    let bytes = std::fs::read(&archive).unwrap();
    plant(&partial, &bytes[..100_000]);
    let server = serve(cache.clone(), Mode::Serve);
    *server.script.lock().unwrap() = vec![Mode::CutAfter(300_000); 2].into();
    let sha256 = hvd_resolver::Sha256::of_file(&archive).unwrap();
    let key = format!(
        "archives/{}",
        archive.file_name().unwrap().to_string_lossy()
    );
    let reported = std::sync::atomic::AtomicU64::new(0);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let found = runtime
        .block_on(Cache::parse(&server.base).unwrap().download(
            &key,
            &partial,
            (&sha256, size),
            &|n| {
                reported.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            },
        ))
        .unwrap();
    let (found, found_size, _) = found.unwrap();
    assert_eq!((found, found_size), (sha256, size));
    assert_eq!(ranges(&server), [100_000, 400_000, 700_000]);
    assert_eq!(reported.into_inner(), size);
}

/// The sweep of abandoned partials looks only at `<sha256>.part` names: an old one is removed (under its archive's
/// lock), another name gets no lock file and is left alone.
#[test]
fn the_sweep_of_old_partials_takes_only_sha256_names() {
    let dir = tempfile::tempdir().unwrap();
    let (store, cache, name, key) = pushed(dir.path());
    let partials_dir = store.root().join(".tmp/archives");
    std::fs::create_dir_all(&partials_dir).unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(8 * 24 * 3600);
    let abandoned = partials_dir.join(format!("{}.part", "ab".repeat(32)));
    let other = partials_dir.join("foo.part");
    for path in [&abandoned, &other] {
        std::fs::File::create(path)
            .unwrap()
            .set_modified(old)
            .unwrap();
    }
    let server = serve(cache.clone(), Mode::Serve);
    assert!(substitute(&store, &server, &name, &key).unwrap());
    assert!(!abandoned.exists());
    assert!(other.exists());
    assert!(!store.root().join(".locks/archive-foo.lock").exists());
}
