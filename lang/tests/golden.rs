//! Golden files: `tests/ok/*.hvd` evaluate to the snapshotted model; `tests/fail/*.hvd` fail with the
//! snapshotted diagnostics (rendered without colour at a fixed width, so snapshots are stable).

use std::path::{Path, PathBuf};

fn hvd_files(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(Path::new("tests").join(dir))
        .unwrap_or_else(|e| panic!("cannot list tests/{dir}: {e}"))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "hvd"))
        .collect();
    files.sort();
    files
}

#[test]
fn ok_files_evaluate_to_their_model() {
    let files = hvd_files("ok");
    assert!(!files.is_empty());
    for path in files {
        let project = match hvd_lang::load_file(&path) {
            Ok(p) => p,
            Err(d) => panic!("{} failed:\n{}", path.display(), d.render_plain()),
        };
        let name = path
            .file_stem()
            .expect("stem")
            .to_string_lossy()
            .into_owned();
        insta::assert_json_snapshot!(format!("ok__{name}"), project);
    }
}

#[test]
fn fail_files_report_their_diagnostics() {
    let files = hvd_files("fail");
    assert!(!files.is_empty());
    for path in files {
        let diagnostics = match hvd_lang::load_file(&path) {
            Ok(_) => panic!("{} should fail", path.display()),
            Err(d) => d,
        };
        let name = path
            .file_stem()
            .expect("stem")
            .to_string_lossy()
            .into_owned();
        insta::assert_snapshot!(format!("fail__{name}"), diagnostics.render_plain());
    }
}
