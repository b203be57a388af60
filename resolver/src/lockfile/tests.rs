//! Tests of the lockfile: round trips, schema and validation, staleness, concurrent writes.

use super::*;
use hvd_lang::model::Toolchain;

/// The fields `check_against` names as changed.
fn changed_fields(lock: &Lockfile, env: &Env) -> Vec<String> {
    lock.check_against(env)
        .unwrap_err()
        .changes
        .into_iter()
        .map(|c| c.field)
        .collect()
}

fn env() -> Env {
    Env {
        python: "3.11".into(),
        index: None,
        toolchain: Some(Toolchain {
            name: "gcc".into(),
            version: "12".into(),
        }),
        packages: vec![
            PackageRequest {
                requirement: "tensorflow-cpu==2.12.1".into(),
                build: None,
            },
            PackageRequest {
                requirement: "Horovod == 0.28.1".into(),
                build: Some(SourceBuild {
                    requires: vec!["cmake<4".into(), "setuptools".into()],
                    env: BTreeMap::from([("HOROVOD_WITH_TENSORFLOW".into(), "1".into())]),
                    against: vec!["tensorflow_cpu".into()],
                    no_build_isolation: true,
                }),
            },
            PackageRequest {
                requirement: "numpy<1.26".into(),
                build: None,
            },
        ],
        variables: BTreeMap::new(),
    }
}

fn package(name: &str, version: &str) -> LockedPackage {
    LockedPackage {
        name: name.into(),
        version: version.into(),
        index: "http://127.0.0.1:1/simple".into(),
        artifact: Artifact {
            kind: ArtifactKind::Wheel,
            filename: format!("{name}-{version}-py3-none-any.whl"),
            url: format!("http://127.0.0.1:1/files/{name}-{version}-py3-none-any.whl"),
            sha256: "ab".repeat(32).parse().unwrap(),
            size: 1234,
        },
        dependencies: vec![Dependency {
            name: "zz".into(),
            extras: vec![],
            marker: Some("python_version < \"3.12\"".into()),
        }],
    }
}

fn lock() -> Lockfile {
    let e = env();
    Lockfile {
        version: SCHEMA_VERSION,
        env_hash: env_hash(&e),
        request: Request::from_env(&e),
        target: Target {
            python: "3.11".into(),
            python_full: "3.11.0".into(),
            interpreter: "cp311".into(),
            abi: "cp311".into(),
            os: "linux".into(),
            arch: "x86_64".into(),
            glibc: Some("2.36".into()),
            platforms: vec!["manylinux_2_36_x86_64".into(), "linux_x86_64".into()],
            installation: None,
        },
        toolchain: Some(ToolchainPin {
            name: "gcc".into(),
            requested: "12".into(),
            tools: vec![ToolPin {
                command: "gcc".into(),
                path: "/usr/bin/x86_64-linux-gnu-gcc-12".into(),
                version: "12.2.0".into(),
                sha256: "cd".repeat(32).parse().unwrap(),
            }],
            debian: None,
            debs: Vec::new(),
        }),
        packages: vec![package("zz", "1.0"), package("aa", "2.0")],
        builds: vec![LockedBuild {
            package: "horovod".into(),
            requires: vec!["cmake<4".into()],
            env: BTreeMap::from([("HOROVOD_WITH_TENSORFLOW".into(), "1".into())]),
            against: vec!["tensorflow-cpu".into()],
            no_build_isolation: true,
            packages: vec![package("cmake", "3.31.6")],
        }],
    }
}

#[test]
fn build_variables_the_file_does_not_ask_for_make_the_lock_stale() {
    let mut l = lock();
    l.env_hash = env_hash(&env());
    assert_eq!(l.check_against(&env()), Ok(()));
    // A lockfile in a pull request adds a loader variable to the recipe's build.
    l.builds[0]
        .env
        .insert("LD_PRELOAD".into(), "./evil.so".into());
    let s = l.check_against(&env()).unwrap_err();
    assert_eq!(s.changes.len(), 1, "{s}");
    assert_eq!(s.changes[0].field, "build.horovod.env");
    assert!(s.changes[0].was.contains("LD_PRELOAD"), "{s}");
    // A `[[build]]` of a package the file builds without a recipe may carry no variables either.
    let mut l = lock();
    l.env_hash = env_hash(&env());
    l.builds.push(LockedBuild {
        package: "numpy".into(),
        requires: vec![],
        env: BTreeMap::from([("PATH".into(), "/tmp/evil".into())]),
        against: vec![],
        no_build_isolation: false,
        packages: vec![],
    });
    let s = l.check_against(&env()).unwrap_err();
    assert_eq!(s.changes[0].field, "build.numpy.env", "{s}");
    l.builds[1].env.clear();
    assert_eq!(l.check_against(&env()), Ok(()));
}

#[test]
fn round_trips_and_is_deterministic() {
    let l = lock();
    let text = l.to_toml();
    let back = Lockfile::parse(&text, Path::new("x.lock")).unwrap();
    let mut sorted = l.clone();
    sorted.canonicalize();
    assert_eq!(back, sorted);
    assert_eq!(back.to_toml(), text);
    // Packages come out sorted whatever the input order.
    let aa = text.find("name = \"aa\"").unwrap();
    let zz = text.find("name = \"zz\"").unwrap();
    assert!(aa < zz, "{text}");
    // One artifact per line.
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("artifact = {"))
            .count(),
        3
    );
}

#[test]
fn refuses_newer_schema() {
    let text = lock().to_toml().replacen("version = 1", "version = 99", 1);
    let err = Lockfile::parse(&text, Path::new("t.hvd.lock")).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, LockfileError::NewerSchema { found: 99, .. }),
        "{msg}"
    );
    assert!(msg.contains("upgrade hvd"), "{msg}");
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    for text in [
        "",
        "version = \"x\"",
        "version = 1\n",
        "[[[",
        "version = -1",
    ] {
        assert!(
            Lockfile::parse(text, Path::new("t.lock")).is_err(),
            "{text}"
        );
    }
}

#[test]
fn normalizes_requests() {
    let r = Request::from_env(&env());
    assert_eq!(r.packages[1].requirement, "horovod==0.28.1");
    assert_eq!(
        r.packages[1].build.as_ref().unwrap().against,
        vec!["tensorflow-cpu"]
    );
    assert_eq!(normalize_name("Foo__Bar.baz"), "foo-bar-baz");
}

#[test]
fn env_hash_ignores_spacing_but_not_content() {
    let a = env();
    let mut b = env();
    b.packages[2].requirement = "numpy <1.26".into();
    assert_eq!(env_hash(&a), env_hash(&b));
    b.packages[2].requirement = "numpy<2".into();
    assert_ne!(env_hash(&a), env_hash(&b));
}

#[test]
fn staleness_names_each_field() {
    let l = lock();
    assert_eq!(l.check_against(&env()), Ok(()));

    let mut e = env();
    e.packages[2].requirement = "numpy<2".into();
    let s = l.check_against(&e).unwrap_err();
    assert_eq!(s.changes.len(), 1);
    assert_eq!(
        s.changes[0].to_string(),
        r#"env.packages[2]: "numpy<2" was "numpy<1.26""#
    );

    let mut e = env();
    e.python = "3.12".into();
    e.packages[1]
        .build
        .as_mut()
        .unwrap()
        .requires
        .push("wheel".into());
    e.variables.insert("A".into(), "1".into());
    let fields = changed_fields(&l, &e);
    assert_eq!(
        fields,
        [
            "env.python",
            "env.packages[1].build.requires",
            "env.variables.A"
        ]
    );

    let mut e = env();
    e.packages.pop();
    let s = l.check_against(&e).unwrap_err();
    assert_eq!(
        s.changes[0].to_string(),
        r#"env.packages[2]: (none) was "numpy<1.26""#
    );

    let mut e = env();
    e.index = Some("http://127.0.0.1:1/simple/".into());
    e.packages[1]
        .build
        .as_mut()
        .unwrap()
        .env
        .insert("X".into(), "1".into());
    e.packages[1].build.as_mut().unwrap().against = vec![];
    let fields = changed_fields(&l, &e);
    assert_eq!(
        fields,
        [
            "env.index",
            "env.packages[1].build.env",
            "env.packages[1].build.against"
        ]
    );

    let mut e = env();
    e.toolchain = None;
    let s = l.check_against(&e).unwrap_err();
    assert_eq!(s.changes[0].field, "env.toolchain");
}

/// Issue 16 items 1 and 15: a lockfile (e.g. from a pull request) with hostile artifact fields is refused
/// when read, naming the package and the field.
#[test]
fn hostile_artifact_fields_are_refused_when_read() {
    let good = lock().to_toml();
    let aa_sha = format!("sha256 = \"{}\"", "ab".repeat(32));
    let aa_url = "url = \"http://127.0.0.1:1/files/aa-2.0-py3-none-any.whl\"";
    let aa_file = "filename = \"aa-2.0-py3-none-any.whl\"";
    let cases: Vec<(String, &str)> = vec![
        (
            good.replacen(&aa_sha, "sha256 = \"../../../../tmp/x\"", 1),
            "not a sha256",
        ),
        (good.replacen(&aa_sha, "sha256 = \"\"", 1), "not a sha256"),
        (
            good.replacen(aa_file, "filename = \"../../aa-2.0-py3-none-any.whl\"", 1),
            "not a plain file name",
        ),
        (
            good.replacen(aa_file, "filename = \"evil-2.0-py3-none-any.whl\"", 1),
            "is not a file of aa 2.0",
        ),
        (
            good.replacen(aa_file, "filename = \"aa-2.0.tar.gz\"", 1),
            "does not end like a wheel",
        ),
        (
            good.replacen(aa_url, "url = \"file:///dev/zero\"", 1),
            "index `http://127.0.0.1:1/simple` is not local",
        ),
        (
            good.replacen(aa_url, "url = \"/dev/zero\"", 1),
            "is not local",
        ),
        (
            good.replacen(
                aa_url,
                "url = \"ftp://127.0.0.1/aa-2.0-py3-none-any.whl\"",
                1,
            ),
            "scheme `ftp`",
        ),
        (
            good.replacen("name = \"aa\"", "name = \"../aa\"", 1),
            "not a normalized package name",
        ),
        (
            good.replacen("version = \"2.0\"", "version = \"2.0; rm -rf /\"", 1),
            "not a PEP 440 version",
        ),
    ];
    for (text, reason) in cases {
        assert_ne!(
            text, good,
            "the case for {reason} did not change the lockfile"
        );
        let err = Lockfile::parse(&text, Path::new("t.hvd.lock"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(reason), "{reason}: {err}");
        assert!(err.contains("t.hvd.lock"), "{err}");
    }
    // A local artifact of a local index is fine.
    let local = good
        .replace(
            "index = \"http://127.0.0.1:1/simple\"",
            "index = \"file:///srv/simple\"",
        )
        .replacen(
            aa_url,
            "url = \"file:///srv/files/aa-2.0-py3-none-any.whl\"",
            1,
        );
    Lockfile::parse(&local, Path::new("t.hvd.lock")).unwrap();
}

/// Low item: concurrent `hvd lock` runs shared one temp file name, so one run's rename failed or moved the
/// other's half-written file into place.
#[test]
fn concurrent_writes_never_share_a_temp_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.hvd.lock");
    let l = lock();
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                for _ in 0..40 {
                    l.write(&path).unwrap();
                }
            });
        }
    });
    assert_eq!(Lockfile::read(&path).unwrap().to_toml(), l.to_toml());
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [std::ffi::OsString::from("train.hvd.lock")]);
}

#[test]
fn lock_path_appends_suffix() {
    assert_eq!(
        Lockfile::path_for(Path::new("a/train.hvd")),
        PathBuf::from("a/train.hvd.lock")
    );
}

/// A lock whose gcc comes from Debian.
fn debian_lock() -> Lockfile {
    let mut l = lock();
    l.toolchain = Some(ToolchainPin {
        name: "gcc".into(),
        requested: "10".into(),
        tools: Vec::new(),
        debian: Some(super::DebianSource {
            archive: "http://127.0.0.1:1/debian".into(),
            suite: "bullseye".into(),
            version: "10.2.1".into(),
            arch: Some("amd64".into()),
        }),
        debs: vec![super::DebPin {
            name: "gcc-10".into(),
            version: "10.2.1-6".into(),
            filename: "pool/main/g/gcc-10/gcc-10_10.2.1-6_amd64.deb".into(),
            sha256: "ef".repeat(32).parse().unwrap(),
            size: 16990272,
        }],
    });
    l
}

#[test]
fn a_debian_toolchain_round_trips_and_hostile_fields_are_refused() {
    let text = debian_lock().to_toml();
    assert!(
        text.contains("debian = { archive = \"http://127.0.0.1:1/debian\", suite = \"bullseye\", version = \"10.2.1\", arch = \"amd64\" }"),
        "{text}"
    );
    // A lock from before `arch` was recorded reads as amd64.
    let old =
        Lockfile::parse(&text.replace(", arch = \"amd64\"", ""), Path::new("x.lock")).unwrap();
    assert_eq!(old.toolchain.unwrap().debian.unwrap().arch(), "amd64");
    let back = Lockfile::parse(&text, Path::new("x.lock")).unwrap();
    let mut want = debian_lock();
    want.canonicalize();
    assert_eq!(back, want);
    assert_eq!(back.to_toml(), text);
    // A lock without the new fields reads as before (they are optional).
    assert!(!lock().to_toml().contains("debs"));
    for (from, to, expect) in [
        (
            "pool/main/g/gcc-10/gcc-10",
            "pool/../../etc/gcc-10",
            "not a `.deb` path under `pool/`",
        ),
        (
            "pool/main/g/gcc-10/gcc-10_10.2.1-6_amd64.deb",
            "/etc/passwd",
            "not a `.deb` path",
        ),
        (
            "http://127.0.0.1:1/debian",
            "ftp://x/debian",
            "not an http(s) URL",
        ),
        (
            "requested = \"10\"",
            "requested = \"../10\"",
            "not digits and dots",
        ),
        (
            "name = \"gcc-10\"",
            "name = \"gcc 10\"",
            "not a Debian package name",
        ),
        ("sha256 = \"efef", "sha256 = \"zzef", "sha256"),
        // A name the builder would join onto the toolchain's root: CC would be a host binary.
        (
            "name = \"gcc\"",
            "name = \"/usr/bin/x\"",
            "only gcc comes from Debian",
        ),
        // Size 0 would lift the bound on the download.
        ("size = 16990272", "size = 0", "has size 0"),
        ("arch = \"amd64\"", "arch = \"../x\"", "debian arch `../x`"),
    ] {
        let bad = text.replacen(from, to, 1);
        assert_ne!(bad, text, "{from}");
        let err = Lockfile::parse(&bad, Path::new("x.lock"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(expect), "{from}: {err}");
    }
}
