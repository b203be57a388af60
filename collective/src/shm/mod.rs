//! The shm transport: ranks on one host talk through one shared memory segment ([`ShmTransport`], one rank's
//! end of it: attaching, liveness, waiting on every rank, and the [`Transport`] it offers).
//!
//! The segment (`segment`) holds a control block, the board (`board`: each operation's headers and small
//! data), the arenas (`arena`: large allreduces) and a ring per ordered pair of ranks (`ring`: every other
//! message).
//!
//! Waiting spins (one pause per round), then yields, then sleeps on a futex in the rank's control line (with a
//! short timeout, so liveness checks still run). A rank announces its sleep in that word; a publisher calls
//! `FUTEX_WAKE` only when it sees the announcement, so the hot path makes no system call. With more ranks than
//! cores (4 ranks on 2 cores) a waiter spins only a few rounds and yields for at most 2 µs before it sleeps (a
//! rank that keeps yielding while its core's other rank works slows that rank down: 4 ranks at 16-64 MiB took
//! twice as long), and positions are published with a full fence so no wake-up is missed; with a core per rank
//! the publish is a plain release store and a wake-up missed in a race costs at most one futex timeout.
//! The hierarchical transport waits the same way on this host's ranks alone; a wait of its that involves ranks
//! on other hosts spins and yields by these settings for up to 300 fruitless rounds before it sleeps, even when
//! oversubscribed (`hierarchical`).
//!
//! Liveness: a rank marks itself gone on drop (clean) or aborted; a rank whose process no longer exists
//! (`kill(pid, 0)` fails with ESRCH) is dead. The first rank that gives up writes the culprit into the abort word,
//! which every waiter checks.

mod arena;
mod board;
mod cores;
mod region;
mod ring;
mod segment;
mod single_copy;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::board::Board;
use crate::config::env_usize;
use crate::env_vars;
use crate::error::{Error, Result};
use crate::transport::{RecvOp, SendOp, Transport};
use ring::Cursor;
use segment::{STATE_ABORTED, STATE_ATTACHED, STATE_GONE, futex_wait};
use single_copy::SingleCopy;

pub use region::SharedBuffer;
pub use ring::{DEFAULT_RING_BYTES, ring_bytes_from_env};
pub use segment::ShmSegment;
pub(crate) use single_copy::{SINGLE_COPY_MIN_BYTES, SINGLE_COPY_MIN_BYTES_MANY};

/// Fruitless polling rounds spent spinning before yielding, with a core per rank and with more ranks than cores.
const SPIN: u32 = 4096;
const SPIN_OVERSUBSCRIBED: u32 = 4;
/// Rounds spent yielding before sleeping on the futex, with a core per rank.
const YIELDS: u32 = 512;
/// With more ranks than cores: how long a rank yields without progress before it sleeps on the futex.
const YIELD_FOR_OVERSUBSCRIBED: Duration = Duration::from_micros(2);

/// One rank's end of a shared memory segment (aligned so that in-process ranks never share a cache line).
#[repr(align(128))]
pub struct ShmTransport {
    seg: ShmSegment,
    rank: usize,
    /// Global rank of each local index (the segment numbers ranks 0..ranks; the job may number them otherwise).
    global: Vec<usize>,
    my_pid: u32,
    last_liveness: Instant,
    /// More ranks than cores. Then positions are published with a full fence, so a peer about to sleep never
    /// misses the wake-up (they sleep often); otherwise a plain release store lets this rank go on without waiting
    /// for the cache line, and a rare missed wake-up costs one futex timeout (the peer spins first). And a waiter
    /// yields for a time (`yield_for`) rather than a count before it sleeps.
    oversubscribed: bool,
    /// Fruitless polling rounds to spin, then to yield, before sleeping on the futex (with a core per rank).
    spin: u32,
    yields: u32,
    /// With more ranks than cores: how long to yield without progress before sleeping on the futex.
    yield_for: Duration,
    /// When the current wait of `wait_inner` began to yield.
    yielding_since: Option<Instant>,
    /// This rank's view of each outgoing ring, by local peer index.
    cursors: Vec<Cursor>,
    /// Arena steps this rank has completed (equal on every rank between operations; the single copy's count too).
    arena_steps: u64,
    /// Whether large allreduces read peers' memory (`single_copy`), and the piece they read it into.
    single_copy: SingleCopy,
    copy_piece: Vec<u8>,
    /// Peers' shared buffers mapped so far, by local peer index (`region`), and whether a failure to map one was
    /// logged already, and whether reading them was.
    peer_regions: Vec<Vec<region::PeerRegion>>,
    map_failure_logged: bool,
    shared_logged: bool,
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
        let ranks = seg.ranks;
        let cursors = (0..seg.ranks)
            .map(|to| Cursor {
                head: seg.head(local, to).load(Ordering::Acquire),
                tail_seen: seg.tail(local, to).load(Ordering::Acquire),
            })
            .collect();
        seg.pid(local).store(my_pid, Ordering::Relaxed);
        seg.cpus(local).store(allowed_cpus(), Ordering::Relaxed);
        seg.state(local).store(STATE_ATTACHED, Ordering::Release);
        seg.attached().fetch_add(1, Ordering::AcqRel);
        let mut t = ShmTransport {
            seg,
            rank: local,
            global,
            my_pid,
            last_liveness: Instant::now(),
            oversubscribed: false,
            spin: SPIN,
            yields: YIELDS,
            yield_for: Duration::ZERO,
            yielding_since: None,
            cursors,
            arena_steps: 0,
            single_copy: SingleCopy::Undecided,
            copy_piece: Vec::new(),
            peer_regions: (0..ranks).map(|_| Vec::new()).collect(),
            map_failure_logged: false,
            shared_logged: false,
        };
        // Until every rank has attached (`wait_attached`), the CPUs this process may run on count as the ranks'.
        t.set_oversubscribed(
            t.seg.ranks > std::thread::available_parallelism().map_or(1, |n| n.get()),
        );
        Ok(t)
    }

    /// How this rank waits, `oversubscribed` or with a core per rank (see `oversubscribed`); the settings of
    /// `HVD_SHM_SPIN` and `HVD_SHM_YIELDS` win.
    fn set_oversubscribed(&mut self, oversubscribed: bool) {
        let yields_set = env_u32(env_vars::HVD_SHM_YIELDS);
        self.oversubscribed = oversubscribed;
        self.spin = env_u32(env_vars::HVD_SHM_SPIN).unwrap_or(if oversubscribed {
            SPIN_OVERSUBSCRIBED
        } else {
            SPIN
        });
        self.yields = yields_set.unwrap_or(if oversubscribed { 0 } else { YIELDS });
        // An explicit count of yields applies to oversubscribed ranks too.
        self.yield_for = match (oversubscribed, yields_set) {
            (true, None) => YIELD_FOR_OVERSUBSCRIBED,
            _ => Duration::ZERO,
        };
    }

    /// Whether this rank waits as one of more ranks than cores (see `oversubscribed`).
    pub(crate) fn oversubscribed(&self) -> bool {
        self.oversubscribed
    }

    /// Whether the segment's ranks are oversubscribed, once all have attached, when they may run on different sets
    /// of CPUs (a launcher bound each rank to its own core: `mpirun --bind-to core`, Slurm's `--cpu-bind`, `hvd
    /// bench --processes`): when they cannot each have a CPU of their own set or outnumber this process's CPU quota
    /// (`cores::oversubscribed`); `None` when every rank has the same set (then this process's count stands, which
    /// also heeds a CPU quota) or one set could not be read.
    fn oversubscribed_by_sets(&self) -> Option<bool> {
        let sets: Vec<u64> = (0..self.seg.ranks)
            .map(|r| self.seg.cpus(r).load(Ordering::Relaxed))
            .collect();
        if sets.contains(&u64::MAX) {
            tracing::debug!(
                ranks = self.seg.ranks,
                "shm: a rank may run on a CPU from 64 up or its CPU set was unreadable; counting this process's CPUs"
            );
        }
        cores::oversubscribed(&sets, cores::quota_cpus)
    }

    /// Waits until all ranks of the segment have attached, then counts the cores they run on (a rank bound to one
    /// core alone is not oversubscribed when its peers are bound to others).
    pub fn wait_attached(&mut self, timeout: Duration) -> Result<()> {
        let deadline = crate::time::saturating_add(Instant::now(), timeout);
        while (self.seg.attached().load(Ordering::Acquire) as usize) < self.seg.ranks {
            // A member of this elastic round found frozen never attaches.
            crate::liveness::check()?;
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
        if let Some(oversubscribed) = self.oversubscribed_by_sets() {
            tracing::debug!(
                oversubscribed,
                ranks = self.seg.ranks,
                "shm: the ranks are bound to different CPUs"
            );
            self.set_oversubscribed(oversubscribed);
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
        // A member of this elastic round that the launcher found frozen never answers nor dies.
        crate::liveness::check()?;
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
            if idle < self.spin + self.yields || started.elapsed() < self.yield_for {
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

    /// Whether the wait of `wait_inner` has yielded for less than `yield_for` so far.
    fn yield_longer(&mut self) -> bool {
        if self.yield_for.is_zero() {
            return false;
        }
        self.yielding_since
            .get_or_insert_with(Instant::now)
            .elapsed()
            < self.yield_for
    }

    /// Stores `value` into this rank's published `word` and wakes sleeping ranks (full fence when ranks outnumber
    /// cores, see `oversubscribed`).
    fn publish(&self, word: &AtomicU64, value: u64) {
        let others = (0..self.seg.ranks).filter(|r| *r != self.rank);
        if self.oversubscribed {
            word.store(value, Ordering::SeqCst);
            others.for_each(|r| self.seg.wake(r));
        } else {
            word.store(value, Ordering::Release);
            others.for_each(|r| self.seg.wake_relaxed(r));
        }
    }
}

/// The CPUs the calling thread may run on, as [`ShmSegment::cpus`] publishes them.
fn allowed_cpus() -> u64 {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes it for the calling thread (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return u64::MAX;
        }
        let mut mask = 0u64;
        for c in 0..libc::CPU_SETSIZE as usize {
            if libc::CPU_ISSET(c, &set) {
                if c >= 64 {
                    return u64::MAX;
                }
                mask |= 1 << c;
            }
        }
        mask
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

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.global[self.rank]
    }

    fn size(&self) -> usize {
        self.seg.ranks
    }

    fn progress_send(&mut self, op: &mut SendOp<'_>) -> Result<bool> {
        self.ring_send(op)
    }

    fn progress_recv(&mut self, op: &mut RecvOp<'_>) -> Result<bool> {
        self.ring_recv(op)
    }

    fn wait(&mut self, send_peers: &[usize], recv_peers: &[usize], idle: u32) -> Result<()> {
        self.wait_inner(send_peers, recv_peers, idle, true)
    }

    fn spin_rounds(&self) -> u32 {
        self.spin
    }

    /// The board, when the segment's ranks are the whole job, numbered alike (this transport's ranks are then the
    /// communicator's); not when the segment is one host's part of a larger job (`attach_mapped`).
    fn shared_board(&mut self) -> Option<&mut dyn Board> {
        match self.whole_job_in_shared_memory() {
            true => Some(self),
            false => None,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPUs this process may run on.
    fn allowed() -> Vec<usize> {
        let mask = allowed_cpus();
        (0..64).filter(|c| mask & (1 << c) != 0).collect()
    }

    /// Binds the calling thread to CPU `cpu`.
    fn bind(cpu: usize) {
        // SAFETY: cpu_set_t is plain data; sched_setaffinity reads it for the calling thread (pid 0).
        unsafe {
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            assert_eq!(
                libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &one),
                0
            );
        }
    }

    /// Whether each of two ranks, attached from threads bound to `cpus` (as worker processes bound by a launcher
    /// are), waits as an oversubscribed rank.
    fn oversubscribed_when_bound(cpus: [usize; 2]) -> Vec<bool> {
        let seg = ShmSegment::create_anonymous(2, 4096).expect("segment");
        std::thread::scope(|s| {
            let ranks: Vec<_> = cpus
                .iter()
                .enumerate()
                .map(|(r, &cpu)| {
                    let seg = seg.clone();
                    s.spawn(move || {
                        bind(cpu);
                        let mut t = ShmTransport::attach(seg, r).expect("attach");
                        t.wait_attached(Duration::from_secs(10)).expect("attached");
                        t.oversubscribed
                    })
                })
                .collect();
            ranks
                .into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        })
    }

    #[test]
    fn ranks_bound_to_cores_of_their_own_are_not_oversubscribed() {
        let cpus = allowed();
        assert!(!cpus.is_empty(), "no CPU below 64 to run on");
        // Both on one core: oversubscribed (each alone sees one CPU, as before).
        assert_eq!(oversubscribed_when_bound([cpus[0], cpus[0]]), [true, true]);
        // A core each: each alone sees one CPU, but together they have two (unless a CPU quota allows fewer).
        if let [a, b, ..] = cpus[..] {
            let over = cores::quota_cpus().is_some_and(|q| q < 2);
            assert_eq!(oversubscribed_when_bound([a, b]), [over, over]);
        }
    }
}
