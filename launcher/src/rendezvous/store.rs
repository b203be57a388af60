//! The rendezvous server's state: stored values (with every byte counted), the ranks that joined, Horovod's gloo scope
//! bookkeeping.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// A refused change to the store, with the one-line reason the peer is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoreError {
    /// The store would exceed its byte limit.
    Full,
    /// `X-Hvd-Rank` names no rank of the job.
    NotARank { rank: u32, size: u32 },
    /// The rank already joined from another process (a different `X-Hvd-Join`).
    AlreadyJoined { rank: u32 },
    /// A gloo finish mark for a scope whose key is not a rank of that scope.
    NotAScopeRank { scope: String, size: usize },
}

impl StoreError {
    pub(crate) fn status(&self) -> u16 {
        match self {
            StoreError::Full => 507,
            StoreError::NotARank { .. } | StoreError::NotAScopeRank { .. } => 400,
            StoreError::AlreadyJoined { .. } => 409,
        }
    }

    pub(crate) fn reason(&self) -> String {
        match self {
            StoreError::Full => "rendezvous store is full".into(),
            StoreError::NotARank { rank, size } => {
                format!("x-hvd-rank {rank} is not a rank of this job (ranks are 0..{size})")
            }
            StoreError::AlreadyJoined { rank } => format!(
                "rank {rank} already joined from another process (its x-hvd-join differs); is a rank started twice?"
            ),
            StoreError::NotAScopeRank { scope, size } => {
                format!("a finished mark in gloo scope `{scope}` must be a rank 0..{size}")
            }
        }
    }
}

/// Everything the server stores. Every value is charged with its scope and key bytes too, so many small keys cannot
/// grow the store past its limit.
pub(crate) struct Store {
    values: HashMap<(String, String), Vec<u8>>,
    bytes: usize,
    max_bytes: usize,
    /// The job's size once known; joined marks are only taken for ranks below it.
    size: Option<u32>,
    /// Ranks below this are accepted while the size is unknown.
    max_ranks: u32,
    /// rank -> the `X-Hvd-Join` identity it joined with (`None`: a client that sends none).
    joined: BTreeMap<u32, Option<String>>,
    /// Horovod's fixed gloo scopes (`global`, `local_<host>`, `cross_<local rank>`) and how many ranks use each: a
    /// scope is cleared once that many ranks have DELETEd their key in it (Horovod's own server does the same).
    gloo_scope_sizes: BTreeMap<String, usize>,
    gloo_finished: BTreeMap<String, BTreeSet<usize>>,
    /// An elastic step's membership (rounds, ranks); `None`: the job is not elastic.
    pub(crate) elastic: Option<super::elastic::Membership>,
}

/// What one stored entry costs against the limit.
fn cost(scope: &str, key: &str, value: &[u8]) -> usize {
    scope.len() + key.len() + value.len()
}

impl Store {
    pub(crate) fn new(max_bytes: usize, max_ranks: u32) -> Store {
        Store {
            values: HashMap::new(),
            bytes: 0,
            max_bytes,
            size: None,
            max_ranks,
            joined: BTreeMap::new(),
            gloo_scope_sizes: BTreeMap::new(),
            gloo_finished: BTreeMap::new(),
            elastic: None,
        }
    }

    /// Bytes charged against the limit (values, keys and scopes).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn get(&self, scope: &str, key: &str) -> Option<&Vec<u8>> {
        // Lookups by a borrowed pair would need a custom key type; the clone is two short strings.
        self.values.get(&(scope.to_owned(), key.to_owned()))
    }

    pub(crate) fn put(&mut self, scope: &str, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let id = (scope.to_owned(), key.to_owned());
        let old = self.values.get(&id).map_or(0, |v| cost(scope, key, v));
        let new_total = (self.bytes - old).saturating_add(cost(scope, key, &value));
        if new_total > self.max_bytes {
            return Err(StoreError::Full);
        }
        self.bytes = new_total;
        self.values.insert(id, value);
        Ok(())
    }

    pub(crate) fn delete(&mut self, scope: &str, key: &str) {
        if let Some(old) = self.values.remove(&(scope.to_owned(), key.to_owned())) {
            self.bytes -= cost(scope, key, &old);
        }
    }

    fn clear_scope(&mut self, scope: &str) {
        let doomed: Vec<_> = self
            .values
            .keys()
            .filter(|(s, _)| s == scope)
            .cloned()
            .collect();
        for (s, k) in doomed {
            self.delete(&s, &k);
        }
    }

    pub(crate) fn set_size(&mut self, size: u32) {
        self.size = Some(size);
    }

    /// Marks `rank` as joined by the process `identity`. A rank joins once: later requests must come from the same
    /// identity. Returns whether this was the rank's first join.
    pub(crate) fn join(&mut self, rank: u32, identity: Option<&str>) -> Result<bool, StoreError> {
        let size = self.size.unwrap_or(self.max_ranks);
        if rank >= size {
            return Err(StoreError::NotARank { rank, size });
        }
        match self.joined.get(&rank) {
            Some(known) if known.as_deref() == identity => Ok(false),
            Some(_) => Err(StoreError::AlreadyJoined { rank }),
            None => {
                self.joined.insert(rank, identity.map(str::to_owned));
                Ok(true)
            }
        }
    }

    /// The `X-Hvd-Join` identity `rank` joined with (`Some(None)`: a client that sent none; `None`: not joined).
    pub(crate) fn identity(&self, rank: u32) -> Option<Option<&str>> {
        self.joined.get(&rank).map(Option::as_deref)
    }

    pub(crate) fn joined(&self) -> BTreeSet<u32> {
        self.joined.keys().copied().collect()
    }

    pub(crate) fn set_gloo_layout(&mut self, sizes: BTreeMap<String, usize>) {
        self.gloo_scope_sizes = sizes;
        self.gloo_finished.clear();
    }

    /// A gloo DELETE. In the layout's scopes it records that the rank named by `key` finished with the scope, and
    /// clears the scope (stored under `stored_scope`) once every rank of it has; elsewhere it removes the key.
    pub(crate) fn gloo_delete(
        &mut self,
        scope: &str,
        stored_scope: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        let Some(&size) = self.gloo_scope_sizes.get(scope) else {
            self.delete(stored_scope, key);
            return Ok(());
        };
        // Only ranks of the scope are recorded, so the set of finished marks stays as small as the scope.
        let rank = key
            .parse::<usize>()
            .ok()
            .filter(|r| *r < size)
            .ok_or_else(|| StoreError::NotAScopeRank {
                scope: scope.to_owned(),
                size,
            })?;
        let finished = self.gloo_finished.entry(scope.to_owned()).or_default();
        finished.insert(rank);
        if finished.len() >= size {
            self.gloo_finished.remove(scope);
            self.clear_scope(stored_scope);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_scopes_count_against_the_limit() {
        let mut s = Store::new(12, 4);
        s.put("ab", "cd", b"ef".to_vec()).unwrap();
        assert_eq!(s.bytes(), 6);
        // An empty value still costs its scope and key.
        assert_eq!(s.put("ab", "xyz", Vec::new()), Ok(()));
        assert_eq!(s.bytes(), 11);
        assert_eq!(s.put("ab", "long-key", Vec::new()), Err(StoreError::Full));
        s.delete("ab", "cd");
        s.delete("ab", "xyz");
        assert_eq!(s.bytes(), 0);
    }

    #[test]
    fn a_rank_joins_once_and_only_below_the_size() {
        let mut s = Store::new(100, 8);
        assert!(matches!(s.join(8, None), Err(StoreError::NotARank { .. })));
        s.set_size(2);
        assert_eq!(s.join(1, Some("a")), Ok(true));
        assert_eq!(s.join(1, Some("a")), Ok(false));
        assert_eq!(
            s.join(1, Some("b")),
            Err(StoreError::AlreadyJoined { rank: 1 })
        );
        assert_eq!(s.join(1, None), Err(StoreError::AlreadyJoined { rank: 1 }));
        assert!(matches!(
            s.join(u32::MAX, Some("a")),
            Err(StoreError::NotARank { size: 2, .. })
        ));
        assert_eq!(s.joined().into_iter().collect::<Vec<_>>(), vec![1]);
    }
}
