//! Every environment variable this crate reads, in one place (documented in docs/collective.md).

use std::time::Duration;

use crate::error::{Error, Result};

/// Names of the environment variables read by the collective layer.
pub struct EnvVars;

impl EnvVars {
    /// Seconds a pending operation waits for a silent peer before failing (default 30).
    pub const TIMEOUT: &'static str = "HVD_COLLECTIVE_TIMEOUT";
    /// Allreduce messages up to this many bytes use recursive doubling, larger ones a ring (default 65536).
    pub const ALLREDUCE_SMALL_BYTES: &'static str = "HVD_ALLREDUCE_SMALL_BYTES";
    /// Allreduce messages with `bytes x (ranks - 1)` up to this go straight to every rank together with the
    /// operation header: one round trip in all (default 16384).
    pub const ALLREDUCE_DIRECT_BYTES: &'static str = "HVD_ALLREDUCE_DIRECT_BYTES";
    /// Large allreduces run the ring over segments of `ranks x` this many bytes, one after the other, so each
    /// segment's data is still in cache when its reduced blocks go round again (default 262144; 0: one segment).
    pub const ALLREDUCE_CHUNK_BYTES: &'static str = "HVD_ALLREDUCE_CHUNK_BYTES";
    /// With at least this many ranks on one shared-memory segment (and nobody else), allreduces beyond the direct
    /// path go through the segment's arenas: two waits per chunk and less traffic than a ring (default 3; 0: never).
    pub const ALLREDUCE_ARENA_RANKS: &'static str = "HVD_ALLREDUCE_ARENA_RANKS";
    /// Allgather totals up to this many bytes send directly to every rank, larger ones use a ring (default 262144).
    pub const ALLGATHER_SMALL_BYTES: &'static str = "HVD_ALLGATHER_SMALL_BYTES";
    /// Capacity of each shared-memory ring between two ranks, rounded to 4 KiB, at least 4 KiB (default 524288,
    /// `shm::DEFAULT_RING_BYTES`).
    pub const SHM_RING_BYTES: &'static str = "HVD_SHM_RING_BYTES";
    /// Fruitless polling rounds a waiting shm rank spins before it yields (default 4096, 4 when ranks outnumber
    /// cores).
    pub const SHM_SPIN: &'static str = "HVD_SHM_SPIN";
    /// Rounds a waiting shm rank yields its core before it sleeps on a futex (default 512, 8 when ranks
    /// outnumber cores).
    pub const SHM_YIELDS: &'static str = "HVD_SHM_YIELDS";
    /// Network interface whose address the tcp backend listens on (e.g. `eth0`).
    pub const TCP_INTERFACE: &'static str = "HVD_TCP_INTERFACE";
    /// Address the tcp backend listens on and advertises (overrides the interface).
    pub const TCP_ADDRESS: &'static str = "HVD_TCP_ADDRESS";
    /// Backend to use: `auto` (default), `shm`, `tcp`, `hierarchical`, `mpi`, `nccl`.
    pub const BACKEND: &'static str = "HVD_COLLECTIVE_BACKEND";
    /// Host name that groups ranks into hosts (set by the launcher; else the machine's host name).
    pub const HOSTNAME: &'static str = "HVD_HOSTNAME";
    pub const RANK: &'static str = "HVD_RANK";
    pub const SIZE: &'static str = "HVD_SIZE";
    pub const LOCAL_RANK: &'static str = "HVD_LOCAL_RANK";
    pub const LOCAL_SIZE: &'static str = "HVD_LOCAL_SIZE";
    pub const CROSS_RANK: &'static str = "HVD_CROSS_RANK";
    pub const CROSS_SIZE: &'static str = "HVD_CROSS_SIZE";
    /// `host:port` of the launcher's rendezvous server, or `file:DIR` for a directory shared by all ranks.
    pub const RENDEZVOUS: &'static str = "HVD_RENDEZVOUS";
    /// Token for the rendezvous server (`Authorization: Bearer`).
    pub const JOB_TOKEN: &'static str = "HVD_JOB_TOKEN";
}

/// Size thresholds that pick the algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    pub allreduce_direct_bytes: usize,
    pub allreduce_small_bytes: usize,
    pub allgather_small_bytes: usize,
    /// See [`EnvVars::ALLREDUCE_ARENA_RANKS`].
    pub allreduce_arena_ranks: usize,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            allreduce_direct_bytes: 16 << 10,
            allreduce_small_bytes: 64 << 10,
            allgather_small_bytes: 256 << 10,
            allreduce_arena_ranks: 3,
        }
    }
}

impl Thresholds {
    /// Defaults overridden by `HVD_ALLREDUCE_SMALL_BYTES` and `HVD_ALLGATHER_SMALL_BYTES` (bad values are
    /// ignored with a warning so a typo cannot stop a job).
    pub fn from_env() -> Thresholds {
        let d = Thresholds::default();
        Thresholds {
            allreduce_direct_bytes: env_usize(EnvVars::ALLREDUCE_DIRECT_BYTES)
                .unwrap_or(d.allreduce_direct_bytes),
            allreduce_small_bytes: env_usize(EnvVars::ALLREDUCE_SMALL_BYTES)
                .unwrap_or(d.allreduce_small_bytes),
            allgather_small_bytes: env_usize(EnvVars::ALLGATHER_SMALL_BYTES)
                .unwrap_or(d.allgather_small_bytes),
            allreduce_arena_ranks: env_usize(EnvVars::ALLREDUCE_ARENA_RANKS)
                .unwrap_or(d.allreduce_arena_ranks),
        }
    }
}

/// Default per-rank block of one ring segment of a large allreduce (see [`EnvVars::ALLREDUCE_CHUNK_BYTES`]).
pub const DEFAULT_ALLREDUCE_CHUNK_BYTES: usize = 256 << 10;

/// The allreduce segment block size from `HVD_ALLREDUCE_CHUNK_BYTES`, else the default.
pub fn allreduce_chunk_bytes_from_env() -> usize {
    env_usize(EnvVars::ALLREDUCE_CHUNK_BYTES).unwrap_or(DEFAULT_ALLREDUCE_CHUNK_BYTES)
}

pub(crate) fn env_usize(name: &str) -> Option<usize> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => {
            tracing::warn!(variable = name, value = %v, "ignoring a value that is not a whole number");
            None
        }
    }
}

/// The operation timeout from `HVD_COLLECTIVE_TIMEOUT` (seconds, fractions allowed), default 30 s.
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var(EnvVars::TIMEOUT) {
        Err(_) => Ok(Duration::from_secs(30)),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                Error::Bootstrap(format!(
                    "`{}={v}` is not a positive number of seconds",
                    EnvVars::TIMEOUT
                ))
            }),
    }
}
