//! Buffers every rank on this host can map ([`SharedBuffer`]: a file under `/dev/shm` that this process created
//! 0600, named by its pid and a random token), the process-wide registry that tells the single copy whether a
//! buffer lies in one, a peer's checked, cached mapping of another rank's buffer (read and written by the single copy) ([`PeerRegion`]), and
//! the sweep that removes the files of killed processes ([`sweep_stale`]).
//!
//! Trust: the name a rank posts comes from the job's own segment, but the file behind it is only a name in a
//! directory every local user can write. A peer therefore opens it with `O_NOFOLLOW` (a symlink is refused), and
//! maps it only when it is a regular file owned by this user, with no group or other permission bits and at least
//! as large as the range it will reach; anything else is refused and the ranks take the ring. The owner creates
//! it with `O_CREAT | O_EXCL` (a planted file makes the creation fail and another name is drawn), and `/dev/shm`'s
//! sticky bit keeps other users from replacing it afterwards.
//!
//! Leaks: a process killed before it frees its buffers leaves their files behind (tmpfs memory that outlives the
//! job). The owner holds a shared `flock` on each file while it lives (the kernel drops it when the process dies)
//! through the buffer's mapping alone: the descriptor that took the lock is closed once the file is mapped, and
//! Linux drops a `flock` only when the last reference to its open file description goes, which the mapping holds
//! until it is unmapped. So a live buffer costs no descriptor (thousands of buffers stay clear of
//! `RLIMIT_NOFILE`; each is one mapping of `vm.max_map_count`, 65530 by default), nor does a peer's mapping of it.
//! The first allocation of every process sweeps the files named `hvd-buf-<pid>-<token>` whose pid no longer
//! exists (`kill(pid, 0)` is ESRCH) and that nobody holds locked (a live owner in another pid namespace whose pid
//! means nothing here keeps its lock). A file is removed only after it was opened with `O_NOFOLLOW` and found to be
//! a regular file of this user, and the name still leads to that same file: a symlink, another user's file or a
//! name in any other format is left alone.

use std::ffi::CString;
use std::io;
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Where shared buffers live (tmpfs on Linux).
const DIR: &str = "/dev/shm";

/// Names tried before giving up when the drawn ones exist already (someone planted them).
const CREATE_TRIES: usize = 8;

/// A shared buffer's address range in this process and its name (token 0: a private fallback allocation).
struct Registered {
    base: usize,
    len: usize,
    pid: u32,
    token: u64,
}

/// Every live [`SharedBuffer`] of this process.
static REGISTRY: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

/// The file of buffer `token` that process `pid` created.
fn path_of(pid: u32, token: u64) -> CString {
    // Numbers and a fixed prefix: never contains a NUL.
    CString::new(format!("{DIR}/{}", name_of(pid, token))).unwrap_or_default()
}

fn name_of(pid: u32, token: u64) -> String {
    format!("hvd-buf-{pid}-{token:016x}")
}

/// The pid and token of a name in exactly the format [`name_of`] writes (decimal pid without sign or leading zero,
/// 16 lowercase hex digits); `None` for anything else.
fn parse_name(name: &[u8]) -> Option<(u32, u64)> {
    let rest = name.strip_prefix(b"hvd-buf-")?;
    let dash = rest.iter().position(|b| *b == b'-')?;
    let (pid, token) = (&rest[..dash], &rest[dash + 1..]);
    let digits = |s: &[u8]| s.iter().all(u8::is_ascii_digit);
    if pid.is_empty() || pid.len() > 10 || pid[0] == b'0' || !digits(pid) {
        return None;
    }
    let hex = |s: &[u8]| {
        s.iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    if token.len() != 16 || !hex(token) {
        return None;
    }
    let pid: u32 = std::str::from_utf8(pid).ok()?.parse().ok()?;
    let token = u64::from_str_radix(std::str::from_utf8(token).ok()?, 16).ok()?;
    (pid <= i32::MAX as u32 && token != 0).then_some((pid, token))
}

/// Removes the buffer files that processes of this user left behind when they were killed (see the module's note
/// on leaks) and returns how many; an unreadable `/dev/shm` is an error, a file that cannot be checked is skipped.
fn sweep_stale() -> io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(DIR)? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some((pid, _)) = parse_name(name.as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid as libc::pid_t, 0) } != 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone && remove_if_stale(&name) {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Removes `/dev/shm/<name>` when it is a regular file of this user that no process holds locked, checked through
/// a descriptor opened without following a symlink, and the name still leads to that file.
fn remove_if_stale(name: &std::ffi::OsStr) -> bool {
    let Ok(path) = CString::new(format!("{DIR}/{}", name.to_string_lossy())) else {
        return false;
    };
    // SAFETY: path is NUL-terminated; the fd is closed below.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return false;
    }
    // SAFETY: zeroed stats are valid out-parameters; fd is open, path NUL-terminated.
    let stale = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        let mut named: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut st) == 0
            && st.st_mode & libc::S_IFMT == libc::S_IFREG
            && st.st_uid == libc::geteuid()
            && libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) == 0
            && libc::lstat(path.as_ptr(), &mut named) == 0
            && (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)
    };
    // SAFETY: path is NUL-terminated; the name leads to the file checked above, which only this user may remove or
    // replace in the sticky /dev/shm.
    let removed = stale && unsafe { libc::unlink(path.as_ptr()) } == 0;
    // SAFETY: fd is ours (closing it drops the lock).
    unsafe { libc::close(fd) };
    removed
}

/// Sweeps once per process, before its first shared buffer; a failure only means nothing was swept.
fn sweep_once() {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| match sweep_stale() {
        Ok(0) => {}
        Ok(n) => tracing::debug!(
            removed = n,
            "shm: removed shared buffer files of killed processes"
        ),
        Err(e) => {
            tracing::debug!(error = %e, "shm: could not sweep {DIR} for stale shared buffers")
        }
    });
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

fn random_token() -> io::Result<u64> {
    let mut b = [0u8; 8];
    // SAFETY: writes at most 8 bytes into `b`.
    let r = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if r != 8 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::from_ne_bytes(b) | 1)
}

/// The token and offset of `[ptr, ptr + len)` when it lies inside one shared buffer of this process.
pub(crate) fn lookup(ptr: *const u8, len: usize) -> Option<(u64, u64)> {
    let at = ptr as usize;
    let reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    reg.iter()
        .find(|r| {
            r.token != 0
                && at >= r.base
                && at.checked_add(len).is_some_and(|end| end <= r.base + r.len)
        })
        .map(|r| (r.token, (at - r.base) as u64))
}

/// Memory that the other ranks on this host can map and read with plain loads, so that a large allreduce in it
/// copies each byte once (the single copy between processes). Freed (unmapped, its file removed) on drop; a peer
/// that mapped it keeps its own mapping, so a buffer given back mid-operation is never read after it is gone.
pub struct SharedBuffer {
    ptr: *mut u8,
    len: usize,
    map_len: usize,
    pid: u32,
    token: u64,
}

// SAFETY: the buffer is plain memory owned by this value; access goes through `&`/`&mut self`.
unsafe impl Send for SharedBuffer {}
// SAFETY: as above.
unsafe impl Sync for SharedBuffer {}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("len", &self.len)
            .field("shared", &self.is_shared())
            .finish()
    }
}

impl SharedBuffer {
    /// `len` zeroed bytes in a new file under `/dev/shm`, mapped here and registered; an error says why (no
    /// `/dev/shm`, its size limit, mapping refused).
    pub fn new(len: usize) -> Result<SharedBuffer> {
        sweep_once();
        let page = page_size();
        let map_len = len.max(1).div_ceil(page) * page;
        let pid = std::process::id();
        let mut last = io::Error::from(io::ErrorKind::AlreadyExists);
        for _ in 0..CREATE_TRIES {
            let token = random_token().map_err(|e| Error::io("draw a shared buffer's name", e))?;
            let path = path_of(pid, token);
            // SAFETY: path is NUL-terminated; the fd is closed below, once the mapping holds the lock.
            let fd = unsafe {
                libc::open(
                    path.as_ptr(),
                    libc::O_RDWR
                        | libc::O_CREAT
                        | libc::O_EXCL
                        | libc::O_NOFOLLOW
                        | libc::O_CLOEXEC,
                    0o600 as libc::c_uint,
                )
            };
            if fd < 0 {
                last = io::Error::last_os_error();
                if last.kind() == io::ErrorKind::AlreadyExists {
                    continue;
                }
                break;
            }
            // The lock says "alive" to other processes' sweeps until this process frees the buffer or dies. It
            // belongs to the open file description, which the mapping keeps after the descriptor is closed (see the
            // module's note on leaks), so it lasts exactly as long as the mapping.
            // SAFETY: fd is the file just created.
            let made = match unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) } {
                0 => Self::size_and_map(fd, map_len),
                _ => Err(io::Error::last_os_error()),
            };
            // SAFETY: fd is ours; closed once.
            unsafe { libc::close(fd) };
            return match made {
                Ok(ptr) => Ok(SharedBuffer {
                    ptr,
                    len,
                    map_len,
                    pid,
                    token,
                }
                .registered()),
                Err(e) => {
                    // SAFETY: path is NUL-terminated; the file is the one created above.
                    unsafe { libc::unlink(path.as_ptr()) };
                    Err(Error::io(
                        format!("allocate a {len}-byte shared buffer in {DIR}"),
                        e,
                    ))
                }
            };
        }
        Err(Error::io(
            format!("create a shared buffer file in {DIR}"),
            last,
        ))
    }

    /// `len` zeroed bytes of private memory (an anonymous mapping), for a caller that wants memory either way
    /// when [`SharedBuffer::new`] failed: allreduces in it take the ring.
    pub fn private(len: usize) -> Result<SharedBuffer> {
        let map_len = len.max(1).div_ceil(page_size()) * page_size();
        // SAFETY: a fresh anonymous mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("allocate {len} bytes"),
                io::Error::last_os_error(),
            ));
        }
        Ok(SharedBuffer {
            ptr: ptr.cast(),
            len,
            map_len,
            pid: 0,
            token: 0,
        }
        .registered())
    }

    /// This buffer, entered in [`REGISTRY`].
    fn registered(self) -> SharedBuffer {
        REGISTRY
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Registered {
                base: self.ptr as usize,
                len: self.map_len,
                pid: self.pid,
                token: self.token,
            });
        self
    }

    /// Reserves the file's pages (so a full `/dev/shm` fails here, not with SIGBUS on first touch) and maps it.
    fn size_and_map(fd: i32, map_len: usize) -> io::Result<*mut u8> {
        // SAFETY: fd is a file this process just created.
        let r = unsafe { libc::posix_fallocate(fd, 0, map_len as libc::off_t) };
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        // SAFETY: a fresh shared mapping of a file of at least map_len bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(ptr.cast())
    }

    /// Whether the buffer is shared (false: the private fallback of [`SharedBuffer::private`]).
    pub fn is_shared(&self) -> bool {
        self.token != 0
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The file a peer maps (tests use it to act as an attacker replacing it).
    pub fn path(&self) -> Option<std::path::PathBuf> {
        self.is_shared()
            .then(|| std::path::Path::new(DIR).join(name_of(self.pid, self.token)))
    }

    /// Takes the buffer apart without freeing it (a C caller frees it with [`SharedBuffer::free_raw`]).
    pub fn into_raw(self) -> *mut u8 {
        let p = self.ptr;
        std::mem::forget(self);
        p
    }

    /// For a pointer that [`SharedBuffer::into_raw`] returned: whether that buffer is shared (`None`: not one).
    pub fn raw_is_shared(ptr: *const u8) -> Option<bool> {
        let reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
        reg.iter()
            .find(|r| r.base == ptr as usize)
            .map(|r| r.token != 0)
    }

    /// Frees a buffer that [`SharedBuffer::into_raw`] returned; `false` (nothing done) for any other pointer.
    ///
    /// # Safety
    /// No reference into the buffer may be used after this call.
    pub unsafe fn free_raw(ptr: *mut u8) -> bool {
        let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
        let Some(i) = reg.iter().position(|r| r.base == ptr as usize) else {
            return false;
        };
        let r = reg.swap_remove(i);
        drop(reg);
        // SAFETY: the range came from `new` or `private`, and the caller gives it back once.
        unsafe { release(r.base as *mut u8, r.len, r.pid, r.token) };
        true
    }
}

impl std::ops::Deref for SharedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is mapped for map_len >= len bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for SharedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
        reg.retain(|r| r.base != self.ptr as usize);
        drop(reg);
        // SAFETY: ptr/map_len are this value's own mapping, released once.
        unsafe { release(self.ptr, self.map_len, self.pid, self.token) };
    }
}

/// Removes a buffer's file (shared ones) and unmaps it, which drops its lock. The file is removed only by the
/// process that made it: a forked child that drops an inherited buffer leaves the parent's live file alone (the
/// parent's mapping still holds the lock).
unsafe fn release(ptr: *mut u8, map_len: usize, pid: u32, token: u64) {
    if token != 0 && std::process::id() == pid {
        // SAFETY: path is NUL-terminated. Removed before the unmap drops the lock, so that no sweep finds the file
        // unlocked while it still has its name.
        unsafe { libc::unlink(path_of(pid, token).as_ptr()) };
    }
    // SAFETY: the caller's contract: a mapping of map_len bytes, released once.
    unsafe { libc::munmap(ptr.cast(), map_len) };
}

/// A peer's shared buffer as mapped by this rank (read and write: the single copy stores this rank's block of the
/// result into it).
pub(crate) struct PeerRegion {
    pub(crate) pid: u32,
    pub(crate) token: u64,
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

// SAFETY: a mapping owned by this value; what is read and written in it is the single copy's protocol.
unsafe impl Send for PeerRegion {}

impl Drop for PeerRegion {
    fn drop(&mut self) {
        // SAFETY: ptr/len are this value's own mapping.
        unsafe { libc::munmap(self.ptr.cast_mut().cast(), self.len) };
    }
}

impl PeerRegion {
    /// Opens and maps the shared buffer `token` of the peer whose process is `pid`, refusing anything but a regular
    /// file of this user, mode 0600 or stricter, of at least `need` bytes (see the module's trust note).
    pub(crate) fn open(pid: u32, token: u64, need: u64) -> io::Result<PeerRegion> {
        let path = path_of(pid, token);
        // SAFETY: path is NUL-terminated; the fd is closed below.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let r = Self::check_and_map(fd, pid, token, need);
        // SAFETY: fd is ours.
        unsafe { libc::close(fd) };
        r
    }

    fn check_and_map(fd: i32, pid: u32, token: u64, need: u64) -> io::Result<PeerRegion> {
        // SAFETY: a zeroed stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is writable.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let refuse = |why: String| Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return refuse("not a regular file".into());
        }
        if st.st_uid != me {
            return refuse(format!("owned by uid {}, not this user ({me})", st.st_uid));
        }
        if st.st_mode & 0o077 != 0 {
            return refuse(format!("mode {:o} lets other users in", st.st_mode & 0o777));
        }
        let size = st.st_size.max(0) as u64;
        if size < need || size == 0 {
            return refuse(format!("{size} bytes, the peer posted {need}"));
        }
        // SAFETY: a fresh shared mapping of `size` bytes of a checked regular file (populated at once: one call
        // instead of a page fault per page on the first allreduce).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(PeerRegion {
            pid,
            token,
            ptr: ptr.cast(),
            len: size as usize,
        })
    }

    /// Whether the owner still has the buffer (its file exists); mappings of freed buffers are dropped.
    pub(crate) fn owner_alive(&self) -> bool {
        // SAFETY: a zeroed stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: path is NUL-terminated; st is writable.
        unsafe { libc::lstat(path_of(self.pid, self.token).as_ptr(), &mut st) == 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn token_path(pid: u32, token: u64) -> std::path::PathBuf {
        std::path::Path::new(DIR).join(name_of(pid, token))
    }

    #[test]
    fn only_names_in_the_exact_format_are_parsed() {
        assert_eq!(
            parse_name(b"hvd-buf-123-00000000000000ff"),
            Some((123, 0xff))
        );
        assert_eq!(
            parse_name(name_of(7, 0xdead_beef).as_bytes()),
            Some((7, 0xdead_beef))
        );
        for bad in [
            &b"hvd-buf-00000000000000ff"[..],
            b"hvd-buf-0123-00000000000000ff",
            b"hvd-buf-+12-00000000000000ff",
            b"hvd-buf-12-00000000000000FF",
            b"hvd-buf-12-00000000000000ff0",
            b"hvd-buf-12-0000000000000000",
            b"hvd-buf-99999999999-00000000000000ff",
            b"hvd-buf-12-00000000000000ff/x",
            b"hvd-buf--00000000000000ff",
            b"hvd-17786-r2-18ed4a5b97141b48",
        ] {
            assert_eq!(parse_name(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_buffer_is_registered_mapped_by_a_peer_and_gone_when_dropped() {
        let mut b = SharedBuffer::new(10_000).expect("shared buffer");
        b[9_999] = 7;
        let (token, off) = lookup(b.as_ptr().wrapping_add(100), 50).expect("registered");
        assert_eq!(off, 100);
        assert!(lookup(b.as_ptr(), 1 << 30).is_none(), "past its end");
        assert!(
            lookup(b.as_ptr(), usize::MAX).is_none(),
            "a length that overflows"
        );
        let peer = PeerRegion::open(std::process::id(), token, 10_000).expect("map");
        // SAFETY: the mapping is at least 10_000 bytes.
        assert_eq!(unsafe { *peer.ptr.add(9_999) }, 7);
        let path = b.path().expect("path");
        drop(b);
        assert!(!path.exists());
        assert!(!peer.owner_alive());
        // The peer's mapping still reads the last contents.
        // SAFETY: as above; the peer's own mapping keeps the pages.
        assert_eq!(unsafe { *peer.ptr.add(9_999) }, 7);
    }

    #[test]
    fn a_forked_child_dropping_an_inherited_buffer_leaves_the_file() {
        let b = SharedBuffer::new(4096).expect("shared buffer");
        let path = b.path().expect("path");
        // SAFETY: the child only drops the buffer (this test thread is the only one holding the registry) and
        // exits without running destructors or atexit hooks.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork: {}", io::Error::last_os_error());
        if child == 0 {
            drop(b);
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(path.exists(), "the child removed the parent's live file");
        drop(b);
        assert!(!path.exists());
    }

    #[test]
    fn an_attackers_file_is_never_mapped() {
        let token = random_token().expect("token");
        // This live process's pid: other processes' sweeps leave the planted files alone.
        let pid = std::process::id();
        let path = token_path(pid, token);
        // Another user's file.
        std::fs::write(&path, vec![0u8; 8192]).expect("plant");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let c = path_of(pid, token);
        // SAFETY: chown of a file this test created; c is NUL-terminated.
        let chowned = unsafe { libc::chown(c.as_ptr(), 65534, 65534) } == 0;
        if chowned {
            let e = PeerRegion::open(pid, token, 4096).err().expect("refused");
            assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        }
        std::fs::remove_file(&path).expect("remove");
        // A symlink to a file of this user.
        let target = std::env::temp_dir().join(format!("hvd-region-target-{token:x}"));
        std::fs::write(&target, vec![0u8; 8192]).expect("target");
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        symlink(&target, &path).expect("symlink");
        let e = PeerRegion::open(pid, token, 4096).err().expect("refused");
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        std::fs::remove_file(&path).expect("remove");
        std::fs::remove_file(&target).expect("remove");
        // Readable by others, or too small for what the peer posted.
        std::fs::write(&path, vec![0u8; 8192]).expect("plant");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = PeerRegion::open(pid, token, 4096).err().expect("refused");
        assert!(e.to_string().contains("mode 644"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let e = PeerRegion::open(pid, token, 1 << 20)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("8192 bytes"), "{e}");
        assert!(
            PeerRegion::open(pid, token, 8192).is_ok(),
            "this user's file of the right size"
        );
        std::fs::remove_file(&path).expect("remove");
    }

    #[test]
    fn a_buffer_file_is_this_users_regular_file_mode_0600() {
        let b = SharedBuffer::new(64).expect("buffer");
        let p = b.path().expect("path");
        let meta = std::fs::symlink_metadata(&p).expect("stat");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(meta.file_type().is_file());
    }

    #[test]
    fn private_and_raw_buffers_are_freed_once() {
        let p = SharedBuffer::private(100).expect("private");
        assert!(!p.is_shared());
        assert!(lookup(p.as_ptr(), 10).is_none());
        drop(p);
        let raw = SharedBuffer::private(100).expect("private").into_raw();
        // SAFETY: raw came from into_raw and is not used after.
        assert!(unsafe { SharedBuffer::free_raw(raw) });
        let raw = SharedBuffer::new(100).expect("shared").into_raw();
        assert!(lookup(raw, 100).is_some());
        // SAFETY: raw came from into_raw and is not used after.
        assert!(unsafe { SharedBuffer::free_raw(raw) });
        assert!(lookup(raw, 100).is_none());
        // SAFETY: an unknown pointer is refused without touching it.
        assert!(!unsafe { SharedBuffer::free_raw(raw) });
    }
}
