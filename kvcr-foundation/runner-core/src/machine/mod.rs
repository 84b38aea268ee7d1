//! The runner's sans-I/O core.
//!
//! Plain data fed `(now, input)` that returns results and actions, like
//! quinn-proto: the block index, residencies (FILLING / READY / DISCARDING),
//! slot pools, claims, the eviction queue, operations with deadlines, and the
//! inventory events they cause. It never touches memory, threads or clocks;
//! the runner's driver (`kvcr-runner`) executes its [`Action`]s (copies) and feeds
//! back their outcomes.
//!
//! Invariants kept here (checked by the model-based property tests):
//! * a claimed residency is never in the eviction queue and never evicted;
//! * slots of a FILLING or DISCARDING residency stay owned until its copy is
//!   terminal; a slot is freed only when no copy can touch it;
//! * an operation completes once, after every key has a result **and** every
//!   copy it started is terminal (so its caller may reuse its buffers);
//! * a result set by abort or deadline is never turned into a success;
//! * `Stored` is emitted once per commit, `Removed` once per stored residency.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use hashbrown::HashMap as IndexMap;

use crate::error::{Error, Result, RunnerReason};
use crate::policy::{
    BlockMeta, CachePolicy, EvictionDecision, EvictionOrder, IngestDecision, SanitizedPolicy,
};
use crate::region::{RegionDesc, RegionMemory, RegionTable};
use crate::types::{
    CopySpan, DeliverEntry, DepositEntry, EntryResult, FailReason, OpResult, PageInfo, PoolId,
    PoolRange, PoolStats, QueryStatus, ReleaseHandle,
};
use destinations::Destinations;
use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::hint::RequestId;
use kvcr_contracts::key::{BlockKey, Namespace, NamespaceId, ScopedKey};
use kvcr_contracts::protocol::{
    DoorbellAdvert, ElementRef, ElementRuns, OpHandle, RegionId, SharedMemoryAdvert,
};
use kvcr_contracts::tier::{InventoryEvent, InventoryScope, Medium, Owner};

mod completions;
mod destinations;
mod events;
mod eviction;
mod g3;
mod leads;
mod operations;
mod peer;
mod records;
mod recovery;
mod registration;

pub use peer::{ConnectFailure, PeerConfig, PutSpan, RouteBudget};
pub use peer::{
    MAX_ADVERTISED_DEVICE_REGIONS, MAX_ADVERTISED_REGIONS, MAX_DEAD_INCARNATIONS,
    MAX_FENCES_PER_TARGET, MAX_REMEMBERED_PEERS, MAX_REPROBES_PER_ACK, MAX_RKEY_LEN,
    MAX_ROUTE_BUDGETS, MAX_WORKER_ADDRESS_LEN, PeerCounters, PeerNotice, PeerStateSizes,
};

use g3::{Allocation, CapacityWaiter, G3Tier, Move, WaiterKind};
pub use g3::{G3Config, G3Counters, G3Direction, G3Transfer};
pub use recovery::RecoveryReport;

/// Label prefix of the runner's own pool regions (`kvcr-dram/<pool>`).
pub const KVCR_REGION_PREFIX: &str = "kvcr-dram/";

/// Most spans (pools) one key may use.
pub const MAX_SPANS_PER_KEY: usize = 512;

const NIL: u32 = u32::MAX;

/// A copy job id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Run these copies off the caller's thread, key by key, skipping any key
    /// whose copy has not started by `deadline_ns` (runner time).
    Copy {
        /// The job.
        job: JobId,
        /// Runner time after which a not-yet-started key is skipped.
        deadline_ns: u64,
        /// Where the framework side of every span lives: host jobs run on the
        /// copy thread's memcpy, device jobs on the device copier.
        memory: RegionMemory,
        /// Per key, its spans.
        keys: Vec<Vec<CopySpan>>,
        /// Take each copied key's page digest over its destination bytes
        /// (a deposit, with page digests on) and report it with the outcome
        /// ([`Core::handle_copy_done_digested`]).
        digest: bool,
        /// A deliver into device memory: copy the first `lead` spans of
        /// every key first and report them landed
        /// ([`Core::handle_copy_lead_landed`]) while the rest copies; 0:
        /// no such report.
        lead: u16,
    },
    /// Send a control message to a peer.
    Send {
        /// The peer's control endpoint.
        to: ControlEndpoint,
        /// The message.
        message: kvcr_contracts::protocol::Message,
    },
    /// (Re)build the data-plane route to a target: endpoint from its worker
    /// address, remote keys of its regions. Replaces any older generation.
    Connect {
        /// The target's control endpoint.
        peer: ControlEndpoint,
        /// Local route generation (writes carry it; a newer one fences older writes).
        generation: u64,
        /// The target's packed worker address.
        worker_address: Vec<u8>,
        /// The target's regions: id, base address, packed remote key.
        rkeys: Vec<(RegionId, u64, Vec<u8>)>,
        /// The target's shared segments, for the driver to map when the
        /// target runs on this host (checked there, never trusted).
        shared_memory: Option<SharedMemoryAdvert>,
        /// Bytes from each region's base to the end of its last element:
        /// all a write may touch, so all a driver maps.
        extents: Vec<(RegionId, u64)>,
        /// Where the target takes sealed completion records (one of its
        /// regions), with the session's key: the driver rings it for a
        /// write whose bytes have landed, ahead of `write_done`.
        doorbell: Option<DoorbellAdvert>,
        /// The target's device regions (the one-hop route), for the driver
        /// to open with its device copier when the target runs on this host
        /// and it has one; it reports whether it opened them all
        /// ([`Core::handle_connected_one_hop`]). Empty: nothing to open.
        device_regions: Vec<kvcr_contracts::protocol::DeviceRegionAdvert>,
    },
    /// Put these spans into the target, flush, then report `handle_put_done`.
    Put {
        /// Source write id.
        write: u64,
        /// The target's control endpoint.
        target: ControlEndpoint,
        /// The route generation the write was accepted on.
        generation: u64,
        /// The puts.
        spans: Vec<peer::PutSpan>,
        /// With `device`: how many of `spans` each written key's page is,
        /// in order (they add up to `spans.len()`), so the driver plans
        /// the copies page by page without finding where pages end.
        /// Empty for any other write.
        page_spans: Vec<u32>,
        /// The spans land in the target's device regions (the one-hop
        /// route): the driver copies them through the device import it
        /// opened for this route, `remote` an address in the target's
        /// advertised device region, never through UCX or mapped pools.
        device: bool,
        /// With `device`: once the first `lead_elements` spans of every key
        /// (spans in key order, each key's in layout order) have landed,
        /// report [`Core::handle_put_lead_landed`] ahead of
        /// `handle_put_done`; 0: no such report.
        lead_elements: u16,
    },
    /// Run these G3 (file tier) transfers off the caller's thread, one per
    /// key of the job, skipping any that has not started by `deadline_ns`;
    /// report them like a copy job (`handle_copy_done`).
    G3 {
        /// The job.
        job: JobId,
        /// Runner time after which a not-yet-started key is skipped.
        deadline_ns: u64,
        /// Per key, its transfers (one per span); a key is copied only when
        /// all of them are.
        transfers: Vec<Vec<G3Transfer>>,
        /// Per key, the page digest its loads must find (the page's when
        /// it was spilled; `None`: nothing to check, or a store). A key
        /// whose bytes differ is reported [`CopyOutcome::Altered`].
        digests: Vec<Option<u64>>,
    },
    /// Skip key `key` of `job` if its copy has not started yet.
    Cancel {
        /// The job.
        job: JobId,
        /// Index of the key inside the job.
        key: u32,
    },
}

/// How one key of a copy job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyOutcome {
    /// The bytes are in place.
    Copied,
    /// Skipped on request before it started.
    Cancelled,
    /// Skipped because the deadline passed before it started.
    DeadlinePassed,
    /// The device copier reported a failure: the destination's bytes are
    /// unknown, and no copy touches the memory any more.
    Failed,
    /// The bytes were read, but they are not the page's digest (a G3 copy
    /// altered on disk): never served, and the copy read is dropped.
    Altered,
}

/// Residency state of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Residency {
    Vacant,
    Filling,
    Ready,
    /// A fill whose callers gave up while a remote write may still land: the
    /// slots stay owned until the write is terminal. Entered by peer fills.
    Discarding,
}

/// Slot indices of a record, one per span of its layout. One- and two-span
/// layouts (the common ones) are stored inline; longer ones live in
/// `Core::many_slots`, so a record stays 64 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotList {
    One(u32),
    Two(u32, u32),
    Many,
}

const FLAG_QUEUED: u8 = 1;
const FLAG_RETIRE: u8 = 2;
const FLAG_UNSCORED: u8 = 4;
/// A spill of this DRAM page to G3 failed: it is dropped, not moved, next time.
const FLAG_SPILL_FAILED: u8 = 8;

/// One page the runner holds (or is filling).
#[derive(Debug, Clone)]
struct Record {
    key: ScopedKey,
    slots: SlotList,
    last_access: u64,
    seq: u64,
    prev: u32,
    next: u32,
    claims: u32,
    access_count: u32,
    layout: u16,
    state: Residency,
    flags: u8,
}

// A resident page costs one record plus one index bucket; keep the record to
// one cache line.
const _: () = assert!(std::mem::size_of::<Record>() <= 64);

/// What the index keeps per key: the record, plus its state for `query`
/// (so a lookup touches one cache line of the table, not the record).
#[derive(Debug, Clone, Copy)]
struct IndexEntry {
    record: u32,
    state: Residency,
}

#[derive(Debug)]
struct PoolState {
    name: String,
    block_size: u64,
    region: RegionId,
    total: u32,
    free: VecDeque<u32>,
    evictable: u32,
    watermark: u32,
    pressured: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Deposit {
        no_evict: bool,
    },
    Fetch,
    Deliver,
    /// The runner's own: filling from G3 the keys a peer's write asks for
    /// that only G3 holds, before the write is served. Its result goes to no
    /// caller; its end resumes the write.
    SourcePrepare,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    None,
    /// Waiting as a waiter of a shared fill.
    Fill(u32),
    /// Waiting for its own deliver copy (key index inside the job).
    Copy(JobId, u32),
    /// Waiting for DRAM room that a spill to G3 is making.
    Capacity,
    /// A deliver entry whose own destination a same-host source writes
    /// (the one-hop route, target operation `.0`): resolved only by that
    /// operation's terminal end, never by a deadline or an abort alone.
    OneHop(OpHandle),
    /// A device deliver entry whose hinted source's route is being set up
    /// (metadata sent, no ack yet): the ack decides one hop or two
    /// ([`TargetRole`]'s `route_waits`); nothing is granted meanwhile.
    Route,
}

#[derive(Debug)]
struct OpEntry {
    key: ScopedKey,
    result: Option<EntryResult>,
    wait: Wait,
    /// Deliver: where to copy once the source is READY.
    destinations: Destinations,
}

#[derive(Debug)]
struct Op {
    kind: OpKind,
    deadline: u64,
    entries: Vec<OpEntry>,
    pending: usize,
    jobs: u32,
    /// Where the operation's framework elements live (one kind per call), so
    /// its copy jobs reach the copier that can touch them.
    memory: RegionMemory,
    /// Leading entries a device deliver's last first-layer scan found
    /// succeeded or with their lead landed (a landing is never undone):
    /// the next scan looks them up no more (`Core::lead_ready`).
    lead_prefix: u32,
}

#[derive(Debug)]
struct Fill {
    record: u32,
    source: FillSource,
    waiters: Vec<(OpHandle, u32)>,
    page: Option<PageInfo>,
}

/// Where a fill's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FillSource {
    /// Key `key` of local copy job `job` (a deposit).
    Copy { job: JobId, key: u32 },
    /// A destination-initiated write from a peer (target operation id).
    Remote { target_op: u64 },
    /// Key `key` of G3 job `job`, reading the G3 residency of the same key
    /// (claimed until the read is terminal).
    G3 { job: JobId, key: u32 },
}

#[derive(Debug, Clone, Copy)]
enum JobKey {
    Fill(u32),
    Deliver {
        record: u32,
        entry: u32,
    },
    /// A spill of DRAM record `record` into the G3 residency of its key.
    Spill {
        record: u32,
    },
    /// Entry `entry` of the job's deliver, read from `key`'s G3 copy
    /// straight into its destination.
    G3Deliver {
        entry: u32,
        key: ScopedKey,
    },
}

#[derive(Debug)]
struct Job {
    op: OpHandle,
    keys: Vec<JobKey>,
    /// A deliver job's first `lead_elements` spans of every key are in
    /// place ([`Core::handle_copy_lead_landed`]).
    lead_landed: bool,
}

impl Job {
    /// A job of `op` over `keys`, its lead not yet landed.
    fn new(op: OpHandle, keys: Vec<JobKey>) -> Self {
        Self {
            op,
            keys,
            lead_landed: false,
        }
    }
}

/// Counters the core keeps.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CoreCounters {
    /// Pages evicted for capacity.
    pub evictions: u64,
    /// Deposit entries the policy dropped.
    pub dropped: u64,
    /// Pages committed READY.
    pub committed: u64,
    /// Bytes copied into the pools.
    pub bytes_deposited: u64,
    /// Bytes copied out of the pools.
    pub bytes_delivered: u64,
    /// Policy calls that panicked or returned garbage.
    pub policy_faults: u64,
}

/// Static configuration of a core.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Per pool: name, block size, blocks.
    pub pools: Vec<(String, u64, u32)>,
    /// Per pool: the address of its first byte.
    pub pool_bases: Vec<u64>,
    /// Budget of one operation, from its start.
    pub operation_timeout_ns: u64,
    /// Percent of a pool's slots below which reclaimable space raises a capacity signal (0: never).
    pub watermark_percent: u8,
    /// The medium KVCR DRAM is published under.
    pub medium: Medium,
    /// The file tier under KVCR DRAM, if any.
    pub g3: Option<G3Config>,
}

/// The sans-I/O runner core.
pub struct Core {
    pools: Vec<PoolState>,
    pool_specs: Vec<(String, u64)>,
    regions: RegionTable,
    index: IndexMap<ScopedKey, IndexEntry>,
    records: Vec<Record>,
    free_records: Vec<u32>,
    /// Slots of records whose layout has more than two spans.
    many_slots: HashMap<u32, Box<[u32]>>,
    /// The fill of each FILLING record.
    filling: HashMap<u32, u32>,
    layouts: Vec<Vec<PoolId>>,
    /// Per layout, each pool it names and how many of its spans are in that
    /// pool: what a record of the layout adds to the pools' evictable
    /// counts (a layer-first page names one pool 128 times).
    layout_pool_counts: Vec<Vec<(PoolId, u32)>>,
    layout_ids: HashMap<Vec<PoolId>, u16>,
    /// The layout `layout_of` found last: a restore's keys share one, and
    /// comparing it beats hashing a 128-pool layout per key.
    last_layout: Option<u16>,
    /// `framework_spans`' buffer for a key's pools, kept between calls.
    pool_scratch: Vec<PoolId>,
    queue_head: u32,
    queue_tail: u32,
    scored: BTreeSet<(u64, u64, u32)>,
    scores: HashMap<u32, u64>,
    policy: SanitizedPolicy,
    ops: HashMap<OpHandle, Op>,
    deadlines: BTreeSet<(u64, OpHandle)>,
    fills: Vec<Option<Fill>>,
    free_fills: Vec<u32>,
    jobs: BTreeMap<JobId, Job>,
    claims: HashMap<ReleaseHandle, u32>,
    namespaces: HashMap<NamespaceId, Namespace>,
    next_op: u64,
    next_claim: u64,
    next_job: u64,
    next_seq: u64,
    operation_timeout_ns: u64,
    medium: Medium,
    actions: VecDeque<Action>,
    events: Vec<InventoryEvent>,
    completed: Vec<OpResult>,
    capacity_signals: Vec<(PoolId, u32)>,
    counters: CoreCounters,
    /// Leading spans of a page that make up its first layer
    /// ([`Core::set_lead_elements`]); 0: none reported.
    lead_elements: u16,
    /// Delivers whose first layer is in place, not yet drained
    /// ([`Core::drain_leads_landed`]).
    leads_landed: Vec<(OpHandle, u32)>,
    peer: Option<peer::PeerState>,
    /// The file tier (G3), when configured.
    g3: Option<G3Tier>,
    /// Operations' keys waiting for DRAM room a spill is making, oldest first.
    capacity_waiters: VecDeque<CapacityWaiter>,
    /// Tokens of READY pages, kept only with G3 (its `Stored` events need them).
    page_info: HashMap<u32, PageInfo>,
    /// Peer writes waiting for their G3-only keys to be filled, by the
    /// preparing operation.
    source_prepares: HashMap<OpHandle, peer::PendingSourceWrite>,
    /// The residency journal's tap, when the runner keeps a journal.
    journal: Option<Box<recovery::JournalTap>>,
    /// Slots a recovery kept out of use (a peer's write may still land).
    recovered_held: Vec<(u16, u32)>,
    /// Recovered records' tokens until their inventory is republished.
    recovered_pages: HashMap<u32, PageInfo>,
    /// Per record, its page digest (taken at deposit, or the source's for
    /// a page restored from a peer and checked on landing).
    digests: Vec<Option<u64>>,
    /// Whether deposits take page digests (on unless a bench compares).
    page_digests: bool,
    /// The keys of a `write_done` whose landed bytes did not match their
    /// digests, while it is handled (see `handle_write_done_checked`).
    landing_mismatch: Option<(OpHandle, Vec<u32>)>,
    /// The operation and write digest of a record whose pages the source
    /// checked in its copy, while it is handled (see
    /// `handle_write_done_checked_in_copy`).
    landing_checked_in_copy: Option<(OpHandle, u64)>,
    /// The operation of a `write_done` whose landed bytes the driver
    /// checked, while it is handled: a one-hop key completes only then.
    landing_checked: Option<OpHandle>,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("resident", &self.index.len())
            .field("ops", &self.ops.len())
            .field("jobs", &self.jobs.len())
            .field("claims", &self.claims.len())
            .finish_non_exhaustive()
    }
}

fn runner_err(reason: RunnerReason) -> Error {
    Error::runner(reason)
}

/// Maps an f64 to a u64 with the same total order (for the score set).
fn ordered_bits(score: f64) -> u64 {
    let bits = score.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    }
}

impl Core {
    /// A core over already-allocated pools (`config.pool_bases[i]` is pool i's
    /// address). Registers one runner-owned region per pool.
    pub fn new(config: &CoreConfig, policy: Box<dyn CachePolicy>) -> Result<Self> {
        let pool_specs: Vec<(String, u64)> = config
            .pools
            .iter()
            .map(|(n, b, _)| (n.clone(), *b))
            .collect();
        let mut regions = RegionTable::default();
        let mut pools = Vec::with_capacity(config.pools.len());
        for (i, ((name, block, blocks), base)) in
            config.pools.iter().zip(&config.pool_bases).enumerate()
        {
            let region = regions.register(
                RegionDesc {
                    label: format!("{KVCR_REGION_PREFIX}{name}"),
                    base: *base,
                    size: *block,
                    stride: 0,
                    count: u64::from(*blocks),
                },
                Owner::Kvcr,
                RegionMemory::Host,
                &pool_specs,
                Some(i),
            )?;
            let watermark =
                (u64::from(*blocks) * u64::from(config.watermark_percent)).div_ceil(100);
            pools.push(PoolState {
                name: name.clone(),
                block_size: *block,
                region,
                total: *blocks,
                free: (0..*blocks).collect(),
                evictable: 0,
                watermark: u32::try_from(watermark).unwrap_or(u32::MAX),
                pressured: false,
            });
        }
        let max_records = config
            .pools
            .iter()
            .map(|(_, _, blocks)| *blocks as usize)
            .sum::<usize>();
        Ok(Self {
            pools,
            pool_specs,
            regions,
            index: IndexMap::with_capacity(max_records),
            // A record holds at least one slot, so the slot count bounds the
            // number of records: size the index and the records for a full
            // pool once, instead of paying doubling slack on every growth.
            records: Vec::with_capacity(max_records),
            free_records: Vec::new(),
            many_slots: HashMap::new(),
            filling: HashMap::new(),
            layouts: Vec::new(),
            layout_pool_counts: Vec::new(),
            layout_ids: HashMap::new(),
            last_layout: None,
            pool_scratch: Vec::new(),
            queue_head: NIL,
            queue_tail: NIL,
            scored: BTreeSet::new(),
            scores: HashMap::new(),
            policy: SanitizedPolicy::new(policy),
            ops: HashMap::new(),
            deadlines: BTreeSet::new(),
            fills: Vec::new(),
            free_fills: Vec::new(),
            jobs: BTreeMap::new(),
            claims: HashMap::new(),
            namespaces: HashMap::new(),
            next_op: 1,
            next_claim: 1,
            next_job: 1,
            next_seq: 0,
            operation_timeout_ns: config.operation_timeout_ns,
            medium: config.medium,
            actions: VecDeque::new(),
            events: Vec::new(),
            completed: Vec::new(),
            capacity_signals: Vec::new(),
            counters: CoreCounters::default(),
            lead_elements: 0,
            leads_landed: Vec::new(),
            peer: None,
            g3: config.g3.map(G3Tier::new),
            capacity_waiters: VecDeque::new(),
            page_info: HashMap::new(),
            source_prepares: HashMap::new(),
            journal: None,
            recovered_held: Vec::new(),
            recovered_pages: HashMap::new(),
            digests: Vec::with_capacity(max_records),
            page_digests: true,
            landing_mismatch: None,
            landing_checked_in_copy: None,
            landing_checked: None,
        })
    }
}

#[cfg(test)]
impl Core {
    /// Whether `slot` of `pool` is on the free list.
    pub fn slot_is_free(&self, pool: PoolId, slot: u32) -> bool {
        self.pools
            .get(pool.0 as usize)
            .is_some_and(|p| p.free.contains(&slot))
    }

    /// Entries of `op` that have no result yet: their position in the op
    /// (and so in its result) and their key. Positions, not keys, tell
    /// apart two entries of one key in one call.
    pub fn pending_entries(&self, op: OpHandle) -> Vec<(usize, ScopedKey)> {
        self.ops
            .get(&op)
            .map(|o| {
                o.entries
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.result.is_none())
                    .map(|(i, e)| (i, e.key))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Drives the lifecycle check with a transition the core never makes.
    pub fn force_transition_for_test(&mut self, key: &ScopedKey) {
        if let Some(entry) = self.index.get(key).copied() {
            let state = entry.state;
            self.transition(entry.record, state, "test");
        }
    }
}

#[cold]
#[allow(clippy::panic)]
fn lifecycle_violation(
    key: ScopedKey,
    from: Residency,
    to: Residency,
    site: &str,
    claims: u32,
) -> ! {
    // Test and debug builds only: an illegal transition is a bug in the core,
    // and continuing would hide it.
    panic!(
        "illegal residency transition for {key:?}: {from:?} -> {to:?} at {site} ({claims} claims)"
    )
}

/// Records the memory kind of one more span (or entry) of a call, refusing a
/// call that mixes host and device memory: one copier runs each job.
fn same_memory(seen: &mut Option<RegionMemory>, next: RegionMemory) -> Result<()> {
    match *seen {
        Some(kind) if kind != next => Err(runner_err(RunnerReason::MixedMemory)),
        _ => {
            *seen = Some(next);
            Ok(())
        }
    }
}
