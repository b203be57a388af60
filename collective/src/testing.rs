//! Starting N ranks inside one process (one thread each), without a launcher: for tests, benchmarks and the
//! runtime's own tests.
//!
//! ```
//! use hvd_collective::testing::{Backend, LocalJob};
//! use hvd_collective::{DType, ReduceOp};
//!
//! let sums = LocalJob::new(3, Backend::Tcp)
//!     .run(|mut comm| {
//!         let mut x = (comm.rank() as f32 + 1.0).to_ne_bytes();
//!         comm.allreduce_in_place(&mut x, DType::F32, ReduceOp::Sum).unwrap();
//!         f32::from_ne_bytes(x)
//!     })
//!     .unwrap();
//! assert_eq!(sums, [6.0, 6.0, 6.0]);
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::time::Duration;

use crate::communicator::Communicator;
use crate::config::Thresholds;
use crate::error::{Error, Result};
use crate::p2p::P2pCommunicator;
use crate::shm::{ShmSegment, ShmTransport};
use crate::tcp::{JobKey, TcpTransport, listen};
use crate::transport::Transport;

/// Which communicator the in-process ranks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// TCP over loopback.
    Tcp,
    /// Shared memory.
    Shm,
    /// Shared memory inside each simulated host, TCP across (set hosts with [`LocalJob::hosts`]).
    Hierarchical,
}

/// A job of `size` ranks, each a thread of this process.
#[derive(Debug, Clone)]
pub struct LocalJob {
    size: usize,
    backend: Backend,
    timeout: Duration,
    hosts: Option<Vec<usize>>,
    thresholds: Option<Thresholds>,
    /// One rank's thresholds instead of the job's.
    rank_thresholds: Option<(usize, Thresholds)>,
    chunk_bytes: Option<usize>,
    pin: bool,
}

impl LocalJob {
    /// `size` ranks on `backend`, with a 30 s operation timeout.
    pub fn new(size: usize, backend: Backend) -> Self {
        LocalJob {
            size,
            backend,
            timeout: Duration::from_secs(30),
            hosts: None,
            thresholds: None,
            rank_thresholds: None,
            chunk_bytes: None,
            pin: false,
        }
    }

    /// The time a pending operation waits for a silent peer.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Simulated host index of every rank (hierarchical backend); default: two ranks per host.
    pub fn hosts(mut self, hosts: Vec<usize>) -> Self {
        self.hosts = Some(hosts);
        self
    }

    /// Pins rank `r`'s thread to CPU `r % cpus` in [`run`](Self::run) (like `mpirun --bind-to core`), for
    /// benchmarks.
    pub fn pin_threads(mut self, pin: bool) -> Self {
        self.pin = pin;
        self
    }

    /// Algorithm thresholds instead of the environment's.
    pub fn thresholds(mut self, thresholds: Thresholds) -> Self {
        self.thresholds = Some(thresholds);
        self
    }

    /// Rank `rank`'s thresholds instead of the job's: a setting a rank may hold alone (`allreduce_deposit_bytes`).
    pub fn rank_thresholds(mut self, rank: usize, thresholds: Thresholds) -> Self {
        self.rank_thresholds = Some((rank, thresholds));
        self
    }

    /// Per-rank block of one ring segment of a large allreduce instead of `HVD_ALLREDUCE_CHUNK_BYTES`'s.
    pub fn allreduce_chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = Some(bytes);
        self
    }

    fn host_list(&self) -> Vec<usize> {
        match (&self.hosts, self.backend) {
            (Some(h), _) => h.clone(),
            (None, Backend::Hierarchical) => (0..self.size).map(|r| r / 2).collect(),
            (None, _) => vec![0; self.size],
        }
    }

    /// Connects all ranks and returns their communicators, index = rank, ready to move into threads.
    pub fn communicators(&self) -> Result<Vec<Box<dyn Communicator>>> {
        let n = self.size;
        if n == 0 {
            return Err(Error::Bootstrap("a job needs at least one rank".into()));
        }
        let hosts = self.host_list();
        if hosts.len() != n {
            return Err(Error::Bootstrap(format!(
                "{} host indices given for {n} ranks",
                hosts.len()
            )));
        }
        let comms: Vec<Box<dyn Communicator>> = match self.backend {
            Backend::Tcp => self.tcp_ranks(&hosts)?,
            Backend::Shm => {
                let seg = ShmSegment::create_anonymous(n, crate::shm::ring_bytes_from_env())?;
                (0..n)
                    .map(|r| -> Result<Box<dyn Communicator>> {
                        let t = ShmTransport::attach(seg.clone(), r)?;
                        Ok(self.boxed(P2pCommunicator::new(t, "shm", hosts.clone(), self.timeout)))
                    })
                    .collect::<Result<_>>()?
            }
            Backend::Hierarchical => self.hierarchical_ranks(&hosts)?,
        };
        Ok(comms)
    }

    fn tcp_ranks(&self, hosts: &[usize]) -> Result<Vec<Box<dyn Communicator>>> {
        let n = self.size;
        let (listeners, addrs) = loopback_listeners(n)?;
        let timeout = self.timeout;
        // In-process ranks share a fresh random key: the handshake is the real one.
        let key = &JobKey::random()?;
        let transports: Vec<Result<TcpTransport>> = std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .iter()
                .enumerate()
                .map(|(r, l)| {
                    let addrs = &addrs;
                    s.spawn(move || TcpTransport::connect(r, l, addrs, key, timeout))
                })
                .collect();
            joined(handles)
        });
        transports
            .into_iter()
            .map(|t| -> Result<Box<dyn Communicator>> {
                Ok(self.boxed(P2pCommunicator::new(t?, "tcp", hosts.to_vec(), timeout)))
            })
            .collect()
    }

    fn hierarchical_ranks(&self, hosts: &[usize]) -> Result<Vec<Box<dyn Communicator>>> {
        let n = self.size;
        let (listeners, addrs) = loopback_listeners(n)?;
        let mut segments = std::collections::HashMap::new();
        for h in hosts {
            if !segments.contains_key(h) {
                let local = hosts.iter().filter(|x| *x == h).count();
                segments.insert(
                    *h,
                    ShmSegment::create_anonymous(local, crate::shm::ring_bytes_from_env())?,
                );
            }
        }
        let timeout = self.timeout;
        let key = &JobKey::random()?;
        let this = self;
        let results: Vec<Result<Box<dyn Communicator>>> = std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .iter()
                .enumerate()
                .map(|(r, l)| {
                    let addrs = &addrs;
                    let seg = segments[&hosts[r]].clone();
                    s.spawn(move || -> Result<Box<dyn Communicator>> {
                        let t = crate::hierarchical::MixedTransport::connect(
                            r, hosts, seg, l, addrs, key, timeout,
                        )?;
                        Ok(this.boxed(P2pCommunicator::new(
                            t,
                            "hierarchical",
                            hosts.to_vec(),
                            timeout,
                        )))
                    })
                })
                .collect();
            joined(handles)
        });
        results.into_iter().collect()
    }

    fn boxed<T: Transport + 'static>(&self, mut c: P2pCommunicator<T>) -> Box<dyn Communicator> {
        if let Some(t) = self.thresholds {
            c.set_thresholds(t);
        }
        if let Some((rank, t)) = self.rank_thresholds
            && c.rank() == rank
        {
            c.set_thresholds(t);
        }
        if let Some(b) = self.chunk_bytes {
            c.set_allreduce_chunk_bytes(b);
        }
        Box::new(c)
    }

    /// Runs `f` on every rank, each on its own thread, and returns the results in rank order.
    pub fn run<R: Send>(&self, f: impl Fn(Box<dyn Communicator>) -> R + Sync) -> Result<Vec<R>> {
        let comms = self.communicators()?;
        let f = &f;
        let pin = self.pin;
        Ok(std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(r, c)| {
                    s.spawn(move || {
                        if pin {
                            pin_to_cpu(r);
                        }
                        f(c)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        }))
    }
}

/// How many two-level header exchanges (ranks on several hosts, the same number on each: `p2p/two_level.rs`) the
/// communicators driven by the calling thread have run, and how many rounds of alltoall counts followed one: a
/// test tells that path from the flat exchange (and from the shm board) by the first, and sees that an alltoallv
/// sends its counts once, not again with its verdicts, by the second. [`LocalJob::run`] drives each rank on a
/// thread of its own.
pub fn two_level_rounds() -> (u64, u64) {
    crate::p2p::two_level_rounds()
}

/// How many allreduces the communicators driven by the calling thread reduced out of the shm board's deposits
/// (ranks beyond cores, see `Board::deposit_room`): a test tells that path from the others by it.
pub fn deposited_allreduces() -> u64 {
    crate::p2p::deposited_allreduces()
}

/// Best effort: binds the calling thread to the `index`-th CPU it may run on (as `mpirun --bind-to core`; in a
/// single-threaded process, the process).
pub fn pin_to_cpu(index: usize) {
    // SAFETY: cpu_set_t is plain data; sched_{get,set}affinity read/write it for the calling thread (pid 0).
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut allowed) != 0 {
            return;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|c| libc::CPU_ISSET(*c, &allowed))
            .collect();
        if cpus.is_empty() {
            return;
        }
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus[index % cpus.len()], &mut one);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &one);
    }
}

/// The environment that makes a process rank `rank` of a `size`-rank job without a launcher: the ranks find each
/// other through `rendezvous_dir` (a fresh directory all of them can reach) and group into hosts by `hostname`.
/// A listener on loopback for each of `n` ranks, and their addresses.
fn loopback_listeners(n: usize) -> Result<(Vec<TcpListener>, Vec<SocketAddr>)> {
    let listeners = (0..n)
        .map(|_| listen(IpAddr::V4(Ipv4Addr::LOCALHOST)))
        .collect::<Result<Vec<_>>>()?;
    let addrs = listeners
        .iter()
        .map(|l| {
            l.local_addr()
                .map_err(|e| Error::io("read a listener's address", e))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((listeners, addrs))
}

/// The results of the connecting threads, in rank order (a panic as an error).
fn joined<T>(handles: Vec<std::thread::ScopedJoinHandle<'_, Result<T>>>) -> Vec<Result<T>> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(Error::Broken("connect panicked".into())))
        })
        .collect()
}

/// Start `size` processes with these variables and have each call [`crate::bootstrap::from_env`].
pub fn process_env(
    rank: usize,
    size: usize,
    rendezvous_dir: &std::path::Path,
    hostname: &str,
) -> Vec<(&'static str, String)> {
    use crate::env_vars;
    vec![
        (env_vars::HVD_RANK, rank.to_string()),
        (env_vars::HVD_SIZE, size.to_string()),
        (
            env_vars::HVD_RENDEZVOUS,
            format!("file:{}", rendezvous_dir.display()),
        ),
        (env_vars::HVD_HOSTNAME, hostname.to_string()),
    ]
}
