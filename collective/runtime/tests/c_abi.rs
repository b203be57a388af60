//! The C ABI through its header: compiles `tests/c_abi.c` against `include/hvd.h` with the system C compiler
//! (`cc`, installed with the build tools) and runs it against the freshly built `libhvd_runtime.so`.

use std::path::Path;
use std::process::Command;

#[test]
fn a_c_program_uses_the_header_and_the_library() {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let lib_dir = [deps.to_path_buf(), deps.join("..")]
        .into_iter()
        .filter(|d| d.join("libhvd_runtime.so").is_file())
        .max_by_key(|d| {
            d.join("libhvd_runtime.so")
                .metadata()
                .and_then(|m| m.modified())
                .ok()
        })
        .expect("libhvd_runtime.so next to the test executable");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("c_abi");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Werror", "-o"])
        .arg(&program)
        .arg(root.join("tests/c_abi.c"))
        .arg("-I")
        .arg(root.join("include"))
        .arg("-L")
        .arg(&lib_dir)
        .arg("-lhvd_runtime")
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(status.success(), "compiling tests/c_abi.c failed");
    let out = Command::new(&program)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .env_remove("HVD_SIZE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok 0."));
}
