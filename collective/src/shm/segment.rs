//! The shared memory segment: its layout (control block, board, arenas, rings), creating, opening and mapping
//! it, the words in it, and the futex that sleeping ranks wait on.
//!
//! Layout: a control block (header, abort word, one cache line per rank), the board (one slot per rank and
//! sequence-number parity), the deposits (one per rank and parity, beside the board's slots), the arenas (two
//! halves per rank), then one single-producer single-consumer ring per ordered pair of ranks.

use std::ffi::CString;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::header::{EAGER_MAX_BYTES, HEADER_LEN};

const MAGIC: u64 = 0x6876_645f_7368_6d33; // "hvd_shm3" (3: the deposits)
/// Every version's magic but its last byte: a segment with it and another last byte is another hvd's layout.
const MAGIC_FAMILY: u64 = MAGIC & !0xff;
pub(super) const LINE: usize = 128;
pub(super) const CTRL_HEADER: usize = 4 * LINE;
pub(super) const RING_HEADER: usize = 2 * LINE;

pub(super) const STATE_ATTACHED: u32 = 1;
pub(super) const STATE_GONE: u32 = 2;
pub(super) const STATE_ABORTED: u32 = 3;

/// One mapping of a segment, unmapped when the last [`ShmSegment`] clone goes.
pub(super) struct Mapping {
    pub(super) ptr: *mut u8,
    len: usize,
    /// Backing file to remove when the last mapping of the creating rank goes (named segments only).
    unlink: Option<CString>,
}

// SAFETY: the mapping is plain shared memory; all cross-thread access goes through atomics or through ring regions
// whose ownership the atomics hand over (single producer, single consumer).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap and are unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
        if let Some(path) = &self.unlink {
            // SAFETY: path is a valid NUL-terminated string.
            unsafe { libc::shm_unlink(path.as_ptr()) };
        }
    }
}

/// A shared memory segment holding the rings of `ranks` ranks.
#[derive(Clone)]
pub struct ShmSegment {
    pub(super) map: Arc<Mapping>,
    pub(super) ranks: usize,
    pub(super) ring_bytes: usize,
    /// A memfd segment ([`ShmSegment::create_anonymous`]): every rank on it is a thread of this process, the only
    /// case in which a rank may dereference an address another rank posted (the single copy's plain loads). On a
    /// named segment a posted pid proves nothing (another pid namespace may share `/dev/shm`).
    pub(super) private: bool,
}

impl std::fmt::Debug for ShmSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmSegment")
            .field("ranks", &self.ranks)
            .field("ring_bytes", &self.ring_bytes)
            .finish()
    }
}

/// The segment's length for `ranks` ranks and rings of `ring_bytes`: the layout below, summed without overflow;
/// `None` when it does not fit an address space (the sizes come from the environment, or from a segment file another
/// process wrote). Every offset inside a segment whose length this gave is smaller, so those are computed plainly.
fn segment_len(ranks: usize, ring_bytes: usize) -> Option<usize> {
    let control = ranks.checked_mul(LINE)?.checked_add(CTRL_HEADER)?;
    let slot = ranks
        .checked_mul(8)?
        .checked_add(PAIRS_AT)?
        .checked_next_multiple_of(LINE)?;
    let per_rank = slot
        .checked_add(DEPOSIT_BYTES)?
        .checked_add(arena_half(ring_bytes))?
        .checked_mul(2)?;
    let rings = ranks
        .checked_mul(ranks)?
        .checked_mul(RING_HEADER.checked_add(ring_bytes)?)?;
    control
        .checked_add(ranks.checked_mul(per_rank)?)?
        .checked_add(rings)
        .filter(|len| *len <= isize::MAX as usize)
}

/// The error for a segment [`segment_len`] finds too large.
fn too_large(ranks: usize, ring_bytes: usize) -> Error {
    Error::Bootstrap(format!(
        "a shared memory segment for {ranks} ranks with rings of {ring_bytes} bytes is larger than this machine can \
         address: lower {}",
        crate::env_vars::HVD_SHM_RING_BYTES
    ))
}

/// Each rank's deposit for operations of one sequence-number parity: the most bytes of an allreduce a rank posts
/// on the board with its header (`Board::deposit`).
pub(super) const DEPOSIT_BYTES: usize = 32 << 10;

fn deposit_base(ranks: usize) -> usize {
    board_base(ranks) + ranks * 2 * slot_bytes(ranks)
}

fn arena_base(ranks: usize) -> usize {
    deposit_base(ranks) + ranks * 2 * DEPOSIT_BYTES
}

/// Each rank's arena has two halves (used by alternate chunks) of a ring each.
pub(super) fn arena_half(ring_bytes: usize) -> usize {
    ring_bytes
}

/// Where a slot's words for each rank start (8-aligned: both terms are multiples of 8).
pub(super) const PAIRS_AT: usize = HEADER_LEN + EAGER_MAX_BYTES;

fn board_base(ranks: usize) -> usize {
    CTRL_HEADER + ranks * LINE
}

/// One board slot: an operation header (its sequence number first), eager data, then one `pair` word per rank
/// (alltoall counts); whole lines. A small allreduce's header and data share the first line with the sequence
/// number, so a reader's one miss brings everything.
fn slot_bytes(ranks: usize) -> usize {
    (PAIRS_AT + 8 * ranks).div_ceil(LINE) * LINE
}

fn map_fd(fd: i32, len: usize, what: &str) -> Result<*mut u8> {
    // SAFETY: a fresh shared mapping of an fd we own; the kernel checks the length against the file.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::io(
            format!("map shared memory segment {what}"),
            io::Error::last_os_error(),
        ));
    }
    Ok(ptr.cast())
}

impl ShmSegment {
    /// A segment for ranks that are threads of this process (a memfd, never visible in the file system).
    pub fn create_anonymous(ranks: usize, ring_bytes: usize) -> Result<ShmSegment> {
        let len = segment_len(ranks, ring_bytes).ok_or_else(|| too_large(ranks, ring_bytes))?;
        let name = c"hvd-shm";
        // SAFETY: name is NUL-terminated; the returned fd is closed below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io("create a memfd", io::Error::last_os_error()));
        }
        let r = Self::init_fd(fd, len, ranks, ring_bytes, "(memfd)", None);
        // SAFETY: fd is ours; the mapping keeps the memory alive.
        unsafe { libc::close(fd) };
        r.map(|seg| ShmSegment {
            private: true,
            ..seg
        })
    }

    /// Creates the named segment `/dev/shm/<name>` for `ranks` processes; the others [`open`](Self::open) it.
    /// The file is removed when this segment is dropped, or earlier with [`unlink`](Self::unlink).
    pub fn create(name: &str, ranks: usize, ring_bytes: usize) -> Result<ShmSegment> {
        let path = shm_path(name)?;
        let len = segment_len(ranks, ring_bytes).ok_or_else(|| too_large(ranks, ring_bytes))?;
        // SAFETY: path is NUL-terminated; the fd is closed below.
        let fd = unsafe {
            libc::shm_open(
                path.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(Error::io(
                format!("create shared memory `/dev/shm/{name}`"),
                io::Error::last_os_error(),
            ));
        }
        let r = Self::init_fd(fd, len, ranks, ring_bytes, name, Some(path));
        // SAFETY: fd is ours.
        unsafe { libc::close(fd) };
        r
    }

    fn init_fd(
        fd: i32,
        len: usize,
        ranks: usize,
        ring_bytes: usize,
        what: &str,
        unlink: Option<CString>,
    ) -> Result<Self> {
        // SAFETY: fd is a valid descriptor of a shared memory file.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(Error::io(
                format!("size shared memory segment {what} to {len} bytes"),
                io::Error::last_os_error(),
            ));
        }
        let ptr = map_fd(fd, len, what)?;
        let seg = ShmSegment {
            map: Arc::new(Mapping { ptr, len, unlink }),
            ranks,
            ring_bytes,
            private: false,
        };
        seg.word(8).store(ranks as u64, Ordering::Relaxed);
        seg.word(16).store(ring_bytes as u64, Ordering::Relaxed);
        seg.word(0).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Opens a named segment another rank created, waiting up to `timeout` for it to appear.
    pub fn open(name: &str, timeout: Duration) -> Result<ShmSegment> {
        let path = shm_path(name)?;
        let deadline = crate::time::saturating_add(Instant::now(), timeout);
        loop {
            // SAFETY: path is NUL-terminated; the fd is closed below.
            let fd = unsafe { libc::shm_open(path.as_ptr(), libc::O_RDWR, 0) };
            if fd >= 0 {
                let r = Self::open_fd(fd, name);
                // SAFETY: fd is ours.
                unsafe { libc::close(fd) };
                match r {
                    Ok(Some(seg)) => return Ok(seg),
                    Ok(None) => {}
                    Err(e) => return Err(e),
                }
            }
            if Instant::now() > deadline {
                return Err(Error::Bootstrap(format!(
                    "shared memory segment `/dev/shm/{name}` did not appear within {timeout:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn open_fd(fd: i32, name: &str) -> Result<Option<ShmSegment>> {
        // SAFETY: `st` is written by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is valid, st is a valid out pointer.
        if unsafe { libc::fstat(fd, &mut st) } != 0 || (st.st_size as usize) < CTRL_HEADER {
            return Ok(None);
        }
        let len = st.st_size as usize;
        let ptr = map_fd(fd, len, name)?;
        let probe = ShmSegment {
            map: Arc::new(Mapping {
                ptr,
                len,
                unlink: None,
            }),
            ranks: 0,
            ring_bytes: 0,
            private: false,
        };
        let magic = probe.word(0).load(Ordering::Acquire);
        if magic != MAGIC {
            if magic & !0xff == MAGIC_FAMILY {
                // Not a segment still being written (its magic comes last): another hvd's layout, which this one
                // must not read (a rank of an older hvd would otherwise wait for one that never appears).
                return Err(Error::Bootstrap(format!(
                    "shared memory segment `/dev/shm/{name}` has layout version {} and this hvd reads version {}: \
                     the ranks on this host run different hvd versions; run the same one on every rank",
                    layout_version(magic),
                    layout_version(MAGIC),
                )));
            }
            return Ok(None);
        }
        let ranks = probe.word(8).load(Ordering::Relaxed) as usize;
        let ring_bytes = probe.word(16).load(Ordering::Relaxed) as usize;
        // The words are another process's: checked arithmetic, so no count makes the size wrap around to this one.
        if segment_len(ranks, ring_bytes) != Some(len) {
            return Err(Error::Bootstrap(format!(
                "shared memory segment `{name}` has an unexpected size"
            )));
        }
        Ok(Some(ShmSegment {
            map: probe.map,
            ranks,
            ring_bytes,
            private: false,
        }))
    }

    /// Removes a named segment's file (mappings stay valid). Safe to call more than once.
    pub fn unlink(name: &str) {
        if let Ok(path) = shm_path(name) {
            // SAFETY: path is NUL-terminated.
            unsafe { libc::shm_unlink(path.as_ptr()) };
        }
    }

    /// Number of ranks the segment was made for.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    #[inline]
    pub(super) fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= self.map.len && offset.is_multiple_of(8));
        // SAFETY: offset is 8-aligned inside the mapping (page aligned base), which lives as long as `self`.
        unsafe { &*(self.map.ptr.add(offset) as *const AtomicU64) }
    }

    #[inline]
    pub(super) fn word32(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset + 4 <= self.map.len && offset.is_multiple_of(4));
        // SAFETY: offset is 4-aligned inside the mapping, which lives as long as `self`.
        unsafe { &*(self.map.ptr.add(offset) as *const AtomicU32) }
    }

    #[inline]
    pub(super) fn abort_word(&self) -> &AtomicU64 {
        self.word(LINE)
    }
    #[inline]
    pub(super) fn attached(&self) -> &AtomicU64 {
        self.word(2 * LINE)
    }
    #[inline]
    pub(super) fn rank_line(&self, r: usize) -> usize {
        CTRL_HEADER + r * LINE
    }
    #[inline]
    pub(super) fn pid(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r))
    }
    #[inline]
    pub(super) fn state(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r) + 4)
    }
    /// The CPUs rank `r` may run on, published when it attaches: bit `c` for CPU `c` below 64, every bit when it
    /// may also run on a CPU from 64 up or its set could not be read (`ShmTransport::wait_attached`).
    #[inline]
    pub(super) fn cpus(&self, r: usize) -> &AtomicU64 {
        self.word(self.rank_line(r) + 72)
    }
    #[inline]
    pub(super) fn sleeping(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r) + 64)
    }
    #[inline]
    pub(super) fn ring_base(&self, from: usize, to: usize) -> usize {
        arena_base(self.ranks)
            + self.ranks * 2 * arena_half(self.ring_bytes)
            + (from * self.ranks + to) * (RING_HEADER + self.ring_bytes)
    }
    /// Rank `r`'s arena half for chunk number `chunk` (alternating halves).
    #[inline]
    pub(super) fn arena(&self, r: usize, chunk: u64) -> *mut u8 {
        let half = arena_half(self.ring_bytes);
        // SAFETY: the arena lies inside the mapping.
        unsafe {
            self.map
                .ptr
                .add(arena_base(self.ranks) + (r * 2 + (chunk & 1) as usize) * half)
        }
    }
    /// How far rank `r` has come through arena steps (two per chunk: deposited, reduced).
    #[inline]
    pub(super) fn arena_progress(&self, r: usize) -> &AtomicU64 {
        self.word(self.rank_line(r) + 8)
    }
    /// Where rank `r`'s buffer of the current single-copy allreduce starts in its address space (`single_copy`).
    #[inline]
    pub(super) fn copy_addr(&self, r: usize) -> &AtomicU64 {
        self.word(self.rank_line(r) + 16)
    }
    /// The length of that buffer.
    #[inline]
    pub(super) fn copy_len(&self, r: usize) -> &AtomicU64 {
        self.word(self.rank_line(r) + 24)
    }
    /// Rank `r`'s vote on reading peers' memory with `process_vm_readv` (`single_copy::Vote`).
    #[inline]
    pub(super) fn copy_vote(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r) + 32)
    }
    /// Rank `r`'s outcome of probing its peers' memory (`single_copy::Vote`; a word of its own, as a rank may
    /// publish its outcome while a slower peer still reads its vote).
    #[inline]
    pub(super) fn copy_probe(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r) + 36)
    }
    /// The token of the shared buffer (`region`) holding rank `r`'s buffer of the current single-copy allreduce;
    /// 0 when it lies in none.
    #[inline]
    pub(super) fn copy_token(&self, r: usize) -> &AtomicU64 {
        self.word(self.rank_line(r) + 40)
    }
    /// Where that buffer starts in the shared buffer.
    #[inline]
    pub(super) fn copy_offset(&self, r: usize) -> &AtomicU64 {
        self.word(self.rank_line(r) + 48)
    }
    /// Rank `r`'s outcome of mapping its peers' shared buffers for the current allreduce.
    #[inline]
    pub(super) fn copy_mapped(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r) + 56)
    }
    /// Rank `r`'s deposit for operations of sequence number parity `parity` (`DEPOSIT_BYTES`).
    #[inline]
    pub(super) fn deposit(&self, r: usize, parity: u64) -> *mut u8 {
        // SAFETY: the deposit lies inside the mapping.
        unsafe {
            self.map
                .ptr
                .add(deposit_base(self.ranks) + (r * 2 + parity as usize) * DEPOSIT_BYTES)
        }
    }
    /// Rank `r`'s board slot for operations of sequence number parity `parity`.
    #[inline]
    pub(super) fn slot(&self, r: usize, parity: u64) -> usize {
        board_base(self.ranks) + (r * 2 + parity as usize) * slot_bytes(self.ranks)
    }
    #[inline]
    pub(super) fn head(&self, from: usize, to: usize) -> &AtomicU64 {
        self.word(self.ring_base(from, to))
    }
    #[inline]
    pub(super) fn tail(&self, from: usize, to: usize) -> &AtomicU64 {
        self.word(self.ring_base(from, to) + LINE)
    }
    #[inline]
    pub(super) fn ring_data(&self, from: usize, to: usize) -> *mut u8 {
        // SAFETY: the ring's data area lies inside the mapping.
        unsafe { self.map.ptr.add(self.ring_base(from, to) + RING_HEADER) }
    }

    #[inline]
    pub(super) fn wake(&self, r: usize) {
        let s = self.sleeping(r);
        if s.load(Ordering::SeqCst) != 0 {
            s.store(0, Ordering::SeqCst);
            futex_wake(s);
        }
    }

    /// Wakes rank `r` if it sleeps, after this rank published a ring position with a plain release store. The
    /// check may miss a sleeper that announced itself at that very moment; it then wakes at its futex timeout.
    #[inline]
    pub(super) fn wake_relaxed(&self, r: usize) {
        let s = self.sleeping(r);
        if s.load(Ordering::Relaxed) != 0 {
            self.wake(r);
        }
    }
}

/// The layout version a magic of the family says: its last byte, a digit for hvd's (anything else in hex: the file
/// is not hvd's).
fn layout_version(magic: u64) -> String {
    let b = magic as u8;
    match b.is_ascii_digit() {
        true => char::from(b).to_string(),
        false => format!("{b:#04x}"),
    }
}

fn shm_path(name: &str) -> Result<CString> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(Error::Bootstrap(format!(
            "`{name}` is not a valid shared memory name ([A-Za-z0-9._-]+)"
        )));
    }
    CString::new(format!("/{name}"))
        .map_err(|_| Error::Bootstrap(format!("`{name}` contains a NUL byte")))
}

pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: word points into a live shared mapping; FUTEX_WAIT (not private) works across processes.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: word points into a live shared mapping.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment another hvd version laid out (another last byte of the magic) is refused at once with both versions
    /// named, not waited for; a segment whose magic is not written yet is still waited for.
    #[test]
    fn a_segment_of_another_layout_version_is_refused_by_name() {
        let name = format!("hvd-test-layout-{}", std::process::id());
        // A file an aborted run of an earlier process with this pid left behind.
        ShmSegment::unlink(&name);
        let seg = ShmSegment::create(&name, 2, 4096).expect("create a segment");
        seg.word(0).store(MAGIC - 1, Ordering::Release);
        let err = ShmSegment::open(&name, Duration::from_secs(5))
            .expect_err("another layout version opened")
            .to_string();
        assert!(
            err.contains(&name) && err.contains("layout version 2") && err.contains("version 3"),
            "{err}"
        );
        seg.word(0).store(0, Ordering::Release);
        let err = ShmSegment::open(&name, Duration::from_millis(100))
            .expect_err("a segment without its magic opened")
            .to_string();
        assert!(err.contains("did not appear"), "{err}");
        seg.word(0).store(MAGIC, Ordering::Release);
        let opened = ShmSegment::open(&name, Duration::from_secs(5)).expect("open the segment");
        assert_eq!((opened.ranks, opened.ring_bytes), (2, 4096));
        assert_eq!(layout_version(MAGIC_FAMILY | 0x07), "0x07");
    }

    /// The length is the layout's (the last ring ends the segment) and any size that does not fit an address space
    /// is `None`, never a wrapped length; a segment file whose counts were rewritten so (as another process of this
    /// user could) is refused by name, not mapped.
    #[test]
    fn sizes_that_do_not_fit_are_refused_not_wrapped() {
        let name = format!("hvd-test-sizes-{}", std::process::id());
        ShmSegment::unlink(&name);
        let seg = ShmSegment::create(&name, 3, 8192).expect("create a segment");
        assert_eq!(
            segment_len(3, 8192),
            Some(seg.ring_base(2, 2) + RING_HEADER + 8192)
        );
        assert_eq!(seg.map.len, segment_len(3, 8192).unwrap_or(0));
        for (ranks, ring) in [
            (usize::MAX, 4096),
            (1 << 32, 4096),
            (2, usize::MAX - 100),
            (1 << 20, 1 << 40),
        ] {
            assert_eq!(
                segment_len(ranks, ring),
                None,
                "{ranks} ranks, {ring}-byte rings"
            );
        }
        let err = ShmSegment::create(&format!("{name}-big"), 2, usize::MAX - 4095)
            .expect_err("a segment of a wrapped size")
            .to_string();
        assert!(err.contains("HVD_SHM_RING_BYTES"), "{err}");
        for (word, value) in [(8, u64::MAX), (8, 1 << 40), (16, u64::MAX - 4095)] {
            seg.word(word).store(value, Ordering::Relaxed);
            let err = ShmSegment::open(&name, Duration::from_secs(5))
                .expect_err("a segment with impossible counts opened")
                .to_string();
            assert!(
                err.contains("unexpected size"),
                "word {word} = {value}: {err}"
            );
            seg.word(8).store(3, Ordering::Relaxed);
            seg.word(16).store(8192, Ordering::Relaxed);
        }
        ShmSegment::open(&name, Duration::from_secs(5)).expect("the repaired segment opens");
    }
}
