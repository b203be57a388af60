//! Locking against the fixture index served over real HTTP on 127.0.0.1.

use std::collections::BTreeMap;

use hvd_lang::model::{PackageRequest, SourceBuild};
use hvd_resolver::lockfile::ArtifactKind;
use hvd_resolver::testing::{
    Dist, FixtureIndex, FixtureOptions, env_of, lock_options, lock_options_at,
    torch_2_0_1_sharing_build_tools,
};
use hvd_resolver::{LockOptions, Lockfile, ResolveError, lock, lock_detailed};

fn versions(lock: &Lockfile) -> Vec<String> {
    lock.packages
        .iter()
        .map(|p| format!("{}=={}", p.name, p.version))
        .collect()
}

fn universe() -> Vec<Dist> {
    vec![
        Dist::wheel("app", "1.0").requires(&["lib>=1,<3", "extra-dep ; python_version < \"3.8\""]),
        Dist::wheel("app", "2.0").requires(&["lib>=2", "plugin[fast]>=1"]),
        Dist::wheel("lib", "1.5"),
        Dist::wheel("lib", "2.0").requires(&["six"]),
        Dist::wheel("lib", "3.0").yanked(),
        Dist::sdist("six", "1.16.0"),
        Dist::wheel("six", "1.16.0").tag("py2.py3-none-any"),
        Dist::wheel("plugin", "1.0").requires(&[
            "speedups ; extra == \"fast\"",
            "win-only ; sys_platform == \"win32\"",
        ]),
        Dist::wheel("speedups", "0.1")
            .tag("cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64"),
        Dist::wheel("speedups", "0.2").tag("cp312-cp312-manylinux_2_17_x86_64"),
        Dist::wheel("newpy", "1.0"),
        Dist::wheel("newpy", "2.0").requires_python(">=3.12"),
    ]
}

/// What `universe()` locks to for `app` and `newpy` (python 3.11, linux x86_64).
const APP_AND_NEWPY: [&str; 6] = [
    "app==2.0",
    "lib==2.0",
    "newpy==1.0",
    "plugin==1.0",
    "six==1.16.0",
    "speedups==0.1",
];

fn lock_app_and_newpy(index: &FixtureIndex, cache: &std::path::Path) -> Lockfile {
    lock(&env_of(&["app", "newpy"]), &lock_options(index, cache)).unwrap()
}

#[test]
fn resolves_markers_extras_yanked_and_requires_python() {
    let index = FixtureIndex::start(universe(), FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let lock = lock_app_and_newpy(&index, cache.path());
    // app 2.0 (newest); lib 2.0 (3.0 is yanked); plugin[fast] pulls speedups 0.1 (0.2 is cp312 only);
    // win-only is skipped by its marker; newpy 2.0 needs python 3.12.
    assert_eq!(versions(&lock), APP_AND_NEWPY);
    let six = lock.package("six").unwrap();
    assert_eq!(
        six.artifact.kind,
        ArtifactKind::Wheel,
        "a wheel is preferred over the sdist"
    );
    let speedups = lock.package("speedups").unwrap();
    assert!(speedups.artifact.filename.contains("cp311"));
    assert_eq!(
        speedups.artifact.sha256.as_str(),
        index.file(&speedups.artifact.filename).unwrap().1
    );
    let plugin = lock.package("plugin").unwrap();
    assert_eq!(plugin.dependencies.len(), 1);
    assert_eq!(
        plugin.dependencies[0].marker.as_deref(),
        Some("extra == 'fast'")
    );
    let app = lock.package("app").unwrap();
    let edge = app
        .dependencies
        .iter()
        .find(|d| d.name == "plugin")
        .unwrap();
    assert_eq!(edge.extras, ["fast"]);
}

#[test]
fn conflicts_are_explained_in_plain_words() {
    let index = FixtureIndex::start(universe(), FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let err = lock(
        &env_of(&["app==1.0", "lib>=2.5"]),
        &lock_options(&index, cache.path()),
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ResolveError::NoSolution(_)), "{text}");
    assert!(text.contains("app 1.0 depends on lib >=1, <3"), "{text}");
    assert!(text.contains("the env depends on lib >=2.5"), "{text}");

    let text = lock(&env_of(&["lib>=2.5"]), &lock_options(&index, cache.path()))
        .unwrap_err()
        .to_string();
    assert!(text.contains("lib==3.0 is yanked"), "{text}");
}

#[test]
fn missing_wheel_names_the_tags_and_suggests() {
    let dists = vec![
        Dist::wheel("tensorflow", "1.5.0").tag("cp27-cp27mu-manylinux1_x86_64"),
        Dist::wheel("tensorflow", "1.5.0").tag("cp34-cp34m-manylinux1_x86_64"),
        Dist::wheel("tensorflow", "1.5.0").tag("cp35-cp35m-manylinux1_x86_64"),
        Dist::wheel("tensorflow", "1.5.0").tag("cp36-cp36m-manylinux1_x86_64"),
        Dist::wheel("tensorflow", "2.12.1").tag("cp311-cp311-manylinux_2_17_x86_64"),
    ];
    let index = FixtureIndex::start(dists, FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let text = lock(
        &env_of(&["tensorflow==1.5.0"]),
        &lock_options(&index, cache.path()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        text.contains(
            "tensorflow==1.5.0 has no wheel for cp311 on manylinux x86_64 (it has cp27, cp34..cp36)"
        ),
        "{text}"
    );
    assert!(text.contains("python = \"3.6\""), "{text}");
    assert!(text.contains("tensorflow==2.12.1"), "{text}");

    let text = lock(
        &env_of(&["no-such-thing"]),
        &lock_options(&index, cache.path()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        text.contains("`no-such-thing` does not exist on the package index"),
        "{text}"
    );
}

#[test]
fn relock_is_byte_identical_and_only_revalidates() {
    let index = FixtureIndex::start(universe(), FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let e = env_of(&["app", "newpy"]);
    let first = lock_detailed(&e, &lock_options(&index, cache.path())).unwrap();
    assert!(
        index
            .requests()
            .iter()
            .any(|r| r.contains("/files/") && r.ends_with(" 206")),
        "{:?}",
        index.requests()
    );
    index.clear_requests();
    let mut opts = lock_options(&index, cache.path());
    opts.existing = Some(first.lockfile.clone());
    let second = lock_detailed(&e, &opts).unwrap();
    assert_eq!(first.lockfile.to_toml(), second.lockfile.to_toml());
    let requests = index.requests();
    // Only project pages, each answered 304; no file or metadata traffic.
    assert!(!requests.is_empty());
    assert!(
        requests
            .iter()
            .all(|r| r.starts_with("GET /simple/") && r.ends_with(" 304")),
        "{requests:?}"
    );
    assert_eq!(second.stats.not_modified, requests.len() as u64);

    // Offline: no requests at all, same bytes.
    index.clear_requests();
    let mut opts = lock_options(&index, cache.path());
    opts.offline = true;
    let third = lock(&e, &opts).unwrap();
    assert_eq!(third.to_toml(), first.lockfile.to_toml());
    assert!(index.requests().is_empty(), "{:?}", index.requests());
}

#[test]
fn offline_without_cache_says_what_to_do() {
    let index = FixtureIndex::start(universe(), FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut opts = lock_options(&index, cache.path());
    opts.offline = true;
    let text = lock(&env_of(&["app"]), &opts).unwrap_err().to_string();
    assert!(text.contains("--offline"), "{text}");
    assert!(index.requests().is_empty());
}

#[test]
fn pins_are_kept_until_upgraded() {
    let index = FixtureIndex::start(universe(), FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let e = env_of(&["lib<3"]);
    let first = lock(&e, &lock_options(&index, cache.path())).unwrap();
    assert_eq!(versions(&first), ["lib==2.0", "six==1.16.0"]);
    index.add(Dist::wheel("lib", "2.5"));
    let mut opts = lock_options(&index, cache.path());
    opts.existing = Some(first.clone());
    assert_eq!(
        versions(&lock(&e, &opts).unwrap()),
        ["lib==2.0", "six==1.16.0"]
    );
    opts.upgrade_packages = vec!["LIB".into()];
    assert_eq!(versions(&lock(&e, &opts).unwrap()), ["lib==2.5"]);
    opts.upgrade_packages.clear();
    opts.upgrade = true;
    assert_eq!(versions(&lock(&e, &opts).unwrap()), ["lib==2.5"]);
}

#[test]
fn html_index_without_ranges_works() {
    let index = FixtureIndex::start(
        universe(),
        FixtureOptions {
            html: true,
            ranges: false,
            ..FixtureOptions::default()
        },
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let lock = lock_app_and_newpy(&index, cache.path());
    assert_eq!(versions(&lock), APP_AND_NEWPY);
    assert!(
        index
            .requests()
            .iter()
            .any(|r| r.contains("/files/") && r.ends_with(" 200"))
    );
}

#[test]
fn pep658_metadata_is_used_when_offered() {
    let index = FixtureIndex::start(
        universe(),
        FixtureOptions {
            core_metadata: true,
            ..FixtureOptions::default()
        },
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    lock(&env_of(&["app"]), &lock_options(&index, cache.path())).unwrap();
    let requests = index.requests();
    assert!(
        requests.iter().any(|r| r.ends_with(".metadata 200")),
        "{requests:?}"
    );
    assert!(
        !requests.iter().any(|r| r.ends_with(" 206")),
        "{requests:?}"
    );
}

#[test]
fn source_builds_lock_build_requirements_against_runtime_pins() {
    let dists = vec![
        Dist::sdist("horovod", "0.28.1")
            .legacy_metadata()
            .requires(&["cloudpickle", "psutil"]),
        Dist::wheel("cloudpickle", "3.0.0"),
        Dist::wheel("psutil", "5.9.0"),
        Dist::wheel("tensorflow-cpu", "2.12.1")
            .tag("cp311-cp311-manylinux_2_17_x86_64")
            .requires(&["setuptools<70"]),
        Dist::wheel("tensorflow-cpu", "2.13.0").tag("cp311-cp311-manylinux_2_17_x86_64"),
        Dist::wheel("setuptools", "69.0.0"),
        Dist::wheel("cmake", "3.31.6").tag("py3-none-manylinux_2_17_x86_64"),
        Dist::wheel("cmake", "4.0.0").tag("py3-none-manylinux_2_17_x86_64"),
        Dist::wheel("setuptools", "70.0.0"),
        Dist::wheel("wheel", "0.43.0"),
        // A wheel exists, but horovod is built from source: the sdist must be chosen.
        Dist::wheel("horovod", "0.28.1").tag("cp311-cp311-linux_x86_64"),
    ];
    let index = FixtureIndex::start(dists, FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut e = env_of(&["tensorflow-cpu==2.12.1"]);
    e.packages.push(PackageRequest {
        requirement: "horovod==0.28.1".into(),
        build: Some(SourceBuild {
            requires: vec!["cmake<4".into(), "setuptools".into(), "wheel".into()],
            env: BTreeMap::from([("HOROVOD_WITH_TENSORFLOW".into(), "1".into())]),
            against: vec!["tensorflow-cpu".into()],
            no_build_isolation: true,
        }),
    });
    let lock = lock(&e, &lock_options(&index, cache.path())).unwrap();
    assert_eq!(
        versions(&lock),
        [
            "cloudpickle==3.0.0",
            "horovod==0.28.1",
            "psutil==5.9.0",
            "setuptools==69.0.0",
            "tensorflow-cpu==2.12.1"
        ]
    );
    assert_eq!(
        lock.package("horovod").unwrap().artifact.kind,
        ArtifactKind::Sdist
    );
    assert_eq!(lock.builds.len(), 1);
    let build = &lock.builds[0];
    assert_eq!(build.package, "horovod");
    assert_eq!(build.against, ["tensorflow-cpu"]);
    let build_versions: Vec<String> = build
        .packages
        .iter()
        .map(|p| format!("{}=={}", p.name, p.version))
        .collect();
    assert_eq!(build_versions, ["cmake==3.31.6", "wheel==0.43.0"],);
    // Round trip through TOML.
    let text = lock.to_toml();
    assert_eq!(
        Lockfile::parse(&text, std::path::Path::new("x"))
            .unwrap()
            .to_toml(),
        text
    );
    lock.check_against(&e).unwrap();
}

#[test]
fn transient_failures_are_retried_and_permanent_ones_name_the_url() {
    let index = FixtureIndex::start(
        universe(),
        FixtureOptions {
            fail_first: 2,
            ..FixtureOptions::default()
        },
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let lock = lock(&env_of(&["lib<2"]), &lock_options(&index, cache.path())).unwrap();
    assert_eq!(versions(&lock), ["lib==1.5"]);
    assert_eq!(
        index
            .requests()
            .iter()
            .filter(|r| r.ends_with(" 503"))
            .count(),
        2,
        "{:?}",
        index.requests()
    );

    // Nothing listens on the index port any more: the error names the URL.
    let url = index.url();
    drop(index);
    let cache = tempfile::tempdir().unwrap();
    let opts = LockOptions {
        index_url: Some(format!("{url}nested/")),
        ..lock_options_at(&url, cache.path())
    };
    let text = hvd_resolver::lock(&env_of(&["lib"]), &opts)
        .unwrap_err()
        .to_string();
    assert!(text.contains(&format!("{url}nested/lib/")), "{text}");
}

#[test]
fn plain_sdists_lock_their_pyproject_build_requirements() {
    let index = FixtureIndex::start(
        vec![
            Dist::sdist("widget", "1.0")
                .requires(&["helper"])
                .build_system(&["Fixture_Backend>=1"], "fixture_backend"),
            Dist::wheel("helper", "1.0"),
            Dist::wheel("fixture-backend", "1.0"),
            Dist::wheel("fixture-backend", "2.0"),
        ],
        FixtureOptions::default(),
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let locked = lock(&env_of(&["widget"]), &lock_options(&index, cache.path())).unwrap();
    assert_eq!(versions(&locked), ["helper==1.0", "widget==1.0"]);
    assert_eq!(
        locked.package("widget").unwrap().artifact.kind,
        ArtifactKind::Sdist
    );
    assert_eq!(locked.builds.len(), 1, "{:?}", locked.builds);
    let build = &locked.builds[0];
    assert_eq!(build.package, "widget");
    assert_eq!(build.requires, ["fixture-backend>=1"]);
    assert!(!build.no_build_isolation);
    assert!(build.against.is_empty() && build.env.is_empty());
    let pins: Vec<String> = build
        .packages
        .iter()
        .map(|p| format!("{}=={}", p.name, p.version))
        .collect();
    assert_eq!(pins, ["fixture-backend==2.0"]);
    assert!(
        locked
            .to_toml()
            .contains("requires = [\"fixture-backend>=1\"]")
    );

    // The build requirements were read from the download made for PKG-INFO and cached: an offline relock works
    // and writes the same bytes; the written lock reads back equal.
    let again = lock(
        &env_of(&["widget"]),
        &LockOptions {
            offline: true,
            existing: Some(locked.clone()),
            ..lock_options(&index, cache.path())
        },
    )
    .unwrap();
    assert_eq!(again.to_toml(), locked.to_toml());
    assert_eq!(
        Lockfile::parse(&locked.to_toml(), std::path::Path::new("x.lock")).unwrap(),
        locked
    );

    // A wheel needs no build: no [[build]].
    let index2 = FixtureIndex::start(
        vec![Dist::wheel("widget", "1.0"), Dist::sdist("widget", "1.0")],
        FixtureOptions::default(),
    )
    .unwrap();
    let cache2 = tempfile::tempdir().unwrap();
    let lock2 = lock(&env_of(&["widget"]), &lock_options(&index2, cache2.path())).unwrap();
    assert!(lock2.builds.is_empty(), "{:?}", lock2.builds);
}

#[test]
fn sdists_without_pyproject_get_the_pep517_default_build_requirements() {
    let index = FixtureIndex::start(
        vec![
            Dist::sdist("oldpkg", "1.0").without_pyproject(),
            Dist::sdist("tablefree", "1.0").build_system(&[], "x"),
            Dist::wheel("setuptools", "39.0"),
            Dist::wheel("setuptools", "70.0"),
            Dist::wheel("wheel", "0.43.0"),
        ],
        FixtureOptions::default(),
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let locked = lock(
        &env_of(&["oldpkg", "tablefree"]),
        &lock_options(&index, cache.path()),
    )
    .unwrap();
    let oldpkg = locked
        .builds
        .iter()
        .find(|b| b.package == "oldpkg")
        .unwrap();
    assert_eq!(oldpkg.requires, ["setuptools>=40.8.0", "wheel"]);
    let pins: Vec<String> = oldpkg
        .packages
        .iter()
        .map(|p| format!("{}=={}", p.name, p.version))
        .collect();
    assert_eq!(pins, ["setuptools==70.0", "wheel==0.43.0"]);
    // An explicit empty `requires` is respected (not replaced by the default).
    let tablefree = locked
        .builds
        .iter()
        .find(|b| b.package == "tablefree")
        .unwrap();
    assert!(tablefree.requires.is_empty() && tablefree.packages.is_empty());

    // No usable build requirement: the error says whose build it is.
    let index = FixtureIndex::start(
        vec![Dist::sdist("oldpkg", "1.0").without_pyproject()],
        FixtureOptions::default(),
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    match lock(&env_of(&["oldpkg"]), &lock_options(&index, cache.path())) {
        Err(ResolveError::NoSolution(text)) => {
            assert!(text.contains("build requirements of `oldpkg`"), "{text}")
        }
        other => panic!("expected no solution, got {other:?}"),
    }
}

/// torch 2.0.1 as the index has it, reduced to what a Horovod build shares with the env: its CUDA wheels depend on
/// setuptools and its triton on cmake, without versions, so the env alone would take the newest of each.
fn torch_2_0_1_universe() -> Vec<Dist> {
    let mut dists = vec![
        Dist::sdist("horovod", "0.28.1").requires(&["cloudpickle"]),
        Dist::wheel("cloudpickle", "3.0.0"),
    ];
    dists.extend(torch_2_0_1_sharing_build_tools(
        "nvidia-cudnn-cu11",
        "8.5.0.96",
    ));
    dists.push(Dist::wheel("wheel", "0.43.0"));
    dists
}

/// `packages` and horovod built against torch with std.horovod's requirements for it.
fn torch_horovod_env(packages: &[&str]) -> hvd_lang::model::Env {
    let mut e = env_of(packages);
    e.packages.push(PackageRequest {
        requirement: "horovod==0.28.1".into(),
        build: Some(SourceBuild {
            requires: vec![
                "cmake>=3.13,<4".into(),
                "setuptools<82".into(),
                "wheel".into(),
            ],
            env: BTreeMap::new(),
            against: vec!["torch".into()],
            no_build_isolation: true,
        }),
    });
    e
}

#[test]
fn build_requirements_on_packages_shared_through_against_bind_the_env() {
    let index = FixtureIndex::start(torch_2_0_1_universe(), FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    // No pin of the user's: the build's `setuptools<82` and `cmake>=3.13,<4` choose the env's versions, which the
    // build then installs.
    let e = torch_horovod_env(&["torch==2.0.1"]);
    let locked = lock(&e, &lock_options(&index, cache.path())).unwrap();
    assert_eq!(
        versions(&locked),
        [
            "cloudpickle==3.0.0",
            "cmake==3.31.6",
            "horovod==0.28.1",
            "nvidia-cudnn-cu11==8.5.0.96",
            "setuptools==81.0.0",
            "torch==2.0.1",
            "triton==2.0.0",
            "wheel==0.43.0",
        ]
    );
    // Everything the build needs is in torch's closure: nothing of its own.
    assert_eq!(locked.builds.len(), 1);
    assert!(
        locked.builds[0].packages.is_empty(),
        "{:?}",
        locked.builds[0]
    );
    locked.check_against(&e).unwrap();

    // Without a build against torch the env takes the newest (the constraint binds only what is shared).
    let plain = lock(
        &env_of(&["torch==2.0.1"]),
        &lock_options(&index, cache.path()),
    )
    .unwrap();
    assert!(versions(&plain).contains(&"setuptools==84.2.1".to_string()));
    assert!(versions(&plain).contains(&"cmake==4.1.0".to_string()));
}

#[test]
fn a_pin_that_conflicts_with_a_shared_build_requirement_names_both() {
    let index = FixtureIndex::start(torch_2_0_1_universe(), FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let e = torch_horovod_env(&["torch==2.0.1", "setuptools==84.2.1"]);
    let err = lock(&e, &lock_options(&index, cache.path()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "no version of setuptools satisfies `setuptools==84.2.1` (asked by the env's packages) and \
             `setuptools<82` (asked by `horovod`'s build, which installs torch and what it needs at the env's versions)"
        ),
        "{err}"
    );
    assert!(
        err.contains("help: change or drop one of those requirements"),
        "{err}"
    );
    assert!(!err.contains('∅'), "{err}");
}

/// The build's `setuptools<82` narrows what torch's CUDA wheel asks (`setuptools`, any version) and the index has only
/// setuptools 84.2.1: PubGrub's report shows the dependent as asking `<82`, so the error names the constraint and who
/// asked it, and suggests no pin outside it (`setuptools==84.2.1` would fail the same way).
#[test]
fn a_shared_build_requirement_no_version_meets_is_named_with_who_asked_and_no_pin_outside_it() {
    let universe: Vec<Dist> = torch_2_0_1_universe()
        .into_iter()
        .filter(|d| !(d.name == "setuptools" && d.version == "81.0.0"))
        .collect();
    let index = FixtureIndex::start(universe, FixtureOptions::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let e = torch_horovod_env(&["torch==2.0.1"]);
    let err = lock(&e, &lock_options(&index, cache.path()))
        .unwrap_err()
        .to_string();
    let words = err.split_whitespace().collect::<Vec<_>>().join(" ");
    let by = "`horovod`'s build, which installs torch and what it needs at the env's versions";
    assert!(
        words.contains(&format!(
            "- `setuptools<82` (asked by {by}) narrows every requirement on setuptools: a package the report shows \
             depending on setuptools in that range may have asked for less"
        )),
        "{err}"
    );
    assert!(
        words.contains(&format!(
            "help: no setuptools usable for cp311 on manylinux x86_64 satisfies `setuptools<82` (asked by {by}); \
             change that requirement where it is asked"
        )),
        "{err}"
    );
    assert!(!err.contains("setuptools==84.2.1"), "{err}");
}
