//! The worker runtime every env gets: the `hvd` Python package (embedded in this binary by build.rs) with
//! `libhvd_runtime.so` inside it. Release builds carry the library too (build.rs), so an installed `hvd` needs
//! nothing beside it; debug builds use the one cargo builds next to them (`hvd` depends on the `hvd-runtime`
//! cdylib, so a `cargo build` of hvd always has a matching one).

use std::path::{Path, PathBuf};

use crate::exit::Failure;

include!(concat!(env!("OUT_DIR"), "/runtime_python.rs"));
include!(concat!(env!("OUT_DIR"), "/runtime_library.rs"));

const LIBRARY: &str = "libhvd_runtime.so";

/// A directory holding `hvd/...` ready to become the env's `hvd` package; removed when dropped.
pub enum Staged {
    /// `HVD_RUNTIME_DIR`: a directory the user staged (development override).
    Given(PathBuf),
    Temporary(tempfile::TempDir),
}

impl Staged {
    pub fn path(&self) -> &Path {
        match self {
            Staged::Given(path) => path,
            Staged::Temporary(dir) => dir.path(),
        }
    }
}

/// Stage the runtime package: the embedded Python files plus the shared library found by [`library`].
pub fn stage() -> Result<Staged, Failure> {
    if let Some(dir) = std::env::var_os(crate::env_vars::HVD_RUNTIME_DIR).filter(|d| !d.is_empty())
    {
        return Ok(Staged::Given(PathBuf::from(dir)));
    }
    let library = library()?;
    let dir = tempfile::Builder::new()
        .prefix("hvd-runtime-")
        .tempdir()
        .map_err(|err| {
            Failure::from_error_in(
                crate::exit::Status::Failure,
                "failed to create a temporary directory",
                &err,
            )
        })?;
    let io = |what: &str, path: &Path, err: std::io::Error| {
        Failure::from_error_in(
            crate::exit::Status::Failure,
            format_args!("failed to {what} `{}`", path.display()),
            &err,
        )
    };
    for (relative, contents) in PYTHON_FILES {
        let path = dir.path().join(relative);
        let parent = path
            .parent()
            .expect("embedded paths are inside the package");
        std::fs::create_dir_all(parent).map_err(|err| io("create", parent, err))?;
        std::fs::write(&path, contents).map_err(|err| io("write", &path, err))?;
    }
    let lib_dir = dir.path().join("hvd").join("lib");
    std::fs::create_dir_all(&lib_dir).map_err(|err| io("create", &lib_dir, err))?;
    let dest = lib_dir.join(LIBRARY);
    match library {
        Library::Embedded(bytes) => {
            std::fs::write(&dest, bytes).map_err(|err| io("write", &dest, err))?;
        }
        // A hard link costs nothing when the temp dir shares the target dir's file system; else copy.
        Library::File(library) => {
            if std::fs::hard_link(&library, &dest).is_err() {
                std::fs::copy(&library, &dest).map_err(|err| io("copy", &library, err))?;
            }
        }
    }
    Ok(Staged::Temporary(dir))
}

/// Where the worker runtime library comes from.
pub enum Library {
    File(PathBuf),
    /// Built into this binary (release builds).
    Embedded(&'static [u8]),
}

/// `HVD_RUNTIME_LIBRARY`, else the library built into this binary, else the newest `libhvd_runtime.so` next to
/// this executable, in its `deps/` (cargo's layout: `deps/` always holds the latest build, the copy next to the
/// executable only the one of the last `cargo build -p hvd-runtime`) or in `../lib/hvd`.
pub fn library() -> Result<Library, Failure> {
    if let Some(path) =
        std::env::var_os(crate::env_vars::HVD_RUNTIME_LIBRARY).filter(|p| !p.is_empty())
    {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(Library::File(path));
        }
        return Err(Failure::usage(format!(
            "{} names `{}`, which is not a file; unset it or point it at libhvd_runtime.so",
            crate::env_vars::HVD_RUNTIME_LIBRARY,
            path.display()
        )));
    }
    if let Some(bytes) = EMBEDDED_LIBRARY {
        return Ok(Library::Embedded(bytes));
    }
    let exe = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.canonicalize().ok());
    let dir = exe.as_deref().and_then(Path::parent);
    let candidates: Vec<PathBuf> = dir
        .map(|dir| {
            vec![
                dir.join(LIBRARY),
                dir.join("deps").join(LIBRARY),
                dir.join("../lib/hvd").join(LIBRARY),
            ]
        })
        .unwrap_or_default();
    let modified = |path: &PathBuf| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let newest = candidates
        .iter()
        .filter(|path| path.is_file())
        .max_by_key(|path| modified(path));
    newest.cloned().map(Library::File).ok_or_else(|| {
        Failure::usage(format!(
            "cannot find the worker runtime library {LIBRARY} (looked in: {})\n\
             help: build it with `cargo build --release -p hvd-runtime`, or set HVD_RUNTIME_LIBRARY to its path",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ))
    })
}
