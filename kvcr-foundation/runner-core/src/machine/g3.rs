//! G3, the file tier under KVCR DRAM, as the core plans it.
//!
//! The core never touches a file: it keeps G3's residencies, slots, claims
//! and eviction queue, and asks the driver to move bytes with
//! [`Action::G3`] (a spill writes a DRAM slot into a G3 slot; a fill reads a
//! G3 slot into a DRAM slot). The driver reports each transfer like a copy
//! (`handle_copy_done`).
//!
//! Rules (the DRAM rules, carried over):
//! * **Move, not copy.** A policy answering [`EvictionDecision::MoveToG3`]
//!   for a DRAM victim starts a spill: the DRAM page is claimed and marked to
//!   retire, and leaves DRAM only once G3 holds its bytes (the driver's write
//!   completed) and its last reader is done. Until then the deposit that
//!   needed the room waits ([`CapacityWaiter`]), and resumes when the spill
//!   ends, by its operation's deadline at the latest.
//! * **READY only when written.** A G3 residency is `Storing` until the
//!   driver reports the write; only then is it readable, queryable as
//!   fetchable and published (`Stored`, medium `DISK`).
//! * **Never both lost.** A failed spill frees its G3 slot and keeps the DRAM
//!   copy (which is dropped, not moved, when it is next chosen), so the bytes
//!   are always in at least one tier. A late success after a failure is
//!   impossible: an outcome is reported once per transfer.
//! * **A failed read drops the G3 copy.** Bytes G3 could not read are never
//!   served: the residency goes (`Removed`, medium `DISK`) and the reader's
//!   key fails.
//! * **Claims.** A G3 residency being read is claimed and never evicted; the
//!   G3 eviction queue (least recently used) holds only READY, unclaimed ones.
//! * **One pool, a slot per span.** G3 serves the runner's one pool: its
//!   slot is that pool's block, and a page of `n` spans (K and V, say) takes
//!   `n` G3 slots, moved span by span; a page is READY in G3 only when every
//!   span landed. Pages of other pools are dropped, not moved.

use super::*;

/// Most spills ahead in flight at once.
const AHEAD_IN_FLIGHT: usize = 16;
/// Most eviction candidates a spill ahead looks at per call.
const AHEAD_WINDOW: usize = 4096;

/// Operation of the runner's own background work (spills): no caller waits
/// on it, and no operation of a caller has this handle (they start at 1).
pub(super) const BACKGROUND: OpHandle = OpHandle(0);

/// The file tier's shape, as the core sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct G3Config {
    /// Slots across every G3 file.
    pub slots: u32,
    /// Bytes per slot: the pool's block (one span of a page).
    pub slot_bytes: u64,
    /// The files' direct-I/O alignment (the driver bounces a deliver
    /// destination that is off it).
    pub alignment: u64,
    /// Copy the pages next in line for eviction to G3 while the pool still
    /// has room (see `Core::spill_ahead`), so evicting them later is free.
    pub spill_ahead: bool,
}

/// Which way a G3 transfer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum G3Direction {
    /// DRAM → G3 slot (a spill).
    Store,
    /// G3 slot → DRAM (a fill).
    Load,
}

/// One span's G3 transfer: `len` bytes between memory at `addr` and G3
/// slot `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct G3Transfer {
    /// The G3 slot.
    pub slot: u32,
    /// The DRAM address (a runner pool slot).
    pub addr: u64,
    /// Bytes (at most the slot size).
    pub len: u64,
    /// Store or load.
    pub direction: G3Direction,
}

/// What G3 did, and holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct G3Counters {
    /// Spills started (moves and spills ahead).
    pub spills: u64,
    /// Spills ahead started: copies of the pages next in line for eviction,
    /// made while the pool still has room, so their eviction waits for
    /// nothing.
    pub spills_ahead: u64,
    /// Spills committed (the page is READY in G3).
    pub spills_committed: u64,
    /// Spills that failed (the DRAM copy was kept).
    pub spills_failed: u64,
    /// DRAM pages dropped by a move because G3 already held them.
    pub moves_already_stored: u64,
    /// Fills (G3 → DRAM) started.
    pub fills: u64,
    /// Fills whose read failed (the G3 copy was dropped).
    pub fills_failed: u64,
    /// G3 pages evicted for room.
    pub evictions: u64,
    /// Bytes written into G3.
    pub bytes_spilled: u64,
    /// Bytes read out of G3.
    pub bytes_filled: u64,
    /// Keys that waited for DRAM room a spill was making.
    pub capacity_waits: u64,
    /// G3 residencies now (storing or READY).
    pub resident: u64,
    /// Free G3 slots now.
    pub free_slots: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum G3State {
    /// A spill is writing the bytes.
    Storing,
    /// The bytes are in the file.
    Ready,
}

#[derive(Debug)]
pub(super) struct G3Entry {
    /// One G3 slot per span of the page's layout, in span order.
    slots: Vec<u32>,
    state: G3State,
    claims: u32,
    /// Key into the eviction queue while queued.
    seq: u64,
    queued: bool,
    layout: u16,
    page: Option<PageInfo>,
    /// A read of it failed: no new reader starts, and it goes with the last.
    poisoned: bool,
    /// While `Storing`: a move (the DRAM copy retires once it lands) or a
    /// spill ahead (the DRAM copy stays, clean: evicting it later is free).
    moving: bool,
}

/// G3's state inside the core.
#[derive(Debug)]
pub(super) struct G3Tier {
    config: G3Config,
    free: VecDeque<u32>,
    entries: HashMap<ScopedKey, G3Entry>,
    /// READY, unclaimed residencies, least recently used first.
    queue: BTreeMap<u64, ScopedKey>,
    next_seq: u64,
    counters: G3Counters,
    /// Spills ahead writing now.
    ahead_in_flight: usize,
}

impl G3Tier {
    pub(super) fn new(config: G3Config) -> Self {
        Self {
            config,
            free: (0..config.slots).collect(),
            entries: HashMap::new(),
            queue: BTreeMap::new(),
            next_seq: 0,
            counters: G3Counters::default(),
            ahead_in_flight: 0,
        }
    }

    fn enqueue(&mut self, key: ScopedKey) {
        let seq = self.next_seq;
        let Some(e) = self.entries.get_mut(&key) else {
            return;
        };
        if e.queued || e.claims != 0 || e.state != G3State::Ready {
            return;
        }
        self.next_seq += 1;
        e.seq = seq;
        e.queued = true;
        self.queue.insert(seq, key);
    }

    fn dequeue(&mut self, key: ScopedKey) {
        if let Some(e) = self.entries.get_mut(&key).filter(|e| e.queued) {
            e.queued = false;
            self.queue.remove(&e.seq);
        }
    }

    /// Removes an entry (unqueued first); returns its slots to the free list.
    fn remove(&mut self, key: ScopedKey) -> Option<G3Entry> {
        self.dequeue(key);
        let e = self.entries.remove(&key)?;
        self.free.extend(e.slots.iter().copied());
        Some(e)
    }

    pub(super) fn counters_mut(&mut self) -> &mut G3Counters {
        &mut self.counters
    }

    fn is_ready(&self, key: &ScopedKey) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.state == G3State::Ready && !e.poisoned)
    }
}

/// What an allocation of DRAM slots came to.
#[derive(Debug)]
pub(super) enum Allocation {
    /// The slots, taken.
    Slots(Vec<u32>),
    /// Not now: spills to G3 are making the room (nothing else was taken).
    Pending,
    /// Not even after evicting or moving every candidate.
    Full,
}

/// A key of an operation waiting for DRAM room.
#[derive(Debug)]
pub(super) struct CapacityWaiter {
    pub(super) op: OpHandle,
    pub(super) entry: u32,
    pub(super) key: ScopedKey,
    pub(super) layout: u16,
    pub(super) kind: WaiterKind,
}

/// A copy job being gathered for one operation: its id, keys and spans.
type GatheredCopy = (JobId, Vec<JobKey>, Vec<Vec<CopySpan>>);

/// What a waiter does once it has room.
#[derive(Debug)]
pub(super) enum WaiterKind {
    /// A deposit: copy these framework spans in.
    Deposit {
        spans: Vec<CopySpan>,
        page: Option<PageInfo>,
    },
    /// A fetch or deliver: fill from the key's G3 copy.
    G3Fill,
}

/// How a claim on a G3 copy ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum G3Read {
    /// The bytes were read.
    Read,
    /// The read failed: the copy is not trusted any more.
    Failed,
    /// Nothing was read (cancelled, past its deadline, no room after all).
    NotRead,
}

/// What moving a DRAM victim to G3 takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Move {
    /// G3 already holds the bytes: the DRAM copy just goes.
    AlreadyStored,
    /// A spill must write them first.
    Spill,
    /// G3 cannot hold this page (or a spill of it failed before): drop it.
    Drop,
    /// A spill ahead is copying it: not a victim until that lands.
    Busy,
}

impl Core {
    /// The scope G3 pages are published under (medium `DISK`).
    fn g3_scope(namespace: NamespaceId) -> InventoryScope {
        InventoryScope {
            owner: Owner::Kvcr,
            namespace,
            medium: Medium::Disk,
        }
    }

    /// Whether G3 can hold pages of `layout`: every span in a pool whose
    /// block is a G3 slot, and no more spans than G3 has slots.
    pub(super) fn g3_fits(&self, layout: u16) -> bool {
        let Some(g3) = &self.g3 else { return false };
        let Some(pools) = self.layouts.get(layout as usize) else {
            return false;
        };
        pools.len() <= g3.config.slots as usize
            && pools.iter().all(|pool| {
                self.pools
                    .get(pool.0 as usize)
                    .is_some_and(|p| p.block_size == g3.config.slot_bytes)
            })
    }

    /// What moving DRAM record `idx` to G3 takes.
    pub(super) fn g3_move_kind(&self, idx: u32) -> Move {
        let Some(r) = self.record(idx) else {
            return Move::Drop;
        };
        if !self.g3_fits(r.layout) || r.flags & FLAG_SPILL_FAILED != 0 {
            return Move::Drop;
        }
        match self.g3.as_ref().and_then(|g| g.entries.get(&r.key)) {
            Some(e) if e.state == G3State::Ready && !e.poisoned => Move::AlreadyStored,
            // A spill ahead is reading it: it stays until that lands.
            Some(e) if e.state == G3State::Storing => Move::Busy,
            Some(_) => Move::Drop,
            None => Move::Spill,
        }
    }

    /// Whether G3 could find `more` slots beyond `promised` ones already
    /// counted (free ones, or those of READY unclaimed pages to evict).
    pub(super) fn g3_has_room(&self, promised: usize, more: usize) -> bool {
        self.g3.as_ref().is_some_and(|g| {
            let evictable: usize = g
                .queue
                .values()
                .filter_map(|k| g.entries.get(k))
                .map(|e| e.slots.len())
                .sum();
            g.free.len() + evictable >= promised + more
        })
    }

    /// `n` G3 slots: free ones, else those of the least recently used READY
    /// unclaimed pages (each published `Removed`). Takes nothing unless all
    /// `n` can be had.
    fn g3_take_slots(&mut self, n: usize) -> Option<Vec<u32>> {
        if !self.g3_has_room(0, n) {
            return None;
        }
        let mut evicted = Vec::new();
        let g3 = self.g3.as_mut()?;
        while g3.free.len() < n {
            let (_, victim) = g3.queue.pop_first()?;
            if let Some(e) = g3.entries.get_mut(&victim) {
                e.queued = false;
            }
            g3.remove(victim)?;
            g3.counters.evictions += 1;
            evicted.push(victim);
        }
        let slots = g3.free.drain(..n).collect();
        for victim in evicted {
            self.events.push(InventoryEvent::Removed {
                scope: Self::g3_scope(victim.namespace),
                keys: vec![victim.key],
            });
            self.keep_in_dram(victim);
        }
        Some(slots)
    }

    /// G3 no longer holds `key`: a DRAM copy waiting to retire after its
    /// spill (a reader still held it) stays instead, so the page is not lost
    /// from both tiers.
    fn keep_in_dram(&mut self, key: ScopedKey) {
        if let Some(record) = self.index.get(&key).map(|e| e.record)
            && let Some(r) = self.record_mut(record)
        {
            r.flags &= !FLAG_RETIRE;
        }
    }

    /// Starts spilling DRAM records `victims` (each checked by
    /// [`Self::g3_move_kind`] to need a spill) in one G3 job: each is
    /// claimed and marked to retire, and gets a `Storing` G3 residency.
    /// A victim G3 finds no slot for is dropped instead (returned).
    pub(super) fn start_spills(&mut self, now: u64, victims: &[u32]) -> Vec<u32> {
        let mut dropped = Vec::new();
        let mut job = Vec::new();
        for &idx in victims {
            match self.begin_spill(idx, true) {
                Some(transfers) => job.push((idx, transfers)),
                None => dropped.push(idx),
            }
        }
        self.submit_spills(now, job);
        dropped
    }

    /// Takes G3 slots for DRAM record `idx` (one per span of a resolving
    /// source), records its `Storing` G3 residency and returns the writes;
    /// `None` (nothing changed) when G3 has no room or a span does not
    /// resolve. A move (`moving`) claims the DRAM page and marks it to
    /// retire; a spill ahead leaves it as it is.
    fn begin_spill(&mut self, idx: u32, moving: bool) -> Option<Vec<G3Transfer>> {
        let (key, layout) = self.record(idx).map(|r| (r.key, r.layout))?;
        let sources = self.slot_spans(idx);
        let spans = self.layouts.get(layout as usize).map_or(0, Vec::len);
        if sources.is_empty() || sources.len() != spans {
            return None;
        }
        let slots = self.g3_take_slots(sources.len())?;
        if moving {
            self.claim_internal(idx);
            if let Some(r) = self.record_mut(idx) {
                r.flags |= FLAG_RETIRE;
            }
        }
        let page = self.page_info.get(&idx).cloned();
        let transfers = sources
            .iter()
            .zip(&slots)
            .map(|(source, slot)| G3Transfer {
                slot: *slot,
                addr: source.src,
                len: source.len,
                direction: G3Direction::Store,
            })
            .collect();
        let g3 = self.g3.as_mut()?;
        g3.entries.insert(
            key,
            G3Entry {
                slots,
                state: G3State::Storing,
                claims: 0,
                seq: 0,
                queued: false,
                layout,
                page,
                poisoned: false,
                moving,
            },
        );
        g3.counters.spills += 1;
        if !moving {
            g3.counters.spills_ahead += 1;
            g3.ahead_in_flight += 1;
        }
        Some(transfers)
    }

    /// Submits spills begun with [`Self::begin_spill`] as one G3 job of the
    /// runner's own.
    fn submit_spills(&mut self, now: u64, spills: Vec<(u32, Vec<G3Transfer>)>) {
        if spills.is_empty() {
            return;
        }
        let job = self.reserve_job();
        let (keys, transfers) = spills
            .into_iter()
            .map(|(record, transfers)| (JobKey::Spill { record }, transfers))
            .unzip();
        self.jobs.insert(
            job,
            Job {
                op: BACKGROUND,
                keys,
            },
        );
        self.actions.push_back(Action::G3 {
            job,
            deadline_ns: now.saturating_add(self.operation_timeout_ns),
            transfers,
        });
    }

    /// Ends the spill of DRAM record `record`: on success the G3 copy is
    /// READY (published) and the DRAM copy retires with its last reader; on
    /// failure the G3 slot is freed and the DRAM copy stays.
    pub(super) fn finish_spill(&mut self, record: u32, copied: bool) {
        let Some(key) = self.record(record).map(|r| r.key) else {
            return;
        };
        let bytes = self.record_bytes(record);
        let Some(g3) = self.g3.as_mut() else { return };
        let moving = g3.entries.get(&key).is_some_and(|e| e.moving);
        if !moving {
            g3.ahead_in_flight = g3.ahead_in_flight.saturating_sub(1);
        }
        if copied {
            let mut stored = None;
            if let Some(e) = g3.entries.get_mut(&key) {
                e.state = G3State::Ready;
                stored = Some(e.page.clone());
            }
            g3.enqueue(key);
            g3.counters.spills_committed += 1;
            g3.counters.bytes_spilled += bytes;
            if let Some(page) = stored {
                let event = self.stored_event(Self::g3_scope(key.namespace), key, page.as_ref());
                self.events.push(event);
            }
            if moving {
                // The DRAM copy goes once its last reader is done (retire).
                self.unclaim(record);
            }
        } else {
            g3.remove(key);
            g3.counters.spills_failed += 1;
            if let Some(r) = self.record_mut(record) {
                r.flags &= !FLAG_RETIRE;
                r.flags |= FLAG_SPILL_FAILED;
            }
            if moving {
                self.unclaim(record);
            }
        }
    }

    /// Spills ahead: once the pool is half full, copies the pages next in
    /// line for eviction (the oldest quarter of the queue, at most
    /// [`AHEAD_WINDOW`] looked at) that the policy would move, at most
    /// [`AHEAD_IN_FLIGHT`] at a time, into free G3 slots. Their DRAM copies
    /// stay READY and evictable; once G3 holds them, evicting them is a drop,
    /// so a deposit into a full pool waits for no disk write.
    pub(super) fn spill_ahead(&mut self, now: u64) {
        let Some(g3) = self.g3.as_ref().filter(|g| g.config.spill_ahead) else {
            return;
        };
        // Only once the pool is half full: an emptier pool evicts nothing soon.
        let (free, total) = self.pools.iter().fold((0usize, 0usize), |(f, t), p| {
            (f + p.free.len(), t + p.total as usize)
        });
        if free * 2 > total {
            return;
        }
        let mut budget = AHEAD_IN_FLIGHT.saturating_sub(g3.ahead_in_flight);
        if budget == 0 {
            return;
        }
        let window = (total / 4).clamp(1, AHEAD_WINDOW);
        let mut chosen = Vec::new();
        let mut promised = 0;
        let mut cursor = self.first_candidate();
        for _ in 0..window {
            let Some(idx) = cursor else { break };
            cursor = self.next_candidate(idx);
            if self.g3_move_kind(idx) != Move::Spill {
                continue;
            }
            let Some(meta) = self.meta(idx) else { continue };
            if self.policy.decide_eviction(&meta) != EvictionDecision::MoveToG3 {
                continue;
            }
            let spans = self
                .record(idx)
                .and_then(|r| self.layouts.get(r.layout as usize))
                .map_or(0, Vec::len);
            // Ahead of time, only free G3 slots: never evict G3 pages for it.
            if self
                .g3
                .as_ref()
                .is_none_or(|g| g.free.len() < promised + spans)
            {
                break;
            }
            promised += spans;
            chosen.push(idx);
            budget -= 1;
            if budget == 0 {
                break;
            }
        }
        let spills = chosen
            .into_iter()
            .filter_map(|idx| self.begin_spill(idx, false).map(|t| (idx, t)))
            .collect();
        self.submit_spills(now, spills);
    }

    /// Starts filling `key` from its READY G3 copy into a new DRAM residency
    /// for entry `entry` of `op` (a fetch or deliver of a key DRAM lacks).
    /// Returns `false` when G3 has no READY copy of it in `layout` (the
    /// caller looks elsewhere).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_g3_fill(
        &mut self,
        now: u64,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
        protected: &[ScopedKey],
        batch: &mut Vec<(u32, Vec<G3Transfer>)>,
    ) -> bool {
        let matches = self
            .g3
            .as_ref()
            .and_then(|g| g.entries.get(&key))
            .is_some_and(|e| e.state == G3State::Ready && !e.poisoned && e.layout == layout);
        if !matches {
            return false;
        }
        // Claimed first: making DRAM room may spill, and a spill must never
        // evict the G3 copy this fill is about to read.
        if let Some(g3) = self.g3.as_mut() {
            g3.dequeue(key);
            if let Some(e) = g3.entries.get_mut(&key) {
                e.claims += 1;
            }
        }
        // Another reader's fill of this key waits for room already: queue
        // behind it, and share its fill once it has a record (the room
        // coming is that reader's; asking for more would find none and
        // fail a key that is about to be in DRAM).
        let queued = self
            .capacity_waiters
            .iter()
            .any(|w| w.key == key && matches!(w.kind, WaiterKind::G3Fill));
        if queued {
            self.wait_for_capacity(op, entry, key, layout, WaiterKind::G3Fill);
            return true;
        }
        match self.allocate(now, layout, protected) {
            Allocation::Slots(slots) => {
                self.begin_g3_fill(now, op, entry, key, layout, slots, batch)
            }
            Allocation::Pending => {
                self.wait_for_capacity(op, entry, key, layout, WaiterKind::G3Fill)
            }
            Allocation::Full => {
                self.g3_release(key, G3Read::NotRead);
                self.set_result(
                    op,
                    entry,
                    EntryResult::failed(FailReason::CapacityExhausted),
                );
            }
        }
        true
    }

    /// With DRAM slots in hand: the DRAM residency FILLING from the G3 copy
    /// (already claimed by the caller, until the read is terminal).
    #[allow(clippy::too_many_arguments)]
    fn begin_g3_fill(
        &mut self,
        now: u64,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
        slots: Vec<u32>,
        batch: &mut Vec<(u32, Vec<G3Transfer>)>,
    ) {
        let Some((g3_slots, page)) = self.g3.as_mut().and_then(|g| {
            let e = g.entries.get(&key)?;
            let found = (e.slots.clone(), e.page.clone());
            g.counters.fills += 1;
            Some(found)
        }) else {
            // The slots go back: nothing reads into them.
            self.return_slots(layout, slots);
            self.set_result(op, entry, EntryResult::failed(FailReason::NoSource));
            return;
        };
        let record = self.insert_record(now, key, layout, slots);
        let dests = self.slot_spans(record);
        if dests.len() != g3_slots.len() {
            self.g3_release(key, G3Read::NotRead);
            self.remove_record(record, "g3 fill without its slots");
            self.set_result(op, entry, EntryResult::failed(FailReason::NoSource));
            return;
        }
        let fill = self.new_fill(Fill {
            record,
            // The job id is set when the batch is submitted.
            source: FillSource::G3 {
                job: JobId(0),
                key: 0,
            },
            waiters: Vec::new(),
            page,
        });
        self.filling.insert(record, fill);
        self.wait_on_fill(op, entry, fill);
        batch.push((
            fill,
            dests
                .iter()
                .zip(g3_slots)
                .map(|(dest, slot)| G3Transfer {
                    slot,
                    addr: dest.src,
                    len: dest.len,
                    direction: G3Direction::Load,
                })
                .collect(),
        ));
    }

    /// For entry `entry` of deliver `op` whose key DRAM lacks: when G3 holds
    /// it READY and its destinations are host spans of a whole slot each,
    /// claims the G3 copy and returns the transfers that read it straight
    /// into them (no DRAM slot, no eviction).
    pub(super) fn g3_direct_deliver(
        &mut self,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
    ) -> Option<Vec<G3Transfer>> {
        let g3 = self.g3.as_ref()?;
        let e = g3.entries.get(&key)?;
        if e.state != G3State::Ready || e.poisoned || e.layout != layout {
            return None;
        }
        let o = self.ops.get(&op)?;
        if o.memory != RegionMemory::Host {
            return None;
        }
        // The driver bounces a destination off the files' alignment.
        let dests = &o.entries.get(entry as usize)?.destinations;
        let direct =
            dests.len() == e.slots.len() && dests.iter().all(|d| d.len == g3.config.slot_bytes);
        if !direct {
            return None;
        }
        let transfer: Vec<G3Transfer> = dests
            .iter()
            .zip(&e.slots)
            .map(|(dest, slot)| G3Transfer {
                slot: *slot,
                addr: dest.dst,
                len: dest.len,
                direction: G3Direction::Load,
            })
            .collect();
        let g3 = self.g3.as_mut()?;
        g3.dequeue(key);
        if let Some(e) = g3.entries.get_mut(&key) {
            e.claims += 1;
        }
        g3.counters.fills += 1;
        Some(transfer)
    }

    /// Bytes of `key`'s G3 copy (0 when G3 does not hold it).
    pub(super) fn g3_bytes(&self, key: &ScopedKey) -> u64 {
        self.g3.as_ref().map_or(0, |g| {
            g.entries
                .get(key)
                .map_or(0, |e| e.slots.len() as u64 * g.config.slot_bytes)
        })
    }

    /// Submits direct G3 delivers of `op` as one job.
    pub(super) fn submit_g3_delivers(
        &mut self,
        op: OpHandle,
        batch: Vec<(u32, ScopedKey, Vec<G3Transfer>)>,
    ) {
        if batch.is_empty() {
            return;
        }
        let job = self.reserve_job();
        let mut keys = Vec::with_capacity(batch.len());
        let mut transfers = Vec::with_capacity(batch.len());
        for (i, (entry, key, transfer)) in batch.into_iter().enumerate() {
            if let Some(e) = self
                .ops
                .get_mut(&op)
                .and_then(|o| o.entries.get_mut(entry as usize))
            {
                e.wait = Wait::Copy(job, i as u32);
            }
            keys.push(JobKey::G3Deliver { entry, key });
            transfers.push(transfer);
        }
        self.submit_g3_job(op, job, keys, transfers);
    }

    /// Registers G3 job `job` of caller operation `op` (which then waits for
    /// it) and asks the driver to run it by the operation's deadline.
    fn submit_g3_job(
        &mut self,
        op: OpHandle,
        job: JobId,
        keys: Vec<JobKey>,
        transfers: Vec<Vec<G3Transfer>>,
    ) {
        let deadline_ns = self.ops.get(&op).map_or(0, |o| o.deadline);
        if let Some(o) = self.ops.get_mut(&op) {
            o.jobs += 1;
        }
        self.jobs.insert(job, Job { op, keys });
        self.actions.push_back(Action::G3 {
            job,
            deadline_ns,
            transfers,
        });
    }

    /// Submits the G3 fills gathered for `op` as one job.
    pub(super) fn submit_g3_fills(&mut self, op: OpHandle, batch: Vec<(u32, Vec<G3Transfer>)>) {
        if batch.is_empty() {
            return;
        }
        let job = self.reserve_job();
        let mut keys = Vec::with_capacity(batch.len());
        let mut transfers = Vec::with_capacity(batch.len());
        for (i, (fill, transfer)) in batch.into_iter().enumerate() {
            if let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::as_mut) {
                f.source = FillSource::G3 { job, key: i as u32 };
            }
            keys.push(JobKey::Fill(fill));
            transfers.push(transfer);
        }
        self.submit_g3_job(op, job, keys, transfers);
    }

    /// Drops a claim on `key`'s G3 copy after `read`: a failed read drops
    /// the copy (bytes G3 could not read are never served again).
    pub(super) fn g3_release(&mut self, key: ScopedKey, read: G3Read) {
        let Some(g3) = self.g3.as_mut() else { return };
        let Some(e) = g3.entries.get_mut(&key) else {
            return;
        };
        e.claims = e.claims.saturating_sub(1);
        // The first failed read withdraws the copy at once (routers stop
        // hinting it, and no new reader starts); its slots go back when its
        // last reader is done.
        let withdrawn = read == G3Read::Failed && !e.poisoned;
        if read == G3Read::Failed {
            e.poisoned = true;
            g3.counters.fills_failed += 1;
        } else if read == G3Read::Read && !e.poisoned {
            g3.counters.bytes_filled += e.slots.len() as u64 * g3.config.slot_bytes;
        }
        if !e.poisoned {
            g3.enqueue(key);
        } else if e.claims == 0 {
            g3.remove(key);
        }
        if withdrawn {
            self.events.push(InventoryEvent::Removed {
                scope: Self::g3_scope(key.namespace),
                keys: vec![key.key],
            });
            self.keep_in_dram(key);
        }
    }

    /// Puts slots taken for `layout` back at the front of their free lists.
    pub(super) fn return_slots(&mut self, layout: u16, slots: Vec<u32>) {
        for (i, slot) in slots.into_iter().enumerate() {
            let pool = self
                .layouts
                .get(layout as usize)
                .and_then(|l| l.get(i))
                .map(|p| p.0 as usize);
            if let Some(p) = pool.and_then(|p| self.pools.get_mut(p)) {
                p.free.push_front(slot);
            }
        }
    }

    /// Sets what entry `entry` of `op` waits on.
    fn set_wait(&mut self, op: OpHandle, entry: u32, wait: Wait) {
        if let Some(e) = self
            .ops
            .get_mut(&op)
            .and_then(|o| o.entries.get_mut(entry as usize))
        {
            e.wait = wait;
        }
    }

    /// Parks entry `entry` of `op` until DRAM room appears.
    pub(super) fn wait_for_capacity(
        &mut self,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
        kind: WaiterKind,
    ) {
        self.set_wait(op, entry, Wait::Capacity);
        if let Some(g3) = self.g3.as_mut() {
            g3.counters.capacity_waits += 1;
        }
        self.capacity_waiters.push_back(CapacityWaiter {
            op,
            entry,
            key,
            layout,
            kind,
        });
    }

    /// Drops the waiter of entry `entry` of `op` (it failed or was aborted),
    /// with the G3 claim a waiting fill holds.
    pub(super) fn forget_waiter(&mut self, op: OpHandle, entry: u32) {
        let (gone, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.capacity_waiters)
            .into_iter()
            .partition(|w| w.op == op && w.entry == entry);
        self.capacity_waiters = kept;
        for w in gone {
            self.drop_waiter(w);
        }
    }

    /// Lets a waiter go: a waiting G3 fill unclaims the copy it would read.
    fn drop_waiter(&mut self, w: CapacityWaiter) {
        if matches!(w.kind, WaiterKind::G3Fill) {
            self.g3_release(w.key, G3Read::NotRead);
        }
    }

    /// Retries the waiting keys, oldest first, after room may have appeared:
    /// a key now resident is served from DRAM; one that gets slots starts its
    /// copy or G3 fill; the first that must still wait keeps its place and
    /// every later one with it.
    pub(super) fn resume_capacity_waiters(&mut self, now: u64) {
        if self.capacity_waiters.is_empty() {
            return;
        }
        let mut copies: BTreeMap<OpHandle, GatheredCopy> = BTreeMap::new();
        let mut g3_batches: BTreeMap<OpHandle, Vec<(u32, Vec<G3Transfer>)>> = BTreeMap::new();
        let mut deliver_next: BTreeMap<OpHandle, Vec<(u32, u32)>> = BTreeMap::new();
        let mut touched = Vec::new();
        while let Some(w) = self.capacity_waiters.pop_front() {
            let live = self
                .ops
                .get(&w.op)
                .and_then(|o| o.entries.get(w.entry as usize))
                .is_some_and(|e| e.result.is_none() && e.wait == Wait::Capacity);
            if !live {
                self.drop_waiter(w);
                continue;
            }
            touched.push(w.op);
            // No longer waiting for room (set back below if it still must).
            self.set_wait(w.op, w.entry, Wait::None);
            if let Some(IndexEntry { record, state }) = self.index.get(&w.key).copied() {
                // Resident after all: a waiting fill's G3 claim is not needed.
                if matches!(w.kind, WaiterKind::G3Fill) {
                    self.g3_release(w.key, G3Read::NotRead);
                }
                let same_layout = self.record(record).is_some_and(|r| r.layout == w.layout);
                match state {
                    _ if !same_layout => self.set_result(
                        w.op,
                        w.entry,
                        EntryResult::failed(FailReason::LayoutMismatch),
                    ),
                    Residency::Ready => {
                        self.fill_committed_for(now, w.op, w.entry, record, &mut deliver_next);
                    }
                    Residency::Filling => {
                        let fill = self.filling.get(&record).copied().unwrap_or(NIL);
                        self.wait_on_fill(w.op, w.entry, fill);
                    }
                    Residency::Discarding | Residency::Vacant => {
                        self.set_result(w.op, w.entry, EntryResult::failed(FailReason::Discarding))
                    }
                }
                continue;
            }
            let protected = [w.key];
            match self.allocate(now, w.layout, &protected) {
                Allocation::Pending => {
                    self.set_wait(w.op, w.entry, Wait::Capacity);
                    self.capacity_waiters.push_front(w);
                    break;
                }
                Allocation::Full => {
                    if matches!(w.kind, WaiterKind::G3Fill) {
                        self.g3_release(w.key, G3Read::NotRead);
                    }
                    self.set_result(
                        w.op,
                        w.entry,
                        EntryResult::failed(FailReason::CapacityExhausted),
                    );
                }
                Allocation::Slots(slots) => match w.kind {
                    WaiterKind::Deposit { mut spans, page } => {
                        let record = self.insert_record(now, w.key, w.layout, slots);
                        for (span, slot) in spans.iter_mut().zip(self.slot_spans(record)) {
                            span.dst = slot.src;
                        }
                        let (job, keys, job_spans) = copies
                            .entry(w.op)
                            .or_insert_with(|| (self.reserve_job(), Vec::new(), Vec::new()));
                        let fill = self.new_fill(Fill {
                            record,
                            source: FillSource::Copy {
                                job: *job,
                                key: keys.len() as u32,
                            },
                            waiters: Vec::new(),
                            page,
                        });
                        self.filling.insert(record, fill);
                        keys.push(JobKey::Fill(fill));
                        job_spans.push(spans);
                        self.wait_on_fill(w.op, w.entry, fill);
                    }
                    WaiterKind::G3Fill => {
                        // Claimed while waiting, so still there; but another
                        // reader may have found it unreadable meanwhile.
                        if self.g3_ready(&w.key) {
                            let batch = g3_batches.entry(w.op).or_default();
                            self.begin_g3_fill(now, w.op, w.entry, w.key, w.layout, slots, batch);
                        } else {
                            self.return_slots(w.layout, slots);
                            self.g3_release(w.key, G3Read::NotRead);
                            self.set_result(
                                w.op,
                                w.entry,
                                EntryResult::failed(FailReason::NoSource),
                            );
                        }
                    }
                },
            }
        }
        for (op, (job, keys, spans)) in copies {
            self.submit_job(op, job, keys, spans);
        }
        for (op, batch) in g3_batches {
            self.submit_g3_fills(op, batch);
        }
        for (op, entries) in deliver_next {
            self.start_delivers(now, op, entries);
        }
        for op in touched {
            self.finish_if_done(op);
        }
    }

    /// Per pool, the DRAM slots spills in flight will free, less what the
    /// keys already waiting for room need.
    pub(super) fn room_coming(&self) -> Vec<u32> {
        let mut room = vec![0u32; self.pools.len()];
        let Some(g3) = &self.g3 else { return room };
        let pools_of = |layout: u16| self.layouts.get(layout as usize).into_iter().flatten();
        for (key, e) in &g3.entries {
            if e.state != G3State::Storing || !e.moving {
                continue;
            }
            let Some(layout) = self
                .index
                .get(key)
                .and_then(|i| self.record(i.record))
                .map(|r| r.layout)
            else {
                continue;
            };
            for pool in pools_of(layout) {
                if let Some(n) = room.get_mut(pool.0 as usize) {
                    *n += 1;
                }
            }
        }
        for w in &self.capacity_waiters {
            for pool in pools_of(w.layout) {
                if let Some(n) = room.get_mut(pool.0 as usize) {
                    *n = n.saturating_sub(1);
                }
            }
        }
        room
    }

    /// The layout of `key`'s READY G3 copy (a peer's write fills it first).
    pub(super) fn g3_layout(&self, key: &ScopedKey) -> Option<u16> {
        let e = self.g3.as_ref()?.entries.get(key)?;
        (e.state == G3State::Ready && !e.poisoned).then_some(e.layout)
    }

    /// Whether G3 holds `key` READY (its bytes are in the file).
    pub fn g3_ready(&self, key: &ScopedKey) -> bool {
        self.g3.as_ref().is_some_and(|g| g.is_ready(key))
    }

    /// G3's counters (with its current occupancy), when configured.
    pub fn g3_counters(&self) -> Option<G3Counters> {
        self.g3.as_ref().map(|g| G3Counters {
            resident: g.entries.len() as u64,
            free_slots: g.free.len() as u64,
            ..g.counters
        })
    }

    /// G3's structural invariants (part of `check_invariants`).
    pub(super) fn check_g3(&self) -> std::result::Result<(), String> {
        let Some(g3) = &self.g3 else {
            return if self.capacity_waiters.is_empty() {
                Ok(())
            } else {
                Err("capacity waiters without G3".into())
            };
        };
        let used: usize = g3.entries.values().map(|e| e.slots.len()).sum();
        if g3.free.len() + used != g3.config.slots as usize {
            return Err(format!(
                "g3: {} free + {used} used != {} slots",
                g3.free.len(),
                g3.config.slots
            ));
        }
        let mut slots: HashSet<u32> = HashSet::new();
        for slot in &g3.free {
            if !slots.insert(*slot) {
                return Err(format!("g3: slot {slot} free twice"));
            }
        }
        for (key, e) in &g3.entries {
            if e.slots.is_empty() {
                return Err(format!("g3: {key:?} holds no slot"));
            }
            for slot in &e.slots {
                if !slots.insert(*slot) {
                    return Err(format!("g3: slot {slot} used twice ({key:?})"));
                }
            }
            let should_queue = e.state == G3State::Ready && e.claims == 0 && !e.poisoned;
            if e.queued != should_queue || (e.queued && g3.queue.get(&e.seq) != Some(key)) {
                return Err(format!("g3: {key:?} queued={} but {e:?}", e.queued));
            }
            if e.state == G3State::Storing {
                // A move's DRAM source is claimed and retiring until the
                // spill ends; a spill ahead's is READY (and evicted by none).
                let source = self.index.get(key).and_then(|i| self.record(i.record));
                let held = if e.moving {
                    source.is_some_and(|r| r.claims > 0 && r.flags & FLAG_RETIRE != 0)
                } else {
                    source.is_some_and(|r| r.state == Residency::Ready)
                };
                if !held {
                    return Err(format!("g3: storing {key:?} without its DRAM source held"));
                }
            }
        }
        let ahead = g3
            .entries
            .values()
            .filter(|e| e.state == G3State::Storing && !e.moving)
            .count();
        if ahead != g3.ahead_in_flight {
            return Err(format!(
                "g3: {ahead} spills ahead writing, {} counted",
                g3.ahead_in_flight
            ));
        }
        if g3.queue.len() != g3.entries.values().filter(|e| e.queued).count() {
            return Err("g3: queue and entries disagree".into());
        }
        // Only a spill retires a DRAM page: a retiring page is in G3 (being
        // written, or written and waiting for its last DRAM reader); after a
        // failed spill it keeps serving from DRAM.
        for (key, entry) in &self.index {
            let retiring = self
                .record(entry.record)
                .is_some_and(|r| r.flags & FLAG_RETIRE != 0);
            if retiring && !g3.entries.contains_key(key) {
                return Err(format!("{key:?} retires from DRAM but G3 does not hold it"));
            }
        }
        for w in &self.capacity_waiters {
            let waiting = self
                .ops
                .get(&w.op)
                .and_then(|o| o.entries.get(w.entry as usize))
                .is_some_and(|e| e.result.is_none() && e.wait == Wait::Capacity);
            if !waiting {
                return Err(format!(
                    "capacity waiter {:?}/{} is not waiting",
                    w.op, w.entry
                ));
            }
        }
        Ok(())
    }
}

use std::collections::HashSet;
