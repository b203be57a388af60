//! Embeds the `hvd` Python package (collective/python/hvd) and the `horovod` compatibility package beside it into the
//! binary, so that `hvd build` can add the worker runtime to every env without looking for the source tree at run
//! time.
//!
//! Release builds also embed `libhvd_runtime.so`, built by a nested cargo into this build script's own target
//! directory: `cargo install` copies only the binary, so an installed `hvd` must carry the library itself. Debug
//! builds (the tests) find the library cargo builds next to them and skip the second build.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("collective/python");
    let mut out = String::new();
    embed_package(&root, "hvd", "PYTHON_FILES", &mut out);
    embed_package(&root, "horovod", "HOROVOD_FILES", &mut out);
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    std::fs::write(out_dir.join("runtime_python.rs"), out).unwrap();
    embed_library(&out_dir);
}

/// Appends `pub const CONSTANT`: the files of the Python package `name` under `root`, as (path relative to
/// site-packages, contents).
fn embed_package(root: &Path, name: &str, constant: &str, out: &mut String) {
    println!("cargo:rerun-if-changed={}", root.join(name).display());
    let mut files = Vec::new();
    collect(root, &root.join(name), &mut files);
    files.sort();
    writeln!(
        out,
        "/// The `{name}` Python package: (path relative to site-packages, contents)."
    )
    .unwrap();
    writeln!(out, "pub const {constant}: &[(&str, &str)] = &[").unwrap();
    for (relative, absolute) in &files {
        println!("cargo:rerun-if-changed={absolute}");
        writeln!(out, "    ({relative:?}, include_str!({absolute:?})),").unwrap();
    }
    out.push_str("];\n");
}

/// Writes `runtime_library.rs`: `EMBEDDED_LIBRARY`, the release build of `libhvd_runtime.so` or `None`.
fn embed_library(out_dir: &Path) {
    println!("cargo:rerun-if-env-changed=HVD_EMBED_RUNTIME");
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    let wanted = std::env::var("HVD_EMBED_RUNTIME").map_or(release, |v| v != "0");
    let dest = out_dir.join("runtime_library.rs");
    if !wanted {
        std::fs::write(dest, "pub const EMBEDDED_LIBRARY: Option<&[u8]> = None;\n").unwrap();
        return;
    }
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    for input in [
        "Cargo.lock",
        "Cargo.toml",
        "collective/Cargo.toml",
        "collective/src",
        "collective/runtime/Cargo.toml",
        "collective/runtime/src",
    ] {
        let path = manifest_dir.join(input);
        if path.is_dir() {
            watch(&path);
        } else {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    let target_dir = out_dir.join("runtime-target");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = std::process::Command::new(cargo);
    command
        .args([
            "build",
            "--release",
            "--locked",
            "-p",
            "hvd-runtime",
            "--manifest-path",
        ])
        .arg(manifest_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir);
    let features: Vec<&str> = [
        ("mpi", "hvd-collective/mpi"),
        ("nccl", "hvd-collective/nccl"),
    ]
    .into_iter()
    .filter(|(name, _)| {
        std::env::var_os(format!("CARGO_FEATURE_{}", name.to_uppercase())).is_some()
    })
    .map(|(_, feature)| feature)
    .collect();
    if !features.is_empty() {
        command.arg("--features").arg(features.join(","));
    }
    // The outer build's settings for this crate must not leak into the nested one.
    for var in [
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET_DIR",
        "RUSTC_WRAPPER",
        "CARGO_ENCODED_RUSTFLAGS",
    ] {
        command.env_remove(var);
    }
    let status = command
        .status()
        .unwrap_or_else(|err| panic!("failed to run cargo to build libhvd_runtime.so: {err}"));
    assert!(
        status.success(),
        "building libhvd_runtime.so for embedding failed ({status}); set HVD_EMBED_RUNTIME=0 to skip it"
    );
    let library = target_dir.join("release").join("libhvd_runtime.so");
    std::fs::write(
        dest,
        format!(
            "pub const EMBEDDED_LIBRARY: Option<&[u8]> = Some(include_bytes!({:?}));\n",
            library.display().to_string()
        ),
    )
    .unwrap();
}

fn watch(dir: &Path) {
    println!("cargo:rerun-if-changed={}", dir.display());
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            watch(&path);
        } else {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

fn collect(root: &Path, dir: &Path, files: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "__pycache__") {
                collect(root, &path, files);
            }
        } else if path.extension().is_some_and(|e| e == "py") {
            let relative = path
                .strip_prefix(root)
                .unwrap()
                .to_str()
                .unwrap()
                .to_owned();
            files.push((relative, path.to_str().unwrap().to_owned()));
        }
    }
}
