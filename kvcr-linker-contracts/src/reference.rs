//! The reference in-memory linker: the linker contract with a `Vec` for a
//! device pool and a bounded map for a store. It passes the conformance suite
//! and is what other crates' tests can use as a mock.
//!
//! Staging is one fetch per attempt that claims the contiguous run of tail
//! pages present in the store when it lands; the store evicts its oldest
//! unclaimed page when full and never a claimed one.

use std::collections::{BTreeMap, VecDeque};

use kvcr_contracts::{AttemptId, BlockKey, Incarnation, ScopedKey, Tier};

use crate::attempt::{ClaimId, TransferId};
use crate::error::{Error, Result};
use crate::hooks::{RequestContext, RequestHooks};
use crate::linker::{
    Accounting, DeclineReason, DeviceSlot, Linker, LinkerEvent, LoadTicket, OffloadBatch,
    OffloadOutcome, OffloadTicket, PreparationState,
};
use crate::prefix::RestorableLengths;
use crate::prepared::PreparedAttempts;

/// Sizes of a [`ReferenceLinker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReferenceConfig {
    /// Bytes per page.
    pub page_bytes: usize,
    /// Slots in the device pool.
    pub device_slots: u32,
    /// Pages the store holds at most.
    pub store_pages: usize,
    /// The store's first incarnation.
    pub incarnation: Incarnation,
}

#[derive(Debug)]
struct StoredPage {
    bytes: Vec<u8>,
    claims: u32,
    inserted: u64,
}

#[derive(Debug)]
struct Fetch {
    transfer: TransferId,
    attempt: AttemptId,
    context: RequestContext,
}

#[derive(Debug)]
struct Load {
    transfer: TransferId,
    ticket: LoadTicket,
    attempt: AttemptId,
    pages: Vec<(ScopedKey, DeviceSlot)>,
}

#[derive(Debug)]
struct QueuedOffload {
    ticket: OffloadTicket,
    pages: Vec<(ScopedKey, Vec<u8>)>,
}

/// An in-memory linker (see the module docs).
#[derive(Debug)]
pub struct ReferenceLinker {
    config: ReferenceConfig,
    incarnation: Incarnation,
    device: Vec<Vec<u8>>,
    store: BTreeMap<ScopedKey, StoredPage>,
    claims: BTreeMap<ClaimId, ScopedKey>,
    prepared: PreparedAttempts,
    fetches: VecDeque<Fetch>,
    loads: VecDeque<Load>,
    offloads: VecDeque<QueuedOffload>,
    next_claim: u64,
    next_ticket: u64,
    next_insert: u64,
}

const STORE_TIER: Tier = Tier::KvcrDram;

impl ReferenceLinker {
    /// An empty linker with a zeroed device pool.
    pub fn new(config: ReferenceConfig) -> Self {
        let slots = usize::try_from(config.device_slots).unwrap_or(0);
        Self {
            config,
            incarnation: config.incarnation,
            device: vec![vec![0; config.page_bytes]; slots],
            store: BTreeMap::new(),
            claims: BTreeMap::new(),
            prepared: PreparedAttempts::new(),
            fetches: VecDeque::new(),
            loads: VecDeque::new(),
            offloads: VecDeque::new(),
            next_claim: 0,
            next_ticket: 0,
            next_insert: 0,
        }
    }

    /// Writes a device page (the engine computing KV). Bytes beyond the page
    /// size are ignored; a short write leaves the rest of the page as it was.
    pub fn write_device(&mut self, slot: DeviceSlot, bytes: &[u8]) -> Result<()> {
        let page = self.device_page_mut(slot)?;
        page.iter_mut().zip(bytes).for_each(|(d, s)| *d = *s);
        Ok(())
    }

    /// Reads a device page.
    pub fn read_device(&self, slot: DeviceSlot) -> Result<Vec<u8>> {
        self.device_page(slot).map(<[u8]>::to_vec)
    }

    /// Whether the store holds `key`.
    pub fn stores(&self, key: ScopedKey) -> bool {
        self.store.contains_key(&key)
    }

    /// The store's live incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    fn device_page(&self, slot: DeviceSlot) -> Result<&[u8]> {
        usize::try_from(slot.0)
            .ok()
            .and_then(|s| self.device.get(s))
            .map(Vec::as_slice)
            .ok_or(Error::DeviceSlot {
                slot,
                slots: self.config.device_slots,
            })
    }

    fn device_page_mut(&mut self, slot: DeviceSlot) -> Result<&mut Vec<u8>> {
        let slots = self.config.device_slots;
        usize::try_from(slot.0)
            .ok()
            .and_then(|s| self.device.get_mut(s))
            .ok_or(Error::DeviceSlot { slot, slots })
    }

    fn claim(&mut self, key: ScopedKey) -> Option<ClaimId> {
        let page = self.store.get_mut(&key)?;
        page.claims += 1;
        self.next_claim += 1;
        let claim = ClaimId(self.next_claim);
        self.claims.insert(claim, key);
        Some(claim)
    }

    fn release_claims(&mut self, claims: impl IntoIterator<Item = ClaimId>) {
        for claim in claims {
            if let Some(key) = self.claims.remove(&claim)
                && let Some(page) = self.store.get_mut(&key)
            {
                page.claims = page.claims.saturating_sub(1);
            }
        }
    }

    fn land_fetch(&mut self, fetch: Fetch) {
        let query = fetch.context.query();
        let mut pages = Vec::with_capacity(query.tail.len());
        for key in &query.tail {
            let scoped = ScopedKey {
                namespace: query.namespace,
                key: *key,
            };
            // Claim the contiguous run only: a page after a miss could never
            // be loaded.
            let run = pages
                .iter()
                .all(|(_, c): &(BlockKey, Option<ClaimId>)| c.is_some());
            let claim = if run { self.claim(scoped) } else { None };
            pages.push((*key, claim));
        }
        let release = self.prepared.land_staging(
            fetch.transfer,
            &fetch.attempt,
            query.device_prefix_pages,
            pages,
        );
        self.release_claims(release);
    }

    fn land_load(&mut self, load: Load) -> LinkerEvent {
        let mut success = true;
        for (key, slot) in &load.pages {
            let bytes = self.store.get(key).map(|p| p.bytes.clone());
            match (bytes, self.device_page_mut(*slot)) {
                (Some(bytes), Ok(page)) => *page = bytes,
                _ => success = false,
            }
        }
        let release = self.prepared.land_load(load.transfer);
        self.release_claims(release);
        LinkerEvent::LoadDone {
            attempt: load.attempt,
            ticket: load.ticket,
            success,
        }
    }

    fn land_offload(&mut self, offload: QueuedOffload, events: &mut Vec<LinkerEvent>) {
        let new_pages = offload
            .pages
            .iter()
            .filter(|(key, _)| !self.store.contains_key(key))
            .count();
        let free = self.config.store_pages.saturating_sub(self.store.len());
        let evictable = self.store.values().filter(|p| p.claims == 0).count();
        if new_pages > free + evictable {
            // Everything left is claimed: fail the offload, evict nothing.
            events.push(LinkerEvent::OffloadDone {
                ticket: offload.ticket,
                success: false,
            });
            return;
        }
        let mut evicted = Vec::new();
        for _ in 0..new_pages.saturating_sub(free) {
            let victim = self
                .store
                .iter()
                .filter(|(_, p)| p.claims == 0)
                .min_by_key(|(_, p)| p.inserted)
                .map(|(k, _)| *k);
            if let Some(victim) = victim {
                self.store.remove(&victim);
                evicted.push(victim);
            }
        }
        for (key, bytes) in offload.pages {
            if self.store.contains_key(&key) {
                continue;
            }
            self.next_insert += 1;
            self.store.insert(
                key,
                StoredPage {
                    bytes,
                    claims: 0,
                    inserted: self.next_insert,
                },
            );
        }
        if !evicted.is_empty() {
            events.push(LinkerEvent::Evicted {
                incarnation: self.incarnation,
                tier: STORE_TIER,
                keys: evicted,
            });
        }
        events.push(LinkerEvent::OffloadDone {
            ticket: offload.ticket,
            success: true,
        });
    }
}

impl RequestHooks for ReferenceLinker {
    fn prepares_requests(&self) -> bool {
        true
    }

    fn request_started(&mut self, context: &RequestContext) -> Result<()> {
        let attempt = context.attempt().clone();
        let (transfer, superseded) = self.prepared.start(&attempt)?;
        self.release_claims(superseded);
        self.fetches.push_back(Fetch {
            transfer,
            attempt,
            context: context.clone(),
        });
        Ok(())
    }

    fn request_finished(&mut self, attempt: &AttemptId) -> Result<()> {
        let released = self.prepared.end(attempt)?;
        self.release_claims(released);
        Ok(())
    }

    fn request_aborted(&mut self, attempt: &AttemptId) -> Result<()> {
        self.request_finished(attempt)
    }

    fn reset(&mut self, next: Incarnation) -> Result<()> {
        let in_flight = self.prepared.attempts().in_flight() + self.offloads.len();
        if in_flight > 0 {
            return Err(Error::TransfersInFlight { in_flight });
        }
        let released = self.prepared.reset()?;
        self.release_claims(released);
        self.store.clear();
        self.claims.clear();
        self.incarnation = next;
        Ok(())
    }
}

impl Linker for ReferenceLinker {
    fn offload(&mut self, batch: OffloadBatch) -> Result<OffloadOutcome> {
        if batch.pages.len() > self.config.store_pages {
            return Ok(OffloadOutcome::Declined(DeclineReason::OverCapacity));
        }
        let mut pages = Vec::with_capacity(batch.pages.len());
        for (key, slot) in &batch.pages {
            let scoped = ScopedKey {
                namespace: batch.namespace,
                key: *key,
            };
            pages.push((scoped, self.device_page(*slot)?.to_vec()));
        }
        self.next_ticket += 1;
        let ticket = OffloadTicket(self.next_ticket);
        self.offloads.push_back(QueuedOffload { ticket, pages });
        Ok(OffloadOutcome::Queued(ticket))
    }

    fn preparation(&self, attempt: &AttemptId) -> Result<PreparationState> {
        self.prepared.state(attempt)
    }

    fn lookup(
        &mut self,
        attempt: &AttemptId,
        device_prefix_pages: u32,
        tail: &[BlockKey],
    ) -> Result<RestorableLengths> {
        let (lengths, released) = self.prepared.lookup(attempt, device_prefix_pages, tail)?;
        self.release_claims(released);
        Ok(lengths)
    }

    fn load(&mut self, attempt: &AttemptId, slots: &[DeviceSlot]) -> Result<LoadTicket> {
        self.prepared.check_can_load(attempt)?;
        for slot in slots {
            self.device_page(*slot)?;
        }
        let claims = self.prepared.load_claims(attempt, slots.len())?;
        let mut pages = Vec::with_capacity(slots.len());
        for (claim, slot) in claims.iter().zip(slots) {
            let key = self
                .claims
                .get(claim)
                .copied()
                .ok_or_else(|| Error::LoadWithoutClaim {
                    attempt: attempt.clone(),
                    page: pages.len(),
                })?;
            pages.push((key, *slot));
        }
        let (transfer, unused) = self.prepared.accept_load(attempt, &claims)?;
        self.release_claims(unused);
        self.next_ticket += 1;
        let ticket = LoadTicket(self.next_ticket);
        self.loads.push_back(Load {
            transfer,
            ticket,
            attempt: attempt.clone(),
            pages,
        });
        Ok(ticket)
    }

    fn poll(&mut self) -> Vec<LinkerEvent> {
        let mut events = Vec::new();
        while let Some(fetch) = self.fetches.pop_front() {
            self.land_fetch(fetch);
        }
        while let Some(load) = self.loads.pop_front() {
            let event = self.land_load(load);
            events.push(event);
        }
        while let Some(offload) = self.offloads.pop_front() {
            self.land_offload(offload, &mut events);
        }
        events
    }

    fn accounting(&self) -> Accounting {
        Accounting {
            claims_held: self.claims.len(),
            transfers_in_flight: self.prepared.attempts().in_flight() + self.offloads.len(),
            live_attempts: self.prepared.attempts().live(),
        }
    }
}
