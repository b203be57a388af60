//! A gcc the host lacks, from a Debian archive: pinned from a suite's `Packages` index, fetched and checked,
//! unpacked and wrapped into the store. The default tests serve a fixture archive (an `InRelease`, a
//! `Packages.gz` and `.deb`s made here, with a shell script as `gcc-99`) over real HTTP on 127.0.0.1 and act as
//! the attacker too; the ignored `real_gcc_from_the_configured_archive` (`--run-ignored only`) takes a real gcc
//! from the machine's configured archive (downloads about 60 MB) and compiles and runs C and C++ with it.

#[allow(dead_code)] // each test binary uses part of the shared fixtures
mod common;

use std::io::Write;
use std::path::Path;

use common::FileServer;
use hvd_builder::lockfile::toolchain_from_pin;
use hvd_builder::{Error, Sha256, Store, Toolchain};
use hvd_resolver::debian::{Archives, DebianError, pin_gcc};
use hvd_resolver::lockfile::ToolchainPin;
use hvd_resolver::testing::debian::Signer;

/// One entry of a fixture package's data tar.
enum Entry<'a> {
    Dir(&'a str),
    File(&'a str, &'a [u8], u32),
    Symlink(&'a str, &'a str),
    /// A name written raw into the header (the tar crate refuses `..` through its safe API).
    RawFile(&'a str),
    CharDevice(&'a str),
}

fn data_tar(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_mtime(0);
        match entry {
            Entry::Dir(path) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o755);
                header.set_size(0);
                builder
                    .append_data(&mut header, path, std::io::empty())
                    .unwrap();
            }
            Entry::File(path, body, mode) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(*mode);
                header.set_size(body.len() as u64);
                builder.append_data(&mut header, path, *body).unwrap();
            }
            Entry::Symlink(path, target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_mode(0o777);
                header.set_size(0);
                builder.append_link(&mut header, path, target).unwrap();
            }
            Entry::RawFile(path) | Entry::CharDevice(path) => {
                let device = matches!(entry, Entry::CharDevice(_));
                header.set_entry_type(if device {
                    tar::EntryType::Char
                } else {
                    tar::EntryType::Regular
                });
                header.set_mode(0o644);
                header.set_size(if device { 0 } else { 2 });
                let name = &mut header.as_gnu_mut().unwrap().name;
                name[..path.len()].copy_from_slice(path.as_bytes());
                header.set_cksum();
                let body: &[u8] = if device { b"" } else { b"x\n" };
                builder.append(&header, body).unwrap();
            }
        }
    }
    builder.into_inner().unwrap()
}

/// A `.deb`: an `ar` archive of `debian-binary`, a control tar and the data tar compressed as `compression`.
fn make_deb(entries: &[Entry<'_>], compression: &str) -> Vec<u8> {
    let tar = data_tar(entries);
    let data = match compression {
        "xz" => {
            let mut out = Vec::new();
            lzma_rs::xz_compress(&mut tar.as_slice(), &mut out).unwrap();
            out
        }
        "gz" => {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder.write_all(&tar).unwrap();
            encoder.finish().unwrap()
        }
        "zst" => zstd::encode_all(tar.as_slice(), 1).unwrap(),
        _ => tar,
    };
    let data_name = if compression.is_empty() {
        "data.tar".to_string()
    } else {
        format!("data.tar.{compression}")
    };
    let mut out = b"!<arch>\n".to_vec();
    for (name, body) in [
        ("debian-binary", b"2.0\n".to_vec()),
        ("control.tar.gz", Vec::new()),
        (data_name.as_str(), data),
    ] {
        out.extend(
            format!(
                "{:<16}{:<12}{:<6}{:<6}{:<8}{:<10}`\n",
                name,
                0,
                0,
                0,
                100644,
                body.len()
            )
            .as_bytes(),
        );
        out.extend(&body);
        if body.len() % 2 == 1 {
            out.push(b'\n');
        }
    }
    out
}

/// The fake compiler: prints its version, or its arguments and library path.
const FAKE_GCC: &[u8] = b"#!/bin/sh\ncase \"$*\" in *-dumpfullversion) echo 99.1.0; exit 0;; esac\necho \"args: $*\"\necho \"libs: $LD_LIBRARY_PATH\"\n";

/// A fixture archive: `dists/<suite>/{InRelease,main/binary-amd64/Packages.gz}` and the packages under `pool/`,
/// its `InRelease` signed by a key of its own.
struct Archive {
    _dir: tempfile::TempDir,
    server: FileServer,
    stanzas: String,
    signer: Signer,
}

impl Archive {
    fn new() -> Archive {
        let dir = tempfile::tempdir().unwrap();
        let server = FileServer::start(dir.path());
        Archive {
            _dir: dir,
            server,
            stanzas: String::new(),
            signer: Signer::new(),
        }
    }

    fn root(&self) -> &Path {
        &self.server.root
    }

    /// Add a package whose file is `deb` (listed with `filename`, or its pool path).
    fn add(
        &mut self,
        name: &str,
        version: &str,
        depends: &str,
        deb: &[u8],
        filename: Option<&str>,
    ) {
        let pool = format!("pool/main/{name}_{version}_amd64.deb");
        let path = self.root().join(&pool);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, deb).unwrap();
        self.stanzas.push_str(&format!(
            "Package: {name}\nVersion: {version}\nArchitecture: amd64\nDepends: {depends}\n\
             Filename: {}\nSize: {}\nSHA256: {}\nDescription: fixture\n more text\n\n",
            filename.unwrap_or(&pool),
            deb.len(),
            Sha256::of_bytes(deb)
        ));
    }

    /// Write the suite's index and release file; `listed` overrides the sha256 InRelease gives for the index.
    fn publish(&self, suite: &str, listed: Option<&str>) {
        let dists = self.root().join("dists").join(suite);
        std::fs::create_dir_all(dists.join("main/binary-amd64")).unwrap();
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(self.stanzas.as_bytes()).unwrap();
        let gz = encoder.finish().unwrap();
        std::fs::write(dists.join("main/binary-amd64/Packages.gz"), &gz).unwrap();
        let sha = listed
            .map(str::to_string)
            .unwrap_or_else(|| Sha256::of_bytes(&gz).to_string());
        std::fs::write(
            dists.join("InRelease"),
            self.signer.clearsign(&format!(
                "Origin: Fixture\nSuite: {suite}\nSHA256:\n {sha} {} main/binary-amd64/Packages.gz\n",
                gz.len()
            )),
        )
        .unwrap();
    }

    fn archives(&self, suites: &[&str]) -> Archives {
        Archives {
            urls: vec![self.server.base.clone()],
            suites: suites.iter().map(|s| s.to_string()).collect(),
            keyrings: [(self.server.base.clone(), self.signer.keyring.clone())].into(),
        }
    }
}

/// The fixture gcc 99: compiler, C++ driver, glibc's package, a library cc1 would load, and libgcc's link.
fn gcc_archive() -> Archive {
    let mut archive = Archive::new();
    let gcc = make_deb(
        &[
            Entry::Dir("./"),
            Entry::Dir("./usr/"),
            Entry::Dir("./usr/bin/"),
            Entry::File("./usr/bin/gcc-99", FAKE_GCC, 0o755),
            Entry::Dir("./usr/lib/"),
            Entry::Dir("./usr/lib/gcc/x86_64-linux-gnu/99/"),
            // Debian makes links across top-level folders absolute: they must name the toolchain's own file.
            Entry::Symlink(
                "./usr/lib/gcc/x86_64-linux-gnu/99/libgcc_s.so",
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
            ),
        ],
        "xz",
    );
    archive.add(
        "gcc-99",
        "99.1.0-1",
        "libisl23 (>= 0.15), libc6 (>= 2.14), libgcc-s1",
        &gcc,
        None,
    );
    let gxx = make_deb(
        &[
            Entry::Dir("./usr/bin/"),
            Entry::File("./usr/bin/g++-99", FAKE_GCC, 0o755),
        ],
        "zst",
    );
    archive.add("g++-99", "99.1.0-1", "gcc-99 (= 99.1.0-1)", &gxx, None);
    let isl = make_deb(
        &[
            Entry::Dir("./usr/lib/x86_64-linux-gnu/"),
            Entry::File("./usr/lib/x86_64-linux-gnu/libisl.so.23.0.0", b"isl", 0o644),
            Entry::Symlink(
                "./usr/lib/x86_64-linux-gnu/libisl.so.23",
                "libisl.so.23.0.0",
            ),
        ],
        "gz",
    );
    archive.add("libisl23", "0.23-1", "libc6 (>= 2.14)", &isl, None);
    let libgcc = make_deb(
        &[
            Entry::Dir("./lib/x86_64-linux-gnu/"),
            Entry::File("./lib/x86_64-linux-gnu/libgcc_s.so.1", b"gcc_s", 0o644),
        ],
        "",
    );
    archive.add("libgcc-s1", "99.1.0-1", "libc6", &libgcc, None);
    let libc = make_deb(
        &[
            Entry::Dir("./lib/x86_64-linux-gnu/"),
            Entry::File("./lib/x86_64-linux-gnu/libc.so.6", b"libc", 0o755),
        ],
        "xz",
    );
    archive.add("libc6", "2.17-1", "libgcc-s1", &libc, None);
    let libc_dev = make_deb(
        &[
            Entry::Dir("./usr/include/"),
            Entry::File("./usr/include/stdio.h", b"/* stdio */\n", 0o644),
        ],
        "gz",
    );
    archive.add(
        "libc6-dev",
        "2.17-1",
        "libc6 (= 2.17-1), libc-dev-bin (= 2.17-1)",
        &libc_dev,
        None,
    );
    archive
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn pin(archive: &Archive, suites: &[&str], cache: &Path) -> Result<ToolchainPin, DebianError> {
    runtime().block_on(pin_gcc(
        "99",
        &archive.archives(suites),
        Some((2, 36)),
        cache,
        false,
    ))
}

#[test]
fn fixture_gcc_is_pinned_fetched_unpacked_and_wrapped() {
    let archive = gcc_archive();
    archive.publish("fixture", None);
    let cache = tempfile::tempdir().unwrap();
    // A suite the archive lacks is skipped; the first suite with gcc-99 is pinned.
    let pin = pin(&archive, &["nosuch", "fixture"], cache.path()).unwrap();
    let debian = pin.debian.clone().unwrap();
    assert_eq!(
        (debian.suite.as_str(), debian.version.as_str()),
        ("fixture", "99.1.0")
    );
    let names: Vec<&str> = pin.debs.iter().map(|d| d.name.as_str()).collect();
    // libc-dev-bin is not followed; every other dependency is.
    assert_eq!(
        names,
        [
            "g++-99",
            "gcc-99",
            "libc6",
            "libc6-dev",
            "libgcc-s1",
            "libisl23"
        ]
    );

    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path().join("store")).unwrap();
    let toolchain = toolchain_from_pin(&pin);
    let built = Toolchain::for_build(&store, Some(&toolchain), false, true).unwrap();
    let gcc = built.path.clone().unwrap();
    let top = gcc.parent().unwrap().parent().unwrap().to_path_buf();
    assert!(top.starts_with(store.root()), "{}", gcc.display());
    assert!(
        built.identity().contains("gcc 99.1.0 debian fixture"),
        "{}",
        built.identity()
    );

    // The wrapper runs the packaged driver with the sysroot, -B and the compiler's libraries.
    let out = std::process::Command::new(&gcc)
        .args(["-c", "x.c"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let root = top.join("root");
    assert!(
        text.contains(&format!(
            "--sysroot={} -B {}/usr/bin/ -c x.c",
            root.display(),
            root.display()
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("libs: {}/run-libs", top.display())),
        "{text}"
    );
    let version = std::process::Command::new(top.join("bin/g++"))
        .arg("-dumpfullversion")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&version.stdout).trim(), "99.1.0");

    // run-libs has the compiler's libraries but not glibc's.
    let run_libs: Vec<String> = std::fs::read_dir(top.join("run-libs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        run_libs.contains(&"libisl.so.23".to_string()),
        "{run_libs:?}"
    );
    assert!(
        run_libs.contains(&"libgcc_s.so.1".to_string()),
        "{run_libs:?}"
    );
    assert!(!run_libs.contains(&"libc.so.6".to_string()), "{run_libs:?}");
    assert_eq!(
        std::fs::read(top.join("run-libs/libisl.so.23")).unwrap(),
        b"isl"
    );

    // The absolute link was re-rooted: it reads the toolchain's libgcc_s, inside the store path.
    let link = root.join("usr/lib/gcc/x86_64-linux-gnu/99/libgcc_s.so");
    assert!(!std::fs::read_link(&link).unwrap().is_absolute());
    assert!(std::fs::canonicalize(&link).unwrap().starts_with(&top));
    assert_eq!(std::fs::read(&link).unwrap(), b"gcc_s");

    // Realizing again reuses the path.
    let again = Toolchain::for_build(&store, Some(&toolchain), false, true).unwrap();
    assert_eq!(again.path, built.path);

    // The pin records this machine's Debian arch; a lock made on a machine of another arch is refused, naming both.
    assert_eq!(debian.arch.as_deref(), Some("amd64"));
    let mut other = pin.clone();
    other.debian.as_mut().unwrap().arch = Some("arm64".into());
    let err = Toolchain::for_build(&store, Some(&toolchain_from_pin(&other)), false, true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is for arm64, and this machine is amd64"),
        "{err}"
    );
}

#[test]
fn a_version_no_suite_has_names_what_each_has() {
    let archive = gcc_archive();
    archive.publish("fixture", None);
    let cache = tempfile::tempdir().unwrap();
    let err = runtime()
        .block_on(pin_gcc(
            "7",
            &archive.archives(&["fixture"]),
            Some((2, 36)),
            cache.path(),
            false,
        ))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("has `gcc-7`") && err.contains("fixture has gcc 99"),
        "{err}"
    );
    // The suite's glibc is newer than the host's: the compiler could not run here.
    let err = runtime()
        .block_on(pin_gcc(
            "99",
            &archive.archives(&["fixture"]),
            Some((2, 12)),
            cache.path(),
            false,
        ))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("needs glibc 2.17") && err.contains("has glibc 2.12"),
        "{err}"
    );
}

#[test]
fn hostile_index_is_refused() {
    // The index's sha256 is not the one InRelease lists.
    let archive = gcc_archive();
    archive.publish("fixture", Some(&"ab".repeat(32)));
    let cache = tempfile::tempdir().unwrap();
    let err = pin(&archive, &["fixture"], cache.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Packages.gz") && err.contains("InRelease lists"),
        "{err}"
    );

    // A Filename that climbs out of the archive never reaches a lock.
    let mut archive = gcc_archive();
    let deb = make_deb(&[Entry::File("./x", b"x", 0o644)], "gz");
    archive.stanzas = archive
        .stanzas
        .replace("Package: libisl23\n", "Package: libisl-old\n");
    archive.add(
        "libisl23",
        "0.24-1",
        "",
        &deb,
        Some("pool/../../../etc/shadow.deb"),
    );
    archive.publish("fixture", None);
    let err = pin(&archive, &["fixture"], cache.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("etc/shadow.deb") && err.contains("will not fetch"),
        "{err}"
    );
}

/// Pin the fixture gcc, then replace libisl23's file with what `replace` makes of it (its sha256 and size
/// relisted in the lock when `relist`); the store's directory lives as long as the returned guard.
fn build_with(
    replace: impl FnOnce(Vec<u8>) -> Vec<u8>,
    relist: bool,
) -> (tempfile::TempDir, Result<Toolchain, Error>) {
    let archive = gcc_archive();
    archive.publish("fixture", None);
    let cache = tempfile::tempdir().unwrap();
    let mut pin = pin(&archive, &["fixture"], cache.path()).unwrap();
    let isl = pin.debs.iter_mut().find(|d| d.name == "libisl23").unwrap();
    let file = archive.root().join(&isl.filename);
    let deb = replace(std::fs::read(&file).unwrap());
    std::fs::write(&file, &deb).unwrap();
    if relist {
        isl.sha256 = Sha256::of_bytes(&deb);
        isl.size = deb.len() as u64;
    }
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path().join("store")).unwrap();
    let result = Toolchain::for_build(&store, Some(&toolchain_from_pin(&pin)), false, true);
    if result.is_err() {
        // Nothing of a refused toolchain is left in the store.
        let left: Vec<_> = std::fs::read_dir(store.root())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("-gcc-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
    (store_dir, result)
}

#[test]
fn a_deb_that_is_not_the_locked_one_is_refused() {
    // Same size, one byte changed: only the sha256 tells.
    let (_store, result) = build_with(
        |mut deb| {
            let last = deb.len() - 1;
            deb[last] ^= 1;
            deb
        },
        false,
    );
    let err = result.unwrap_err();
    assert!(matches!(err, Error::HashMismatch { .. }), "{err}");
}

#[test]
fn hostile_debs_are_refused() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (make_deb(&[Entry::RawFile("./../../escape")], "gz"), "`..`"),
        (make_deb(&[Entry::RawFile("/etc/evil")], "xz"), "absolute"),
        (
            make_deb(
                &[Entry::Symlink("./usr/lib/out", "/../../../etc/passwd")],
                "gz",
            ),
            "/../../../etc/passwd",
        ),
        (
            make_deb(
                &[Entry::Symlink("./usr/lib/out", "../../../../etc/passwd")],
                "gz",
            ),
            "link",
        ),
        (make_deb(&[Entry::CharDevice("./dev/null")], "gz"), "Char"),
        // A file another package of the toolchain ships.
        (
            make_deb(
                &[Entry::File("./usr/bin/gcc-99", b"#!/bin/sh\n", 0o755)],
                "gz",
            ),
            "also shipped by `gcc-99`",
        ),
        (b"!<arch>\nnot a header".to_vec(), "not a Debian package"),
        (b"MZ".to_vec(), "not a Debian package"),
    ];
    for (deb, expect) in cases {
        let err = build_with(|_| deb, true).1.unwrap_err();
        let text = format!("{err}: {:?}", err);
        assert!(text.contains(expect), "expected `{expect}` in {text}");
    }
}

#[test]
fn the_size_and_entry_limits_hold_for_all_packages_together() {
    use hvd_builder::debian::deb::{Deb, unpack_debs_with};
    use hvd_builder::unpack::Limits;
    let dir = tempfile::tempdir().unwrap();
    let body = vec![b'x'; 12_000];
    let names = ["a", "b", "c"];
    let debs: Vec<Deb> = names
        .iter()
        .map(|name| {
            let path = dir.path().join(format!("{name}.deb"));
            let file = format!("./usr/share/{name}");
            std::fs::write(&path, make_deb(&[Entry::File(&file, &body, 0o644)], "gz")).unwrap();
            Deb {
                name: name.to_string(),
                path,
            }
        })
        .collect();
    let run = |limits: Limits| {
        let scratch = tempfile::tempdir().unwrap();
        let dest = dir.path().join(format!("out-{}", limits.max_entries));
        unpack_debs_with(&debs, scratch.path(), &dest, limits)
    };
    let limits = Limits {
        max_unpacked_bytes: 30_000,
        ..Limits::default()
    };
    // One package alone is far under the limit; two fit; three together are past it.
    let err = run(limits).unwrap_err().to_string();
    assert!(
        err.contains("limit of 30000 bytes for all packages"),
        "{err}"
    );
    unpack_debs_with(
        &debs[..2],
        tempfile::tempdir().unwrap().path(),
        &dir.path().join("two"),
        limits,
    )
    .unwrap();
    // An xz member whose block is larger than what is left is refused from its chunk headers, before lzma-rs
    // (which holds a block in memory) decodes it.
    let xz_path = dir.path().join("xz.deb");
    std::fs::write(
        &xz_path,
        make_deb(&[Entry::File("./usr/share/big", &body, 0o644)], "xz"),
    )
    .unwrap();
    let err = unpack_debs_with(
        &[Deb {
            name: "big".into(),
            path: xz_path,
        }],
        tempfile::tempdir().unwrap().path(),
        &dir.path().join("xz"),
        Limits {
            max_unpacked_bytes: 10_000,
            ..Limits::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("an xz block decompresses to"), "{err}");
    let err = run(Limits {
        max_entries: 2,
        ..Limits::default()
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("limit of 2 entries for all packages"), "{err}");
}

#[test]
fn an_absolute_link_to_the_host_stays_inside() {
    // `/etc/passwd` becomes the toolchain's own `etc/passwd` (missing): nothing reads the host's file through it.
    let deb = make_deb(
        &[
            Entry::Dir("./usr/lib/"),
            Entry::Symlink("./usr/lib/passwd", "/etc/passwd"),
        ],
        "gz",
    );
    let (_store, built) = build_with(|_| deb, true);
    let built = built.unwrap();
    let top = built
        .path
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let link = top.join("root/usr/lib/passwd");
    assert_eq!(
        std::fs::read_link(&link).unwrap(),
        Path::new("../../etc/passwd")
    );
    assert!(std::fs::read(&link).is_err());
}

/// Opt-in (`--run-ignored only`; downloads about 60 MB from the Debian archive of the machine's apt sources): a gcc
/// the host lacks compiles and runs C and C++ from the store.
#[test]
#[ignore = "downloads about 60 MB from the Debian archive of the machine's apt sources"]
fn real_gcc_from_the_configured_archive() {
    let archives = Archives::discover().unwrap();
    let glibc = hvd_resolver::tags::Platform::host().glibc;
    let cache = tempfile::tempdir().unwrap();
    let on_path = |name: &str| {
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .any(|d| d.join(name).is_file())
    };
    // The first of these the host lacks (gcc 10 on a bookworm host).
    let version = ["10", "9", "11", "13"]
        .into_iter()
        .find(|v| !on_path(&format!("gcc-{v}")))
        .unwrap()
        .to_string();
    let pin = runtime()
        .block_on(pin_gcc(&version, &archives, glibc, cache.path(), false))
        .unwrap_or_else(|e| panic!("gcc {version}: {e}"));
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path().join("store")).unwrap();
    let started = std::time::Instant::now();
    let built = Toolchain::for_build(&store, Some(&toolchain_from_pin(&pin)), false, true).unwrap();
    eprintln!(
        "gcc {} from {}: {} packages, realized in {:.1} s",
        built.version,
        pin.debian.as_ref().unwrap().suite,
        pin.debs.len(),
        started.elapsed().as_secs_f64()
    );
    let gcc = built.path.unwrap();
    let work = tempfile::tempdir().unwrap();
    std::fs::write(
        work.path().join("hello.c"),
        "#include <stdio.h>\nint main(void){printf(\"hello from gcc %d\\n\", __GNUC__);return 0;}\n",
    )
    .unwrap();
    std::fs::write(
        work.path().join("hello.cc"),
        "#include <iostream>\n#include <vector>\nint main(){std::vector<int> v{1,2,3};std::cout << \"hello c++ \" << __GNUC__ << \" \" << v.size() << std::endl;}\n",
    )
    .unwrap();
    for (driver, source, expect) in [
        ("gcc", "hello.c", format!("hello from gcc {version}")),
        ("g++", "hello.cc", format!("hello c++ {version} 3")),
    ] {
        let exe = work.path().join(format!("{source}.out"));
        let status = std::process::Command::new(gcc.with_file_name(driver))
            .arg(work.path().join(source))
            .arg("-o")
            .arg(&exe)
            .status()
            .unwrap();
        assert!(status.success(), "{driver} failed");
        let out = std::process::Command::new(&exe).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), expect);
    }
}
