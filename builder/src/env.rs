//! Assembling a venv-layout environment from package store paths.
//!
//! ```text
//! <env>/pyvenv.cfg                              home = <interpreter path>/bin, include-system-site-packages = false
//! <env>/bin/python -> <interpreter path>/bin/pythonX.Y   (the interpreter's store path, `interpreter.rs`)
//!                                               python3, pythonX.Y -> python
//! <env>/bin/<script>                            console scripts and `.data/scripts`, shebang = <env>/bin/python
//! <env>/lib/pythonX.Y/site-packages/<entry>     symlinks into package paths; directories two packages share
//!                                               (namespace packages) become real directories, merged recursively
//! <env>/lib64 -> lib
//! ```
//! `.pth` files are linked into site-packages like any file, so Python's `site` processes them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::python::Interpreter;
use crate::store::BuildTarget;
use crate::wheel;

/// The relative site-packages directory of an env.
pub(crate) fn site_packages(python: &Interpreter) -> PathBuf {
    PathBuf::from("lib")
        .join(format!("python{}", python.short_version))
        .join("site-packages")
}

/// Fill `target.out` with an env over `packages` (package store paths, in priority order: on a file conflict the
/// first wins). `pycache` is where the env's interpreters write bytecode, keeping store paths unmodified.
pub(crate) fn assemble_env(
    target: &BuildTarget,
    python: &Interpreter,
    packages: &[PathBuf],
    pycache: &Path,
) -> Result<()> {
    let out = &target.out;
    let bin = out.join("bin");
    fs_err::create_dir_all(&bin)?;
    let site = out.join(site_packages(python));
    fs_err::create_dir_all(&site)?;
    if python.short_version.starts_with("2.") {
        python2_layout(out, python, packages)?;
    } else {
        symlink(&python.executable, &bin.join("python"))?;
    }
    for alias in [
        "python3".to_string(),
        format!("python{}", python.short_version),
    ] {
        symlink(Path::new("python"), &bin.join(alias))?;
    }
    symlink(Path::new("lib"), &out.join("lib64"))?;
    let home = python.executable.parent().unwrap_or(Path::new("/"));
    let cfg = format!(
        "home = {}\ninclude-system-site-packages = false\nversion = {}\nexecutable = {}\ncommand = hvd build\n",
        home.display(),
        python.version,
        python.executable.display()
    );
    hvd_file(&out.join("pyvenv.cfg"), cfg.as_bytes(), 0o644, packages)?;

    for package in packages {
        let package_site = package.join("site-packages");
        if package_site.is_dir() {
            link_tree(&package_site, &site)?;
        }
    }

    // Scripts: `#!python` shebangs point at this env; console scripts are generated from entry points.
    let env_python = target.final_path.join("bin").join("python");
    let mut taken: BTreeSet<String> = ["python", "python3"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    taken.insert(format!("python{}", python.short_version));
    for package in packages {
        let scripts = package.join("scripts");
        if scripts.is_dir() {
            let mut entries: Vec<_> = fs_err::read_dir(&scripts)?.filter_map(|e| e.ok()).collect();
            entries.sort_by_key(|e| e.file_name());
            for entry in entries {
                let name = entry.file_name().to_string_lossy().into_owned();
                if !taken.insert(name.clone()) {
                    continue;
                }
                let bytes = fs_err::read(entry.path())?;
                let dest = bin.join(&name);
                if let Some(rest) = bytes.strip_prefix(b"#!python") {
                    let rest = rest.strip_prefix(b"w").unwrap_or(rest);
                    let mut script = format!("#!{}", env_python.display()).into_bytes();
                    script.extend_from_slice(rest);
                    hvd_file(&dest, &script, 0o755, packages)?;
                } else {
                    symlink(&entry.path(), &dest)?;
                }
            }
        }
        let package_site = package.join("site-packages");
        if let Some(dist_info) = wheel::find_suffix_dir(&package_site, ".dist-info")
            .ok()
            .flatten()
        {
            let entry_points = dist_info.join("entry_points.txt");
            if entry_points.is_file() {
                for point in wheel::parse_entry_points(&fs_err::read_to_string(&entry_points)?) {
                    if !taken.insert(point.name.clone()) {
                        continue;
                    }
                    let dest = bin.join(&point.name);
                    let script = wheel::entry_point_script(&env_python, &point);
                    hvd_file(&dest, script.as_bytes(), 0o755, packages)?;
                }
            }
        }
    }

    // Bytecode goes to a shared cache outside the (read-only, immutable) store paths. `sys.pycache_prefix` exists
    // from 3.8 on; before that no bytecode is written at all (a root process could otherwise write `__pycache__`
    // into a store path). One line, valid and silent on 2.7 to 3.13: `site` executes `.pth` lines starting with
    // `import` on every version.
    let pth = pycache_pth_line(pycache);
    hvd_file(&site.join(PYCACHE_PTH), pth.as_bytes(), 0o644, packages)?;
    let activate = format!(
        "# source this file: puts the env first on PATH\nexport VIRTUAL_ENV={root}\nexport PATH={root}/bin:\"$PATH\"\nunset PYTHONHOME\n",
        root = target.final_path.display()
    );
    hvd_file(&bin.join("activate"), activate.as_bytes(), 0o644, packages)?;
    Ok(())
}

/// Python 2 reads no `pyvenv.cfg` and finds its prefix from the real path of its executable (symlinks resolved)
/// by looking for `lib/python2.7/os.py` above it. So `bin/python` is a copy of the (small, libpython-linked)
/// executable and `lib/python2.7/` links every entry of the interpreter's standard library except its
/// `site-packages`: `sys.prefix` is then the env, and the interpreter's own `site.py` adds the env's site-packages
/// and processes its `.pth` files.
fn python2_layout(out: &Path, python: &Interpreter, packages: &[PathBuf]) -> Result<()> {
    let stdlib = python
        .executable
        .parent()
        .and_then(Path::parent)
        .map(|prefix| {
            prefix
                .join("lib")
                .join(format!("python{}", python.short_version))
        })
        .filter(|stdlib| stdlib.join("os.py").is_file())
        .ok_or_else(|| {
            Error::Invalid(format!(
                "python {} at `{}`: its standard library (<prefix>/lib/python{}/os.py next to bin/) was not \
                 found, so no env can be made for it; use a python 3 or a python {} installed with its prefix \
                 layout (pyenv's, /usr)",
                python.version,
                python.executable.display(),
                python.short_version,
                python.short_version
            ))
        })?;
    let executable = fs_err::read(&python.executable)?;
    hvd_file(&out.join("bin/python"), &executable, 0o755, packages)?;
    // The copy's RUNPATH is `$ORIGIN/../lib` (relocated in the interpreter's store path): the env's `lib/` links
    // the interpreter's shared libpython.
    if let Some(prefix_lib) = stdlib.parent() {
        let mut libraries: Vec<_> = fs_err::read_dir(prefix_lib)?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("libpython"))
            .collect();
        libraries.sort_by_key(|e| e.file_name());
        for library in libraries {
            symlink(&library.path(), &out.join("lib").join(library.file_name()))?;
        }
    }
    let env_stdlib = out
        .join("lib")
        .join(format!("python{}", python.short_version));
    let mut entries: Vec<_> = fs_err::read_dir(&stdlib)?.filter_map(|e| e.ok()).collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        if entry.file_name() == "site-packages" {
            continue;
        }
        symlink(&entry.path(), &env_stdlib.join(entry.file_name()))?;
    }
    Ok(())
}

/// The `.pth` file hvd writes into every env's site-packages.
pub(crate) const PYCACHE_PTH: &str = "_hvd_pycache.pth";

/// The one line of [`PYCACHE_PTH`]: on 3.8+ points `sys.pycache_prefix` at `pycache` unless the user already set
/// one (`PYTHONPYCACHEPREFIX`, `-X pycache_prefix`); before 3.8 sets `sys.dont_write_bytecode`.
fn pycache_pth_line(pycache: &Path) -> String {
    format!(
        "import sys; setattr(sys, 'pycache_prefix', getattr(sys, 'pycache_prefix', None) or {:?}) \
         if hasattr(sys, 'pycache_prefix') else setattr(sys, 'dont_write_bytecode', True)\n",
        pycache.display().to_string()
    )
}

/// Write a file hvd itself puts into the env, created new and never through a link (see
/// [`crate::store::write_new_file`]). When a package already provided the name (a file, or a link to anywhere), the
/// env is refused and the error names the package.
fn hvd_file(dest: &Path, bytes: &[u8], mode: u32, packages: &[PathBuf]) -> Result<()> {
    match crate::store::write_new_file(dest, bytes, mode) {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
            let name = dest.file_name().unwrap_or_default();
            let provider = packages
                .iter()
                .find(|p| {
                    ["site-packages", "scripts"]
                        .iter()
                        .any(|dir| fs_err::symlink_metadata(p.join(dir).join(name)).is_ok())
                })
                .or_else(|| {
                    // An entry point of that name (console scripts are named by their package's metadata).
                    packages.iter().find(|p| {
                        wheel::find_suffix_dir(&p.join("site-packages"), ".dist-info")
                            .ok()
                            .flatten()
                            .and_then(|d| fs_err::read_to_string(d.join("entry_points.txt")).ok())
                            .is_some_and(|text| {
                                wheel::parse_entry_points(&text)
                                    .iter()
                                    .any(|point| std::ffi::OsStr::new(&point.name) == name)
                            })
                    })
                })
                .and_then(|p| p.file_name())
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|| "a package".into());
            Err(Error::Invalid(format!(
                "{provider} provides `{}`, a name hvd writes into every env itself; the env is not assembled \
                 (nothing was written through it): remove that package or file from the env",
                name.to_string_lossy()
            )))
        }
        Err(err) => Err(err.into()),
    }
}

/// Link every entry of `from` into `to`: a missing entry becomes a symlink; a directory present in both becomes a
/// real directory holding links to both sides (recursively).
fn link_tree(from: &Path, to: &Path) -> Result<()> {
    let mut entries: Vec<_> = fs_err::read_dir(from)?.filter_map(|e| e.ok()).collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let source = entry.path();
        let dest = to.join(entry.file_name());
        let Ok(existing) = fs_err::symlink_metadata(&dest) else {
            symlink(&source, &dest)?;
            continue;
        };
        if !source.is_dir() {
            tracing::debug!("{} is provided twice; keeping the first", dest.display());
            continue;
        }
        if existing.file_type().is_symlink() && dest.is_dir() {
            // Turn the link into a real directory holding links to what it pointed at.
            let previous = fs_err::read_link(&dest)?;
            fs_err::remove_file(&dest)?;
            fs_err::create_dir(&dest)?;
            link_tree(&previous, &dest)?;
            link_tree(&source, &dest)?;
        } else if existing.is_dir() {
            link_tree(&source, &dest)?;
        }
    }
    Ok(())
}

fn symlink(target: &Path, link: &Path) -> Result<()> {
    std::os::unix::fs::symlink(target, link).map_err(|err| {
        std::io::Error::other(format!(
            "failed to link `{}` -> `{}`: {err}",
            link.display(),
            target.display()
        ))
    })?;
    Ok(())
}
