//! A wheel read while it downloads (#22 §4: the largest wheel's unpacking hidden behind its own download).
//!
//! The fetcher writes the archive into its `.part` file and publishes how far the written (flushed) bytes reach; the
//! end of the file (the zip's central directory) was fetched ahead by a range request. While the archive is opened
//! (its central directory parsed) a read at or past `tail_start` is served from the fetched tail; once it is open
//! ([`Growing::close_tail`]) every read, entry data in the tail's range included, waits for the written front: the
//! unchecked range answer only says where the entries are, never what they hold. Before the verdict the bytes an
//! extraction may write are bounded by what the body delivered ([`Growing::admit`]), so a host cannot make a small
//! unverified answer fill the disk. Nothing read here is trusted until [`Growing::wait_verified`] has returned: the
//! whole file then matched its locked sha256 and size, and the tail that was read equals the verified file's end.
//! The reader unpacks into a store temp dir and commits only after that; on any other outcome the temp dir is
//! removed.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

use crate::error::{Error, Result};

/// Bytes an extraction may write before the download is verified, besides [`PRE_VERIFY_RATIO`] per body byte
/// received.
pub(crate) const PRE_VERIFY_BUDGET: u64 = 16 << 20;
/// Bytes written per body byte received, before the download is verified (the extraction's ratio limit).
pub(crate) const PRE_VERIFY_RATIO: u64 = super::MAX_RATIO;
/// The most bytes one wheel's extraction writes before its download is verified, however much arrived: past it the
/// extraction waits for the verdict (an honest wheel then goes on; tensorflow-cpu's 232 MB fit below it).
pub(crate) const PRE_VERIFY_MAX: u64 = 512 << 20;

/// What an extraction may have written before the verdict once `received` body bytes are in the file.
pub(crate) fn pre_verify_allowance(received: u64) -> u64 {
    received
        .saturating_mul(PRE_VERIFY_RATIO)
        .saturating_add(PRE_VERIFY_BUDGET)
        .min(PRE_VERIFY_MAX)
}

/// How a download being read ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Pending,
    /// Complete, and its sha256 and size matched the lock.
    Verified,
    /// Failed (network, deadline, size, hash), stopped, or abandoned: what was read means nothing.
    Failed,
}

#[derive(Debug)]
struct Front {
    written: u64,
    verdict: Verdict,
}

/// A download's file as it grows, for readers on other threads.
#[derive(Debug)]
pub(crate) struct Growing {
    /// A read-only handle on the `.part` file (it stays valid when the file is renamed into the cache).
    file: std::fs::File,
    /// The locked size: the file's length once complete.
    len: u64,
    tail_start: u64,
    tail: Vec<u8>,
    /// Reads at or past `tail_start` come from `tail` (only while the central directory is read).
    tail_open: AtomicBool,
    /// The verified file's end differs from `tail`: what was unpacked is discarded, the verified file is not.
    tail_differs: AtomicBool,
    filename: String,
    url: String,
    front: Mutex<Front>,
    changed: Condvar,
}

impl Growing {
    /// A view of the `len`-byte download of `filename` being written into `file`, whose bytes from `tail_start` on
    /// are `tail` (as a range request answered them: checked against the whole file by [`Growing::wait_verified`]).
    pub(crate) fn new(
        file: std::fs::File,
        len: u64,
        tail_start: u64,
        tail: Vec<u8>,
        filename: &str,
        url: &str,
    ) -> Growing {
        Growing {
            file,
            len,
            tail_start,
            tail,
            tail_open: AtomicBool::new(true),
            tail_differs: AtomicBool::new(false),
            filename: filename.to_string(),
            url: url.to_string(),
            front: Mutex::new(Front {
                written: 0,
                verdict: Verdict::Pending,
            }),
            changed: Condvar::new(),
        }
    }

    /// The central directory is read: from now on every read waits for the body's bytes (the tail read ahead is
    /// never a source of entry data).
    pub(crate) fn close_tail(&self) {
        self.tail_open.store(false, Ordering::Release);
    }

    /// The extraction: wait until `written` unpacked bytes are within what may be written before the verdict
    /// ([`pre_verify_allowance`] of the body bytes received), or the download is verified; an error once it failed.
    pub(crate) fn admit(&self, written: u64) -> std::io::Result<()> {
        let mut front = self.front();
        loop {
            match front.verdict {
                Verdict::Failed => return Err(self.download_failed()),
                Verdict::Verified => return Ok(()),
                Verdict::Pending if written <= pre_verify_allowance(front.written) => return Ok(()),
                Verdict::Pending => {
                    front = self.changed.wait(front).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }

    /// The archive's length once complete (the locked size).
    pub(crate) fn size(&self) -> u64 {
        self.len
    }

    fn front(&self) -> std::sync::MutexGuard<'_, Front> {
        self.front.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The fetcher: the first `written` bytes are in the file (flushed).
    pub(crate) fn advance(&self, written: u64) {
        let mut front = self.front();
        front.written = front.written.max(written.min(self.len));
        self.changed.notify_all();
    }

    /// The fetcher: the download ended, `verified` when the whole file matched its locked sha256 and size.
    pub(crate) fn finish(&self, verified: bool) {
        let mut front = self.front();
        if front.verdict == Verdict::Pending {
            front.verdict = if verified {
                front.written = self.len;
                Verdict::Verified
            } else {
                Verdict::Failed
            };
        }
        self.changed.notify_all();
    }

    /// Whether the download ended without a verified file.
    pub(crate) fn failed(&self) -> bool {
        self.front().verdict == Verdict::Failed
    }

    /// Whether every byte is in the file (not verified yet).
    pub(crate) fn complete(&self) -> bool {
        self.front().written >= self.len
    }

    /// Whether the download was verified but the end read ahead differed from it (the streamed install failed for
    /// that: the verified file itself may still be installed).
    pub(crate) fn tail_differed(&self) -> bool {
        self.verified() && self.tail_differs.load(Ordering::Acquire)
    }

    /// Whether the download ended with a verified file.
    pub(crate) fn verified(&self) -> bool {
        self.front().verdict == Verdict::Verified
    }

    fn download_failed(&self) -> std::io::Error {
        std::io::Error::other(format!(
            "the download of `{}` failed or was stopped while it was being unpacked",
            self.filename
        ))
    }

    /// `pread` on the archive as it will be: waits until the bytes are written (or, while the central directory is
    /// read, come from the tail); an error once the download failed.
    pub(crate) fn read_at(&self, out: &mut [u8], offset: u64) -> std::io::Result<usize> {
        if offset >= self.len || out.is_empty() {
            return Ok(0);
        }
        let tail_open = self.tail_open.load(Ordering::Acquire);
        if tail_open && offset >= self.tail_start {
            let start = (offset - self.tail_start) as usize;
            let n = out.len().min(self.tail.len() - start);
            out[..n].copy_from_slice(&self.tail[start..start + n]);
            return Ok(n);
        }
        let stop = if tail_open { self.tail_start } else { self.len };
        let end = offset.saturating_add(out.len() as u64).min(stop);
        let mut front = self.front();
        loop {
            match front.verdict {
                Verdict::Failed => return Err(self.download_failed()),
                Verdict::Verified => break,
                Verdict::Pending if front.written >= end => break,
                Verdict::Pending => {
                    front = self.changed.wait(front).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
        drop(front);
        let n = (end - offset) as usize;
        self.file.read_at(&mut out[..n], offset)
    }

    /// Wait for the download's end. `Ok` only when the whole file matched its locked sha256 and size and the tail
    /// read ahead equals the verified file's end; otherwise nothing unpacked from this view may be kept.
    pub(crate) fn wait_verified(&self) -> Result<()> {
        let mut front = self.front();
        while front.verdict == Verdict::Pending {
            front = self.changed.wait(front).unwrap_or_else(|e| e.into_inner());
        }
        if front.verdict == Verdict::Failed {
            return Err(self.download_failed().into());
        }
        drop(front);
        let mut end = vec![0u8; self.tail.len()];
        self.file.read_exact_at(&mut end, self.tail_start)?;
        if end != self.tail {
            self.tail_differs.store(true, Ordering::Release);
            return Err(Error::Download {
                url: self.url.clone(),
                message: format!(
                    "the server answered a range request for the last {} bytes of {} with bytes that differ from \
                     the end of the whole file (which matched the lock's sha256): it serves inconsistent \
                     answers; nothing unpacked from it was kept",
                    self.tail.len(),
                    self.filename
                ),
            });
        }
        Ok(())
    }
}

/// The fetcher's side of a [`Growing`]: when dropped without [`Publisher::verified`] (an error, a retry, a panic)
/// the readers are told the download failed, so none waits forever.
#[derive(Debug)]
pub(crate) struct Publisher {
    view: std::sync::Arc<Growing>,
    published: u64,
}

impl Publisher {
    pub(crate) fn new(view: std::sync::Arc<Growing>) -> Publisher {
        Publisher { view, published: 0 }
    }

    /// The bytes published so far.
    pub(crate) fn published(&self) -> u64 {
        self.published
    }

    /// The first `written` bytes are flushed into the file.
    pub(crate) fn advance(&mut self, written: u64) {
        self.published = written;
        self.view.advance(written);
    }

    /// The whole file matched the lock: readers may keep what they unpacked.
    pub(crate) fn verified(self) {
        self.view.finish(true);
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.view.finish(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Arc;

    fn view(data: &[u8], tail_from: usize) -> (tempfile::TempDir, std::fs::File, Arc<Growing>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.whl.part");
        let writer = std::fs::File::create(&path).unwrap();
        let reader = std::fs::File::open(&path).unwrap();
        let view = Arc::new(Growing::new(
            reader,
            data.len() as u64,
            tail_from as u64,
            data[tail_from..].to_vec(),
            "w.whl",
            "http://127.0.0.1/w.whl",
        ));
        (dir, writer, view)
    }

    /// A reader below the front waits for the bytes; the tail is served at once; a verified file with the same end
    /// passes, a different end does not.
    #[test]
    fn reads_wait_for_the_front_and_the_tail_is_checked() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let (_dir, mut writer, view) = view(&data, 90_000);
        let mut end = [0u8; 10];
        assert_eq!(view.read_at(&mut end, 99_990).unwrap(), 10);
        assert_eq!(end, data[99_990..]);
        let reader = {
            let view = view.clone();
            std::thread::spawn(move || {
                let mut out = vec![0u8; 50_000];
                let n = view.read_at(&mut out, 1000).unwrap();
                out.truncate(n);
                out
            })
        };
        let mut publisher = Publisher::new(view.clone());
        writer.write_all(&data[..30_000]).unwrap();
        publisher.advance(30_000);
        writer.write_all(&data[30_000..]).unwrap();
        publisher.advance(data.len() as u64);
        assert_eq!(reader.join().unwrap(), data[1000..51_000]);
        publisher.verified();
        view.wait_verified().unwrap();

        // The same, but the file's end is not what the range request said.
        let (_dir, mut writer, view) = view_with_other_tail(&data);
        writer.write_all(&data).unwrap();
        let mut publisher = Publisher::new(view.clone());
        publisher.advance(data.len() as u64);
        publisher.verified();
        let err = view.wait_verified().unwrap_err().to_string();
        assert!(
            err.contains("differ from the end of the whole file"),
            "{err}"
        );
    }

    fn view_with_other_tail(data: &[u8]) -> (tempfile::TempDir, std::fs::File, Arc<Growing>) {
        let (dir, writer, view) = view(data, 90_000);
        let mut tail = data[90_000..].to_vec();
        tail[5] ^= 1;
        let path = dir.path().join("w.whl.part");
        let view = Arc::new(Growing::new(
            std::fs::File::open(path).unwrap(),
            view.len,
            90_000,
            tail,
            "w.whl",
            "http://127.0.0.1/w.whl",
        ));
        (dir, writer, view)
    }

    /// Once the central directory is read the tail is no source of data: a read in its range waits for the body
    /// (here the download fails first, so the read fails instead of answering from the unchecked tail).
    #[test]
    fn a_closed_tail_serves_nothing_before_the_body_brings_it() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let (_dir, mut writer, first) = view(&data, 90_000);
        let mut out = [0u8; 10];
        assert_eq!(first.read_at(&mut out, 95_000).unwrap(), 10);
        first.close_tail();
        let mut publisher = Publisher::new(first.clone());
        writer.write_all(&data).unwrap();
        publisher.advance(data.len() as u64);
        let mut out = [0u8; 10];
        assert_eq!(first.read_at(&mut out, 95_000).unwrap(), 10);
        assert_eq!(out, data[95_000..95_010]);

        let (_dir, _writer, view) = view(&data, 90_000);
        view.close_tail();
        let reader = {
            let view = view.clone();
            std::thread::spawn(move || view.read_at(&mut [0u8; 10], 95_000))
        };
        drop(Publisher::new(view.clone()));
        let err = reader.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("failed or was stopped"), "{err}");
    }

    /// Before the verdict the extraction may write [`PRE_VERIFY_BUDGET`] plus [`PRE_VERIFY_RATIO`] bytes per body
    /// byte received, never more than [`PRE_VERIFY_MAX`]; past that it waits for more body or the verdict.
    #[test]
    fn writes_before_the_verdict_are_bounded_by_the_body_received() {
        assert_eq!(pre_verify_allowance(0), PRE_VERIFY_BUDGET);
        assert_eq!(
            pre_verify_allowance(1 << 20),
            PRE_VERIFY_BUDGET + PRE_VERIFY_RATIO * (1 << 20)
        );
        assert_eq!(pre_verify_allowance(u64::MAX), PRE_VERIFY_MAX);
        let data = vec![7u8; 10_000];
        let (_dir, _writer, first) = view(&data, 9_000);
        first.admit(PRE_VERIFY_BUDGET).unwrap();
        let waiting = |written: u64| {
            let view = first.clone();
            std::thread::spawn(move || view.admit(written))
        };
        let (more_body, verdict) = (
            waiting(PRE_VERIFY_BUDGET + 100),
            waiting(PRE_VERIFY_MAX + 1),
        );
        let mut publisher = Publisher::new(first.clone());
        publisher.advance(1);
        more_body.join().unwrap().unwrap();
        assert!(!verdict.is_finished());
        publisher.verified();
        verdict.join().unwrap().unwrap();

        let (_dir, _writer, view) = view(&data, 9_000);
        let waiting = {
            let view = view.clone();
            std::thread::spawn(move || view.admit(PRE_VERIFY_BUDGET + 1))
        };
        drop(Publisher::new(view.clone()));
        assert!(waiting.join().unwrap().is_err());
    }

    /// A publisher dropped before the end (an error, a retry) fails every waiting reader instead of leaving it
    /// waiting forever.
    #[test]
    fn an_abandoned_download_fails_its_readers() {
        let data = vec![7u8; 10_000];
        let (_dir, _writer, view) = view(&data, 9_000);
        let reader = {
            let view = view.clone();
            std::thread::spawn(move || view.read_at(&mut [0u8; 100], 0))
        };
        let publisher = Publisher::new(view.clone());
        drop(publisher);
        let err = reader.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("failed or was stopped"), "{err}");
        assert!(view.failed());
        assert!(view.wait_verified().is_err());
    }
}
