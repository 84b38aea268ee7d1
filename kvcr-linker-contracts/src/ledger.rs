//! The owned-inventory ledger: what a linker's lower tiers publish on the KV
//! event wire, and under whose name.
//!
//! Ownership rules ([`OwnershipPolicy`]):
//!
//! * GPU pages and the engine's own host pool are **framework-owned**: the
//!   engine publishes them and their clears; the ledger refuses them
//!   ([`Error::EngineTier`]) and never emits `AllCleared` for the framework.
//! * Lower tiers (KVCR DRAM, disk, external) are published by the ledger,
//!   under [`Owner::Kvcr`] only when the deployment opted that tier in, and
//!   under [`Owner::Framework`] (the engine's publisher, `ownership` absent)
//!   otherwise.
//!
//! Publication rules ([`InventoryLedger`]):
//!
//! * `Stored` goes out only when **every rank** reported success for an
//!   offload; one failure and nothing is published.
//! * At most one residency per (tier, namespace, key): a re-offload of a
//!   resident page publishes nothing for it.
//! * The removal identity (key, owner, namespace with its LoRA name,
//!   incarnation) lives in the ledger, not in the engine's GPU state, so GPU
//!   evictions and engine clears ([`FrameworkChange`]) change nothing and the
//!   matching `Removed` is still sent exactly once: when the store evicts the
//!   page, or when the linker resets.
//! * Events are grouped by [`InventoryScope`] only; two owners, namespaces or
//!   media never share an event.
//! * Each incarnation's first KVCR-owned `Stored` is preceded by an
//!   `AllCleared` barrier for [`Owner::Kvcr`].

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;

use kvcr_contracts::{
    BlockKey, Incarnation, InventoryEvent, InventoryScope, InventorySink, Namespace, NamespaceId,
    Owner, ScopedKey, Tier,
};

use crate::error::{Error, Result};

#[cfg(test)]
mod tests;

/// Which lower tiers the deployment opted into KVCR ownership.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnershipPolicy {
    kvcr_owned: BTreeSet<Tier>,
}

impl OwnershipPolicy {
    /// Nothing opted in: every lower tier is published as framework-owned.
    pub fn framework_owned() -> Self {
        Self::default()
    }

    /// Opts `tier` into KVCR ownership (`ownership: "kvcr"`). Engine tiers
    /// cannot be opted in.
    pub fn opt_in(mut self, tier: Tier) -> Result<Self> {
        Self::check_lower(tier)?;
        self.kvcr_owned.insert(tier);
        Ok(self)
    }

    /// Who owns inventory on `tier`; engine tiers are refused.
    pub fn owner_of(&self, tier: Tier) -> Result<Owner> {
        Self::check_lower(tier)?;
        Ok(if self.kvcr_owned.contains(&tier) {
            Owner::Kvcr
        } else {
            Owner::Framework
        })
    }

    fn check_lower(tier: Tier) -> Result<()> {
        match tier {
            Tier::Gpu | Tier::HostPinned => Err(Error::EngineTier { tier }),
            Tier::KvcrDram | Tier::Disk | Tier::External => Ok(()),
        }
    }
}

/// One page of an offload: its key and its real tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadPage {
    /// The page's key within its namespace.
    pub key: BlockKey,
    /// The page's tokens (`block_size` of them).
    pub token_ids: Vec<u32>,
}

/// An offload the ledger waits on: consecutive pages of one chain, to one tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offload {
    /// The pages' namespace (its LoRA name travels into `Stored`).
    pub namespace: Namespace,
    /// The tier written.
    pub tier: Tier,
    /// The key of the page before the first one, if any.
    pub parent: Option<BlockKey>,
    /// Tokens per page.
    pub block_size: u32,
    /// The pages, in chain order.
    pub pages: Vec<OffloadPage>,
}

/// An offload waiting for its ranks' outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OffloadId(u64);

/// A change in framework-owned inventory. The engine publishes these itself;
/// the ledger only observes them, emits nothing, and keeps every removal
/// identity it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameworkChange {
    /// The engine evicted these pages from its GPU pools.
    DeviceEvicted(Vec<ScopedKey>),
    /// The engine cleared its GPU cache.
    EngineCleared,
}

/// Everything needed to publish the removal of one residency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemovalIdentity {
    /// The tier holding the page.
    pub tier: Tier,
    /// The owner it was published under.
    pub owner: Owner,
    /// Its namespace (with the LoRA name).
    pub namespace: Namespace,
    /// The page.
    pub key: BlockKey,
    /// The incarnation it was published in.
    pub incarnation: Incarnation,
}

#[derive(Debug)]
struct Pending {
    offload: Offload,
    owner: Owner,
    reported: Vec<Option<bool>>,
    /// Pages from this index on were evicted while the offload was pending;
    /// they (and the chain after them) are never published.
    cut_at: usize,
}

#[derive(Debug)]
struct Residency {
    owner: Owner,
    namespace: Namespace,
    incarnation: Incarnation,
}

type ResidencyKey = (Tier, NamespaceId, BlockKey);

/// Turns rank-agreed offloads, store evictions and resets into
/// [`InventoryEvent`]s (see the module docs for the rules).
#[derive(Debug)]
pub struct InventoryLedger {
    policy: OwnershipPolicy,
    ranks: NonZeroU32,
    incarnation: Incarnation,
    kvcr_barrier_sent: bool,
    pending: BTreeMap<OffloadId, Pending>,
    resident: BTreeMap<ResidencyKey, Residency>,
    next_offload: u64,
    framework_changes: u64,
}

impl InventoryLedger {
    /// A ledger for a group of `ranks` ranks, publishing for `incarnation`.
    pub fn new(policy: OwnershipPolicy, ranks: NonZeroU32, incarnation: Incarnation) -> Self {
        Self {
            policy,
            ranks,
            incarnation,
            kvcr_barrier_sent: false,
            pending: BTreeMap::new(),
            resident: BTreeMap::new(),
            next_offload: 0,
            framework_changes: 0,
        }
    }

    /// Registers an offload every rank performs; nothing is published until
    /// all ranks report ([`Self::rank_result`]).
    pub fn begin_offload(&mut self, offload: Offload) -> Result<OffloadId> {
        let owner = self.policy.owner_of(offload.tier)?;
        if offload.block_size == 0 {
            return Err(Error::ZeroBlockSize);
        }
        if offload.pages.is_empty() {
            return Err(Error::EmptyOffload);
        }
        for (page, p) in offload.pages.iter().enumerate() {
            if usize::try_from(offload.block_size).ok() != Some(p.token_ids.len()) {
                return Err(Error::TokenCount {
                    page,
                    expected: offload.block_size,
                    got: p.token_ids.len(),
                });
            }
        }
        self.next_offload += 1;
        let id = OffloadId(self.next_offload);
        let ranks = usize::try_from(self.ranks.get()).unwrap_or(usize::MAX);
        let cut_at = offload.pages.len();
        self.pending.insert(
            id,
            Pending {
                offload,
                owner,
                reported: vec![None; ranks],
                cut_at,
            },
        );
        Ok(id)
    }

    /// One rank's outcome for `offload`. When the last rank reports, returns
    /// the `Stored` events (if every rank succeeded) and forgets the offload.
    pub fn rank_result(
        &mut self,
        offload: OffloadId,
        rank: u32,
        success: bool,
    ) -> Result<Vec<InventoryEvent>> {
        if rank >= self.ranks.get() {
            return Err(Error::RankOutOfRange {
                rank,
                ranks: self.ranks.get(),
            });
        }
        let pending = self
            .pending
            .get_mut(&offload)
            .ok_or(Error::UnknownOffload { offload })?;
        let slot = usize::try_from(rank)
            .ok()
            .and_then(|r| pending.reported.get_mut(r))
            .ok_or(Error::RankOutOfRange {
                rank,
                ranks: self.ranks.get(),
            })?;
        if slot.is_some() {
            return Err(Error::RankReportedTwice { offload, rank });
        }
        *slot = Some(success);
        if pending.reported.iter().any(Option::is_none) {
            return Ok(Vec::new());
        }
        let Some(done) = self.pending.remove(&offload) else {
            return Ok(Vec::new());
        };
        if done.reported.iter().all(|r| *r == Some(true)) {
            Ok(self.commit(done))
        } else {
            Ok(Vec::new())
        }
    }

    /// The store behind `tier` evicted `keys` (in `incarnation`). Each
    /// resident page yields its removal exactly once; pages never published
    /// yield nothing, and a pending offload will not publish them (nor the
    /// chain after them). Reports from an earlier incarnation are ignored: the
    /// reset already removed those pages.
    pub fn store_evicted(
        &mut self,
        incarnation: Incarnation,
        tier: Tier,
        keys: &[ScopedKey],
    ) -> Result<Vec<InventoryEvent>> {
        self.policy.owner_of(tier)?;
        if incarnation != self.incarnation {
            return Ok(Vec::new());
        }
        let mut events = Vec::new();
        for scoped in keys {
            for pending in self.pending.values_mut() {
                if pending.offload.tier != tier
                    || pending.offload.namespace.id() != scoped.namespace
                {
                    continue;
                }
                if let Some(index) = pending
                    .offload
                    .pages
                    .iter()
                    .position(|p| p.key == scoped.key)
                {
                    pending.cut_at = pending.cut_at.min(index);
                }
            }
            if let Some(residency) = self.resident.remove(&(tier, scoped.namespace, scoped.key)) {
                push_removed(
                    &mut events,
                    scope(residency.owner, scoped.namespace, tier),
                    scoped.key,
                );
            }
        }
        Ok(events)
    }

    /// Observes a framework-owned change. It emits nothing (the engine owns
    /// those events) and keeps every removal identity.
    pub fn framework_changed(&mut self, change: &FrameworkChange) {
        // Deliberately no state change beyond the count: tying KVCR-owned
        // residency to the engine's GPU state is exactly how removals get lost.
        let _ = change;
        self.framework_changes += 1;
    }

    /// The linker reset: its stores are gone. Every residency is removed
    /// (once, grouped by scope), pending offloads are dropped, and `next`
    /// becomes the live incarnation.
    pub fn reset(&mut self, next: Incarnation) -> Result<Vec<InventoryEvent>> {
        if next == self.incarnation {
            return Err(Error::SameIncarnation { incarnation: next });
        }
        let mut events = Vec::new();
        for ((tier, namespace, key), residency) in std::mem::take(&mut self.resident) {
            push_removed(&mut events, scope(residency.owner, namespace, tier), key);
        }
        self.pending.clear();
        self.incarnation = next;
        self.kvcr_barrier_sent = false;
        Ok(events)
    }

    /// Like [`Self::rank_result`], publishing into `sink`.
    pub fn rank_result_into(
        &mut self,
        offload: OffloadId,
        rank: u32,
        success: bool,
        sink: &mut dyn InventorySink,
    ) -> Result<()> {
        for event in self.rank_result(offload, rank, success)? {
            sink.publish(&event);
        }
        Ok(())
    }

    /// The live incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// Offloads waiting for rank outcomes.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Framework changes observed (never published by the ledger).
    pub fn framework_changes(&self) -> u64 {
        self.framework_changes
    }

    /// Whether `key` is published as resident on `tier`.
    pub fn is_resident(&self, tier: Tier, key: ScopedKey) -> bool {
        self.resident.contains_key(&(tier, key.namespace, key.key))
    }

    /// The removal identity of every published residency, in (tier,
    /// namespace, key) order.
    pub fn residencies(&self) -> impl Iterator<Item = RemovalIdentity> + '_ {
        self.resident
            .iter()
            .map(|((tier, _, key), r)| RemovalIdentity {
                tier: *tier,
                owner: r.owner,
                namespace: r.namespace.clone(),
                key: *key,
                incarnation: r.incarnation,
            })
    }

    fn commit(&mut self, done: Pending) -> Vec<InventoryEvent> {
        let Pending {
            offload,
            owner,
            cut_at,
            ..
        } = done;
        let namespace_id = offload.namespace.id();
        let scope = scope(owner, namespace_id, offload.tier);
        let mut stored = Vec::new();
        let mut run: Vec<&OffloadPage> = Vec::new();
        // The parent of the run being built, and of the page being visited.
        let mut run_parent = offload.parent;
        let mut previous = offload.parent;
        for page in offload.pages.iter().take(cut_at) {
            let key = (offload.tier, namespace_id, page.key);
            if self.resident.contains_key(&key) {
                // Already published: it ends this run and parents the next.
                flush_run(&mut stored, scope, &offload, &mut run, run_parent);
            } else {
                if run.is_empty() {
                    run_parent = previous;
                }
                self.resident.insert(
                    key,
                    Residency {
                        owner,
                        namespace: offload.namespace.clone(),
                        incarnation: self.incarnation,
                    },
                );
                run.push(page);
            }
            previous = Some(page.key);
        }
        flush_run(&mut stored, scope, &offload, &mut run, run_parent);
        if owner == Owner::Kvcr && !stored.is_empty() && !self.kvcr_barrier_sent {
            self.kvcr_barrier_sent = true;
            stored.insert(
                0,
                InventoryEvent::AllCleared {
                    owner: Owner::Kvcr,
                    incarnation: self.incarnation,
                },
            );
        }
        stored
    }
}

fn scope(owner: Owner, namespace: NamespaceId, tier: Tier) -> InventoryScope {
    InventoryScope {
        owner,
        namespace,
        medium: tier.default_medium(),
    }
}

/// Appends a removal, extending the previous event only when its scope is the
/// same (the foundation's merge rule).
fn push_removed(events: &mut Vec<InventoryEvent>, scope: InventoryScope, key: BlockKey) {
    let next = InventoryEvent::Removed {
        scope,
        keys: vec![key],
    };
    if let Some(last) = events.last_mut()
        && last.can_merge(&next)
        && let InventoryEvent::Removed { keys, .. } = last
    {
        keys.push(key);
        return;
    }
    events.push(next);
}

/// Emits the pages of `run` as one `Stored` event (they form one chain under
/// `parent`) and empties it.
fn flush_run(
    stored: &mut Vec<InventoryEvent>,
    scope: InventoryScope,
    offload: &Offload,
    run: &mut Vec<&OffloadPage>,
    parent: Option<BlockKey>,
) {
    if run.is_empty() {
        return;
    }
    stored.push(InventoryEvent::Stored {
        scope,
        keys: run.iter().map(|p| p.key).collect(),
        parent,
        token_ids: run
            .iter()
            .flat_map(|p| p.token_ids.iter().copied())
            .collect(),
        block_size: offload.block_size,
        lora_name: offload.namespace.lora_name.clone(),
        lora_id: None,
        cache_salt: offload.namespace.cache_salt.clone(),
    });
    run.clear();
}
