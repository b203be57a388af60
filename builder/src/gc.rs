//! Roots and garbage collection.
//!
//! A project keeps its env alive with a link next to its file (`.hvd/env -> <store path>`). The store records that
//! link in `.roots/<hash of the link's absolute path>` (a symlink to the project link), like Nix's indirect roots:
//! deleting the project (or its `.hvd/`) is enough to let gc reclaim the env.
//!
//! A running `hvd run`/`exec`/`shell` also holds a temporary root ([`TempRoot`]): a file
//! `.temproots/<random>` naming the store paths it uses, flock-ed exclusively for as long as any process holds the
//! descriptor (it is inherited across `exec`, so the command itself and its children keep it). gc keeps what a
//! locked temporary root names and deletes unlocked ones (their process is gone). A temporary root is created while
//! the builders' lock (`.locks/gc.lock`, shared) is held since before the build, so gc (exclusive) never runs between
//! the build and the root.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use hvd_resolver::Sha256;

use crate::error::{Error, Result};
use crate::store::{Store, remove_tree};

/// Point `link` at `target` (atomically replacing an older link) and register it as a gc root.
pub fn add_root(store: &Store, link: &Path, target: &Path) -> Result<()> {
    if let Some(parent) = link.parent() {
        fs_err::create_dir_all(parent)?;
    }
    let link = absolute(link)?;
    // Random temporary names: pids collide across pid namespaces sharing one store.
    let temp = link.with_extension(format!("tmp{}", random_name()?));
    std::os::unix::fs::symlink(target, &temp)?;
    fs_err::rename(&temp, &link)?;
    let name = Sha256::of_bytes(link.to_string_lossy().as_bytes());
    let root = store.root().join(".roots").join(&name.as_str()[..32]);
    if fs_err::read_link(&root).ok().as_deref() != Some(link.as_path()) {
        let temp_root = root.with_extension(format!("tmp{}", random_name()?));
        std::os::unix::fs::symlink(&link, &temp_root)?;
        fs_err::rename(&temp_root, &root)?;
    }
    Ok(())
}

/// Keeps store paths alive while this process, or any process that inherited its descriptor, runs.
///
/// Create it while holding [`Store::lock_builders`] (taken before the build), so no gc runs in between.
#[derive(Debug)]
pub struct TempRoot {
    lock: Flock<std::fs::File>,
    path: PathBuf,
}

impl TempRoot {
    /// Root the store paths `targets` (each directly under the store root).
    pub fn create(store: &Store, targets: &[&Path]) -> Result<TempRoot> {
        let mut names = String::new();
        for target in targets {
            let name = target
                .file_name()
                .filter(|_| target.parent() == Some(store.root()))
                .ok_or_else(|| {
                    Error::Invalid(format!(
                        "`{}` is not a path in the store `{}`",
                        target.display(),
                        store.root().display()
                    ))
                })?;
            names.push_str(&name.to_string_lossy());
            names.push('\n');
        }
        let dir = store.temp_roots_dir();
        // A random name, never an existing one: processes in different pid namespaces share one store, so a pid
        // in the name could collide (and a rename would replace, and so unroot, another process's root).
        let mut attempts = 0;
        loop {
            let name = random_name()?;
            // Written and locked under a name gc skips as fresh, then linked to its final name (`link` never
            // replaces): gc never sees an unlocked, fresh root.
            let partial = dir.join(format!(".{name}"));
            let file = crate::store::write_new_file(&partial, names.as_bytes(), 0o644)?;
            let lock =
                Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
                    std::io::Error::other(format!(
                        "failed to lock `{}`: {errno}",
                        partial.display()
                    ))
                })?;
            let path = dir.join(&name);
            let linked = std::fs::hard_link(&partial, &path);
            let _ = std::fs::remove_file(&partial);
            match linked {
                Ok(()) => return Ok(TempRoot { lock, path }),
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists && attempts < 4 => {
                    attempts += 1;
                }
                Err(err) => {
                    return Err(std::io::Error::new(
                        err.kind(),
                        format!(
                            "failed to create the temporary root `{}`: {err}",
                            path.display()
                        ),
                    )
                    .into());
                }
            }
        }
    }

    /// The root file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Let the descriptor (and so the root) survive `exec`: the executed command, and every child that inherits
    /// the descriptor, keeps the paths alive.
    pub fn keep_across_exec(&self) -> Result<()> {
        nix::fcntl::fcntl(
            &*self.lock,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .map_err(|errno| {
            std::io::Error::other(format!(
                "failed to keep `{}` open across exec: {errno}",
                self.path.display()
            ))
        })?;
        Ok(())
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        // Removed while still locked; a root left behind (exec, SIGKILL) is unlocked and gc removes it.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Store path names the temporary roots still held by a live process name; unlocked (stale) ones are removed
/// unless `dry_run`. Returns (names, live count, stale count).
fn temp_roots(store: &Store, dry_run: bool) -> Result<(Vec<String>, usize, usize)> {
    let mut names = Vec::new();
    let mut stale = 0;
    let mut live = 0;
    for entry in fs_err::read_dir(store.temp_roots_dir())? {
        let entry = entry?;
        let path = entry.path();
        let Ok(file) = std::fs::File::open(&path) else {
            continue;
        };
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(_unlocked) => {
                // Nobody holds it: its process (and everything that inherited it) has ended. A `.<random>` file is
                // a root whose creator died before the link.
                stale += 1;
                if !dry_run {
                    fs_err::remove_file(&path)?;
                }
            }
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut file, &mut text)?;
                live += 1;
                names.extend(
                    text.lines()
                        .filter(|n| !n.is_empty() && !n.starts_with('.') && !n.contains('/'))
                        .map(str::to_string),
                );
            }
            Err((_, errno)) => {
                return Err(std::io::Error::other(format!(
                    "failed to check the temporary root `{}`: {errno}",
                    path.display()
                ))
                .into());
            }
        }
    }
    Ok((names, live, stale))
}

/// 128 random bits from the kernel as 32 hex digits.
fn random_name() -> Result<String> {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        let rest = &mut bytes[filled..];
        // SAFETY: getrandom writes at most `rest.len()` bytes into `rest`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(std::io::Error::other(format!("failed to get random bytes: {err}")).into());
        }
        filled += n as usize;
    }
    Ok(hex::encode(bytes))
}

fn absolute(path: &Path) -> Result<PathBuf> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    Ok(std::env::current_dir()?.join(path))
}

/// What gc found (and, unless a dry run, removed).
#[derive(Debug, Default, Clone)]
pub struct GcReport {
    /// Store path names reachable from a root.
    pub live: BTreeSet<String>,
    /// Store path names no root reaches (removed unless dry run).
    pub dead: Vec<String>,
    /// Bytes those dead paths occupy.
    pub bytes: u64,
    /// Roots whose project link is gone (their registration was removed unless dry run).
    pub stale_roots: usize,
    /// Temporary roots of running processes.
    pub temp_roots: usize,
    /// Temporary roots whose processes have ended (removed unless dry run).
    pub stale_temp_roots: usize,
    /// Lock files under `.locks/` no one held (removed unless dry run; `gc.lock` stays).
    pub free_locks: usize,
}

/// Remove every store path that no root reaches (`dry_run`: only report).
pub fn collect_garbage(store: &Store, dry_run: bool) -> Result<GcReport> {
    let _gc = store.lock_gc()?;
    let mut report = GcReport::default();
    let mut stack = Vec::new();
    for entry in fs_err::read_dir(store.root().join(".roots"))? {
        let entry = entry?;
        let live_target = fs_err::read_link(entry.path())
            .ok()
            .and_then(|project_link| fs_err::read_link(project_link).ok())
            .filter(|target| target.parent() == Some(store.root()))
            .and_then(|target| target.file_name().map(|n| n.to_string_lossy().into_owned()));
        match live_target {
            Some(name) => stack.push(name),
            None => {
                report.stale_roots += 1;
                if !dry_run {
                    fs_err::remove_file(entry.path())?;
                }
            }
        }
    }
    let (held, live, stale) = temp_roots(store, dry_run)?;
    report.temp_roots = live;
    report.stale_temp_roots = stale;
    stack.extend(held);
    while let Some(name) = stack.pop() {
        let path = store.root().join(&name);
        if !store.is_valid(&path) || !report.live.insert(name) {
            continue;
        }
        if let Ok(info) = store.path_info(&path) {
            stack.extend(info.references);
        }
    }
    for name in store.list_paths()? {
        if report.live.contains(&name) {
            continue;
        }
        let path = store.root().join(&name);
        report.bytes += tree_size(&path);
        if !dry_run {
            // Skip a path someone is (re)building right now.
            if let Some(_lock) = store.try_lock_path(&name)? {
                remove_tree(&path)?;
            }
        }
        report.dead.push(name);
    }
    if !dry_run {
        store.remove_all_stale_temps()?;
        for entry in fs_err::read_dir(store.root().join(".build"))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(_lock) = store.try_lock_path(&name)? {
                remove_tree(&entry.path())?;
            }
        }
    }
    report.free_locks = remove_free_locks(store, dry_run)?;
    Ok(report)
}

/// Removes (`dry_run`: counts) the lock files under `.locks/` no one holds now: one is made for every path and
/// every cache archive (`archive-<sha256>.lock`) ever locked, so they pile up. `gc.lock` stays (gc holds it).
fn remove_free_locks(store: &Store, dry_run: bool) -> Result<usize> {
    let mut removed = 0;
    for entry in fs_err::read_dir(store.root().join(".locks"))? {
        let file_name = entry?.file_name();
        let Some(name) = file_name.to_str().and_then(|n| n.strip_suffix(".lock")) else {
            continue;
        };
        if name == "gc" || name.is_empty() {
            continue;
        }
        if dry_run {
            removed += usize::from(store.try_lock_path(name)?.is_some());
        } else if store.remove_lock_if_free(name)? {
            removed += 1;
        }
    }
    Ok(removed)
}

fn tree_size(path: &Path) -> u64 {
    walkdir::WalkDir::new(path)
        .follow_links(false)
        .into_iter()
        .filter_map(|e| e.ok())
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}
