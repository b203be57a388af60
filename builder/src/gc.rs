//! Roots and garbage collection.
//!
//! A project keeps its env alive with a link next to its file (`.hvd/env -> <store path>`). The store records that
//! link in `.roots/<hash of the link's absolute path>` (a symlink to the project link), like Nix's indirect roots:
//! deleting the project (or its `.hvd/`) is enough to let gc reclaim the env.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::hash::Sha256;
use crate::store::{Store, remove_tree};

/// Point `link` at `target` (atomically replacing an older link) and register it as a gc root.
pub fn add_root(store: &Store, link: &Path, target: &Path) -> Result<()> {
    if let Some(parent) = link.parent() {
        fs_err::create_dir_all(parent)?;
    }
    let link = absolute(link)?;
    let temp = link.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs_err::remove_file(&temp);
    std::os::unix::fs::symlink(target, &temp)?;
    fs_err::rename(&temp, &link)?;
    let name = Sha256::of_bytes(link.to_string_lossy().as_bytes());
    let root = store.root().join(".roots").join(&name.as_str()[..32]);
    if fs_err::read_link(&root).ok().as_deref() != Some(link.as_path()) {
        let temp_root = root.with_extension(format!("tmp{}", std::process::id()));
        let _ = fs_err::remove_file(&temp_root);
        std::os::unix::fs::symlink(&link, &temp_root)?;
        fs_err::rename(&temp_root, &root)?;
    }
    Ok(())
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
    Ok(report)
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
