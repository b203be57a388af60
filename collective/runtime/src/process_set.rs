//! Process sets (Horovod's): groups of the job's ranks that run collectives among themselves, each on its own
//! communicator driven by its own [`Engine`], so negotiation, fusion, the response cache and the stall inspector
//! are per set.
//!
//! Adding a set is collective over the whole job (every rank calls it, in the same order): the ranks first agree,
//! through the job's engine, on what is added (an allgather of each rank's request, so ranks that disagree all get
//! the same error) and on a tag unique to this join of the set; then the members join among themselves through the
//! job's rendezvous under that tag ([`hvd_collective::bootstrap::connect_group`]), ranked by their position in the
//! sorted member list. A set of one rank needs no peer. Removing a set shuts its engine down (collective over its
//! members).

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
        "the ranks disagree on the process set to add (every rank must add the same sets in the same order): {0}"
    )]
    Disagree(String),
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
    #[error("failed to agree on the process set to add")]
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
    /// Held through a whole add (adds are collective and numbered: one at a time on a rank).
    adding: Mutex<Adds>,
}

struct Adds {
    /// The id the next added set gets, the same on every rank (sets are added collectively, in order).
    next_id: i32,
    /// Collective adds so far, naming each one's agreement.
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
        }
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
        adds.count += 1;
        let id = adds.next_id;
        let nonce = if topology.rank == 0 { nonce() } else { 0 };
        let mine = [digest(requested) as i64, i64::from(id), nonce as i64];
        let data: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        let request = Request::owned(
            OpKind::Allgather,
            &format!("hvd.add_process_set.{}", adds.count),
            DType::I64,
            vec![3],
            data,
        );
        let handle = global.enqueue(request).map_err(ProcessSetError::Agree)?;
        let out = global.wait(handle).map_err(ProcessSetError::Agree)?;
        let all: Vec<i64> = out
            .data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect();
        if all.len() != 3 * topology.size {
            return Err(ProcessSetError::Disagree(format!(
                "the agreement carried {} values, expected {}",
                all.len(),
                3 * topology.size
            )));
        }
        if let Some((rank, theirs)) = all
            .chunks_exact(3)
            .enumerate()
            .find(|(_, v)| v[0] != mine[0] || v[1] != mine[1])
        {
            let what = if theirs[0] != mine[0] {
                "other ranks".to_string()
            } else {
                format!(
                    "them as set {} (it has added a different number of sets)",
                    theirs[1]
                )
            };
            return Err(ProcessSetError::Disagree(format!(
                "rank {} asked for ranks {requested:?} as set {id}; rank {rank} asked for {what}",
                topology.rank
            )));
        }
        // Agreed: the id is spent whatever follows, on every rank alike.
        if id >= MAX_ID {
            return Err(ProcessSetError::TooMany);
        }
        adds.next_id += 1;
        let tag = format!("ps{id}-{:x}", all[2] as u64);
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

    /// Removes set `id` (every rank of the job calls it, as in Horovod): its members shut its engine down
    /// (collectively among them, as `hvd_shutdown` does for the job), the others forget it.
    pub fn remove(&self, id: i32) -> Result<(), ProcessSetError> {
        if id == GLOBAL {
            return Err(ProcessSetError::RemoveGlobal);
        }
        let set = lock(&self.sets)
            .remove(&id)
            .ok_or(ProcessSetError::Unknown(id))?;
        if let Some(engine) = set.engine {
            engine.shutdown();
        }
        Ok(())
    }

    /// Shuts every set's engine down (before the job's), in id order: the same on every rank.
    pub fn shutdown(&self) {
        let sets = std::mem::take(&mut *lock(&self.sets));
        for (_, set) in sets {
            if let Some(engine) = set.engine {
                engine.shutdown();
            }
        }
    }
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

/// FNV-1a over the requested ranks as given (order included: ranks that list a set differently disagree).
fn digest(requested: &[i64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in (requested.len() as u64)
        .to_le_bytes()
        .into_iter()
        .chain(requested.iter().flat_map(|r| r.to_le_bytes()))
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
        assert_ne!(digest(&[0, 1]), digest(&[1, 0]));
        assert_ne!(digest(&[0, 1]), digest(&[0, 1, 2]));
        assert_eq!(digest(&[2, 3]), digest(&[2, 3]));
    }
}
