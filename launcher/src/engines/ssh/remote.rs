//! Running a command on a host (or a local tool) within a deadline and bounded output, and showing what it wrote:
//! the pieces the host check and the project delivery share.

use std::process::{Child, ChildStdout, Command, Stdio};

use super::SshSetup;
use crate::engines::shell::quote;

/// What a host (or a local tool) wrote to stderr, as a message may show it: the last 40 lines at most 200
/// characters each, control characters (but line ends) escaped, so a host cannot move the cursor or rewrite the
/// terminal the launcher runs in.
pub(super) fn host_text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(40)..]
        .iter()
        .map(|line| {
            let mut out = String::new();
            for c in line.chars().take(200) {
                if c.is_control() && c != '\t' {
                    out.extend(c.escape_default());
                } else {
                    out.push(c);
                }
            }
            if line.chars().nth(200).is_some() {
                out.push_str("...");
            }
            out
        })
        .collect::<Vec<_>>()
        .join("\n    ")
}

/// The error of a phase on `host` that ran past its `deadline`.
pub(super) fn timed_out(host: &str, phase: &str, deadline: std::time::Duration) -> String {
    format!(
        "{phase} on host `{host}` did not finish within {} s and was stopped: the host stalls (or the network to \
         it); check `ssh {host} true` and the host's load, or give more time (`--start-timeout`)",
        deadline.as_secs()
    )
}

/// What [`bounded_output`] read.
pub(super) struct BoundedOutput {
    pub status: std::process::ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// stdout had more than the limit (the rest was read and dropped).
    pub stdout_overflow: bool,
    /// The command ran past its deadline and was killed.
    pub timed_out: bool,
}

/// Runs `command` with `stdin` (closed when `None`) and keeps at most `limit` bytes of each of its stdout and stderr,
/// reading and dropping the rest (so the child never blocks on a full pipe). Past `deadline` the child is killed (a
/// host that authenticates and then stalls cannot hold the launcher); what it started and still holds the pipes is
/// waited for [`AFTER_KILL`] at most. The child stays in the launcher's process group, so a Ctrl-C at the terminal
/// still reaches it at once.
pub(super) fn bounded_output(
    command: &mut Command,
    stdin: Option<Stdio>,
    limit: usize,
    deadline: std::time::Duration,
) -> std::io::Result<BoundedOutput> {
    use std::sync::mpsc::{RecvTimeoutError, channel};
    use std::time::Instant;
    fn keep(mut from: impl std::io::Read, limit: usize) -> (Vec<u8>, bool) {
        let mut kept = Vec::new();
        let mut buf = [0u8; 16 << 10];
        let mut overflow = false;
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => return (kept, overflow),
                Ok(n) => {
                    let room = limit.saturating_sub(kept.len());
                    kept.extend_from_slice(&buf[..n.min(room)]);
                    overflow |= n > room;
                }
            }
        }
    }
    let started = Instant::now();
    let mut child = command
        .stdin(stdin.unwrap_or_else(Stdio::null))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let (sender, read) = channel::<(bool, (Vec<u8>, bool))>();
    if let Some(stdout) = child.stdout.take() {
        let sender = sender.clone();
        std::thread::spawn(move || sender.send((true, keep(stdout, limit))));
    }
    if let Some(stderr) = child.stderr.take() {
        std::thread::spawn(move || sender.send((false, keep(stderr, limit))));
    } else {
        drop(sender);
    }
    let mut stdout = (Vec::new(), false);
    let mut stderr = (Vec::new(), false);
    let mut timed_out = false;
    let kill = |child: &mut std::process::Child, timed_out: &mut bool| {
        if !*timed_out {
            let _ = child.kill();
            *timed_out = true;
        }
    };
    for _ in 0..2 {
        let wait = if timed_out {
            AFTER_KILL
        } else {
            deadline.saturating_sub(started.elapsed())
        };
        let got = match read.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) if !timed_out => {
                kill(&mut child, &mut timed_out);
                read.recv_timeout(AFTER_KILL)
            }
            other => other,
        };
        match got {
            Ok((true, out)) => stdout = out,
            Ok((false, err)) => stderr = err,
            Err(_) => break,
        }
    }
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() >= deadline {
            kill(&mut child, &mut timed_out);
            break child.wait()?;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Ok(BoundedOutput {
        status,
        stdout: stdout.0,
        stderr: stderr.0,
        stdout_overflow: stdout.1,
        timed_out,
    })
}

/// How long [`bounded_output`] waits for the output pipes after it killed a command past its deadline.
const AFTER_KILL: std::time::Duration = std::time::Duration::from_secs(2);

impl SshSetup {
    /// Runs `script` on `host` with `archive` (the stdout of the local `tar`) as its stdin, within the copy deadline,
    /// keeping 1 MiB of its output; past the deadline `tar` is killed too. The caller waits for `tar`.
    pub(super) fn unpack_on(
        &self,
        host: &str,
        script: &str,
        archive: ChildStdout,
        tar: &mut Child,
    ) -> Result<BoundedOutput, String> {
        let argv = self.argv(host, &format!("exec /bin/sh -c {}", quote(script)));
        let out = bounded_output(
            Command::new(&argv[0]).args(&argv[1..]),
            Some(archive.into()),
            1 << 20,
            self.deadlines.copy,
        )
        .map_err(|e| format!("failed to run `{}`: {e}", argv[0]));
        if out.as_ref().is_ok_and(|o| o.timed_out) {
            let _ = tar.kill();
        }
        out
    }
}
