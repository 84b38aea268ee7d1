//! The live state a journal describes: the writer's mirror, and what the
//! reader rebuilds; it decides whether a record may follow.

use std::collections::{BTreeMap, BTreeSet};

// hashbrown's default (foldhash, seeded at random per process, as the core's
// own index): the mirror is updated on every append, under the runner's lock,
// and SipHash made that a measurable share of a deposit.
use hashbrown::{HashMap, HashSet};

use super::error::Refusal;
use super::layout::{MAX_SLOTS, MAX_STRING, MAX_TOKEN_IDS, frame_len};
use super::record::{JournalRecord, Recovered, RecoveredNamespace, RecoveredPage};

#[derive(Debug, Clone, Default)]
pub(super) struct Live {
    /// In registration order.
    pub(super) namespaces: Vec<RecoveredNamespace>,
    /// Id → index in `namespaces`.
    namespace_index: HashMap<u64, usize>,
    /// (namespace, key) → (order, page).
    pub(super) pages: HashMap<(u64, u64), (u64, RecoveredPage)>,
    /// Journal order → (namespace, key).
    order: BTreeMap<u64, (u64, u64)>,
    next_order: u64,
    /// Slots owned by live pages.
    page_slots: HashSet<u32>,
    /// Held slots.
    pub(super) held: BTreeSet<u32>,
}

fn cap(what: &'static str, len: usize, max: usize) -> Result<(), Refusal> {
    if len > max {
        return Err(Refusal::TooLong { what, len, max });
    }
    Ok(())
}

fn slot_list(slots: &[u32]) -> Result<(), Refusal> {
    if slots.is_empty() {
        return Err(Refusal::NoSlots);
    }
    cap("slots", slots.len(), MAX_SLOTS)?;
    let mut seen = HashSet::with_capacity(slots.len());
    for &slot in slots {
        if !seen.insert(slot) {
            return Err(Refusal::DuplicateSlot(slot));
        }
    }
    Ok(())
}

impl Live {
    /// Whether `record` may follow this state: `Ok(true)` when applying it
    /// changes the state, `Ok(false)` for a namespace registered already with
    /// the same values.
    pub(super) fn check(&self, record: &JournalRecord) -> Result<bool, Refusal> {
        match record {
            JournalRecord::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => {
                cap(
                    "lora_name",
                    lora_name.as_ref().map_or(0, String::len),
                    MAX_STRING,
                )?;
                cap(
                    "cache_salt",
                    cache_salt.as_ref().map_or(0, String::len),
                    MAX_STRING,
                )?;
                match self
                    .namespace_index
                    .get(id)
                    .and_then(|&i| self.namespaces.get(i))
                {
                    None => Ok(true),
                    Some(ns)
                        if ns.compat == *compat
                            && ns.lora_name == *lora_name
                            && ns.cache_salt == *cache_salt =>
                    {
                        Ok(false)
                    }
                    Some(_) => Err(Refusal::NamespaceConflict(*id)),
                }
            }
            JournalRecord::Ready {
                namespace,
                key,
                slots,
                token_ids,
                ..
            } => {
                if !self.namespace_index.contains_key(namespace) {
                    return Err(Refusal::UnknownNamespace(*namespace));
                }
                if self.pages.contains_key(&(*namespace, *key)) {
                    return Err(Refusal::PageLive {
                        namespace: *namespace,
                        key: *key,
                    });
                }
                cap("token_ids", token_ids.len(), MAX_TOKEN_IDS)?;
                slot_list(slots)?;
                self.all_free(slots)?;
                Ok(true)
            }
            JournalRecord::Removed { namespace, key } => {
                if self.pages.contains_key(&(*namespace, *key)) {
                    Ok(true)
                } else {
                    Err(Refusal::PageNotLive {
                        namespace: *namespace,
                        key: *key,
                    })
                }
            }
            JournalRecord::Held { slots } => {
                slot_list(slots)?;
                self.all_free(slots)?;
                Ok(true)
            }
            JournalRecord::Freed { slots } => {
                slot_list(slots)?;
                match slots.iter().find(|s| !self.held.contains(s)) {
                    Some(&slot) => Err(Refusal::SlotNotHeld(slot)),
                    None => Ok(true),
                }
            }
        }
    }

    fn all_free(&self, slots: &[u32]) -> Result<(), Refusal> {
        match slots
            .iter()
            .find(|s| self.page_slots.contains(*s) || self.held.contains(s))
        {
            Some(&slot) => Err(Refusal::SlotInUse(slot)),
            None => Ok(()),
        }
    }

    /// Applies a record [`Self::check`] accepted.
    pub(super) fn apply(&mut self, record: JournalRecord) {
        match record {
            JournalRecord::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => {
                if !self.namespace_index.contains_key(&id) {
                    self.namespace_index.insert(id, self.namespaces.len());
                    self.namespaces.push(RecoveredNamespace {
                        id,
                        compat,
                        lora_name,
                        cache_salt,
                    });
                }
            }
            JournalRecord::Ready {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            } => {
                self.page_slots.extend(slots.iter().copied());
                let order = self.next_order;
                self.next_order += 1;
                self.order.insert(order, (namespace, key));
                self.pages.insert(
                    (namespace, key),
                    (
                        order,
                        RecoveredPage {
                            namespace,
                            key,
                            layout,
                            slots,
                            parent,
                            token_ids,
                        },
                    ),
                );
            }
            JournalRecord::Removed { namespace, key } => {
                if let Some((order, page)) = self.pages.remove(&(namespace, key)) {
                    self.order.remove(&order);
                    for slot in &page.slots {
                        self.page_slots.remove(slot);
                    }
                }
            }
            JournalRecord::Held { slots } => self.held.extend(slots),
            JournalRecord::Freed { slots } => {
                for slot in &slots {
                    self.held.remove(slot);
                }
            }
        }
    }

    /// Checks and applies.
    pub(super) fn push(&mut self, record: JournalRecord) -> Result<(), Refusal> {
        self.check(&record)?;
        self.apply(record);
        Ok(())
    }

    pub(super) fn held_list(&self) -> Vec<u32> {
        self.held.iter().copied().collect()
    }

    /// The live pages, oldest first.
    pub(super) fn pages_in_order(&self) -> impl Iterator<Item = &RecoveredPage> {
        self.order
            .values()
            .filter_map(|k| self.pages.get(k).map(|(_, page)| page))
    }

    /// Bytes a snapshot of this state takes in a half.
    pub(super) fn snapshot_len(&self) -> usize {
        let namespaces: usize = self
            .namespaces
            .iter()
            .map(|ns| frame_len(ns.view().payload_len()))
            .sum();
        let held = self.held.len();
        let full = held / MAX_SLOTS;
        let rest = held % MAX_SLOTS;
        let held_len = full * frame_len(1 + 4 + 4 * MAX_SLOTS)
            + if rest > 0 {
                frame_len(1 + 4 + 4 * rest)
            } else {
                0
            };
        let pages: usize = self
            .pages_in_order()
            .map(|p| frame_len(p.view().payload_len()))
            .sum();
        namespaces + held_len + pages
    }

    pub(super) fn from_recovered(recovered: &Recovered) -> Result<Self, Refusal> {
        let mut live = Self::default();
        for ns in &recovered.namespaces {
            live.push(JournalRecord::Namespace {
                id: ns.id,
                compat: ns.compat,
                lora_name: ns.lora_name.clone(),
                cache_salt: ns.cache_salt.clone(),
            })?;
        }
        let mut held = recovered.held.clone();
        held.sort_unstable();
        held.dedup();
        for chunk in held.chunks(MAX_SLOTS) {
            live.push(JournalRecord::Held {
                slots: chunk.to_vec(),
            })?;
        }
        for page in &recovered.pages {
            live.push(JournalRecord::Ready {
                namespace: page.namespace,
                key: page.key,
                layout: page.layout,
                slots: page.slots.clone(),
                parent: page.parent,
                token_ids: page.token_ids.clone(),
            })?;
        }
        Ok(live)
    }

    pub(super) fn into_recovered(mut self, torn_tail: bool, records: u64) -> Recovered {
        let held = self.held_list();
        let pages = std::mem::take(&mut self.order)
            .into_values()
            .filter_map(|k| self.pages.remove(&k).map(|(_, page)| page))
            .collect();
        Recovered {
            namespaces: self.namespaces,
            pages,
            held,
            torn_tail,
            records,
        }
    }
}
