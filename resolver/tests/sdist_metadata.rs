//! The resolver's side of building sdist metadata (issue 21 item 3): what it hands a `SourceMetadataProvider`,
//! that it caches the answer by the sdist's sha256, and what it says without a provider. The builder's sandboxed
//! provider itself is tested through the CLI (`tests/cli_sdist_metadata.rs`).

use std::sync::{Arc, Mutex};

use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions, env_of, lock_options};
use hvd_resolver::{
    BoxError, LockOptions, Locked, SourceMetadataProvider, SourceMetadataRequest, lock_detailed,
};

/// One request as the provider saw it: (package, sdist file name, python, sorted `name==version` build packages).
type Call = (String, String, String, Vec<String>);

/// Answers as a backend would for the one sdist of these tests, and records each request.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<Call>>,
    fail: bool,
    /// What the backend writes instead of widget's metadata (a backend that lies).
    answer: Option<&'static str>,
}

impl SourceMetadataProvider for Recorder {
    fn metadata(&self, request: &SourceMetadataRequest<'_>) -> Result<Vec<u8>, BoxError> {
        let mut build: Vec<String> = request
            .build_packages
            .iter()
            .map(|p| format!("{}=={}", p.name, p.version))
            .collect();
        build.sort();
        self.calls.lock().unwrap().push((
            request.name.to_string(),
            request.sdist.filename.clone(),
            request.python.to_string(),
            build,
        ));
        if self.fail {
            return Err("the backend said no".into());
        }
        let widget = "Metadata-Version: 2.1\nName: widget\nVersion: 1.0\nRequires-Dist: dep>=1\n";
        Ok(self.answer.unwrap_or(widget).as_bytes().to_vec())
    }
}

fn index() -> FixtureIndex {
    index_with(Dist::wheel("setuptools", "69.0.0"))
}

/// widget's sdist (no static dependencies), `dep`, `wheel` and `setuptools` as given.
fn index_with(setuptools: Dist) -> FixtureIndex {
    FixtureIndex::start(
        vec![
            Dist::sdist("widget", "1.0")
                .legacy_metadata()
                .without_pyproject(),
            Dist::wheel("dep", "1.0"),
            setuptools,
            Dist::wheel("wheel", "0.43.0"),
        ],
        FixtureOptions::default(),
    )
    .unwrap()
}

/// The locked runtime packages' names.
fn names(locked: &Locked) -> Vec<&str> {
    locked
        .lockfile
        .packages
        .iter()
        .map(|p| p.name.as_str())
        .collect()
}

fn with_provider(options: LockOptions, provider: &Arc<Recorder>) -> LockOptions {
    let provider: Arc<dyn SourceMetadataProvider> = provider.clone();
    LockOptions {
        source_metadata: Some(provider),
        ..options
    }
}

#[test]
fn the_provider_gets_the_locked_build_requirements_and_its_answer_is_cached() {
    let index = index();
    let cache = tempfile::tempdir().unwrap();
    let recorder = Arc::new(Recorder::default());
    let options = with_provider(lock_options(&index, cache.path()), &recorder);
    let locked = lock_detailed(&env_of(&["widget"]), &options).unwrap();
    assert_eq!(names(&locked), ["dep", "widget"]);
    assert!(locked.warnings.is_empty(), "{:?}", locked.warnings);
    assert_eq!(
        *recorder.calls.lock().unwrap(),
        [(
            "widget".to_string(),
            "widget-1.0.tar.gz".to_string(),
            "3.11".to_string(),
            vec![
                "setuptools==69.0.0".to_string(),
                "wheel==0.43.0".to_string()
            ],
        )]
    );

    // Another lock with the same cache: the built metadata comes from it, nothing is built again.
    let again = lock_detailed(&env_of(&["widget"]), &options).unwrap();
    assert_eq!(again.lockfile.packages, locked.lockfile.packages);
    assert_eq!(recorder.calls.lock().unwrap().len(), 1);
}

#[test]
fn a_failing_provider_fails_the_lock_naming_the_package_and_keeping_the_cause() {
    let index = index();
    let cache = tempfile::tempdir().unwrap();
    let recorder = Arc::new(Recorder {
        fail: true,
        ..Recorder::default()
    });
    let options = with_provider(lock_options(&index, cache.path()), &recorder);
    let err = lock_detailed(&env_of(&["widget"]), &options).unwrap_err();
    assert!(err.to_string().contains("widget==1.0"), "{err}");
    let chain = error_chain(&err);
    assert_eq!(
        chain.last().map(String::as_str),
        Some("the backend said no"),
        "{chain:?}"
    );
    // Not cached: the next lock asks again.
    let _ = lock_detailed(&env_of(&["widget"]), &options);
    assert_eq!(recorder.calls.lock().unwrap().len(), 2);
}

#[test]
fn without_a_provider_the_assumption_is_one_warning_for_the_caller() {
    let index = index();
    let cache = tempfile::tempdir().unwrap();
    let locked = lock_detailed(&env_of(&["widget"]), &lock_options(&index, cache.path())).unwrap();
    assert_eq!(names(&locked), ["widget"]);
    assert_eq!(locked.warnings.len(), 1, "{:?}", locked.warnings);
    assert!(
        locked.warnings[0].contains("widget==1.0")
            && locked.warnings[0].contains("as if it had none"),
        "{:?}",
        locked.warnings
    );
}

/// The sdist's locked sha256.
fn widget_sha256(locked: &Locked) -> String {
    let widget = locked.lockfile.packages.iter().find(|p| p.name == "widget");
    widget.unwrap().artifact.sha256.as_str().to_string()
}

#[test]
fn one_index_s_built_metadata_never_answers_for_another_index() {
    // The attacker's index serves the same sdist bytes (same sha256) with build requirements of its choosing; what
    // its build wrote must not be what a lock against another index reads from the shared cache.
    let (hostile, trusted) = (index(), index());
    let cache = tempfile::tempdir().unwrap();
    let (at_hostile, at_trusted) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
    let first = lock_detailed(
        &env_of(&["widget"]),
        &with_provider(lock_options(&hostile, cache.path()), &at_hostile),
    )
    .unwrap();
    let second = lock_detailed(
        &env_of(&["widget"]),
        &with_provider(lock_options(&trusted, cache.path()), &at_trusted),
    )
    .unwrap();
    assert_eq!(widget_sha256(&first), widget_sha256(&second));
    assert_eq!(at_hostile.calls.lock().unwrap().len(), 1);
    assert_eq!(
        at_trusted.calls.lock().unwrap().len(),
        1,
        "the trusted index's lock built its own"
    );
}

#[test]
fn metadata_of_another_package_is_refused_and_not_cached() {
    let index = index();
    let cache = tempfile::tempdir().unwrap();
    let recorder = Arc::new(Recorder {
        answer: Some("Metadata-Version: 2.1\nName: gadget\nVersion: 1.0\nRequires-Dist: evil\n"),
        ..Recorder::default()
    });
    let options = with_provider(lock_options(&index, cache.path()), &recorder);
    let err = lock_detailed(&env_of(&["widget"]), &options).unwrap_err();
    let chain = format!("{:?}", error_chain(&err));
    assert!(
        chain.contains("widget==1.0") && chain.contains("`gadget 1.0`, not of this sdist"),
        "{chain}"
    );
    let _ = lock_detailed(&env_of(&["widget"]), &options);
    assert_eq!(
        recorder.calls.lock().unwrap().len(),
        2,
        "nothing was cached"
    );
}

#[test]
fn a_build_requirement_that_needs_its_own_metadata_built_is_a_cycle_not_a_stack_overflow() {
    // The index offers setuptools only as an sdist without static metadata: building its metadata needs
    // setuptools, whose metadata needs building...
    let index = index_with(
        Dist::sdist("setuptools", "69.0.0")
            .legacy_metadata()
            .without_pyproject(),
    );
    let cache = tempfile::tempdir().unwrap();
    let recorder = Arc::new(Recorder::default());
    let options = with_provider(lock_options(&index, cache.path()), &recorder);
    let err = lock_detailed(&env_of(&["widget"]), &options).unwrap_err();
    let chain = format!("{:?}", error_chain(&err));
    assert!(
        chain.contains("setuptools==69.0.0") && chain.contains("a cycle"),
        "{chain}"
    );
    assert!(recorder.calls.lock().unwrap().is_empty());
}

/// Every message of `err`'s source chain.
fn error_chain(err: &dyn std::error::Error) -> Vec<String> {
    let mut chain = Vec::new();
    let mut link: Option<&dyn std::error::Error> = Some(err);
    while let Some(e) = link {
        chain.push(e.to_string());
        link = e.source();
    }
    chain
}
