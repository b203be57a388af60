//! The one archive-extraction routine for wheels (zip) and sdists (tar.gz, zip).
//!
//! An archive is hostile until proven otherwise, so extraction never follows a link it did not create, and never
//! follows any link while it writes:
//! - every directory on the way to an entry is opened relative to the one before it, one component at a time, with
//!   `O_NOFOLLOW | O_DIRECTORY` from a handle on the destination: a link (or a file) anywhere on the way makes the
//!   open fail, whatever the entry's name says lexically;
//! - files are created with `O_CREAT | O_EXCL | O_NOFOLLOW`: nothing that exists is overwritten or followed;
//! - names are normalized (`a//b` and `./a/b` are `a/b`) and each may appear once; `..`, absolute names, NUL bytes
//!   and names that are not UTF-8 are refused, as is an entry whose path goes through a link or a file entry;
//! - symlinks are created last, after every other entry, and only when their target, resolved component by
//!   component against the final tree the way the kernel would (following the archive's own links), stays inside;
//! - a hard link may only name a regular file extracted earlier from the same archive (its bytes are copied);
//! - device files, fifos and anything else are refused;
//! - the total unpacked size, the number of entries and the compression ratio are limited ([`Limits`]).
//!
//! The destination must be a fresh directory that only this extraction writes to.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use sha2::Digest;

use hvd_resolver::Sha256;

use crate::error::{Error, Result};
use crate::hash::ManifestEntry;

mod growing;
mod zip_archive;

pub(crate) use growing::{Growing, Publisher};
pub use zip_archive::unpack_zip;
pub(crate) use zip_archive::{OpenZip, SharedFile, unpack_open_zip};

/// Limits on what one archive may unpack to. The defaults are far above any real wheel or sdist (a CUDA build of
/// torch unpacks to about 4 GiB in about 15 000 files; tensorflow to about 2 GiB in 25 000; pyspark's sdist to about
/// 460 MB), and far below what would fill a disk or exhaust inodes by accident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of file content (hard link copies included), and of decompressed tar stream.
    pub max_unpacked_bytes: u64,
    /// Entries of any kind (files, directories, links).
    pub max_entries: u64,
    /// Unpacked bytes per archive byte, checked once more than `ratio_floor` bytes are unpacked.
    pub max_ratio: u64,
    /// Below this many unpacked bytes the ratio is not checked: small archives of very compressible text are fine.
    pub ratio_floor: u64,
}

/// 16 GiB: four times the largest real wheels (CUDA torch), so only a bomb reaches it.
pub const MAX_UNPACKED_BYTES: u64 = 16 << 30;
/// 200 000 entries: about eight times the most files a real wheel has (tensorflow's headers), far below inode
/// exhaustion.
pub const MAX_ENTRIES: u64 = 200_000;
/// Deflate tops out near 1032:1, real wheels and sdists are 2:1 to 10:1 overall (source text, shared libraries);
/// 100:1 over a whole archive only comes from a bomb (the 1 MB wheel that unpacked to 1 GiB was 1000:1).
pub const MAX_RATIO: u64 = 100;
/// 64 MiB: a small package of very compressible text (test data, padding) may exceed the ratio harmlessly.
pub const RATIO_FLOOR: u64 = 64 << 20;

/// The longest link target accepted (Linux's `PATH_MAX`).
const MAX_LINK_TARGET: u64 = 4096;
/// Links resolved within one target before it counts as a loop (Linux's own limit is 40).
const MAX_LINK_HOPS: usize = 40;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_unpacked_bytes: MAX_UNPACKED_BYTES,
            max_entries: MAX_ENTRIES,
            max_ratio: MAX_RATIO,
            ratio_floor: RATIO_FLOOR,
        }
    }
}

/// Where an archive entry goes: `Ok(Some(path))` relative to the destination (already normalized components
/// joined by `/`), `Ok(None)` to skip a directory entry, `Err(reason)` to refuse the entry.
pub type Layout<'a> = &'a dyn Fn(&str) -> std::result::Result<Option<String>, String>;

/// How to extract.
#[derive(Clone, Copy)]
pub struct Options<'a> {
    pub limits: Limits,
    /// Compute the sha256 of every file (for RECORD checks and the store's manifest).
    pub hash: bool,
    /// Maps normalized archive names to destination paths; `None` keeps them as they are.
    pub layout: Option<Layout<'a>>,
    /// Links may point anywhere (absolute, or out of the tree): a store path's archive from a binary cache, whose
    /// env links into the store and to its interpreter. They are still created last, so nothing is written
    /// through them, and the caller checks the whole tree against its signed content hash.
    pub links_anywhere: bool,
}

impl std::fmt::Debug for Options<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("limits", &self.limits)
            .field("hash", &self.hash)
            .field("links_anywhere", &self.links_anywhere)
            .finish_non_exhaustive()
    }
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options {
            limits: Limits::default(),
            hash: true,
            layout: None,
            links_anywhere: false,
        }
    }
}

/// One regular file or link written by an extraction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unpacked {
    /// Its path relative to the destination.
    pub dest: String,
    /// The sha256 of its bytes (of its target, for a link); `None` when hashing was off.
    pub sha256: Option<Sha256>,
    pub is_link: bool,
}

/// Every regular file and link an extraction wrote, by normalized archive name.
pub type Extracted = BTreeMap<String, Unpacked>;

/// Normalize an archive name: `/`-separated components without empty ones and `.`; `..`, absolute names and NUL
/// bytes are refused (the reason is returned). An empty result is the archive's root.
pub fn normalize(name: &str) -> std::result::Result<String, &'static str> {
    if name.starts_with('/') {
        return Err("is an absolute path");
    }
    if name.contains('\0') {
        return Err("contains a NUL byte");
    }
    let mut out = String::with_capacity(name.len());
    for part in name.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err("contains `..`"),
            part => {
                if !out.is_empty() {
                    out.push('/');
                }
                out.push_str(part);
            }
        }
    }
    Ok(out)
}

/// What the tree being built holds at a destination path.
#[derive(Debug, Clone)]
enum Node {
    /// A directory, named by an entry or made on the way to one (directories merge: two entries may name one).
    Dir,
    /// A regular file from the named archive entry.
    File { entry: String, executable: bool },
    /// A link (created at the end) to `target`, from the named archive entry.
    Link { entry: String, target: String },
}

/// The kind of an archive entry, independent of the archive format.
enum Kind {
    Dir,
    File { executable: bool },
    Symlink { target: String },
    HardLink { target: String },
}

/// Every entry of an extracted tree (directories, files, links) by its path relative to the destination, as the
/// store's content hash covers it ([`crate::hash::manifest`] of the same tree gives the same map).
pub type Manifest = BTreeMap<String, ManifestEntry>;

/// The bytes read and written at a time.
const BUFFER_BYTES: usize = 256 << 10;
/// A zip whose files declare at least this many bytes in all is written by several threads.
const PARALLEL_FROM_BYTES: u64 = 16 << 20;
/// Files at least this big are written first, largest first: the longest single stream bounds the whole.
const BIG_FILE_BYTES: u64 = 1 << 20;

/// The last directory a thread opened, by destination path (entries come grouped by directory).
#[derive(Default)]
struct DirCache {
    open: Option<(String, OwnedFd)>,
}

/// What writing a file into the tree needs: shared (read-only but for two atomics) by the threads of a parallel
/// zip extraction.
struct Sink<'a> {
    archive: &'a Path,
    dest: &'a Path,
    root: OwnedFd,
    limits: Limits,
    archive_len: u64,
    hash: bool,
    /// Give each entry the store's mode and mtime as it is written (files when their bytes are in, links and
    /// directories at the end), so that the store need not walk the tree again.
    store_modes: bool,
    /// Bytes of file content written so far, by every thread.
    written: AtomicU64,
    /// Set by the first thread that fails: the others stop at their next chunk.
    failed: AtomicBool,
    /// The download being unpacked while it arrives: before its verdict the bytes written are bounded by what it
    /// received ([`Growing::admit`]).
    growing: Option<std::sync::Arc<Growing>>,
}

fn errno_error(path: &Path, what: &str, errno: Errno) -> Error {
    std::io::Error::other(format!("failed to {what} `{}`: {errno}", path.display())).into()
}

impl Sink<'_> {
    fn refuse(&self, entry: &str, reason: impl Into<String>) -> Error {
        Error::UnsafeArchiveEntry {
            archive: self.archive.to_path_buf(),
            entry: entry.to_string(),
            reason: reason.into(),
        }
    }

    fn io(&self, entry: &str, err: impl std::fmt::Display) -> Error {
        Error::Archive {
            archive: self.archive.to_path_buf(),
            message: format!("entry `{entry}`: {err}"),
        }
    }

    /// Refuse when `total` unpacked bytes break the size or ratio limit.
    fn check_total(&self, entry: &str, total: u64) -> Result<()> {
        let limits = &self.limits;
        if total > limits.max_unpacked_bytes {
            return Err(self.refuse(
                entry,
                format!(
                    "makes the archive unpack to more than {} bytes (the limit for any archive)",
                    limits.max_unpacked_bytes
                ),
            ));
        }
        if total > limits.ratio_floor && total > self.archive_len.saturating_mul(limits.max_ratio) {
            return Err(self.refuse(
                entry,
                format!(
                    "makes the archive unpack to more than {}x its size of {} bytes (a decompression bomb)",
                    limits.max_ratio, self.archive_len
                ),
            ));
        }
        Ok(())
    }

    /// Open the directory `path` (relative to the destination) one component at a time, each with `O_NOFOLLOW |
    /// O_DIRECTORY` relative to the one before, making missing ones: a link or a file on the way fails.
    fn open_dir(&self, entry: &str, path: &str) -> Result<OwnedFd> {
        let mut current: Option<OwnedFd> = None;
        let mut so_far = 0;
        for component in path.split('/') {
            so_far += component.len() + usize::from(so_far > 0);
            let dir = match &current {
                Some(fd) => fd.as_fd(),
                None => self.root.as_fd(),
            };
            let open = || {
                nix::fcntl::openat(
                    dir,
                    component,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
            };
            let opened = match open() {
                Err(Errno::ENOENT) => {
                    match nix::sys::stat::mkdirat(dir, component, Mode::from_bits_truncate(0o755)) {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(errno) => {
                            return Err(errno_error(
                                &self.dest.join(&path[..so_far]),
                                "create directory",
                                errno,
                            ));
                        }
                    }
                    open()
                }
                other => other,
            };
            match opened {
                Ok(fd) => current = Some(fd),
                Err(Errno::ELOOP | Errno::ENOTDIR) => {
                    return Err(self.refuse(
                        entry,
                        format!(
                            "goes through `{}`, which is not a directory: nothing is written through a link",
                            &path[..so_far]
                        ),
                    ));
                }
                Err(errno) => {
                    return Err(errno_error(&self.dest.join(&path[..so_far]), "open", errno));
                }
            }
        }
        current.ok_or_else(|| self.refuse(entry, "has an empty directory name"))
    }

    /// Open (making them as needed) the directories on the way to `dest` without following anything; returns the
    /// parent's handle (kept in `dirs` for the next entry) and the last component.
    fn open_parent<'d>(
        &'d self,
        dirs: &'d mut DirCache,
        entry: &str,
        dest: &'d str,
    ) -> Result<(BorrowedFd<'d>, &'d str)> {
        let (parent, last) = match dest.rfind('/') {
            Some(index) => (&dest[..index], &dest[index + 1..]),
            None => ("", dest),
        };
        if parent.is_empty() {
            return Ok((self.root.as_fd(), last));
        }
        if dirs.open.as_ref().is_none_or(|(path, _)| path != parent) {
            let fd = self.open_dir(entry, parent)?;
            dirs.open = Some((parent.to_string(), fd));
        }
        let (_, fd) = dirs.open.as_ref().expect("opened above");
        Ok((fd.as_fd(), last))
    }

    /// Create the file `dest` (never following or replacing anything), fill it from `reader` (counting the bytes
    /// against the limits), set its mode (and the store's mtime); its sha256 when hashing.
    fn write_file(
        &self,
        dirs: &mut DirCache,
        buffer: &mut [u8],
        entry: &str,
        dest: &str,
        executable: bool,
        reader: &mut dyn Read,
    ) -> Result<Option<Sha256>> {
        let (parent, last) = self.open_parent(dirs, entry, dest)?;
        let fd = nix::fcntl::openat(
            parent,
            last,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        );
        let fd = match fd {
            Ok(fd) => fd,
            Err(Errno::EEXIST | Errno::ELOOP) => {
                return Err(self.refuse(entry, format!("would replace `{dest}`, which exists")));
            }
            Err(errno) => return Err(errno_error(&self.dest.join(dest), "create", errno)),
        };
        let mut file = std::fs::File::from(fd);
        let mut hasher = self.hash.then(sha2::Sha256::new);
        loop {
            if self.failed.load(Ordering::Acquire) {
                return Err(self.io(entry, "stopped: another entry of the archive failed"));
            }
            let n = match reader.read(buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(self.io(entry, err)),
            };
            let total = self.written.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
            self.check_total(entry, total)?;
            if let Some(growing) = &self.growing {
                growing.admit(total).map_err(|err| self.io(entry, err))?;
            }
            if let Some(hasher) = hasher.as_mut() {
                hasher.update(&buffer[..n]);
            }
            file.write_all(&buffer[..n]).map_err(|err| {
                std::io::Error::new(
                    err.kind(),
                    format!(
                        "failed to write `{}`: {err}",
                        self.dest.join(dest).display()
                    ),
                )
            })?;
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = match (executable, self.store_modes) {
            (true, true) => 0o555,
            (false, true) => 0o444,
            (true, false) => 0o755,
            (false, false) => 0o644,
        };
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        if self.store_modes {
            nix::sys::stat::futimens(&file, &store_time(), &store_time())
                .map_err(|errno| errno_error(&self.dest.join(dest), "set the mtime of", errno))?;
        }
        Ok(hasher.map(Sha256::from_hasher))
    }
}

/// Modification time every store entry gets (seconds since the epoch), as Nix does; the store re-exports it.
pub const STORE_MTIME: i64 = 1;

/// The mtime of every store entry.
fn store_time() -> nix::sys::time::TimeSpec {
    nix::sys::time::TimeSpec::new(STORE_MTIME, 0)
}

struct Extractor<'a> {
    sink: Sink<'a>,
    options: Options<'a>,
    nodes: HashMap<String, Node>,
    /// Every normalized archive name seen, to refuse duplicates.
    seen: HashSet<String>,
    extracted: Extracted,
    pending_links: Vec<(String, String, String)>,
    entries: u64,
    dirs: DirCache,
    buffer: Vec<u8>,
}

/// What one thread of a parallel extraction wrote: index into the jobs and the file's sha256.
type Written = Vec<(usize, Option<Sha256>)>;

/// A file of a zip whose place is checked and claimed, waiting for its bytes.
struct FileJob {
    index: usize,
    entry: String,
    normalized: String,
    dest: String,
    executable: bool,
    /// What the central directory says it unpacks to: the order's hint, and exactly what it must unpack to.
    size: u64,
}

impl<'a> Extractor<'a> {
    /// An extractor of `archive` (`archive_len` bytes: the ratio limit's base) into `dest`.
    fn new(
        archive: &'a Path,
        archive_len: u64,
        dest: &'a Path,
        options: Options<'a>,
        store_modes: bool,
    ) -> Result<Self> {
        fs_err::create_dir_all(dest)?;
        let root = nix::fcntl::open(
            dest,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| errno_error(dest, "open", errno))?;
        Ok(Extractor {
            sink: Sink {
                archive,
                dest,
                root,
                limits: options.limits,
                archive_len,
                hash: options.hash,
                store_modes,
                written: AtomicU64::new(0),
                failed: AtomicBool::new(false),
                growing: None,
            },
            options,
            nodes: HashMap::new(),
            seen: HashSet::new(),
            extracted: BTreeMap::new(),
            pending_links: Vec::new(),
            entries: 0,
            dirs: DirCache::default(),
            buffer: vec![0u8; BUFFER_BYTES],
        })
    }

    fn refuse(&self, entry: &str, reason: impl Into<String>) -> Error {
        self.sink.refuse(entry, reason)
    }

    fn io(&self, entry: &str, err: impl std::fmt::Display) -> Error {
        self.sink.io(entry, err)
    }

    fn check_total(&self, entry: &str, total: u64) -> Result<()> {
        self.sink.check_total(entry, total)
    }

    fn count_entry(&mut self, entry: &str) -> Result<()> {
        self.entries += 1;
        if self.entries > self.options.limits.max_entries {
            return Err(self.refuse(
                entry,
                format!(
                    "is one entry more than the {} an archive may have",
                    self.options.limits.max_entries
                ),
            ));
        }
        Ok(())
    }

    /// Normalize `name` and map it to its destination; `None` for a directory entry to skip.
    fn place(&self, name: &str, is_dir: bool) -> Result<Option<(String, String)>> {
        let normalized = normalize(name).map_err(|reason| self.refuse(name, reason))?;
        if normalized.is_empty() {
            return if is_dir {
                Ok(None)
            } else {
                Err(self.refuse(name, "has an empty name"))
            };
        }
        let dest = match self.options.layout {
            None => Some(normalized.clone()),
            Some(layout) => layout(&normalized).map_err(|reason| self.refuse(name, reason))?,
        };
        // A layout builds destinations from archive text (a wheel's `.dist-info` name goes into `include/<name>/`):
        // what it returns must be a plain relative path too, or a `..` would reach above the tree being built.
        if let Some(dest) = &dest
            && normalize(dest).ok().as_deref() != Some(dest.as_str())
        {
            return Err(self.refuse(
                name,
                format!("would be placed at `{dest}`, which is not a plain relative path"),
            ));
        }
        match dest {
            Some(dest) if !dest.is_empty() => Ok(Some((normalized, dest))),
            _ if is_dir => Ok(None),
            _ => Err(self.refuse(name, "has no place to go")),
        }
    }

    /// Record `node` at `dest` for `entry`: its parents must be directories (made here when new), and the name may
    /// not be taken (except a directory named twice, once implicitly).
    fn claim(&mut self, entry: &str, normalized: &str, dest: &str, node: Node) -> Result<()> {
        if !self.seen.insert(normalized.to_string()) {
            return Err(self.refuse(
                entry,
                format!("is a duplicate name: `{normalized}` is already in the archive"),
            ));
        }
        let mut end = 0;
        while let Some(offset) = dest[end..].find('/') {
            end += offset;
            let parent = &dest[..end];
            match self.nodes.get(parent) {
                Some(Node::Dir) => {}
                Some(Node::Link { .. }) => {
                    return Err(self.refuse(
                        entry,
                        format!("goes through `{parent}`, which is a link: nothing is written through a link"),
                    ));
                }
                Some(Node::File { .. }) => {
                    return Err(
                        self.refuse(entry, format!("goes through `{parent}`, which is a file"))
                    );
                }
                None => {
                    self.nodes.insert(parent.to_string(), Node::Dir);
                }
            }
            end += 1;
        }
        let is_dir = matches!(node, Node::Dir);
        match self.nodes.get(dest) {
            None => {}
            Some(Node::Dir) if is_dir => {}
            Some(Node::Dir) => {
                return Err(self.refuse(
                    entry,
                    format!("is a file or link, but `{dest}` is already a directory"),
                ));
            }
            Some(Node::File { entry: first, .. } | Node::Link { entry: first, .. }) => {
                return Err(self.refuse(
                    entry,
                    format!("is a duplicate name: `{dest}` was already written by entry `{first}`"),
                ));
            }
        }
        self.nodes.insert(dest.to_string(), node);
        Ok(())
    }

    fn add_dir(&mut self, entry: &str) -> Result<()> {
        self.count_entry(entry)?;
        let Some((normalized, dest)) = self.place(entry, true)? else {
            return Ok(());
        };
        self.claim(entry, &normalized, &dest, Node::Dir)?;
        let (parent, last) = self.sink.open_parent(&mut self.dirs, entry, &dest)?;
        match nix::sys::stat::mkdirat(parent, last, Mode::from_bits_truncate(0o755)) {
            Ok(()) | Err(Errno::EEXIST) => Ok(()),
            Err(errno) => Err(errno_error(
                &self.sink.dest.join(&dest),
                "create directory",
                errno,
            )),
        }
    }

    /// Write the file `dest` from `reader` and record it as extracted under `normalized`.
    fn write_file(
        &mut self,
        entry: &str,
        (normalized, dest): (String, String),
        executable: bool,
        reader: &mut dyn Read,
    ) -> Result<()> {
        let sha256 = self.sink.write_file(
            &mut self.dirs,
            &mut self.buffer,
            entry,
            &dest,
            executable,
            reader,
        )?;
        self.extracted.insert(
            normalized,
            Unpacked {
                dest,
                sha256,
                is_link: false,
            },
        );
        Ok(())
    }

    /// [`Self::claim`] `dest` for a regular file of `entry`.
    fn claim_file(
        &mut self,
        entry: &str,
        normalized: &str,
        dest: &str,
        executable: bool,
    ) -> Result<()> {
        self.claim(
            entry,
            normalized,
            dest,
            Node::File {
                entry: entry.to_string(),
                executable,
            },
        )
    }

    /// Check and claim a regular file's place; `None` when it has none (never for a file: an error then).
    fn plan_file(&mut self, entry: &str, executable: bool) -> Result<Option<(String, String)>> {
        self.count_entry(entry)?;
        let Some((normalized, dest)) = self.place(entry, false)? else {
            return Ok(None);
        };
        self.claim_file(entry, &normalized, &dest, executable)?;
        Ok(Some((normalized, dest)))
    }

    fn add_file(&mut self, entry: &str, executable: bool, reader: &mut dyn Read) -> Result<()> {
        let Some(place) = self.plan_file(entry, executable)? else {
            return Ok(());
        };
        self.write_file(entry, place, executable, reader)
    }

    fn add_symlink(&mut self, entry: &str, target: &str) -> Result<()> {
        self.count_entry(entry)?;
        let Some((normalized, dest)) = self.place(entry, false)? else {
            return Ok(());
        };
        if target.is_empty()
            || target.contains('\0')
            || (target.starts_with('/') && !self.options.links_anywhere)
        {
            return Err(self.refuse(
                entry,
                format!(
                    "is a link to `{target}`: only relative links inside the archive are allowed"
                ),
            ));
        }
        self.claim(
            entry,
            &normalized,
            &dest,
            Node::Link {
                entry: entry.to_string(),
                target: target.to_string(),
            },
        )?;
        let sha256 = self
            .options
            .hash
            .then(|| Sha256::of_bytes(target.as_bytes()));
        self.extracted.insert(
            normalized.clone(),
            Unpacked {
                dest: dest.clone(),
                sha256,
                is_link: true,
            },
        );
        self.pending_links
            .push((entry.to_string(), dest, target.to_string()));
        Ok(())
    }

    /// A hard link: a copy of a regular file extracted earlier from this archive (never anything else).
    fn add_hard_link(&mut self, entry: &str, target: &str) -> Result<()> {
        self.count_entry(entry)?;
        let Some((normalized, dest)) = self.place(entry, false)? else {
            return Ok(());
        };
        let refuse_target = |this: &Self, why: &str| {
            this.refuse(
                entry,
                format!("is a hard link to `{target}`, {why}: hard links may only name a regular file extracted before them"),
            )
        };
        let target_normalized = normalize(target).map_err(|reason| refuse_target(self, reason))?;
        let source = match self.extracted.get(&target_normalized) {
            Some(unpacked) if !unpacked.is_link => unpacked.clone(),
            Some(_) => return Err(refuse_target(self, "which is a link")),
            None => return Err(refuse_target(self, "which was not extracted before it")),
        };
        self.claim_file(entry, &normalized, &dest, false)?;
        let (parent, last) = self.sink.open_parent(&mut self.dirs, entry, &source.dest)?;
        let fd = nix::fcntl::openat(
            parent,
            last,
            OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| errno_error(&self.sink.dest.join(&source.dest), "open", errno))?;
        let mut file = std::fs::File::from(fd);
        use std::os::unix::fs::PermissionsExt;
        let metadata = file.metadata()?;
        if !metadata.is_file() {
            return Err(refuse_target(self, "which is not a regular file"));
        }
        let executable = metadata.permissions().mode() & 0o111 != 0;
        self.nodes.insert(
            dest.clone(),
            Node::File {
                entry: entry.to_string(),
                executable,
            },
        );
        self.write_file(entry, (normalized, dest), executable, &mut file)
    }

    /// Write the files of `jobs` from `zip`, on up to `threads` threads, and record them as extracted. On an
    /// error the first failure is returned and every thread stops at its next chunk.
    fn write_zip_files(
        &mut self,
        zip: &zip::ZipArchive<SharedFile>,
        jobs: Vec<FileJob>,
        threads: usize,
    ) -> Result<()> {
        let threads = threads.clamp(1, jobs.len().max(1));
        if threads == 1 {
            let mut zip = zip.clone();
            for job in jobs {
                let reader = zip
                    .by_index(job.index)
                    .map_err(|err| archive_error(self.sink.archive, err))?;
                self.write_file(
                    &job.entry,
                    (job.normalized, job.dest),
                    job.executable,
                    &mut zip_archive::Declared::new(reader, job.size),
                )?;
            }
            return Ok(());
        }
        // Big files first, largest first; the rest in archive order, so a thread's entries share directories.
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by_key(|&i| {
            let size = jobs[i].size;
            if size >= BIG_FILE_BYTES {
                (false, std::cmp::Reverse(size), i)
            } else {
                (true, std::cmp::Reverse(0), i)
            }
        });
        let next = AtomicUsize::new(0);
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        let sink = &self.sink;
        let jobs = &jobs;
        let order = &order;
        let joined: Vec<std::thread::Result<Written>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut zip = zip.clone();
                        let mut dirs = DirCache::default();
                        let mut buffer = vec![0u8; BUFFER_BYTES];
                        let mut done = Vec::new();
                        while !sink.failed.load(Ordering::Acquire) {
                            let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) else {
                                break;
                            };
                            let job = &jobs[i];
                            let written = zip
                                .by_index(job.index)
                                .map_err(|err| archive_error(sink.archive, err))
                                .and_then(|reader| {
                                    sink.write_file(
                                        &mut dirs,
                                        &mut buffer,
                                        &job.entry,
                                        &job.dest,
                                        job.executable,
                                        &mut zip_archive::Declared::new(reader, job.size),
                                    )
                                });
                            match written {
                                Ok(sha256) => done.push((i, sha256)),
                                Err(err) => {
                                    // The error is in place before the others are told to stop, so theirs
                                    // ("stopped") never replaces it.
                                    first_error
                                        .lock()
                                        .unwrap_or_else(|e| e.into_inner())
                                        .get_or_insert(err);
                                    sink.failed.store(true, Ordering::Release);
                                    break;
                                }
                            }
                        }
                        done
                    })
                })
                .collect();
            handles.into_iter().map(|handle| handle.join()).collect()
        });
        if let Some(err) = first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(err);
        }
        let mut hashes: Vec<Option<Option<Sha256>>> = vec![None; jobs.len()];
        for result in joined {
            let done = result.map_err(|_| {
                self.io(
                    "(any)",
                    "a thread writing the archive's files panicked; nothing was installed",
                )
            })?;
            for (i, sha256) in done {
                hashes[i] = Some(sha256);
            }
        }
        for (job, sha256) in jobs.iter().zip(hashes) {
            let sha256 = sha256.ok_or_else(|| self.io(&job.entry, "was not written"))?;
            self.extracted.insert(
                job.normalized.clone(),
                Unpacked {
                    dest: job.dest.clone(),
                    sha256,
                    is_link: false,
                },
            );
        }
        Ok(())
    }

    /// Whether a link at `dest` to `target` resolves inside the tree, following the tree's links as the kernel
    /// would (a link's `..` leaves the directory the link resolved to, not the one its name suggests).
    /// Returns why not, when not.
    fn resolves_inside(&self, dest: &str, target: &str) -> std::result::Result<(), &'static str> {
        let mut stack: Vec<String> = dest.split('/').map(str::to_string).collect();
        stack.pop();
        let mut pending: VecDeque<String> = target.split('/').map(str::to_string).collect();
        let mut hops = 0;
        while let Some(component) = pending.pop_front() {
            match component.as_str() {
                "" | "." => {}
                ".." => {
                    if stack.pop().is_none() {
                        return Err("which resolves outside the archive's tree");
                    }
                }
                _ => {
                    stack.push(component);
                    if let Some(Node::Link { target, .. }) = self.nodes.get(&stack.join("/")) {
                        hops += 1;
                        if hops > MAX_LINK_HOPS {
                            return Err("which is part of a link loop");
                        }
                        if target.starts_with('/') {
                            return Err("which resolves outside the archive's tree");
                        }
                        stack.pop();
                        for part in target.split('/').rev() {
                            pending.push_front(part.to_string());
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Create the links, now that the whole tree is known; with store modes, give links and directories their
    /// mtime and directories their mode (deepest first: a directory is made read-only only once nothing more is
    /// created in it). Returns what was extracted and, when hashing, the manifest of the whole tree.
    fn finish(mut self) -> Result<(Extracted, Option<Manifest>)> {
        let links = std::mem::take(&mut self.pending_links);
        for (entry, dest, target) in links.iter().filter(|_| !self.options.links_anywhere) {
            if let Err(why) = self.resolves_inside(dest, target) {
                return Err(self.refuse(entry, format!("is a link to `{target}`, {why}")));
            }
        }
        let root = self.sink.dest;
        for (entry, dest, target) in &links {
            let (parent, last) = self.sink.open_parent(&mut self.dirs, entry, dest)?;
            nix::unistd::symlinkat(target.as_str(), parent, last)
                .map_err(|errno| errno_error(&root.join(dest), "create link", errno))?;
            if self.sink.store_modes {
                nix::sys::stat::utimensat(
                    parent,
                    last,
                    &store_time(),
                    &store_time(),
                    nix::sys::stat::UtimensatFlags::NoFollowSymlink,
                )
                .map_err(|errno| errno_error(&root.join(dest), "set the mtime of", errno))?;
            }
        }
        if self.sink.store_modes {
            let mut dirs: Vec<&String> = self
                .nodes
                .iter()
                .filter(|(_, node)| matches!(node, Node::Dir))
                .map(|(path, _)| path)
                .collect();
            // Reverse byte order puts every directory before its parent (`a/b` sorts after `a`).
            dirs.sort_unstable_by(|a, b| b.cmp(a));
            for dir in dirs {
                let (parent, last) = self.sink.open_parent(&mut self.dirs, dir, dir)?;
                let fd = nix::fcntl::openat(
                    parent,
                    last,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|errno| errno_error(&root.join(dir), "open", errno))?;
                nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(0o555))
                    .map_err(|errno| errno_error(&root.join(dir), "set the mode of", errno))?;
                nix::sys::stat::futimens(&fd, &store_time(), &store_time())
                    .map_err(|errno| errno_error(&root.join(dir), "set the mtime of", errno))?;
            }
        }
        let manifest = self.options.hash.then(|| self.manifest()).transpose()?;
        Ok((self.extracted, manifest))
    }

    /// The tree as the store's content hash sees it, from what was written (every directory, file and link is
    /// a node, and nothing else was written into the destination).
    fn manifest(&self) -> Result<Manifest> {
        let hashes: HashMap<&str, &Sha256> = self
            .extracted
            .values()
            .filter(|unpacked| !unpacked.is_link)
            .filter_map(|unpacked| Some((unpacked.dest.as_str(), unpacked.sha256.as_ref()?)))
            .collect();
        self.nodes
            .iter()
            .map(|(path, node)| {
                let entry = match node {
                    Node::Dir => ManifestEntry::Directory,
                    Node::File { entry, executable } => ManifestEntry::File {
                        executable: *executable,
                        sha256: (*hashes
                            .get(path.as_str())
                            .ok_or_else(|| self.io(entry, "was not written"))?)
                        .clone(),
                    },
                    Node::Link { target, .. } => ManifestEntry::Symlink {
                        target: target.clone(),
                    },
                };
                Ok((path.clone(), entry))
            })
            .collect()
    }
}

fn archive_error(archive: &Path, err: impl std::fmt::Display) -> Error {
    Error::Archive {
        archive: archive.to_path_buf(),
        message: err.to_string(),
    }
}

/// Counts (and caps) the decompressed bytes of a tar stream, headers and padding included.
struct CountingReader<R> {
    inner: R,
    count: std::rc::Rc<std::cell::Cell<u64>>,
    cap: u64,
}

impl<R: Read> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let total = self.count.get() + n as u64;
        self.count.set(total);
        if total > self.cap {
            return Err(std::io::Error::other(
                "the decompressed stream is over its limit",
            ));
        }
        Ok(n)
    }
}

/// Unpack a `.tar.gz` archive into `dest` (see the module documentation for what is refused).
pub(crate) fn unpack_tar_gz(
    archive: &Path,
    dest: &Path,
    options: Options<'_>,
) -> Result<Extracted> {
    unpack_tar(archive, dest, options, |file| {
        Ok(Box::new(flate2::read::GzDecoder::new(file)))
    })
}

/// A zstd-compressed tar (a binary cache's archive), with every check of [`unpack_tar_gz`].
pub(crate) fn unpack_tar_zst(
    archive: &Path,
    dest: &Path,
    options: Options<'_>,
) -> Result<Extracted> {
    unpack_tar(archive, dest, options, |file| {
        Ok(Box::new(zstd::stream::read::Decoder::with_buffer(file)?))
    })
}

/// An uncompressed tar (the Debian packages of a toolchain, merged by `debian::deb`), with every check of
/// [`unpack_tar_gz`].
pub(crate) fn unpack_tar_plain(
    archive: &Path,
    dest: &Path,
    options: Options<'_>,
) -> Result<Extracted> {
    unpack_tar(archive, dest, options, |file| Ok(Box::new(file)))
}

/// A tar stream read through `decoder` (gzip, zstd).
fn unpack_tar(
    archive: &Path,
    dest: &Path,
    options: Options<'_>,
    decoder: impl FnOnce(std::io::BufReader<fs_err::File>) -> std::io::Result<Box<dyn Read>>,
) -> Result<Extracted> {
    let file = fs_err::File::open(archive)?;
    let archive_len = file.metadata()?.len();
    let mut extractor = Extractor::new(archive, archive_len, dest, options, false)?;
    let limits = options.limits;
    // The stream may not exceed what the size and ratio limits allow (this also bounds the memory the tar reader
    // spends on long names and pax headers).
    let cap = limits.max_unpacked_bytes.min(
        limits
            .ratio_floor
            .max(extractor.sink.archive_len.saturating_mul(limits.max_ratio)),
    );
    let count = std::rc::Rc::new(std::cell::Cell::new(0));
    let reader = CountingReader {
        inner: decoder(std::io::BufReader::new(file)).map_err(|err| archive_error(archive, err))?,
        count: count.clone(),
        cap,
    };
    let mut tar = tar::Archive::new(reader);
    let mut last_name = String::from("(first entry)");
    // The stream went over the cap: the error names the limit (the tar reader only saw an I/O error).
    let over = |extractor: &Extractor<'_>, name: &str| -> Error {
        extractor
            .check_total(name, count.get().max(cap.saturating_add(1)))
            .err()
            .unwrap_or_else(|| extractor.refuse(name, "unpacks to more than its limits allow"))
    };
    let entries = tar.entries().map_err(|err| archive_error(archive, err))?;
    for entry in entries {
        let mut entry = match entry {
            Ok(entry) => entry,
            Err(_) if count.get() > cap => {
                return Err(over(&extractor, &format!("after {last_name}")));
            }
            Err(err) => return Err(archive_error(archive, err)),
        };
        let name = String::from_utf8(entry.path_bytes().into_owned()).map_err(|_| {
            extractor.refuse(
                &String::from_utf8_lossy(&entry.path_bytes()),
                "has a name that is not UTF-8",
            )
        })?;
        last_name = format!("`{name}`");
        let kind = entry.header().entry_type();
        let link_target = |entry: &tar::Entry<'_, _>| -> Result<String> {
            let target = entry
                .link_name_bytes()
                .ok_or_else(|| extractor.refuse(&name, "is a link without a target"))?;
            String::from_utf8(target.into_owned())
                .map_err(|_| extractor.refuse(&name, "is a link whose target is not UTF-8"))
        };
        let kind = match kind {
            tar::EntryType::Directory => Kind::Dir,
            tar::EntryType::Regular | tar::EntryType::Continuous => Kind::File {
                executable: entry.header().mode().unwrap_or(0o644) & 0o111 != 0,
            },
            tar::EntryType::Symlink => Kind::Symlink {
                target: link_target(&entry)?,
            },
            tar::EntryType::Link => Kind::HardLink {
                target: link_target(&entry)?,
            },
            // Pax headers that apply to the whole archive carry nothing to write.
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader => continue,
            other => {
                return Err(extractor.refuse(
                    &name,
                    format!("has type {other:?}: only files, directories and links are allowed"),
                ));
            }
        };
        let result = match kind {
            Kind::Dir => extractor.add_dir(&name),
            Kind::File { executable } => extractor.add_file(&name, executable, &mut entry),
            Kind::Symlink { target } => extractor.add_symlink(&name, &target),
            Kind::HardLink { target } => extractor.add_hard_link(&name, &target),
        };
        if result.is_err() && count.get() > cap {
            return Err(over(&extractor, &name));
        }
        result?;
        extractor.check_total(&name, count.get())?;
    }
    Ok(extractor.finish()?.0)
}

/// Unpack an sdist by its file name (`.tar.gz`, `.tgz` or `.zip`) with the default limits.
pub fn unpack_sdist(archive: &Path, filename: &str, dest: &Path) -> Result<()> {
    unpack_sdist_with(archive, filename, dest, Limits::default())
}

/// Unpack an sdist by its file name with the given limits.
pub fn unpack_sdist_with(
    archive: &Path,
    filename: &str,
    dest: &Path,
    limits: Limits,
) -> Result<()> {
    let options = Options {
        limits,
        hash: false,
        layout: None,
        links_anywhere: false,
    };
    if filename.ends_with(".zip") {
        unpack_zip(archive, dest, options).map(|_| ())
    } else if filename.ends_with(".tar.gz") || filename.ends_with(".tgz") {
        unpack_tar_gz(archive, dest, options).map(|_| ())
    } else {
        Err(Error::Invalid(format!(
            "unsupported sdist format `{filename}` (expected .tar.gz or .zip)"
        )))
    }
}

#[cfg(test)]
mod tests;
