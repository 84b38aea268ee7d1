//! The peer protocol's two state machines, inside the sans-I/O core: the
//! target role in `target`, the source role in `source`, and what they
//! share: the state types here, `config` and `reports` (the public values),
//! the message `dispatch`, the `timers`, and the driver's read-only
//! `queries`.
//!
//! **Target** (the destination, which pulls): a fetch or deliver of keys the
//! request's router hint places on a peer reserves FILLING slots and becomes a
//! target operation: `start_write` naming, per key, the runner-owned pool
//! elements it grants. States, with the reference runtime's deadlines:
//!
//! ```text
//! WaitingWriteDone --write_done / refused--> Finished
//!        | op deadline: fills DISCARDING, callers fail, probe #1
//!        v
//! WaitingTerminal --terminal proof--> Finished (slots freed)
//!        | abandonment deadline: uncertain notice, probe #2
//!        v
//! Quarantined --terminal proof--> Finished (slots freed, quiesced notice)
//! ```
//!
//! A late success after the op deadline never commits: the slots are freed.
//! Elapsed time alone never frees a quarantined destination. Terminal proof
//! is a terminal reply from the incarnation the op was sent to, a refusal,
//! or a **death report**: a probe ack from the op's own source endpoint, by
//! the process serving there now, naming the op's incarnation as dead
//! (`dead_incarnation`; that process was told so by the guard, which saw
//! the old one exit by its pidfd: it can write nothing any more). A death
//! report ends every op of that endpoint sent to that incarnation at once.
//! A quarantined op is probed again, up to [`MAX_REPROBES_PER_ACK`] per
//! endpoint, whenever its endpoint acknowledges our metadata afresh (a new
//! process there, or the same one after an expiry or a lost session), so a
//! restarted or backup runner that knows the old incarnation dead frees its
//! slots without an engine restart; one that does not answers non-terminal
//! and the slots stay held.
//!
//! **Source** (the peer that holds the pages): a `start_write` is checked
//! against the target's advertised regions (every element in range, sizes
//! equal), READY keys are claimed, and one put action covers them; after the
//! put and flush complete, `write_done` reports the completed indices. Probes
//! install sticky cancellation fences; a source that finds its own process
//! stalled past an operation timeout refuses new writes until its driver
//! has closed the sessions opened before the stall (requests that waited
//! in them would otherwise get fresh deadlines), then serves again; a
//! refused or foreign request gets `write_refused` or a terminal failure,
//! and is counted. A probe naming an incarnation of this
//! endpoint that the guard confirmed dead ([`Core::set_dead_incarnations`])
//! is answered with a death report.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use super::*;

mod config;
mod digests;
mod dispatch;
mod one_hop;
mod queries;
mod reports;
mod source;
mod target;
mod timers;

pub use config::{
    MAX_ADVERTISED_DEVICE_REGIONS, MAX_ADVERTISED_REGIONS, MAX_DEAD_INCARNATIONS,
    MAX_FENCES_PER_TARGET, MAX_REMEMBERED_PEERS, MAX_REPROBES_PER_ACK, MAX_RKEY_LEN,
    MAX_ROUTE_BUDGETS, MAX_WORKER_ADDRESS_LEN, PeerConfig, RouteBudget,
};
pub use reports::{ConnectFailure, PeerCounters, PeerNotice, PeerStateSizes, PutSpan};

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::hint::{FetchHint, RequestId};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{
    Body, CompletedIndices, DeviceRegionAdvert, Header, Message, RegionAdvert, RouteGeneration,
    SharedMemoryAdvert, WriteOutcome,
};

/// A source route's device regions, sorted by id (the codec refused an
/// advertisement naming one twice), at most `MAX_ADVERTISED_DEVICE_REGIONS`.
///
/// Looked up once per element of every one-hop write, in the order a page
/// names them: a layer-first page names consecutive regions, so each is
/// tried right after the last one found before a binary search
/// ([`crate::region::position_after`]). A hash lookup per element (std's
/// SipHash, then hashbrown's) was a fifth of a `start_write`'s handling in
/// the seed's restore (232,000 elements, profiled).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct DeviceGrants {
    sorted: Vec<DeviceRegionAdvert>,
}

impl DeviceGrants {
    pub(super) fn new(regions: &[DeviceRegionAdvert]) -> Self {
        let mut sorted = regions.to_vec();
        sorted.sort_unstable_by_key(|r| r.id);
        sorted.dedup_by_key(|r| r.id);
        Self { sorted }
    }

    pub(super) fn get(&self, id: RegionId) -> Option<&DeviceRegionAdvert> {
        self.position_after(id, None)
            .and_then(|at| self.sorted.get(at))
    }

    /// Where region `id` is, tried after `last` (a position this returned)
    /// first.
    pub(super) fn position_after(&self, id: RegionId, last: Option<usize>) -> Option<usize> {
        crate::region::position_after(&self.sorted, id, last, |r| r.id)
    }

    pub(super) fn at(&self, position: usize) -> Option<&DeviceRegionAdvert> {
        self.sorted.get(position)
    }

    pub(super) fn len(&self) -> usize {
        self.sorted.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }
}

#[derive(Debug)]
pub(crate) struct RequestHint {
    source: ControlEndpoint,
    hashes: HashSet<BlockKey>,
    failed: bool,
    missing: HashSet<BlockKey>,
}

#[derive(Debug, Default)]
struct SourcePeer {
    acked: bool,
    /// The source's ack said it maps our shared segments: its writes need
    /// nothing from our UCX worker.
    one_copy: bool,
    /// The source's ack said it opened every device region we advertised
    /// (the one-hop route); reset with `acked`, so it is always the word
    /// of the incarnation in `incarnation`.
    device: bool,
    /// The device regions our last metadata to it advertised (ascending):
    /// only their elements are granted, even if more were exported since.
    device_advertised: Vec<RegionId>,
    incarnation: Option<Incarnation>,
    last_metadata_ns: Option<u64>,
    /// The last quarantined op probed again on an ack: the next round
    /// starts after it (so more than [`MAX_REPROBES_PER_ACK`] ops all get
    /// their turn).
    reprobed_up_to: Option<OpHandle>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TargetState {
    /// The source's incarnation is not known yet: `start_write` waits for the
    /// metadata ack, so that every reply can be checked against it.
    AwaitingAck,
    WaitingWriteDone,
    WaitingTerminal,
    Quarantined,
}

#[derive(Debug)]
struct TargetOp {
    source: ControlEndpoint,
    source_incarnation: Option<Incarnation>,
    request: Option<RequestId>,
    state: TargetState,
    deadline: u64,
    abandon_deadline: u64,
    keys: Vec<ScopedKey>,
    fills: Vec<u32>,
    /// A one-hop write (then `fills` is empty): per key, the deliver
    /// operation and entry whose own device destination it grants.
    one_hop: Vec<(OpHandle, u32)>,
    /// A one-hop write's `lead_elements` (0: none asked), and whether its
    /// source said they landed ([`Body::WriteLeadLanded`]).
    lead: u16,
    lead_landed: bool,
    uncertain: bool,
    /// The request, until it is sent.
    start: Option<Body>,
}

impl TargetOp {
    /// When this operation's timer may fire: its deadline while it waits
    /// for the write, or the abandon deadline if that comes first (it
    /// applies once the write is given up on); none once quarantined.
    fn timer(&self) -> Option<u64> {
        match self.state {
            TargetState::AwaitingAck | TargetState::WaitingWriteDone => {
                Some(self.deadline.min(self.abandon_deadline))
            }
            TargetState::WaitingTerminal => Some(self.abandon_deadline),
            TargetState::Quarantined => None,
        }
    }
}

#[derive(Debug)]
struct Route {
    incarnation: Incarnation,
    their_generation: RouteGeneration,
    local_generation: u64,
    /// Shared with each write checked against it (a write holds them for
    /// its whole check while the core changes; a clone per write cost more
    /// than the check).
    regions: Arc<HashMap<RegionId, RegionAdvert>>,
    shared_memory: Option<SharedMemoryAdvert>,
    doorbell: Option<DoorbellAdvert>,
    /// `None` while the driver connects; then whether it mapped every
    /// shared segment (the metadata ack waits for this and carries it).
    one_copy: Option<bool>,
    /// The target's device regions, by id (shared as `regions` is).
    device_regions: Arc<DeviceGrants>,
    /// Whether the driver opened every device region (known with
    /// `one_copy`): only then are device elements written.
    device: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteState {
    Writing,
    CancelPending,
}

#[derive(Debug)]
struct SourceWrite {
    target: ControlEndpoint,
    target_incarnation: Incarnation,
    op: OpHandle,
    records: Vec<u32>,
    indices: Vec<u32>,
    bytes: u64,
    deadline: u64,
    state: WriteState,
    /// Its spans land in the target's device regions (the one-hop route).
    device: bool,
    /// Leading elements per key the target asked to hear about once landed
    /// ([`Body::WriteLeadLanded`]); 0 once said, or where none was asked
    /// (only one-hop writes say it).
    lead: u16,
}

/// The peer half of the core's state: the two roles, and what they share.
#[derive(Debug)]
pub(crate) struct PeerState {
    config: PeerConfig,
    /// The destination role: hints, sources' metadata, target operations.
    target: TargetRole,
    /// The source role: routes to targets, writes, fences, the stall latch.
    source: SourceRole,
    last_tick: Option<u64>,
    /// No target operation or source write expires before this (`u64::MAX`:
    /// none waits): a lower bound, lowered by each insert and set afresh by
    /// each scan of them ([`Core::handle_peer_timeout`]). The engine polls
    /// for completions on every step, and each poll expires deadlines: a
    /// scan of every operation per poll, under the runner's lock, was what
    /// a restore's 453 one-hop operations made every poll cost.
    timer_floor: u64,
    /// The driver's export name of each device region it shares with
    /// same-host sources ([`Core::set_device_export`]).
    device_exports: BTreeMap<RegionId, Vec<u8>>,
    pub(crate) notices: Vec<PeerNotice>,
    pub(crate) counters: PeerCounters,
}

/// What a destination (a target) keeps: it pulls hinted pages from sources.
#[derive(Debug, Default)]
struct TargetRole {
    hints: HashMap<RequestId, RequestHint>,
    sources: HashMap<ControlEndpoint, SourcePeer>,
    ops: BTreeMap<OpHandle, TargetOp>,
    /// Operations completed by a record that carried only their write's
    /// digest (the source checked each page as it copied it), newest last,
    /// at most [`LATE_DIGESTS`]: their pages' own digests come with the
    /// `write_done` behind the record.
    late_digests: std::collections::VecDeque<LateDigests>,
    /// Device deliver entries waiting for their source's metadata ack
    /// ([`Wait::Route`]), at most one per entry of a live deliver.
    route_waits: Vec<RouteWait>,
}

/// A device deliver entry held until its hinted source acknowledges our
/// metadata, so that a restore issued right after the hint takes the
/// one-hop route when the source offers it instead of racing the
/// handshake into two hops.
#[derive(Debug)]
struct RouteWait {
    deliver: OpHandle,
    entry: u32,
    key: ScopedKey,
    layout: u16,
    request: Option<RequestId>,
    source: ControlEndpoint,
    elements: Vec<ElementRef>,
}

/// How many operations wait for their pages' digests at once (older ones
/// are forgotten: their pages are served on without a digest).
pub(in crate::machine) const LATE_DIGESTS: usize = 256;

/// An operation completed without its pages' digests, which its
/// `write_done` brings.
#[derive(Debug)]
struct LateDigests {
    op: OpHandle,
    source: ControlEndpoint,
    source_incarnation: Option<Incarnation>,
    /// The write's digest the record carried: the pages' digests must
    /// combine to it.
    combined: u64,
    /// Per landed key: its index in the operation, its record and key.
    pages: Vec<(u32, u32, ScopedKey)>,
}

/// A peer's write held back while the keys only G3 holds are filled into
/// DRAM (the write is then served as if it had just arrived, rechecked).
#[derive(Debug)]
pub(in crate::machine) struct PendingSourceWrite {
    target: ControlEndpoint,
    target_incarnation: Incarnation,
    op: OpHandle,
    deadline: u64,
    namespace: NamespaceId,
    keys: Vec<BlockKey>,
    destinations: Vec<ElementRuns>,
    /// The write's `lead_elements`.
    lead: u16,
    /// DRAM records the fills committed, pinned until the write claims them.
    pub(in crate::machine) pinned: Vec<u32>,
    /// Refused, not served, when its preparation ends: the target probed
    /// the op meanwhile (and was answered that nothing is in flight; a fence
    /// cannot say so, the op being at or below the high-water mark where
    /// fences fold), or the write's deadline passed (the target gives up
    /// then: a put would only race its probe).
    pub(in crate::machine) refused: bool,
}

/// Why a key of a peer's write is not READY in DRAM yet, and how the write's
/// preparation waits for it.
#[derive(Debug, Clone, Copy)]
pub(in crate::machine) enum Awaited {
    /// Only G3 holds it (its DRAM layout): fill it.
    FromG3(u16),
    /// Its DRAM record is FILLING (another preparation, a deposit): wait on
    /// that fill.
    Filling(u32),
}

/// What a source keeps: it writes its READY pages into targets' grants.
#[derive(Debug)]
struct SourceRole {
    /// Writes being prepared (G3 fills first), by target incarnation and op.
    preparing: HashMap<(Incarnation, OpHandle), OpHandle>,
    routes: HashMap<ControlEndpoint, Route>,
    /// When each target's next route change is due ([`RouteBudget::admit`]);
    /// at most [`MAX_ROUTE_BUDGETS`], outliving the routes (a target that
    /// reconnects keeps its budget).
    route_changes_due: HashMap<source::routes::RouteMember, u64>,
    /// When the next route change of any target is due
    /// ([`PeerConfig::route_budget_total`]).
    route_changes_total_due: Option<u64>,
    next_route_generation: u64,
    writes: HashMap<u64, SourceWrite>,
    writes_by_op: HashMap<(Incarnation, OpHandle), u64>,
    /// Highest op handle accepted per target incarnation: a duplicate or late
    /// `start_write` at or below it never writes (the slots it names may have
    /// been reused by the target since).
    high_water: HashMap<Incarnation, OpHandle>,
    /// Probed ops per target incarnation: a `start_write` arriving after its
    /// probe never writes. Bounded by [`MAX_FENCES_PER_TARGET`].
    fences: HashMap<Incarnation, BTreeSet<OpHandle>>,
    next_write: u64,
    /// A stall of this process was seen: new writes are refused until the
    /// driver has closed every session opened before it
    /// ([`Core::end_peer_stall`]), so no request that waited in a socket
    /// meanwhile is served with a fresh deadline.
    stalled: bool,
    /// The latest stall's length (ns), until the driver takes it
    /// ([`Core::take_peer_stall`]).
    stall_untaken: Option<u64>,
    /// While stalled: when the requests that waited meanwhile have been
    /// read (and refused), and the driver may close their sessions.
    drain_until: Option<u64>,
    /// Incarnations of this endpoint the guard confirmed dead (oldest
    /// first, at most [`MAX_DEAD_INCARNATIONS`], never our own).
    dead: Vec<Incarnation>,
}

impl Default for SourceRole {
    fn default() -> Self {
        Self {
            preparing: HashMap::new(),
            routes: HashMap::new(),
            route_changes_due: HashMap::new(),
            route_changes_total_due: None,
            next_route_generation: 1,
            writes: HashMap::new(),
            writes_by_op: HashMap::new(),
            high_water: HashMap::new(),
            fences: HashMap::new(),
            next_write: 1,
            stalled: false,
            stall_untaken: None,
            drain_until: None,
            dead: Vec::new(),
        }
    }
}

impl Route {
    /// The target's device regions if the driver opened them all (writes
    /// into them are served), else none.
    fn device_regions_opened(&self) -> Option<Arc<DeviceGrants>> {
        self.device.then(|| Arc::clone(&self.device_regions))
    }
}

impl PeerState {
    pub(crate) fn new(config: PeerConfig) -> Self {
        Self {
            config,
            target: TargetRole::default(),
            source: SourceRole::default(),
            last_tick: None,
            timer_floor: u64::MAX,
            device_exports: BTreeMap::new(),
            notices: Vec::new(),
            counters: PeerCounters::default(),
        }
    }

    /// Tracks target operation `handle` (its timer lowers the floor).
    fn insert_target_op(&mut self, handle: OpHandle, op: TargetOp) {
        if let Some(at) = op.timer() {
            self.timer_floor = self.timer_floor.min(at);
        }
        self.target.ops.insert(handle, op);
    }

    /// Tracks source write `id` (its deadline lowers the floor).
    fn insert_source_write(&mut self, id: u64, write: SourceWrite) {
        self.timer_floor = self.timer_floor.min(write.deadline);
        self.source.writes.insert(id, write);
    }

    /// The earliest timer of every target operation and source write still
    /// writing, by a scan of them all.
    fn earliest_timer(&self) -> Option<u64> {
        let targets = self.target.ops.values().filter_map(TargetOp::timer);
        let sources = self
            .source
            .writes
            .values()
            .filter(|w| w.state == WriteState::Writing)
            .map(|w| w.deadline);
        targets.chain(sources).min()
    }

    fn header(&self) -> Header {
        Header {
            sender: self.config.incarnation,
            route_generation: RouteGeneration(0),
            sender_endpoint: self.config.endpoint.clone(),
        }
    }

    /// Whether `key` of `request` may come from the request's hinted source.
    pub(crate) fn hinted_source(
        &self,
        request: Option<&RequestId>,
        key: &ScopedKey,
    ) -> Option<&ControlEndpoint> {
        let hint = self.target.hints.get(request?)?;
        (!hint.failed && hint.hashes.contains(&key.key) && !hint.missing.contains(&key.key))
            .then_some(&hint.source)
    }
}
