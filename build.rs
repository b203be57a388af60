//! Embeds the `hvd` Python package (collective/python/hvd) into the binary, so that `hvd build` can add the worker
//! runtime to every env without looking for the source tree at run time.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("collective/python");
    println!("cargo:rerun-if-changed={}", root.join("hvd").display());
    let mut files = Vec::new();
    collect(&root, &root.join("hvd"), &mut files);
    files.sort();
    let mut out =
        String::from("/// The `hvd` Python package: (path relative to site-packages, contents).\n");
    out.push_str("pub const PYTHON_FILES: &[(&str, &str)] = &[\n");
    for (relative, absolute) in &files {
        println!("cargo:rerun-if-changed={absolute}");
        writeln!(out, "    ({relative:?}, include_str!({absolute:?})),").unwrap();
    }
    out.push_str("];\n");
    let dest = Path::new(&std::env::var("OUT_DIR").unwrap()).join("runtime_python.rs");
    std::fs::write(dest, out).unwrap();
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
