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

use crate::policy::{
    BlockMeta, CachePolicy, EvictionDecision, EvictionOrder, IngestDecision, SanitizedPolicy,
};
use crate::region::{RegionDesc, RegionMemory, RegionTable};
use crate::types::{
    CopySpan, PoolRange,    DeliverEntry, DepositEntry, EntryResult, FailReason, OpResult, PageInfo, PoolId, PoolStats,
    QueryStatus, ReleaseHandle,
};
use kvcr_contracts::endpoint::ControlEndpoint;
use crate::error::{Error, Result, RunnerReason};
use kvcr_contracts::hint::RequestId;
use kvcr_contracts::key::{BlockKey, Namespace, NamespaceId, ScopedKey};
use kvcr_contracts::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_contracts::tier::{InventoryEvent, InventoryScope, Medium, Owner};

mod peer;

pub use peer::{PeerConfig, PutSpan};
pub use peer::{PeerCounters, PeerNotice};

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
    Deposit { no_evict: bool },
    Fetch,
    Deliver,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    None,
    /// Waiting as a waiter of a shared fill.
    Fill(u32),
    /// Waiting for its own deliver copy (key index inside the job).
    Copy(JobId, u32),
}

#[derive(Debug)]
struct OpEntry {
    key: ScopedKey,
    result: Option<EntryResult>,
    wait: Wait,
    /// Deliver: where to copy once the source is READY.
    destinations: Vec<CopySpan>,
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
}

#[derive(Debug, Clone, Copy)]
enum JobKey {
    Fill(u32),
    Deliver { record: u32, entry: u32 },
}

#[derive(Debug)]
struct Job {
    op: OpHandle,
    keys: Vec<JobKey>,
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
    layout_ids: HashMap<Vec<PoolId>, u16>,
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
    peer: Option<peer::PeerState>,
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
            layout_ids: HashMap::new(),
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
            peer: None,
        })
    }

    // ------------------------------------------------------------ registration

    /// Registers a host region of framework memory (validated; overlaps refused).
    pub fn register_region(&mut self, desc: RegionDesc) -> Result<RegionId> {
        self.register_region_in(desc, RegionMemory::Host)
    }

    /// Registers a region in the given memory (host or device).
    pub fn register_region_in(
        &mut self,
        desc: RegionDesc,
        memory: RegionMemory,
    ) -> Result<RegionId> {
        self.regions
            .register(desc, Owner::Framework, memory, &self.pool_specs, None)
    }

    /// Every runner pool's memory, in pool order.
    pub fn pool_ranges(&self) -> Vec<PoolRange> {
        self.pools
            .iter()
            .filter_map(|p| self.regions.get(p.region).ok())
            .map(|r| PoolRange {
                base: r.desc.base,
                len: r.desc.size.saturating_mul(r.desc.count),
            })
            .collect()
    }

    /// The id of a registered region.
    pub fn region_by_label(&self, label: &str) -> Option<RegionId> {
        self.regions.by_label(label)
    }

    /// Registers a namespace and returns its id (idempotent).
    pub fn register_namespace(&mut self, namespace: Namespace) -> NamespaceId {
        let id = namespace.id();
        self.namespaces.insert(id, namespace);
        id
    }

    /// The id of the pool of that name.
    pub fn pool_id(&self, name: &str) -> Option<PoolId> {
        self.pools
            .iter()
            .position(|p| p.name == name)
            .and_then(|i| u16::try_from(i).ok())
            .map(PoolId)
    }

    // ------------------------------------------------------------ queries

    /// Residency of one key. No allocation, no I/O.
    pub fn query(&self, key: &ScopedKey) -> QueryStatus {
        match self.index.get(key).map(|e| e.state) {
            Some(Residency::Ready) => QueryStatus::Hit,
            Some(Residency::Filling) => QueryStatus::Fetching,
            _ => QueryStatus::Miss,
        }
    }

    /// Keys in the index, whatever their residency.
    pub fn resident_blocks(&self) -> usize {
        self.index.len()
    }

    // ------------------------------------------------------------ operations

    fn new_op(
        &mut self,
        now: u64,
        kind: OpKind,
        entries: Vec<OpEntry>,
        memory: RegionMemory,
    ) -> OpHandle {
        let handle = OpHandle(self.next_op);
        self.next_op += 1;
        let deadline = now.saturating_add(self.operation_timeout_ns);
        let pending = entries.iter().filter(|e| e.result.is_none()).count();
        self.ops.insert(
            handle,
            Op {
                kind,
                deadline,
                entries,
                pending,
                jobs: 0,
                memory,
            },
        );
        self.deadlines.insert((deadline, handle));
        handle
    }

    fn layout_of(&mut self, pools: Vec<PoolId>) -> Result<u16> {
        if let Some(id) = self.layout_ids.get(&pools) {
            return Ok(*id);
        }
        let id = u16::try_from(self.layouts.len()).map_err(|_| {
            runner_err(RunnerReason::Config {
                field: "layouts",
                why: "more than 65535 distinct span layouts",
            })
        })?;
        self.layouts.push(pools.clone());
        self.layout_ids.insert(pools, id);
        Ok(id)
    }

    /// Validates a key's framework spans: resolves every element and returns
    /// the layout (pools in span order) and the spans.
    fn framework_spans(
        &mut self,
        spans: &[ElementRef],
    ) -> Result<(u16, Vec<CopySpan>, RegionMemory)> {
        if spans.is_empty() || spans.len() > MAX_SPANS_PER_KEY {
            return Err(runner_err(RunnerReason::LayoutLength {
                got: spans.len(),
                max: MAX_SPANS_PER_KEY,
            }));
        }
        let mut pools = Vec::with_capacity(spans.len());
        let mut copies = Vec::with_capacity(spans.len());
        let mut memory = None;
        for element in spans {
            let span = self.regions.resolve_framework(*element)?;
            same_memory(&mut memory, span.memory)?;
            pools.push(span.pool);
            copies.push(CopySpan {
                src: span.addr,
                dst: 0,
                len: span.len,
            });
        }
        let layout = self.layout_of(pools)?;
        Ok((layout, copies, memory.unwrap_or(RegionMemory::Host)))
    }

    fn check_namespace(&self, key: &ScopedKey) -> Result<()> {
        if self.namespaces.contains_key(&key.namespace) {
            Ok(())
        } else {
            Err(runner_err(RunnerReason::UnknownNamespace(key.namespace.0)))
        }
    }

    /// Copies framework memory into KVCR DRAM. Validation errors refuse the
    /// whole call before anything changes.
    pub fn deposit(
        &mut self,
        now: u64,
        entries: Vec<DepositEntry>,
        no_evict: bool,
    ) -> Result<OpHandle> {
        // Validate everything first: a bad entry refuses the call unchanged.
        let mut validated = Vec::with_capacity(entries.len());
        let mut memory = None;
        for entry in entries {
            self.check_namespace(&entry.key)?;
            let (layout, spans, entry_memory) = self.framework_spans(&entry.spans)?;
            same_memory(&mut memory, entry_memory)?;
            validated.push((entry.key, layout, spans, entry.page));
        }
        let op_entries = validated
            .iter()
            .map(|(key, ..)| OpEntry {
                key: *key,
                result: None,
                wait: Wait::None,
                destinations: Vec::new(),
            })
            .collect();
        let handle = self.new_op(
            now,
            OpKind::Deposit { no_evict },
            op_entries,
            memory.unwrap_or(RegionMemory::Host),
        );
        let job = JobId(self.next_job);
        let mut job_keys = Vec::new();
        let mut job_spans = Vec::new();
        let protected: Vec<ScopedKey> = validated.iter().map(|v| v.0).collect();
        for (i, (key, layout, mut spans, page)) in validated.into_iter().enumerate() {
            let entry = i as u32;
            match self.index.get(&key).copied() {
                Some(IndexEntry { record, state }) => {
                    let same_layout = self.record(record).is_some_and(|r| r.layout == layout);
                    match state {
                        _ if !same_layout => self.set_result(
                            handle,
                            entry,
                            EntryResult::failed(FailReason::LayoutMismatch),
                        ),
                        Residency::Ready => {
                            let release = no_evict.then(|| self.claim_public(record));
                            self.set_result(
                                handle,
                                entry,
                                EntryResult::success(release, Vec::new()),
                            );
                        }
                        Residency::Filling => {
                            let fill = self.filling.get(&record).copied().unwrap_or(NIL);
                            self.wait_on_fill(handle, entry, fill);
                        }
                        Residency::Discarding | Residency::Vacant => {
                            self.set_result(
                                handle,
                                entry,
                                EntryResult::failed(FailReason::Discarding),
                            );
                        }
                    }
                }
                None => {
                    let size: u64 = spans.iter().map(|s| s.len).sum();
                    let meta = BlockMeta {
                        key,
                        size_bytes: size,
                        access_count: 0,
                        last_access_ns: now,
                        inserted_seq: self.next_seq,
                    };
                    if self.policy.decide_ingest(&meta, no_evict) == IngestDecision::Drop {
                        self.counters.dropped += 1;
                        self.set_result(handle, entry, EntryResult::dropped());
                        continue;
                    }
                    let Some(slots) = self.allocate(now, layout, &protected) else {
                        self.set_result(
                            handle,
                            entry,
                            EntryResult::failed(FailReason::CapacityExhausted),
                        );
                        continue;
                    };
                    let record = self.insert_record(now, key, layout, slots);
                    for (span, slot) in spans.iter_mut().zip(self.slot_spans(record)) {
                        span.dst = slot.src;
                    }
                    let fill = self.new_fill(Fill {
                        record,
                        source: FillSource::Copy {
                            job,
                            key: job_keys.len() as u32,
                        },
                        waiters: Vec::new(),
                        page,
                    });
                    self.filling.insert(record, fill);
                    job_keys.push(JobKey::Fill(fill));
                    job_spans.push(spans);
                    self.wait_on_fill(handle, entry, fill);
                }
            }
        }
        if !job_keys.is_empty() {
            self.submit_job(handle, job, job_keys, job_spans);
        }
        self.finish_if_done(handle);
        self.check_pressure();
        Ok(handle)
    }

    /// Makes keys resident and claims them. Without a peer source (the peer
    /// slice adds one), a key that is not resident fails with `NoSource`.
    pub fn fetch(
        &mut self,
        now: u64,
        keys: &[ScopedKey],
        layout: &[PoolId],
        request: Option<&RequestId>,
    ) -> Result<OpHandle> {
        if layout.is_empty() || layout.len() > MAX_SPANS_PER_KEY {
            return Err(runner_err(RunnerReason::LayoutLength {
                got: layout.len(),
                max: MAX_SPANS_PER_KEY,
            }));
        }
        if layout.iter().any(|p| p.0 as usize >= self.pools.len()) {
            return Err(runner_err(RunnerReason::LayoutMismatch));
        }
        for key in keys {
            self.check_namespace(key)?;
        }
        let layout = self.layout_of(layout.to_vec())?;
        // Keys are deduplicated in order.
        let mut seen = hashbrown::HashSet::with_capacity(keys.len());
        let unique: Vec<ScopedKey> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
        let entries = unique
            .iter()
            .map(|key| OpEntry {
                key: *key,
                result: None,
                wait: Wait::None,
                destinations: Vec::new(),
            })
            .collect();
        let handle = self.new_op(now, OpKind::Fetch, entries, RegionMemory::Host);
        let mut remote = Vec::new();
        for (i, key) in unique.iter().enumerate() {
            let entry = i as u32;
            match self.index.get(key).copied() {
                Some(IndexEntry { record, state }) => {
                    let same_layout = self.record(record).is_some_and(|r| r.layout == layout);
                    match state {
                        _ if !same_layout => self.set_result(
                            handle,
                            entry,
                            EntryResult::failed(FailReason::LayoutMismatch),
                        ),
                        Residency::Ready => {
                            let release = self.claim_public(record);
                            self.touch(now, record);
                            let slots = self.slot_refs(record);
                            self.set_result(
                                handle,
                                entry,
                                EntryResult::success(Some(release), slots),
                            );
                        }
                        Residency::Filling => {
                            let fill = self.filling.get(&record).copied().unwrap_or(NIL);
                            self.wait_on_fill(handle, entry, fill);
                        }
                        Residency::Discarding | Residency::Vacant => {
                            self.set_result(
                                handle,
                                entry,
                                EntryResult::failed(FailReason::NoSource),
                            );
                        }
                    }
                }
                None => remote.push((entry, *key)),
            }
        }
        self.start_remote(now, handle, request, layout, remote, &unique);
        self.finish_if_done(handle);
        self.check_pressure();
        Ok(handle)
    }

    /// Sends the keys of `op` that are not resident to the request's hinted
    /// source (when the hint covers them); the rest fail with `NoSource`.
    fn start_remote(
        &mut self,
        now: u64,
        op: OpHandle,
        request: Option<&RequestId>,
        layout: u16,
        missing: Vec<(u32, ScopedKey)>,
        protected: &[ScopedKey],
    ) {
        // One start_write per (source, namespace): the message carries one
        // namespace for all its keys.
        let mut by_source: BTreeMap<(ControlEndpoint, NamespaceId), Vec<(u32, ScopedKey)>> =
            BTreeMap::new();
        for (entry, key) in missing {
            match self
                .peer
                .as_ref()
                .and_then(|p| p.hinted_source(request, &key))
            {
                Some(source) => by_source
                    .entry((source.clone(), key.namespace))
                    .or_default()
                    .push((entry, key)),
                None => self.set_result(op, entry, EntryResult::failed(FailReason::NoSource)),
            }
        }
        for ((source, _), entries) in by_source {
            let keys: Vec<ScopedKey> = entries.iter().map(|(_, k)| *k).collect();
            let fills = self.start_remote_fills(now, request, source, &keys, layout, protected);
            for ((entry, _), fill) in entries.into_iter().zip(fills) {
                match fill {
                    Ok(fill) => self.wait_on_fill(op, entry, fill),
                    Err(reason) => self.set_result(op, entry, EntryResult::failed(reason)),
                }
            }
        }
    }

    /// Copies resident pages into framework destinations.
    pub fn deliver(
        &mut self,
        now: u64,
        entries: Vec<DeliverEntry>,
        request: Option<&RequestId>,
    ) -> Result<OpHandle> {
        let mut validated = Vec::with_capacity(entries.len());
        let mut memory = None;
        for entry in entries {
            self.check_namespace(&entry.key)?;
            let (layout, spans, entry_memory) = self.framework_spans(&entry.destinations)?;
            same_memory(&mut memory, entry_memory)?;
            // Destinations: the resolved framework spans are the copy targets.
            let destinations: Vec<CopySpan> = spans
                .into_iter()
                .map(|s| CopySpan {
                    src: 0,
                    dst: s.src,
                    len: s.len,
                })
                .collect();
            validated.push((entry.key, layout, destinations));
        }
        let op_entries = validated
            .iter()
            .map(|(key, _, destinations)| OpEntry {
                key: *key,
                result: None,
                wait: Wait::None,
                destinations: destinations.clone(),
            })
            .collect();
        let handle = self.new_op(
            now,
            OpKind::Deliver,
            op_entries,
            memory.unwrap_or(RegionMemory::Host),
        );
        let mut ready = Vec::new();
        let mut remote: BTreeMap<u16, Vec<(u32, ScopedKey)>> = BTreeMap::new();
        for (i, (key, layout, _)) in validated.iter().enumerate() {
            let entry = i as u32;
            match self.index.get(key).copied() {
                Some(IndexEntry { record, state }) => {
                    let same_layout = self.record(record).is_some_and(|r| r.layout == *layout);
                    match state {
                        _ if !same_layout => self.set_result(
                            handle,
                            entry,
                            EntryResult::failed(FailReason::LayoutMismatch),
                        ),
                        Residency::Ready => ready.push((entry, record)),
                        Residency::Filling => {
                            let fill = self.filling.get(&record).copied().unwrap_or(NIL);
                            self.wait_on_fill(handle, entry, fill);
                        }
                        Residency::Discarding | Residency::Vacant => {
                            self.set_result(
                                handle,
                                entry,
                                EntryResult::failed(FailReason::NoSource),
                            );
                        }
                    }
                }
                None => remote.entry(*layout).or_default().push((entry, *key)),
            }
        }
        let protected: Vec<ScopedKey> = validated.iter().map(|v| v.0).collect();
        for (layout, missing) in remote {
            self.start_remote(now, handle, request, layout, missing, &protected);
        }
        self.start_delivers(now, handle, ready);
        self.finish_if_done(handle);
        self.check_pressure();
        Ok(handle)
    }

    /// Starts one deliver copy job for `entries` of `handle`, each reading a
    /// READY record under an internal claim.
    fn start_delivers(&mut self, now: u64, handle: OpHandle, entries: Vec<(u32, u32)>) {
        if entries.is_empty() {
            return;
        }
        let job = JobId(self.next_job);
        let mut keys = Vec::with_capacity(entries.len());
        let mut spans = Vec::with_capacity(entries.len());
        for (entry, record) in entries {
            self.claim_internal(record);
            self.touch(now, record);
            let sources = self.slot_spans(record);
            let Some(op) = self.ops.get_mut(&handle) else {
                continue;
            };
            let Some(e) = op.entries.get_mut(entry as usize) else {
                continue;
            };
            let copies: Vec<CopySpan> = e
                .destinations
                .iter()
                .zip(&sources)
                .map(|(d, s)| CopySpan {
                    src: s.src,
                    dst: d.dst,
                    len: d.len,
                })
                .collect();
            e.wait = Wait::Copy(job, keys.len() as u32);
            keys.push(JobKey::Deliver { record, entry });
            spans.push(copies);
        }
        self.submit_job(handle, job, keys, spans);
    }

    fn submit_job(
        &mut self,
        op: OpHandle,
        job: JobId,
        keys: Vec<JobKey>,
        spans: Vec<Vec<CopySpan>>,
    ) {
        debug_assert_eq!(job.0, self.next_job);
        self.next_job += 1;
        let deadline_ns = self.ops.get(&op).map_or(0, |o| o.deadline);
        let memory = self.ops.get(&op).map_or(RegionMemory::Host, |o| o.memory);
        if let Some(o) = self.ops.get_mut(&op) {
            o.jobs += 1;
        }
        self.jobs.insert(job, Job { op, keys });
        self.actions.push_back(Action::Copy {
            job,
            deadline_ns,
            memory,
            keys: spans,
        });
    }

    /// Releases public claims. `true` for a live handle; unknown or already
    /// released handles give `false` and change nothing.
    pub fn release(&mut self, handles: &[ReleaseHandle]) -> Vec<bool> {
        let out = handles
            .iter()
            .map(|h| match self.claims.remove(h) {
                Some(record) => {
                    self.unclaim(record);
                    true
                }
                None => false,
            })
            .collect();
        self.check_pressure();
        out
    }

    /// Best-effort abort of `keys` of `op` (all keys when `None`). Keys waiting
    /// on shared work detach (the work continues for other waiters); a copy that
    /// has not started is cancelled; one in flight finishes, and the operation
    /// completes only after it, reporting `Aborted` for those keys.
    pub fn abort(&mut self, op: OpHandle, keys: Option<&[ScopedKey]>) -> bool {
        let Some(o) = self.ops.get(&op) else {
            return false;
        };
        let targets: Vec<u32> = o
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.result.is_none() && keys.is_none_or(|ks| ks.contains(&e.key)))
            .map(|(i, _)| i as u32)
            .collect();
        if targets.is_empty() {
            return false;
        }
        for entry in targets {
            self.fail_waiting_entry(op, entry, FailReason::Aborted);
        }
        self.finish_if_done(op);
        true
    }

    /// Fails one pending entry now (abort or deadline): detaches it from a
    /// shared fill (cancelling the fill's copy if nobody else waits), or
    /// cancels its own deliver copy.
    fn fail_waiting_entry(&mut self, op: OpHandle, entry: u32, reason: FailReason) {
        let wait = self
            .ops
            .get(&op)
            .and_then(|o| o.entries.get(entry as usize))
            .map_or(Wait::None, |e| e.wait);
        match wait {
            Wait::Fill(fill) => {
                let mut cancel = None;
                if let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::as_mut) {
                    f.waiters.retain(|w| *w != (op, entry));
                    // A local copy nobody waits for is cancelled; a remote
                    // write cannot be, and its target operation still owns it.
                    if let (true, FillSource::Copy { job, key }) = (f.waiters.is_empty(), f.source)
                    {
                        cancel = Some((job, key));
                    }
                }
                if let Some((job, key)) = cancel {
                    self.actions.push_back(Action::Cancel { job, key });
                }
            }
            Wait::Copy(job, key) => self.actions.push_back(Action::Cancel { job, key }),
            Wait::None => {}
        }
        self.set_result(op, entry, EntryResult::failed(reason));
    }

    /// Expires deadlines: keys still waiting on shared work fail with
    /// `Timeout`. Keys whose own copy is in flight wait for it (the copy engine
    /// skips it if it has not started by the deadline).
    pub fn handle_timeout(&mut self, now: u64) {
        self.handle_peer_timeout(now);
        while let Some(&(deadline, op)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            let Some(o) = self.ops.get(&op) else { continue };
            let waiting: Vec<u32> = o
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.result.is_none() && matches!(e.wait, Wait::Fill(_)))
                .map(|(i, _)| i as u32)
                .collect();
            for entry in waiting {
                let own_fill = self.entry_owns_fill(op, entry);
                if !own_fill {
                    self.fail_waiting_entry(op, entry, FailReason::Timeout);
                }
            }
            self.finish_if_done(op);
        }
        self.check_pressure();
    }

    /// Whether entry `entry` of `op` waits on a fill whose copy `op` itself runs.
    fn entry_owns_fill(&self, op: OpHandle, entry: u32) -> bool {
        let Some(Wait::Fill(fill)) = self
            .ops
            .get(&op)
            .and_then(|o| o.entries.get(entry as usize))
            .map(|e| e.wait)
        else {
            return false;
        };
        match self
            .fills
            .get(fill as usize)
            .and_then(Option::as_ref)
            .map(|f| f.source)
        {
            Some(FillSource::Copy { job, .. }) => self.jobs.get(&job).is_some_and(|j| j.op == op),
            _ => false,
        }
    }

    /// The earliest pending deadline.
    pub fn next_deadline(&self) -> Option<u64> {
        let ops = self.deadlines.first().map(|(d, _)| *d);
        match (ops, self.next_peer_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Feeds back a finished copy job.
    pub fn handle_copy_done(&mut self, now: u64, job: JobId, outcomes: &[CopyOutcome]) {
        let Some(Job { op, keys }) = self.jobs.remove(&job) else {
            return;
        };
        let mut stored: Vec<(u32, Option<PageInfo>)> = Vec::new();
        let mut deliver_next: BTreeMap<OpHandle, Vec<(u32, u32)>> = BTreeMap::new();
        for (i, key) in keys.iter().enumerate() {
            let outcome = outcomes.get(i).copied().unwrap_or(CopyOutcome::Cancelled);
            match *key {
                JobKey::Fill(fill) => {
                    let result = match outcome {
                        CopyOutcome::Copied => Ok(()),
                        CopyOutcome::DeadlinePassed => Err(FailReason::Timeout),
                        CopyOutcome::Cancelled => Err(FailReason::Aborted),
                        CopyOutcome::Failed => Err(FailReason::CopyFailed),
                    };
                    self.finish_fill(now, fill, result, &mut stored, &mut deliver_next);
                }
                JobKey::Deliver { record, entry } => {
                    if outcome == CopyOutcome::Copied {
                        self.counters.bytes_delivered += self.record_bytes(record);
                    }
                    self.unclaim(record);
                    let result = match outcome {
                        CopyOutcome::Copied => EntryResult::success(None, Vec::new()),
                        CopyOutcome::DeadlinePassed => EntryResult::failed(FailReason::Timeout),
                        CopyOutcome::Cancelled => EntryResult::failed(FailReason::Aborted),
                        CopyOutcome::Failed => EntryResult::failed(FailReason::CopyFailed),
                    };
                    // A result set earlier (abort) stands: set_result keeps the first.
                    self.set_result(op, entry, result);
                }
            }
        }
        self.publish_stored(&stored);
        if let Some(o) = self.ops.get_mut(&op) {
            o.jobs = o.jobs.saturating_sub(1);
        }
        for (waiter_op, entries) in deliver_next {
            self.start_delivers(now, waiter_op, entries);
        }
        self.finish_if_done(op);
        let waiting_ops: Vec<OpHandle> = self.ops.keys().copied().collect();
        for o in waiting_ops {
            self.finish_if_done(o);
        }
        self.check_pressure();
    }

    /// Ends a fill: commits its record READY (and serves its waiters) when
    /// the bytes landed, else frees it and fails its waiters with `reason`.
    fn finish_fill(
        &mut self,
        now: u64,
        fill: u32,
        result: std::result::Result<(), FailReason>,
        stored: &mut Vec<(u32, Option<PageInfo>)>,
        deliver_next: &mut BTreeMap<OpHandle, Vec<(u32, u32)>>,
    ) {
        let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::take) else {
            return;
        };
        self.free_fills.push(fill);
        self.filling.remove(&f.record);
        let filling = self
            .record(f.record)
            .is_some_and(|r| r.state == Residency::Filling);
        if result.is_ok() && filling {
            self.counters.bytes_deposited += self.record_bytes(f.record);
            self.counters.committed += 1;
            self.transition(f.record, Residency::Ready, "fill commit");
            if let Some(r) = self.record_mut(f.record) {
                r.last_access = now;
            }
            stored.push((f.record, f.page));
            for (waiter_op, entry) in f.waiters {
                self.fill_committed_for(now, waiter_op, entry, f.record, deliver_next);
            }
            if self.record(f.record).is_some_and(|r| r.claims == 0) {
                self.make_evictable(f.record);
            }
        } else {
            let reason = result.err().unwrap_or(FailReason::Aborted);
            for (waiter_op, entry) in f.waiters {
                self.set_result(waiter_op, entry, EntryResult::failed(reason));
                self.finish_if_done(waiter_op);
            }
            self.remove_record(f.record, "fill failed");
        }
    }

    fn fill_committed_for(
        &mut self,
        now: u64,
        op: OpHandle,
        entry: u32,
        record: u32,
        deliver_next: &mut BTreeMap<OpHandle, Vec<(u32, u32)>>,
    ) {
        let Some(kind) = self.ops.get(&op).map(|o| o.kind) else {
            return;
        };
        match kind {
            OpKind::Deposit { no_evict } => {
                let release = no_evict.then(|| self.claim_public(record));
                self.set_result(op, entry, EntryResult::success(release, Vec::new()));
            }
            OpKind::Fetch => {
                let release = self.claim_public(record);
                self.touch(now, record);
                let slots = self.slot_refs(record);
                self.set_result(op, entry, EntryResult::success(Some(release), slots));
            }
            OpKind::Deliver => deliver_next.entry(op).or_default().push((entry, record)),
        }
    }

    fn wait_on_fill(&mut self, op: OpHandle, entry: u32, fill: u32) {
        let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::as_mut) else {
            self.set_result(op, entry, EntryResult::failed(FailReason::NoSource));
            return;
        };
        f.waiters.push((op, entry));
        if let Some(e) = self
            .ops
            .get_mut(&op)
            .and_then(|o| o.entries.get_mut(entry as usize))
        {
            e.wait = Wait::Fill(fill);
        }
    }

    fn new_fill(&mut self, fill: Fill) -> u32 {
        if let Some(i) = self.free_fills.pop()
            && let Some(slot) = self.fills.get_mut(i as usize)
        {
            *slot = Some(fill);
            return i;
        }
        self.fills.push(Some(fill));
        (self.fills.len() - 1) as u32
    }

    /// Sets an entry's result if it has none (the first result stands).
    fn set_result(&mut self, op: OpHandle, entry: u32, result: EntryResult) {
        let Some(o) = self.ops.get_mut(&op) else {
            return;
        };
        let Some(e) = o.entries.get_mut(entry as usize) else {
            return;
        };
        if e.result.is_none() {
            e.result = Some(result);
            o.pending = o.pending.saturating_sub(1);
        } else if let Some(release) = result.release {
            // The entry already failed (abort, deadline): a claim taken for it
            // must not leak.
            if let Some(record) = self.claims.remove(&release) {
                self.unclaim(record);
            }
        }
    }

    /// Completes an operation once every key has a result and every copy it
    /// started is terminal.
    fn finish_if_done(&mut self, op: OpHandle) {
        let done = self
            .ops
            .get(&op)
            .is_some_and(|o| o.pending == 0 && o.jobs == 0);
        if !done {
            return;
        }
        if let Some(o) = self.ops.remove(&op) {
            self.deadlines.remove(&(o.deadline, op));
            let entries = o
                .entries
                .into_iter()
                .map(|e| {
                    (
                        e.key,
                        e.result
                            .unwrap_or_else(|| EntryResult::failed(FailReason::Aborted)),
                    )
                })
                .collect();
            self.completed.push(OpResult { op, entries });
        }
    }

    // ------------------------------------------------------------ records

    fn record(&self, idx: u32) -> Option<&Record> {
        self.records
            .get(idx as usize)
            .filter(|r| r.state != Residency::Vacant)
    }

    fn record_mut(&mut self, idx: u32) -> Option<&mut Record> {
        self.records
            .get_mut(idx as usize)
            .filter(|r| r.state != Residency::Vacant)
    }

    fn insert_record(&mut self, now: u64, key: ScopedKey, layout: u16, slot_vec: Vec<u32>) -> u32 {
        let slots = match slot_vec.as_slice() {
            [a] => SlotList::One(*a),
            [a, b] => SlotList::Two(*a, *b),
            _ => SlotList::Many,
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let record = Record {
            key,
            slots,
            last_access: now,
            seq,
            prev: NIL,
            next: NIL,
            claims: 0,
            access_count: 0,
            layout,
            state: Residency::Vacant,
            flags: 0,
        };
        let idx = match self.free_records.pop() {
            Some(i) => {
                if let Some(r) = self.records.get_mut(i as usize) {
                    *r = record;
                }
                i
            }
            None => {
                self.records.push(record);
                (self.records.len() - 1) as u32
            }
        };
        if slots == SlotList::Many {
            self.many_slots.insert(idx, slot_vec.into_boxed_slice());
        }
        self.index.insert(
            key,
            IndexEntry {
                record: idx,
                state: Residency::Vacant,
            },
        );
        self.transition(idx, Residency::Filling, "insert");
        idx
    }

    /// Slot `i` of a record.
    fn slot(&self, idx: u32, i: usize) -> Option<u32> {
        match (self.record(idx)?.slots, i) {
            (SlotList::One(a), 0) | (SlotList::Two(a, _), 0) => Some(a),
            (SlotList::Two(_, b), 1) => Some(b),
            (SlotList::Many, i) => self.many_slots.get(&idx)?.get(i).copied(),
            _ => None,
        }
    }

    /// All slots of a record, in layout order.
    fn slot_vec(&self, idx: u32) -> Vec<u32> {
        match self.record(idx).map(|r| r.slots) {
            Some(SlotList::One(a)) => vec![a],
            Some(SlotList::Two(a, b)) => vec![a, b],
            Some(SlotList::Many) => self
                .many_slots
                .get(&idx)
                .map(|s| s.to_vec())
                .unwrap_or_default(),
            None => Vec::new(),
        }
    }

    /// Adds `delta` to the evictable count of every pool in a record's layout.
    fn adjust_evictable(&mut self, idx: u32, add: bool) {
        let Some(layout) = self.record(idx).map(|r| r.layout as usize) else {
            return;
        };
        let spans = self.layouts.get(layout).map_or(0, Vec::len);
        for i in 0..spans {
            let Some(pool) = self.layouts.get(layout).and_then(|l| l.get(i)).copied() else {
                continue;
            };
            if let Some(p) = self.pools.get_mut(pool.0 as usize) {
                p.evictable = if add {
                    p.evictable + 1
                } else {
                    p.evictable.saturating_sub(1)
                };
            }
        }
    }

    /// Moves a record to a new state, keeping the index in step. In debug
    /// builds an illegal transition aborts with the key and the call site.
    fn transition(&mut self, idx: u32, to: Residency, site: &'static str) {
        let Some(r) = self.records.get_mut(idx as usize) else {
            return;
        };
        let from = r.state;
        let legal = matches!(
            (from, to),
            (Residency::Vacant, Residency::Filling)
                | (Residency::Filling, Residency::Ready)
                | (Residency::Filling, Residency::Discarding)
                | (Residency::Filling, Residency::Vacant)
                | (Residency::Discarding, Residency::Vacant)
                | (Residency::Ready, Residency::Vacant)
        );
        if cfg!(debug_assertions) && !legal {
            lifecycle_violation(r.key, from, to, site, r.claims);
        }
        if to == Residency::Vacant && r.claims != 0 && cfg!(debug_assertions) {
            lifecycle_violation(r.key, from, to, site, r.claims);
        }
        r.state = to;
        let key = r.key;
        if to == Residency::Vacant {
            self.index.remove(&key);
        } else if let Some(e) = self.index.get_mut(&key) {
            e.state = to;
        }
    }

    /// Frees a record's slots and the record itself; publishes `Removed` if it
    /// was READY (so exactly once per stored residency).
    fn remove_record(&mut self, idx: u32, site: &'static str) {
        if let Some(stored) = self.free_record(idx, site) {
            self.publish_removed(&[stored]);
        }
    }

    /// Returns a record's slots to their pools and frees the record. Returns
    /// its key if it was READY (stored), so the caller publishes `Removed`
    /// exactly once (alone, or batched with other victims).
    fn free_record(&mut self, idx: u32, site: &'static str) -> Option<ScopedKey> {
        let r = self.record(idx)?;
        let stored = (r.state == Residency::Ready).then_some(r.key);
        let layout = r.layout as usize;
        let slots = self.slot_vec(idx);
        self.many_slots.remove(&idx);
        self.filling.remove(&idx);
        self.dequeue(idx);
        self.transition(idx, Residency::Vacant, site);
        for (i, slot) in slots.into_iter().enumerate() {
            let pool = self
                .layouts
                .get(layout)
                .and_then(|l| l.get(i))
                .map(|p| p.0 as usize);
            if let Some(p) = pool.and_then(|p| self.pools.get_mut(p)) {
                p.free.push_back(slot);
            }
        }
        self.free_records.push(idx);
        stored
    }

    fn record_bytes(&self, idx: u32) -> u64 {
        let Some(r) = self.record(idx) else { return 0 };
        self.layouts.get(r.layout as usize).map_or(0, |l| {
            l.iter()
                .filter_map(|p| self.pools.get(p.0 as usize))
                .map(|p| p.block_size)
                .sum()
        })
    }

    /// The record's slots as copy sources (`src`, `len`): its element
    /// references resolved through the (bounds-checked) region table.
    fn slot_spans(&self, idx: u32) -> Vec<CopySpan> {
        self.slot_refs(idx)
            .into_iter()
            .filter_map(|element| self.regions.resolve(element).ok())
            .map(|span| CopySpan {
                src: span.addr,
                dst: 0,
                len: span.len,
            })
            .collect()
    }

    /// The record's slots as references into the runner-owned pool regions.
    fn slot_refs(&self, idx: u32) -> Vec<ElementRef> {
        let Some(r) = self.record(idx) else {
            return Vec::new();
        };
        let Some(pools) = self.layouts.get(r.layout as usize) else {
            return Vec::new();
        };
        pools
            .iter()
            .enumerate()
            .filter_map(|(i, pool)| {
                Some(ElementRef {
                    region: self.pools.get(pool.0 as usize)?.region,
                    index: u64::from(self.slot(idx, i)?),
                })
            })
            .collect()
    }

    /// Address and length of a runner-owned element, bounds-checked.
    pub fn resolve(&self, element: ElementRef) -> Result<(u64, u64)> {
        let span = self.regions.resolve(element)?;
        Ok((span.addr, span.len))
    }

    /// The index record a live public claim holds.
    pub fn claim_record(&self, handle: ReleaseHandle) -> Option<u32> {
        self.claims.get(&handle).copied()
    }

    /// The KVCR DRAM elements a live public claim holds (for reading its bytes).
    pub fn claimed_slot_refs(&self, handle: ReleaseHandle) -> Option<Vec<ElementRef>> {
        self.claim_record(handle).map(|r| self.slot_refs(r))
    }

    fn touch(&mut self, now: u64, idx: u32) {
        if let Some(r) = self.record_mut(idx) {
            r.access_count = r.access_count.saturating_add(1);
            r.last_access = now;
        }
    }

    // ------------------------------------------------------------ claims

    fn claim_public(&mut self, idx: u32) -> ReleaseHandle {
        self.claim_internal(idx);
        let handle = ReleaseHandle(self.next_claim);
        self.next_claim += 1;
        self.claims.insert(handle, idx);
        handle
    }

    fn claim_internal(&mut self, idx: u32) {
        self.dequeue(idx);
        if let Some(r) = self.record_mut(idx) {
            r.claims += 1;
        }
    }

    fn unclaim(&mut self, idx: u32) {
        let Some(r) = self.record_mut(idx) else {
            return;
        };
        r.claims = r.claims.saturating_sub(1);
        if r.claims == 0 && r.state == Residency::Ready {
            if r.flags & FLAG_RETIRE != 0 {
                self.remove_record(idx, "retire on release");
            } else {
                self.make_evictable(idx);
            }
        }
    }

    // ------------------------------------------------------------ eviction queue

    fn meta(&self, idx: u32) -> Option<BlockMeta> {
        let r = self.record(idx)?;
        Some(BlockMeta {
            key: r.key,
            size_bytes: self.record_bytes(idx),
            access_count: r.access_count,
            last_access_ns: r.last_access,
            inserted_seq: r.seq,
        })
    }

    fn make_evictable(&mut self, idx: u32) {
        let queued = self.record(idx).is_none_or(|r| {
            r.flags & FLAG_QUEUED != 0 || r.claims != 0 || r.state != Residency::Ready
        });
        if queued {
            return;
        }
        match self.policy.order() {
            EvictionOrder::LeastRecentlyUsed => self.list_push_back(idx),
            // Insertion order survives a claim and release: the set is keyed by
            // insertion sequence, so a re-queued page goes back to its place.
            EvictionOrder::Insertion => {
                let Some(seq) = self.record(idx).map(|r| r.seq) else {
                    return;
                };
                self.scores.insert(idx, 0);
                self.scored.insert((0, seq, idx));
            }
            EvictionOrder::Scored => {
                let Some(meta) = self.meta(idx) else { return };
                let previous = self.scores.get(&idx).copied();
                match self.policy.eviction_score(&meta) {
                    Ok(Some(score)) => {
                        let bits = ordered_bits(score);
                        self.scores.insert(idx, bits);
                        self.scored.insert((bits, meta.inserted_seq, idx));
                    }
                    Ok(None) => {
                        if let Some(r) = self.record_mut(idx) {
                            r.flags |= FLAG_UNSCORED;
                        }
                    }
                    Err(()) => {
                        let bits = previous.unwrap_or(ordered_bits(0.0));
                        self.scores.insert(idx, bits);
                        self.scored.insert((bits, meta.inserted_seq, idx));
                    }
                }
            }
        }
        if let Some(r) = self.record_mut(idx) {
            r.flags |= FLAG_QUEUED;
        }
        self.adjust_evictable(idx, true);
    }

    fn dequeue(&mut self, idx: u32) {
        let Some(r) = self.record(idx) else { return };
        if r.flags & FLAG_QUEUED == 0 {
            return;
        }
        match self.policy.order() {
            EvictionOrder::LeastRecentlyUsed => self.list_unlink(idx),
            EvictionOrder::Insertion | EvictionOrder::Scored => {
                let seq = r.seq;
                if let Some(bits) = self.scores.remove(&idx) {
                    self.scored.remove(&(bits, seq, idx));
                }
            }
        }
        if let Some(r) = self.record_mut(idx) {
            r.flags &= !(FLAG_QUEUED | FLAG_UNSCORED);
        }
        self.adjust_evictable(idx, false);
    }

    fn list_push_back(&mut self, idx: u32) {
        let tail = self.queue_tail;
        if let Some(r) = self.records.get_mut(idx as usize) {
            r.prev = tail;
            r.next = NIL;
        }
        match self.records.get_mut(tail as usize) {
            Some(t) => t.next = idx,
            None => self.queue_head = idx,
        }
        self.queue_tail = idx;
    }

    fn list_unlink(&mut self, idx: u32) {
        let Some(r) = self.records.get(idx as usize) else {
            return;
        };
        let (prev, next) = (r.prev, r.next);
        match self.records.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => self.queue_head = next,
        }
        match self.records.get_mut(next as usize) {
            Some(n) => n.prev = prev,
            None => self.queue_tail = prev,
        }
        if let Some(r) = self.records.get_mut(idx as usize) {
            r.prev = NIL;
            r.next = NIL;
        }
    }

    /// Scored policies: pages the policy left unscored get another chance
    /// when space is needed.
    fn rescore_unscored(&mut self) {
        if self.policy.order() != EvictionOrder::Scored {
            return;
        }
        let unscored: Vec<u32> = self
            .records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.state == Residency::Ready && r.flags & FLAG_UNSCORED != 0)
            .map(|(i, _)| i as u32)
            .collect();
        for idx in unscored {
            if let Some(r) = self.record_mut(idx) {
                r.flags &= !(FLAG_QUEUED | FLAG_UNSCORED);
            }
            self.adjust_evictable(idx, false);
            self.make_evictable(idx);
        }
    }

    /// Takes one slot per pool of `layout`, evicting READY unclaimed pages if
    /// needed. Evicts nothing unless the whole allocation can succeed.
    fn allocate(&mut self, _now: u64, layout: u16, protected: &[ScopedKey]) -> Option<Vec<u32>> {
        let spans = self.layouts.get(layout as usize)?.len();
        // Slots still missing per pool (pools are few; index by pool id).
        let mut short = vec![0u32; self.pools.len()];
        for i in 0..spans {
            let pool = self.layouts.get(layout as usize)?.get(i)?.0 as usize;
            *short.get_mut(pool)? += 1;
        }
        for (pool, missing) in short.iter_mut().enumerate() {
            let free = self.pools.get(pool).map_or(0, |p| p.free.len() as u32);
            *missing = missing.saturating_sub(free);
        }
        let mut still_short = short.iter().filter(|m| **m > 0).count();
        if still_short > 0 {
            self.rescore_unscored();
            let mut victims = Vec::new();
            let mut cursor = self.first_candidate();
            while let (Some(idx), true) = (cursor, still_short > 0) {
                cursor = self.next_candidate(idx);
                let Some(r) = self.record(idx) else { continue };
                if protected.contains(&r.key) {
                    continue;
                }
                let victim_layout = r.layout as usize;
                let helps = self.layouts.get(victim_layout).is_some_and(|l| {
                    l.iter()
                        .any(|p| short.get(p.0 as usize).is_some_and(|m| *m > 0))
                });
                if !helps {
                    continue;
                }
                let Some(meta) = self.meta(idx) else { continue };
                if self.policy.decide_eviction(&meta) == EvictionDecision::Keep {
                    continue;
                }
                victims.push(idx);
                for p in self.layouts.get(victim_layout).into_iter().flatten() {
                    if let Some(m) = short.get_mut(p.0 as usize).filter(|m| **m > 0) {
                        *m -= 1;
                        if *m == 0 {
                            still_short -= 1;
                        }
                    }
                }
            }
            if still_short > 0 {
                return None;
            }
            let mut removed = Vec::with_capacity(victims.len());
            for idx in victims {
                removed.extend(self.free_record(idx, "evict"));
                self.counters.evictions += 1;
            }
            // One Removed event per namespace for the whole batch.
            self.publish_removed(&removed);
        }
        let mut slots = Vec::with_capacity(spans);
        for i in 0..spans {
            let pool = self.layouts.get(layout as usize)?.get(i)?.0 as usize;
            slots.push(self.pools.get_mut(pool)?.free.pop_front()?);
        }
        Some(slots)
    }

    /// The first eviction candidate in policy order.
    fn first_candidate(&self) -> Option<u32> {
        match self.policy.order() {
            EvictionOrder::LeastRecentlyUsed => (self.queue_head != NIL).then_some(self.queue_head),
            EvictionOrder::Insertion | EvictionOrder::Scored => {
                self.scored.first().map(|(_, _, idx)| *idx)
            }
        }
    }

    /// The candidate after `idx` (which must still be queued).
    fn next_candidate(&self, idx: u32) -> Option<u32> {
        match self.policy.order() {
            EvictionOrder::LeastRecentlyUsed => {
                let next = self.records.get(idx as usize)?.next;
                (next != NIL).then_some(next)
            }
            EvictionOrder::Insertion | EvictionOrder::Scored => {
                let seq = self.records.get(idx as usize)?.seq;
                let bits = *self.scores.get(&idx)?;
                self.scored
                    .range((
                        std::ops::Bound::Excluded((bits, seq, idx)),
                        std::ops::Bound::Unbounded,
                    ))
                    .next()
                    .map(|(_, _, i)| *i)
            }
        }
    }

    // ------------------------------------------------------------ events

    fn scope(&self, namespace: NamespaceId) -> InventoryScope {
        InventoryScope {
            owner: Owner::Kvcr,
            namespace,
            medium: self.medium,
        }
    }

    fn publish_stored(&mut self, stored: &[(u32, Option<PageInfo>)]) {
        for (idx, page) in stored {
            let Some(r) = self.record(*idx) else { continue };
            let key = r.key;
            let lora_name = self
                .namespaces
                .get(&key.namespace)
                .and_then(|n| n.lora_name.clone());
            let (parent, token_ids) = match page {
                Some(p) => (p.parent, p.token_ids.clone()),
                None => (None, Vec::new()),
            };
            let event = InventoryEvent::Stored {
                scope: self.scope(key.namespace),
                keys: vec![key.key],
                parent,
                block_size: u32::try_from(token_ids.len()).unwrap_or(u32::MAX),
                token_ids,
                lora_name,
            };
            let merge = self
                .events
                .last()
                .is_some_and(|last| last.can_merge(&event));
            match (merge, self.events.last_mut(), event) {
                (
                    true,
                    Some(InventoryEvent::Stored {
                        keys, token_ids, ..
                    }),
                    InventoryEvent::Stored {
                        keys: more_keys,
                        token_ids: more_tokens,
                        ..
                    },
                ) => {
                    keys.extend(more_keys);
                    token_ids.extend(more_tokens);
                }
                (_, _, event) => self.events.push(event),
            }
        }
    }

    fn publish_removed(&mut self, keys: &[ScopedKey]) {
        let mut by_namespace: BTreeMap<NamespaceId, Vec<kvcr_contracts::key::BlockKey>> = BTreeMap::new();
        for key in keys {
            by_namespace.entry(key.namespace).or_default().push(key.key);
        }
        for (namespace, keys) in by_namespace {
            self.events.push(InventoryEvent::Removed {
                scope: self.scope(namespace),
                keys,
            });
        }
    }

    // ------------------------------------------------------------ pressure

    /// Edge-triggered capacity signal: a pool whose reclaimable slots (free +
    /// evictable) newly drop below its watermark is reported once, until it
    /// recovers.
    fn check_pressure(&mut self) {
        for (i, p) in self.pools.iter_mut().enumerate() {
            if p.watermark == 0 {
                continue;
            }
            let reclaimable = p.free.len() as u32 + p.evictable;
            if reclaimable < p.watermark {
                if !p.pressured {
                    p.pressured = true;
                    self.capacity_signals.push((PoolId(i as u16), p.watermark));
                }
            } else {
                p.pressured = false;
            }
        }
    }

    // ------------------------------------------------------------ draining

    /// The next action for the driver.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Completed operations, in completion order.
    pub fn drain_completed(&mut self, out: &mut Vec<OpResult>) {
        out.append(&mut self.completed);
    }

    /// Inventory events, in order.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, InventoryEvent> {
        self.events.drain(..)
    }

    /// Pools that newly crossed their watermark.
    pub fn drain_capacity_signals(&mut self) -> Vec<(PoolId, u32)> {
        std::mem::take(&mut self.capacity_signals)
    }

    // ------------------------------------------------------------ stats

    /// Copy jobs not yet terminal.
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Live public claims.
    pub fn public_claims(&self) -> usize {
        self.claims.len()
    }

    /// Operations not yet completed.
    pub fn ops_in_flight(&self) -> usize {
        self.ops.len()
    }

    /// The counters.
    pub fn counters(&self) -> CoreCounters {
        let mut c = self.counters;
        c.policy_faults = self.policy.faults;
        c
    }

    /// The eviction policy's name.
    pub fn policy_name(&self) -> String {
        self.policy.name()
    }

    /// Per pool occupancy.
    pub fn pool_stats(&self) -> Vec<PoolStats> {
        self.pools
            .iter()
            .map(|p| PoolStats {
                name: p.name.clone(),
                block_size: p.block_size,
                total_slots: p.total,
                free_slots: p.free.len() as u32,
                evictable_slots: p.evictable,
            })
            .collect()
    }

    /// READY, FILLING and DISCARDING residencies.
    pub fn state_counts(&self) -> (usize, usize, usize) {
        let mut counts = (0, 0, 0);
        for e in self.index.values() {
            match e.state {
                Residency::Ready => counts.0 += 1,
                Residency::Filling => counts.1 += 1,
                Residency::Discarding => counts.2 += 1,
                Residency::Vacant => {}
            }
        }
        counts
    }

    /// Checks the structural invariants (used by the property tests after
    /// every step). Returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut owned: HashMap<(u16, u32), ScopedKey> = HashMap::new();
        for (key, entry) in &self.index {
            let r = self
                .records
                .get(entry.record as usize)
                .ok_or("index points past records")?;
            if r.key != *key || r.state != entry.state {
                return Err(format!("index and record disagree for {key:?}"));
            }
            let queued = r.flags & FLAG_QUEUED != 0;
            if queued && (r.claims != 0 || r.state != Residency::Ready) {
                return Err(format!(
                    "{key:?} is queued for eviction while claimed or not READY"
                ));
            }
            let pools = self.layouts.get(r.layout as usize).ok_or("bad layout")?;
            for (i, pool) in pools.iter().enumerate() {
                let slot = self.slot(entry.record, i).ok_or("missing slot")?;
                if let Some(other) = owned.insert((pool.0, slot), *key) {
                    return Err(format!(
                        "slot {pool:?}/{slot} owned by {other:?} and {key:?}"
                    ));
                }
                if self
                    .pools
                    .get(pool.0 as usize)
                    .is_some_and(|p| p.free.contains(&slot))
                {
                    return Err(format!("slot {pool:?}/{slot} of {key:?} is also free"));
                }
            }
        }
        for (i, p) in self.pools.iter().enumerate() {
            let used = owned.keys().filter(|(pool, _)| *pool as usize == i).count();
            if used + p.free.len() != p.total as usize {
                return Err(format!(
                    "pool {i}: {used} used + {} free != {}",
                    p.free.len(),
                    p.total
                ));
            }
        }
        for (handle, record) in &self.claims {
            let r = self
                .record(*record)
                .ok_or_else(|| format!("claim {handle:?} on a vacant record"))?;
            if r.state != Residency::Ready || r.claims == 0 {
                return Err(format!(
                    "claim {handle:?} on {:?} in {:?} with {} claims",
                    r.key, r.state, r.claims
                ));
            }
        }
        Ok(())
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

    /// Keys of `op` that have no result yet.
    pub fn pending_keys(&self, op: OpHandle) -> Vec<ScopedKey> {
        self.ops
            .get(&op)
            .map(|o| {
                o.entries
                    .iter()
                    .filter(|e| e.result.is_none())
                    .map(|e| e.key)
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
