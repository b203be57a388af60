//! The store: immutable `<hash>-<name>-<version>` directories, created atomically under a per-path lock.
//!
//! Layout (see docs/store.md):
//! - `<root>/<hash>-<name>-<version>/` a store path; its `.hvd-path.json` records the derivation, the content hash
//!   and the store paths it references. A directory without that file is never treated as valid.
//! - `<root>/.tmp/<path-name>.<pid>.<n>/` builds in progress; created and used only while holding the path's lock,
//!   so any such directory found by the next lock holder is the debris of a killed build and is removed.
//! - `<root>/.locks/<path-name>.lock` flock files; `.locks/gc.lock` is held shared by builders, exclusive by gc. gc
//!   unlinks the others while it holds them; a lock is held only once its file is still at its path (see
//!   `Store::lock_file`).
//! - `<root>/.roots/` links to the project links (`.hvd/env`) that keep paths alive.
//! - `<root>/.temproots/<random>` store path names a running process uses, flock-ed while it runs (see gc).
//! - `<root>/.downloads/sha256/<hex>` the download cache; `<root>/.pycache/` bytecode written by envs.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use hvd_resolver::Sha256;

use crate::derivation::Derivation;
use crate::error::{Error, Result};
use crate::hash::{self, PATH_INFO_FILE};

/// Modification time every store entry gets (defined with the extractor that writes most of them).
pub use crate::unpack::STORE_MTIME;

/// What `.hvd-path.json` records about a store path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathInfo {
    /// Version of this file's format.
    pub schema: u32,
    pub derivation_hash: String,
    pub derivation: Derivation,
    /// `sha256` of the canonical tree (see [`hash::content_hash`]).
    pub content_hash: Sha256,
    /// Names of other store paths this one needs at run time (gc keeps them alive together).
    pub references: BTreeSet<String>,
}

/// A handle on a store directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// A held per-path (or gc) lock; released on drop.
#[derive(Debug)]
pub struct StoreLock {
    _lock: Flock<std::fs::File>,
}

/// Where a build writes and what the finished path will be called.
#[derive(Debug, Clone)]
pub struct BuildTarget {
    /// The directory to fill (inside `.tmp`).
    pub out: PathBuf,
    /// The final store path; use it for paths written into files (shebangs).
    pub final_path: PathBuf,
}

/// What a build function returns besides the filled directory.
#[derive(Debug, Default, Clone)]
pub struct BuildOutput {
    /// Store path names the result refers to at run time.
    pub references: BTreeSet<String>,
    /// sha256 of files by path relative to the output, when the build already knows them (saves a re-read).
    pub file_hashes: std::collections::BTreeMap<String, Sha256>,
}

/// What a build that knows its whole tree hands back (an archive extraction that gave every entry the store's
/// mode and mtime as it wrote it and hashed every file): the tree is then neither canonicalized nor walked again.
#[derive(Debug, Default, Clone)]
pub struct KnownTree {
    /// Store path names the result refers to at run time.
    pub references: BTreeSet<String>,
    /// Every entry of the output, as [`hash::manifest`] of it would give.
    pub manifest: crate::unpack::Manifest,
}

/// What a build function of [`Store::realize_tree`] returned.
enum Built {
    /// A tree to canonicalize and walk.
    Walk(BuildOutput),
    /// A canonical tree whose manifest is known.
    Known(KnownTree),
}

/// The result of realizing one derivation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Realized {
    pub path: PathBuf,
    /// `false` when the path was already valid (a cache hit).
    pub built: bool,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Store {
    /// Open (creating if needed) the store at `root`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Store> {
        let root = root.into();
        for sub in [
            ".tmp",
            ".build",
            ".locks",
            ".roots",
            ".temproots",
            ".downloads",
            ".pycache",
        ] {
            fs_err::create_dir_all(root.join(sub))?;
        }
        let root = fs_err::canonicalize(&root)?;
        Ok(Store { root })
    }

    /// `$HVD_STORE`, else `<data dir>/hvd/store` (e.g. `~/.local/share/hvd/store`).
    pub fn default_root() -> PathBuf {
        match std::env::var_os(crate::env_vars::HVD_STORE) {
            Some(path) if !path.is_empty() => PathBuf::from(path),
            _ => dirs::data_dir()
                .unwrap_or_else(|| PathBuf::from("/tmp"))
                .join("hvd")
                .join("store"),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Temporary gc roots of running processes (see `gc::TempRoot`, which writes them).
    pub(crate) fn temp_roots_dir(&self) -> PathBuf {
        self.root.join(".temproots")
    }

    /// The download cache directory (files named by their sha256).
    pub fn downloads_dir(&self) -> PathBuf {
        self.root.join(".downloads")
    }

    /// The store path a derivation produces (whether or not it exists).
    pub fn path_of(&self, derivation: &Derivation) -> PathBuf {
        self.root.join(derivation.path_name())
    }

    /// A path is valid when its directory and its metadata file both exist: the metadata is written before the
    /// atomic rename, so a valid path is always complete.
    pub fn is_valid(&self, path: &Path) -> bool {
        path.join(PATH_INFO_FILE).is_file()
    }

    /// Read a path's metadata.
    pub fn path_info(&self, path: &Path) -> Result<PathInfo> {
        let file = path.join(PATH_INFO_FILE);
        let text = fs_err::read_to_string(&file)?;
        serde_json::from_str(&text).map_err(|err| Error::CorruptPath {
            path: file,
            message: err.to_string(),
        })
    }

    /// Every valid store path name.
    pub fn list_paths(&self) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs_err::read_dir(&self.root)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') && self.is_valid(&entry.path()) {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn lock_path_of(&self, name: &str) -> PathBuf {
        self.root.join(".locks").join(format!("{name}.lock"))
    }

    /// Flocks `.locks/<name>.lock`; `None` when `arg` does not wait and another holds it.
    ///
    /// gc unlinks lock files it holds ([`Store::remove_lock_if_free`]): whoever opened such a file before the
    /// unlink gets its flock afterwards on a file no one else will open, which excludes no one. So the lock counts
    /// only when the path still names the locked file (same device and inode) once the flock is held; otherwise it
    /// is dropped and taken again on the file now at the path.
    fn lock_file(&self, name: &str, arg: FlockArg) -> Result<Option<StoreLock>> {
        use std::os::unix::fs::MetadataExt;
        let path = self.lock_path_of(name);
        loop {
            let file = fs_err::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)?;
            let lock = match Flock::lock(file.into_parts().0, arg) {
                Ok(lock) => lock,
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Ok(None),
                Err((_, errno)) => {
                    return Err(std::io::Error::other(format!(
                        "failed to lock `{}`: {errno}",
                        path.display()
                    ))
                    .into());
                }
            };
            let held = lock.metadata()?;
            match fs_err::metadata(&path) {
                Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => {
                    return Ok(Some(StoreLock { _lock: lock }));
                }
                // Unlinked (and maybe made again) since it was opened: take the one there now.
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Unlinks `.locks/<name>.lock` if no one holds it (taking it without waiting, unlinking, releasing); `true`
    /// when it was removed. Safe against every other locker: see [`Store::lock_file`].
    pub(crate) fn remove_lock_if_free(&self, name: &str) -> Result<bool> {
        let Some(_lock) = self.lock_file(name, FlockArg::LockExclusiveNonblock)? else {
            return Ok(false);
        };
        fs_err::remove_file(self.lock_path_of(name))?;
        Ok(true)
    }

    /// Block until this process holds the exclusive lock for a path name.
    pub fn lock_path(&self, name: &str) -> Result<StoreLock> {
        if let Some(lock) = self.lock_file(name, FlockArg::LockExclusiveNonblock)? {
            return Ok(lock);
        }
        tracing::info!("waiting for another build of {name}");
        self.lock_file(name, FlockArg::LockExclusive)?
            .ok_or_else(|| std::io::Error::other(format!("failed to lock {name}")).into())
    }

    /// Try to take a path's lock without waiting.
    pub(crate) fn try_lock_path(&self, name: &str) -> Result<Option<StoreLock>> {
        self.lock_file(name, FlockArg::LockExclusiveNonblock)
    }

    /// Builders hold this shared; gc holds it exclusive, so gc never deletes what a build is about to reference.
    pub fn lock_builders(&self) -> Result<StoreLock> {
        self.lock_file("gc", FlockArg::LockShared)?
            .ok_or_else(|| std::io::Error::other("failed to lock gc").into())
    }

    /// Exclusive gc lock.
    pub(crate) fn lock_gc(&self) -> Result<StoreLock> {
        self.lock_file("gc", FlockArg::LockExclusive)?
            .ok_or_else(|| std::io::Error::other("failed to lock gc").into())
    }

    /// A fresh temp directory inside the store for `name` (call with the path's lock held).
    pub fn temp_dir(&self, name: &str) -> Result<PathBuf> {
        let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = self
            .root
            .join(".tmp")
            .join(format!("{name}.{}.{n}", std::process::id()));
        fs_err::create_dir_all(&dir)?;
        Ok(dir)
    }

    /// Remove temp directories of `name` left by killed builds (call with the path's lock held).
    fn remove_stale_temps(&self, name: &str) -> Result<()> {
        let prefix = format!("{name}.");
        for entry in fs_err::read_dir(self.root.join(".tmp"))? {
            let entry = entry?;
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                tracing::info!(
                    "removing {} left by an interrupted build",
                    entry.path().display()
                );
                remove_tree(&entry.path())?;
            }
        }
        Ok(())
    }

    /// Remove every temp directory whose path lock is free (gc).
    pub(crate) fn remove_all_stale_temps(&self) -> Result<usize> {
        let mut removed = 0;
        for entry in fs_err::read_dir(self.root.join(".tmp"))? {
            let entry = entry?;
            let file_name = entry.file_name().to_string_lossy().into_owned();
            // `<path-name>.<pid>.<n>`; the path name itself may contain dots.
            let Some(path_name) = file_name.rsplitn(3, '.').nth(2) else {
                continue;
            };
            if let Some(_lock) = self.try_lock_path(path_name)? {
                remove_tree(&entry.path())?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Return the valid path for `derivation`, building it with `build` if needed.
    ///
    /// `build` fills `target.out`; afterwards the tree is canonicalized, hashed, its metadata written and the
    /// directory renamed into place. Concurrent callers for the same derivation wait on the path's lock and then
    /// reuse the result. With `replace`, an existing path is rebuilt and swapped in atomically.
    pub fn realize(
        &self,
        derivation: &Derivation,
        replace: bool,
        build: impl FnOnce(&BuildTarget) -> Result<BuildOutput>,
    ) -> Result<Realized> {
        self.realize_checked(derivation, replace, build, |_| Ok(()))
    }

    /// [`Store::realize`], with `check` run on the finished tree's metadata before the rename (a substituted
    /// path's content hash against its signed record). A failed build or check leaves no path and removes its
    /// temp directory.
    pub fn realize_checked(
        &self,
        derivation: &Derivation,
        replace: bool,
        build: impl FnOnce(&BuildTarget) -> Result<BuildOutput>,
        check: impl FnOnce(&PathInfo) -> Result<()>,
    ) -> Result<Realized> {
        self.realize_tree(
            derivation,
            replace,
            |target| build(target).map(Built::Walk),
            check,
        )
    }

    /// [`Store::realize`] for a build that knows its whole tree, already canonical ([`KnownTree`]).
    pub fn realize_known(
        &self,
        derivation: &Derivation,
        replace: bool,
        build: impl FnOnce(&BuildTarget) -> Result<KnownTree>,
    ) -> Result<Realized> {
        self.realize_tree(
            derivation,
            replace,
            |target| build(target).map(Built::Known),
            |_| Ok(()),
        )
    }

    fn realize_tree(
        &self,
        derivation: &Derivation,
        replace: bool,
        build: impl FnOnce(&BuildTarget) -> Result<Built>,
        check: impl FnOnce(&PathInfo) -> Result<()>,
    ) -> Result<Realized> {
        let name = derivation.path_name();
        let final_path = self.root.join(&name);
        if !replace && self.is_valid(&final_path) {
            return Ok(Realized {
                path: final_path,
                built: false,
            });
        }
        let _lock = self.lock_path(&name)?;
        if !replace && self.is_valid(&final_path) {
            return Ok(Realized {
                path: final_path,
                built: false,
            });
        }
        self.remove_stale_temps(&name)?;
        let temp = self.temp_dir(&name)?;
        let out = temp.join("out");
        fs_err::create_dir(&out)?;
        let target = BuildTarget {
            out: out.clone(),
            final_path: final_path.clone(),
        };
        let finished = (|| {
            let info = match build(&target)? {
                Built::Walk(output) => {
                    finish_tree(&out, derivation, output.references, &output.file_hashes)?
                }
                Built::Known(tree) => write_info(&out, derivation, tree.references, tree.manifest)?,
            };
            check(&info)?;
            Ok(info)
        })();
        let info = match finished {
            Ok(info) => info,
            Err(err) => {
                if let Err(cleanup) = remove_tree(&temp) {
                    tracing::warn!("failed to remove `{}`: {cleanup}", temp.display());
                }
                return Err(err);
            }
        };
        tracing::debug!("built {name} with content hash {}", info.content_hash);
        if final_path.exists() {
            // A replaced (`--rebuild`) or invalid leftover path: move it aside first, then swap in the new one.
            let old = temp.join("old");
            // Moving a directory to another parent rewrites its `..`: a non-root owner needs write permission on it.
            if fs_err::symlink_metadata(&final_path)?.is_dir() {
                fs_err::set_permissions(&final_path, std::fs::Permissions::from_mode(0o755))?;
            }
            fs_err::rename(&final_path, &old)?;
        }
        fs_err::rename(&out, &final_path)?;
        remove_tree(&temp)?;
        Ok(Realized {
            path: final_path,
            built: true,
        })
    }
}

/// Canonicalize `out`, hash it, write its metadata (the last write before the rename) and return it.
pub(crate) fn finish_tree(
    out: &Path,
    derivation: &Derivation,
    references: BTreeSet<String>,
    file_hashes: &std::collections::BTreeMap<String, Sha256>,
) -> Result<PathInfo> {
    canonicalize(out)?;
    let manifest = hash::manifest_with_known(out, file_hashes)?;
    write_info(out, derivation, references, manifest)
}

/// Write the metadata of the canonical tree `out` whose manifest is `manifest` (the last write before the rename)
/// and return it.
fn write_info(
    out: &Path,
    derivation: &Derivation,
    references: BTreeSet<String>,
    manifest: crate::unpack::Manifest,
) -> Result<PathInfo> {
    let info = PathInfo {
        schema: 1,
        derivation_hash: derivation.hash(),
        derivation: derivation.clone(),
        content_hash: hash::content_hash(&manifest),
        references,
    };
    let info_path = out.join(PATH_INFO_FILE);
    let text =
        serde_json::to_string_pretty(&info).map_err(|err| Error::Invalid(err.to_string()))?;
    // Only the top directory is opened for the metadata write: `make_writable` would leave every directory below
    // writable, and a job could then change a shared store path.
    fs_err::set_permissions(out, std::fs::Permissions::from_mode(0o755))?;
    // Created new and never through a link: a package that placed this name (a file or a link to anywhere) is
    // refused, not written through. Mode and mtime are set on the descriptor.
    let written = write_new_file(&info_path, (text + "\n").as_bytes(), 0o444).map_err(|err| {
        if err.kind() == std::io::ErrorKind::AlreadyExists {
            Error::Invalid(format!(
                "the store path of {} {} already has `{PATH_INFO_FILE}` before hvd wrote it: its contents (a \
                 package's files) placed that name, which hvd reserves; the package cannot be installed",
                derivation.name, derivation.version
            ))
        } else {
            Error::Io(err)
        }
    })?;
    let time = nix::sys::time::TimeSpec::new(STORE_MTIME, 0);
    nix::sys::stat::futimens(&written, &time, &time).map_err(|errno| {
        std::io::Error::other(format!(
            "failed to set the mtime of `{}`: {errno}",
            info_path.display()
        ))
    })?;
    drop(written);
    fs_err::set_permissions(out, std::fs::Permissions::from_mode(0o555))?;
    set_mtime(out)?;
    Ok(info)
}

/// Create a file hvd itself puts into a store, env or build tree: `O_CREAT | O_EXCL | O_NOFOLLOW`, so an existing
/// name (a file or a link a package placed) fails with `AlreadyExists` instead of being written through; opened
/// for reading and writing, with the mode set on the descriptor (`fchmod`), never by path. The error text names
/// the path; the kind is kept.
pub(crate) fn create_new_file(path: &Path, mode: u32) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|err| io_context(err, "create", path))?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(|err| io_context(err, "set the mode of", path))?;
    Ok(file)
}

/// [`create_new_file`] with `bytes` written into it (the descriptor stays writable after the mode is set).
pub(crate) fn write_new_file(
    path: &Path,
    bytes: &[u8],
    mode: u32,
) -> std::io::Result<std::fs::File> {
    use std::io::Write;
    let mut file = create_new_file(path, mode)?;
    file.write_all(bytes)
        .map_err(|err| io_context(err, "write", path))?;
    Ok(file)
}

/// `err`, its kind kept, with a message naming what failed on `path`.
fn io_context(err: std::io::Error, what: &str, path: &Path) -> std::io::Error {
    std::io::Error::new(
        err.kind(),
        format!("failed to {what} `{}`: {err}", path.display()),
    )
}

/// Normalize a tree: no write bits (files 0444, or 0555 when any execute bit was set; directories 0555),
/// every mtime set to [`STORE_MTIME`]. Symlinks keep their targets and get the mtime too.
pub fn canonicalize(root: &Path) -> Result<()> {
    for entry in walkdir::WalkDir::new(root)
        .follow_links(false)
        .contents_first(true)
    {
        let entry = entry.map_err(|err| {
            std::io::Error::other(format!("failed to walk `{}`: {err}", root.display()))
        })?;
        let kind = entry.file_type();
        if !kind.is_symlink() {
            let mode = if kind.is_dir() {
                0o555
            } else {
                let current = fs_err::symlink_metadata(entry.path())?.permissions().mode();
                if current & 0o111 != 0 { 0o555 } else { 0o444 }
            };
            fs_err::set_permissions(entry.path(), std::fs::Permissions::from_mode(mode))?;
        }
        set_mtime(entry.path())?;
    }
    Ok(())
}

fn set_mtime(path: &Path) -> Result<()> {
    let time = nix::sys::time::TimeVal::new(STORE_MTIME, 0);
    nix::sys::stat::lutimes(path, &time, &time).map_err(|errno| {
        std::io::Error::other(format!(
            "failed to set the mtime of `{}`: {errno}",
            path.display()
        ))
    })?;
    Ok(())
}

/// Give the owner write permission on a directory tree (store trees are read-only), without following links.
pub(crate) fn make_writable(root: &Path) -> Result<()> {
    for entry in walkdir::WalkDir::new(root).follow_links(false) {
        let Ok(entry) = entry else { continue };
        if entry.file_type().is_dir() {
            let mode = fs_err::symlink_metadata(entry.path())?.permissions().mode();
            fs_err::set_permissions(entry.path(), std::fs::Permissions::from_mode(mode | 0o700))?;
        }
    }
    Ok(())
}

/// Remove a (possibly read-only) tree; a missing tree is fine.
pub fn remove_tree(root: &Path) -> Result<()> {
    if fs_err::symlink_metadata(root).is_err() {
        return Ok(());
    }
    if root.is_dir() && !root.is_symlink() {
        make_writable(root)?;
        fs_err::remove_dir_all(root)?;
    } else {
        fs_err::remove_file(root)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::derivation::DerivationKind;

    #[test]
    fn realize_is_atomic_and_cached() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("store")).unwrap();
        let drv = Derivation::new(DerivationKind::Local, "demo", "1").input("x", "1");
        let failed = store.realize(&drv, false, |target| {
            fs_err::write(target.out.join("half"), "x")?;
            Err(Error::Invalid("boom".into()))
        });
        assert!(failed.is_err());
        assert!(
            !store.path_of(&drv).exists(),
            "a failed build leaves no path"
        );

        let first = store
            .realize(&drv, false, |target| {
                fs_err::create_dir(target.out.join("bin"))?;
                fs_err::write(target.out.join("bin/tool"), "#!/bin/sh\n")?;
                fs_err::set_permissions(
                    target.out.join("bin/tool"),
                    std::fs::Permissions::from_mode(0o750),
                )?;
                Ok(BuildOutput::default())
            })
            .unwrap();
        assert!(first.built);
        let mode = fs_err::metadata(first.path.join("bin/tool"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o555);
        let mtime = fs_err::metadata(first.path.join("bin/tool")).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::mtime(&mtime), STORE_MTIME);
        let info = store.path_info(&first.path).unwrap();
        assert_eq!(info.derivation, drv);

        let second = store
            .realize(&drv, false, |_| panic!("must not rebuild a valid path"))
            .unwrap();
        assert_eq!(
            second,
            Realized {
                path: first.path.clone(),
                built: false
            }
        );
        assert_eq!(
            fs_err::read_dir(store.root().join(".tmp")).unwrap().count(),
            0
        );
    }

    #[test]
    fn a_rebuild_replaces_a_path_read_only_at_every_depth() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let drv = Derivation::new(DerivationKind::Local, "deep", "1");
        let build = |text: &'static str| {
            move |target: &BuildTarget| -> Result<BuildOutput> {
                fs_err::create_dir_all(target.out.join("a/b/c"))?;
                fs_err::write(target.out.join("a/b/c/file"), text)?;
                Ok(BuildOutput::default())
            }
        };
        let first = store.realize(&drv, false, build("one")).unwrap();
        for sub in ["", "a", "a/b", "a/b/c"] {
            let mode = fs_err::metadata(first.path.join(sub))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o555, "{sub}");
        }
        let second = store.realize(&drv, true, build("two")).unwrap();
        assert!(second.built);
        assert_eq!(
            fs_err::read_to_string(second.path.join("a/b/c/file")).unwrap(),
            "two"
        );
        let mode = fs_err::metadata(second.path.join("a/b"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o555);
        assert_eq!(
            fs_err::read_dir(store.root().join(".tmp")).unwrap().count(),
            0
        );
    }

    #[test]
    fn stale_temp_dirs_are_removed_by_the_next_builder() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let drv = Derivation::new(DerivationKind::Local, "demo", "1");
        let stale = store
            .root()
            .join(".tmp")
            .join(format!("{}.999999.0", drv.path_name()));
        fs_err::create_dir_all(stale.join("out/sub")).unwrap();
        fs_err::set_permissions(
            stale.join("out/sub"),
            std::fs::Permissions::from_mode(0o555),
        )
        .unwrap();
        store
            .realize(&drv, false, |_| Ok(BuildOutput::default()))
            .unwrap();
        assert!(!stale.exists());
    }
}
