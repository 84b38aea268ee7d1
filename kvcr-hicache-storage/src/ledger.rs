//! The publication ledger (pure): which pages this rank group has said are
//! stored, so each gets exactly one `Stored` and, after any rank evicts it,
//! exactly one `Removed`.
//!
//! The runner's own inventory events are per rank and per segment; the
//! backend does not forward them. It feeds the ledger only rank-agreed facts:
//! pages every rank committed (after the MIN-reduce of `batch_set`) and the
//! union of every rank's evictions (after the all-gather). Every rank runs the
//! same ledger transitions in the same order, so their ledgers stay equal and
//! any rank's sink publishes the group's inventory.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use kvcr_foundation::{BlockKey, InventoryEvent, InventoryScope, InventorySink};

/// Most removed page hashes kept for [`crate::KvcrHiCacheStorage::take_removed_page_hashes`].
pub const MAX_REMOVED_BACKLOG: usize = 1 << 20;

/// Tokens of the pages of one `batch_set`, for their `Stored` events, and the
/// namespace they belong to as a router indexes it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PageTokens {
    /// The key of the page before `keys[0]` in the request, if any.
    pub parent: Option<BlockKey>,
    /// `keys.len() * page_size` real token ids, in key order.
    pub token_ids: Vec<u32>,
    /// The LoRA adapter the pages were computed with (`None`: the base model).
    pub lora_name: Option<String>,
    /// The adapter's numeric id, where the engine has one.
    pub lora_id: Option<u64>,
    /// The tenant's cache salt (`None`: unsalted).
    pub cache_salt: Option<String>,
}

#[derive(Debug)]
pub(crate) struct Ledger {
    scope: InventoryScope,
    block_size: u32,
    published: HashSet<BlockKey>,
    removed_backlog: VecDeque<BlockKey>,
}

impl Ledger {
    pub(crate) fn new(scope: InventoryScope, block_size: u32) -> Self {
        Self {
            scope,
            block_size,
            published: HashSet::new(),
            removed_backlog: VecDeque::new(),
        }
    }

    pub(crate) fn is_published(&self, key: &BlockKey) -> bool {
        self.published.contains(key)
    }

    pub(crate) fn published_len(&self) -> usize {
        self.published.len()
    }

    /// `Stored` events for the agreed pages of one batch that are not yet
    /// published: one event per run of consecutive such pages (so each
    /// event's parent is the page before it in the request). Without tokens
    /// for the whole batch nothing is published (returned as the second value:
    /// agreed pages left unpublished).
    pub(crate) fn stored(
        &mut self,
        keys: &[BlockKey],
        agreed: &[bool],
        tokens: Option<&PageTokens>,
    ) -> (Vec<InventoryEvent>, usize) {
        let page = self.block_size as usize;
        let new = |i: usize, key: &BlockKey, published: &HashSet<BlockKey>| {
            agreed.get(i).copied().unwrap_or(false) && !published.contains(key)
        };
        let Some(tokens) = tokens.filter(|t| t.token_ids.len() == keys.len() * page) else {
            let unpublished = keys
                .iter()
                .enumerate()
                .filter(|(i, k)| new(*i, k, &self.published))
                .count();
            return (Vec::new(), unpublished);
        };
        let mut events = Vec::new();
        let mut i = 0;
        while i < keys.len() {
            let Some(key) = keys.get(i) else { break };
            if !new(i, key, &self.published) {
                i += 1;
                continue;
            }
            let start = i;
            let mut run = Vec::new();
            while let Some(k) = keys.get(i).filter(|k| new(i, k, &self.published)) {
                // A key repeated inside one run would be a self-parent chain.
                if run.contains(k) {
                    break;
                }
                run.push(*k);
                i += 1;
            }
            let parent = match start.checked_sub(1) {
                Some(prev) => keys.get(prev).copied(),
                None => tokens.parent,
            };
            let token_ids = tokens
                .token_ids
                .get(start * page..i * page)
                .unwrap_or_default()
                .to_vec();
            self.published.extend(run.iter().copied());
            events.push(InventoryEvent::Stored {
                scope: self.scope,
                keys: run,
                parent,
                token_ids,
                block_size: self.block_size,
                lora_name: tokens.lora_name.clone(),
                lora_id: tokens.lora_id,
                cache_salt: tokens.cache_salt.clone(),
            });
        }
        (events, 0)
    }

    /// The `Removed` event for the published pages among `evicted` (the
    /// union of every rank's evictions), each exactly once.
    pub(crate) fn removed(
        &mut self,
        evicted: impl IntoIterator<Item = BlockKey>,
    ) -> Option<InventoryEvent> {
        let mut keys = Vec::new();
        for key in evicted {
            if self.published.remove(&key) {
                keys.push(key);
                if self.removed_backlog.len() == MAX_REMOVED_BACKLOG {
                    self.removed_backlog.pop_front();
                }
                self.removed_backlog.push_back(key);
            }
        }
        (!keys.is_empty()).then_some(InventoryEvent::Removed {
            scope: self.scope,
            keys,
        })
    }

    pub(crate) fn take_removed(&mut self) -> Vec<BlockKey> {
        self.removed_backlog.drain(..).collect()
    }
}

/// Most local evictions buffered between two exchanges.
pub(crate) const MAX_PENDING_EVICTIONS: usize = 1 << 20;

/// The runner's inventory sink: keeps the page keys of `Removed` events
/// (evictions on this rank) for the next exchange; everything else is dropped
/// (the ledger publishes the group's view instead). Runs under the runner's
/// lock: it only appends to a vector.
#[derive(Debug, Clone, Default)]
pub(crate) struct EvictionCollector {
    pub(crate) pending: Arc<Mutex<Vec<BlockKey>>>,
}

impl InventorySink for EvictionCollector {
    fn publish(&mut self, event: &InventoryEvent) {
        if let InventoryEvent::Removed { keys, .. } = event {
            let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            let room = MAX_PENDING_EVICTIONS.saturating_sub(pending.len());
            pending.extend(keys.iter().copied().take(room));
        }
    }
}

#[cfg(test)]
mod tests {
    use kvcr_foundation::{Medium, NamespaceId, Owner};

    use super::*;

    fn scope() -> InventoryScope {
        InventoryScope {
            owner: Owner::Kvcr,
            namespace: NamespaceId(7),
            medium: Medium::External,
        }
    }

    fn k(v: u64) -> BlockKey {
        BlockKey::from_u64(v)
    }

    #[test]
    fn stored_runs_follow_the_chain_and_publish_once() {
        let mut ledger = Ledger::new(scope(), 2);
        let tokens = PageTokens {
            parent: Some(k(100)),
            token_ids: (0..8).collect(),
            ..PageTokens::default()
        };
        let keys = [k(1), k(2), k(3), k(4)];
        let (events, unpublished) = ledger.stored(&keys, &[true, true, false, true], Some(&tokens));
        assert_eq!(unpublished, 0);
        assert_eq!(events.len(), 2);
        match &events[0] {
            InventoryEvent::Stored {
                keys,
                parent,
                token_ids,
                ..
            } => {
                assert_eq!(keys, &[k(1), k(2)]);
                assert_eq!(*parent, Some(k(100)));
                assert_eq!(token_ids, &[0, 1, 2, 3]);
            }
            other => panic!("{other:?}"),
        }
        match &events[1] {
            InventoryEvent::Stored {
                keys,
                parent,
                token_ids,
                ..
            } => {
                assert_eq!(keys, &[k(4)]);
                assert_eq!(*parent, Some(k(3)));
                assert_eq!(token_ids, &[6, 7]);
            }
            other => panic!("{other:?}"),
        }
        // Again: nothing new.
        let (events, _) = ledger.stored(&keys, &[true; 4], Some(&tokens));
        assert_eq!(events.len(), 1, "only page 3 is new: {events:?}");
    }

    #[test]
    fn removed_exactly_once_per_stored() {
        let mut ledger = Ledger::new(scope(), 1);
        let tokens = PageTokens {
            parent: None,
            token_ids: vec![1, 2],
            ..PageTokens::default()
        };
        ledger.stored(&[k(1), k(2)], &[true, true], Some(&tokens));
        let removed = ledger.removed([k(2), k(2), k(9)]);
        assert_eq!(
            removed,
            Some(InventoryEvent::Removed {
                scope: scope(),
                keys: vec![k(2)]
            })
        );
        assert_eq!(ledger.removed([k(2)]), None);
        assert_eq!(ledger.take_removed(), vec![k(2)]);
        assert!(ledger.take_removed().is_empty());
    }

    #[test]
    fn without_tokens_nothing_is_published() {
        let mut ledger = Ledger::new(scope(), 4);
        let (events, unpublished) = ledger.stored(&[k(1)], &[true], None);
        assert!(events.is_empty());
        assert_eq!(unpublished, 1);
        assert_eq!(ledger.removed([k(1)]), None);
    }
}

#[cfg(test)]
mod model {
    //! Model-based property test: any sequence of agreed stores and evicted
    //! unions publishes, per key, alternating Stored / Removed starting with
    //! Stored, and the ledger's published set equals the model's.

    use std::collections::{HashMap, HashSet};

    use kvcr_foundation::{Medium, NamespaceId, Owner};
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Step {
        Store {
            keys: Vec<u64>,
            agreed: Vec<bool>,
            tokens: bool,
        },
        Evict(Vec<u64>),
        Drain,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (
                proptest::collection::vec((0u64..12, any::<bool>()), 0..6),
                any::<bool>()
            )
                .prop_map(|(pairs, tokens)| Step::Store {
                    keys: pairs.iter().map(|p| p.0).collect(),
                    agreed: pairs.iter().map(|p| p.1).collect(),
                    tokens,
                }),
            proptest::collection::vec(0u64..12, 0..6).prop_map(Step::Evict),
            Just(Step::Drain),
        ]
    }

    proptest! {
        #[test]
        fn stored_and_removed_alternate(steps in proptest::collection::vec(step(), 0..40)) {
            let scope = InventoryScope { owner: Owner::Kvcr, namespace: NamespaceId(1), medium: Medium::External };
            let mut ledger = Ledger::new(scope, 2);
            let mut model: HashSet<u64> = HashSet::new();
            let mut last: HashMap<u64, bool> = HashMap::new(); // key -> last event was Stored
            let mut drained = Vec::new();
            let mut removed_total = Vec::new();
            for step in steps {
                match step {
                    Step::Store { keys, agreed, tokens } => {
                        let page_tokens = PageTokens { parent: None, token_ids: vec![0; keys.len() * 2], ..PageTokens::default() };
                        let block_keys: Vec<BlockKey> = keys.iter().map(|k| BlockKey::from_u64(*k)).collect();
                        let (events, _) = ledger.stored(&block_keys, &agreed, tokens.then_some(&page_tokens));
                        for e in &events {
                            let InventoryEvent::Stored { keys: stored, token_ids, .. } = e else {
                                panic!("{e:?}");
                            };
                            prop_assert_eq!(token_ids.len(), stored.len() * 2);
                            for k in stored {
                                prop_assert!(last.get(&k.as_u64()) != Some(&true), "stored twice: {:?}", k);
                                last.insert(k.as_u64(), true);
                                model.insert(k.as_u64());
                            }
                        }
                        if tokens {
                            for (k, a) in keys.iter().zip(&agreed) {
                                if *a { prop_assert!(model.contains(k)); }
                            }
                        }
                    }
                    Step::Evict(keys) => {
                        if let Some(InventoryEvent::Removed { keys: removed, .. }) =
                            ledger.removed(keys.iter().map(|k| BlockKey::from_u64(*k)))
                        {
                            for k in removed {
                                prop_assert_eq!(last.get(&k.as_u64()), Some(&true), "removed without stored");
                                last.insert(k.as_u64(), false);
                                model.remove(&k.as_u64());
                                removed_total.push(k);
                            }
                        }
                        for k in &keys { prop_assert!(!model.contains(k)); }
                    }
                    Step::Drain => drained.extend(ledger.take_removed()),
                }
                prop_assert_eq!(ledger.published_len(), model.len());
            }
            drained.extend(ledger.take_removed());
            prop_assert_eq!(drained, removed_total);
        }
    }
}
