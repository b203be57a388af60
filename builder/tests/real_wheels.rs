//! Opt-in (`HVD_TEST_WHEELS=DIR`, needs the wheels there, e.g. `pip download --no-deps --only-binary=:all: -d DIR
//! numpy tensorflow-cpu ...`, which needs the index): every `*.whl` in DIR, real wheels as their build tools wrote
//! them (zipfile, Rust's zip crate, ...), unpacks through the zip reader with every structural check of a hostile
//! archive (names, local headers, sizes, stray bytes, end records); prints each one's entries and time. Without the
//! variable it says so and checks nothing.

use std::path::PathBuf;
use std::time::Instant;

use hvd_builder::unpack::{Options, unpack_zip};

#[test]
fn real_wheels_pass_the_zip_readers_checks() {
    let Some(dir) = std::env::var_os("HVD_TEST_WHEELS").map(PathBuf::from) else {
        eprintln!(
            "HVD_TEST_WHEELS is not set: no real wheels checked (opt-in, see the module docs)"
        );
        return;
    };
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("HVD_TEST_WHEELS={}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    wheels.sort();
    assert!(!wheels.is_empty(), "no *.whl in {}", dir.display());
    let mut refused = Vec::new();
    for wheel in &wheels {
        let dest = tempfile::tempdir().unwrap();
        let options = Options {
            hash: true,
            ..Options::default()
        };
        let started = Instant::now();
        match unpack_zip(wheel, &dest.path().join("t"), options) {
            Ok(extracted) => println!(
                "{:>8.1} ms {:>6} files  {}",
                started.elapsed().as_secs_f64() * 1e3,
                extracted.len(),
                wheel.file_name().unwrap_or_default().to_string_lossy()
            ),
            Err(e) => refused.push(format!("{}: {e}", wheel.display())),
        }
    }
    assert!(refused.is_empty(), "{refused:#?}");
}
