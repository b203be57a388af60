//! Helpers shared by the engine tests (`mod common;` in each test binary; each uses a different part).
#![allow(
    dead_code,
    reason = "each test binary uses a different part of this module"
)]

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const HVD: &str = env!("CARGO_BIN_EXE_hvd");

/// stdout and stderr of `out` as text.
pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A temporary project whose train.hvd holds an env with no packages and `step`.
pub fn project(step: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("project \"t\"\nenv {{\n  python = \"3.11\"\n  packages = []\n}}\n{step}\n");
    std::fs::write(dir.path().join("train.hvd"), text).unwrap();
    dir
}

/// What the allreduce workers of these tests need outside an env: (a python3 with numpy, the `hvd` Python
/// package's directory for PYTHONPATH, `libhvd_runtime.so` for HVD_LIBRARY).
pub fn allreduce_runtime() -> (String, PathBuf, PathBuf) {
    // Cargo builds the runtime library with the binary (hvd depends on hvd-runtime): always in `deps/`, and at the
    // top of the target dir after a `cargo build -p hvd-runtime` (possibly older): the newest one.
    let lib = [
        Path::new(HVD).with_file_name("libhvd_runtime.so"),
        Path::new(HVD)
            .with_file_name("deps")
            .join("libhvd_runtime.so"),
    ]
    .into_iter()
    .filter(|lib| lib.is_file())
    .max_by_key(|lib| std::fs::metadata(lib).and_then(|m| m.modified()).ok())
    .expect("libhvd_runtime.so is built with the hvd binary");
    let python = Command::new("python3")
        .args(["-c", "import numpy, sys; print(sys.executable)"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| text(&o).0.trim().to_owned())
        .expect("python3 with numpy (scripts/install-deps installs it)");
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("collective/python");
    (python, package, lib)
}

/// The `env = { ... }` entry of a step that runs the allreduce worker outside an env.
pub fn allreduce_step_env(package: &Path, lib: &Path) -> String {
    format!(
        "env = {{ PYTHONPATH = \"{}\", HVD_LIBRARY = \"{}\" }}",
        package.display(),
        lib.display()
    )
}

/// Serves the files under `root` over HTTP on 127.0.0.1 (one request per connection, 404 for what is missing);
/// returns the base URL.
pub fn serve_files(root: PathBuf) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            let _ = reader.read_line(&mut request);
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 2 {
                line.clear();
            }
            let path = request.split_whitespace().nth(1).unwrap_or("/");
            let response = match std::fs::read(root.join(path.trim_start_matches('/'))) {
                Ok(body) => {
                    let mut out = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    )
                    .into_bytes();
                    out.extend(body);
                    out
                }
                Err(_) => {
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        .to_vec()
                }
            };
            let _ = stream.write_all(&response);
        }
    });
    base
}
