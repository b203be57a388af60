//! A batch job's output file, read as it grows (`hvd run` following a job on the slurm engine).

use std::io::Read as _;
use std::path::PathBuf;

use crate::report::{LineSplitter, Stream};

/// One output file of a job, read as it grows.
pub(super) struct Tail {
    path: PathBuf,
    file: Option<fs_err::File>,
    splitter: LineSplitter,
    stream: Stream,
    /// The path was not a regular file (a link, a FIFO): it is not opened.
    refused: bool,
    /// An open failed for a reason that may pass (and was said): it is tried again at each poll.
    retrying: bool,
}

impl Tail {
    pub(super) fn path(&self) -> &std::path::Path {
        &self.path
    }

    pub(super) fn new(path: PathBuf, stream: Stream) -> Self {
        Tail {
            path,
            file: None,
            splitter: LineSplitter::default(),
            stream,
            refused: false,
            retrying: false,
        }
    }

    /// Emits every complete line written since the last call (`last`: the file is complete, emit the rest too),
    /// and whether it continues a line cut at the length limit before it ([`LineSplitter::push_pieces`]).
    /// The file is opened as [`crate::untrusted::open_growing`] does. A link, a FIFO or anything but a regular file
    /// is refused for good ([`crate::untrusted::not_a_file_for_good`]); any other failed open (out of descriptors, a
    /// network file system's hiccup) is tried again at the next call. Either is returned once, as a note.
    pub(super) fn read(
        &mut self,
        last: bool,
        emit: &mut impl FnMut(Stream, &[u8], bool),
    ) -> Option<String> {
        let mut note = None;
        if self.file.is_none() && !self.refused {
            match crate::untrusted::open_growing(&self.path) {
                Ok(file) => self.file = Some(fs_err::File::from_parts(file, &self.path)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) if crate::untrusted::not_a_file_for_good(&e) => {
                    self.refused = true;
                    note = Some(format!(
                        "not following `{}` ({e}): the job's output file is not a regular file of its own; \
                         its lines are not shown",
                        self.path.display()
                    ));
                }
                Err(e) => {
                    if !self.retrying {
                        note = Some(format!(
                            "cannot open the job's output file `{}` ({e}); trying again at each poll",
                            self.path.display()
                        ));
                    }
                    self.retrying = true;
                }
            }
        }
        let stream = self.stream;
        let mut lines = |line: &[u8], continued: bool| emit(stream, line, continued);
        if let Some(file) = &mut self.file {
            // Shorter than what was read: the file started over (Slurm requeued the job, after a node failure, and
            // truncated its output for the new run). Its lines are read from the start again.
            let read_up_to = std::io::Seek::stream_position(file).unwrap_or(0);
            if file.metadata().is_ok_and(|m| m.len() < read_up_to) {
                let _ = std::io::Seek::rewind(file);
                self.splitter.finish_pieces(&mut lines);
                note = Some(format!(
                    "the job's output file `{}` started over (the job was requeued?): following it from its start",
                    self.path.display()
                ));
            }
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match file.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => self.splitter.push_pieces(&buf[..n], &mut lines),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        if last {
            self.splitter.finish_pieces(&mut lines);
        }
        note
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// A job requeued after a node failure runs again and Slurm truncates its output file: the lines of the new run
    /// are read from its start, said once, not from where the first run's ended (which showed nothing, or the middle
    /// of a line, until the file outgrew the old length).
    #[test]
    fn an_output_file_that_starts_over_is_read_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.out");
        std::fs::write(&path, "first run line one\nfirst run line two\n").unwrap();
        let mut tail = Tail::new(path.clone(), Stream::Stdout);
        let mut lines: Vec<Vec<u8>> = Vec::new();
        assert_eq!(
            tail.read(false, &mut |_, l, _| lines.push(l.to_vec())),
            None
        );
        assert_eq!(lines.len(), 2);
        std::fs::write(&path, "again\n").unwrap();
        lines.clear();
        let note = tail.read(false, &mut |_, l, _| lines.push(l.to_vec()));
        assert!(note.is_some_and(|n| n.contains("started over")));
        assert_eq!(lines, [b"again".to_vec()]);
        lines.clear();
        assert_eq!(tail.read(true, &mut |_, l, _| lines.push(l.to_vec())), None);
        assert!(lines.is_empty(), "{lines:?}");
    }

    /// Someone who can write where the jobs' output goes plants a FIFO or a link as a job's output file: following
    /// it neither blocks (a FIFO's open waits for a writer) nor reads the link's target; each is said once.
    #[test]
    fn a_planted_fifo_or_link_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("secret");
        std::fs::write(&target, "secret line\n").unwrap();
        let link = dir.path().join("t-a-1.out");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let fifo = dir.path().join("t-a-1.err");
        let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        for path in [link, fifo] {
            let mut tail = Tail::new(path.clone(), Stream::Stdout);
            let mut lines = Vec::new();
            let refused = tail.read(false, &mut |_, line, _| lines.push(line.to_vec()));
            let refused = refused.expect("the planted file is refused");
            assert!(refused.contains(&path.display().to_string()), "{refused}");
            assert_eq!(
                tail.read(true, &mut |_, line, _| lines.push(line.to_vec())),
                None
            );
            assert!(lines.is_empty(), "{lines:?}");
        }
        // A regular file is followed as it grows.
        let out = dir.path().join("t-a-2.out");
        std::fs::write(&out, "one\ntw").unwrap();
        let mut tail = Tail::new(out.clone(), Stream::Stdout);
        let mut lines = Vec::new();
        assert_eq!(
            tail.read(false, &mut |_, l, _| lines.push(l.to_vec())),
            None
        );
        std::fs::write(&out, "one\ntwo\n").unwrap();
        assert_eq!(tail.read(true, &mut |_, l, _| lines.push(l.to_vec())), None);
        assert_eq!(lines, vec![b"one".to_vec(), b"two".to_vec()]);
    }

    /// An open that fails for a reason that may pass (here `ENOTDIR`, standing in for running out of descriptors or
    /// a network file system's stale handle) is said once, with its error, and tried again: once the path opens, the
    /// job's lines are shown.
    #[test]
    fn an_output_file_that_fails_to_open_is_tried_again() {
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("d");
        std::fs::write(&parent, "").unwrap();
        let path = parent.join("t-a-1.out");
        let mut tail = Tail::new(path.clone(), Stream::Stdout);
        let mut lines = Vec::new();
        let note = tail.read(false, &mut |_, l, _| lines.push(l.to_vec()));
        let note = note.expect("the failed open is said");
        assert!(
            note.contains(&path.display().to_string())
                && note.contains(&std::io::Error::from_raw_os_error(libc::ENOTDIR).to_string()),
            "{note}"
        );
        assert_eq!(
            tail.read(false, &mut |_, l, _| lines.push(l.to_vec())),
            None
        );
        std::fs::remove_file(&parent).unwrap();
        std::fs::create_dir(&parent).unwrap();
        std::fs::write(&path, "line\n").unwrap();
        assert_eq!(tail.read(true, &mut |_, l, _| lines.push(l.to_vec())), None);
        assert_eq!(lines, vec![b"line".to_vec()]);
    }
}
