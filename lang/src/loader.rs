//! Where `.hvd` files come from: the [`ImportLoader`] trait the evaluator reads the main file and its
//! imports through, with the file system ([`FsLoader`], what the CLI uses) and memory ([`MemoryLoader`],
//! for tests and the fuzz target) behind it.

use std::collections::BTreeMap;
use std::io;
use std::path::{Component, Path, PathBuf};

/// Reads source files for the evaluator. The evaluator joins an import's path to the importing file's
/// directory and drops `.` components; the loader says which file that names and what it holds. `Sync`
/// because parsing and evaluation run on a thread of their own (one with a large stack).
pub trait ImportLoader: Sync {
    /// The one path that names this file, whatever way it was written: import cycles and the module cache
    /// compare these. An error when there is no such file.
    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf>;

    /// The text of the file at `path` (as written, or as [`canonicalize`](Self::canonicalize) gave it).
    fn read_to_string(&self, path: &Path) -> io::Result<String>;
}

/// The file system: paths are canonicalized by the operating system (links and `..` resolved, the file
/// must exist), and read as UTF-8 text.
#[derive(Debug, Clone, Copy, Default)]
pub struct FsLoader;

impl ImportLoader for FsLoader {
    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf> {
        std::fs::canonicalize(path)
    }

    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        fs_err::read_to_string(path)
    }
}

/// Files held in memory, by path: nothing outside them can be read. Paths are compared after `.` is
/// dropped and `..` removes the component before it, so `./a.hvd`, `a.hvd` and `lib/../a.hvd` name the
/// same file; a `..` with nothing before it stays, so it can name no file that was added under a plain path.
#[derive(Debug, Clone, Default)]
pub struct MemoryLoader {
    files: BTreeMap<PathBuf, String>,
}

impl MemoryLoader {
    /// Add (or replace) the file at `path`.
    pub fn insert(&mut self, path: impl AsRef<Path>, text: impl Into<String>) {
        self.files.insert(lexical(path.as_ref()), text.into());
    }
}

impl ImportLoader for MemoryLoader {
    fn canonicalize(&self, path: &Path) -> io::Result<PathBuf> {
        let path = lexical(path);
        if self.files.contains_key(&path) {
            Ok(path)
        } else {
            Err(not_found())
        }
    }

    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        self.files
            .get(&lexical(path))
            .cloned()
            .ok_or_else(not_found)
    }
}

fn not_found() -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, "no such file in memory")
}

/// `path` with `.` dropped and each `..` taking away the normal component before it.
fn lexical(path: &Path) -> PathBuf {
    let mut out: Vec<Component> = Vec::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir if matches!(out.last(), Some(Component::Normal(_))) => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_paths_are_compared_after_dots_are_resolved() {
        let mut loader = MemoryLoader::default();
        loader.insert("./lib/a.hvd", "let a = 1\n");
        for same in ["lib/a.hvd", "lib/./a.hvd", "lib/x/../a.hvd", "./lib/a.hvd"] {
            assert_eq!(
                loader.canonicalize(Path::new(same)).unwrap(),
                Path::new("lib/a.hvd")
            );
            assert_eq!(
                loader.read_to_string(Path::new(same)).unwrap(),
                "let a = 1\n"
            );
        }
        for outside in ["../lib/a.hvd", "/lib/a.hvd", "a.hvd", "lib/../../lib/a.hvd"] {
            let error = loader.canonicalize(Path::new(outside)).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::NotFound, "{outside}");
        }
    }
}
