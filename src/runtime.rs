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

/// The `env { variables }` entry that keeps the `horovod` compatibility package out of an env: `= "0"`.
pub const HOROVOD_COMPAT: &str = crate::env_vars::HVD_HOROVOD_COMPAT;

/// Whether an env gets the `horovod` compatibility package (collective/python/horovod and the `horovodrun`
/// command): not when it locks the real Horovod (a package named `horovod`: `std.horovod` or a plain requirement),
/// so the shim never shadows it, and not when its variables set [`HOROVOD_COMPAT`] to `"0"`.
pub fn wants_horovod_compat<'a>(
    mut locked: impl Iterator<Item = &'a str>,
    variables: &std::collections::BTreeMap<String, String>,
) -> bool {
    let real_horovod = locked.any(|name| name.eq_ignore_ascii_case("horovod"));
    !real_horovod && variables.get(HOROVOD_COMPAT).is_none_or(|v| v != "0")
}

/// Stage the runtime package: the embedded Python files plus the shared library found by [`library`]; with
/// `horovod`, also the `horovod` package and a dist-info whose entry point makes the env's `bin/horovodrun`.
pub fn stage(horovod: bool) -> Result<Staged, Failure> {
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
    let mut files: Vec<(String, &str)> = PYTHON_FILES
        .iter()
        .map(|(relative, contents)| ((*relative).to_owned(), *contents))
        .collect();
    if horovod {
        files.extend(
            HOROVOD_FILES
                .iter()
                .map(|(relative, contents)| ((*relative).to_owned(), *contents)),
        );
        files.extend(compat_dist_info());
    }
    for (relative, contents) in files {
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

/// The dist-info of the compatibility package: not named `horovod` (the real Horovod is not installed, and
/// `importlib.metadata` says so), with the `horovodrun` console script.
fn compat_dist_info() -> [(String, &'static str); 2] {
    let dir = format!("hvd_horovod_compat-{}.dist-info", env!("CARGO_PKG_VERSION"));
    [
        (
            format!("{dir}/METADATA"),
            concat!(
                "Metadata-Version: 2.1\nName: hvd-horovod-compat\nVersion: ",
                env!("CARGO_PKG_VERSION"),
                "\nSummary: Horovod's module names and horovodrun over hvd's runtime\n"
            ),
        ),
        (
            format!("{dir}/entry_points.txt"),
            "[console_scripts]\nhorovodrun = horovod.runner.launch:run_commandline\n",
        ),
    ]
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn the_horovod_compat_package_never_shadows_the_real_horovod_and_can_be_turned_off() {
        let none = BTreeMap::new();
        assert!(wants_horovod_compat(["numpy", "torch"].into_iter(), &none));
        assert!(!wants_horovod_compat(
            ["numpy", "horovod"].into_iter(),
            &none
        ));
        assert!(!wants_horovod_compat(["Horovod"].into_iter(), &none));
        let off = BTreeMap::from([(HOROVOD_COMPAT.to_owned(), "0".to_owned())]);
        assert!(!wants_horovod_compat(["torch"].into_iter(), &off));
        let on = BTreeMap::from([(HOROVOD_COMPAT.to_owned(), "1".to_owned())]);
        assert!(wants_horovod_compat(["torch"].into_iter(), &on));
    }

    #[test]
    fn the_compat_dist_info_names_horovodrun_and_not_horovod() {
        let [(metadata, text), (entry_points, scripts)] = compat_dist_info();
        assert!(metadata.ends_with(".dist-info/METADATA"), "{metadata}");
        assert!(text.contains("Name: hvd-horovod-compat\n"), "{text}");
        assert!(entry_points.ends_with(".dist-info/entry_points.txt"));
        assert!(
            scripts.contains("horovodrun = horovod.runner.launch:run_commandline"),
            "{scripts}"
        );
        let launch = HOROVOD_FILES
            .iter()
            .find(|(path, _)| *path == "horovod/runner/launch.py")
            .expect("the launcher is embedded");
        assert!(launch.1.contains("def run_commandline("));
    }
}
