//! Process control for workers: their own process group, death with the launcher (PR_SET_PDEATHSIG plus a watchdog
//! process for what the worker itself starts), signals to whole groups, and the launcher's own SIGINT/SIGTERM.
//!
//! All `unsafe` of the launcher lives here.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

/// Makes `command` start in a new session (so its own process group, without the terminal: Ctrl-C reaches workers
/// only through the launcher) and get SIGKILL when the launcher thread that spawns it dies.
pub fn configure_worker(command: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only calls async-signal-safe functions (setsid, prctl,
    // getppid); it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) < 0
            {
                return Err(io::Error::last_os_error());
            }
            // The launcher may have died between fork and prctl; then nobody would deliver the signal.
            if libc::getppid() != launcher {
                libc::_exit(137);
            }
            Ok(())
        });
    }
}

/// Sends `signal` to every process in group `pgid`. Errors (the group is gone) are ignored.
pub fn signal_group(pgid: u32, signal: i32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    // SAFETY: plain syscall with integer arguments; a negative pid addresses the process group.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

/// Makes this process the reaper of its orphaned descendants, so workers' children that left their process group
/// (`setsid`, double fork) are re-parented to the launcher and can be found by [`kill_escaped`].
pub fn become_subreaper() {
    // SAFETY: plain prctl with integer arguments.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0);
    }
}

/// Kills and reaps this process's children (adopted orphans included) whose environment holds `marker`
/// (`NAME=value`), repeating until none is left, so descendants that escaped their worker's process group end too.
pub fn kill_escaped(marker: &str) {
    let me = std::process::id();
    for _ in 0..50 {
        let mut found = false;
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // Field 4 (ppid) follows the command name, which is in parentheses and may contain anything.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if ppid != Some(me) {
                continue;
            }
            let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
                continue;
            };
            if !environ.split(|&b| b == 0).any(|v| v == marker.as_bytes()) {
                continue;
            }
            found = true;
            let Ok(pid) = libc::pid_t::try_from(pid) else {
                continue;
            };
            // SAFETY: signalling and reaping a child of ours by pid; a null status pointer is allowed.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
        if !found {
            return;
        }
    }
}

/// Waits up to `timeout` for `fd` to be readable (or at end of file / in error: a read will not block).
pub fn wait_readable(fd: std::os::fd::RawFd, timeout: std::time::Duration) -> bool {
    let mut pollfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd on the stack, count 1.
    let n = unsafe { libc::poll(&mut pollfd, 1, ms) };
    n != 0
}

/// Whether any process of group `pgid` is still alive.
pub fn group_alive(pgid: u32) -> bool {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return false;
    };
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

/// A forked helper that SIGKILLs the watched process groups when the launcher dies without cleaning up (SIGKILL,
/// crash): it reads group ids from a pipe and sees end-of-file when the launcher is gone. PR_SET_PDEATHSIG alone only
/// covers the worker's `sh`, not the processes it starts.
#[derive(Debug)]
pub struct Watchdog {
    pipe: Option<OwnedFd>,
    pid: libc::pid_t,
}

const WATCH_CAPACITY: usize = 4096;

impl Watchdog {
    pub fn start() -> io::Result<Watchdog> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid two-element array for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let (read_fd, write_fd) = (fds[0], fds[1]);
        // SAFETY: fork in a multi-threaded process is sound as long as the child only calls async-signal-safe
        // functions until it exits; `watchdog_main` does exactly that (read, kill, signal, close_range, _exit).
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            let err = io::Error::last_os_error();
            // SAFETY: closing the descriptors pipe2 just returned.
            unsafe {
                libc::close(read_fd);
                libc::close(write_fd);
            }
            return Err(err);
        }
        if pid == 0 {
            // SAFETY: in the forked child; see above.
            unsafe { watchdog_main(read_fd) }
        }
        // SAFETY: the parent owns the write end exclusively from here on; the read end is closed.
        let pipe = unsafe {
            libc::close(read_fd);
            OwnedFd::from_raw_fd(write_fd)
        };
        Ok(Watchdog {
            pipe: Some(pipe),
            pid,
        })
    }

    fn send(&self, value: i32) {
        if let Some(pipe) = &self.pipe {
            let bytes = value.to_ne_bytes();
            // SAFETY: writing 4 bytes from a live buffer to a descriptor we own. 4 < PIPE_BUF: atomic.
            unsafe {
                libc::write(pipe.as_raw_fd(), bytes.as_ptr().cast(), bytes.len());
            }
        }
    }

    /// Kill group `pgid` if the launcher dies.
    pub fn watch(&self, pgid: u32) {
        if let Ok(v) = i32::try_from(pgid) {
            self.send(v);
        }
    }

    /// Group `pgid` is reaped and gone; forget it (its id may be reused).
    pub fn unwatch(&self, pgid: u32) {
        if let Ok(v) = i32::try_from(pgid) {
            self.send(-v);
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // 0 means "clean exit, kill nothing".
        self.send(0);
        drop(self.pipe.take());
        // SAFETY: reaping our own child; a null status pointer is allowed.
        unsafe {
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// The watchdog's whole life. Async-signal-safe calls only, no allocation.
unsafe fn watchdog_main(read_fd: libc::c_int) -> ! {
    // SAFETY: all calls are async-signal-safe syscalls on integers or on stack buffers we own.
    unsafe {
        // Ctrl-C goes to the whole foreground group; the watchdog must outlive the launcher's handling of it.
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        // Hold nothing of the launcher's (listening sockets, worker pipes), only our pipe end.
        if read_fd > 3 {
            libc::syscall(libc::SYS_close_range, 3u32, (read_fd - 1) as u32, 0u32);
        }
        libc::syscall(libc::SYS_close_range, (read_fd + 1) as u32, u32::MAX, 0u32);
        let mut groups = [0i32; WATCH_CAPACITY];
        let mut count = 0usize;
        let mut buf = [0u8; 4];
        let mut have = 0usize;
        loop {
            let n = libc::read(read_fd, buf.as_mut_ptr().add(have).cast(), 4 - have);
            if n < 0 {
                if *libc::__errno_location() == libc::EINTR {
                    continue;
                }
                break;
            }
            if n == 0 {
                break;
            }
            have += n as usize;
            if have < 4 {
                continue;
            }
            have = 0;
            let value = i32::from_ne_bytes(buf);
            if value == 0 {
                libc::_exit(0);
            } else if value > 0 {
                if count < WATCH_CAPACITY {
                    groups[count] = value;
                    count += 1;
                }
            } else if let Some(i) = groups[..count].iter().position(|&g| g == -value) {
                groups[i] = groups[count - 1];
                count -= 1;
            }
        }
        // The launcher is gone without saying goodbye.
        for &g in &groups[..count] {
            if g > 1 {
                libc::kill(-g, libc::SIGKILL);
            }
        }
        libc::_exit(0)
    }
}

static INTERRUPTS: AtomicU32 = AtomicU32::new(0);
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_interrupt(signal: libc::c_int) {
    LAST_SIGNAL.store(signal, Ordering::SeqCst);
    INTERRUPTS.fetch_add(1, Ordering::SeqCst);
}

/// SIGINT/SIGTERM received by the launcher: the first stops the workers gracefully, the second kills them.
#[derive(Debug, Clone, Copy)]
pub struct Interrupts {
    global: bool,
}

impl Interrupts {
    /// Installs handlers for SIGINT and SIGTERM in this process (for the `hvd` binary).
    pub fn install() -> Interrupts {
        for signal in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: the handler only touches atomics, which is async-signal-safe; sigaction gets a zeroed,
            // fully initialized struct.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_interrupt as *const () as libc::sighandler_t;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut());
            }
        }
        Interrupts { global: true }
    }

    /// No signal handling (library callers that handle signals themselves, tests).
    pub fn none() -> Interrupts {
        Interrupts { global: false }
    }

    /// How many interrupts arrived, and the last signal number.
    pub fn get(&self) -> (u32, i32) {
        if self.global {
            (
                INTERRUPTS.load(Ordering::SeqCst),
                LAST_SIGNAL.load(Ordering::SeqCst),
            )
        } else {
            (0, 0)
        }
    }
}

/// The conventional name of a signal number.
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        _ => return format!("signal {signal}"),
    };
    name.to_owned()
}
