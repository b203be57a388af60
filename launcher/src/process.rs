//! Process control for workers: their own process group, death with the launcher (PR_SET_PDEATHSIG plus a watchdog
//! process for what the worker itself starts), signals to whole groups, and the launcher's own SIGINT/SIGTERM.
//!
//! The `unsafe` of the launcher's own process control (the fork-exec hook, signals, `prctl`) lives here. Other
//! modules hold the `unsafe` of the system calls only they make, each with its SAFETY note: `engines/shim.rs` (the
//! shim's signal forwarding and `prctl` in front of a rank), `engines/ssh.rs` (`getifaddrs`),
//! `rendezvous/peer.rs` (`getifaddrs` and the socket queries behind the peer checks), and `engines/mod.rs` and
//! `rendezvous.rs` (`geteuid`).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

/// Makes `command` start in a new session (so its own process group, without the terminal: Ctrl-C reaches workers
/// only through the launcher) and get SIGKILL when the launcher thread that spawns it dies.
pub fn configure_worker(command: &mut Command) {
    configure_worker_in(command, None);
}

/// [`configure_worker`], and the worker joins `cgroup` before it runs anything, so everything it starts is
/// found there whatever it does (`setsid`, double fork, a cleared environment).
pub fn configure_worker_in(command: &mut Command, cgroup: Option<&StepCgroup>) {
    let launcher = std::process::id() as libc::pid_t;
    let procs = cgroup.map(|c| c.procs.as_raw_fd());
    // SAFETY: the closure runs between fork and exec and only calls async-signal-safe functions (write, setsid,
    // prctl, getppid); it allocates nothing. `procs` stays open in the parent until the spawn returns.
    unsafe {
        command.pre_exec(move || {
            if let Some(fd) = procs {
                // "0" moves the writing process.
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
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
/// (`setsid`, double fork) are re-parented to the launcher and can be found by [`end_step`].
pub fn become_subreaper() {
    // SAFETY: plain prctl with integer arguments.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0);
    }
}

/// The `HVD_RUN_STEP=...` markers of the steps running in this process (all runs): their processes are left alone
/// by another step's cleanup.
static LIVE_STEPS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn live_steps() -> std::sync::MutexGuard<'static, Vec<String>> {
    LIVE_STEPS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A running step, registered by its marker (`NAME=value`, as it is in its workers' environment) before any of its
/// workers starts; [`end_step`] ends it.
#[derive(Debug)]
pub struct StepLease {
    marker: String,
}

/// Registers a step that is about to start workers carrying `marker` (`NAME=value`) in their environment.
pub fn start_step(marker: String) -> StepLease {
    live_steps().push(marker.clone());
    StepLease { marker }
}

impl Drop for StepLease {
    fn drop(&mut self) {
        let mut live = live_steps();
        if let Some(i) = live.iter().position(|m| *m == self.marker) {
            live.swap_remove(i);
        }
    }
}

/// Ends what is left of a step whose workers have all exited (and been reaped): kills and reaps its whole
/// remaining process tree, then unregisters it. See [`kill_orphans`] for what is attributed to it.
pub fn end_step(lease: StepLease) {
    kill_orphans(Some(&lease.marker));
    drop(lease);
}

/// At the end of a run: kills every orphan this process adopted that no running step claims, with its descendants.
pub fn end_run() {
    kill_orphans(None);
}

/// One process as `/proc/PID/stat` shows it.
struct ProcEntry {
    pid: u32,
    ppid: u32,
    session: u32,
    zombie: bool,
}

/// Every process in `/proc` (those that vanish while being read are left out).
fn processes() -> Vec<ProcEntry> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // After the command name (in parentheses, and it may contain anything): state, ppid, pgrp, session.
            let (_, rest) = stat.rsplit_once(')')?;
            let mut fields = rest.split_whitespace();
            let state = fields.next()?;
            let ppid = fields.next()?.parse().ok()?;
            let _pgrp = fields.next()?;
            let session = fields.next()?.parse().ok()?;
            Some(ProcEntry {
                pid,
                ppid,
                session,
                zombie: state == "Z" || state == "X",
            })
        })
        .collect()
}

/// The step marker (`NAME=value` starting with `marker_name=`) in the environment of `pid`, if readable and present.
fn marker_of(pid: u32, marker_name: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|&b| b == 0)
        .find(|v| {
            v.len() > marker_name.len()
                && v.starts_with(marker_name.as_bytes())
                && v[marker_name.len()] == b'='
        })
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// Kills, with all their descendants (by ppid), the orphans this process adopted as a subreaper that belong to the
/// step `ending` (`NAME=value`; `None` at the end of a run), and reaps them; repeats until none is left (bounded).
///
/// An adopted orphan is a child of this process in another session than this process's own: workers start in new
/// sessions and a session can only be left for a new one, so nothing a worker starts is ever in the launcher's
/// session, while the launcher's own helpers (the watchdog, a test harness's children) are. Workers themselves are
/// never touched here: the ending step's have all exited, and other steps' carry a live marker (registered before
/// they start). An orphan is the ending step's when its environment carries the step's marker, or carries the marker
/// of a step that is no longer running; one without a readable marker (`env -i`, another user after `setuid`) is
/// killed only when no other step of this process is running, since it may be any running step's; it is then
/// ended by the next step end that finds no other step running, or at the end of the run.
fn kill_orphans(ending: Option<&str>) {
    let me = std::process::id();
    // SAFETY: getsid(0) only queries this process.
    let Ok(own_session) = u32::try_from(unsafe { libc::getsid(0) }) else {
        return;
    };
    let marker_name = crate::env::STEP_MARKER_VAR;
    let mut killed: std::collections::HashSet<u32> = std::collections::HashSet::new();
    const ROUNDS: u32 = 500;
    for round in 0..ROUNDS {
        let (others_running, live): (bool, Vec<String>) = {
            let live = live_steps();
            let others = live.iter().any(|m| Some(m.as_str()) != ending);
            (others, live.clone())
        };
        let all = processes();
        let mut roots = Vec::new();
        for p in &all {
            if p.ppid != me || p.zombie || p.session == own_session {
                continue;
            }
            let take = match marker_of(p.pid, marker_name) {
                Some(m) if Some(m.as_str()) == ending => true,
                Some(m) if live.contains(&m) => false,
                Some(_) => true,
                None => !others_running,
            };
            if take {
                roots.push(p.pid);
            }
        }
        // Every descendant of a root, parents before children: a child left alive by its killed parent is
        // re-parented to us (we are its subreaper), so its pid cannot be reused before we reap it.
        let mut order = roots.clone();
        let mut i = 0;
        while i < order.len() {
            let parent = order[i];
            order.extend(
                all.iter()
                    .filter(|p| p.ppid == parent && !p.zombie)
                    .map(|p| p.pid),
            );
            i += 1;
        }
        for &pid in &order {
            if let Ok(pid) = libc::pid_t::try_from(pid)
                && pid > 1
            {
                // SAFETY: sending a signal by pid, to a process of the tree we adopted.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
        killed.extend(order.iter().copied());
        // Reap what we killed and adopted (never a pid we did not kill: a worker's own waiter reaps it).
        // A killed pid that is not (yet) our child stays in the set while it exists: once its killed parent is gone
        // it is re-parented to us as a zombie, to be reaped here.
        killed.retain(|&pid| {
            let Ok(p) = libc::pid_t::try_from(pid) else {
                return false;
            };
            // SAFETY: reaping by pid with WNOHANG; a pid that is not our child gives ECHILD.
            match unsafe { libc::waitpid(p, std::ptr::null_mut(), libc::WNOHANG) } {
                0 => true,
                r if r < 0 => Path::new(&format!("/proc/{pid}")).exists(),
                _ => false,
            }
        });
        if order.is_empty() && killed.is_empty() {
            return;
        }
        if round + 1 < ROUNDS {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
    tracing::warn!(
        "processes of a finished step were still appearing after {ROUNDS} rounds of killing: {:?}",
        killed
    );
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
    // `n` is -1 when poll itself failed (`EINTR`: a signal came first; `ENOMEM`): nothing says a read will not block,
    // so the fd counts as not ready and the caller polls again (a blocking read here could hang on a pipe an escaped
    // grandchild holds open).
    n > 0
}

/// Whether any process of group `pgid` is still alive.
pub fn group_alive(pgid: u32) -> bool {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return false;
    };
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

/// A forked helper that SIGKILLs the watched process groups, and every process of the run's cgroup, when the
/// launcher dies without cleaning up (SIGKILL, crash): it reads group ids from a pipe and sees end-of-file when the
/// launcher is gone. PR_SET_PDEATHSIG alone only covers the worker's `sh`, not the processes it starts. Then (for
/// the fallback without cgroups) it kills what left the groups but is still in a watched group's session, or
/// carries the run's step marker; a process that left the session and dropped the marker is out of its reach.
#[derive(Debug)]
pub struct Watchdog {
    pipe: Option<OwnedFd>,
    pid: libc::pid_t,
}

impl Watchdog {
    /// Without a cgroup: only the watched groups are killed.
    pub fn start() -> io::Result<Watchdog> {
        Watchdog::start_for(None, None)
    }

    /// With the run's cgroup: on the launcher's death, every process in it (all steps) is killed too. With
    /// `marker` (`NAME=prefix`), so is every process whose environment has an entry starting with it (the run's
    /// step markers), and every process in a watched group's session, wherever they went (see [`Watchdog`]).
    pub fn start_for(cgroup: Option<&RunCgroup>, marker: Option<&str>) -> io::Result<Watchdog> {
        let kill_fd = match cgroup {
            Some(c) => c.open_kill()?.into_raw_fd(),
            None => -1,
        };
        let result = Watchdog::fork(kill_fd, marker.map(str::as_bytes));
        if kill_fd >= 0 {
            // SAFETY: closing our copy of the descriptor opened above; the child has its own.
            unsafe {
                libc::close(kill_fd);
            }
        }
        result
    }

    fn fork(kill_fd: libc::c_int, marker: Option<&[u8]>) -> io::Result<Watchdog> {
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
            unsafe { watchdog_main(read_fd, kill_fd, marker) }
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

/// The watchdog's whole life. Async-signal-safe calls only; its table of groups lives in memory it maps itself
/// (mmap/mremap are plain syscalls, unlike malloc), so it has no fixed capacity.
unsafe fn watchdog_main(read_fd: libc::c_int, kill_fd: libc::c_int, marker: Option<&[u8]>) -> ! {
    // SAFETY: all calls are async-signal-safe syscalls on integers, on stack buffers we own, or on the mapping this
    // function created and tracks (`groups`, `capacity`).
    unsafe {
        // Ctrl-C goes to the whole foreground group; the watchdog must outlive the launcher's handling of it.
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        // Hold nothing of the launcher's (listening sockets, worker pipes), only our pipe end and the cgroup's
        // kill file.
        let (low, high) = if kill_fd >= 0 && kill_fd < read_fd {
            (kill_fd, read_fd)
        } else if kill_fd >= 0 {
            (read_fd, kill_fd)
        } else {
            (read_fd, read_fd)
        };
        if low > 3 {
            libc::syscall(libc::SYS_close_range, 3u32, (low - 1) as u32, 0u32);
        }
        if high > low + 1 {
            libc::syscall(
                libc::SYS_close_range,
                (low + 1) as u32,
                (high - 1) as u32,
                0u32,
            );
        }
        libc::syscall(libc::SYS_close_range, (high + 1) as u32, u32::MAX, 0u32);
        let entry = std::mem::size_of::<i32>();
        let mut capacity = 4096usize;
        let mut groups = libc::mmap(
            std::ptr::null_mut(),
            capacity * entry,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        ) as *mut i32;
        if groups as *mut libc::c_void == libc::MAP_FAILED {
            groups = std::ptr::null_mut();
            capacity = 0;
        }
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
                if count == capacity {
                    let grown = libc::mremap(
                        groups.cast(),
                        capacity * entry,
                        capacity * 2 * entry,
                        libc::MREMAP_MAYMOVE,
                    );
                    if grown != libc::MAP_FAILED {
                        groups = grown.cast();
                        capacity *= 2;
                    }
                }
                if count < capacity {
                    *groups.add(count) = value;
                    count += 1;
                }
            } else {
                for i in 0..count {
                    if *groups.add(i) == -value {
                        *groups.add(i) = *groups.add(count - 1);
                        count -= 1;
                        break;
                    }
                }
            }
        }
        // The launcher is gone without saying goodbye: its cgroup first (it holds what left the groups), then the
        // groups.
        if kill_fd >= 0 {
            libc::write(kill_fd, b"1".as_ptr().cast(), 1);
        }
        for i in 0..count {
            let g = *groups.add(i);
            if g > 1 {
                libc::kill(-g, libc::SIGKILL);
            }
        }
        // Then what left the groups: processes still in a watched group's session (a worker is its session's
        // leader, so its group id is its session id), and processes whose environment carries one of the run's
        // step markers. Repeated while a round finds something (what forks meanwhile inherits both).
        let table: &[i32] = if groups.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(groups, count)
        };
        for _ in 0..16 {
            if kill_leftovers(table, marker) == 0 {
                break;
            }
        }
        libc::_exit(0)
    }
}

/// For the watchdog, after the launcher died: SIGKILLs every process (but itself) whose session is in `sessions` or
/// whose environment has an entry starting with `marker`; returns how many it signalled. Async-signal-safe: raw
/// `open`/`getdents64`/`read`/`kill` on stack buffers, no allocation.
unsafe fn kill_leftovers(sessions: &[i32], marker: Option<&[u8]>) -> usize {
    // SAFETY: syscalls on descriptors this function opens and closes, into stack buffers it owns, with lengths no
    // larger than those buffers; paths are NUL-terminated within their buffers.
    unsafe {
        let me = libc::getpid();
        let proc_fd = libc::open(
            c"/proc".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        if proc_fd < 0 {
            return 0;
        }
        let mut signalled = 0;
        let mut entries = [0u8; 4096];
        loop {
            let n = libc::syscall(
                libc::SYS_getdents64,
                proc_fd,
                entries.as_mut_ptr(),
                entries.len(),
            );
            if n <= 0 {
                break;
            }
            let n = n as usize;
            let mut at = 0usize;
            while at + 19 < n {
                // struct linux_dirent64: d_ino u64, d_off i64, d_reclen u16, d_type u8, d_name (NUL-terminated).
                let reclen = u16::from_ne_bytes([entries[at + 16], entries[at + 17]]) as usize;
                if reclen == 0 {
                    break;
                }
                let name_start = at + 19;
                let name_end = (name_start..(at + reclen).min(n))
                    .find(|&i| entries[i] == 0)
                    .unwrap_or(name_start);
                let name = &entries[name_start..name_end];
                at += reclen;
                let mut pid: i32 = 0;
                if name.is_empty() || name.len() > 9 || !name.iter().all(u8::is_ascii_digit) {
                    continue;
                }
                for &d in name {
                    pid = pid * 10 + i32::from(d - b'0');
                }
                if pid <= 1 || pid == me {
                    continue;
                }
                let ours = in_session(proc_fd, name, sessions)
                    || marker.is_some_and(|m| environ_has(proc_fd, name, m));
                if ours && libc::kill(pid, libc::SIGKILL) == 0 {
                    signalled += 1;
                }
            }
        }
        libc::close(proc_fd);
        signalled
    }
}

/// Opens `/proc/<pid>/<file>` relative to `proc_fd` (async-signal-safe).
unsafe fn open_proc_file(proc_fd: libc::c_int, pid: &[u8], file: &[u8]) -> libc::c_int {
    let mut path = [0u8; 64];
    if pid.len() + 1 + file.len() + 1 > path.len() {
        return -1;
    }
    path[..pid.len()].copy_from_slice(pid);
    path[pid.len()] = b'/';
    path[pid.len() + 1..pid.len() + 1 + file.len()].copy_from_slice(file);
    // SAFETY: `path` is NUL-terminated (zero-filled past what was copied).
    unsafe {
        libc::openat(
            proc_fd,
            path.as_ptr().cast(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    }
}

/// Whether `/proc/<pid>/stat` names a session in `sessions` (async-signal-safe).
unsafe fn in_session(proc_fd: libc::c_int, pid: &[u8], sessions: &[i32]) -> bool {
    if sessions.is_empty() {
        return false;
    }
    // SAFETY: reading into a stack buffer no larger than its length, from a descriptor opened and closed here.
    unsafe {
        let fd = open_proc_file(proc_fd, pid, b"stat");
        if fd < 0 {
            return false;
        }
        let mut stat = [0u8; 1024];
        let n = libc::read(fd, stat.as_mut_ptr().cast(), stat.len());
        libc::close(fd);
        if n <= 0 {
            return false;
        }
        let stat = &stat[..n as usize];
        // After the last ')': " state ppid pgrp session ..."
        let Some(close) = stat.iter().rposition(|&b| b == b')') else {
            return false;
        };
        let mut fields = stat[close + 1..]
            .split(|&b| b == b' ')
            .filter(|f| !f.is_empty());
        let Some(session) = fields.nth(3) else {
            return false;
        };
        let mut value: i64 = 0;
        for &d in session {
            if !d.is_ascii_digit() || value > i64::from(i32::MAX) {
                return false;
            }
            value = value * 10 + i64::from(d - b'0');
        }
        value > 1 && sessions.iter().any(|&s| i64::from(s) == value)
    }
}

/// Whether `/proc/<pid>/environ` has an entry starting with `marker`, read in chunks (async-signal-safe).
unsafe fn environ_has(proc_fd: libc::c_int, pid: &[u8], marker: &[u8]) -> bool {
    // SAFETY: reading into a stack buffer no larger than its length, from a descriptor opened and closed here.
    unsafe {
        let fd = open_proc_file(proc_fd, pid, b"environ");
        if fd < 0 {
            return false;
        }
        let mut chunk = [0u8; 4096];
        // Characters of `marker` matched at the start of the current entry; `usize::MAX` once it differs.
        let mut matched = 0usize;
        let mut found = false;
        'read: loop {
            let n = libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len());
            if n <= 0 {
                break;
            }
            for &b in &chunk[..n as usize] {
                if b == 0 {
                    matched = 0;
                } else if matched < marker.len() {
                    if marker[matched] == b {
                        matched += 1;
                        if matched == marker.len() {
                            found = true;
                            break 'read;
                        }
                    } else {
                        matched = usize::MAX;
                    }
                }
            }
        }
        libc::close(fd);
        found
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

/// A cgroup (v2) holding every process of one run, with one child group per step.
///
/// Made under the launcher's own cgroup where this machine allows it (cgroup v2 mounted, the directory writable,
/// `cgroup.kill` present: Linux 5.14+). Each worker joins its step's group before it runs anything, so whatever it
/// starts stays in the group; ending a step kills the group (`cgroup.kill`), and the [`Watchdog`] kills the whole
/// run's group when the launcher dies. Groups of launchers that died with their watchdog are killed and removed the
/// next time a launcher starts: a live launcher holds a shared `flock` on its group's directory (`owner`, close-on-exec
/// so no worker inherits it), which is namespace-independent, unlike the pid in the group's name.
#[derive(Debug)]
pub struct RunCgroup {
    dir: PathBuf,
    _owner: OwnedFd,
}

/// One step's group inside a [`RunCgroup`]; [`StepCgroup::kill_all`] ends everything in it.
#[derive(Debug)]
pub struct StepCgroup {
    dir: PathBuf,
    procs: OwnedFd,
}

static CGROUPS: AtomicU32 = AtomicU32::new(0);
const CGROUP_PREFIX: &str = "hvd-run-";

/// The cgroup v2 directory this process is in, if v2 is mounted.
pub fn own_cgroup_v2() -> Result<PathBuf, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    // Fields: ... mount-point(5th) ... " - " fstype source options.
    let mount = mountinfo
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            (right.split_whitespace().next()? == "cgroup2")
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .ok_or("no cgroup v2 file system is mounted")?;
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
    let relative = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or("this process has no cgroup v2 membership")?;
    Ok(mount.join(relative.trim_start_matches('/')))
}

/// `flock(operation)` on a cgroup directory, through a close-on-exec descriptor that keeps the lock.
fn lock_group(dir: &Path, operation: libc::c_int) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)?;
    let fd = OwnedFd::from(file);
    loop {
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(fd.as_raw_fd(), operation) } == 0 {
            return Ok(fd);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

fn write_file(path: &Path, value: &str) -> io::Result<()> {
    std::fs::write(path, value)
}

/// Kills every process in `dir` and below, waits (up to 5 s) until it is empty, reaps what were our children, and
/// removes the directories.
fn kill_and_remove(dir: &Path) {
    let members = cgroup_members(dir);
    let _ = write_file(&dir.join("cgroup.kill"), "1");
    for pid in members {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            continue;
        };
        // SAFETY: reaping by pid; only our own children (adopted orphans) can be reaped, others give ECHILD.
        unsafe {
            libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG);
        }
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while populated(dir) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
        // Members that were our children become zombies; reap them so they leave the group.
        for pid in cgroup_members(dir) {
            if let Ok(pid) = libc::pid_t::try_from(pid) {
                // SAFETY: as above.
                unsafe {
                    libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG);
                }
            }
        }
    }
    remove_cgroup_tree(dir);
}

fn remove_cgroup_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&entry.path());
            }
        }
    }
    if let Err(e) = std::fs::remove_dir(dir)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!("could not remove the cgroup {}: {e}", dir.display());
    }
}

/// Pids in `dir` and every group below it.
fn cgroup_members(dir: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pids.extend(cgroup_members(&entry.path()));
            }
        }
    }
    pids
}

fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events"))
        .map(|e| e.lines().any(|l| l == "populated 1"))
        .unwrap_or(false)
}

impl RunCgroup {
    /// Creates the run's group, or says why it cannot (the caller falls back to process groups and the
    /// subreaper). First kills and removes groups left by launchers that are gone.
    pub fn create() -> Result<RunCgroup, String> {
        let parent = own_cgroup_v2()?;
        if !parent.join("cgroup.kill").exists() && !parent.join("cgroup.procs").exists() {
            return Err(format!("{} is not a cgroup v2 directory", parent.display()));
        }
        Self::remove_stale(&parent);
        let mut attempts = 0;
        let group = loop {
            let n = CGROUPS.fetch_add(1, Ordering::Relaxed);
            let dir = parent.join(format!("{CGROUP_PREFIX}{}-{n}", std::process::id()));
            match std::fs::create_dir(&dir) {
                // Another pid namespace's launcher with the same pid and counter: take the next name.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => {
                    attempts += 1;
                    continue;
                }
                r => r.map_err(|e| format!("cannot create the cgroup {}: {e}", dir.display()))?,
            }
            let owner = lock_group(&dir, libc::LOCK_SH)
                .map_err(|e| format!("cannot lock the cgroup {}: {e}", dir.display()))?;
            // Another launcher's `remove_stale` may have taken the fresh, not yet locked group for a stale one
            // and removed it: then take a new one.
            if dir.is_dir() {
                break RunCgroup { dir, _owner: owner };
            }
            attempts += 1;
            if attempts >= 16 {
                return Err(format!("the cgroup {} keeps disappearing", dir.display()));
            }
        };
        if !group.dir.join("cgroup.kill").exists() {
            return Err("this kernel has no cgroup.kill (Linux 5.14+)".into());
        }
        // Moving a process in can still be refused (delegation, controllers in the parent): try with `true`.
        let probe = group
            .step("probe")
            .map_err(|e| format!("cannot create a step cgroup: {e}"))?;
        let mut command = Command::new("true");
        command
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        configure_worker_in(&mut command, Some(&probe));
        command
            .status()
            .map_err(|e| format!("cannot move a process into {}: {e}", probe.dir.display()))?;
        probe.kill_all();
        Ok(group)
    }

    /// Groups `hvd-run-*` whose launcher is no longer alive: what is left in them escaped a launcher that was
    /// killed together with its watchdog. A launcher holds a shared `flock` on its group's directory for as long as
    /// it runs; a group whose lock can be taken exclusively has none. Unlike the pid in the name, this holds across
    /// pid namespaces sharing one cgroup tree (a pid there may be unknown here, or another process's).
    fn remove_stale(parent: &Path) {
        let Ok(entries) = std::fs::read_dir(parent) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(CGROUP_PREFIX) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            // Held while the group is emptied and removed, so a launcher never adopts it half-removed.
            let Ok(_held) = lock_group(&entry.path(), libc::LOCK_EX | libc::LOCK_NB) else {
                continue;
            };
            tracing::info!(
                "killing what is left in {} (its launcher is gone)",
                entry.path().display()
            );
            kill_and_remove(&entry.path());
        }
    }

    fn open_kill(&self) -> io::Result<OwnedFd> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.kill"))?;
        Ok(OwnedFd::from(file))
    }

    /// A group for one step (`name` is sanitized; several steps may share a name across runs, not within one).
    pub fn step(&self, name: &str) -> io::Result<StepCgroup> {
        let safe: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let n = CGROUPS.fetch_add(1, Ordering::Relaxed);
        let dir = self.dir.join(format!("step-{safe}-{n}"));
        std::fs::create_dir(&dir)?;
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))?;
        Ok(StepCgroup {
            dir,
            procs: OwnedFd::from(procs),
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for RunCgroup {
    fn drop(&mut self) {
        kill_and_remove(&self.dir);
    }
}

impl StepCgroup {
    /// Kills every process still in the step's group (escaped `setsid` daemons, children with a cleared
    /// environment), reaps those the launcher adopted, and removes the group.
    pub fn kill_all(&self) {
        kill_and_remove(&self.dir);
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod stale_group_tests {
    #![allow(clippy::print_stderr)]
    use super::*;

    /// A `sleep` moved into `group`; returns the child to reap.
    fn sleeper_in(group: &Path) -> std::process::Child {
        let child = Command::new("sleep").arg("300").spawn().unwrap();
        write_file(&group.join("cgroup.procs"), &child.id().to_string()).unwrap();
        child
    }

    fn alive(child: &mut std::process::Child) -> bool {
        child.try_wait().unwrap().is_none()
    }

    /// #16 review finding 10: liveness of a group's launcher is its `flock`, not the pid in the group's name,
    /// which means nothing across pid namespaces sharing one cgroup tree: a group named after a pid alive here
    /// (1) but held by nobody is stale; a group named after a pid unknown here but held by a launcher (in another
    /// namespace) is live and keeps running.
    #[test]
    fn stale_groups_by_their_lock_not_by_the_pid_in_their_name() {
        let Ok(parent) = own_cgroup_v2() else {
            eprintln!("no cgroup v2 here; skipping");
            return;
        };
        let unique = format!(
            "{}{}",
            std::process::id(),
            CGROUPS.fetch_add(1, Ordering::Relaxed)
        );
        let orphan = parent.join(format!("{CGROUP_PREFIX}1-{unique}"));
        let other_ns = parent.join(format!("{CGROUP_PREFIX}4194305-{unique}"));
        if std::fs::create_dir(&orphan).is_err() || !orphan.join("cgroup.kill").exists() {
            eprintln!(
                "cannot make cgroups with cgroup.kill under {}; skipping",
                parent.display()
            );
            let _ = std::fs::remove_dir(&orphan);
            return;
        }
        std::fs::create_dir(&other_ns).unwrap();
        let held = lock_group(&other_ns, libc::LOCK_SH).unwrap();
        let mut orphan_sleeper = sleeper_in(&orphan);
        let mut live_sleeper = sleeper_in(&other_ns);

        RunCgroup::remove_stale(&parent);

        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while alive(&mut orphan_sleeper) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let orphan_left = alive(&mut orphan_sleeper) || orphan.exists();
        let live_kept = alive(&mut live_sleeper) && other_ns.exists();
        drop(held);
        kill_and_remove(&other_ns);
        kill_and_remove(&orphan);
        let _ = live_sleeper.wait();
        let _ = orphan_sleeper.kill();
        let _ = orphan_sleeper.wait();
        assert!(
            !orphan_left,
            "a group no launcher holds was kept (its name's pid 1 is alive here)"
        );
        assert!(
            live_kept,
            "a group its launcher holds was killed (its name's pid is unknown here)"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;
    use std::time::Duration;

    /// An empty pipe is not ready; one with bytes is, and so is one whose writer is gone (a read sees the end).
    #[test]
    fn wait_readable_says_ready_only_when_a_read_will_not_block() {
        let (reader, mut writer) = std::io::pipe().unwrap();
        let fd = reader.as_raw_fd();
        assert!(!super::wait_readable(fd, Duration::ZERO));
        writer.write_all(b"x").unwrap();
        assert!(super::wait_readable(fd, Duration::ZERO));
        let (reader, writer) = std::io::pipe().unwrap();
        drop(writer);
        assert!(super::wait_readable(reader.as_raw_fd(), Duration::ZERO));
    }
}
