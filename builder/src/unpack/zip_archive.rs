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
    /// The archive's length (the locked size of one still downloading).
    len: u64,
    /// Still downloading: each file is written as it is read, in the central directory's order, until the whole
    /// file is in; the rest is written as from a complete file.
    growing: Option<Arc<Growing>>,
}

impl<'p> OpenZip<'p> {
    pub(crate) fn open(path: &'p Path) -> Result<OpenZip<'p>> {
        let file = SharedFile::open(path)?;
        let len = file.len;
        let zip = zip::ZipArchive::new(file).map_err(|err| archive_error(path, err))?;
        Ok(OpenZip {
            path,
            zip,
            len,
            growing: None,
        })
    }

    /// The archive that will be at `path` once `growing` has downloaded (its central directory comes from the tail
    /// read ahead; what is read is trusted only after [`Growing::wait_verified`]).
    pub(crate) fn open_growing(path: &'p Path, growing: Arc<Growing>) -> Result<OpenZip<'p>> {
        let len = growing.size();
        let zip = zip::ZipArchive::new(SharedFile::of(Source::Growing(growing.clone()), len))
            .map_err(|err| archive_error(path, err))?;
        // The central directory is parsed: entries' headers and data are read from the body as it arrives.
        growing.close_tail();
        Ok(OpenZip {
            path,
            zip,
            len,
            growing: Some(growing),
        })
    }

    /// The entries' names as the archive spells them (not normalized, not checked).
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.zip.file_names()
    }
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
    for index in 0..zip.len() {
        let (name, mode, is_dir, size, span) = {
            let entry = zip
                .by_index_raw(index)
                .map_err(|err| archive_error(archive, err))?;
            (
                entry.name().to_string(),
                entry.unix_mode(),
                entry.is_dir(),
                entry.size(),
                (
                    entry.header_start(),
                    entry.data_start().saturating_add(entry.compressed_size()),
                ),
            )
        };
        if let Err(reason) = spans.claim(span, directory_start) {
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
                    let mut reader = zip
                        .by_index(index)
                        .map_err(|err| archive_error(archive, err))?;
                    extractor.write_file(&name, place, executable, &mut reader)?;
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
/// bounded by the archive's.
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
