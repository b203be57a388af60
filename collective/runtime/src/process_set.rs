//! Process sets (Horovod's): groups of the job's ranks that run collectives among themselves, each on its own
//! communicator driven by its own [`Engine`], so negotiation, fusion, the response cache and the stall inspector
//! are per set.
//!
//! Adding a set is collective over the whole job (every rank calls it, in the same order): the ranks first agree,
//! through the job's engine, on what is added (an allgather of each rank's request, so ranks that disagree all get
//! the same error) and on a tag unique to this join of the set; then the members join among themselves through the
//! job's rendezvous under that tag ([`hvd_collective::bootstrap::connect_group`]), ranked by their position in the
//! sorted member list. A set of one rank needs no peer. Removing a set is agreed on the same way (every rank
//! removes the same set at the same point: ranks that disagree all get a MISMATCH error, never a hang), then its
//! members shut its engine down among themselves, bounded by [`ProcessSets::shutdown_timeout`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hvd_collective::{Communicator, DType};

use crate::config::EngineConfig;
use crate::engine::{Engine, EngineError, ErrorKind, Request};
use crate::message::OpKind;
use crate::transport::LocalTransport;

/// The global process set's id: every rank of the job, the job's own engine.
pub const GLOBAL: i32 = 0;
/// Set ids stay below this (the C ABI carries a set's id in its handles' high bits).
pub const MAX_ID: i32 = 1 << 22;
/// How long removing a set (or shutting the sets down) waits for the set's engine to stop, by default.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(60);

/// What an agreement is about (the first value each rank contributes).
const ADD: i64 = 1;
const REMOVE: i64 = 2;

/// Why a process set could not be added, removed or used.
#[derive(Debug, thiserror::Error)]
pub enum ProcessSetError {
    #[error("invalid process set {ranks:?}: {why}")]
    InvalidRanks { ranks: Vec<i64>, why: String },
    #[error(
        "a process set with ranks {0:?} exists already (Horovod refuses a duplicate process set)"
    )]
    Existing(Vec<usize>),
    #[error(
        "the ranks disagree on the process set to add or remove (every rank must add and remove the same sets in the same order): {0}"
    )]
    Disagree(String),
    #[error(
        "process set {id}'s engine did not stop within {timeout:?} (a member has not removed the set, or an operation on it is stuck): the set is forgotten, its engine left running"
    )]
    ShutdownTimeout { id: i32, timeout: Duration },
    #[error("unknown process set {0} (removed, never added, or added before a shutdown)")]
    Unknown(i32),
    #[error("the global process set (id 0) cannot be removed")]
    RemoveGlobal,
    #[error("too many process sets added (ids reach {MAX_ID})")]
    TooMany,
    #[error("rank {rank} is not a member of process set {id} (ranks {ranks:?})")]
    NotMember {
        rank: usize,
        id: i32,
        ranks: Vec<usize>,
    },
    #[error("failed to agree on the process set to add or remove")]
    Agree(#[source] EngineError),
    #[error("failed to join process set {id} (ranks {ranks:?})")]
    Connect {
        id: i32,
        ranks: Vec<usize>,
        #[source]
        source: hvd_collective::Error,
    },
    #[error("failed to start the engine of process set {id}")]
    Start {
        id: i32,
        #[source]
        source: EngineError,
    },
}

impl ProcessSetError {
    /// What a caller can do about it (the C ABI's `hvd_last_error_kind`).
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProcessSetError::InvalidRanks { .. }
            | ProcessSetError::Existing(_)
            | ProcessSetError::Unknown(_)
            | ProcessSetError::RemoveGlobal
            | ProcessSetError::TooMany
            | ProcessSetError::NotMember { .. } => ErrorKind::InvalidArgument,
            ProcessSetError::Disagree(_) => ErrorKind::Mismatch,
            ProcessSetError::ShutdownTimeout { .. } => ErrorKind::Stalled,
            ProcessSetError::Agree(e) | ProcessSetError::Start { source: e, .. } => e.kind(),
            ProcessSetError::Connect { source, .. } => ErrorKind::of_collective(source),
        }
    }

    /// The collective failure inside, if any (a lost peer's rank).
    pub fn collective(&self) -> Option<&hvd_collective::Error> {
        match self {
            ProcessSetError::Agree(e) | ProcessSetError::Start { source: e, .. } => e.collective(),
            ProcessSetError::Connect { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// One process set as this rank knows it.
#[derive(Clone)]
pub struct ProcessSet {
    ranks: Vec<usize>,
    /// This rank's engine for the set; none when this rank is not a member.
    engine: Option<Arc<Engine>>,
}

impl ProcessSet {
    /// The members' global ranks, ascending.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// The set's engine, when this rank is a member.
    pub fn engine(&self) -> Option<&Arc<Engine>> {
        self.engine.as_ref()
    }

    /// `global_rank`'s rank in the set (its position among the members).
    pub fn rank_of(&self, global_rank: usize) -> Option<usize> {
        self.ranks.binary_search(&global_rank).ok()
    }
}

/// Joins the members of a set of more than one rank: (this rank's position, the set's size, the join's tag).
pub type Connect<'a> =
    dyn Fn(usize, usize, &str) -> Result<Box<dyn Communicator>, hvd_collective::Error> + 'a;

/// The process sets of one join of the job (ids from 1; id 0 is the job itself), until shutdown. Shared by the
/// rank's threads: the table is locked only to look a set up or change it, never while a set is joined, agreed on
/// or shut down, so a thread using one set never waits for another set's add or remove.
pub struct ProcessSets {
    sets: Mutex<BTreeMap<i32, ProcessSet>>,
    /// Held through a whole add or remove (they are collective and numbered: one at a time on a rank).
    adding: Mutex<Adds>,
    /// How long a set's engine may take to stop.
    shutdown_timeout: Duration,
}

struct Adds {
    /// The id the next added set gets, the same on every rank (sets are added collectively, in order).
    next_id: i32,
    /// Collective adds and removes so far, naming each one's agreement.
    count: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Default for ProcessSets {
    fn default() -> ProcessSets {
        ProcessSets::new()
    }
}

impl ProcessSets {
    pub fn new() -> ProcessSets {
        ProcessSets {
            sets: Mutex::new(BTreeMap::new()),
            adding: Mutex::new(Adds {
                next_id: 1,
                count: 0,
            }),
            shutdown_timeout: SHUTDOWN_TIMEOUT,
        }
    }

    /// The same, waiting at most `timeout` for a set's engine to stop (on remove and shutdown).
    pub fn with_shutdown_timeout(timeout: Duration) -> ProcessSets {
        ProcessSets {
            shutdown_timeout: timeout,
            ..ProcessSets::new()
        }
    }

    /// How long a set's engine may take to stop before remove or shutdown gives up on it with an error.
    pub fn shutdown_timeout(&self) -> Duration {
        self.shutdown_timeout
    }

    /// Set `id` (its ranks and this rank's engine for it).
    pub fn get(&self, id: i32) -> Result<ProcessSet, ProcessSetError> {
        lock(&self.sets)
            .get(&id)
            .cloned()
            .ok_or(ProcessSetError::Unknown(id))
    }

    /// The ids of the sets, ascending.
    pub fn ids(&self) -> Vec<i32> {
        lock(&self.sets).keys().copied().collect()
    }

    /// Adds the set of `requested` global ranks, collectively: every rank of the job (whose engine is `global`)
    /// calls it with the same ranks, in the same order as its other adds. Returns the set's id. `connect` joins
    /// the members of a set of more than one rank; `config` is the set engine's (its timeline is never written:
    /// the job's engine writes the job's).
    pub fn add(
        &self,
        global: &Engine,
        requested: &[i64],
        config: &EngineConfig,
        connect: &Connect<'_>,
    ) -> Result<i32, ProcessSetError> {
        let topology = global.topology();
        let mut adds = lock(&self.adding);
        let id = adds.next_id;
        let nonce = if topology.rank == 0 { nonce() } else { 0 };
        let all = agree(
            global,
            &mut adds,
            [ADD, digest(requested) as i64, i64::from(id), nonce as i64],
            &format!("to add ranks {requested:?} as set {id}"),
        )?;
        // Agreed: the id is spent whatever follows, on every rank alike.
        if id >= MAX_ID {
            return Err(ProcessSetError::TooMany);
        }
        adds.next_id += 1;
        let tag = format!("ps{id}-{:x}", all[0][3] as u64);
        let ranks = validate(requested, topology.size)?;
        if ranks.len() == topology.size || lock(&self.sets).values().any(|s| s.ranks == ranks) {
            return Err(ProcessSetError::Existing(ranks));
        }
        let engine = match ranks.binary_search(&topology.rank) {
            Err(_) => None,
            Ok(member) => {
                let comm: Box<dyn Communicator> = if ranks.len() == 1 {
                    Box::new(single())
                } else {
                    connect(member, ranks.len(), &tag).map_err(|source| {
                        ProcessSetError::Connect {
                            id,
                            ranks: ranks.clone(),
                            source,
                        }
                    })?
                };
                let config = EngineConfig {
                    timeline: None,
                    ..config.clone()
                };
                let engine = Engine::start(comm, config)
                    .map_err(|source| ProcessSetError::Start { id, source })?;
                Some(Arc::new(engine))
            }
        };
        lock(&self.sets).insert(id, ProcessSet { ranks, engine });
        Ok(id)
    }

    /// Removes set `id`, collectively: every rank of the job (whose engine is `global`) calls it with the same id,
    /// in the same order as its other adds and removes (ranks that disagree all get [`ProcessSetError::Disagree`]
    /// and keep the set). Its members then shut its engine down (collectively among them, as `hvd_shutdown` does
    /// for the job, waiting at most [`ProcessSets::shutdown_timeout`]); the others forget it.
    pub fn remove(&self, global: &Engine, id: i32) -> Result<(), ProcessSetError> {
        let mut adds = lock(&self.adding);
        agree(
            global,
            &mut adds,
            [REMOVE, i64::from(id), 0, 0],
            &format!("to remove set {id}"),
        )?;
        drop(adds);
        if id == GLOBAL {
            return Err(ProcessSetError::RemoveGlobal);
        }
        let set = lock(&self.sets)
            .remove(&id)
            .ok_or(ProcessSetError::Unknown(id))?;
        match set.engine {
            Some(engine) => stop(id, engine, self.shutdown_timeout),
            None => Ok(()),
        }
    }

    /// Shuts every set's engine down (before the job's), in id order: the same on every rank. Each waits at most
    /// [`ProcessSets::shutdown_timeout`]; the first that does not stop is the error (the others are still tried).
    pub fn shutdown(&self) -> Result<(), ProcessSetError> {
        let sets = std::mem::take(&mut *lock(&self.sets));
        let mut first = Ok(());
        for (id, set) in sets {
            if let Some(engine) = set.engine {
                let stopped = stop(id, engine, self.shutdown_timeout);
                if first.is_ok() {
                    first = stopped;
                }
            }
        }
        first
    }
}

/// Agrees with every rank, through the job's engine, on one add or remove: an allgather of each rank's
/// `[kind, what, id, nonce]` (the first three must be equal everywhere). `mine` describes this rank's request for
/// the error. Returns every rank's values.
fn agree(
    global: &Engine,
    adds: &mut Adds,
    values: [i64; 4],
    mine: &str,
) -> Result<Vec<[i64; 4]>, ProcessSetError> {
    let topology = global.topology();
    adds.count += 1;
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let request = Request::owned(
        OpKind::Allgather,
        &format!("hvd.process_set.{}", adds.count),
        DType::I64,
        vec![4],
        data,
    );
    let handle = global.enqueue(request).map_err(ProcessSetError::Agree)?;
    let out = global.wait(handle).map_err(ProcessSetError::Agree)?;
    let all: Vec<[i64; 4]> = out
        .data
        .chunks_exact(32)
        .map(|c| {
            let mut v = [0i64; 4];
            for (x, b) in v.iter_mut().zip(c.chunks_exact(8)) {
                *x = i64::from_le_bytes(b.try_into().unwrap_or_default());
            }
            v
        })
        .collect();
    if all.len() != topology.size || out.data.len() != 32 * topology.size {
        return Err(ProcessSetError::Disagree(format!(
            "the agreement carried {} bytes, expected {}",
            out.data.len(),
            32 * topology.size
        )));
    }
    if let Some((rank, theirs)) = all.iter().enumerate().find(|(_, v)| v[..3] != values[..3]) {
        let what = match theirs[0] {
            REMOVE => format!("to remove set {}", theirs[1]),
            ADD if values[0] == ADD && theirs[1] == values[1] => format!(
                "to add them as set {} (it has added a different number of sets)",
                theirs[2]
            ),
            ADD => format!("to add other ranks as set {}", theirs[2]),
            _ => "something else".to_string(),
        };
        return Err(ProcessSetError::Disagree(format!(
            "rank {} asked {mine}; rank {rank} asked {what}",
            topology.rank
        )));
    }
    Ok(all)
}

/// Shuts set `id`'s engine down, waiting at most `timeout` (past it the engine is left to stop on its own thread).
fn stop(id: i32, engine: Arc<Engine>, timeout: Duration) -> Result<(), ProcessSetError> {
    let (done, stopped) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name(format!("hvd-ps{id}-shutdown"))
        .spawn(move || {
            engine.shutdown();
            let _ = done.send(());
        });
    if spawned.is_err() {
        return Err(ProcessSetError::ShutdownTimeout { id, timeout });
    }
    stopped
        .recv_timeout(timeout)
        .map_err(|_| ProcessSetError::ShutdownTimeout { id, timeout })
}

/// `requested` as ascending global ranks of a job of `size`: no duplicates, none outside the job, not empty.
pub fn validate(requested: &[i64], size: usize) -> Result<Vec<usize>, ProcessSetError> {
    let invalid = |why: String| ProcessSetError::InvalidRanks {
        ranks: requested.to_vec(),
        why,
    };
    if requested.is_empty() {
        return Err(invalid("a process set needs at least one rank".into()));
    }
    let mut ranks = Vec::with_capacity(requested.len());
    for &r in requested {
        match usize::try_from(r).ok().filter(|r| *r < size) {
            Some(r) => ranks.push(r),
            None => {
                return Err(invalid(format!(
                    "rank {r} is not a rank of the job (ranks are 0..{size})"
                )));
            }
        }
    }
    ranks.sort_unstable();
    if let Some(w) = ranks.windows(2).find(|w| w[0] == w[1]) {
        return Err(invalid(format!("rank {} appears twice", w[0])));
    }
    Ok(ranks)
}

/// FNV-1a over the requested ranks, sorted (as Horovod sorts a set's ranks: `[1, 0]` and `[0, 1]` are one set).
fn digest(requested: &[i64]) -> u64 {
    let mut sorted = requested.to_vec();
    sorted.sort_unstable();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in (sorted.len() as u64)
        .to_le_bytes()
        .into_iter()
        .chain(sorted.iter().flat_map(|r| r.to_le_bytes()))
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A value that tells this join of a set from an earlier one of the same id (after a shutdown and init, or in
/// another job on the same rendezvous directory): time and process.
fn nonce() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// The communicator of a set of one rank.
fn single() -> LocalTransport {
    LocalTransport::group(1, Duration::from_secs(1))
        .pop()
        .unwrap_or_else(|| unreachable!("a group of one has one member"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_sorted_and_bad_ones_refused() {
        assert_eq!(validate(&[3, 1], 4).unwrap(), vec![1, 3]);
        for (bad, what) in [
            (&[1, 1][..], "appears twice"),
            (&[0, 4][..], "not a rank of the job"),
            (&[-1][..], "not a rank of the job"),
            (&[][..], "at least one rank"),
        ] {
            let e = validate(bad, 4).unwrap_err();
            assert!(e.to_string().contains(what), "{bad:?}: {e}");
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        }
    }

    #[test]
    fn the_digest_tells_lists_apart() {
        assert_eq!(
            digest(&[0, 1]),
            digest(&[1, 0]),
            "the order of ranks is not part of a set"
        );
        assert_ne!(digest(&[0, 1]), digest(&[0, 2]));
        assert_ne!(digest(&[0, 1]), digest(&[0, 1, 2]));
        assert_eq!(digest(&[2, 3]), digest(&[2, 3]));
    }
}
