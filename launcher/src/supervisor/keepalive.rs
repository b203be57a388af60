//! Keepalive lines on every remote rank's stdin (ssh, srun, a spark relay, `kubectl exec`): a line `ALIVE` every
//! `HVD_REMOTE_KEEPALIVE` seconds (default 30), which the host's wrapper skips (`engines/ssh.rs`, `WRAPPER`).
//!
//! A rank other than 0 commonly prints nothing for hours, and its stdin carries nothing until it is stopped, so the
//! stream between the launcher and the rank is idle in both directions. What sits on the way closes idle streams and
//! so ends the rank (its stdin's end is a stop): the kubelet closes an exec stream after its
//! `--streaming-connection-idle-timeout` (4 h by default, 5 min on clusters hardened by the CIS benchmark), load
//! balancers in front of an API server after a minute or an hour, sshd after its `ChannelTimeout`, NAT and firewall
//! state tables after theirs. A line every 30 s keeps each of them from seeing an idle stream.
//!
//! The lines are written without blocking: a rank whose transport stopped reading (a hung ssh, an srun waiting for
//! its step's resources) fills its pipe after about 10^4 lines (three days at the default, 18 minutes at the least
//! interval), and then its keepalives are dropped rather than stalling the launcher; a stop or hand-over request
//! that no longer fits is lost too, and the pipe's end that follows it is taken for TERM.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::Worker;
use crate::LaunchError;
use crate::engine::PlannedStep;

/// The most seconds between two keepalive lines.
const MAX_SECONDS: f64 = 3600.0;

/// `HVD_REMOTE_KEEPALIVE` of `step` (the step's `env`, else this process's): seconds between two keepalive lines,
/// `0` for none; default 30, from 0.1 to 3600, anything else is an error naming the variable and the step.
pub(super) fn interval(step: &PlannedStep) -> Result<Option<Duration>, LaunchError> {
    let name = crate::env_vars::HVD_REMOTE_KEEPALIVE;
    let Some(value) = step
        .env
        .get(name)
        .cloned()
        .or_else(|| std::env::var(name).ok())
    else {
        return Ok(Some(Duration::from_secs(30)));
    };
    match value.trim().parse::<f64>() {
        Ok(0.0) => Ok(None),
        Ok(s) if (0.1..=MAX_SECONDS).contains(&s) => Ok(Some(Duration::from_secs_f64(s))),
        _ => Err(LaunchError::Engine(format!(
            "step `{}`: {name}={value:?} is not a number of seconds from 0.1 to {MAX_SECONDS} (or 0: no keepalive \
             lines to the remote ranks)",
            step.name
        ))),
    }
}

/// When the next keepalive lines are due.
pub(super) struct Keepalive {
    every: Option<Duration>,
    next: Instant,
}

impl Keepalive {
    pub(super) fn new(every: Option<Duration>, now: Instant) -> Keepalive {
        Keepalive {
            every,
            next: now + every.unwrap_or_default(),
        }
    }

    /// Writes `ALIVE` to every running remote worker's stdin once the interval has passed since the last time.
    pub(super) fn tick(&mut self, now: Instant, workers: &mut [Worker]) {
        let Some(every) = self.every else { return };
        if now < self.next {
            return;
        }
        self.next = now + every;
        for w in workers.iter_mut().filter(|w| w.exited.is_none()) {
            if let Some(stdin) = w.stdin.as_mut() {
                crate::engine::send_alive(stdin);
            }
        }
    }
}

/// Makes writes to a remote rank's stdin fail rather than wait when its pipe is full (the keepalives above; a stop
/// line that cannot be written is then replaced by the pipe's end, which the wrapper takes for TERM). Called after
/// the token and the variables, at most 48 KiB, which fit an empty pipe of the usual 64 KiB (a pipe made past the
/// user's `pipe-user-pages-soft` limit is smaller, and that first write may wait for the transport to read).
pub(super) fn never_block(stdin: &std::process::ChildStdin) {
    let fd = stdin.as_raw_fd();
    // SAFETY: fcntl on a descriptor this process owns (the child's stdin pipe), changing only its status flags.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(keepalive: &str) -> PlannedStep {
        PlannedStep {
            name: "train".into(),
            command: "python t.py".into(),
            needs: vec![],
            workers: Some(2),
            layout: crate::env::WorkerLayout::local("h", 2),
            env: [(
                crate::env_vars::HVD_REMOTE_KEEPALIVE.to_owned(),
                keepalive.to_owned(),
            )]
            .into_iter()
            .collect(),
            inputs: vec![],
            outputs: vec![],
            timeout: None,
            restarts: 0,
            min_workers: None,
            elastic: Default::default(),
        }
    }

    /// The step's value wins; `0` is none; what is not a number of seconds in range is refused, naming the variable,
    /// the value and the step.
    #[test]
    fn the_interval_is_the_steps_and_a_bad_one_is_refused_by_name() {
        assert_eq!(
            interval(&step("0.5")).unwrap(),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            interval(&step(" 60 ")).unwrap(),
            Some(Duration::from_secs(60))
        );
        assert_eq!(interval(&step("0")).unwrap(), None);
        for bad in ["", "fast", "-1", "0.01", "3601", "NaN", "inf"] {
            let e = interval(&step(bad)).unwrap_err().to_string();
            assert!(
                e.contains("HVD_REMOTE_KEEPALIVE")
                    && e.contains(&format!("{bad:?}"))
                    && e.contains("`train`"),
                "{bad}: {e}"
            );
        }
    }
}
