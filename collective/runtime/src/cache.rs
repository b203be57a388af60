//! The response cache behind the negotiation fast path.
//!
//! Every rank holds an identical cache because entries are inserted and evicted only in reaction to the same
//! response lists and the same allreduced bit vectors, in the same order. A request whose parameters match its
//! cached entry is announced by one bit (its slot) instead of a message to the coordinator; when every rank sets the
//! bit, the tensor runs without the coordinator.

use std::collections::HashMap;

use crate::message::RequestMeta;

#[derive(Debug, Default)]
pub struct ResponseCache {
    capacity: usize,
    slots: Vec<Option<RequestMeta>>,
    by_name: HashMap<String, u32>,
}

/// What the cache says about a new request.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    Hit(u32),
    /// The name is cached with other parameters: the slot must be invalidated on every rank.
    Stale(u32),
    Miss,
}

/// Whether two requests for one name agree on everything the execution depends on.
pub fn same_parameters(a: &RequestMeta, b: &RequestMeta) -> bool {
    a.kind == b.kind
        && a.dtype == b.dtype
        && a.shape == b.shape
        && a.op == b.op
        && a.root == b.root
        && a.prescale.to_bits() == b.prescale.to_bits()
        && a.postscale.to_bits() == b.postscale.to_bits()
        && a.splits == b.splits
}

impl ResponseCache {
    pub fn new(capacity: usize) -> ResponseCache {
        ResponseCache {
            capacity,
            slots: Vec::new(),
            by_name: HashMap::new(),
        }
    }

    /// Number of slots (the bit vector's length); equal on every rank.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn lookup(&self, meta: &RequestMeta) -> Lookup {
        match self.by_name.get(&meta.name) {
            None => Lookup::Miss,
            Some(slot) => match &self.slots[*slot as usize] {
                Some(cached) if same_parameters(cached, meta) => Lookup::Hit(*slot),
                _ => Lookup::Stale(*slot),
            },
        }
    }

    pub fn slot_of(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    pub fn get(&self, slot: u32) -> Option<&RequestMeta> {
        self.slots.get(slot as usize).and_then(|s| s.as_ref())
    }

    /// Inserts into the lowest free slot; does nothing when full or already cached (deterministic on every rank).
    pub fn insert(&mut self, meta: &RequestMeta) {
        if self.by_name.contains_key(&meta.name) || !meta.kind.cacheable() {
            return;
        }
        let slot = match self.slots.iter().position(|s| s.is_none()) {
            Some(free) => free,
            None if self.slots.len() < self.capacity => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return,
        };
        self.slots[slot] = Some(meta.clone());
        self.by_name.insert(meta.name.clone(), slot as u32);
    }

    pub fn evict(&mut self, slot: u32) {
        if let Some(Some(meta)) = self.slots.get_mut(slot as usize).map(|s| s.take()) {
            self.by_name.remove(&meta.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::OpKind;
    use hvd_collective::{DType, ReduceOp};

    fn meta(name: &str, n: i64) -> RequestMeta {
        RequestMeta {
            kind: OpKind::Allreduce,
            name: name.into(),
            dtype: DType::F32,
            shape: vec![n],
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            splits: vec![],
        }
    }

    #[test]
    fn hits_stale_and_slot_reuse() {
        let mut c = ResponseCache::new(2);
        c.insert(&meta("a", 1));
        c.insert(&meta("b", 1));
        c.insert(&meta("c", 1));
        assert_eq!(c.len(), 2);
        assert_eq!(c.lookup(&meta("a", 1)), Lookup::Hit(0));
        assert_eq!(c.lookup(&meta("a", 2)), Lookup::Stale(0));
        assert_eq!(c.lookup(&meta("c", 1)), Lookup::Miss);
        c.evict(0);
        c.insert(&meta("c", 1));
        assert_eq!(c.lookup(&meta("c", 1)), Lookup::Hit(0));
    }
}
