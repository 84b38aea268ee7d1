//! The residency journal's tap and warm recovery.
//!
//! With the tap on ([`Core::enable_journal`]), the core reports every
//! residency change a restarted runner needs to take its pool back, as
//! [`JournalRecord`]s the runner drains ([`Core::take_journal`]) and writes
//! into the journal before it executes any action:
//! * `Namespace` when one is registered (and every registered one when the
//!   tap is turned on);
//! * `Ready` when a page's bytes are complete (a fill committed), with its
//!   tokens and parent when the page came with them;
//! * `Removed` when a READY residency ends, before its slots are free for
//!   anything else: the runner drains the tap before it starts the copy or
//!   the peer grant that could write them again, so a journal never names a
//!   page whose slots hold other bytes;
//! * `Held` when slots are granted to a peer's write (a source may write
//!   them until it proves otherwise), `Freed` when that write ends with
//!   proof (the page committed, or the slots were freed by an answer).
//!
//! Slots in the journal are global: pool `p`'s slot `s` is the sum of the
//! earlier pools' slot counts plus `s`, so a record names its pools without
//! naming a layout id (layout ids are this process's own).
//!
//! [`Core::recover`] seats a recovered journal's pages in a fresh core:
//! READY, unclaimed, at the cold end of the eviction queue, in journal
//! order; each page is validated first (slots in range, one pool per span,
//! no slot twice, key not already resident) and a page that fails is
//! skipped and counted, never seated. Held slots are taken out of the free
//! lists for the life of this core: nothing proves the write into them has
//! stopped.

use std::collections::HashSet;

use super::*;
use crate::journal::{JournalRecord, Recovered, RecoveredPage};

/// What the journal tap keeps between drains.
#[derive(Debug, Default)]
pub(in crate::machine) struct JournalTap {
    records: Vec<JournalRecord>,
    /// Records whose slots were reported `Held` and not yet `Freed`.
    held: HashSet<u32>,
}

/// What [`Core::recover`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Pages seated READY.
    pub seated: u64,
    /// Pages skipped, with why (the first few; `skipped` counts all).
    pub refusals: Vec<(u64, &'static str)>,
    /// How many pages were skipped.
    pub skipped: u64,
    /// Slots kept out of use because a peer's write may still land in them.
    pub held_slots: u64,
    /// Bytes of the seated pages.
    pub bytes: u64,
}

/// At most this many refusals are listed in a report (all are counted).
const LISTED_REFUSALS: usize = 16;

impl Core {
    /// Turns the journal tap on: every registered namespace is reported
    /// now, and every residency change from here on.
    pub fn enable_journal(&mut self) {
        let mut tap = JournalTap::default();
        let mut namespaces: Vec<(&NamespaceId, &Namespace)> = self.namespaces.iter().collect();
        namespaces.sort_by_key(|(id, _)| id.0);
        for (id, namespace) in namespaces {
            tap.records.push(namespace_record(*id, namespace));
        }
        self.journal = Some(Box::new(tap));
    }

    /// Whether the journal tap is on.
    pub fn journal_enabled(&self) -> bool {
        self.journal.is_some()
    }

    /// The residency changes since the last drain, in order. The caller
    /// writes them before it executes the actions pending now.
    pub fn take_journal(&mut self) -> Vec<JournalRecord> {
        self.journal
            .as_mut()
            .map(|t| std::mem::take(&mut t.records))
            .unwrap_or_default()
    }

    pub(in crate::machine) fn journal_namespace(&mut self, id: NamespaceId) {
        let Some(record) = self.namespaces.get(&id).map(|n| namespace_record(id, n)) else {
            return;
        };
        if let Some(tap) = self.journal.as_mut() {
            tap.records.push(record);
        }
    }

    /// The global slot ids of a record (see the module doc).
    fn global_slots(&self, idx: u32) -> Vec<u32> {
        let Some(layout) = self.record(idx).map(|r| r.layout as usize) else {
            return Vec::new();
        };
        let Some(pools) = self.layouts.get(layout) else {
            return Vec::new();
        };
        self.slot_vec(idx)
            .into_iter()
            .zip(pools)
            .map(|(slot, pool)| self.pool_first_slot(pool.0).saturating_add(slot))
            .collect()
    }

    fn pool_first_slot(&self, pool: u16) -> u32 {
        self.pools
            .iter()
            .take(pool as usize)
            .map(|p| p.total)
            .fold(0u32, u32::saturating_add)
    }

    /// The pool and its slot of a global slot id.
    fn pool_slot_of(&self, global: u32) -> Option<(u16, u32)> {
        let mut first = 0u32;
        for (i, p) in self.pools.iter().enumerate() {
            if global < first.saturating_add(p.total) {
                return Some((u16::try_from(i).ok()?, global - first));
            }
            first = first.saturating_add(p.total);
        }
        None
    }

    /// A record's slots were granted to a peer's write.
    pub(in crate::machine) fn journal_held(&mut self, idx: u32) {
        if self.journal.is_none() {
            return;
        }
        let slots = self.global_slots(idx);
        if let Some(tap) = self.journal.as_mut()
            && tap.held.insert(idx)
        {
            tap.records.push(JournalRecord::Held { slots });
        }
    }

    /// A held record's write ended with proof (its record commits or is
    /// freed): its slots are no longer written by a peer.
    fn journal_freed(&mut self, idx: u32) {
        if !self.journal.as_ref().is_some_and(|t| t.held.contains(&idx)) {
            return;
        }
        let slots = self.global_slots(idx);
        if let Some(tap) = self.journal.as_mut() {
            tap.held.remove(&idx);
            tap.records.push(JournalRecord::Freed { slots });
        }
    }

    /// A record became READY with all its bytes.
    pub(in crate::machine) fn journal_ready(&mut self, idx: u32, page: Option<&PageInfo>) {
        if self.journal.is_none() {
            return;
        }
        self.journal_freed(idx);
        let Some((key, layout)) = self.record(idx).map(|r| (r.key, r.layout)) else {
            return;
        };
        let record = JournalRecord::Ready {
            namespace: key.namespace.0,
            key: key.key.as_u64(),
            layout,
            slots: self.global_slots(idx),
            parent: page.and_then(|p| p.parent).map(BlockKey::as_u64),
            token_ids: page.map(|p| p.token_ids.clone()).unwrap_or_default(),
        };
        if let Some(tap) = self.journal.as_mut() {
            tap.records.push(record);
        }
    }

    /// A record is about to be freed (its slots go back to the free lists):
    /// `Removed` if it was READY, `Freed` if a peer's write held it.
    pub(in crate::machine) fn journal_freeing(&mut self, idx: u32) {
        if self.journal.is_none() {
            return;
        }
        self.journal_freed(idx);
        let Some((key, ready)) = self
            .record(idx)
            .map(|r| (r.key, r.state == Residency::Ready))
        else {
            return;
        };
        if let (true, Some(tap)) = (ready, self.journal.as_mut()) {
            tap.records.push(JournalRecord::Removed {
                namespace: key.namespace.0,
                key: key.key.as_u64(),
            });
        }
    }

    /// Seats a recovered journal in this core, which must be fresh (nothing
    /// resident, no operation): namespaces registered, pages READY and
    /// evictable (coldest first, in journal order), held slots out of use.
    /// A page that does not fit this core's pools is skipped, never seated.
    ///
    /// Returns what was done and the state actually seated, which the
    /// caller resumes its journal with ([`crate::journal::JournalWriter::resume`]):
    /// the seated pages and held slots are not reported through the tap
    /// again (the resumed journal holds them already).
    pub fn recover(&mut self, now: u64, recovered: &Recovered) -> (RecoveryReport, Recovered) {
        let mut report = RecoveryReport::default();
        let mut seated = Recovered {
            namespaces: Vec::new(),
            pages: Vec::new(),
            held: Vec::new(),
            torn_tail: recovered.torn_tail,
            records: recovered.records,
        };
        let mut known = HashSet::new();
        for n in &recovered.namespaces {
            let namespace = Namespace {
                compat: kvcr_contracts::key::CompatDigest(n.compat),
                lora_name: n.lora_name.clone(),
                cache_salt: n.cache_salt.clone(),
            };
            // An id is the namespace's digest: one that does not match its
            // fields was not written by a runner.
            if namespace.id().0 == n.id {
                let id = self.register_namespace(namespace);
                known.insert(id);
                seated.namespaces.push(n.clone());
            }
        }
        // What is free now (a fresh core: everything); taken slots leave
        // the free lists once, at the end.
        let mut free: HashSet<(u16, u32)> = self
            .pools
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.free.iter().map(move |s| (i as u16, *s)))
            .collect();
        for global in &recovered.held {
            if let Some(slot) = self.pool_slot_of(*global)
                && free.remove(&slot)
            {
                self.recovered_held.push(slot);
                seated.held.push(*global);
                report.held_slots += 1;
            }
        }
        for page in &recovered.pages {
            match self.seat(now, &known, &mut free, page) {
                Ok(bytes) => {
                    report.seated += 1;
                    report.bytes += bytes;
                    seated.pages.push(page.clone());
                }
                Err(why) => {
                    report.skipped += 1;
                    if report.refusals.len() < LISTED_REFUSALS {
                        report.refusals.push((page.key, why));
                    }
                }
            }
        }
        for (i, p) in self.pools.iter_mut().enumerate() {
            p.free.retain(|s| free.contains(&(i as u16, *s)));
        }
        (report, seated)
    }

    fn seat(
        &mut self,
        now: u64,
        known: &HashSet<NamespaceId>,
        free: &mut HashSet<(u16, u32)>,
        page: &RecoveredPage,
    ) -> std::result::Result<u64, &'static str> {
        let namespace = NamespaceId(page.namespace);
        if !known.contains(&namespace) {
            return Err("its namespace is not in the journal");
        }
        let key = ScopedKey {
            namespace,
            key: BlockKey::from_u64(page.key),
        };
        if self.index.contains_key(&key) {
            return Err("the key is resident already");
        }
        let placed: Vec<(u16, u32)> = page
            .slots
            .iter()
            .map(|g| self.pool_slot_of(*g))
            .collect::<Option<_>>()
            .ok_or("a slot lies outside the pools")?;
        if placed.is_empty() {
            return Err("a page without slots");
        }
        // Spans may share a pool (K and V pages of one pool, say).
        let pools: Vec<PoolId> = placed.iter().map(|(p, _)| PoolId(*p)).collect();
        if !placed.iter().all(|slot| free.contains(slot)) {
            return Err("a slot is not free (taken by another page or held)");
        }
        let layout = self.layout_of(&pools).map_err(|_| "too many layouts")?;
        for slot in &placed {
            free.remove(slot);
        }
        let record = self.insert_record(now, key, layout, placed.iter().map(|(_, s)| *s).collect());
        self.transition(record, Residency::Ready, "recovered");
        if let Some(r) = self.record_mut(record) {
            // Cold: a recovered page has no access history.
            r.last_access = 0;
        }
        let info = PageInfo {
            parent: page.parent.map(BlockKey::from_u64),
            token_ids: page.token_ids.clone(),
        };
        // Kept until the inventory is republished (`recovered_stored_events`).
        self.recovered_pages.insert(record, info);
        self.make_evictable(record);
        Ok(self.record_bytes(record))
    }

    /// Every READY page and its global slots (what a journal must recover).
    pub fn ready_pages(&self) -> BTreeMap<ScopedKey, Vec<u32>> {
        self.index
            .iter()
            .filter(|(_, e)| e.state == Residency::Ready)
            .map(|(key, e)| (*key, self.global_slots(e.record)))
            .collect()
    }

    /// Slots kept out of use since a recovery (a peer may still write them).
    pub fn recovered_held_slots(&self) -> usize {
        self.recovered_held.len()
    }

    /// The inventory of the recovered pages still READY, once: `Stored`
    /// events with their tokens (the caller sends an `AllCleared` barrier
    /// first, so a router drops what the dead incarnation published and
    /// converges on what this one holds). Later calls return nothing.
    pub fn recovered_stored_events(&mut self) -> Vec<InventoryEvent> {
        let pages = std::mem::take(&mut self.recovered_pages);
        let mut records: Vec<(u64, u32, PageInfo)> = pages
            .into_iter()
            .filter_map(|(idx, info)| {
                let r = self.record(idx)?;
                (r.state == Residency::Ready).then_some((r.seq, idx, info))
            })
            .collect();
        records.sort_by_key(|(seq, _, _)| *seq);
        let saved = std::mem::take(&mut self.events);
        let stored: Vec<(u32, Option<PageInfo>)> = records
            .into_iter()
            .map(|(_, idx, info)| (idx, (!info.token_ids.is_empty()).then_some(info)))
            .collect();
        self.publish_stored(&stored);
        std::mem::replace(&mut self.events, saved)
    }
}

fn namespace_record(id: NamespaceId, namespace: &Namespace) -> JournalRecord {
    JournalRecord::Namespace {
        id: id.0,
        compat: namespace.compat.0,
        lora_name: namespace.lora_name.clone(),
        cache_salt: namespace.cache_salt.clone(),
    }
}
