//! Rounds of the rendezvous: the n-th time this process joins its job as one rank, the namespace of that join's keys,
//! and which keys a rank stored in its latest rounds (to delete them two rounds later).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use super::Rendezvous;

/// One join of the job by its ranks (`hvd.init()`; the next one after `hvd.shutdown()` is the next round). Every
/// rank counts its own joins, and ranks join and leave in lockstep (Horovod's test suites call init in setUp and
/// shutdown in tearDown around every test), so the ranks of one round agree on its number without asking anyone.
/// A round's keys live under `r<n>.` ([`Round::key`]): a rank of round n never reads a key of an earlier round (a
/// stale address, an old segment's name), and a rank beginning round n deletes what it stored in round n - 2, so the
/// store holds at most two rounds' keys per rank, however often the job is joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Round(u64);

impl Round {
    /// The first join of a process.
    pub const FIRST: Round = Round(1);

    /// Round `n` (from 1).
    pub fn new(n: u64) -> Round {
        Round(n)
    }

    pub fn number(self) -> u64 {
        self.0
    }

    pub fn next(self) -> Round {
        Round(self.0 + 1)
    }

    /// `key` in this round's namespace: `r<n>.<key>`.
    pub fn key(self, key: &str) -> String {
        format!("{self}.{key}")
    }
}

impl std::fmt::Display for Round {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// This process's latest round as one rank of one rendezvous, and the (namespaced) keys it stored in it and in the
/// round before.
struct Latest {
    round: Round,
    stored: Vec<String>,
    before: Vec<String>,
}

type Joins = HashMap<(Rendezvous, usize), Latest>;

/// Per rendezvous and rank, not per process: a test may run several ranks as threads of one process.
static JOINS: Mutex<Option<Joins>> = Mutex::new(None);

fn with_joins<R>(f: impl FnOnce(&mut Joins) -> R) -> R {
    let mut joins = JOINS.lock().unwrap_or_else(PoisonError::into_inner);
    f(joins.get_or_insert_with(HashMap::new))
}

/// Begins this process's next round n as `rank` of `rendezvous`: returns it and the keys the rank stored in round
/// n - 2, which no rank reads any more. Round n - 1's may still be read: a rank's join can complete before another
/// rank has read everything (across hosts, a rank that only meets the others through its host's leader), but no
/// rank is in round n - 2 once this one begins round n: this rank's round n - 1 read every rank's key of round
/// n - 1, which that rank stored once its round n - 2 was over.
pub(super) fn begin(rendezvous: &Rendezvous, rank: usize) -> (Round, Vec<String>) {
    with_joins(|joins| {
        let latest = joins.entry((rendezvous.clone(), rank)).or_insert(Latest {
            round: Round(0),
            stored: Vec::new(),
            before: Vec::new(),
        });
        latest.round = latest.round.next();
        let done = std::mem::replace(&mut latest.before, std::mem::take(&mut latest.stored));
        (latest.round, done)
    })
}

/// Begins round `round`, given by the launcher's server (an elastic job's rounds are the server's, not counted by
/// each rank: ranks that joined later or were left out count differently): returns the keys the rank stored two
/// joins ago, which no rank reads any more (every rank of `round` has finished the round before it).
pub(super) fn begin_at(rendezvous: &Rendezvous, rank: usize, round: Round) -> Vec<String> {
    with_joins(|joins| {
        let latest = joins.entry((rendezvous.clone(), rank)).or_insert(Latest {
            round: Round(0),
            stored: Vec::new(),
            before: Vec::new(),
        });
        latest.round = round;
        std::mem::replace(&mut latest.before, std::mem::take(&mut latest.stored))
    })
}

/// The latest round `rank` of `rendezvous` began in this process, if any.
pub(super) fn latest(rendezvous: &Rendezvous, rank: usize) -> Option<Round> {
    with_joins(|joins| joins.get(&(rendezvous.clone(), rank)).map(|l| l.round))
}

/// Records that `rank` stored `key` (already namespaced) in `round`, unless a later round has begun.
pub(super) fn stored(rendezvous: &Rendezvous, rank: usize, round: Round, key: &str) {
    with_joins(|joins| {
        if let Some(latest) = joins.get_mut(&(rendezvous.clone(), rank))
            && latest.round == round
            && !latest.stored.iter().any(|k| k == key)
        {
            latest.stored.push(key.to_string());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_of_each_rendezvous_counts_its_own_rounds() {
        let a = Rendezvous::Http {
            address: "127.0.0.1:1".into(),
            token: Some("round-test".into()),
        };
        let b = Rendezvous::Directory("/nonexistent/round-test".into());
        assert_eq!(begin(&a, 0).0, Round::FIRST);
        assert_eq!(begin(&a, 1).0, Round::FIRST);
        stored(&a, 0, Round::FIRST, "r1.addr.0");
        stored(&a, 0, Round::FIRST, "r1.addr.0");
        assert_eq!(begin(&b, 0).0, Round::FIRST);
        // Round 1's keys are deleted when round 3 begins, not before.
        assert_eq!(begin(&a, 0), (Round::new(2), Vec::new()));
        stored(&a, 0, Round::new(2), "r2.addr.0");
        // A late record of an earlier round is not kept.
        stored(&a, 0, Round::FIRST, "r1.shm.0");
        assert_eq!(begin(&a, 0), (Round::new(3), vec!["r1.addr.0".to_string()]));
        assert_eq!(begin(&a, 0), (Round::new(4), vec!["r2.addr.0".to_string()]));
        assert_eq!(Round::new(3).key("addr.0"), "r3.addr.0");
    }

    #[test]
    fn a_round_given_by_the_server_replaces_the_count() {
        let a = Rendezvous::Http {
            address: "127.0.0.1:1".into(),
            token: Some("round-at-test".into()),
        };
        assert_eq!(latest(&a, 0), None);
        assert!(begin_at(&a, 0, Round::new(1)).is_empty());
        stored(&a, 0, Round::new(1), "r1.addr.0");
        // The server's next round for this worker may skip numbers (rounds it was not part of).
        assert!(begin_at(&a, 0, Round::new(4)).is_empty());
        assert_eq!(latest(&a, 0), Some(Round::new(4)));
        assert_eq!(
            begin_at(&a, 0, Round::new(5)),
            vec!["r1.addr.0".to_string()]
        );
    }
}
