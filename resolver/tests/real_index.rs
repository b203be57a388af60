//! Opt-in: lock against the real package index (the one pip is configured with). Run with
//! `cargo nextest run -p hvd-resolver --test real_index --run-ignored only`. Needs network access.

use std::collections::BTreeMap;

use hvd_lang::model::{Env, PackageRequest};
use hvd_resolver::lockfile::ArtifactKind;
use hvd_resolver::{LockOptions, lock_detailed};

#[test]
#[ignore = "opt-in: locks against the real package index; run with --run-ignored only"]
fn tensorflow_cpu_2_12_1_on_python_3_11() {
    let env = Env {
        python: "3.11".into(),
        index: None,
        toolchain: None,
        packages: vec![PackageRequest {
            requirement: "tensorflow-cpu==2.12.1".into(),
            build: None,
        }],
        variables: BTreeMap::new(),
    };
    let cache = tempfile::tempdir().unwrap();
    let options = LockOptions {
        cache_dir: Some(cache.path().to_path_buf()),
        ..LockOptions::default()
    };
    let cold = lock_detailed(&env, &options).unwrap();
    let lock = &cold.lockfile;
    assert_eq!(
        lock.packages.len(),
        45,
        "{:?}",
        lock.packages.iter().map(|p| &p.name).collect::<Vec<_>>()
    );
    let tf = lock.package("tensorflow-cpu").unwrap();
    assert_eq!(tf.version, "2.12.1");
    assert_eq!(tf.artifact.kind, ArtifactKind::Wheel);
    assert!(
        tf.artifact.filename.contains("cp311"),
        "{}",
        tf.artifact.filename
    );
    assert!(
        lock.packages
            .iter()
            .all(|p| p.artifact.sha256.as_str().len() == 64 && p.artifact.size > 0)
    );
    // A few KB per wheel by range, not the 200+ MB tensorflow wheel.
    assert!(cold.stats.bytes < 200_000_000, "{} bytes", cold.stats.bytes);

    // Relock from the cache with the lock as preferences: same bytes.
    let warm = lock_detailed(
        &env,
        &LockOptions {
            existing: Some(lock.clone()),
            ..options.clone()
        },
    )
    .unwrap();
    assert_eq!(warm.lockfile.to_toml(), lock.to_toml());
    let offline = lock_detailed(
        &env,
        &LockOptions {
            offline: true,
            ..options
        },
    )
    .unwrap();
    assert_eq!(offline.lockfile.to_toml(), lock.to_toml());
    assert_eq!(offline.stats.requests, 0);
}
