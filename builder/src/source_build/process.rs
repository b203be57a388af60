//! One build backend process run to its end or its deadline, its output written to a log of bounded size.
//!
//! A build backend is code from the sdist: it may print without end or never exit (a `setup.py` waiting on a
//! prompt, a compiler loop). So its stdout and stderr go through a pipe that hvd drains into `build.log`, keeping
//! at most [`LOG_MAX_BYTES`] there (the head, then a line saying how much was left out, then the last
//! [`KEPT_TAIL_BYTES`] — the driver's `HVD_*=` lines come last), and the process gets a deadline after which its
//! whole process group is killed.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The most bytes of build output `build.log` keeps (head and tail together, roughly).
pub(crate) const LOG_MAX_BYTES: u64 = 64 << 20;
/// How much of the end of an over-long output is kept after the cut.
const KEPT_TAIL_BYTES: usize = 256 << 10;
/// How long the log is drained after the process ended (a process the build left behind may still hold the
/// pipe; where no sandbox could be made nothing else ends it).
const DRAIN_GRACE: Duration = Duration::from_secs(5);
/// How often the deadline is checked while the process runs.
const POLL: Duration = Duration::from_millis(50);

/// How a backend process ended.
#[derive(Debug)]
pub(crate) enum Ended {
    Exited(ExitStatus),
    /// Killed (with its process group) at the deadline.
    TimedOut,
}

/// Run `command` (whose stdin the caller set) with its stdout and stderr drained into `log`, killing it and its
/// process group when `deadline` (if any) passes. The command runs in a new process group.
pub(crate) fn run(
    mut command: Command,
    log: std::fs::File,
    deadline: Option<Duration>,
) -> std::io::Result<Ended> {
    use std::os::unix::process::CommandExt;
    let (reader, writer) = std::io::pipe()?;
    command
        .stdout(writer.try_clone()?)
        .stderr(writer)
        .process_group(0);
    let started = Instant::now();
    let spawned = command.spawn();
    // The command keeps the pipe's write end until it is dropped: without this the drain never sees its end.
    drop(command);
    let mut child = spawned?;
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = drain(reader, log, LOG_MAX_BYTES);
        let _ = done_tx.send(());
    });
    // A limit past what an Instant can hold is no limit.
    let ended = wait_until(
        &mut child,
        deadline.and_then(|limit| started.checked_add(limit)),
    );
    let ended = match ended {
        Ok(ended) => ended,
        Err(err) => {
            kill_group(&mut child);
            let _ = child.wait();
            return Err(err);
        }
    };
    // Bounded: a process the build left running may keep the pipe open; then the log simply ends here.
    let _ = done_rx.recv_timeout(DRAIN_GRACE);
    Ok(ended)
}

fn wait_until(child: &mut Child, deadline: Option<Instant>) -> std::io::Result<Ended> {
    loop {
        if exited_unreaped(child)? {
            // What the backend left running in its group (a daemon, a forgotten compiler) ends with it, and
            // stops holding the log's pipe; killed before the child is reaped, so the group id is still its own.
            kill_group_of(child.id());
            return Ok(Ended::Exited(child.wait()?));
        }
        if deadline.is_some_and(|at| Instant::now() >= at) {
            kill_group(child);
            child.wait()?;
            return Ok(Ended::TimedOut);
        }
        std::thread::sleep(POLL);
    }
}

/// Whether the child has exited, without reaping it (`WNOWAIT`: its pid, and so its group's id, stay reserved).
fn exited_unreaped(child: &Child) -> std::io::Result<bool> {
    let pid: libc::id_t = child.id();
    // SAFETY: `info` is a zeroed siginfo_t the call fills; the child is ours and not yet reaped.
    let (r, info) = unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let r = libc::waitid(
            libc::P_PID,
            pid,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        );
        (r, info)
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: waitid succeeded, so si_pid is valid to read (0 when nothing has exited yet).
    Ok(unsafe { info.si_pid() } != 0)
}

/// SIGKILL the child's process group (it leads one: `process_group(0)`), then the child itself.
fn kill_group(child: &mut Child) {
    kill_group_of(child.id());
    let _ = child.kill();
}

/// SIGKILL the process group `pgid` (the group the backend process led; called while that process is unreaped,
/// so the id cannot name another group).
fn kill_group_of(pgid: u32) {
    if let Ok(pgid) = i32::try_from(pgid) {
        // SAFETY: `kill` has no memory effects; a negative pid names a process group.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
}

/// Copy `from` into `log` until its end, keeping at most about `max` bytes: past that, only the last
/// [`KEPT_TAIL_BYTES`] are kept and written at the end after a line saying how many bytes were left out.
fn drain(mut from: impl Read, mut log: impl Write, max: u64) -> std::io::Result<()> {
    let head_limit = max.saturating_sub(KEPT_TAIL_BYTES as u64);
    let mut written = 0u64;
    let mut tail: VecDeque<u8> = VecDeque::new();
    let mut dropped = 0u64;
    let mut write_failed = None;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        let mut chunk = &buf[..n];
        if written < head_limit && write_failed.is_none() {
            let take = chunk.len().min((head_limit - written) as usize);
            // A log that cannot be written (a full disk) must not stop the draining: the backend would block on
            // its output until the deadline. The error is returned at the end.
            if let Err(err) = log.write_all(&chunk[..take]) {
                write_failed = Some(err);
            }
            written += take as u64;
            chunk = &chunk[take..];
        }
        tail.extend(chunk);
        if tail.len() > KEPT_TAIL_BYTES {
            let excess = tail.len() - KEPT_TAIL_BYTES;
            tail.drain(..excess);
            dropped += excess as u64;
        }
    }
    if let Some(err) = write_failed {
        return Err(err);
    }
    if dropped > 0 {
        writeln!(
            log,
            "\n[hvd: {dropped} bytes of build output left out here: build.log keeps at most {max} bytes]"
        )?;
    }
    let (front, back) = tail.as_slices();
    log.write_all(front)?;
    log.write_all(back)?;
    log.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_output_is_kept_whole() {
        let mut log = Vec::new();
        drain(&b"line one\nHVD_WHEEL=x.whl\n"[..], &mut log, 1 << 20).unwrap();
        assert_eq!(log, b"line one\nHVD_WHEEL=x.whl\n");
    }

    #[test]
    fn an_endless_output_keeps_its_head_and_its_last_lines() {
        let mut input = b"first line\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 3 << 20));
        input.extend(b"\nHVD_WHEEL=last.whl\n");
        let mut log = Vec::new();
        drain(&input[..], &mut log, 1 << 20).unwrap();
        let text = String::from_utf8_lossy(&log);
        assert!(log.len() < (1 << 20) + 200, "{} bytes kept", log.len());
        assert!(text.starts_with("first line\n"));
        assert!(text.contains("bytes of build output left out here"));
        assert!(text.ends_with("\nHVD_WHEEL=last.whl\n"));
    }

    #[test]
    fn a_process_past_its_deadline_is_killed_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let marker = dir.path().join("child-survived");
        let mut command = Command::new("/bin/sh");
        // The background child would write the marker after the deadline if it outlived its group's kill.
        command.arg("-c").arg(format!(
            "(sleep 2; touch {}) & echo started; sleep 600",
            marker.display()
        ));
        command.stdin(std::process::Stdio::null());
        let ended = run(command, log, Some(Duration::from_millis(300))).unwrap();
        assert!(matches!(ended, Ended::TimedOut), "{ended:?}");
        std::thread::sleep(Duration::from_millis(2500));
        assert!(
            !marker.exists(),
            "a process of the killed build kept running"
        );
        let text = std::fs::read_to_string(dir.path().join("log")).unwrap();
        assert!(text.contains("started"), "{text:?}");
    }

    #[test]
    fn what_a_backend_leaves_running_ends_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let marker = dir.path().join("left-behind-survived");
        let mut command = Command::new("/bin/sh");
        // The background child holds the log's pipe and would write the marker after its parent exited.
        command
            .arg("-c")
            .arg(format!("(sleep 2; touch {}) & echo done", marker.display()));
        command.stdin(std::process::Stdio::null());
        let ended = run(command, log, Some(Duration::from_secs(60))).unwrap();
        assert!(
            matches!(ended, Ended::Exited(s) if s.success()),
            "{ended:?}"
        );
        std::thread::sleep(Duration::from_millis(2500));
        assert!(
            !marker.exists(),
            "a process the backend left running outlived it"
        );
    }

    #[test]
    fn a_deadline_past_what_an_instant_holds_is_no_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let mut command = Command::new("/bin/sh");
        command.arg("-c").arg("exit 0");
        command.stdin(std::process::Stdio::null());
        let ended = run(command, log, Some(Duration::from_secs(u64::MAX))).unwrap();
        assert!(
            matches!(ended, Ended::Exited(s) if s.success()),
            "{ended:?}"
        );
    }

    #[test]
    fn a_process_that_exits_reports_its_status() {
        let dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let mut command = Command::new("/bin/sh");
        command.arg("-c").arg("echo out; echo err >&2; exit 3");
        command.stdin(std::process::Stdio::null());
        let Ended::Exited(status) = run(command, log, Some(Duration::from_secs(60))).unwrap()
        else {
            panic!("timed out");
        };
        assert_eq!(status.code(), Some(3));
        let text = std::fs::read_to_string(dir.path().join("log")).unwrap();
        assert_eq!(text, "out\nerr\n");
    }
}
