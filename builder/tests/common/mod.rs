//! Fixtures for the builder's tests: wheels and sdists made on the fly, served over real HTTP on 127.0.0.1.

use std::io::Write;
use std::path::{Path, PathBuf};

use hvd_builder::{Artifact, PackagePlan, Sha256};

/// A static file server on 127.0.0.1 serving one directory; lives as long as the test process.
pub struct FileServer {
    pub root: PathBuf,
    pub base: String,
}

impl FileServer {
    pub fn start(root: &Path) -> FileServer {
        let base = hvd_resolver::testing::file_server::serve_dir(root.to_path_buf(), None);
        FileServer {
            root: root.to_path_buf(),
            base,
        }
    }

    pub fn artifact(&self, filename: &str) -> Artifact {
        let bytes = std::fs::read(self.root.join(filename)).unwrap();
        Artifact {
            url: format!("{}/{filename}", self.base),
            filename: filename.to_string(),
            sha256: Sha256::of_bytes(&bytes),
            size: Some(bytes.len() as u64),
        }
    }

    pub fn wheel_plan(&self, name: &str, version: &str, filename: &str) -> PackagePlan {
        PackagePlan {
            name: name.into(),
            version: version.into(),
            artifact: self.artifact(filename),
            dependencies: Vec::new(),
            build: None,
        }
    }
}

/// RECORD's digest form of `data` (urlsafe base64 of the sha256, no padding).
pub fn record_hash(data: &[u8]) -> String {
    hvd_builder::Sha256::of_bytes(data).record_form()
}

/// Write `<name>-<version>-py3-none-any.whl` into `dir` with `files` plus dist-info (METADATA, WHEEL, RECORD and,
/// when given, entry_points.txt). `files` may use `<name>-<version>.data/...` paths.
pub fn make_wheel(
    dir: &Path,
    name: &str,
    version: &str,
    files: &[(&str, &[u8])],
    entry_points: Option<&str>,
) -> String {
    let files: Vec<(&str, &[u8], bool)> = files
        .iter()
        .map(|(p, d)| (*p, *d, p.contains(".data/scripts/")))
        .collect();
    write_wheel(dir, name, name, version, &files, entry_points)
}

/// Write `<dist>-<version>-py3-none-any.whl` of the project `name` into `dir` (METADATA, WHEEL, RECORD and, when
/// given, entry_points.txt); `files` are (path, bytes, executable).
pub fn write_wheel(
    dir: &Path,
    dist: &str,
    name: &str,
    version: &str,
    files: &[(&str, &[u8], bool)],
    entry_points: Option<&str>,
) -> String {
    let filename = format!("{dist}-{version}-py3-none-any.whl");
    let dist_info = format!("{dist}-{version}.dist-info");
    let mut all: Vec<(String, Vec<u8>, bool)> = files
        .iter()
        .map(|(p, d, x)| (p.to_string(), d.to_vec(), *x))
        .collect();
    all.push((
        format!("{dist_info}/METADATA"),
        format!("Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n").into_bytes(),
        false,
    ));
    all.push((
        format!("{dist_info}/WHEEL"),
        b"Wheel-Version: 1.0\nGenerator: fixture\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            .to_vec(),
        false,
    ));
    if let Some(entry_points) = entry_points {
        all.push((
            format!("{dist_info}/entry_points.txt"),
            entry_points.as_bytes().to_vec(),
            false,
        ));
    }
    let mut record: String = all
        .iter()
        .map(|(p, d, _)| format!("{p},sha256={},{}\n", record_hash(d), d.len()))
        .collect();
    record.push_str(&format!("{dist_info}/RECORD,,\n"));
    all.push((format!("{dist_info}/RECORD"), record.into_bytes(), false));
    let mut writer = zip::ZipWriter::new(std::fs::File::create(dir.join(&filename)).unwrap());
    for (path, data, executable) in all {
        let mode = if executable { 0o755 } else { 0o644 };
        writer
            .start_file(
                path,
                zip::write::SimpleFileOptions::default().unix_permissions(mode),
            )
            .unwrap();
        writer.write_all(&data).unwrap();
    }
    writer.finish().unwrap();
    filename
}

/// Write `<name>-<version>.tar.gz` with `files` under the top directory `<name>-<version>/`.
pub fn make_sdist(dir: &Path, name: &str, version: &str, files: &[(&str, &[u8])]) -> String {
    let filename = format!("{name}-{version}.tar.gz");
    let encoder = flate2::write::GzEncoder::new(
        std::fs::File::create(dir.join(&filename)).unwrap(),
        flate2::Compression::fast(),
    );
    let mut builder = tar::Builder::new(encoder);
    for (path, data) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_cksum();
        builder
            .append_data(&mut header, format!("{name}-{version}/{path}"), *data)
            .unwrap();
    }
    builder.into_inner().unwrap().finish().unwrap();
    filename
}

/// The `major.minor` of `python3` on this machine (the tests' env python).
pub fn host_python() -> String {
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        .output()
        .expect("python3 must be installed for the builder tests");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A PEP 517 in-tree backend (no setuptools needed) that compiles `native.c` against the `fwk` package's header
/// into `<module>_native`, adds `extra_py` as `<module>/__init__.py`, and writes a wheel. `prelude` runs first.
pub fn backend_source(module: &str, version: &str, prelude: &str) -> String {
    format!(
        r#"
import base64, hashlib, os, socket, subprocess, sys, sysconfig, zipfile
NAME, VERSION = {module:?}, {version:?}

def _hash(data):
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
{prelude}
    files = {{}}
    if os.path.exists("native.c"):
        import fwk
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        target = NAME + "_native" + suffix
        subprocess.check_call([os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-O1", "-I", fwk.get_include(),
                               "-I", sysconfig.get_paths()["include"], "native.c", "-o", target])
        with open(target, "rb") as f:
            files[target] = f.read()
    try:
        socket.create_connection(("127.0.0.1", int(open("port.txt").read())), timeout=2).close()
        network = "reachable"
    except Exception:
        network = "unreachable"
    with open("module.py", "rb") as f:
        files[NAME + "/__init__.py"] = f.read()
    files[NAME + "/build_facts.py"] = ("NETWORK = %r\nENV = %r\n" % (network, sorted(os.environ))).encode()
    dist = NAME + "-" + VERSION + ".dist-info"
    files[dist + "/METADATA"] = ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (NAME, VERSION)).encode()
    files[dist + "/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: fixture\nRoot-Is-Purelib: false\nTag: py3-none-any\n"
    record = "".join("%s,sha256=%s,%d\n" % (p, _hash(d), len(d)) for p, d in sorted(files.items()))
    files[dist + "/RECORD"] = (record + dist + "/RECORD,,\n").encode()
    name = NAME + "-" + VERSION + "-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, data in sorted(files.items()):
            z.writestr(zipfile.ZipInfo(path, (1980, 1, 1, 0, 0, 0)), data)
    return name
"#
    )
}

pub const PYPROJECT: &str =
    "[build-system]\nrequires = []\nbuild-backend = \"fixture_backend\"\nbackend-path = [\".\"]\n";

pub const NATIVE_C: &str = r#"#include <Python.h>
#include "fwk.h"
static PyObject* value(PyObject* self, PyObject* args) { return PyLong_FromLong(FWK_VALUE); }
static PyMethodDef methods[] = {{"value", value, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ext_native", NULL, -1, methods};
PyMODINIT_FUNC PyInit_ext_native(void) { return PyModule_Create(&module); }
"#;

/// The fixture framework wheel `fwk` whose header defines `FWK_VALUE` as `value`.
pub fn make_framework(dir: &Path, version: &str, value: u32) -> String {
    let header = format!("#define FWK_VALUE {value}\n");
    make_wheel(
        dir,
        "fwk",
        version,
        &[
            ("fwk/__init__.py", b"import os\ndef get_include():\n    return os.path.join(os.path.dirname(__file__), 'include')\n"),
            ("fwk/include/fwk.h", header.as_bytes()),
        ],
        None,
    )
}

/// Run `python` with `code`; returns stdout (panics with stderr on failure).
pub fn run_python(python: &Path, code: &str) -> String {
    let out = std::process::Command::new(python)
        .args(["-c", code])
        .env_remove("PYTHONPATH")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Builds `plan` in `store` with the default options and no progress output.
pub fn build_default(
    store: &hvd_builder::Store,
    plan: &hvd_builder::EnvPlan,
) -> Result<hvd_builder::EnvBuild, hvd_builder::Error> {
    hvd_builder::build_env(
        store,
        plan,
        &hvd_builder::BuildOptions::default(),
        &hvd_builder::NoProgress,
    )
}

/// Appends a member `name` holding `data` to the zip archive (a wheel) at `archive`, after its RECORD was written:
/// a member RECORD does not list. Python's `zipfile` appends over the old central directory, as a tool adding a
/// file to a wheel does (the zip crate's append mode leaves the old central directory between the members: bytes
/// the reader refuses).
pub fn append_to_zip(archive: &Path, name: &str, data: &[u8]) {
    let mut python = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile\nwith zipfile.ZipFile(sys.argv[1], 'a', zipfile.ZIP_DEFLATED) as z:\n    \
             z.writestr(sys.argv[2], sys.stdin.buffer.read())",
        ])
        .arg(archive)
        .arg(name)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("python3 must be installed for the builder tests");
    python.stdin.take().unwrap().write_all(data).unwrap();
    assert!(
        python.wait().unwrap().success(),
        "appending to {}",
        archive.display()
    );
}

/// A temporary directory whose `files/` is served over HTTP and whose `store/` holds an empty store. The
/// directory must outlive both.
pub fn served_store() -> (tempfile::TempDir, FileServer, hvd_builder::Store) {
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir(&files).unwrap();
    let server = FileServer::start(&files);
    let store = hvd_builder::Store::open(dir.path().join("store")).unwrap();
    (dir, server, store)
}

/// The store's valid paths except interpreter paths (every env build copies its interpreter in first).
pub fn paths_besides_interpreters(store: &hvd_builder::Store) -> Vec<String> {
    store
        .list_paths()
        .unwrap()
        .into_iter()
        .filter(|name| {
            store
                .path_info(&store.root().join(name))
                .unwrap()
                .derivation
                .kind
                != hvd_builder::derivation::DerivationKind::Interpreter
        })
        .collect()
}

/// Every path under `root`, `root` included, links not followed (a link to a directory is listed, not entered).
pub fn walk(root: &Path) -> Vec<PathBuf> {
    walkdir::WalkDir::new(root)
        .follow_links(false)
        .into_iter()
        .map(|entry| entry.unwrap().into_path())
        .collect()
}
