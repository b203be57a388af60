//! Zip extraction: the positional reader its threads share, the archive opened once, and the entry walk that
//! checks and claims every name before `Extractor::write_zip_files` writes the files' bytes.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use super::growing::Growing;
use super::{
    Extracted, Extractor, FileJob, Kind, MAX_LINK_TARGET, Manifest, Options, PARALLEL_FROM_BYTES,
    archive_error,
};
use crate::error::Result;

pub(super) const S_IFMT: u32 = 0o170000;
const S_IFREG: u32 = 0o100000;
const S_IFDIR: u32 = 0o040000;
pub(super) const S_IFLNK: u32 = 0o120000;

/// What a [`SharedFile`] reads: a complete file, or one still downloading.
#[derive(Clone)]
enum Source {
    File(Arc<std::fs::File>),
    Growing(Arc<Growing>),
}

impl Source {
    fn read_at(&self, out: &mut [u8], offset: u64) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        match self {
            Source::File(file) => file.read_at(out, offset),
            Source::Growing(growing) => growing.read_at(out, offset),
        }
    }
}

/// An archive file read by position (`pread`), so that clones read independently: every thread of a parallel
/// extraction has its own, sharing one descriptor and one parsed central directory. Buffered, and a seek keeps
/// the buffer (the central directory is parsed field by field, entries are opened by seeking).
pub(crate) struct SharedFile {
    file: Source,
    len: u64,
    pos: u64,
    buffer: Vec<u8>,
    /// The file offset of `buffer[0]` and how many bytes of it are valid.
    buffer_at: u64,
    buffered: usize,
}

impl SharedFile {
    pub(super) fn open(path: &Path) -> Result<SharedFile> {
        let file = fs_err::File::open(path)?.into_parts().0;
        let len = file.metadata()?.len();
        Ok(SharedFile::of(Source::File(Arc::new(file)), len))
    }

    fn of(file: Source, len: u64) -> SharedFile {
        SharedFile {
            file,
            len,
            pos: 0,
            buffer: vec![0u8; 64 << 10],
            buffer_at: 0,
            buffered: 0,
        }
    }
}

impl SharedFile {
    /// Reads `out.len()` bytes at `offset`, through the buffer.
    fn read_exact_at(&mut self, out: &mut [u8], offset: u64) -> std::io::Result<()> {
        use std::io::Seek;
        self.seek(std::io::SeekFrom::Start(offset))?;
        self.read_exact(out)
    }
}

/// The reason an archive's records cannot be read where they say they are.
fn unreadable(e: std::io::Error) -> String {
    format!("cannot be read where its records say: {e}")
}

impl Clone for SharedFile {
    fn clone(&self) -> Self {
        SharedFile {
            file: self.file.clone(),
            len: self.len,
            pos: self.pos,
            buffer: vec![0u8; self.buffer.len()],
            buffer_at: 0,
            buffered: 0,
        }
    }
}

impl Read for SharedFile {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let in_buffer = self.pos >= self.buffer_at
            && self.pos < self.buffer_at + self.buffered as u64
            && self.buffered > 0;
        if !in_buffer {
            if out.len() >= self.buffer.len() {
                let n = self.file.read_at(out, self.pos)?;
                self.pos += n as u64;
                return Ok(n);
            }
            self.buffered = self.file.read_at(&mut self.buffer, self.pos)?;
            self.buffer_at = self.pos;
            if self.buffered == 0 {
                return Ok(0);
            }
        }
        let start = (self.pos - self.buffer_at) as usize;
        let n = out.len().min(self.buffered - start);
        out[..n].copy_from_slice(&self.buffer[start..start + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl std::io::Seek for SharedFile {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        let invalid = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek out of range");
        self.pos = match to {
            std::io::SeekFrom::Start(n) => n,
            std::io::SeekFrom::End(d) => self.len.checked_add_signed(d).ok_or_else(invalid)?,
            std::io::SeekFrom::Current(d) => self.pos.checked_add_signed(d).ok_or_else(invalid)?,
        };
        Ok(self.pos)
    }
}

/// A zip archive whose central directory is read once (the wheel installer looks at its names first).
pub(crate) struct OpenZip<'p> {
    path: &'p Path,
    zip: zip::ZipArchive<SharedFile>,
    /// The archive's bytes, and its central directory as walked by [`raw_directory`].
    source: Source,
    raw: Vec<RawEntry>,
    /// The archive's length (the locked size of one still downloading).
    len: u64,
    /// Still downloading: each file is written as it is read, in the central directory's order, until the whole
    /// file is in; the rest is written as from a complete file.
    growing: Option<Arc<Growing>>,
}

impl<'p> OpenZip<'p> {
    pub(crate) fn open(path: &'p Path) -> Result<OpenZip<'p>> {
        let file = SharedFile::open(path)?;
        let (source, len, walker) = (file.file.clone(), file.len, file.clone());
        let zip = zip::ZipArchive::new(file).map_err(|err| archive_error(path, err))?;
        let raw = checked_directory(path, walker, &zip)?;
        Ok(OpenZip {
            path,
            zip,
            source,
            raw,
            len,
            growing: None,
        })
    }

    /// The archive that will be at `path` once `growing` has downloaded (its central directory comes from the tail
    /// read ahead; what is read is trusted only after [`Growing::wait_verified`]).
    pub(crate) fn open_growing(path: &'p Path, growing: Arc<Growing>) -> Result<OpenZip<'p>> {
        let len = growing.size();
        let source = Source::Growing(growing.clone());
        let zip = zip::ZipArchive::new(SharedFile::of(source.clone(), len))
            .map_err(|err| archive_error(path, err))?;
        let raw = checked_directory(path, SharedFile::of(source.clone(), len), &zip)?;
        // The central directory is parsed: entries' headers and data are read from the body as it arrives.
        growing.close_tail();
        Ok(OpenZip {
            path,
            zip,
            source,
            raw,
            len,
            growing: Some(growing),
        })
    }

    /// The entries' names as the archive spells them (not normalized, not checked).
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.zip.file_names()
    }
}

/// [`raw_directory`] of an archive the zip crate opened, its refusal an unsafe archive's error.
fn checked_directory(
    path: &Path,
    mut file: SharedFile,
    zip: &zip::ZipArchive<SharedFile>,
) -> Result<Vec<RawEntry>> {
    raw_directory(
        &mut file,
        zip.central_directory_start(),
        zip.offset(),
        zip.len(),
    )
    .map_err(|reason| crate::error::Error::UnsafeArchiveEntry {
        archive: path.to_path_buf(),
        entry: "(central directory)".to_owned(),
        reason,
    })
}

/// Unpack a zip archive into `dest` (see the [`crate::unpack`] module documentation for what is refused).
pub fn unpack_zip(archive: &Path, dest: &Path, options: Options<'_>) -> Result<Extracted> {
    Ok(unpack_open_zip(OpenZip::open(archive)?, dest, options, false)?.0)
}

/// [`unpack_zip`] of an archive already open. With `store_modes`, every entry gets the store's mode and mtime
/// as it is written and the manifest of the whole tree is returned (when hashing), so that the store neither
/// canonicalizes nor walks the tree again. A big archive's files are written by several threads.
pub(crate) fn unpack_open_zip(
    open: OpenZip<'_>,
    dest: &Path,
    options: Options<'_>,
    store_modes: bool,
) -> Result<(Extracted, Option<Manifest>)> {
    let OpenZip {
        path: archive,
        zip,
        source,
        raw,
        len: archive_len,
        growing,
    } = open;
    let mut zip = zip;
    let mut extractor = Extractor::new(archive, archive_len, dest, options, store_modes)?;
    extractor.sink.growing = growing.clone();
    let directory_start = zip.central_directory_start();
    let mut spans = Spans::default();
    if zip.len() as u64 > options.limits.max_entries {
        return Err(extractor.refuse(
            "(central directory)",
            format!(
                "lists {} entries, more than the {} an archive may have",
                zip.len(),
                options.limits.max_entries
            ),
        ));
    }
    // Every name, kind and place is checked and claimed first (links' targets are read); then the files' bytes
    // (of an archive still downloading: each file's as it comes, in the central directory's order, until the whole
    // file is in).
    let mut jobs = Vec::new();
    for (index, raw) in raw.iter().enumerate() {
        let (name, renamed, mode, is_dir, sizes, span) = {
            let entry = zip
                .by_index_raw(index)
                .map_err(|err| archive_error(archive, err))?;
            (
                entry.name().to_string(),
                // The crate takes a Unicode path extra field over the header's name; pip's `zipfile` does not.
                entry.name_raw() != raw.name,
                entry.unix_mode(),
                entry.is_dir(),
                (entry.compressed_size(), entry.size()),
                (
                    entry.header_start(),
                    entry.data_start().saturating_add(entry.compressed_size()),
                ),
            )
        };
        let size = sizes.1;
        if renamed {
            return Err(extractor.refuse(
                &name,
                format!(
                    "is named so by an extra field; its header names `{}`: readers disagree on the file's name",
                    String::from_utf8_lossy(&raw.name)
                ),
            ));
        }
        if let Err(reason) = spans
            .claim(span, directory_start)
            .and_then(|()| check_local_header(&source, span.0, raw, sizes))
        {
            return Err(extractor.refuse(&name, reason));
        }
        let kind = match mode.map(|mode| mode & S_IFMT) {
            _ if is_dir => Kind::Dir,
            Some(S_IFDIR) => Kind::Dir,
            Some(S_IFLNK) => {
                let mut entry = zip
                    .by_index(index)
                    .map_err(|err| archive_error(archive, err))?;
                let mut target = Vec::new();
                (&mut entry)
                    .take(MAX_LINK_TARGET + 1)
                    .read_to_end(&mut target)
                    .map_err(|err| extractor.io(&name, err))?;
                if target.len() as u64 > MAX_LINK_TARGET {
                    return Err(extractor.refuse(&name, "is a link with an overlong target"));
                }
                let target = String::from_utf8(target)
                    .map_err(|_| extractor.refuse(&name, "is a link whose target is not UTF-8"))?;
                Kind::Symlink { target }
            }
            None | Some(0) | Some(S_IFREG) => Kind::File {
                executable: mode.is_some_and(|mode| mode & 0o111 != 0),
            },
            Some(other) => {
                return Err(extractor.refuse(
                    &name,
                    format!("has file type {other:o} (a device, fifo or socket): only files, directories and links are allowed"),
                ));
            }
        };
        match kind {
            Kind::Dir => extractor.add_dir(&name)?,
            Kind::File { executable } => match extractor.plan_file(&name, executable)? {
                // An archive still downloading is written as its bytes arrive, entry by entry, as a tar is (its
                // local headers are read as they come): a later entry's conflict is found when it comes, and then
                // nothing is kept.
                Some(place) if growing.as_ref().is_some_and(|g| !g.complete()) => {
                    let reader = zip
                        .by_index(index)
                        .map_err(|err| archive_error(archive, err))?;
                    extractor.write_file(
                        &name,
                        place,
                        executable,
                        &mut Declared::new(reader, size),
                    )?;
                }
                Some((normalized, dest)) => jobs.push(FileJob {
                    index,
                    entry: name,
                    normalized,
                    dest,
                    executable,
                    size,
                }),
                None => {}
            },
            Kind::Symlink { target } => extractor.add_symlink(&name, &target)?,
            Kind::HardLink { target } => extractor.add_hard_link(&name, &target)?,
        }
    }
    if let Err(reason) = spans.contiguous(directory_start) {
        return Err(extractor.refuse("(central directory)", reason));
    }
    let declared: u64 = jobs.iter().map(|job| job.size).sum();
    let threads = if declared >= PARALLEL_FROM_BYTES {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
    } else {
        1
    };
    extractor.write_zip_files(&zip, jobs, threads)?;
    extractor.finish()
}

/// The archive bytes each entry spans (its local header and data), so that no two entries share a byte and none
/// lies in the central directory: every byte of the archive is unpacked at most once, and an unpacked size is
/// bounded by the archive's. Once all are claimed, they must cover every byte before the central directory
/// ([`Spans::contiguous`]).
#[derive(Default)]
struct Spans {
    /// Start -> end of the spans claimed so far (disjoint).
    claimed: std::collections::BTreeMap<u64, u64>,
}

impl Spans {
    fn claim(
        &mut self,
        (start, end): (u64, u64),
        directory_start: u64,
    ) -> std::result::Result<(), String> {
        if end > directory_start || start >= directory_start {
            return Err(format!(
                "has its data at bytes {start}..{end}, which reach into the central directory (from byte \
                 {directory_start})"
            ));
        }
        let before = self.claimed.range(..end.max(start + 1)).next_back();
        if let Some((&other_start, &other_end)) = before
            && other_end > start
        {
            return Err(format!(
                "has its data at bytes {start}..{end}, which overlap another entry's ({other_start}..{other_end})"
            ));
        }
        self.claimed.insert(start, end);
        Ok(())
    }

    /// Every byte before `directory_start` belongs to an entry (there are no data descriptors): bytes no entry
    /// claims are what a reader from the front (a streaming unzip) may take for other files. `Err` names the first
    /// stray bytes.
    fn contiguous(&self, directory_start: u64) -> std::result::Result<(), String> {
        let mut expected = 0;
        let spans = self
            .claimed
            .iter()
            .map(|(start, end)| (*start, *end))
            .chain([(directory_start, directory_start)]);
        for (start, end) in spans {
            if start != expected {
                return Err(format!(
                    "has {} bytes at {expected}..{start} that belong to no entry it lists: a reader from the front \
                     would take them for other files",
                    start.saturating_sub(expected)
                ));
            }
            expected = end;
        }
        Ok(())
    }
}

/// An entry's bytes held to the size its central directory declares: more, or an end before it, is an error (a
/// reader that trusts the declared size would see other bytes than this one).
pub(super) struct Declared<R> {
    inner: R,
    size: u64,
    left: u64,
}

impl<R: Read> Declared<R> {
    pub(super) fn new(inner: R, size: u64) -> Declared<R> {
        Declared {
            inner,
            size,
            left: size,
        }
    }
}

impl<R: Read> Read for Declared<R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let n = self.inner.read(out)?;
        let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
        if n == 0 && self.left > 0 {
            return Err(invalid(format!(
                "unpacks to {} bytes, but its central directory says {}",
                self.size - self.left,
                self.size
            )));
        }
        if n as u64 > self.left {
            return Err(invalid(format!(
                "unpacks to more than the {} bytes its central directory says",
                self.size
            )));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Signatures of the zip records read here.
const CENTRAL_HEADER: u32 = 0x0201_4b50;
const LOCAL_HEADER: u32 = 0x0403_4b50;
const END: u32 = 0x0605_4b50;
const END64: u32 = 0x0606_4b50;
const END64_LOCATOR: u32 = 0x0706_4b50;

/// One central directory header as the archive spells it.
pub(super) struct RawEntry {
    name: Vec<u8>,
    method: u16,
    /// The general purpose flags (a data descriptor, encryption, UTF-8 names).
    flags: u16,
}

/// The general purpose flag of a data descriptor after the entry's data (its sizes and CRC after it, not in its
/// local header).
const DATA_DESCRIPTOR: u16 = 0x8;

/// Reads `out.len()` bytes at `offset` (an archive shorter than that is an error).
fn read_exact_at(file: &Source, out: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < out.len() {
        match file.read_at(&mut out[done..], offset + done as u64)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => done += n,
        }
    }
    Ok(())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

/// The zip structure, walked record by record where the zip crate is lenient, so that another reader of the
/// archive (pip's `zipfile`, which finds the last end record and places the directory by its size; a streaming
/// unzip, which walks local headers from the front) finds the same entries: nothing prepended (`offset`, what the
/// zip crate found before the archive, is 0); the central directory from `start` lists `entries` headers, no name
/// twice (the crate keeps one entry per name), none with a data descriptor (a streaming reader finds such an entry's
/// end by the data itself; no wheel builder writes one); the end record (and a zip64 end record and locator, if
/// any) follows it, says where it starts, how long it is and how many headers it has exactly (a zip64 end record's
/// 32-bit twin saturated or equal), with no other end record in its comment nor a locator's signature where a
/// reader would look for one, and ends the file. Returns each header's name, method and flags, in the central
/// directory's order (the crate's, when no name repeats). The local headers are held to these, and the entries to
/// cover every byte before the central directory, as the entries are unpacked (`check_local_header`,
/// [`Spans::contiguous`]).
fn raw_directory(
    file: &mut SharedFile,
    start: u64,
    offset: u64,
    entries: usize,
) -> std::result::Result<Vec<RawEntry>, String> {
    let mut read_exact_at =
        |out: &mut [u8], at: u64| file.read_exact_at(out, at).map_err(unreadable);
    if offset != 0 {
        return Err(format!(
            "has {offset} bytes of other data before its first entry (prepended): a reader from the front would \
             see other files"
        ));
    }
    let mut raw = Vec::new();
    let mut names = std::collections::HashSet::new();
    let mut at = start;
    let mut fixed = [0u8; 46];
    loop {
        read_exact_at(&mut fixed[..4], at)?;
        // No more headers than the end record lists are read (the count is checked below).
        if u32_at(&fixed, 0) != CENTRAL_HEADER || raw.len() > entries {
            break;
        }
        read_exact_at(&mut fixed, at)?;
        let (name_len, extra_len, comment_len) = (
            u16_at(&fixed, 28) as usize,
            u16_at(&fixed, 30) as usize,
            u16_at(&fixed, 32) as usize,
        );
        let mut name = vec![0u8; name_len];
        read_exact_at(&mut name, at + 46)?;
        let flags = u16_at(&fixed, 8);
        if flags & DATA_DESCRIPTOR != 0 {
            return Err(format!(
                "has `{}` with a data descriptor (its sizes after its data): a streaming reader finds its end \
                 otherwise, and no wheel builder writes one",
                String::from_utf8_lossy(&name)
            ));
        }
        if !names.insert(name.clone()) {
            return Err(format!(
                "names `{}` twice in its central directory: readers disagree on which one is the file",
                String::from_utf8_lossy(&name)
            ));
        }
        raw.push(RawEntry {
            name,
            method: u16_at(&fixed, 10),
            flags,
        });
        at += 46 + (name_len + extra_len + comment_len) as u64;
    }
    if raw.len() != entries {
        return Err(format!(
            "has {} headers in its central directory, but its end record lists {entries}",
            raw.len()
        ));
    }
    let (count, size) = (raw.len() as u64, at - start);
    end_records(file, u32_at(&fixed, 0), at, (start, size, count))?;
    Ok(raw)
}

/// The end records after a central directory of `count` headers, `size` bytes from byte `start` (see
/// [`raw_directory`]), the first of them at `at`, its signature `signature`.
fn end_records(
    file: &mut SharedFile,
    mut signature: u32,
    mut at: u64,
    (start, size, count): (u64, u64, u64),
) -> std::result::Result<(), String> {
    let len = file.len;
    let mut read_exact_at =
        |out: &mut [u8], at: u64| file.read_exact_at(out, at).map_err(unreadable);
    let mut record = [0u8; 56];
    // A zip64 end record and its locator, then the end record; or the end record alone.
    let zip64 = signature == END64;
    if zip64 {
        read_exact_at(&mut record, at)?;
        let fields = (
            u64_at(&record, 4),
            u32_at(&record, 16),
            u32_at(&record, 20),
            u64_at(&record, 24),
            u64_at(&record, 32),
            u64_at(&record, 40),
            u64_at(&record, 48),
        );
        if fields != (44, 0, 0, count, count, size, start) {
            return Err(format!(
                "has a zip64 end record that does not describe its central directory ({count} headers, {size} bytes \
                 from byte {start})"
            ));
        }
        let mut locator = [0u8; 20];
        read_exact_at(&mut locator, at + 56)?;
        if (
            u32_at(&locator, 0),
            u32_at(&locator, 4),
            u64_at(&locator, 8),
        ) != (END64_LOCATOR, 0, at)
            || u32_at(&locator, 16) > 1
        {
            return Err("has a zip64 end record without its locator after it".to_owned());
        }
        at += 56 + 20;
        read_exact_at(&mut record[..4], at)?;
        signature = u32_at(&record, 0);
    } else if at >= 20 {
        // Where a reader looks for a zip64 locator (20 bytes before the end record): none may seem to be there.
        let mut before = [0u8; 4];
        read_exact_at(&mut before, at - 20)?;
        if u32_at(&before, 0) == END64_LOCATOR {
            return Err(
                "has what looks like a zip64 locator just before its end record, which lists no zip64 end record"
                    .to_owned(),
            );
        }
    }
    if signature != END {
        return Err(format!(
            "has other data after its central directory's {count} headers (at byte {at}), not its end record"
        ));
    }
    read_exact_at(&mut record[..22], at)?;
    let said = (
        u16_at(&record, 4),
        u16_at(&record, 6),
        u16_at(&record, 8),
        u16_at(&record, 10),
        u32_at(&record, 12),
        u32_at(&record, 16),
    );
    let fits16 = |v: u64| (v <= 0xFFFF).then_some(v as u16);
    let fits32 = |v: u64| (v <= 0xFFFF_FFFF).then_some(v as u32);
    // The 32-bit fields: exact, or (with a zip64 end record) saturated.
    let agrees16 = |got: u16, want: u64| fits16(want) == Some(got) || (zip64 && got == 0xFFFF);
    let agrees32 = |got: u32, want: u64| fits32(want) == Some(got) || (zip64 && got == 0xFFFF_FFFF);
    if !(said.0 == 0
        && said.1 == 0
        && agrees16(said.2, count)
        && agrees16(said.3, count)
        && agrees32(said.4, size)
        && agrees32(said.5, start))
    {
        return Err(format!(
            "has an end record that does not describe its central directory ({count} headers, {size} bytes from \
             byte {start})"
        ));
    }
    let comment_len = u16_at(&record, 20) as usize;
    let end = at + 22 + comment_len as u64;
    if end != len {
        return Err(format!(
            "ends at byte {len}, but its end record (with its comment) ends at byte {end}: other data follows it"
        ));
    }
    // `zipfile` takes the last end record's signature in the file: none may follow this one's first byte, in its
    // fields or its comment.
    let mut tail = vec![0u8; 21 + comment_len];
    read_exact_at(&mut tail, at + 1)?;
    if tail.windows(4).any(|w| w == END.to_le_bytes()) {
        return Err(
            "has another end record's signature in its end record or comment: readers disagree on which one ends it"
                .to_owned(),
        );
    }
    Ok(())
}

/// Checks that the local header at `header_start` says what the central directory says of the entry (`raw`, and
/// `sizes`, its compressed and unpacked sizes as the zip crate read them, zip64 included): its name, compression,
/// flags and sizes, as a reader that walks local headers sees them (`Err` says what differs).
fn check_local_header(
    file: &Source,
    header_start: u64,
    raw: &RawEntry,
    sizes: (u64, u64),
) -> std::result::Result<(), String> {
    let unreadable =
        |e: std::io::Error| format!("has no readable local header at byte {header_start}: {e}");
    // The header and its name in one read (a name the central directory spells).
    let mut header = vec![0u8; 30 + raw.name.len()];
    read_exact_at(file, &mut header, header_start).map_err(unreadable)?;
    let (fixed, name) = header.split_at(30);
    if u32_at(fixed, 0) != LOCAL_HEADER {
        return Err(format!("has no local header at byte {header_start}"));
    }
    let (name_len, extra_len) = (u16_at(fixed, 26) as usize, u16_at(fixed, 28) as usize);
    if name_len != name.len() || name != raw.name {
        let mut local = vec![0u8; name_len];
        read_exact_at(file, &mut local, header_start + 30).map_err(unreadable)?;
        return Err(format!(
            "is named `{}` in its local header: readers disagree on the file's name",
            String::from_utf8_lossy(&local)
        ));
    }
    let (method, flags) = (u16_at(fixed, 8), u16_at(fixed, 6));
    if method != raw.method {
        return Err(format!(
            "is compressed with method {method} by its local header, {} by its central directory",
            raw.method
        ));
    }
    if flags != raw.flags {
        return Err(format!(
            "has flags {flags:#06x} in its local header, {:#06x} in its central directory",
            raw.flags
        ));
    }
    let mut local = (u64::from(u32_at(fixed, 18)), u64::from(u32_at(fixed, 22)));
    if local.0 == 0xFFFF_FFFF || local.1 == 0xFFFF_FFFF {
        // Zip64: a local header carries both sizes in its extra field 1 (unpacked first).
        let mut extra = vec![0u8; extra_len];
        read_exact_at(file, &mut extra, header_start + 30 + name_len as u64).map_err(unreadable)?;
        let mut at = 0;
        while at + 4 <= extra.len() {
            let (id, size) = (u16_at(&extra, at), u16_at(&extra, at + 2) as usize);
            if id == 1 && size >= 16 && at + 4 + 16 <= extra.len() {
                local = (u64_at(&extra, at + 12), u64_at(&extra, at + 4));
                break;
            }
            at += 4 + size;
        }
    }
    if local != sizes {
        return Err(format!(
            "has sizes {}/{} (compressed/unpacked) in its local header, {}/{} in its central directory",
            local.0, local.1, sizes.0, sizes.1
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries may not share archive bytes or reach into the central directory.
    #[test]
    fn entry_spans_are_disjoint_and_before_the_central_directory() {
        let mut spans = Spans::default();
        spans.claim((100, 200), 1000).unwrap();
        spans.claim((0, 100), 1000).unwrap();
        spans.claim((200, 1000), 1000).unwrap();
        for (span, why) in [
            ((100, 200), "overlap"),
            ((150, 160), "overlap"),
            ((50, 150), "overlap"),
            ((199, 201), "overlap"),
            ((1000, 1040), "central directory"),
            ((990, 1010), "central directory"),
        ] {
            let mut fresh = Spans::default();
            fresh.claim((100, 200), 1000).unwrap();
            fresh.claim((980, 990), 1000).unwrap();
            let err = fresh.claim(span, 1000).unwrap_err();
            assert!(err.contains(why), "{span:?}: {err}");
        }
    }

    /// Each clone has its own position and buffer over one descriptor; a seek keeps the buffer, reads across its
    /// end and bigger than it are whole.
    #[test]
    fn shared_file_clones_read_and_seek_independently() {
        use std::io::{Seek, SeekFrom};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        fs_err::write(&path, &data).unwrap();
        let mut a = SharedFile::open(&path).unwrap();
        let mut b = a.clone();
        let read = |file: &mut SharedFile, n: usize| {
            let mut out = vec![0u8; n];
            file.read_exact(&mut out).unwrap();
            out
        };
        a.seek(SeekFrom::Start(100_000)).unwrap();
        assert_eq!(read(&mut a, 10), data[100_000..100_010]);
        assert_eq!(b.seek(SeekFrom::End(-5)).unwrap(), 299_995);
        let mut tail = Vec::new();
        b.read_to_end(&mut tail).unwrap();
        assert_eq!(tail, data[299_995..]);
        a.seek(SeekFrom::Current(-10)).unwrap();
        assert_eq!(read(&mut a, 70_000), data[100_000..170_000]);
        assert_eq!(read(&mut a, 100_000), data[170_000..270_000]);
        let mut c = a.clone();
        assert_eq!(read(&mut c, 30_000), data[270_000..]);
        assert!(c.seek(SeekFrom::Current(-400_000)).is_err());
    }
}
