//! The base interpreter as a store path: its own installation (no third-party packages) copied from the host,
//! relocated (`RUNPATH` rewritten to `$ORIGIN`-relative) and content-hashed, so an env's closure carries it.
//!
//! ```text
//! <store>/<hash>-python-3.11.7/bin/python3.11            the executable (a copy; RUNPATH $ORIGIN/../lib)
//!                             /lib/python3.11/...         the standard library: no site-packages contents, no
//!                                                         test/, no __pycache__, no static libpython*.a
//!                             /lib/libpython3.11.so*      the shared libpython, when the build has one
//!                             /include/python3.11/        headers (source builds compile against them)
//!                             /lib/hvd-host-libraries     sonames it needs from the host beyond glibc and itself,
//!                                                         one a line: `<soname> <file that needs it>...`
//! ```
//! The path is named by a derivation of the version and the tree's content hash, so a lock that pins both names
//! it without looking at the host. The copy is made once per store and interpreter; a fingerprint of the source
//! files' metadata (`<store>/.interpreters/<fingerprint>`) finds it again without reading or hashing anything.

pub mod elf;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use sha2::Digest;

use hvd_resolver::Sha256;

use crate::derivation::{Derivation, DerivationKind};
use crate::error::{Error, Result};
use crate::hash::ManifestEntry;
use crate::python::Interpreter;
use crate::store::{KnownTree, Store};

/// Part of every interpreter derivation: bump when what is copied or how it is relocated changes.
const LAYOUT: &str = "hvd-python-3";

/// The file in an interpreter path listing the shared libraries it needs from the host beyond glibc and itself:
/// one line per soname, `<soname> <file>...` naming the files of the path that need it (`bin/python3.11`,
/// `lib/python3.11/lib-dynload/_ssl.cpython-311-x86_64-linux-gnu.so`), sorted.
pub const HOST_LIBRARIES: &str = "lib/hvd-host-libraries";

/// The names of the shared libpython files in an interpreter's `lib` (`libpython3.6m.so`, `libpython3.11.so.1.0`);
/// empty when it has none or `lib` cannot be read.
pub fn shared_libpythons(lib: &Path) -> Vec<String> {
    let Ok(entries) = fs_err::read_dir(lib) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("libpython") && name.contains(".so"))
        .collect()
}

/// The sonames every Linux host has with its C library; not listed in [`HOST_LIBRARIES`].
const GLIBC_SONAMES: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libutil.so.1",
    "libcrypt.so.1",
    "libnsl.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
];

/// What a lock pins of the interpreter: exactly this version with exactly this content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterpreterPin {
    /// Full version, e.g. `3.11.7`.
    pub version: String,
    /// Content hash of the interpreter's store path.
    pub content_hash: Sha256,
}

/// An interpreter that is a store path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPython {
    pub path: PathBuf,
    pub version: String,
    pub short_version: String,
    pub content_hash: Sha256,
}

impl StoredPython {
    /// `<path>/bin/pythonX.Y`.
    pub fn executable(&self) -> PathBuf {
        self.path
            .join("bin")
            .join(format!("python{}", self.short_version))
    }

    /// What a lock records of it.
    pub fn pin(&self) -> InterpreterPin {
        InterpreterPin {
            version: self.version.clone(),
            content_hash: self.content_hash.clone(),
        }
    }

    /// The interpreter an env is layered on.
    pub(crate) fn interpreter(&self) -> Interpreter {
        Interpreter {
            executable: self.executable(),
            version: self.version.clone(),
            short_version: self.short_version.clone(),
        }
    }

    /// The interpreter path a lock's pin names (whether or not it exists yet): its path and identity follow from
    /// the pin alone.
    pub(crate) fn pinned(store: &Store, version: &str, content_hash: &Sha256) -> StoredPython {
        StoredPython {
            path: store.path_of(&derivation(version, content_hash)),
            version: version.to_string(),
            short_version: short_version(version),
            content_hash: content_hash.clone(),
        }
    }

    /// The interpreter path at `path` (valid, and made by [`import`]).
    pub fn from_path(store: &Store, path: &Path) -> Result<StoredPython> {
        let info = store.path_info(path)?;
        if info.derivation.kind != DerivationKind::Interpreter {
            return Err(Error::Invalid(format!(
                "`{}` is not an interpreter store path",
                path.display()
            )));
        }
        let version = info.derivation.version.clone();
        Ok(StoredPython {
            path: path.to_path_buf(),
            short_version: short_version(&version),
            version,
            content_hash: info.content_hash,
        })
    }
}

fn short_version(version: &str) -> String {
    version.split('.').take(2).collect::<Vec<_>>().join(".")
}

/// The derivation of the interpreter path with this version and content.
pub fn derivation(version: &str, content_hash: &Sha256) -> Derivation {
    Derivation::new(DerivationKind::Interpreter, "python", version)
        .input("content", content_hash.as_str())
        .input("layout", LAYOUT)
}

/// One entry to copy: where it goes in the store path and what it is.
#[derive(Debug, Clone)]
enum Item {
    Dir,
    /// A regular file (a link leaving the copied tree is copied as the file it points at).
    File(PathBuf),
    /// A relative link that stays inside the copied tree, kept as it is.
    Link(PathBuf),
    /// A bytecode file `pyc` of the source file `py` (python 2): copied only when valid for it, with the source
    /// mtime it records set to the store's.
    Bytecode {
        pyc: PathBuf,
        py: PathBuf,
    },
    /// An empty regular file named `__pycache__`, so no bytecode is read or written beside the sources (python 3).
    Blocker,
}

/// What of an installation is copied: destination (relative) -> item, and where the installation lies.
struct Selection {
    prefix: PathBuf,
    /// The installation's executable (python 2's relocated configure-time variables are compiled with it).
    executable: PathBuf,
    short_version: String,
    items: BTreeMap<PathBuf, Item>,
}

/// The prefix of an interpreter's installation: the directory above its executable's `bin/` that holds
/// `lib/pythonX.Y/os.py` (pyenv's `~/.pyenv/versions/3.11.7`, Debian's `/usr`).
fn installation(python: &Interpreter) -> Result<(PathBuf, PathBuf)> {
    let executable = fs_err::canonicalize(&python.executable)?;
    let prefix = executable
        .parent()
        .and_then(Path::parent)
        .filter(|prefix| {
            prefix
                .join("lib")
                .join(format!("python{}", python.short_version))
                .join("os.py")
                .is_file()
        })
        .map(Path::to_path_buf)
        .ok_or_else(|| {
            Error::Invalid(format!(
                "python {} at `{}`: its standard library (<prefix>/lib/python{}/os.py next to bin/) was not \
                 found, so it cannot be copied into the store; use a python installed with its prefix layout \
                 (pyenv's, /usr)",
                python.version,
                python.executable.display(),
                python.short_version
            ))
        })?;
    Ok((prefix, executable))
}

fn select(python: &Interpreter) -> Result<Selection> {
    let (prefix, executable) = installation(python)?;
    let host_executable = executable.clone();
    let short = &python.short_version;
    let mut items = BTreeMap::new();
    items.insert(PathBuf::from("bin"), Item::Dir);
    items.insert(
        PathBuf::from("bin").join(format!("python{short}")),
        Item::File(executable),
    );
    items.insert(PathBuf::from("lib"), Item::Dir);
    let stdlib = PathBuf::from("lib").join(format!("python{short}"));
    add_tree(&prefix, &stdlib, &mut items, &|relative: &Path| {
        // Relative to lib/pythonX.Y: third-party packages, the test suite, bytecode and the static library are
        // not the interpreter (site-packages itself is kept, empty).
        let mut components = relative.components();
        let first = components.next().map(|c| c.as_os_str().to_os_string());
        let name = relative
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        let top = first.as_deref().map(|f| f.to_string_lossy().into_owned());
        let nested = components.next().is_some();
        !(top.as_deref() == Some("site-packages") && nested
            || top.as_deref() == Some("test")
            || top.as_deref().is_some_and(|t| t.starts_with("config"))
                && name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("libpython") && n.ends_with(".a")))
    })?;
    // The shared libpython (pyenv's builds link the executable against it).
    for name in shared_libpythons(&prefix.join("lib")) {
        add_entry(&prefix, &PathBuf::from("lib").join(&name), &mut items)?;
    }
    // Headers: include/pythonX.Y (3.6 and 3.7: include/pythonX.Ym).
    if let Ok(entries) = fs_err::read_dir(prefix.join("include")) {
        let mut any = false;
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if (name == format!("python{short}") || name == format!("python{short}m"))
                && entry.path().is_dir()
            {
                if !any {
                    items.insert(PathBuf::from("include"), Item::Dir);
                    any = true;
                }
                add_tree(
                    &prefix,
                    &PathBuf::from("include").join(&name),
                    &mut items,
                    &|_| true,
                )?;
            }
        }
    }
    resolve_links(&prefix, &mut items);
    bytecode(short, &mut items);
    Ok(Selection {
        prefix,
        executable: host_executable,
        short_version: short.clone(),
        items,
    })
}

/// Bytecode. Python 3: none of the installation's is copied (which `.pyc` files a host has changes whenever a
/// process compiles a module, which would change the copy's content hash); instead every directory of the
/// standard library gets an empty regular *file* named `__pycache__`, so the interpreter can neither read nor
/// write bytecode beside the sources (creating `__pycache__/<module>.pyc` fails, which importlib ignores): modules
/// imported before `site` runs (and before an env's `.pth` points `sys.pycache_prefix` at the store's cache) are
/// compiled in memory, and a root process cannot write into the store path. Python 2 (no `pycache_prefix`; its
/// `.pyc` lies beside the source and root could replace it) keeps the installation's `<module>.pyc` files that
/// are valid for their source, as [`Item::Bytecode`], their recorded mtime rewritten to the store's.
fn bytecode(short: &str, items: &mut BTreeMap<PathBuf, Item>) {
    let python2 = short.starts_with("2.");
    let bytecode: Vec<PathBuf> = items
        .keys()
        .filter(|dest| is_bytecode(dest))
        .cloned()
        .collect();
    for dest in bytecode {
        let Some(Item::File(pyc)) = items.remove(&dest) else {
            continue;
        };
        if python2 && dest.extension().is_some_and(|e| e == "pyc") {
            let py = dest.with_extension("py");
            if let Some(Item::File(source)) = items.get(&py) {
                let source = source.clone();
                items.insert(dest, Item::Bytecode { pyc, py: source });
            }
        }
    }
    if python2 {
        return;
    }
    let stdlib = PathBuf::from("lib").join(format!("python{short}"));
    let with_sources: BTreeSet<PathBuf> = items
        .keys()
        .filter(|dest| dest.starts_with(&stdlib) && dest.extension().is_some_and(|e| e == "py"))
        .filter_map(|dest| dest.parent().map(Path::to_path_buf))
        .collect();
    for dir in with_sources {
        items.insert(dir.join("__pycache__"), Item::Blocker);
    }
}

/// A kept link whose target is not part of the copy becomes a copy of the file it points at (or is left out).
fn resolve_links(prefix: &Path, items: &mut BTreeMap<PathBuf, Item>) {
    let dangling: Vec<PathBuf> = items
        .iter()
        .filter_map(|(dest, item)| match item {
            Item::Link(target) => {
                let resolved = dest.parent().and_then(|dir| normalize(&dir.join(target)));
                (!resolved.is_some_and(|r| items.contains_key(&r))).then(|| dest.clone())
            }
            _ => None,
        })
        .collect();
    for dest in dangling {
        let source = prefix.join(&dest);
        if fs_err::metadata(&source).is_ok_and(|m| m.is_file()) {
            items.insert(dest, Item::File(source));
        } else {
            items.remove(&dest);
        }
    }
}

/// Add `relative` (a directory under `prefix`) and everything below it that `keep` accepts (given the path
/// relative to `relative`).
fn add_tree(
    prefix: &Path,
    relative: &Path,
    items: &mut BTreeMap<PathBuf, Item>,
    keep: &dyn Fn(&Path) -> bool,
) -> Result<()> {
    let root = prefix.join(relative);
    items.insert(relative.to_path_buf(), Item::Dir);
    let walk = walkdir::WalkDir::new(&root)
        .follow_links(false)
        .min_depth(1)
        .into_iter()
        // No `__pycache__` is copied (see `bytecode`), and a running interpreter writes `<module>.pyc.<id>` files
        // into it that vanish a moment later: it is not walked at all.
        .filter_entry(|entry| {
            entry.file_name() != "__pycache__"
                && keep(entry.path().strip_prefix(&root).unwrap_or(entry.path()))
        });
    for entry in walk {
        let entry = match entry {
            Ok(entry) => entry,
            Err(err) if vanished_bytecode(&err) => continue,
            Err(err) => {
                return Err(std::io::Error::other(format!(
                    "failed to walk `{}`: {err}",
                    root.display()
                ))
                .into());
            }
        };
        let inner = entry.path().strip_prefix(prefix).unwrap_or(entry.path());
        match add_entry(prefix, inner, items) {
            Err(Error::Io(err))
                if err.kind() == std::io::ErrorKind::NotFound && is_bytecode(inner) => {}
            other => other?,
        }
    }
    Ok(())
}

/// A path of compiled bytecode, or of an interpreter's temporary file while it writes one
/// (`<module>.pyc.<id>`): python 3 writes and renames these while the installation is walked.
fn is_bytecode(path: &Path) -> bool {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.components().any(|c| c.as_os_str() == "__pycache__")
        || name.ends_with(".pyc")
        || name.ends_with(".pyo")
        || name.contains(".pyc.")
}

/// A walk error for an entry of bytecode that vanished between listing its directory and reading it.
fn vanished_bytecode(err: &walkdir::Error) -> bool {
    err.io_error()
        .is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound)
        && err.path().is_some_and(is_bytecode)
}

/// Add one entry of the installation: directories and files as they are; a relative link whose target stays
/// inside the copied tree as a link; any other link as the file it points at (a link to a directory outside, or a
/// dangling one, is left out).
fn add_entry(prefix: &Path, relative: &Path, items: &mut BTreeMap<PathBuf, Item>) -> Result<()> {
    let source = prefix.join(relative);
    let metadata = fs_err::symlink_metadata(&source)?;
    if metadata.is_dir() {
        items.insert(relative.to_path_buf(), Item::Dir);
    } else if metadata.file_type().is_symlink() {
        let target = fs_err::read_link(&source)?;
        let inside = target.is_relative()
            && relative
                .parent()
                .and_then(|dir| normalize(&dir.join(&target)))
                .is_some();
        match fs_err::metadata(&source) {
            // Kept as a link for now; `resolve_links` turns it into a copy when its target is not copied.
            Ok(_) if inside => {
                items.insert(relative.to_path_buf(), Item::Link(target));
            }
            Ok(followed) if followed.is_file() => {
                items.insert(relative.to_path_buf(), Item::File(source));
            }
            _ => tracing::debug!(
                "leaving out `{}` (a link out of the installation)",
                source.display()
            ),
        }
    } else if metadata.is_file() {
        items.insert(relative.to_path_buf(), Item::File(source));
    }
    Ok(())
}

/// `path` with `.` and `..` resolved lexically; `None` when it climbs above its start.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            _ => return None,
        }
    }
    Some(out)
}

impl Selection {
    /// A digest of everything the copy depends on that a `stat` can see: each entry's destination, kind, source
    /// path, size, mtime and ctime (ns), inode and mode, and each kept link's target. A file changed in any way
    /// changes its ctime.
    fn fingerprint(&self, version: &str) -> Result<String> {
        let mut hasher = sha2::Sha256::new();
        hasher.update(format!("{LAYOUT}\n{version}\n{}\n", self.prefix.display()));
        for (dest, item) in &self.items {
            hasher.update(dest.as_os_str().as_encoded_bytes());
            match item {
                Item::Dir => hasher.update(b"\0dir\n"),
                Item::Blocker => hasher.update(b"\0blocker\n"),
                Item::Link(target) => {
                    hasher.update(b"\0link ");
                    hasher.update(target.as_os_str().as_encoded_bytes());
                    hasher.update(b"\n");
                }
                Item::File(source) | Item::Bytecode { pyc: source, .. } => {
                    let m = fs_err::metadata(source)?;
                    hasher.update(b"\0file ");
                    hasher.update(source.as_os_str().as_encoded_bytes());
                    hasher.update(
                        format!(
                            " {} {}.{} {}.{} {} {} {:o}\n",
                            m.len(),
                            m.mtime(),
                            m.mtime_nsec(),
                            m.ctime(),
                            m.ctime_nsec(),
                            m.dev(),
                            m.ino(),
                            m.mode()
                        )
                        .as_bytes(),
                    );
                }
            }
        }
        Ok(Sha256::from_hasher(hasher).as_str().to_string())
    }

    /// Python 2's bytecode of `bytes` (the relocated source of `source`, copied to `dest`) as the installation's
    /// own interpreter compiles it (`-E -S -B`: no environment, no site, nothing written), recording the store's
    /// source mtime and `dest` as its file name (not the host's path, so the content hash does not depend on where
    /// the installation lies).
    fn python2_bytecode(&self, source: &Path, dest: &Path, bytes: &[u8]) -> Result<Vec<u8>> {
        use std::io::Write as _;
        const COMPILE: &str = "import sys, imp, marshal, struct\n\
            code = compile(sys.stdin.read(), sys.argv[1], 'exec')\n\
            sys.stdout.write(imp.get_magic() + struct.pack('<I', int(sys.argv[2])) + marshal.dumps(code))\n";
        let failed = |why: String| {
            Error::Invalid(format!(
                "cannot compile the relocated `{}` with `{}`: {why}",
                source.display(),
                self.executable.display()
            ))
        };
        let mut child = std::process::Command::new(&self.executable)
            .args(["-E", "-S", "-B", "-c", COMPILE])
            .arg(dest)
            .arg(crate::store::STORE_MTIME.to_string())
            .env_clear()
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|err| failed(err.to_string()))?;
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let input = bytes.to_vec();
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let out = child
            .wait_with_output()
            .map_err(|err| failed(err.to_string()))?;
        let written = writer
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("writer panicked")));
        if !out.status.success() || out.stdout.len() < 8 {
            return Err(failed(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        if let Err(err) = written {
            return Err(failed(format!("writing the source to it: {err}")));
        }
        Ok(out.stdout)
    }

    /// Copy the selection into `out`, relocating ELF files, and return the manifest of the canonical tree. With
    /// `out` `None`, nothing is written: the same walk, relocation and hashing give the manifest the copy would
    /// have (what `hvd lock` pins, [`pin`]).
    fn copy(&self, out: Option<&Path>) -> Result<crate::unpack::Manifest> {
        let mut manifest = BTreeMap::new();
        let mut host_libraries: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut provided = BTreeSet::new();
        // Python 2's bytecode compiled here for a relocated module (`python2_bytecode`), which the
        // installation's own `.pyc` (later in the walk) must not replace.
        let mut compiled = BTreeSet::new();
        for (dest, item) in &self.items {
            let path = out.map(|out| out.join(dest));
            let path = path.as_deref();
            let key = dest.to_string_lossy().into_owned();
            match item {
                Item::Dir => {
                    if let Some(path) = path {
                        fs_err::create_dir_all(path)?;
                    }
                    manifest.insert(key, ManifestEntry::Directory);
                }
                Item::Link(target) => {
                    if let Some(path) = path {
                        std::os::unix::fs::symlink(target, path).map_err(|err| {
                            std::io::Error::other(format!(
                                "failed to link `{}`: {err}",
                                path.display()
                            ))
                        })?;
                    }
                    if let Some(name) = dest.file_name() {
                        provided.insert(name.to_string_lossy().into_owned());
                    }
                    manifest.insert(
                        key,
                        ManifestEntry::Symlink {
                            target: target.to_string_lossy().into_owned(),
                        },
                    );
                }
                Item::Blocker => {
                    if let Some(path) = path {
                        fs_err::write(path, b"")?;
                    }
                    manifest.insert(
                        key,
                        ManifestEntry::File {
                            executable: false,
                            sha256: Sha256::of_bytes(b""),
                        },
                    );
                }
                Item::Bytecode { pyc, py } => {
                    if compiled.contains(dest) {
                        continue;
                    }
                    let Some(bytes) = store_bytecode(&self.short_version, pyc, py)? else {
                        continue;
                    };
                    if let Some(path) = path {
                        fs_err::write(path, &bytes)?;
                    }
                    manifest.insert(
                        key,
                        ManifestEntry::File {
                            executable: false,
                            sha256: Sha256::of_bytes(&bytes),
                        },
                    );
                }
                Item::File(source) => {
                    let mut bytes = fs_err::read(source)?;
                    let sysconfigdata = is_sysconfigdata(&self.short_version, dest);
                    if sysconfigdata {
                        relocate_sysconfigdata(&mut bytes);
                    }
                    if sysconfigdata && self.short_version.starts_with("2.") {
                        // Python 2 writes a module's bytecode beside its source, so without a valid `.pyc` it
                        // would write one into the store (or an env linking the module): compile it here.
                        let pyc = self.python2_bytecode(source, dest, &bytes)?;
                        let pyc_dest = dest.with_extension("pyc");
                        if let Some(out) = out {
                            fs_err::write(out.join(&pyc_dest), &pyc)?;
                        }
                        compiled.insert(pyc_dest.clone());
                        manifest.insert(
                            pyc_dest.to_string_lossy().into_owned(),
                            ManifestEntry::File {
                                executable: false,
                                sha256: Sha256::of_bytes(&pyc),
                            },
                        );
                    }
                    if elf::is_elf(&bytes) {
                        let needed = self.relocate(dest, &mut bytes).map_err(|err| {
                            Error::Invalid(format!(
                                "cannot copy the interpreter file `{}` into the store: {err}",
                                source.display()
                            ))
                        })?;
                        for soname in needed {
                            host_libraries
                                .entry(soname)
                                .or_default()
                                .insert(key.clone());
                        }
                    }
                    if let Some(name) = dest.file_name() {
                        provided.insert(name.to_string_lossy().into_owned());
                    }
                    let executable = fs_err::metadata(source)?.permissions().mode() & 0o111 != 0;
                    if let Some(path) = path {
                        fs_err::write(path, &bytes)?;
                        fs_err::set_permissions(
                            path,
                            std::fs::Permissions::from_mode(if executable { 0o755 } else { 0o644 }),
                        )?;
                    }
                    manifest.insert(
                        key,
                        ManifestEntry::File {
                            executable,
                            sha256: Sha256::of_bytes(&bytes),
                        },
                    );
                }
            }
        }
        let mut text = String::new();
        for (soname, files) in host_libraries {
            if provided.contains(&soname) || GLIBC_SONAMES.contains(&soname.as_str()) {
                continue;
            }
            text.push_str(&soname);
            for file in files {
                text.push(' ');
                text.push_str(&file);
            }
            text.push('\n');
        }
        if let Some(out) = out {
            fs_err::write(out.join(HOST_LIBRARIES), text.as_bytes())?;
        }
        manifest.insert(
            HOST_LIBRARIES.to_string(),
            ManifestEntry::File {
                executable: false,
                sha256: Sha256::of_bytes(text.as_bytes()),
            },
        );
        if let Some(out) = out {
            crate::store::canonicalize(out)?;
        }
        Ok(manifest)
    }

    /// Rewrite every `RPATH`/`RUNPATH` directory of `bytes` (the file `dest` of the copy) that lies in the
    /// copied part of the installation into `$ORIGIN`-relative form, leaving out those in the rest of it; return
    /// the file's `DT_NEEDED` sonames. A path that would grow
    /// (a very short prefix) is left as it is, with a warning: the copy then still looks there first.
    fn relocate(
        &self,
        dest: &Path,
        bytes: &mut [u8],
    ) -> std::result::Result<Vec<String>, elf::ElfError> {
        let dynamic = match elf::read_dynamic(bytes) {
            Ok(dynamic) => dynamic,
            Err(elf::ElfError::Unsupported(what)) => {
                tracing::warn!("not relocating `{}`: {what}", dest.display());
                return Ok(Vec::new());
            }
            Err(err) => return Err(err),
        };
        let from = dest.parent().unwrap_or(Path::new(""));
        for path in &dynamic.search_paths {
            // A directory of the installation that is copied becomes `$ORIGIN`-relative; one that is not (pyenv's
            // `<prefix>/openssl/lib`) is left out: the libraries found there are not copied, so they are listed in
            // `HOST_LIBRARIES` and come from the host's default search path.
            let rewritten: Vec<String> = path
                .value
                .split(':')
                .filter_map(|dir| match Path::new(dir).strip_prefix(&self.prefix) {
                    Ok(inside) => {
                        let copied = inside.as_os_str().is_empty()
                            || matches!(self.items.get(inside), Some(Item::Dir));
                        copied.then(|| origin_relative(from, inside))
                    }
                    Err(_) => Some(dir.to_string()),
                })
                .collect();
            // Never an empty search path: ld.so reads an empty entry as the working directory.
            let new = if rewritten.is_empty() {
                "$ORIGIN".to_string()
            } else {
                rewritten.join(":")
            };
            if new == path.value {
                continue;
            }
            match elf::set_search_path(bytes, path, &new) {
                Ok(()) => {}
                Err(elf::ElfError::TooLong { old, new }) => tracing::warn!(
                    "`{}`: cannot rewrite its search path `{old}` to `{new}` in place; it keeps the host's path",
                    dest.display()
                ),
                Err(err) => return Err(err),
            }
        }
        Ok(dynamic.needed)
    }
}

/// Whether `dest` is the module of the installation's configure-time variables (`lib/python3.11/
/// _sysconfigdata__linux_x86_64-linux-gnu.py`, python 2's `lib/python2.7/_sysconfigdata.py`), which `sysconfig`
/// and `distutils` read for the paths and flags that builds of extensions use.
fn is_sysconfigdata(short: &str, dest: &Path) -> bool {
    dest.parent() == Some(&PathBuf::from("lib").join(format!("python{short}")))
        && dest.file_name().is_some_and(|name| {
            let name = name.to_string_lossy();
            name.starts_with("_sysconfigdata") && name.ends_with(".py")
        })
}

/// Make the configure-time variables name the copy instead of the installation it was copied from: every value
/// naming a path under the configured prefix (`LIBDIR`, `INCLUDEPY`, `-L<prefix>/lib` in `LDSHARED`, ...) would
/// send a build of an extension to the host's installation, which a sandboxed build does not see and another host
/// does not have (distutils before python 3.8 links extensions with `-L$LIBDIR -lpython3.6m`). The store path is
/// not known while its content is hashed, and the prefix is not copied into code, so the appended function reads
/// both when the module is imported: the prefix from the module's own `build_time_vars['prefix']`, the store path
/// as the directory three levels above the module's real path (`<store path>/lib/pythonX.Y/_sysconfigdata*.py`).
/// An occurrence of the prefix is replaced where it starts the value or follows a character that cannot continue
/// a path (a blank, `=`, `,`, a quote; or `-L`/`-I`/`-R`) and is followed by `/`, a blank, `:`, a quote or the
/// value's end. Nothing is replaced for a system prefix (`/usr`, `/usr/local`: a value there may name any host
/// file, such as `/usr/bin/install`; Debian's python) or a prefix that is not an absolute path.
fn relocate_sysconfigdata(bytes: &mut Vec<u8>) {
    bytes.extend_from_slice(RELOCATE_SYSCONFIGDATA.as_bytes());
}

/// Appended to `_sysconfigdata*.py` (python 2.7 and 3.x alike): see [`relocate_sysconfigdata`].
const RELOCATE_SYSCONFIGDATA: &str = r#"

# Appended by hvd when this installation was copied into its store: values naming paths under the prefix it was
# configured with name this copy instead.
def _hvd_relocate():
    import os
    old = build_time_vars.get('prefix')
    if not isinstance(old, str):
        return
    old = old.rstrip('/')
    if old in ('', '/usr', '/usr/local') or not old.startswith('/'):
        return
    new = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    if new == old:
        return
    for key, value in list(build_time_vars.items()):
        if not isinstance(value, str) or old not in value:
            continue
        parts = value.split(old)
        out = parts[0]
        for part in parts[1:]:
            before = out[-1:]
            starts = before == '' or before in ' \t=,"\'' or out[-2:] in ('-L', '-I', '-R')
            ends = part[:1] in ('', '/', ' ', '\t', ':', '"', "'")
            out += (new if starts and ends else old) + part
        build_time_vars[key] = out
_hvd_relocate()
del _hvd_relocate
"#;

/// The bytes of `pyc` with the source mtime it records set to the store's, when it is valid for the source `py`
/// (the mtime and, from 3.3, the size it records are the source's; from 3.7 its flags say timestamp-based);
/// `None` otherwise (the interpreter then compiles that module, as it would have on the host).
fn store_bytecode(short: &str, pyc: &Path, py: &Path) -> Result<Option<Vec<u8>>> {
    let mut bytes = fs_err::read(pyc)?;
    let source = fs_err::metadata(py)?;
    let mut numbers = short.split('.').map(|n| n.parse::<u32>().unwrap_or(0));
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    let (mtime_at, size_at) = if version >= (3, 7) {
        if bytes.get(4..8) != Some(&[0, 0, 0, 0][..]) {
            return Ok(None);
        }
        (8, Some(12))
    } else if version >= (3, 3) {
        (4, Some(8))
    } else {
        (4, None)
    };
    let word = |at: usize| -> Option<u32> {
        bytes
            .get(at..at + 4)
            .and_then(|w| w.try_into().ok())
            .map(u32::from_le_bytes)
    };
    let valid = word(mtime_at) == Some(source.mtime() as u32)
        && size_at.is_none_or(|at| word(at) == Some(source.len() as u32));
    if !valid {
        return Ok(None);
    }
    bytes[mtime_at..mtime_at + 4]
        .copy_from_slice(&(crate::store::STORE_MTIME as u32).to_le_bytes());
    Ok(Some(bytes))
}

/// `$ORIGIN/<path from the directory `from` to `to`>`, both relative to the store path's root.
fn origin_relative(from: &Path, to: &Path) -> String {
    let from: Vec<_> = from.components().collect();
    let to: Vec<_> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut parts: Vec<String> = vec!["$ORIGIN".into()];
    parts.extend(std::iter::repeat_n("..".to_string(), from.len() - common));
    parts.extend(
        to[common..]
            .iter()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
    );
    parts.join("/")
}

/// What a lock pins of `python`'s installation: its version and the content hash its store path has, or would have,
/// without copying it: the path this store already made from these files ([`import`]'s fingerprint entry) when it is
/// valid, else the pin an earlier `pin` of the same files computed (`<store>/.interpreters/<fingerprint>.pin`), else
/// the selection is read, relocated and hashed in memory, one file at a time, and only that pin file is written.
/// The pin file is a hint like the fingerprint entry: the build's copy checks the hash it computes against the pin.
pub fn pin(store: &Store, python: &Interpreter) -> Result<InterpreterPin> {
    let selection = select(python)?;
    let fingerprint = selection.fingerprint(&python.version)?;
    if let Some(found) = imported(store, python, &fingerprint) {
        return Ok(found.pin());
    }
    let hint = store
        .root()
        .join(".interpreters")
        .join(format!("{fingerprint}.pin"));
    if let Some(pinned) = read_pin_hint(&hint, &python.version) {
        tracing::debug!(
            "interpreter pin from the hint `{}`: {} {}",
            hint.display(),
            pinned.version,
            pinned.content_hash
        );
        return Ok(pinned);
    }
    let manifest = selection.copy(None)?;
    let pinned = InterpreterPin {
        version: python.version.clone(),
        content_hash: crate::hash::content_hash(&manifest),
    };
    // Only a hint: a failure to write it costs the next lock a hash, nothing else.
    if let Err(err) = write_pin_hint(store, &hint, &pinned) {
        tracing::debug!("no interpreter pin hint `{}`: {err}", hint.display());
    }
    Ok(pinned)
}

/// The pin a hint file holds (`VERSION\nCONTENT-HASH\n`), when it is a regular file of at most 4 KiB holding exactly
/// `version` and a sha256; anything else (planted, stale, cut short) gives `None`.
fn read_pin_hint(hint: &Path, version: &str) -> Option<InterpreterPin> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(hint)
        .ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    file.take(4096).read_to_string(&mut text).ok()?;
    let mut lines = text.lines();
    let (found, hash) = (lines.next()?, lines.next()?);
    if found != version || lines.next().is_some() {
        return None;
    }
    let content_hash: Sha256 = hash.parse().ok()?;
    Some(InterpreterPin {
        version: version.to_string(),
        content_hash,
    })
}

/// Write the hint file `hint` for `pinned`: a temp file renamed into place (created new, mode 0644).
fn write_pin_hint(store: &Store, hint: &Path, pinned: &InterpreterPin) -> Result<()> {
    let dir = store.root().join(".interpreters");
    interpreters_dir(&dir)?;
    let mut random = [0u8; 8];
    getrandom::fill(&mut random)
        .map_err(|err| std::io::Error::other(format!("no random bytes for a temp name: {err}")))?;
    let temp = dir.join(format!(
        ".pin.{}.{:016x}",
        std::process::id(),
        u64::from_le_bytes(random)
    ));
    let written = crate::store::create_new_file(&temp, 0o644)
        .and_then(|mut file| {
            std::io::Write::write_all(
                &mut file,
                format!("{}\n{}\n", pinned.version, pinned.content_hash).as_bytes(),
            )
        })
        .and_then(|_| std::fs::rename(&temp, hint));
    if let Err(err) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(err.into());
    }
    Ok(())
}

/// Create `<store>/.interpreters` (mode 0755) unless it exists.
fn interpreters_dir(cache_dir: &Path) -> Result<()> {
    if !cache_dir.is_dir() {
        // Whoever can write an entry chooses the interpreter of every env built from these files.
        use std::os::unix::fs::DirBuilderExt;
        let created = std::fs::DirBuilder::new().mode(0o755).create(cache_dir);
        if let Err(err) = created
            && err.kind() != std::io::ErrorKind::AlreadyExists
        {
            return Err(std::io::Error::other(format!(
                "failed to create `{}`: {err}",
                cache_dir.display()
            ))
            .into());
        }
    }
    Ok(())
}

/// The interpreter path that `<store>/.interpreters/<fingerprint>` names, when it is valid, of exactly `python`'s
/// version and named by its own content. The entry is only a hint: a stale or planted entry (naming another version,
/// or any other path) gives `None`.
fn imported(store: &Store, python: &Interpreter, fingerprint: &str) -> Option<StoredPython> {
    let name =
        std::fs::read_to_string(store.root().join(".interpreters").join(fingerprint)).ok()?;
    let name = name.trim();
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return None;
    }
    let path = store.root().join(name);
    if !store.is_valid(&path) {
        return None;
    }
    let stored = StoredPython::from_path(store, &path).ok()?;
    let expected = derivation(&python.version, &stored.content_hash);
    (stored.version == python.version
        && expected.path_name() == name
        && store.path_of(&expected) == path)
        .then_some(stored)
}

/// The store path of `python`'s installation, copying it in when this store has none for its current files.
pub fn import(store: &Store, python: &Interpreter) -> Result<StoredPython> {
    let selection = select(python)?;
    let fingerprint = selection.fingerprint(&python.version)?;
    let cache_dir = store.root().join(".interpreters");
    interpreters_dir(&cache_dir)?;
    let cache = cache_dir.join(&fingerprint);
    // An entry is only a hint (see [`imported`]); the copy that follows a stale or planted one overwrites it.
    let cached = || imported(store, python, &fingerprint);
    if let Some(found) = cached() {
        return Ok(found);
    }
    let lock_name = format!("python-import-{}", &fingerprint[..32]);
    let _lock = store.lock_path(&lock_name)?;
    if let Some(found) = cached() {
        return Ok(found);
    }
    let temp = store.temp_dir(&lock_name)?;
    let result = (|| {
        let out = temp.join("out");
        let manifest = selection.copy(Some(&out))?;
        let content_hash = crate::hash::content_hash(&manifest);
        let derivation = derivation(&python.version, &content_hash);
        let realized = store.realize_known(&derivation, false, |target| {
            fs_err::remove_dir(&target.out)?;
            // Moving a directory to another parent rewrites its `..`: it must be writable for a non-root owner.
            fs_err::set_permissions(&out, std::fs::Permissions::from_mode(0o755))?;
            fs_err::rename(&out, &target.out)?;
            Ok(KnownTree {
                manifest,
                ..KnownTree::default()
            })
        })?;
        let name = derivation.path_name();
        let partial = cache_dir.join(format!(".{fingerprint}.{}", std::process::id()));
        fs_err::write(&partial, format!("{name}\n"))?;
        fs_err::rename(&partial, &cache)?;
        StoredPython::from_path(store, &realized.path)
    })();
    crate::store::remove_tree(&temp)?;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_relative_paths() {
        assert_eq!(
            origin_relative(Path::new("bin"), Path::new("lib")),
            "$ORIGIN/../lib"
        );
        assert_eq!(
            origin_relative(Path::new("lib"), Path::new("lib")),
            "$ORIGIN"
        );
        assert_eq!(
            origin_relative(Path::new("lib/python3.11/lib-dynload"), Path::new("lib")),
            "$ORIGIN/../.."
        );
    }

    #[test]
    fn normalize_refuses_climbing_out() {
        assert_eq!(
            normalize(Path::new("lib/../bin/x")),
            Some(PathBuf::from("bin/x"))
        );
        assert_eq!(normalize(Path::new("lib/../../x")), None);
    }

    /// The appended relocation, run by a real python against a module laid out as in a store path: what it
    /// replaces and what it leaves (the boundaries), and that a system prefix is left alone.
    #[test]
    fn sysconfigdata_relocation_replaces_the_prefix_only_where_it_names_a_path_under_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap().join("abc-python-3.11.7");
        let stdlib = root.join("lib/python3.11");
        fs_err::create_dir_all(&stdlib).unwrap();
        let module = |prefix: &str| {
            let mut bytes = format!(
                "build_time_vars = {{'prefix': '{p}',\n 'LIBDIR': '{p}/lib',\n 'LDSHARED': 'gcc -shared -L{p}/lib ',\n \
                 'CONFIG_ARGS': \"'--prefix={p}' 'LDFLAGS=-Wl,-rpath,{p}/lib'\",\n 'PATHS': '{p}:/x',\n \
                 'OTHER': '/srv{p}/lib {p}-old {p}x',\n 'N': 3}}\n",
                p = prefix
            )
            .into_bytes();
            relocate_sysconfigdata(&mut bytes);
            fs_err::write(stdlib.join("_sysconfigdata_test.py"), bytes).unwrap();
        };
        let read = || {
            let out = std::process::Command::new("python3")
                .args(["-S", "-B", "-c", "import sys, json; sys.path.insert(0, sys.argv[1]); \
                       import _sysconfigdata_test as m; print(json.dumps(m.build_time_vars, sort_keys=True))"])
                .arg(&stdlib)
                .env_remove("PYTHONPATH")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        let old = "/root/.pyenv/versions/3.11.7";
        module(old);
        let new = root.display().to_string();
        let expected = format!(
            "{{\"CONFIG_ARGS\": \"'--prefix={new}' 'LDFLAGS=-Wl,-rpath,{new}/lib'\", \"LDSHARED\": \"gcc -shared \
             -L{new}/lib \", \"LIBDIR\": \"{new}/lib\", \"N\": 3, \"OTHER\": \"/srv{old}/lib {old}-old {old}x\", \
             \"PATHS\": \"{new}:/x\", \"prefix\": \"{new}\"}}\n"
        );
        assert_eq!(read(), expected);
        // Debian's python: /usr is every host's, so nothing is replaced.
        module("/usr");
        assert!(read().contains("\"LIBDIR\": \"/usr/lib\""));
    }
}
