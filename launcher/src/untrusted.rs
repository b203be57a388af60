//! Files that someone else wrote where hvd reads them (a rank's checkpoint report, the note a pod's init container
//! left, a batch job's output as it grows) and the directories they are in: their place, kind, size and owner are
//! hostile input.

use std::io::Read as _;
use std::path::Path;

/// What [`read_small`] found.
#[derive(Debug)]
pub enum Small {
    /// The first bytes, at most the `max` asked for, and the length when it is a regular file.
    Read {
        bytes: Vec<u8>,
        file_len: Option<u64>,
    },
    /// Not a regular file (a FIFO, a directory, a device), and only files were asked for: nothing was read.
    NotAFile,
}

/// Reads at most `max` bytes of `path`. It is opened without following a link (a link fails with `ELOOP`),
/// waiting for a FIFO's writer (`O_NONBLOCK`) or making a terminal this process's controlling one (`O_NOCTTY`), and
/// the open descriptor's own metadata says what it is, so what was checked is what is read. Only the last component
/// of `path` is kept from being a link: links among the directories above it are followed. `only_files`: anything but a regular file is [`Small::NotAFile`] (and a failed `fstat`
/// an error); otherwise it is read whatever it is (an empty FIFO without a writer reads as empty).
pub fn read_small(path: &Path, max: u64, only_files: bool) -> std::io::Result<Small> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let metadata = file.metadata();
    let file_len = match metadata {
        Ok(m) if m.is_file() => Some(m.len()),
        Ok(_) if only_files => return Ok(Small::NotAFile),
        Err(err) if only_files => return Err(err),
        _ => None,
    };
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes)?;
    Ok(Small::Read { bytes, file_len })
}

/// Opens `path` to read as it grows (a job's output file on a shared file system): without following a link
/// (`ELOOP`), without waiting for a FIFO's writer or taking a terminal (`O_NONBLOCK | O_NOCTTY`); anything but a
/// regular file is an `InvalidData` error naming what it is, checked on the open descriptor.
pub fn open_growing(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not a regular file ({kind:?})"),
        ));
    }
    Ok(file)
}

/// Whether an [`open_growing`] error says the path is not a regular file of its own, for good: a link (`ELOOP`), a
/// socket or a device without its driver (`ENXIO`), or anything else but a regular file (`InvalidData`). Any other
/// error (`EMFILE`, `ENFILE`, `EACCES`, `ESTALE`, `EIO`, ...) may pass (a descriptor shortage, a network file
/// system's hiccup): the caller tries again later.
pub fn not_a_file_for_good(err: &std::io::Error) -> bool {
    err.kind() == std::io::ErrorKind::InvalidData
        || matches!(err.raw_os_error(), Some(libc::ELOOP | libc::ENXIO))
}

/// Refuses a directory hvd keeps what others must not plant in (`what` says what it holds; `not_yours` what to do
/// when it is another user's) unless it is this user's and not writable by group or others (the same rule as the
/// collective's file rendezvous directory).
pub fn check_private_dir(dir: &Path, what: &str, not_yours: &str) -> Result<(), String> {
    use hvd_collective::rendezvous::{NotPrivate, PrivateDir};
    let says = PrivateDir {
        name: "",
        plant: what,
        not_yours,
        or_else: "",
    };
    hvd_collective::rendezvous::check_private_dir(dir, says).map_err(|e| match e {
        NotPrivate::Unreadable(e) => format!("cannot read `{}`: {e}", dir.display()),
        NotPrivate::Refused(message) => message,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link is refused (`ELOOP`) without reading its target; a FIFO with no writer neither blocks the open nor
    /// the read; a directory is not a file; a long file is cut at `max` and its length told.
    #[test]
    fn links_fifos_directories_and_long_files() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, "0123456789").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for only_files in [true, false] {
            let err = read_small(&link, 64, only_files).unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::ELOOP), "{err}");
        }
        match read_small(&target, 4, true).unwrap() {
            Small::Read { bytes, file_len } => {
                assert_eq!((bytes.as_slice(), file_len), (&b"0123"[..], Some(10)));
            }
            other => panic!("{other:?}"),
        }
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        assert!(matches!(read_small(&fifo, 4, true), Ok(Small::NotAFile)));
        match read_small(&fifo, 4, false).unwrap() {
            Small::Read { bytes, file_len } => assert!(bytes.is_empty() && file_len.is_none()),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            read_small(dir.path(), 4, true),
            Ok(Small::NotAFile)
        ));
        let missing = read_small(&dir.path().join("missing"), 4, true).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    }

    /// A link or anything but a regular file is refused for good; an error that may pass (out of descriptors, a
    /// network file system's stale handle or I/O error, a denied open) is not.
    #[test]
    fn only_a_link_or_not_a_file_is_refused_for_good() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, "x").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        for refused in [&link, &fifo, &dir.path().to_path_buf()] {
            let err = open_growing(refused).unwrap_err();
            assert!(not_a_file_for_good(&err), "{}: {err}", refused.display());
        }
        // An open that fails for another reason (here `ENOTDIR`: a file where a directory is expected).
        let err = open_growing(&target.join("x")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOTDIR), "{err}");
        assert!(!not_a_file_for_good(&err));
        for errno in [
            libc::EMFILE,
            libc::ENFILE,
            libc::EACCES,
            libc::ESTALE,
            libc::EIO,
            libc::EAGAIN,
        ] {
            let err = std::io::Error::from_raw_os_error(errno);
            assert!(!not_a_file_for_good(&err), "{err}");
        }
        assert!(open_growing(&target).is_ok());
    }
}
