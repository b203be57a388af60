//! The shm transport: ranks on one host talk through one shared memory segment.
//!
//! Layout: a control block (header, abort word, one cache line per rank), then one single-producer
//! single-consumer ring per ordered pair of ranks. A ring has a `head` (bytes ever written, owned by the sender)
//! and a `tail` (bytes ever read, owned by the receiver) on their own cache lines, then `capacity` data bytes.
//! Messages start 8-byte aligned in the ring (lengths are padded), so an element never straddles the wrap and the
//! receiver can reduce straight out of the ring while the sender keeps writing: no kernel call on the hot path.
//!
//! The sender keeps its own `head` and the last `tail` it saw, so a small message touches only the data line(s)
//! and the `head` line; the receiver's `tail` line is read again only when the ring looks full.
//!
//! Waiting spins (one pause per round), then yields, then sleeps on a futex in the rank's control line (with a
//! short timeout, so liveness checks still run). A rank announces its sleep in that word; a publisher calls
//! `FUTEX_WAKE` only when it sees the announcement, so the hot path makes no system call. With more ranks than
//! cores (4 ranks on 2 cores) a waiter spins only a few rounds and yields a few times before it sleeps, and
//! positions are published with a full fence so no wake-up is missed; with a core per rank the publish is a plain
//! release store and a wake-up missed in a race costs at most one futex timeout.
//!
//! Every operation starts on the **board**: one slot per rank and sequence-number parity, holding the operation's
//! header, a word per peer (alltoall counts) and eager data (a small allreduce's whole input), published by storing
//! the sequence number last. Each rank reads every other rank's slot, so the header check and a small allreduce
//! take one cache line from each peer instead of a ring message (head and data lines) each way. A slot is written
//! again two operations later, when every rank has posted the operation in between and so has finished reading it.
//!
//! Liveness: a rank marks itself gone on drop (clean) or aborted; a rank whose process no longer exists
//! (`kill(pid, 0)` fails with ESRCH) is dead. The first rank that gives up writes the culprit into the abort word,
//! which every waiter checks.

use std::ffi::CString;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::communicator::Staged;
use crate::config::{EnvVars, env_usize};
use crate::error::{Error, Result};
use crate::header::HEADER_LEN;
use crate::p2p::EAGER_MAX_BYTES;
use crate::reduce::reduce_into;
use crate::transport::{RecvOp, SendOp, Transport};

const MAGIC: u64 = 0x6876_645f_7368_6d32; // "hvd_shm2"
const LINE: usize = 128;
const CTRL_HEADER: usize = 4 * LINE;
const RING_HEADER: usize = 2 * LINE;

const STATE_ATTACHED: u32 = 1;
const STATE_GONE: u32 = 2;
const STATE_ABORTED: u32 = 3;

/// Fruitless polling rounds spent spinning before yielding, with a core per rank and with more ranks than cores.
const SPIN: u32 = 4096;
const SPIN_OVERSUBSCRIBED: u32 = 4;
/// Rounds spent yielding before sleeping on the futex.
const YIELDS: u32 = 512;
const YIELDS_OVERSUBSCRIBED: u32 = 8;

/// Default ring capacity per ordered pair of ranks.
pub const DEFAULT_RING_BYTES: usize = 512 << 10;

/// Ring capacity from `HVD_SHM_RING_BYTES` (rounded to 4 KiB, at least 4 KiB), else the default.
pub fn ring_bytes_from_env() -> usize {
    let v = env_usize(EnvVars::SHM_RING_BYTES).unwrap_or(DEFAULT_RING_BYTES);
    v.max(4096).div_ceil(4096) * 4096
}

struct Mapping {
    ptr: *mut u8,
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
    map: Arc<Mapping>,
    ranks: usize,
    ring_bytes: usize,
}

impl std::fmt::Debug for ShmSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmSegment")
            .field("ranks", &self.ranks)
            .field("ring_bytes", &self.ring_bytes)
            .finish()
    }
}

fn segment_len(ranks: usize, ring_bytes: usize) -> usize {
    arena_base(ranks)
        + ranks * 2 * arena_half(ring_bytes)
        + ranks * ranks * (RING_HEADER + ring_bytes)
}

fn arena_base(ranks: usize) -> usize {
    board_base(ranks) + ranks * 2 * slot_bytes(ranks)
}

/// Each rank's arena has two halves (used by alternate chunks) of a ring each.
fn arena_half(ring_bytes: usize) -> usize {
    ring_bytes
}

/// The bytes an arena allreduce moves per chunk: with 2 ranks a whole half (a 100 x 4 KiB fused group in one
/// chunk: 168 us per step against 176 us in two, medians of five interleaved runs of `bench/engine.py`'s grouped
/// step), with more ranks half a half (a whole half was slower with 4 ranks on 2 cores: 1 MiB in 483-526 us
/// against 456-460 us).
fn arena_chunk(ranks: usize, ring_bytes: usize) -> usize {
    if ranks == 2 {
        arena_half(ring_bytes)
    } else {
        arena_half(ring_bytes) / 2
    }
}

/// Where a slot's words for each rank start (8-aligned: both terms are multiples of 8).
const PAIRS_AT: usize = HEADER_LEN + EAGER_MAX_BYTES;

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
        let len = segment_len(ranks, ring_bytes);
        let name = c"hvd-shm";
        // SAFETY: name is NUL-terminated; the returned fd is closed below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io("create a memfd", io::Error::last_os_error()));
        }
        let r = Self::init_fd(fd, len, ranks, ring_bytes, "(memfd)", None);
        // SAFETY: fd is ours; the mapping keeps the memory alive.
        unsafe { libc::close(fd) };
        r
    }

    /// Creates the named segment `/dev/shm/<name>` for `ranks` processes; the others [`open`](Self::open) it.
    /// The file is removed when this segment is dropped, or earlier with [`unlink`](Self::unlink).
    pub fn create(name: &str, ranks: usize, ring_bytes: usize) -> Result<ShmSegment> {
        let path = shm_path(name)?;
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
        let len = segment_len(ranks, ring_bytes);
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
        };
        seg.word(8).store(ranks as u64, Ordering::Relaxed);
        seg.word(16).store(ring_bytes as u64, Ordering::Relaxed);
        seg.word(0).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Opens a named segment another rank created, waiting up to `timeout` for it to appear.
    pub fn open(name: &str, timeout: Duration) -> Result<ShmSegment> {
        let path = shm_path(name)?;
        let deadline = Instant::now() + timeout;
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
        };
        if probe.word(0).load(Ordering::Acquire) != MAGIC {
            return Ok(None);
        }
        let ranks = probe.word(8).load(Ordering::Relaxed) as usize;
        let ring_bytes = probe.word(16).load(Ordering::Relaxed) as usize;
        if segment_len(ranks, ring_bytes) != len {
            return Err(Error::Bootstrap(format!(
                "shared memory segment `{name}` has an unexpected size"
            )));
        }
        Ok(Some(ShmSegment {
            map: probe.map,
            ranks,
            ring_bytes,
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

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= self.map.len && offset.is_multiple_of(8));
        // SAFETY: offset is 8-aligned inside the mapping (page aligned base), which lives as long as `self`.
        unsafe { &*(self.map.ptr.add(offset) as *const AtomicU64) }
    }

    fn word32(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset + 4 <= self.map.len && offset.is_multiple_of(4));
        // SAFETY: offset is 4-aligned inside the mapping, which lives as long as `self`.
        unsafe { &*(self.map.ptr.add(offset) as *const AtomicU32) }
    }

    fn abort_word(&self) -> &AtomicU64 {
        self.word(LINE)
    }
    fn attached(&self) -> &AtomicU64 {
        self.word(2 * LINE)
    }
    fn rank_line(&self, r: usize) -> usize {
        CTRL_HEADER + r * LINE
    }
    fn pid(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r))
    }
    fn state(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r) + 4)
    }
    fn sleeping(&self, r: usize) -> &AtomicU32 {
        self.word32(self.rank_line(r) + 64)
    }
    fn ring_base(&self, from: usize, to: usize) -> usize {
        arena_base(self.ranks)
            + self.ranks * 2 * arena_half(self.ring_bytes)
            + (from * self.ranks + to) * (RING_HEADER + self.ring_bytes)
    }
    /// Rank `r`'s arena half for chunk number `chunk` (alternating halves).
    fn arena(&self, r: usize, chunk: u64) -> *mut u8 {
        let half = arena_half(self.ring_bytes);
        // SAFETY: the arena lies inside the mapping.
        unsafe {
            self.map
                .ptr
                .add(arena_base(self.ranks) + (r * 2 + (chunk & 1) as usize) * half)
        }
    }
    /// How far rank `r` has come through arena steps (two per chunk: deposited, reduced).
    fn arena_progress(&self, r: usize) -> &AtomicU64 {
        self.word(self.rank_line(r) + 8)
    }
    /// Rank `r`'s board slot for operations of sequence number parity `parity`.
    fn slot(&self, r: usize, parity: u64) -> usize {
        board_base(self.ranks) + (r * 2 + parity as usize) * slot_bytes(self.ranks)
    }
    fn head(&self, from: usize, to: usize) -> &AtomicU64 {
        self.word(self.ring_base(from, to))
    }
    fn tail(&self, from: usize, to: usize) -> &AtomicU64 {
        self.word(self.ring_base(from, to) + LINE)
    }
    fn ring_data(&self, from: usize, to: usize) -> *mut u8 {
        // SAFETY: the ring's data area lies inside the mapping.
        unsafe { self.map.ptr.add(self.ring_base(from, to) + RING_HEADER) }
    }

    fn wake(&self, r: usize) {
        let s = self.sleeping(r);
        if s.load(Ordering::SeqCst) != 0 {
            s.store(0, Ordering::SeqCst);
            futex_wake(s);
        }
    }

    /// Wakes rank `r` if it sleeps, after this rank published a ring position with a plain release store. The
    /// check may miss a sleeper that announced itself at that very moment; it then wakes at its futex timeout.
    fn wake_relaxed(&self, r: usize) {
        let s = self.sleeping(r);
        if s.load(Ordering::Relaxed) != 0 {
            self.wake(r);
        }
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

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
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

/// A sender's private view of one outgoing ring, on its own cache line: ranks that are threads of one process
/// write these on every message, and sharing a line with another rank's state would bounce it between cores.
#[repr(align(128))]
#[derive(Clone, Copy)]
struct Cursor {
    /// `head` of the ring: only this rank writes it.
    head: u64,
    /// Last `tail` seen: the sender re-reads the peer's line only when this stale value says the ring is too
    /// full, so a small message costs no extra line transfer.
    tail_seen: u64,
}

/// One rank's end of a shared memory segment (aligned so that in-process ranks never share a cache line).
#[repr(align(128))]
pub struct ShmTransport {
    seg: ShmSegment,
    rank: usize,
    /// Global rank of each local index (the segment numbers ranks 0..ranks; the job may number them otherwise).
    global: Vec<usize>,
    my_pid: u32,
    last_liveness: Instant,
    /// Publish ring positions with a full fence, so a peer about to sleep never misses the wake-up. Needed when
    /// ranks outnumber cores (they sleep often); otherwise a plain release store lets this rank go on without
    /// waiting for the cache line, and a rare missed wake-up costs one futex timeout (the peer spins first).
    strict_wake: bool,
    /// Fruitless polling rounds to spin, then to yield, before sleeping on the futex.
    spin: u32,
    yields: u32,
    /// This rank's view of each outgoing ring, by local peer index.
    cursors: Vec<Cursor>,
    /// Arena steps this rank has completed (equal on every rank between operations).
    arena_steps: u64,
}

impl ShmTransport {
    /// Attaches local index `rank` to `seg`; ranks are numbered `0..seg.ranks()` and are the global ranks.
    pub fn attach(seg: ShmSegment, rank: usize) -> Result<ShmTransport> {
        let global = (0..seg.ranks).collect();
        Self::attach_mapped(seg, rank, global)
    }

    /// Attaches local index `local` to `seg`, where local index `i` is global rank `global[i]`.
    pub fn attach_mapped(
        seg: ShmSegment,
        local: usize,
        global: Vec<usize>,
    ) -> Result<ShmTransport> {
        if local >= seg.ranks || global.len() != seg.ranks {
            return Err(Error::Bootstrap(format!(
                "local rank {local} does not fit a {}-rank segment",
                seg.ranks
            )));
        }
        let my_pid = std::process::id();
        let cursors = (0..seg.ranks)
            .map(|to| Cursor {
                head: seg.head(local, to).load(Ordering::Acquire),
                tail_seen: seg.tail(local, to).load(Ordering::Acquire),
            })
            .collect();
        seg.pid(local).store(my_pid, Ordering::Relaxed);
        seg.state(local).store(STATE_ATTACHED, Ordering::Release);
        seg.attached().fetch_add(1, Ordering::AcqRel);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let oversubscribed = seg.ranks > cores;
        Ok(ShmTransport {
            seg,
            rank: local,
            global,
            my_pid,
            last_liveness: Instant::now(),
            strict_wake: oversubscribed,
            spin: env_u32(EnvVars::SHM_SPIN).unwrap_or(if oversubscribed {
                SPIN_OVERSUBSCRIBED
            } else {
                SPIN
            }),
            yields: env_u32(EnvVars::SHM_YIELDS).unwrap_or(if oversubscribed {
                YIELDS_OVERSUBSCRIBED
            } else {
                YIELDS
            }),
            cursors,
            arena_steps: 0,
        })
    }

    /// Waits until all ranks of the segment have attached.
    pub fn wait_attached(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while (self.seg.attached().load(Ordering::Acquire) as usize) < self.seg.ranks {
            if Instant::now() > deadline {
                let missing: Vec<usize> = (0..self.seg.ranks)
                    .filter(|r| self.seg.state(*r).load(Ordering::Acquire) == 0)
                    .map(|r| self.global[r])
                    .collect();
                return Err(Error::Timeout {
                    op: "attach shared memory",
                    ranks: missing,
                    waited: timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    fn local(&self, global: usize) -> Result<usize> {
        self.global
            .iter()
            .position(|g| *g == global)
            .ok_or_else(|| {
                Error::Broken(format!(
                    "rank {global} is not on this host's shared memory segment"
                ))
            })
    }

    fn check_abort(&self) -> Result<()> {
        let a = self.seg.abort_word().load(Ordering::Acquire);
        if a != 0 {
            let culprit = (a & 0xffff_ffff) as usize - 1;
            let reporter = (a >> 32) as usize;
            return Err(Error::PeerLost {
                rank: culprit,
                reason: format!("rank {reporter} lost it and aborted"),
            });
        }
        Ok(())
    }

    fn check_peer(&self, local: usize, need_data: bool) -> Result<()> {
        let g = self.global[local];
        match self.seg.state(local).load(Ordering::Acquire) {
            STATE_GONE if need_data => Err(Error::PeerLost {
                rank: g,
                reason: "it shut its communicator down while this rank still expected data".into(),
            }),
            // Left cleanly; what it wrote before leaving is still in the ring.
            STATE_GONE => Ok(()),
            STATE_ABORTED => {
                self.check_abort()?;
                Err(Error::PeerLost {
                    rank: g,
                    reason: "it aborted".into(),
                })
            }
            _ => {
                let pid = self.seg.pid(local).load(Ordering::Relaxed);
                if pid != 0 && pid != self.my_pid {
                    // SAFETY: signal 0 only checks that the process exists.
                    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
                    let gone =
                        r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
                    if gone || is_zombie(pid) {
                        return Err(Error::PeerLost {
                            rank: g,
                            reason: format!("its process {pid} no longer exists"),
                        });
                    }
                }
                Ok(())
            }
        }
    }
}

impl ShmTransport {
    /// Waits for ring activity; `may_sleep` allows the futex sleep (off when another transport needs polling).
    pub(crate) fn wait_inner(
        &mut self,
        send_peers: &[usize],
        recv_peers: &[usize],
        idle: u32,
        may_sleep: bool,
    ) -> Result<()> {
        // Spin (the peer is usually on another core and a few hundred nanoseconds away; one pause per round
        // so its data is seen as soon as it lands), then yield so a peer sharing our core can run, then sleep on
        // the futex. With more ranks than cores, spin only briefly and yield less before sleeping.
        let (spin, yields) = (self.spin, self.yields);
        if idle < spin {
            std::hint::spin_loop();
            if !idle.is_multiple_of(256) {
                return Ok(());
            }
            return self.check_abort();
        }
        self.check_abort()?;
        if idle < spin + yields || !may_sleep {
            std::thread::yield_now();
            if !idle.is_multiple_of(64) {
                return Ok(());
            }
        }
        if self.last_liveness.elapsed() > Duration::from_millis(20) {
            self.last_liveness = Instant::now();
            for &p in send_peers {
                self.check_peer(self.local(p)?, true)?;
            }
            for &p in recv_peers {
                let from = self.local(p)?;
                let empty = self.seg.head(from, self.rank).load(Ordering::Acquire)
                    == self.seg.tail(from, self.rank).load(Ordering::Acquire);
                // Data still in the ring was sent before the peer went: read it first.
                if empty {
                    self.check_peer(from, true)?;
                }
            }
        }
        // Sleep until a peer publishes something. Announce the sleep first, then re-check, so a peer that
        // publishes in between either is seen here or sees the flag and wakes us.
        if !may_sleep || idle < spin + yields {
            return Ok(());
        }
        let me = self.rank;
        let flag = self.seg.sleeping(me);
        flag.store(1, Ordering::SeqCst);
        let mut ready = false;
        for &p in send_peers {
            let to = self.local(p)?;
            let used = self.seg.head(me, to).load(Ordering::SeqCst)
                - self.seg.tail(me, to).load(Ordering::SeqCst);
            ready |= used < self.seg.ring_bytes as u64;
        }
        for &p in recv_peers {
            let from = self.local(p)?;
            ready |= self.seg.head(from, me).load(Ordering::SeqCst)
                != self.seg.tail(from, me).load(Ordering::SeqCst);
        }
        if !ready && self.seg.abort_word().load(Ordering::SeqCst) == 0 {
            futex_wait(flag, 1, Duration::from_millis(2));
        }
        flag.store(0, Ordering::SeqCst);
        Ok(())
    }
}

impl ShmTransport {
    fn slot_ptr(&self, r: usize, seq: u64) -> *mut u8 {
        // SAFETY: the slot lies inside the mapping.
        unsafe { self.seg.map.ptr.add(self.seg.slot(r, seq & 1)) }
    }

    fn posted(&self, r: usize, seq: u64) -> bool {
        self.seg
            .word(self.seg.slot(r, seq & 1))
            .load(Ordering::Acquire)
            == seq
    }

    /// Posts this rank's operation `header` (whose first 8 bytes, the sequence number, are published last, after
    /// everything else), `eager` data (at most `EAGER_MAX_BYTES`) and, for operations that have them, `pairs[j]`
    /// for each rank `j` (on a line of their own, which readers of other operations never touch).
    pub(crate) fn board_post(
        &mut self,
        header: &[u8; HEADER_LEN],
        pairs: Option<&[u64]>,
        eager: &[u8],
    ) {
        let n = self.seg.ranks;
        let seq = u64::from_ne_bytes(header[..8].try_into().unwrap_or_default());
        let pairs = pairs.unwrap_or(&[]);
        assert!(pairs.len() <= n && eager.len() <= EAGER_MAX_BYTES);
        let p = self.slot_ptr(self.rank, seq);
        // SAFETY: the slot lies inside the mapping, only this rank writes it, and no rank reads it now: every rank
        // has posted the previous operation, so every rank is done with the one before, which used this slot.
        // Words are 8-aligned (slots are line-aligned, HEADER_LEN is a multiple of 8).
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr().add(8), p.add(8), HEADER_LEN - 8);
            std::ptr::copy_nonoverlapping(eager.as_ptr(), p.add(HEADER_LEN), eager.len());
            for (j, v) in pairs.iter().enumerate() {
                p.add(PAIRS_AT + 8 * j).cast::<u64>().write(*v);
            }
        }
        self.publish(self.seg.word(self.seg.slot(self.rank, seq & 1)), seq);
    }

    /// Waits until every other rank has posted operation `seq`.
    pub(crate) fn board_wait(
        &mut self,
        seq: u64,
        op: &'static str,
        timeout: Duration,
    ) -> Result<()> {
        self.wait_ranks(op, timeout, |t, r| t.posted(r, seq))
    }

    /// Waits until `ready(self, r)` holds for every other rank: spins, yields, then sleeps on the futex like the
    /// rings' waits (whoever makes a rank ready must wake it, see `publish`); a dead or departed rank, an abort, or
    /// `timeout` without progress is an error naming the ranks not ready.
    fn wait_ranks(
        &mut self,
        op: &'static str,
        timeout: Duration,
        ready: impl Fn(&Self, usize) -> bool,
    ) -> Result<()> {
        let n = self.seg.ranks;
        let me = self.rank;
        let mut first_missing = 0;
        let mut idle = 0u32;
        let mut since: Option<Instant> = None;
        loop {
            match (first_missing..n).find(|r| *r != me && !ready(self, *r)) {
                None => return Ok(()),
                Some(r) if r > first_missing => {
                    // Progress: the timeout counts time without any.
                    first_missing = r;
                    since = None;
                }
                Some(_) => {}
            }
            idle = idle.saturating_add(1);
            if idle < self.spin {
                std::hint::spin_loop();
                if idle.is_multiple_of(256) {
                    self.check_abort()?;
                }
                continue;
            }
            self.check_abort()?;
            let started = *since.get_or_insert_with(Instant::now);
            if started.elapsed() > timeout {
                return Err(Error::Timeout {
                    op,
                    ranks: (0..n)
                        .filter(|r| *r != me && !ready(self, *r))
                        .map(|r| self.global[r])
                        .collect(),
                    waited: timeout,
                });
            }
            if self.last_liveness.elapsed() > Duration::from_millis(20) {
                self.last_liveness = Instant::now();
                for r in (0..n).filter(|r| *r != me && !ready(self, *r)) {
                    self.check_peer(r, true)?;
                }
            }
            if idle < self.spin + self.yields {
                std::thread::yield_now();
                continue;
            }
            // Announce the sleep, then look again: a rank publishing in between either is seen here or sees the
            // flag. (The fence orders the flag before the loads in `ready`.)
            let flag = self.seg.sleeping(me);
            flag.store(1, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            let missing = (0..n).any(|r| r != me && !ready(self, r));
            if missing && self.seg.abort_word().load(Ordering::SeqCst) == 0 {
                futex_wait(flag, 1, Duration::from_millis(2));
            }
            flag.store(0, Ordering::SeqCst);
        }
    }

    /// Stores `value` into this rank's published `word` and wakes sleeping ranks (full fence when ranks outnumber
    /// cores, see `strict_wake`).
    fn publish(&self, word: &AtomicU64, value: u64) {
        let others = (0..self.seg.ranks).filter(|r| *r != self.rank);
        if self.strict_wake {
            word.store(value, Ordering::SeqCst);
            others.for_each(|r| self.seg.wake(r));
        } else {
            word.store(value, Ordering::Release);
            others.for_each(|r| self.seg.wake_relaxed(r));
        }
    }

    /// Allreduce through the ranks' arenas, chunk by chunk: every rank reads the other ranks' blocks of its chunk
    /// from `io` into its arena; once all have, rank `r` reads its own block into its arena, reduces the others'
    /// deposits of block `r` into it and writes it out, all in one pass while it is in cache; once all have, every
    /// rank writes the other blocks to `io` straight out of the arenas that hold them. Two waits per chunk
    /// whatever the rank count, and less memory traffic per rank than a ring with three ranks or more; with `io`
    /// in the caller's tensors (a fused group) no fusion buffer is needed at all. Chunks alternate between the
    /// arenas' halves: a rank deposits chunk `c + 2` only after every rank deposited chunk `c + 1`, which each did
    /// after writing chunk `c` out.
    pub(crate) fn allreduce_arena(
        &mut self,
        len: usize,
        dtype: crate::types::DType,
        op: crate::types::ReduceOp,
        io: &mut dyn Staged,
        timeout: Duration,
    ) -> Result<()> {
        let n = self.seg.ranks;
        let me = self.rank;
        let esize = dtype.size();
        let per_chunk = (arena_chunk(n, self.seg.ring_bytes) / esize).max(1) * esize;
        let mut at = 0;
        while at < len {
            let clen = per_chunk.min(len - at);
            let counts = crate::p2p::even_counts(clen / esize, n);
            let mut offsets = Vec::with_capacity(n + 1);
            offsets.push(0);
            for c in &counts {
                offsets.push(offsets.last().copied().unwrap_or(0) + c * esize);
            }
            let number = self.arena_steps / 2;
            let mine = self.seg.arena(me, number);
            // The other ranks' blocks of this rank's input go into its arena; its own block it reads later, right
            // where it reduces it.
            for r in (0..n).filter(|r| *r != me) {
                let b = offsets[r]..offsets[r + 1];
                // SAFETY: this rank's arena half holds `per_chunk` bytes and nobody reads it now (see above).
                io.read(at + b.start, unsafe {
                    std::slice::from_raw_parts_mut(mine.add(b.start), b.len())
                });
            }
            self.arena_steps += 1;
            let deposited = self.arena_steps;
            self.publish(self.seg.arena_progress(me), deposited);
            self.wait_ranks("allreduce", timeout, |t, r| {
                t.seg.arena_progress(r).load(Ordering::Acquire) >= deposited
            })?;
            let block = offsets[me]..offsets[me + 1];
            // SAFETY: block `me` of this rank's arena is read by the others only after the publish below; they read
            // only their own blocks of it until then.
            let own = unsafe { std::slice::from_raw_parts_mut(mine.add(block.start), block.len()) };
            // Read, reduced and written out in one pass while it is in cache.
            io.read(at + block.start, own);
            for r in (0..n).filter(|r| *r != me) {
                // SAFETY: rank r published its deposit (Acquire above) and leaves it alone until every rank has
                // deposited the next chunk.
                let theirs = unsafe {
                    std::slice::from_raw_parts(
                        self.seg.arena(r, number).add(block.start),
                        block.len(),
                    )
                };
                reduce_into(own, theirs, dtype, op);
            }
            io.write(at + block.start, own);
            self.arena_steps += 1;
            let reduced = self.arena_steps;
            self.publish(self.seg.arena_progress(me), reduced);
            self.wait_ranks("allreduce", timeout, |t, r| {
                t.seg.arena_progress(r).load(Ordering::Acquire) >= reduced
            })?;
            for r in (0..n).filter(|r| *r != me) {
                let b = offsets[r]..offsets[r + 1];
                // SAFETY: rank r published its reduced block (Acquire above).
                let theirs = unsafe {
                    std::slice::from_raw_parts(self.seg.arena(r, number).add(b.start), b.len())
                };
                io.write(at + b.start, theirs);
            }
            at += clen;
        }
        Ok(())
    }

    /// Rank `r`'s header of operation `seq` (after [`board_wait`](Self::board_wait)).
    pub(crate) fn board_header(&self, r: usize, seq: u64) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        // SAFETY: rank r published the slot (Acquire in `posted`) and does not write it again before this rank
        // posts its next operation.
        unsafe { std::ptr::copy_nonoverlapping(self.slot_ptr(r, seq), h.as_mut_ptr(), HEADER_LEN) };
        h
    }

    /// Rank `r`'s word for this rank in operation `seq` (posted with `pairs`).
    pub(crate) fn board_pair(&self, r: usize, seq: u64) -> u64 {
        // SAFETY: as in `board_header`; the words area holds one word per rank.
        unsafe {
            self.slot_ptr(r, seq)
                .add(PAIRS_AT + 8 * self.rank)
                .cast::<u64>()
                .read()
        }
    }

    /// Copies rank `r`'s eager data of operation `seq` into `out` (its length, at most `EAGER_MAX_BYTES`).
    pub(crate) fn board_eager(&self, r: usize, seq: u64, out: &mut [u8]) {
        assert!(out.len() <= EAGER_MAX_BYTES);
        let p = self.slot_ptr(r, seq);
        // SAFETY: as in `board_header`; the eager area holds EAGER_MAX_BYTES.
        unsafe {
            std::ptr::copy_nonoverlapping(p.add(HEADER_LEN), out.as_mut_ptr(), out.len());
        }
    }
}

/// A killed process stays a zombie until its parent reaps it; it will never run again.
fn is_zombie(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command name, which is in parentheses and may itself contain ") ".
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
        .is_some_and(|c| c == 'Z' || c == 'X')
}

fn env_u32(name: &str) -> Option<u32> {
    env_usize(name).map(|v| v.min(u32::MAX as usize / 2) as u32)
}

fn padded(len: usize) -> usize {
    len.div_ceil(8) * 8
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.global[self.rank]
    }

    fn size(&self) -> usize {
        self.seg.ranks
    }

    fn progress_send(&mut self, op: &mut SendOp<'_>) -> Result<bool> {
        let to = self.local(op.peer)?;
        let me = self.rank;
        let cap = self.seg.ring_bytes as u64;
        let head = self.cursors[to].head;
        let total = padded(op.data.len());
        let mut free = (cap - (head - self.cursors[to].tail_seen)) as usize;
        if free < total - op.pos {
            let tail = self.seg.tail(me, to).load(Ordering::Acquire);
            self.cursors[to].tail_seen = tail;
            free = (cap - (head - tail)) as usize;
        }
        let k = free.min(total - op.pos);
        if k == 0 {
            return Ok(false);
        }
        let data_k = k.min(op.data.len().saturating_sub(op.pos));
        let at = (head % cap) as usize;
        let first = data_k.min(cap as usize - at);
        let ring = self.seg.ring_data(me, to);
        // SAFETY: [at, at+first) and [0, data_k-first) lie in the ring's free region, which only this rank writes
        // until `head` is published below; the source is the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(op.data.as_ptr().add(op.pos), ring.add(at), first);
            std::ptr::copy_nonoverlapping(
                op.data.as_ptr().add(op.pos + first),
                ring,
                data_k - first,
            );
        }
        op.pos += k;
        op.finished = op.pos == total;
        self.cursors[to].head = head + k as u64;
        let head_a = self.seg.head(me, to);
        if self.strict_wake {
            head_a.store(head + k as u64, Ordering::SeqCst);
            self.seg.wake(to);
        } else {
            head_a.store(head + k as u64, Ordering::Release);
            self.seg.wake_relaxed(to);
        }
        Ok(true)
    }

    fn progress_recv(&mut self, op: &mut RecvOp<'_>) -> Result<bool> {
        let from = self.local(op.peer)?;
        let me = self.rank;
        let cap = self.seg.ring_bytes as u64;
        let tail_a = self.seg.tail(from, me);
        let tail = tail_a.load(Ordering::Relaxed);
        let head = self.seg.head(from, me).load(Ordering::Acquire);
        let avail = (head - tail) as usize;
        let len = op.buf.len();
        let total = padded(len);
        let mut k = avail.min(total - op.pos);
        let mut data_k = k.min(len.saturating_sub(op.pos));
        if let Some((dtype, _)) = op.reduce
            && data_k < len - op.pos.min(len)
        {
            // Reduce whole elements only; the rest arrives with the next write.
            data_k -= data_k % dtype.size();
            k = data_k;
        }
        if k == 0 {
            return Ok(false);
        }
        let at = (tail % cap) as usize;
        let first = data_k.min(cap as usize - at);
        let ring = self.seg.ring_data(from, me);
        // SAFETY: [tail, tail+k) was published by the sender (Acquire on head) and is not written again until
        // `tail` moves past it below.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(ring.add(at), first),
                std::slice::from_raw_parts(ring, data_k - first),
            )
        };
        let dst = &mut op.buf[op.pos.min(len)..];
        match op.reduce {
            None => {
                dst[..first].copy_from_slice(a);
                dst[first..data_k].copy_from_slice(b);
            }
            Some((dtype, rop)) => {
                reduce_into(&mut dst[..first], a, dtype, rop);
                reduce_into(&mut dst[first..data_k], b, dtype, rop);
            }
        }
        op.pos += k;
        op.finished = op.pos == total;
        if self.strict_wake {
            tail_a.store(tail + k as u64, Ordering::SeqCst);
            self.seg.wake(from);
        } else {
            tail_a.store(tail + k as u64, Ordering::Release);
            self.seg.wake_relaxed(from);
        }
        Ok(true)
    }

    fn wait(&mut self, send_peers: &[usize], recv_peers: &[usize], idle: u32) -> Result<()> {
        self.wait_inner(send_peers, recv_peers, idle, true)
    }

    fn spin_rounds(&self) -> u32 {
        self.spin
    }

    /// The board, when the segment's ranks are the whole job, numbered alike (this transport's ranks are then the
    /// communicator's); not when the segment is one host's part of a larger job (`attach_mapped`).
    fn shared_board(&mut self) -> Option<&mut ShmTransport> {
        self.whole_job_in_shared_memory().then_some(self)
    }

    fn whole_job_in_shared_memory(&self) -> bool {
        self.global.iter().enumerate().all(|(i, g)| i == *g)
    }

    fn abort(&mut self, culprit: usize, reason: &str) {
        tracing::debug!(culprit, reason, "aborting shared memory peers");
        let word = (culprit as u64 + 1) | ((self.rank() as u64) << 32);
        let _ = self
            .seg
            .abort_word()
            .compare_exchange(0, word, Ordering::SeqCst, Ordering::SeqCst);
        self.seg
            .state(self.rank)
            .store(STATE_ABORTED, Ordering::SeqCst);
        for r in 0..self.seg.ranks {
            self.seg.wake(r);
        }
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        let s = self.seg.state(self.rank);
        if s.load(Ordering::Acquire) != STATE_ABORTED {
            s.store(STATE_GONE, Ordering::SeqCst);
        }
        for r in 0..self.seg.ranks {
            self.seg.wake(r);
        }
    }
}
