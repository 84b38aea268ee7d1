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

mod accounting;
mod capacity;
mod fill;
mod slots;
mod spill;

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
    /// Reads (fills and direct delivers) whose bytes did not match the
    /// page's digest taken before the spill: failed, the G3 copy dropped
    /// (counted in `fills_failed` too).
    pub digest_mismatches: u64,
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
    /// The DRAM page's digest when it was spilled: a fill checks the bytes
    /// it reads against it, and the filled page keeps it.
    digest: Option<u64>,
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
