//! [`DirectLinker`]: the linker contract over a rank-local runner whose
//! framework regions are the engine's KV pool.
//!
//! * Offload is a runner `deposit` of each page's `2 × layers` device spans
//!   into KVCR DRAM slots; restore (`load`) is a `deliver` back into device
//!   spans. With [`KvMemory::Cuda`] both run on the [`CudaCopier`]'s batched
//!   kernels; with [`KvMemory::Host`] the runner's copy thread copies.
//! * Preparation is a runner `fetch` of the request's tail that claims each
//!   resident page; with router hints (and a runner started with peers) it is
//!   a hinted fetch, which first pulls missing pages from the hinted peer's
//!   KVCR DRAM into local DRAM (UCX) — the load then moves them on to the GPU.
//! * Claims are runner claims: a claimed page is never evicted, and every
//!   claim is released exactly once (lookup shift, load landing, request end,
//!   supersession, or a late landing for an attempt that is gone).
//!
//! Nothing here blocks on the GPU: transfers land through [`Linker::poll`]
//! (or [`DirectLinker::settle`], which waits for them, bounded).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvcr_foundation::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_foundation::runner::{
    DeliverEntry, DepositEntry, OpResult, PeerOptions, PoolId, ReleaseHandle, Runner, RunnerConfig,
};
use kvcr_foundation::{
    AttemptId, BlockKey, CompatDigest, Incarnation, InventoryEvent, InventorySink, Namespace,
    NamespaceId, ScopedKey, Tier,
};
use kvcr_linker_contracts::{
    Accounting, ClaimId, DeclineReason, DeviceSlot, Error as LinkError, Linker, LinkerEvent,
    LoadTicket, OffloadBatch, OffloadOutcome, OffloadTicket, PreparationState, PreparedAttempts,
    RequestContext, RequestHooks, RestorableLengths, TransferId,
};

use crate::copier::CudaCopier;
use crate::error::{Error, Result};
use crate::layout::{KvLayout, POOL};

mod hooks;
mod restore;

use restore::{RESTORE_PART_PAGES, Restore};

/// Where the engine's KV pool lives, which decides who copies it.
#[derive(Debug, Clone)]
pub enum KvMemory {
    /// GPU memory, copied by this copier's kernels.
    Cuda(Arc<CudaCopier>),
    /// Host memory (a CPU engine, or a machine without a GPU): the runner's
    /// copy thread copies it.
    Host,
}

/// How to build a [`DirectLinker`].
#[derive(Debug, Clone)]
pub struct DirectLinkerConfig {
    /// The engine's KV pool.
    pub layout: KvLayout,
    /// Pages KVCR DRAM holds.
    pub store_pages: u32,
    /// Budget of one runner operation (offload, fetch, load).
    pub operation_timeout: Duration,
    /// The store's first incarnation.
    pub incarnation: Incarnation,
    /// Take part in the peer protocol (hinted fetches from peers' KVCR DRAM).
    pub peer: Option<PeerOptions>,
    /// Touch every pool page at startup.
    pub prefault: bool,
}

const STORE_TIER: Tier = Tier::KvcrDram;

#[derive(Debug)]
enum Pending {
    Fetch {
        transfer: TransferId,
        attempt: AttemptId,
        namespace: NamespaceId,
        tail: Vec<BlockKey>,
        device_prefix_pages: u32,
    },
    Load {
        transfer: TransferId,
        ticket: LoadTicket,
        attempt: AttemptId,
    },
    Offload(OffloadTicket),
    /// Part `part` of the restore `ticket` (see [`restore`]).
    Restore {
        ticket: LoadTicket,
        part: usize,
    },
}

/// Collects the runner's removals (the store's evictions).
#[derive(Debug, Clone, Default)]
struct Removals(Arc<Mutex<Vec<ScopedKey>>>);

impl InventorySink for Removals {
    fn publish(&mut self, event: &InventoryEvent) {
        if let InventoryEvent::Removed { scope, keys } = event {
            let mut removed = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            removed.extend(keys.iter().map(|key| ScopedKey {
                namespace: scope.namespace,
                key: *key,
            }));
        }
    }
}

/// A direct linker for one rank (see the module docs).
///
/// Drop order: `runner` first (its copy thread stops, the copier unpins its
/// pools, then the pools are freed), then the copier it used (`memory`).
#[derive(Debug)]
pub struct DirectLinker {
    runner: Runner,
    memory: KvMemory,
    config: DirectLinkerConfig,
    incarnation: Incarnation,
    regions: Vec<RegionId>,
    pool_layout: Vec<PoolId>,
    removals: Removals,
    /// Engine namespace → the runner's, and back.
    namespaces: BTreeMap<NamespaceId, NamespaceId>,
    engine_namespaces: BTreeMap<NamespaceId, NamespaceId>,
    prepared: PreparedAttempts,
    pending: HashMap<OpHandle, Pending>,
    /// Restores in flight, their parts' operations in `pending`.
    restores: HashMap<LoadTicket, Restore>,
    /// Most pages one part of a restore delivers.
    restore_part_pages: NonZeroUsize,
    /// Fetches that needed no runner operation; they land at the next poll.
    immediate: VecDeque<Pending>,
    /// Offloads in submission order, with their outcome once known.
    offloads: VecDeque<(OffloadTicket, Option<bool>)>,
    /// Every claim held: the runner's release handle has the same number.
    claims: BTreeMap<ClaimId, ScopedKey>,
    next_ticket: u64,
}

/// Mixes a namespace id with a shard (splitmix64 finaliser over each part):
/// distinct shards of one namespace give unrelated digests.
fn shard_digest(namespace: u64, tp_rank: u32, tp_size: u32) -> u64 {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let shard = (u64::from(tp_size) << 32) | u64::from(tp_rank);
    mix(mix(namespace) ^ shard.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

fn backend(error: impl Into<Error>) -> LinkError {
    LinkError::Backend(Box::new(error.into()))
}

fn start_runner(
    config: &DirectLinkerConfig,
    memory: &KvMemory,
) -> Result<(Runner, Vec<RegionId>, Removals)> {
    config.layout.validate()?;
    let spans = config.layout.spans_per_page();
    let blocks = u32::try_from(spans)
        .ok()
        .and_then(|s| s.checked_mul(config.store_pages))
        .filter(|b| *b > 0)
        .ok_or(Error::Layout {
            field: "store_pages",
            why: "must be positive and hold at most 2^32 spans",
        })?;
    let mut runner_config = RunnerConfig::single_pool(POOL, config.layout.span_bytes(), blocks);
    runner_config.operation_timeout = config.operation_timeout;
    runner_config.prefault = config.prefault;
    let runner = match &config.peer {
        Some(peer) => Runner::start_with_peers(runner_config, None, peer)?,
        None => Runner::start(runner_config, None)?,
    };
    // Restores report a page's first layer (layer 0's K and V regions,
    // registered first) ahead of the rest: copied first from KVCR DRAM, and
    // asked of a one-hop write's source.
    runner.set_lead_elements(2);
    if let KvMemory::Cuda(copier) = memory {
        runner.pools().set_device_copier(Arc::clone(copier) as _)?;
    }
    let mut regions = Vec::with_capacity(spans);
    for desc in config.layout.regions() {
        // SAFETY: `DirectLinker::new`'s contract: the engine keeps every K/V
        // buffer allocated for the linker's lifetime and does not touch a page
        // slot named by an offload or load until it lands.
        #[allow(unsafe_code)]
        let region = unsafe {
            match memory {
                KvMemory::Cuda(_) => runner.register_device_region(desc),
                KvMemory::Host => runner.register_region(desc),
            }
        }?;
        regions.push(region);
    }
    let removals = Removals::default();
    runner.set_inventory_sink(Box::new(removals.clone()));
    Ok((runner, regions, removals))
}

impl DirectLinker {
    /// Starts the runner (KVCR DRAM sized for `store_pages` pages), pins its
    /// pools for the GPU and registers the engine's KV buffers.
    ///
    /// # Safety
    /// Every K and V buffer the layout names must stay allocated (on the GPU
    /// for [`KvMemory::Cuda`], in host memory for [`KvMemory::Host`]) until the
    /// linker is dropped, and the engine must not touch a page slot named by an
    /// accepted offload or load until [`Linker::poll`] reports it landed.
    #[allow(unsafe_code)]
    pub unsafe fn new(config: DirectLinkerConfig, memory: KvMemory) -> Result<Self> {
        let (runner, regions, removals) = start_runner(&config, &memory)?;
        let pool_layout = vec![PoolId(0); config.layout.spans_per_page()];
        Ok(Self {
            runner,
            memory,
            incarnation: config.incarnation,
            config,
            regions,
            pool_layout,
            removals,
            namespaces: BTreeMap::new(),
            engine_namespaces: BTreeMap::new(),
            prepared: PreparedAttempts::new(),
            pending: HashMap::new(),
            restores: HashMap::new(),
            restore_part_pages: RESTORE_PART_PAGES,
            immediate: VecDeque::new(),
            offloads: VecDeque::new(),
            claims: BTreeMap::new(),
            next_ticket: 0,
        })
    }

    /// Most pages one part of a pipelined restore delivers (default 64):
    /// [`Self::restore_hinted`] hands a restore to the runner in parts, so
    /// that a peer's first writes can leave while later parts are still
    /// being granted. At least a restore's pages make it one part.
    pub fn set_restore_part_pages(&mut self, pages: NonZeroUsize) {
        self.restore_part_pages = pages;
    }

    /// The runner underneath (endpoint, stats, hints).
    pub fn runner(&self) -> &Runner {
        &self.runner
    }

    /// The engine's layout.
    pub fn layout(&self) -> &KvLayout {
        &self.config.layout
    }

    /// Who copies.
    pub fn memory(&self) -> &KvMemory {
        &self.memory
    }

    /// The store's live incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// Whether KVCR DRAM holds `key` (READY).
    pub fn stores(&mut self, namespace: NamespaceId, key: BlockKey) -> bool {
        let scoped = self.scoped(namespace, key);
        self.runner.query(&scoped) == kvcr_foundation::runner::QueryStatus::Hit
    }

    /// The digest KVCR DRAM keeps for `key`'s page (xxh3-64 of its bytes in
    /// layout order, taken at its offload), if it holds the page READY.
    pub fn page_digest(&mut self, namespace: NamespaceId, key: BlockKey) -> Option<u64> {
        let scoped = self.scoped(namespace, key);
        self.runner.page_digest(&scoped)
    }

    /// Restores the request's tail straight into `slots` (page `i` of the
    /// query's tail into `slots[i]`), pipelined: pages already in KVCR DRAM
    /// go to the device at once; missing ones the request's hints place on a
    /// peer are pulled in batches ([`PeerOptions::write_batch_bytes`]) and
    /// each batch moves on to the device as soon as it has landed, so a
    /// large peer restore takes about as long as its slower hop rather than
    /// both hops in turn.
    ///
    /// This replaces `request_started` + `lookup` + `load` for an engine
    /// that allocates the hinted pages' slots up front: it takes no
    /// preparation and holds no claims. [`LinkerEvent::RestoreDone`] reports
    /// how many leading pages are on the device; the engine recomputes the
    /// rest. The slots are the engine's grant: nothing else is written, and
    /// the engine must not touch them until the restore is reported.
    ///
    /// The runner gets the restore in parts of at most
    /// [`Self::set_restore_part_pages`] pages (64 unless set), each
    /// delivered as soon as it is built; the engine sees one restore. If a later
    /// part cannot be handed to the runner, the parts before it still run
    /// and `RestoreDone` counts no page after them; only if the first
    /// cannot is the restore refused (an error, nothing queued).
    pub fn restore_hinted(
        &mut self,
        context: &RequestContext,
        slots: &[DeviceSlot],
    ) -> Result<LoadTicket> {
        let query = context.query();
        let pages = query.tail.len();
        let mut seen = std::collections::HashSet::with_capacity(slots.len());
        let duplicate = !slots.iter().all(|s| seen.insert(*s));
        let refused = Error::RestoreSlots {
            slots: slots.len(),
            pages,
            duplicate,
        };
        let in_pool = slots.iter().all(|s| self.check_slot(*s).is_ok());
        if slots.len() != pages || duplicate || !in_pool {
            return Err(refused);
        }
        let page_count = u32::try_from(pages).map_err(|_| refused)?;
        let attempt = context.attempt().clone();
        let hinted = self.submit_hints(context);
        let mut restore = Restore::new(attempt.clone(), page_count);
        let ticket = LoadTicket(self.next_ticket + 1);
        // In parts, each delivered as soon as it is built (see [`restore`]);
        // an empty restore is one empty part, so that it still reports.
        let pairs: Vec<(BlockKey, DeviceSlot)> = query
            .tail
            .iter()
            .copied()
            .zip(slots.iter().copied())
            .collect();
        let parts = pairs.chunks(self.restore_part_pages.get());
        let parts: Vec<&[(BlockKey, DeviceSlot)]> = if pairs.is_empty() {
            vec![&[]]
        } else {
            parts.collect()
        };
        for part in parts {
            let entries: Vec<DeliverEntry> = part
                .iter()
                .map(|(key, slot)| DeliverEntry {
                    key: self.scoped(query.namespace, *key),
                    destinations: self.elements(*slot),
                })
                .collect();
            let submitted = if hinted {
                self.runner.hints().deliver(&attempt.request, entries)
            } else {
                self.runner.deliver(entries)
            };
            match submitted {
                Ok(op) => {
                    let index = restore.push(part.len() as u32);
                    self.pending.insert(
                        op,
                        Pending::Restore {
                            ticket,
                            part: index,
                        },
                    );
                }
                // Nothing went: the restore is refused as a whole.
                Err(e) if restore.is_empty() => return Err(e.into()),
                // Later parts are not sent; the restore reports the pages
                // before them (a prefix is all an engine can use).
                Err(_) => break,
            }
        }
        self.next_ticket += 1;
        self.restores.insert(ticket, restore);
        Ok(ticket)
    }

    /// Hands the request's router hints to the runner when it takes part in
    /// the peer protocol; returns whether its operations are then hinted.
    fn submit_hints(&self, context: &RequestContext) -> bool {
        let hinted = self.config.peer.is_some() && !context.hints().is_empty();
        if hinted {
            for hint in context.hints() {
                self.runner
                    .hints()
                    .submit(context.attempt().request.clone(), hint);
            }
        }
        hinted
    }

    /// Lands whatever completes within `timeout`, waiting until nothing is in
    /// flight (or the time is up), and returns every event.
    pub fn settle(&mut self, timeout: Duration) -> Vec<LinkerEvent> {
        let mut events = self.poll();
        let rounds = (timeout.as_millis() / 10).max(1);
        for _ in 0..rounds {
            if self.accounting().transfers_in_flight == 0 {
                break;
            }
            let results = self.runner.wait_completed(Duration::from_millis(10));
            self.first_layers(&mut events);
            self.absorb(results, &mut events);
            self.emit(&mut events);
        }
        events
    }

    /// The runner namespace standing for the engine's `namespace` on this
    /// tensor-parallel shard: derived from the namespace id and the shard
    /// alone, so the same shard of every engine names the same pages, and
    /// another shard's pages are other keys. A hint that sends rank 1 to rank
    /// 0's runner therefore finds nothing: a miss, never the wrong shard.
    fn runner_namespace(&mut self, namespace: NamespaceId) -> NamespaceId {
        if let Some(id) = self.namespaces.get(&namespace) {
            return *id;
        }
        let layout = &self.config.layout;
        let digest = shard_digest(namespace.0, layout.tp_rank, layout.tp_size);
        let id = self
            .runner
            .register_namespace(Namespace::base(CompatDigest(digest)));
        self.namespaces.insert(namespace, id);
        self.engine_namespaces.insert(id, namespace);
        id
    }

    fn scoped(&mut self, namespace: NamespaceId, key: BlockKey) -> ScopedKey {
        ScopedKey {
            namespace: self.runner_namespace(namespace),
            key,
        }
    }

    fn elements(&self, slot: DeviceSlot) -> Vec<ElementRef> {
        self.regions
            .iter()
            .map(|region| ElementRef {
                region: *region,
                index: u64::from(slot.0),
            })
            .collect()
    }

    fn check_slot(&self, slot: DeviceSlot) -> kvcr_linker_contracts::Result<()> {
        if slot.0 < self.config.layout.device_pages {
            Ok(())
        } else {
            Err(LinkError::DeviceSlot {
                slot,
                slots: self.config.layout.device_pages,
            })
        }
    }

    fn release_claims(&mut self, claims: impl IntoIterator<Item = ClaimId>) {
        let handles: Vec<ReleaseHandle> = claims
            .into_iter()
            .filter(|c| self.claims.remove(c).is_some())
            .map(|c| ReleaseHandle(c.0))
            .collect();
        if !handles.is_empty() {
            let _ = self.runner.release(&handles);
        }
    }

    /// Restores whose first layer is in place (before their results, which
    /// the runner drains after these).
    fn first_layers(&mut self, events: &mut Vec<LinkerEvent>) {
        for (op, landed) in self.runner.poll_leads_landed() {
            match self.pending.get(&op) {
                Some(Pending::Restore { ticket, part }) => {
                    let said = self
                        .restores
                        .get_mut(ticket)
                        .and_then(|r| r.first_layer(*ticket, *part, landed));
                    events.extend(said);
                }
                Some(Pending::Load {
                    ticket, attempt, ..
                }) => events.push(LinkerEvent::FirstLayerLanded {
                    attempt: attempt.clone(),
                    ticket: *ticket,
                    pages: landed,
                }),
                _ => {}
            }
        }
    }

    fn absorb(&mut self, results: Vec<OpResult>, events: &mut Vec<LinkerEvent>) {
        for result in results {
            match self.pending.remove(&result.op) {
                Some(fetch @ Pending::Fetch { .. }) => self.land_fetch(fetch, Some(&result)),
                Some(Pending::Load {
                    transfer,
                    ticket,
                    attempt,
                }) => {
                    let success = result.entries.iter().all(|(_, e)| e.is_success());
                    let release = self.prepared.land_load(transfer);
                    self.release_claims(release);
                    events.push(LinkerEvent::LoadDone {
                        attempt,
                        ticket,
                        success,
                    });
                }
                Some(Pending::Restore { ticket, part }) => {
                    let restored = result
                        .entries
                        .iter()
                        .take_while(|(_, e)| e.is_success())
                        .count();
                    let restored = u32::try_from(restored).unwrap_or(u32::MAX);
                    let said = self
                        .restores
                        .get_mut(&ticket)
                        .and_then(|r| r.part_done(ticket, part, restored));
                    if let Some(done) = said {
                        self.restores.remove(&ticket);
                        events.push(done);
                    }
                }
                Some(Pending::Offload(ticket)) => {
                    let success = result.entries.iter().all(|(_, e)| e.is_success());
                    if let Some(slot) = self.offloads.iter_mut().find(|(t, _)| *t == ticket) {
                        slot.1 = Some(success);
                    }
                }
                // An operation this linker no longer tracks (none today).
                None => {}
            }
        }
    }

    /// Evictions, then offload outcomes in submission order.
    fn emit(&mut self, events: &mut Vec<LinkerEvent>) {
        let removed: Vec<ScopedKey> = std::mem::take(
            &mut *self
                .removals
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        if !removed.is_empty() {
            let keys = removed
                .into_iter()
                .map(|k| ScopedKey {
                    namespace: self
                        .engine_namespaces
                        .get(&k.namespace)
                        .copied()
                        .unwrap_or(k.namespace),
                    key: k.key,
                })
                .collect();
            events.push(LinkerEvent::Evicted {
                incarnation: self.incarnation,
                tier: STORE_TIER,
                keys,
            });
        }
        while let Some((ticket, Some(success))) = self.offloads.front().copied() {
            self.offloads.pop_front();
            events.push(LinkerEvent::OffloadDone { ticket, success });
        }
    }

    fn land_fetch(&mut self, fetch: Pending, result: Option<&OpResult>) {
        let Pending::Fetch {
            transfer,
            attempt,
            namespace,
            tail,
            device_prefix_pages,
        } = fetch
        else {
            return;
        };
        let mut pages = Vec::with_capacity(tail.len());
        for (i, key) in tail.iter().enumerate() {
            let handle = result
                .and_then(|r| r.entries.get(i))
                .filter(|(k, e)| k.key == *key && e.is_success())
                .and_then(|(_, e)| e.release);
            let claim = handle.map(|h| ClaimId(h.0));
            if let Some(claim) = claim {
                let scoped = self.scoped(namespace, *key);
                self.claims.insert(claim, scoped);
            }
            pages.push((*key, claim));
        }
        // Claims after the contiguous run, and all of them for an attempt
        // that is gone, come back for release.
        let release = self
            .prepared
            .land_staging(transfer, &attempt, device_prefix_pages, pages);
        self.release_claims(release);
    }
}
