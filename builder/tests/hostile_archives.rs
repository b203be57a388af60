//! Hostile wheels and sdists, made by hand the way an attacker would, run through the real extraction and
//! installation (real HTTP on 127.0.0.1, a real store, a real source-build directory). Every attack is pointed at a
//! real directory outside the store, which must stay untouched; nothing may be installed, and the error must name
//! the entry and the reason.

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use common::{FileServer, append_to_zip, host_python, record_hash, served_store};
use hvd_builder::unpack::{Limits, unpack_sdist_with};
use hvd_builder::wheel::install_wheel;
use hvd_builder::{BuildOptions, EnvPlan, NoProgress, SourceBuildPlan, Store, build_env};

struct Fixture {
    _dir: tempfile::TempDir,
    server: FileServer,
    store: Store,
    /// A real directory outside the store: the attacks aim here.
    outside: PathBuf,
}

/// The victim's file in `outside`, which must keep its bytes.
const VICTIM: &str = "victim.txt";
const VICTIM_BYTES: &[u8] = b"the victim's own bytes\n";

fn fixture() -> Fixture {
    let (dir, server, store) = served_store();
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join(VICTIM), VICTIM_BYTES).unwrap();
    Fixture {
        _dir: dir,
        server,
        store,
        outside,
    }
}

/// A link target that passes any lexical check (as many `..` as names) but, with `l -> .` next to it, climbs to
/// `/` from any depth below 20 and then names `path` (absolute): `l/l/.../l/../../..../<path>`.
fn chain_to(path: &Path) -> String {
    let absolute = path.to_str().unwrap().trim_start_matches('/');
    format!("{}{}{absolute}", "l/".repeat(20), "../".repeat(20))
}

impl Fixture {
    /// Nothing outside was created, changed or removed.
    fn assert_outside_untouched(&self) {
        let names: Vec<_> = std::fs::read_dir(&self.outside)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, [VICTIM], "something was written outside the store");
        assert_eq!(
            std::fs::read(self.outside.join(VICTIM)).unwrap(),
            VICTIM_BYTES,
            "the victim's file was changed"
        );
    }

    /// No store path of the package `evil` exists (a refused build's debris under `.tmp` is no path: the store
    /// removes it when the path is next built or at gc). The build env of an sdist may exist.
    fn assert_nothing_installed(&self) {
        let paths = self.store.list_paths().unwrap();
        assert!(
            paths.iter().all(|name| !name.ends_with("-evil-1.0")),
            "installed: {paths:?}"
        );
    }

    /// Install `archive` through the real store; the refusal's whole message (the error and its causes).
    fn install(&self, archive: &Path) -> String {
        let filename = archive.file_name().unwrap().to_str().unwrap();
        let is_sdist = !filename.ends_with(".whl");
        let mut package = self.server.wheel_plan("evil", "1.0", filename);
        if is_sdist {
            package.build = Some(SourceBuildPlan {
                requires: Vec::new(),
                env: BTreeMap::new(),
                against: Vec::new(),
            });
        }
        let plan = EnvPlan {
            name: "victim".into(),
            python: host_python(),
            interpreter: None,
            packages: vec![package],
            toolchain: None,
            local_packages: Vec::new(),
        };
        let err = build_env(&self.store, &plan, &BuildOptions::default(), &NoProgress)
            .expect_err("a hostile archive must be refused");
        hvd_resolver::index::error_chain(&err)
    }

    /// Install `archive` through the real store, expect it refused naming `entry` and `reason`, and check that
    /// nothing was installed and nothing outside changed.
    fn assert_refused(&self, archive: &Path, entry: &str, reason: &str) {
        let message = self.install(archive);
        assert!(
            message.contains("evil 1.0")
                && message.contains(&format!("`{entry}`"))
                && message.contains(reason),
            "expected the package, entry `{entry}` and reason `{reason}` in: {message}"
        );
        self.assert_nothing_installed();
        self.assert_outside_untouched();
    }

    /// [`Self::assert_refused`] for a wheel of `members` (its RECORD as written).
    fn assert_wheel_refused(&self, members: Vec<Member>, entry: &str, reason: &str) {
        let archive = wheel(&self.server.root, members, |text| text);
        self.assert_refused(&archive, entry, reason);
    }

    /// [`Self::assert_wheel_refused`] for each `(members, entry, reason)`.
    fn assert_wheels_refused<const N: usize>(&self, cases: [(Vec<Member>, &str, &str); N]) {
        for (members, entry, reason) in cases {
            self.assert_wheel_refused(members, entry, reason);
        }
    }

    /// [`Self::assert_refused`] for an sdist of `members`.
    fn assert_sdist_refused(&self, members: Vec<TarMember>, entry: &str, reason: &str) {
        let archive = sdist(&self.server.root, members);
        self.assert_refused(&archive, entry, reason);
    }
}

/// `l -> .`, a link `name` that climbs through it to `path` ([`chain_to`]), then `then`.
fn climbing(name: &str, path: &Path, then: Member) -> Vec<Member> {
    vec![link("l", "."), link(name, &chain_to(path)), then]
}

/// One zip member of a hand-made wheel.
enum Member {
    File(String, Vec<u8>),
    Link(String, String),
    /// A file compressed as hard as deflate can (for the bomb).
    Dense(String, Vec<u8>),
}

fn file(name: &str, data: &[u8]) -> Member {
    Member::File(name.into(), data.to_vec())
}

fn link(name: &str, target: &str) -> Member {
    Member::Link(name.into(), target.into())
}

/// Write a wheel `evil-1.0-py3-none-any.whl` into `dir` with `members`, plus METADATA and WHEEL and a RECORD
/// listing every member with its true hash (`record` rewrites the RECORD text before it is written).
fn wheel(dir: &Path, members: Vec<Member>, record: impl FnOnce(String) -> String) -> PathBuf {
    let dist_info = "evil-1.0.dist-info";
    let mut members = members;
    members.push(Member::File(
        format!("{dist_info}/METADATA"),
        b"Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n".to_vec(),
    ));
    members.push(Member::File(
        format!("{dist_info}/WHEEL"),
        b"Wheel-Version: 1.0\nGenerator: attacker\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            .to_vec(),
    ));
    let mut text = String::new();
    for member in &members {
        let (name, data) = match member {
            Member::File(name, data) | Member::Dense(name, data) => (name, data.as_slice()),
            Member::Link(name, target) => (name, target.as_bytes()),
        };
        text.push_str(&format!(
            "{name},sha256={},{}\n",
            record_hash(data),
            data.len()
        ));
    }
    text.push_str(&format!("{dist_info}/RECORD,,\n"));
    members.push(Member::File(
        format!("{dist_info}/RECORD"),
        record(text).into_bytes(),
    ));
    let path = dir.join("evil-1.0-py3-none-any.whl");
    let mut writer = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
    let options = zip::write::SimpleFileOptions::default().compression_level(Some(1));
    for member in members {
        match member {
            Member::File(name, data) => {
                writer.start_file(name, options).unwrap();
                writer.write_all(&data).unwrap();
            }
            Member::Dense(name, data) => {
                writer
                    .start_file(name, options.compression_level(Some(9)))
                    .unwrap();
                writer.write_all(&data).unwrap();
            }
            Member::Link(name, target) => writer.add_symlink(name, target, options).unwrap(),
        }
    }
    writer.finish().unwrap();
    path
}

/// One tar member of a hand-made sdist; names are written raw, so nothing is normalized on the way.
enum TarMember {
    File(&'static str, &'static [u8]),
    Link(&'static str, String),
    HardLink(&'static str, String),
}

/// `evil-1.0/l -> .`, then a link `name` that climbs through it to `path` ([`chain_to`]), then `then`.
fn climbing_tar(name: &'static str, path: &Path, then: Vec<TarMember>) -> Vec<TarMember> {
    let mut members = vec![
        TarMember::Link("evil-1.0/l", ".".into()),
        TarMember::Link(name, chain_to(path)),
    ];
    members.extend(then);
    members
}

/// Write `evil-1.0.tar.gz` into `dir`, every header built by hand (GNU long names for long targets).
fn sdist(dir: &Path, members: Vec<TarMember>) -> PathBuf {
    let path = dir.join("evil-1.0.tar.gz");
    let encoder = flate2::write::GzEncoder::new(
        std::fs::File::create(&path).unwrap(),
        flate2::Compression::fast(),
    );
    let mut builder = tar::Builder::new(encoder);
    let pyproject: &[u8] = b"[build-system]\nrequires = []\nbuild-backend = \"x\"\n";
    let mut all = vec![TarMember::File("evil-1.0/pyproject.toml", pyproject)];
    all.extend(members);
    for member in all {
        let (name, kind, target, data): (&str, tar::EntryType, Option<String>, &[u8]) = match member
        {
            TarMember::File(name, data) => (name, tar::EntryType::Regular, None, data),
            TarMember::Link(name, target) => (name, tar::EntryType::Symlink, Some(target), b""),
            TarMember::HardLink(name, target) => (name, tar::EntryType::Link, Some(target), b""),
        };
        if let Some(target) = &target {
            // A GNU long-link record carries the target verbatim (the tar crate would refuse `..` in it).
            let mut long = tar::Header::new_gnu();
            long.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"././@LongLink");
            long.set_entry_type(tar::EntryType::GNULongLink);
            long.set_size(target.len() as u64 + 1);
            long.set_mode(0o644);
            long.set_cksum();
            let mut bytes = target.as_bytes().to_vec();
            bytes.push(0);
            builder.append(&long, bytes.as_slice()).unwrap();
        }
        let mut header = tar::Header::new_gnu();
        header.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_cksum();
        builder.append(&header, data).unwrap();
    }
    builder.into_inner().unwrap().finish().unwrap();
    path
}

#[test]
fn wheel_symlink_chain_is_refused() {
    let f = fixture();
    f.assert_wheel_refused(
        climbing("x", &f.outside, file("evil/__init__.py", b"")),
        "x",
        "which resolves outside the archive's tree",
    );
}

#[test]
fn wheel_write_through_link_is_refused() {
    let f = fixture();
    f.assert_wheels_refused([
        // The link to the victim's file, then `./x` written "to it".
        (
            climbing("x", &f.outside.join(VICTIM), file("./x", b"pwned")),
            "./x",
            "is a duplicate name",
        ),
        // The link to the victim's directory, then a file below it.
        (
            climbing("d", &f.outside, file("d/pwned.py", b"pwned")),
            "d/pwned.py",
            "which is a link",
        ),
    ]);
}

#[test]
fn wheel_data_merged_through_link_is_refused() {
    let f = fixture();
    let merged = "evil-1.0.data/purelib/pkg/pwned.py";
    f.assert_wheels_refused([
        // `.data/purelib/pkg/` lands in `site-packages/pkg/`, which the wheel made a link out of the store.
        (
            climbing("pkg", &f.outside, file(merged, b"pwned")),
            merged,
            "which is a link",
        ),
        // A link inside `.data` that is harmless where it is unpacked but escapes where it lands.
        (
            vec![
                file("evil/__init__.py", b""),
                link("evil-1.0.data/purelib/up", "../../../.."),
            ],
            "evil-1.0.data/purelib/up",
            "which resolves outside the archive's tree",
        ),
    ]);
}

#[test]
fn wheel_duplicate_names_are_refused() {
    let f = fixture();
    for (first, second) in [
        ("evil/a.py", "evil//a.py"),
        ("evil/a.py", "./evil/a.py"),
        ("evil/a.py", "evil/./a.py"),
        ("evil/a.py", "evil-1.0.data/purelib/evil/a.py"),
    ] {
        f.assert_wheel_refused(
            vec![file(first, b"first"), file(second, b"second")],
            second,
            "is a duplicate name",
        );
    }
}

#[test]
fn wheel_zip_bomb_is_refused() {
    let f = fixture();
    let zeros = vec![0u8; 128 << 20];
    let archive = wheel(
        &f.server.root,
        vec![Member::Dense("evil/zeros.bin".into(), zeros)],
        |text| text,
    );
    let size = std::fs::metadata(&archive).unwrap().len();
    assert!(
        size * 100 < 128 << 20,
        "the bomb is not dense enough: {size} bytes"
    );
    f.assert_refused(&archive, "evil/zeros.bin", "(a decompression bomb)");
}

#[test]
fn wheel_with_too_many_files_is_refused() {
    let f = fixture();
    let members = (0..200_001)
        .map(|i| Member::File(format!("evil/f{i}"), Vec::new()))
        .collect();
    let archive = wheel(&f.server.root, members, |text| text);
    f.assert_refused(&archive, "(central directory)", "more than the 200000");
}

#[test]
fn sdist_with_too_many_files_is_refused() {
    let f = fixture();
    let archive = sdist(
        &f.server.root,
        vec![
            TarMember::File("evil-1.0/a", b"a"),
            TarMember::File("evil-1.0/b", b"b"),
            TarMember::File("evil-1.0/c", b"c"),
        ],
    );
    let dest = f.outside.join("dest");
    let limits = Limits {
        max_entries: 3,
        ..Limits::default()
    };
    let err = unpack_sdist_with(&archive, "evil-1.0.tar.gz", &dest, limits).unwrap_err();
    assert!(
        err.to_string()
            .contains("`evil-1.0/c` is one entry more than the 3"),
        "{err}"
    );
}

#[test]
fn wheel_record_must_list_every_file_with_its_sha256() {
    let f = fixture();
    let dist_info = "evil-1.0.dist-info";
    // RECORD lists a file the wheel lacks.
    let archive = wheel(&f.server.root, vec![file("evil/a.py", b"a")], |text| {
        text + "evil/gone.py,sha256=AAAA,1\n"
    });
    let err = f.install(&archive);
    assert!(
        err.contains("RECORD lists `evil/gone.py`, which the wheel does not contain"),
        "{err}"
    );
    f.assert_nothing_installed();
    // A RECORD line without sha256.
    let archive = wheel(&f.server.root, vec![file("evil/a.py", b"a")], |text| {
        text.replace(
            &format!("evil/a.py,sha256={},1", record_hash(b"a")),
            "evil/a.py,,",
        )
    });
    let err = f.install(&archive);
    assert!(
        err.contains("RECORD lists `evil/a.py` without a sha256 hash"),
        "{err}"
    );
    f.assert_nothing_installed();
    // A file RECORD does not list (here: a `.pth` file, which python would run at startup).
    let archive = wheel(&f.server.root, vec![file("evil/a.py", b"a")], |text| text);
    append_to_zip(&archive, "evil.pth", b"import os; os.system('id')\n");
    let err = f.install(&archive);
    assert!(err.contains("`evil.pth` is not listed in RECORD"), "{err}");
    f.assert_nothing_installed();
    // A hash that does not match.
    let archive = wheel(&f.server.root, vec![file("evil/a.py", b"a")], |text| {
        text.replace(&record_hash(b"a"), &record_hash(b"b"))
    });
    let err = f.install(&archive);
    assert!(
        err.contains("`evil/a.py` does not match its RECORD hash"),
        "{err}"
    );
    f.assert_nothing_installed();
    // RECORD's signature may be unlisted; an honest wheel with links and `.data` installs.
    let archive = wheel(
        &f.server.root,
        vec![
            file("evil/a.py", b"a"),
            link("evil/alias.py", "a.py"),
            file("evil-1.0.data/purelib/evil/b.py", b"b"),
            file("evil-1.0.data/scripts/tool", b"#!python\n"),
        ],
        |text| text,
    );
    append_to_zip(&archive, &format!("{dist_info}/RECORD.jws"), b"{}");
    let out = f.outside.join("honest");
    std::fs::create_dir(&out).unwrap();
    let hashes = install_wheel(&archive, &out).unwrap();
    assert_eq!(
        std::fs::read(out.join("site-packages/evil/alias.py")).unwrap(),
        b"a"
    );
    assert!(out.join("site-packages/evil/b.py").is_file() && out.join("scripts/tool").is_file());
    assert!(!out.join("site-packages/evil-1.0.data").exists());
    assert!(hashes.contains_key("site-packages/evil/b.py"));
}

#[test]
fn sdist_symlink_chain_is_refused() {
    let f = fixture();
    f.assert_sdist_refused(
        climbing_tar(
            "evil-1.0/x",
            &f.outside,
            vec![TarMember::File("evil-1.0/x/pwned", b"pwned")],
        ),
        "evil-1.0/x/pwned",
        "which is a link",
    );
    f.assert_sdist_refused(
        climbing_tar(
            "evil-1.0/x",
            &f.outside.join(VICTIM),
            vec![TarMember::File("./evil-1.0/x", b"pwned")],
        ),
        "./evil-1.0/x",
        "is a duplicate name",
    );
    f.assert_sdist_refused(
        climbing_tar("evil-1.0/x", &f.outside, vec![]),
        "evil-1.0/x",
        "which resolves outside the archive's tree",
    );
}

#[test]
fn sdist_hard_link_to_outside_is_refused() {
    let f = fixture();
    let victim = f.outside.join(VICTIM);
    for (members, entry, reason) in [
        (
            vec![TarMember::HardLink(
                "evil-1.0/h",
                victim.to_str().unwrap().to_string(),
            )],
            "evil-1.0/h",
            "is an absolute path",
        ),
        (
            vec![
                TarMember::Link("evil-1.0/l", ".".into()),
                TarMember::HardLink("evil-1.0/h", format!("evil-1.0/{}", chain_to(&victim))),
            ],
            "evil-1.0/h",
            "contains `..`",
        ),
        (
            vec![
                TarMember::Link("evil-1.0/l", ".".into()),
                TarMember::Link("evil-1.0/s", chain_to(&victim)),
                TarMember::HardLink("evil-1.0/h", "evil-1.0/s".into()),
            ],
            "evil-1.0/h",
            "which is a link",
        ),
    ] {
        f.assert_sdist_refused(members, entry, reason);
        // The victim's bytes were not copied anywhere into the store either.
        for entry in walkdir::WalkDir::new(f.store.root()).follow_links(false) {
            let entry = entry.unwrap();
            if entry.file_type().is_file() {
                assert_ne!(std::fs::read(entry.path()).unwrap(), VICTIM_BYTES);
            }
        }
    }
}

#[test]
fn sdist_hard_link_to_a_later_entry_is_refused() {
    let f = fixture();
    f.assert_sdist_refused(
        vec![
            TarMember::HardLink("evil-1.0/h", "evil-1.0/later".into()),
            TarMember::File("evil-1.0/later", b"later"),
        ],
        "evil-1.0/h",
        "which was not extracted before it",
    );
    // A hard link to a file extracted before it is a plain copy.
    let archive = sdist(
        &f.server.root,
        vec![
            TarMember::File("evil-1.0/first", b"first"),
            TarMember::HardLink("evil-1.0/h", "./evil-1.0//first".into()),
        ],
    );
    let dest = f.outside.join("dest");
    unpack_sdist_with(&archive, "evil-1.0.tar.gz", &dest, Limits::default()).unwrap();
    assert_eq!(std::fs::read(dest.join("evil-1.0/h")).unwrap(), b"first");
}

/// A wheel of about `total` bytes in `files` files, like a big binary wheel: half the files compressible source
/// text, half incompressible "shared library" bytes, in a few hundred directories.
fn big_wheel(dir: &Path, files: usize, total: usize) -> PathBuf {
    let per_file = total / files;
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut members = Vec::with_capacity(files);
    for i in 0..files {
        let name = format!(
            "bigpkg/sub{}/mod{}/file{i}.{}",
            i % 17,
            i % 23,
            if i % 2 == 0 { "py" } else { "so" }
        );
        let data: Vec<u8> = if i % 2 == 0 {
            format!("def f{i}(x):\n    return x * {i} + len('{name}')\n")
                .into_bytes()
                .into_iter()
                .cycle()
                .take(per_file)
                .collect()
        } else {
            (0..per_file)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect()
        };
        members.push(Member::File(name, data));
    }
    wheel(dir, members, |text| text)
}

/// CPU seconds this thread has used (less disturbed than wall time on a shared machine).
fn thread_cpu_seconds() -> f64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec and the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    assert_eq!(rc, 0);
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

/// Not a correctness test: times the installation of a big wheel (5000 files, 200 MiB), best of 5 in wall and in
/// CPU time, against the zip crate's own unchecked `extract` of the same file as a baseline (the machine is shared:
/// compare the ratios). Run with
/// `cargo test -p hvd-builder --test hostile_archives -- --ignored --nocapture install_big_wheel_timing`.
#[test]
#[ignore = "a measurement, not a check"]
fn install_big_wheel_timing() {
    let dir = tempfile::tempdir().unwrap();
    let archive = big_wheel(dir.path(), 5000, 200 << 20);
    let (mut wall, mut cpu, mut base_wall, mut base_cpu) = (f64::MAX, f64::MAX, f64::MAX, f64::MAX);
    for run in 0..5 {
        let out = dir.path().join(format!("out{run}"));
        std::fs::create_dir(&out).unwrap();
        let (start, start_cpu) = (std::time::Instant::now(), thread_cpu_seconds());
        let hashes = install_wheel(&archive, &out).unwrap();
        wall = wall.min(start.elapsed().as_secs_f64());
        cpu = cpu.min(thread_cpu_seconds() - start_cpu);
        assert!(hashes.len() >= 5000);
        std::fs::remove_dir_all(&out).unwrap();

        let (start, start_cpu) = (std::time::Instant::now(), thread_cpu_seconds());
        zip::ZipArchive::new(std::fs::File::open(&archive).unwrap())
            .unwrap()
            .extract(&out)
            .unwrap();
        base_wall = base_wall.min(start.elapsed().as_secs_f64());
        base_cpu = base_cpu.min(thread_cpu_seconds() - start_cpu);
        std::fs::remove_dir_all(&out).unwrap();
    }
    let size = std::fs::metadata(&archive).unwrap().len();
    println!(
        "install_wheel of a {:.1} MB wheel (5000 files, 200 MiB unpacked), best of 5: wall {wall:.3} s, cpu \
         {cpu:.3} s; unchecked zip extract: wall {base_wall:.3} s, cpu {base_cpu:.3} s",
        size as f64 / 1e6,
    );
}
