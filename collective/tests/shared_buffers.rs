//! The single copy between rank processes whose buffers lie in shared buffers (`shm::SharedBuffer`): 2 and 3
//! processes (this test binary re-run as workers, joined through the launcher's real rendezvous server) read one
//! another's buffers with plain loads and sum exactly at sizes around the segment boundaries; a rank whose buffer is
//! not shared, or whose shared buffer a peer refuses to map (replaced by another user's file), takes everyone to the
//! ring (the arenas from 3 ranks), with exact sums still. A rank process killed while it holds a shared buffer leaves the file, which the next
//! process's first allocation removes, leaving alone what is not such a leftover (a file of a live process, one
//! still locked, another user's file, a symlink). Buffers hold no descriptor: a process holds hundreds under a
//! descriptor limit of 64, and the sweep still leaves the file of a live owner alone (held by its mapping's lock).

use std::process::{Child, Command, Stdio};

use hvd_collective::shm::SharedBuffer;
use hvd_collective::{Communicator, DType, Error, ReduceOp, bootstrap};
use hvd_launcher::rendezvous::RendezvousServer;

mod log_capture;
mod workers;

const WORKER: &str = "HVD_SHARED_BUFFERS_TEST_WORKER";
const SHARED: &str = "large allreduces read peers' shared buffers";
const REFUSED: &str = "could not map a peer's shared buffer";

/// f32 counts: just past the single copy's 4 KiB of 3 or more ranks, just past its 32 KiB of 2, just past 1 MiB,
/// 2 MiB plus 3, odd over 4 MiB (uneven blocks).
const COUNTS: [usize; 5] = [
    (1 << 10) + 3,
    (1 << 13) + 5,
    (1 << 18) + 1,
    (1 << 19) + 3,
    (1 << 20) + 7,
];

/// Bytes before the allreduce's range inside its shared buffer (the offset every rank posts).
const OFFSET: usize = 12;

#[test]
fn worker() {
    workers::serve(WORKER, |scenario| {
        log_capture::install();
        run_worker(scenario)
    });
}

/// Fills `buf` with this rank's values and checks the sum after the allreduce; an error line names the first
/// wrong element.
fn allreduce_checked(
    comm: &mut dyn Communicator,
    buf: &mut [u8],
    what: &str,
) -> Result<Option<String>, Error> {
    let (rank, size) = (comm.rank(), comm.size());
    for (i, c) in buf.chunks_exact_mut(4).enumerate() {
        c.copy_from_slice(&((i % 1000) as f32 + rank as f32).to_ne_bytes());
    }
    comm.allreduce_in_place(buf, DType::F32, ReduceOp::Sum)?;
    for (i, c) in buf.chunks_exact(4).enumerate() {
        let want = (size * (i % 1000)) as f32 + (size * (size - 1) / 2) as f32;
        let got = f32::from_ne_bytes(c.try_into().unwrap_or_default());
        if got != want {
            return Ok(Some(format!(
                "{what}: element {i} is {got}, expected {want}"
            )));
        }
    }
    Ok(None)
}

fn run_worker(scenario: &str) -> Result<String, Error> {
    match scenario {
        // A rank that is killed while it holds a shared buffer (it says where the file is, then waits).
        "hold" => {
            let sb = SharedBuffer::new(4096)?;
            // On a line of its own: the test harness has printed "test worker ... " without a newline.
            println!("\nPATH {}", sb.path().expect("shared").display());
            std::thread::sleep(std::time::Duration::from_secs(60));
            return Ok("not killed".into());
        }
        // Many buffers under a descriptor limit below their number; then one of them is renamed as if its owner
        // were the dead process `<pid>` (a live owner whose pid means nothing to the sweeper), and it waits.
        _ if scenario.starts_with("many ") => return many_buffers(&scenario[5..]),
        // The next process: its first allocation sweeps.
        "allocate" => {
            let sb = SharedBuffer::new(4096)?;
            return Ok(format!("allocated, shared: {}", sb.is_shared()));
        }
        "die" => return die(),
        "stall" => return stall(),
        _ => {}
    }
    let mut comm = bootstrap::from_env()?;
    let rank = comm.rank();
    for count in COUNTS {
        let bytes = count * 4;
        // A new shared buffer each size: peers map it on first use and drop their mapping of the freed one.
        let shared = !(scenario == "mixed" && rank == 1);
        let mut sb = match shared {
            true => SharedBuffer::new(OFFSET + bytes)?,
            false => SharedBuffer::private(OFFSET + bytes)?,
        };
        if scenario == "planted" && rank == 1 {
            plant_another_users_file(&sb);
        }
        for round in 0..2 {
            let what = format!("{count} floats, round {round}");
            if let Some(bad) =
                allreduce_checked(comm.as_mut(), &mut sb[OFFSET..OFFSET + bytes], &what)?
            {
                return Ok(bad);
            }
        }
        // An ordinary buffer in between (everyone takes the ring or the default path), same step counters.
        let mut plain = vec![0u8; bytes];
        if let Some(bad) = allreduce_checked(comm.as_mut(), &mut plain, "plain")? {
            return Ok(bad);
        }
    }
    let path = match log_capture::logged(SHARED) {
        true => "shared buffers",
        false => "ring",
    };
    let refused = match log_capture::logged(REFUSED) {
        true => ", a peer's refused",
        false => "",
    };
    Ok(format!("exact via {path}{refused}"))
}

/// Sends this process `signal` from another thread `ms` milliseconds from now, while its main thread runs
/// allreduces.
fn signal_self_after(ms: u64, signal: libc::c_int) {
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        // SAFETY: a process signalling itself (SIGKILL: nothing to clean up; SIGSTOP: the test continues it).
        unsafe { libc::kill(libc::getpid(), signal) };
    });
}

/// Three ranks run 16 MiB allreduces in shared buffers (the one pass: each stores into the others' mappings) until
/// one fails; rank 2 kills itself from another thread meanwhile. The others must name it lost and return: a rank
/// that gives up waits for the peers that may still store into its buffer, and a dead one has stopped.
fn die() -> Result<String, Error> {
    let mut comm = bootstrap::from_env()?;
    let rank = comm.rank();
    let mut sb = SharedBuffer::new(16 << 20)?;
    comm.allreduce_in_place(&mut sb[..], DType::F32, ReduceOp::Sum)?;
    if rank == 2 {
        signal_self_after(30, libc::SIGKILL);
    }
    for _ in 0..100_000 {
        match comm.allreduce_in_place(&mut sb[..], DType::F32, ReduceOp::Sum) {
            Ok(()) => {}
            Err(Error::PeerLost { rank, .. }) => {
                let shared = log_capture::logged(SHARED);
                return Ok(format!("lost rank {rank}, shared buffers: {shared}"));
            }
            Err(e) => return Ok(format!("unexpected {e}")),
        }
    }
    Ok("never noticed".into())
}

/// Bytes of each allreduce of the `stall` scenario (a one pass of tens of milliseconds: a freeze lands in it).
const STALL_BYTES: usize = 256 << 20;

/// Two ranks run allreduces in shared buffers until one fails; rank 1 stops itself (SIGSTOP, from another thread)
/// while they run, and the test continues it once rank 0's collective timeout has passed. Rank 0 then fills its
/// buffer with a pattern and checks, a while later, that nobody wrote into it after its allreduce returned.
fn stall() -> Result<String, Error> {
    let mut comm = bootstrap::from_env()?;
    let rank = comm.rank();
    let mut sb = SharedBuffer::new(STALL_BYTES)?;
    comm.allreduce_in_place(&mut sb[..], DType::F32, ReduceOp::Sum)?;
    if rank == 1 {
        signal_self_after(25, libc::SIGSTOP);
    }
    for _ in 0..100_000 {
        if let Err(e) = comm.allreduce_in_place(&mut sb[..], DType::F32, ReduceOp::Sum) {
            if rank != 0 {
                return Ok("failed".into());
            }
            sb.fill(0x5a);
            std::thread::sleep(std::time::Duration::from_secs(2));
            let written = sb.iter().filter(|b| **b != 0x5a).count();
            let shared = log_capture::logged(SHARED);
            return Ok(match (written, &e) {
                (0, Error::Timeout { .. }) => {
                    format!("timed out, untouched after, shared buffers: {shared}")
                }
                (0, e) => format!("untouched after {e}"),
                (n, _) => format!("{n} bytes written after the allreduce returned"),
            });
        }
    }
    Ok("never failed".into())
}

/// Buffers held at once by the `many` worker, and the descriptor limit it sets first (far below: a buffer that
/// kept a descriptor fails with EMFILE at about the limit's count).
const MANY: usize = 300;
const NOFILE: u64 = 64;

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

fn many_buffers(dead_pid: &str) -> Result<String, Error> {
    let limit = libc::rlimit {
        rlim_cur: NOFILE,
        rlim_max: NOFILE,
    };
    // SAFETY: setrlimit with a valid struct; lowers this worker process's own limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Ok(format!("setrlimit: {}", std::io::Error::last_os_error()));
    }
    let before = open_descriptors();
    let mut held = Vec::with_capacity(MANY);
    for i in 0..MANY {
        let mut sb = SharedBuffer::new(4096)?;
        if !sb.is_shared() {
            return Ok(format!("buffer {i} is not shared"));
        }
        sb[4095] = i as u8;
        held.push(sb);
    }
    if let Some(i) = (0..MANY).find(|i| held[*i][4095] != *i as u8) {
        return Ok(format!("buffer {i} lost its contents"));
    }
    let added = open_descriptors().saturating_sub(before);
    let path = held[0].path().expect("shared");
    let name = path
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let token = name.rsplit('-').next().expect("token");
    let renamed = path.with_file_name(format!("hvd-buf-{dead_pid}-{token}"));
    if let Err(e) = std::fs::rename(&path, &renamed) {
        return Ok(format!("rename {}: {e}", path.display()));
    }
    // On lines of their own: the test harness has printed "test worker ... " without a newline.
    println!("\nFDS {added}\nPATH {}", renamed.display());
    std::thread::sleep(std::time::Duration::from_secs(60));
    Ok("not killed".into())
}

/// Acts as another local user: replaces this rank's shared buffer file with one of the same size owned by uid
/// 65534 (this rank's own mapping stays), so the peer finds a file it must not trust under the posted name.
fn plant_another_users_file(sb: &SharedBuffer) {
    use std::os::unix::fs::PermissionsExt;
    let path = sb.path().expect("a shared buffer has a file");
    std::fs::remove_file(&path).expect("remove own file");
    std::fs::write(&path, vec![0u8; sb.len()]).expect("plant");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: chown of the file just written.
    let r = unsafe { libc::chown(c.as_ptr(), 65534, 65534) };
    if r != 0 {
        // Not root: make it a symlink instead, which the peer must refuse just the same.
        std::fs::remove_file(&path).expect("remove");
        std::os::unix::fs::symlink("/proc/self/mem", &path).expect("symlink");
    }
}

/// Runs `n` workers on one host (shm) and returns each one's RESULT line.
fn run_job(n: usize, scenario: &str) -> Vec<String> {
    run_job_with(n, scenario, "10")
}

/// [`run_job`] with `HVD_COLLECTIVE_TIMEOUT` set to `timeout` seconds.
fn run_job_with(n: usize, scenario: &str, timeout: &str) -> Vec<String> {
    let (_server, children) = start_job(n, scenario, timeout);
    workers::results(children)
}

/// Starts `n` workers on one host (shm) with `HVD_COLLECTIVE_TIMEOUT` `timeout`: the rendezvous server (keep it
/// until they are done) and the workers.
fn start_job(n: usize, scenario: &str, timeout: &str) -> (RendezvousServer, Vec<Child>) {
    let token = "0123456789abcdef".to_string();
    let srv = RendezvousServer::start_on_loopback(&token).expect("start the rendezvous server");
    let exe = std::env::current_exe().expect("test binary path");
    let children: Vec<Child> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
                .env(WORKER, scenario)
                .env("HVD_RANK", r.to_string())
                .env("HVD_SIZE", n.to_string())
                .env("HVD_HOSTNAME", "h")
                .env("HVD_COLLECTIVE_TIMEOUT", timeout)
                .env("HVD_RENDEZVOUS", srv.addr().to_string())
                .env("HVD_JOB_TOKEN", &token)
                .env_remove("HVD_COLLECTIVE_BACKEND")
                .env_remove("HVD_SHM_CMA")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a worker")
        })
        .collect();
    (srv, children)
}

#[test]
fn two_processes_read_each_others_shared_buffers() {
    assert_eq!(run_job(2, "ok"), ["exact via shared buffers"; 2]);
}

#[test]
fn three_processes_read_each_others_shared_buffers() {
    assert_eq!(run_job(3, "ok"), ["exact via shared buffers"; 3]);
}

#[test]
fn a_rank_without_a_shared_buffer_takes_everyone_to_the_ring() {
    assert_eq!(run_job(2, "mixed"), ["exact via ring"; 2]);
}

#[test]
fn among_three_ranks_one_without_a_shared_buffer_takes_everyone_to_the_arenas() {
    // Rank 1 posts no shared buffer and goes on to the arenas without waiting; ranks 0 and 2 learn it from the
    // posts. (The result line says "ring" for any path but the shared buffers'.)
    assert_eq!(run_job(3, "mixed"), ["exact via ring"; 3]);
}

/// A rank that gives up on a peer stalled in its one pass (stopped, then continued after the giving-up rank's
/// timeout) returns only once that peer has stopped storing into its shared buffer: the buffer its caller then
/// reuses is not written any more (before, it returned at once, and the continued peer finished its pass into it).
#[test]
fn a_rank_that_gives_up_is_not_written_after_it_returns() {
    let (_server, children) = start_job(2, "stall", "4");
    // Rank 1 stops itself; continue it after rank 0's 4 s timeout, while rank 0 waits for it to stop storing.
    let pid = children[1].id();
    let stopped = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
            .unwrap_or(false)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !stopped() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(stopped(), "rank 1 never stopped itself");
    std::thread::sleep(std::time::Duration::from_secs(5));
    // SAFETY: signalling a child this test started.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
    let out = workers::results(children);
    assert_eq!(
        out[0], "timed out, untouched after, shared buffers: true",
        "rank 0"
    );
    assert_eq!(out[1], "failed", "rank 1");
}

/// A rank killed while the one pass stores into shared buffers: the others name it lost and return (with the
/// collective timeout an hour, a rank waiting for the dead one to stop storing would outlast the 60 s the workers are
/// given, and show as hung).
#[test]
fn a_rank_killed_mid_one_pass_is_named_and_the_others_return() {
    let out = run_job_with(3, "die", "3600");
    assert_eq!(out[0], "lost rank 2, shared buffers: true", "rank 0");
    assert_eq!(out[1], "lost rank 2, shared buffers: true", "rank 1");
    assert_eq!(out[2], "no result (killed?)", "rank 2");
}

#[test]
fn a_file_replaced_by_another_user_is_refused_and_everyone_takes_the_ring() {
    let out = run_job(2, "planted");
    // Rank 0 could not map rank 1's (planted) file and says so; rank 1 mapped rank 0's, but both took the ring
    // for the planted sizes. Later sizes (new, untouched buffers) are planted too, so no size read shared memory.
    assert_eq!(out, ["exact via ring, a peer's refused", "exact via ring"]);
}

/// This test binary re-run as a worker of `scenario` that needs no job.
fn solo(scenario: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test binary path"));
    c.args(["--exact", "worker", "--nocapture", "--test-threads=1"])
        .env(WORKER, scenario)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    c
}

fn allocate_in_a_new_process() {
    let child = solo("allocate").spawn().expect("start a worker");
    assert_eq!(workers::results(vec![child]), ["allocated, shared: true"]);
}

#[test]
fn a_killed_processs_buffer_file_is_removed_by_the_next_allocation_and_nothing_else() {
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{PermissionsExt, symlink};

    let mut holder = solo("hold").spawn().expect("start the holder");
    let out = std::io::BufReader::new(holder.stdout.take().expect("stdout"));
    let path = out
        .lines()
        .find_map(|l| l.ok()?.strip_prefix("PATH ").map(std::path::PathBuf::from))
        .expect("the holder's buffer file");
    // Held locked by this test until it looks (a sweep of another test's process leaves a locked file alone).
    let lock = std::fs::File::open(&path).expect("open the holder's file");
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_SH) }, 0);
    holder.kill().expect("SIGKILL the holder");
    holder.wait().expect("reap the holder");
    assert!(path.exists(), "a killed process leaves its file behind");

    // What a sweep must leave alone, named like buffers: a live process's file (this test's), another user's file
    // and a symlink to a file of this user, both under the dead holder's pid.
    let dead = holder.id();
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as u64
        | 1;
    let named = |pid: u32, k: u64| {
        std::path::PathBuf::from(format!("/dev/shm/hvd-buf-{pid}-{:016x}", stamp ^ (k << 60)))
    };
    let (live, theirs, link) = (named(std::process::id(), 1), named(dead, 2), named(dead, 3));
    let target = std::env::temp_dir().join(format!("hvd-sweep-target-{stamp:x}"));
    let _cleanup = Removed(vec![
        path.clone(),
        live.clone(),
        theirs.clone(),
        link.clone(),
        target.clone(),
    ]);
    std::fs::write(&live, [0u8; 64]).expect("plant a live process's file");
    std::fs::write(&theirs, [0u8; 64]).expect("plant");
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let c = std::ffi::CString::new(theirs.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: chown of the file just written.
    let another_user = unsafe { libc::chown(c.as_ptr(), 65534, 65534) } == 0;
    if !another_user {
        eprintln!("not root: no file of another user planted");
        std::fs::remove_file(&theirs).expect("remove");
    }
    std::fs::write(&target, [0u8; 64]).expect("target");
    symlink(&target, &link).expect("plant a symlink");

    // The holder's pid is gone but its file is locked (as a live owner in another pid namespace holds it): kept.
    allocate_in_a_new_process();
    assert!(path.exists(), "a locked file was removed");
    drop(lock);
    allocate_in_a_new_process();
    assert!(!path.exists(), "the killed process's file is still there");

    assert!(live.exists(), "a live process's file was removed");
    assert_eq!(
        another_user,
        theirs.exists(),
        "another user's file was removed"
    );
    let meta = std::fs::symlink_metadata(&link).expect("the symlink is still there");
    assert!(meta.file_type().is_symlink());
    assert!(target.exists(), "the symlink was followed");
}

/// Whether no process has `pid` (`kill(pid, 0)` is ESRCH).
fn pid_is_free(pid: u32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks whether the pid exists.
    let sent = unsafe { libc::kill(pid as libc::pid_t, 0) };
    sent == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// A pid no process has, from the top of the pid range (`kernel.pid_max`), which new processes reach last.
fn unused_pid() -> u32 {
    let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(32768);
    (2..max)
        .rev()
        .find(|&pid| pid_is_free(pid))
        .expect("a free pid")
}

#[test]
fn many_buffers_hold_no_descriptors_and_a_live_owners_file_is_never_swept() {
    use std::io::BufRead;

    // A pid no process has: with a finished worker's, a new process could take it (pid reuse), and the sweep would
    // then keep the file for that process instead of for its owner's lock.
    let dead = unused_pid();

    let mut owner = solo(&format!("many {dead}"))
        .spawn()
        .expect("start the owner");
    let owner_pid = owner.id();
    let out = std::io::BufReader::new(owner.stdout.take().expect("stdout"));
    let mut fds = None;
    let mut path = None;
    let mut seen = Vec::new();
    for line in out.lines().map_while(|l| l.ok()) {
        if let Some(n) = line.strip_prefix("FDS ") {
            fds = n.parse::<usize>().ok();
        } else if let Some(p) = line.strip_prefix("PATH ") {
            path = Some(std::path::PathBuf::from(p));
            break;
        }
        seen.push(line);
    }
    let Some(path) = path else {
        let _ = owner.kill();
        let _ = owner.wait();
        panic!("the owner did not hold {MANY} buffers under RLIMIT_NOFILE {NOFILE}: {seen:?}");
    };
    let _cleanup = Removed(vec![path.clone()]);
    // A few for the allocator's own work at most (the sweep's directory handle is closed again), not one each.
    assert!(
        fds.is_some_and(|n| n < 8),
        "{fds:?} descriptors held for {MANY} buffers"
    );

    // The renamed file's pid is gone, but its live owner's mapping holds the lock: another process's sweep
    // leaves it.
    allocate_in_a_new_process();
    assert!(path.exists(), "a live owner's file was removed");
    assert!(
        pid_is_free(dead),
        "pid {dead} was taken during the test: the sweep's decision proves nothing"
    );
    owner.kill().expect("SIGKILL the owner");
    owner.wait().expect("reap the owner");
    allocate_in_a_new_process();
    assert!(!path.exists(), "the killed owner's file is still there");
    let prefix = format!("hvd-buf-{owner_pid}-");
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .expect("list /dev/shm")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .collect();
    assert!(
        left.is_empty(),
        "{} files of the killed owner left",
        left.len()
    );
}

/// Files a test planted, removed when it ends (also when it fails).
struct Removed(Vec<std::path::PathBuf>);

impl Drop for Removed {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}
