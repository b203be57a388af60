//! End-to-end tests of the signed binary cache: `hvd cache keygen`, `hvd cache push` into a directory, and `hvd
//! build --cache` substituting into an empty store while the package index is unreachable; refusals of untrusted,
//! tampered and hostile records and archives (the real binary, a real interpreter, real HTTP servers).

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use hvd_builder::cache::record::{Record, archive_key, record_key};
use hvd_builder::cache::{SecretKey, archive};
use hvd_resolver::lockfile::{LockedPackage, Lockfile};

/// The key name the tests push with.
const KEY: &str = "test-cache-1";

/// A project built once into `store`, pushed into the directory cache `cache`, then the store moved aside (to
/// `first`) and the lock pointed at a port nobody listens on: a build now has only the cache.
struct Pushed {
    _dir: tempfile::TempDir,
    root: PathBuf,
    store: PathBuf,
    first: PathBuf,
    cache: PathBuf,
    keys: PathBuf,
    /// The env's store path (the same in both stores: the store directory is the same).
    env: String,
}

fn dead_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", listener.local_addr().unwrap())
}

fn hvd(root: &Path, store: &Path, args: &[&str]) -> Output {
    common::hvd_with_store(root, store, args)
        .env_remove("HVD_CACHES")
        .env_remove("HVD_TRUSTED_KEYS")
        .output()
        .unwrap()
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).trim().to_string(),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

impl Pushed {
    fn new() -> Pushed {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let files = root.join("files");
        std::fs::create_dir(&files).unwrap();
        common::make_fixtures(common::GREET_AND_NOISY, &files);
        let base = common::serve_files(files.clone());
        let python = common::python_version();
        std::fs::create_dir_all(root.join("app")).unwrap();
        let file = root.join("app/train.hvd");
        std::fs::write(
            &file,
            format!(
                "project \"app\"\nenv {{\n  python = \"{python}\"\n  packages = [\"greet==1.0\", {{ requirement = \
                 \"noisy==1.0\", build = {{ requires = [], against = [] }} }}]\n}}\n"
            ),
        )
        .unwrap();
        let lock = |base: &str| {
            let package = |name: &str, filename: &str, deps: &[&str]| -> LockedPackage {
                let mut locked = common::locked_file(name, base, &files.join(filename), deps);
                locked.artifact.url = format!("{base}/{filename}");
                locked
            };
            let build = common::plain_build("noisy");
            common::lockfile(
                &file,
                &python,
                vec![
                    package("greet", "greet-1.0-py3-none-any.whl", &["helper"]),
                    package("helper", "helper-1.0-py3-none-any.whl", &[]),
                    package("noisy", "noisy-1.0.tar.gz", &[]),
                ],
                vec![build],
            )
            .write(&Lockfile::path_for(&file))
            .unwrap();
        };
        lock(&base);
        let store = root.join("store");
        let built = hvd(&root, &store, &["build", "app/train.hvd", "--locked"]);
        let (env, err) = text(&built);
        assert_eq!(built.status.code(), Some(0), "{err}");

        let keys = root.join("keys");
        let keygen = hvd(&root, &store, &["cache", "keygen", KEY, "--out", "keys"]);
        assert_eq!(keygen.status.code(), Some(0), "{}", text(&keygen).1);
        let secret = keys.join(format!("{KEY}.secret"));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the secret key is private");

        let cache = root.join("cache");
        let to = format!("file://{}", cache.display());
        let secret_arg = secret.display().to_string();
        let push = common::push_args("--locked", &to, &secret_arg);
        let pushed = hvd(&root, &store, &push);
        let (out, err) = text(&pushed);
        assert_eq!(pushed.status.code(), Some(0), "{err}");
        // The env, greet, helper, noisy, the worker runtime `hvd` and the interpreter.
        assert_eq!(out.lines().count(), 6, "{out}");
        assert!(err.contains("pushed 6 store path(s)"), "{err}");
        let again = hvd(&root, &store, &push);
        assert!(
            text(&again).1.contains("pushed 0 store path(s)")
                && text(&again).1.contains("6 already there"),
            "{}",
            text(&again).1
        );
        assert!(cache.join("hvd-cache-info").is_file());

        let first = root.join("first-store");
        std::fs::rename(&store, &first).unwrap();
        lock(&dead_url());
        Pushed {
            _dir: dir,
            root,
            store,
            first,
            cache,
            keys,
            env,
        }
    }

    fn cache_url(&self) -> String {
        format!("file://{}", self.cache.display())
    }

    fn public_key(&self) -> String {
        self.keys
            .join(format!("{KEY}.public"))
            .display()
            .to_string()
    }

    /// `hvd build` of the project into the (empty) store with `args` added.
    fn build(&self, args: &[&str]) -> Output {
        let mut all = vec!["build", "app/train.hvd", "--locked"];
        all.extend_from_slice(args);
        hvd(&self.root, &self.store, &all)
    }

    /// The name of the first store's path whose name contains `part`.
    fn path_name(&self, part: &str) -> String {
        std::fs::read_dir(&self.first)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .find(|n| n.contains(part) && !n.starts_with('.'))
            .unwrap_or_else(|| panic!("no store path with {part}"))
    }

    fn record(&self, name: &str) -> Record {
        Record::parse(&std::fs::read(self.cache.join(record_key(name))).unwrap()).unwrap()
    }

    fn write_record(&self, name: &str, record: &Record) {
        std::fs::write(self.cache.join(record_key(name)), record.to_bytes()).unwrap();
    }

    fn secret_key(&self) -> SecretKey {
        SecretKey::read(&self.keys.join(format!("{KEY}.secret"))).unwrap()
    }

    /// `hvd build` from the cache trusting `key` refuses `name` from the cache, saying `reason`, and leaves nothing
    /// of it.
    fn assert_refused(&self, key: &str, name: &str, reason: &str) {
        let out = self.build(&["--cache", &self.cache_url(), "--trusted-key", key]);
        let refusing = format!("refusing {name} from cache `{}`", self.cache_url());
        assert_says(&out, 1, &[&refusing, reason]);
        self.assert_nothing_of(name);
    }

    /// `out` is a build that printed the pushing store's env path, having substituted its 5 store paths from a
    /// cache: its stderr.
    fn assert_substituted_env(&self, out: &Output) -> String {
        let (env, err) = text(out);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert_eq!(env, self.env, "the same env path as the pushing store");
        assert!(err.contains("substituted 5 store path(s)"), "{err}");
        err
    }

    /// Nothing of a refused path: no store path for `name` (valid or not) and no temp debris.
    fn assert_nothing_of(&self, name: &str) {
        if self.store.exists() {
            assert!(
                !self.store.join(name).exists(),
                "{name} was installed although refused"
            );
            // `.tmp/archives/` holds partial downloads to resume: a refused path leaves none.
            let debris: Vec<_> = std::fs::read_dir(self.store.join(".tmp"))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .filter(|name| name != "archives")
                .chain(
                    std::fs::read_dir(self.store.join(".tmp/archives"))
                        .into_iter()
                        .flatten()
                        .map(|e| e.unwrap().file_name()),
                )
                .collect();
            assert!(debris.is_empty(), "temp debris left: {debris:?}");
        }
    }
}

fn assert_says(output: &Output, code: i32, parts: &[&str]) {
    let err = common::unwrapped(&text(output).1);
    assert_eq!(output.status.code(), Some(code), "{err}");
    for part in parts {
        assert!(
            err.contains(&common::unwrapped(part)),
            "no `{part}` in: {err}"
        );
    }
}

#[test]
fn an_empty_store_builds_the_env_purely_from_the_cache_with_the_index_unreachable() {
    let p = Pushed::new();
    let key = p.public_key();
    let out = p.build(&["--cache", &p.cache_url(), "--trusted-key", &key]);
    let err = p.assert_substituted_env(&out);
    assert!(!err.contains("building noisy"), "{err}");
    // The source build was substituted, not rebuilt: its random stamp is the pushed one.
    let noisy = p.path_name("-noisy-1.0");
    let stamp = |store: &Path| {
        std::fs::read_to_string(store.join(&noisy).join("site-packages/noisy.py")).unwrap()
    };
    assert_eq!(stamp(&p.store), stamp(&p.first));
    // Every path is complete and verified like a built one: same content hash as the pushed one.
    let mut paths = 0;
    for entry in std::fs::read_dir(&p.store).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        paths += 1;
        let info = |store: &Path| -> serde_json::Value {
            serde_json::from_str(
                &std::fs::read_to_string(store.join(&name).join(".hvd-path.json")).unwrap(),
            )
            .unwrap()
        };
        assert_eq!(info(&p.store), info(&p.first), "{name}");
    }
    assert_eq!(
        paths, 6,
        "the env's closure (its interpreter included) and nothing else (no build env)"
    );
    let run = hvd(
        &p.root,
        &p.store,
        &["exec", "app/train.hvd", "--locked", "--", "greet"],
    );
    assert_eq!(text(&run).0, "hello from greet", "{}", text(&run).1);
    let python = hvd(
        &p.root,
        &p.store,
        &common::exec_locked_python("app/train.hvd", "import noisy, helper; print(helper.WORD)"),
    );
    assert_eq!(text(&python).0, "hello", "{}", text(&python).1);
}

#[test]
fn a_node_pulls_the_env_by_name_without_project_lock_or_index() {
    let p = Pushed::new();
    let key = p.public_key();
    let cache = p.cache_url();
    let name = Path::new(&p.env)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    // A node has only hvd, the store directory and the cache: no project file, lock or index.
    let node = tempfile::tempdir().unwrap();
    let pull = |what: &str| {
        hvd(
            node.path(),
            &p.store,
            &[
                "cache",
                "pull",
                what,
                "--cache",
                &cache,
                "--trusted-key",
                &key,
            ],
        )
    };
    let out = pull(&name);
    let (stdout, err) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(stdout, p.env, "prints the store path");
    let greet = std::process::Command::new(p.store.join(&name).join("bin/greet"))
        .output()
        .unwrap();
    assert_eq!(text(&greet).0, "hello from greet", "{}", text(&greet).1);
    // Valid already: nothing to do; the full path in this store is accepted too.
    let again = pull(&p.env);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again).1);
    // Names that are not store path names, paths of another store, and paths no cache has.
    for hostile in ["..", "x", &format!("{name}\n")] {
        assert_says(&pull(hostile), 2, &["not a store path name"]);
    }
    for escaping in ["../../etc", "0123456789abcdef0123456789abcdef-x/../../y"] {
        assert_says(&pull(escaping), 2, &["is not a path in this store"]);
    }
    assert_says(
        &pull(&format!("/elsewhere/{name}")),
        2,
        &["is not a path in this store"],
    );
    assert_says(
        &pull("0123456789abcdef0123456789abcdef-absent-1.0"),
        1,
        &["0123456789abcdef0123456789abcdef-absent-1.0 is in none of the caches"],
    );
    p.assert_nothing_of("0123456789abcdef0123456789abcdef-absent-1.0");
}

/// `hvd gc` during `hvd cache pull`: the pull holds the store's builders lock (shared) as a build does, so gc
/// (exclusive) waits, and never deletes a reference the pull installed before the path that needs it. The cache
/// holds back the env's archive (the last path installed: every reference is in place by then) until the test has
/// checked the lock and started a real `hvd gc`.
#[test]
fn gc_waits_for_a_pull_and_never_leaves_a_pulled_path_without_its_references() {
    let p = Pushed::new();
    let name = Path::new(&p.env)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let record = p.record(&name);
    let (base, requested, release) = held_back_cache(
        p.cache.clone(),
        format!("/{}", archive_key(&record.archive.sha256)),
    );
    let node = tempfile::tempdir().unwrap();
    let key = p.public_key();
    let pull = common::hvd_with_store(
        node.path(),
        &p.store,
        &[
            "cache",
            "pull",
            &name,
            "--cache",
            &base,
            "--trusted-key",
            &key,
        ],
    )
    .env_remove("HVD_CACHES")
    .env_remove("HVD_TRUSTED_KEYS")
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    requested
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the pull asks for the env's archive");
    let references: Vec<&String> = record.references.iter().filter(|r| **r != name).collect();
    assert!(!references.is_empty());
    for reference in &references {
        assert!(
            p.store.join(reference).exists(),
            "{reference} installed first"
        );
    }
    // gc's lock cannot be taken while the pull runs (flock(1), a real process, as gc would take it).
    let gc_lock = p.store.join(".locks/gc.lock");
    let probe = std::process::Command::new("flock")
        .args(["--exclusive", "--nonblock"])
        .arg(&gc_lock)
        .arg("true")
        .output()
        .unwrap();
    assert_eq!(
        probe.status.code(),
        Some(1),
        "gc could take its lock during a pull: {}",
        text(&probe).1
    );
    let gc = common::hvd_with_store(node.path(), &p.store, &["gc"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    release.send(()).unwrap();
    let pulled = pull.wait_with_output().unwrap();
    assert_eq!(pulled.status.code(), Some(0), "{}", text(&pulled).1);
    assert_eq!(text(&pulled).0, p.env);
    let collected = gc.wait_with_output().unwrap();
    assert_eq!(collected.status.code(), Some(0), "{}", text(&collected).1);
    // Nothing roots the pulled env, so gc (after the pull) may remove it, but never a part of it alone.
    if p.store.join(&name).exists() {
        for reference in &references {
            assert!(
                p.store.join(reference).exists(),
                "gc left {name} without {reference}"
            );
        }
    }
}

/// An HTTP cache serving `root` that holds back the download (`GET`; a `HEAD` is answered) of `held` (a URL path):
/// it reports the request on the returned receiver and answers it once the test sends on the returned sender.
fn held_back_cache(
    root: PathBuf,
    held: String,
) -> (
    String,
    std::sync::mpsc::Receiver<()>,
    std::sync::mpsc::Sender<()>,
) {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (requested_tx, requested) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = std::sync::Arc::new(std::sync::Mutex::new(release_rx));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let (root, held) = (root.clone(), held.clone());
            let (requested_tx, release_rx) = (requested_tx.clone(), release_rx.clone());
            std::thread::spawn(move || {
                let request = common::read_request(&stream);
                let path = request.split_whitespace().nth(1).unwrap_or("/").to_owned();
                if path == held && request.starts_with("GET ") {
                    let _ = requested_tx.send(());
                    let _ = release_rx.lock().unwrap().recv();
                }
                let response = common::file_response(&root, &path);
                let _ = stream.write_all(&response);
            });
        }
    });
    (base, requested, release)
}

#[test]
fn a_cache_over_http_and_from_the_environment_substitutes_the_same() {
    let p = Pushed::new();
    let base = common::serve_files(p.cache.clone());
    let trusted = std::fs::read_to_string(p.public_key()).unwrap();
    // `--offline` asks no HTTP cache: the build then needs the (unreachable) index, and says so.
    let offline = common::hvd_with_store(
        &p.root,
        &p.store,
        &["build", "app/train.hvd", "--locked", "--offline"],
    )
    .env("HVD_CACHES", &base)
    .env("HVD_TRUSTED_KEYS", trusted.trim())
    .output()
    .unwrap();
    assert_says(&offline, 1, &["`--offline` forbids the network"]);
    assert!(!text(&offline).1.contains("substituted"));
    let out = common::hvd_with_store(&p.root, &p.store, &["build", "app/train.hvd", "--locked"])
        .env(
            "HVD_CACHES",
            format!("file://{} {base}", p.root.join("no-cache").display()),
        )
        .env("HVD_TRUSTED_KEYS", trusted.trim())
        .output()
        .unwrap();
    // The first cache does not exist: a warning, then the HTTP one serves everything.
    let err = p.assert_substituted_env(&out);
    assert!(
        err.contains("is not usable: it has no `hvd-cache-info`"),
        "{err}"
    );

    // A cache that answers `hvd-cache-info` and then trickles every record (a byte each 300 ms, well inside any
    // read timeout): with HVD_HTTP_TIMEOUT=2 the record fetch stops, the cache is named, and the build goes on
    // (to the unreachable index here) instead of hanging.
    let stalling = trickling_cache(std::fs::read(p.cache.join("hvd-cache-info")).unwrap());
    std::fs::rename(&p.store, p.root.join("second-store")).unwrap();
    let out = common::hvd_with_store(&p.root, &p.store, &["build", "app/train.hvd", "--locked"])
        .env("HVD_CACHES", &stalling)
        .env("HVD_TRUSTED_KEYS", trusted.trim())
        .env("HVD_HTTP_TIMEOUT", "2")
        .output()
        .unwrap();
    assert_says(
        &out,
        1,
        &[
            &format!("cache `{stalling}`"),
            "took too long",
            "HVD_HTTP_TIMEOUT",
        ],
    );
}

/// An HTTP cache that serves `info` as `hvd-cache-info` and answers every other request with headers promising
/// 1000 bytes, then one byte each 300 ms.
fn trickling_cache(info: Vec<u8>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let info = info.clone();
            std::thread::spawn(move || {
                let mut request = Vec::new();
                let mut byte = [0u8; 1];
                while !request.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                    request.push(byte[0]);
                }
                let line = String::from_utf8_lossy(&request)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                if line.contains("/hvd-cache-info ") {
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        info.len()
                    );
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(&info);
                    return;
                }
                let _ = stream.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n",
                );
                for _ in 0..1000 {
                    if stream.write_all(b"x").is_err() {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
            });
        }
    });
    base
}

#[test]
fn untrusted_and_wrongly_signed_records_are_refused_naming_path_and_cache() {
    let p = Pushed::new();
    let env_name = Path::new(&p.env)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    // A key of another name: no signature the user trusts; warned, then the build has to build (and cannot).
    let other = hvd(
        &p.root,
        &p.store,
        &["cache", "keygen", "other", "--out", "other"],
    );
    assert_eq!(other.status.code(), Some(0));
    let other_key = p.root.join("other/other.public").display().to_string();
    let out = p.build(&["--cache", &p.cache_url(), "--trusted-key", &other_key]);
    assert_says(
        &out,
        1,
        &[
            &format!(
                "{env_name} in cache `{}` is not signed by a trusted key",
                p.cache_url()
            ),
            "signed by: test-cache-1",
        ],
    );
    p.assert_nothing_of(&env_name);

    // Another key under the trusted name: the signature does not verify, which is an error.
    let impostor = SecretKey::generate(KEY).unwrap().public().to_text();
    p.assert_refused(
        &impostor,
        &env_name,
        "trusted key `test-cache-1` does not verify",
    );

    // A cache but no trusted key at all is a usage error.
    let out = p.build(&["--cache", &p.cache_url()]);
    assert_says(&out, 2, &["no trusted key"]);
}

#[test]
fn tampered_archives_and_records_are_refused_and_leave_nothing() {
    let p = Pushed::new();
    let key = p.public_key();
    let helper = p.path_name("-helper-1.0");
    let record = p.record(&helper);
    let archive_path = p.cache.join(archive_key(&record.archive.sha256));
    let original = std::fs::read(&archive_path).unwrap();

    // One flipped byte in the archive.
    let mut flipped = original.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x20;
    std::fs::write(&archive_path, &flipped).unwrap();
    p.assert_refused(
        &key,
        &helper,
        &format!("the signed record says {}", record.archive.sha256),
    );
    std::fs::write(&archive_path, &original).unwrap();

    // A record whose content hash or references changed without a new signature.
    let mut changed = record.clone();
    changed.content_hash = hvd_builder::Sha256::of_bytes(b"other tree");
    p.write_record(&helper, &changed);
    p.assert_refused(&key, &helper, "does not verify");
    let mut changed = record.clone();
    changed.references.insert(p.path_name("-greet-1.0"));
    p.write_record(&helper, &changed);
    p.assert_refused(&key, &helper, "does not verify");

    // Even the key's holder cannot make a store path differ from its content hash: a repacked archive with a
    // changed file, correctly described and signed, is refused after unpacking.
    let evil_tree = p.root.join("evil");
    let copy = std::process::Command::new("cp")
        .args(["-a"])
        .arg(p.first.join(&helper))
        .arg(&evil_tree)
        .status()
        .unwrap();
    assert!(copy.success());
    let module = evil_tree.join("site-packages/helper.py");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&evil_tree, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(
        evil_tree.join("site-packages"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::fs::remove_file(&module).unwrap();
    std::fs::write(&module, "WORD = 'owned'\n").unwrap();
    let evil_archive = p.root.join("evil.tar.zst");
    let info = archive::pack(&evil_tree, &evil_archive).unwrap();
    std::fs::copy(&evil_archive, p.cache.join(archive_key(&info.sha256))).unwrap();
    let mut evil = record.clone();
    evil.archive = info;
    evil.signatures.clear();
    evil.sign(&p.secret_key());
    p.write_record(&helper, &evil);
    p.assert_refused(
        &key,
        &helper,
        &format!("the signed record says {}", record.content_hash),
    );

    // Restored, the same cache serves the build.
    p.write_record(&helper, &record);
    let out = p.build(&["--cache", &p.cache_url(), "--trusted-key", &key]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
}

#[test]
fn a_record_naming_another_or_an_escaping_path_is_refused_even_when_signed() {
    let p = Pushed::new();
    let key = p.public_key();
    let helper = p.path_name("-helper-1.0");
    let record = p.record(&helper);
    let secret = p.secret_key();

    let mut escaping = record.clone();
    escaping.name = "../x".into();
    escaping.sign(&secret);
    p.write_record(&helper, &escaping);
    p.assert_refused(
        &key,
        &helper,
        "`../x` does not start with a 32-digit derivation hash",
    );
    assert!(!p.root.join("x").exists() && !p.store.with_file_name("x").exists());

    let mut escaping = record.clone();
    escaping.references.insert("../../etc".into());
    escaping.sign(&secret);
    p.write_record(&helper, &escaping);
    p.assert_refused(&key, &helper, "its reference `../../etc`");

    // A record signed for another store directory (a cache relabeled by whoever can write it): refused, named.
    let mut elsewhere = record.clone();
    elsewhere.store = "/elsewhere/store".into();
    elsewhere.signatures.clear();
    elsewhere.sign(&secret);
    p.write_record(&helper, &elsewhere);
    p.assert_refused(
        &key,
        &helper,
        "it was built for the store `/elsewhere/store`",
    );

    // A signed cycle (helper now references the env, which references helper): each record is fetched once, the
    // cycle is named, and nothing is installed.
    let env_name = Path::new(&p.env)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut cycle = record.clone();
    cycle.references.insert(env_name.clone());
    cycle.signatures.clear();
    cycle.sign(&secret);
    p.write_record(&helper, &cycle);
    let out = p.build(&["--cache", &p.cache_url(), "--trusted-key", &key]);
    assert_says(
        &out,
        1,
        &[&format!(
            "the references of {env_name} in the caches form a cycle"
        )],
    );
    p.assert_nothing_of(&helper);
    p.assert_nothing_of(&env_name);
}

#[test]
fn a_pruned_archive_or_a_garbage_record_is_built_instead_and_repaired_by_the_next_push() {
    let p = Pushed::new();
    let key = p.public_key();
    let helper = p.path_name("-helper-1.0");
    let greet = p.path_name("-greet-1.0");
    let archive = p.cache.join(archive_key(&p.record(&helper).archive.sha256));
    std::fs::remove_file(&archive).unwrap();

    // The missing archive withholds helper like a missing record (a warning, the next cache is asked, then it has
    // to be built: the index is unreachable here).
    let out = p.build(&["--cache", &p.cache_url(), "--trusted-key", &key]);
    let err = common::unwrapped(&text(&out).1);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&common::unwrapped(&format!(
            "{helper} in cache `{}` has a record but not its archive; asking the next cache",
            p.cache_url()
        ))),
        "{err}"
    );
    p.assert_nothing_of(&helper);

    // A garbage record and the pruned archive: a push from the original store rewrites both instead of skipping them because some record exists.
    std::fs::write(p.cache.join(record_key(&greet)), "garbage").unwrap();
    std::fs::remove_dir_all(&p.store).unwrap();
    std::fs::rename(&p.first, &p.store).unwrap();
    let secret = p.keys.join(format!("{KEY}.secret")).display().to_string();
    let to = p.cache_url();
    let push = hvd(
        &p.root,
        &p.store,
        &common::push_args("--locked", &to, &secret),
    );
    let (out, err) = text(&push);
    assert_eq!(push.status.code(), Some(0), "{err}");
    assert!(err.contains("pushed 2 store path(s)"), "{err}");
    assert!(out.contains(&helper) && out.contains(&greet), "{out}");
    assert!(archive.is_file());
    std::fs::rename(&p.store, &p.first).unwrap();
    let out = p.build(&["--cache", &p.cache_url(), "--trusted-key", &key]);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("substituted 5 store path(s)"), "{err}");
}

const BUCKET: &str = "hvd-cache";

/// Points `command` at `s3` with its identity, and at no cache or trusted key from this machine's environment.
fn s3_env(s3: &common::s3::S3Server, command: &mut std::process::Command) {
    command
        .envs(s3.env())
        .env_remove("AWS_ENDPOINT_URL")
        .env_remove("HVD_CACHES")
        .env_remove("HVD_TRUSTED_KEYS");
}

#[test]
fn an_s3_cache_takes_a_push_and_substitutes_into_an_empty_store() {
    let p = Pushed::new();
    let s3 = common::s3::S3Server::start(BUCKET);
    let url = format!("s3://{BUCKET}/team/cache");
    // Push from the first store (moved back for this), then substitute into an empty one.
    std::fs::rename(&p.first, &p.store).unwrap();
    let secret = p.keys.join(format!("{KEY}.secret")).display().to_string();
    let mut push = common::hvd_with_store(
        &p.root,
        &p.store,
        &common::push_args("--frozen", &url, &secret),
    );
    s3_env(&s3, &mut push);
    let pushed = push.output().unwrap();
    assert_eq!(pushed.status.code(), Some(0), "{}", text(&pushed).1);
    assert!(
        text(&pushed).1.contains("pushed 6 store path(s)"),
        "{}",
        text(&pushed).1
    );
    std::fs::rename(&p.store, &p.first).unwrap();

    // `hvd build` from the S3 cache trusting `trusted`.
    let build = |trusted: &str| {
        let mut command = common::hvd_with_store(
            &p.root,
            &p.store,
            &[
                "build",
                "app/train.hvd",
                "--locked",
                "--cache",
                &url,
                "--trusted-key",
                trusted,
            ],
        );
        s3_env(&s3, &mut command);
        command
    };
    // The wrong key first: refused, nothing installed.
    let stranger = SecretKey::generate("stranger").unwrap().public().to_text();
    let refused = build(&stranger).output().unwrap();
    let env_name = Path::new(&p.env)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert_says(
        &refused,
        1,
        &[&format!(
            "{env_name} in cache `{url}` is not signed by a trusted key"
        )],
    );
    p.assert_nothing_of(&env_name);

    // Every archive has a partial download of other bytes in the store: each is resumed with a ranged GET (which
    // S3 answers from the offset asked), fails the full hash, is discarded and read whole.
    let partials = p.store.join(".tmp/archives");
    std::fs::create_dir_all(&partials).unwrap();
    let mut planted = 0;
    for record in std::fs::read_dir(&p.cache).unwrap() {
        let record = record.unwrap().path();
        if record.extension().is_none_or(|e| e != "info") {
            continue;
        }
        let record: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
        if p.store.join(record["name"].as_str().unwrap()).exists() {
            continue; // not substituted (the interpreter, copied from this machine by the refused build)
        }
        let sha256 = record["archive"]["sha256"].as_str().unwrap();
        let archive = p.cache.join(format!("archives/{sha256}.tar.zst"));
        let bytes = std::fs::read(&archive).unwrap();
        let other: Vec<u8> = bytes[..bytes.len() / 2].iter().map(|b| !b).collect();
        std::fs::write(partials.join(format!("{sha256}.part")), other).unwrap();
        planted += 1;
    }
    assert_eq!(planted, 5);
    let out = build(&p.public_key())
        .env("HVD_LOG", "hvd_builder=info")
        .output()
        .unwrap();
    let err = p.assert_substituted_env(&out);
    assert!(
        err.contains("the resumed archive is not the one its record names; reading it whole"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&partials).unwrap().count(), 0);
    let run = hvd(
        &p.root,
        &p.store,
        &["exec", "app/train.hvd", "--locked", "--", "greet"],
    );
    assert_eq!(text(&run).0, "hello from greet", "{}", text(&run).1);
}

#[test]
fn the_files_cluster_caches_feed_the_same_list_and_bad_ones_are_diagnosed() {
    let p = Pushed::new();
    let file = p.root.join("app/train.hvd");
    let original = std::fs::read_to_string(&file).unwrap();
    let with = |cluster: &str| std::fs::write(&file, format!("{original}{cluster}\n")).unwrap();

    // A misspelled field and a string that is no cache URL: the language's own diagnostics.
    with("cluster {\n  cache = [\"s3://bucket\"]\n}");
    let check = hvd(&p.root, &p.store, &["check", "app/train.hvd"]);
    assert_says(&check, 2, &["cache", "caches"]);
    with("cluster {\n  caches = [\"bucket/prefix\"]\n}");
    let check = hvd(&p.root, &p.store, &["check", "app/train.hvd"]);
    assert_says(
        &check,
        2,
        &["`bucket/prefix` is not a cache URL", "s3://bucket/prefix"],
    );

    with(&format!(
        "cluster {{\n  caches = [\"{}\"]\n}}",
        p.cache_url()
    ));
    // The file's caches without any trusted key: a warning and no substitution (here the build then needs the
    // unreachable index), not a usage error.
    let out = p.build(&[]);
    assert_says(
        &out,
        1,
        &["not using the caches of the file's", "no trusted key"],
    );
    // The file names the cache, the command line only the key: substituted, nothing built or downloaded.
    let out = p.build(&["--trusted-key", &p.public_key()]);
    p.assert_substituted_env(&out);

    // A hostile file (say, from a pull request) naming its own cache: `hvd cache push` without `--to` refuses
    // and writes nothing there, even with the store built and a key at hand.
    let elsewhere = p.root.join("attacker-cache");
    with(&format!(
        "cluster {{\n  caches = [\"file://{}\"]\n}}",
        elsewhere.display()
    ));
    let secret = p.keys.join(format!("{KEY}.secret")).display().to_string();
    let push = hvd(
        &p.root,
        &p.store,
        &[
            "cache",
            "push",
            "app/train.hvd",
            "--locked",
            "--key",
            &secret,
        ],
    );
    assert_says(&push, 2, &["--to", "never a push destination"]);
    assert!(!elsewhere.exists(), "the push wrote into the file's cache");
}
