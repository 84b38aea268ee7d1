//! The peer protocol's two state machines, inside the sans-I/O core: the
//! target role in `target`, the source role in `source`, the dispatch and
//! timers they share here.
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
//! install sticky cancellation fences; a stalled source refuses new writes
//! until restart; a refused or foreign request gets `write_refused` or a
//! terminal failure, and is counted. A probe naming an incarnation of this
//! endpoint that the guard confirmed dead ([`Core::set_dead_incarnations`])
//! is answered with a death report.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::*;

mod source;
mod target;
use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::hint::{FetchHint, RequestId};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{
    Body, CompletedIndices, Header, Message, RegionAdvert, RouteGeneration, SharedMemoryAdvert,
    WriteOutcome,
};

/// Everything a runner needs to take part in the peer protocol.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// This runner's advertised control endpoint.
    pub endpoint: ControlEndpoint,
    /// This runner's incarnation.
    pub incarnation: Incarnation,
    /// Packed UCX worker address.
    pub worker_address: Vec<u8>,
    /// Packed remote key per runner-owned pool region.
    pub rkeys: Vec<(RegionId, Vec<u8>)>,
    /// The pools a same-host source may map and write itself (advertised
    /// with the metadata; `None`: UCX only).
    pub shared_memory: Option<SharedMemoryAdvert>,
    /// Abandonment budget, from op start (≥ 2 × the op timeout).
    pub abandon_timeout_ns: u64,
    /// How often unacknowledged metadata is re-sent.
    pub metadata_retry_ns: u64,
    /// When non-empty, the only peers this runner talks to: hints naming
    /// another source are dropped, messages from others refused.
    pub allowed_peers: Vec<ControlEndpoint>,
    /// Namespaces only the listed targets may fetch from this runner.
    pub private_namespaces: Vec<(NamespaceId, Vec<ControlEndpoint>)>,
    /// Bytes of pages asked of a source in one write (`start_write`); a
    /// fetch needing more sends several, which the source writes
    /// concurrently and which land one by one. 0: one write per source and
    /// operation.
    pub write_batch_bytes: u64,
    /// How often targets may make this source build routes (see
    /// [`RouteBudget`]).
    pub route_budget: RouteBudget,
}

/// How often a target may make this source build it a new data-plane route
/// (a UCX endpoint and remote keys, or a mapping of its pools).
///
/// Building one takes the peer thread a UCX connect and the close of the
/// route it replaces, and a route to a same-host target through UCX's
/// shared-memory transport keeps the mappings of each distinct segment it
/// unpacked until the worker is destroyed. So route changes are
/// rate-limited per target (the driver also refuses UCX routes while the
/// process is short of mappings). A target's legitimate changes are rare: a
/// restart, a re-registration, a new session after an idle close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteBudget {
    /// Route changes one target may make at once after a quiet spell; 0
    /// counts as 1.
    pub burst: u32,
    /// Then one more per this many nanoseconds. A refused change is not
    /// acknowledged: the target re-sends its metadata (every 100 ms) and is
    /// served once its budget allows.
    pub refill_ns: u64,
}

impl Default for RouteBudget {
    /// 4 at once, then one a second, per target.
    fn default() -> Self {
        Self {
            burst: 4,
            refill_ns: 1_000_000_000,
        }
    }
}

impl RouteBudget {
    /// Whether a target whose next change is theoretically due at `due`
    /// (`None`: never changed, or long enough ago) may change its route at
    /// `now`; if so, when its next change is due. A generic cell rate
    /// algorithm: one timestamp per target, no timer.
    pub(crate) fn admit(&self, now: u64, due: Option<u64>) -> Option<u64> {
        let due = due.map_or(now, |d| d.max(now));
        let tolerance = u64::from(self.burst.max(1) - 1).saturating_mul(self.refill_ns);
        (due.saturating_sub(tolerance) <= now).then(|| due.saturating_add(self.refill_ns))
    }
}

impl PeerConfig {
    /// Whether this runner talks to `peer` at all.
    pub fn allows(&self, peer: &ControlEndpoint) -> bool {
        self.allowed_peers.is_empty() || self.allowed_peers.contains(peer)
    }

    /// Whether `target` may fetch keys of `namespace` from this runner.
    pub fn may_fetch(&self, target: &ControlEndpoint, namespace: NamespaceId) -> bool {
        self.private_namespaces
            .iter()
            .filter(|(ns, _)| *ns == namespace)
            .all(|(_, members)| members.contains(target))
    }
}

/// Most regions one target may advertise.
pub const MAX_ADVERTISED_REGIONS: usize = 64;
/// Largest packed worker address accepted from a target.
pub const MAX_WORKER_ADDRESS_LEN: usize = 64 << 10;
/// Largest packed remote key accepted from a target.
pub const MAX_RKEY_LEN: usize = 4 << 10;
/// Target incarnations (source role) and sources (target role) remembered
/// beyond those in use; past it, the ones not in use are forgotten.
pub const MAX_REMEMBERED_PEERS: usize = 4096;
/// Fences kept per target incarnation; past it they fold into the op-handle
/// high-water mark (every op at or below the highest fenced one is refused).
pub const MAX_FENCES_PER_TARGET: usize = 1024;
/// Targets whose route-change budget a source remembers ([`RouteBudget`]);
/// past it, those whose budget has refilled are forgotten, and a new target
/// is refused while none has.
pub const MAX_ROUTE_BUDGETS: usize = MAX_REMEMBERED_PEERS;
/// Guard-confirmed dead incarnations a source remembers (the latest ones;
/// the guard keeps as many by default).
pub const MAX_DEAD_INCARNATIONS: usize = 64;
/// Quarantined ops probed again per endpoint when it acknowledges our
/// metadata afresh (the rest on later acks, in turn).
pub const MAX_REPROBES_PER_ACK: usize = 64;

/// Why the driver built no route ([`Core::handle_connect_failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectFailure {
    /// UCX refused the target's worker address or a remote key (counted in
    /// [`PeerCounters::refused`]).
    Unusable,
    /// The route would have gone through UCX while this process holds too
    /// many memory mappings (counted in [`PeerCounters::routes_refused`]).
    NoMappingsLeft,
}

/// A notice for the framework about memory a peer may still write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerNotice {
    /// The abandonment deadline passed without proof that the source stopped:
    /// the target's slots stay quarantined.
    Uncertain {
        /// The target operation.
        op: OpHandle,
    },
    /// Proof arrived that the source will not touch the slots again; they are free.
    Quiesced {
        /// The target operation.
        op: OpHandle,
    },
}

/// Counters of the peer protocol.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PeerCounters {
    /// `start_write`s sent.
    pub writes_requested: u64,
    /// Keys a source wrote for us.
    pub keys_received: u64,
    /// Keys we wrote for targets.
    pub keys_sent: u64,
    /// Bytes we wrote for targets.
    pub bytes_sent: u64,
    /// Messages refused: unknown op, wrong sender, foreign incarnation,
    /// out-of-range element, unknown region, size mismatch.
    pub refused: u64,
    /// Target operations that reached the abandonment deadline.
    pub quarantined: u64,
    /// Requests or hints refused because the peer is not on the allowlist.
    pub refused_peers: u64,
    /// Writes refused because the namespace is private to other targets.
    pub refused_private: u64,
    /// Routes to targets whose every region the driver mapped (writes are
    /// one copy, without UCX).
    pub one_copy_routes: u64,
    /// Routes written through UCX (no shared segments, or some refused).
    pub ucx_routes: u64,
    /// Route changes refused: a target over its [`RouteBudget`] (not
    /// acknowledged, so it re-sends), or a UCX route while this process was
    /// short of mappings ([`ConnectFailure::NoMappingsLeft`], acknowledged
    /// as no route).
    pub routes_refused: u64,
    /// (Source role) probes answered with a death report: the probed
    /// incarnation of this endpoint is guard-confirmed dead.
    pub dead_reported: u64,
    /// (Target role) operations ended by a death report (the probed one and
    /// the others sent to that incarnation).
    pub dead_freed: u64,
    /// (Target role) death reports not believed: from another endpoint,
    /// naming another incarnation than the op's, from the dead incarnation
    /// itself, or about an op that was never probed.
    pub dead_ignored: u64,
    /// (Target role) quarantined ops probed again on a fresh metadata ack.
    pub reprobes: u64,
}

/// Sizes of the core's per-peer state ([`Core::peer_state_sizes`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PeerStateSizes {
    /// Routes to targets (one per target session).
    pub routes: usize,
    /// Fenced (probed, never started) ops, over all targets.
    pub fences: usize,
    /// Target incarnations with an op-handle high-water mark.
    pub high_water: usize,
    /// Requests with a router hint.
    pub hinted_requests: usize,
    /// Sources this runner fetched from or was hinted to.
    pub sources: usize,
    /// Target operations in flight or quarantined.
    pub target_ops: usize,
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
    uncertain: bool,
    /// The request, until it is sent.
    start: Option<Body>,
}

#[derive(Debug)]
struct Route {
    incarnation: Incarnation,
    their_generation: RouteGeneration,
    local_generation: u64,
    regions: HashMap<RegionId, RegionAdvert>,
    shared_memory: Option<SharedMemoryAdvert>,
    doorbell: Option<DoorbellAdvert>,
    /// `None` while the driver connects; then whether it mapped every
    /// shared segment (the metadata ack waits for this and carries it).
    one_copy: Option<bool>,
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
}

/// One put: local bytes into a remote element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutSpan {
    /// Local source address (inside a runner-owned pool).
    pub local: u64,
    /// Remote destination address (inside `region` of the target).
    pub remote: u64,
    /// Bytes.
    pub len: u64,
    /// The target's region (selects the rkey).
    pub region: RegionId,
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
    pub(crate) notices: Vec<PeerNotice>,
    pub(crate) counters: PeerCounters,
}

/// What a destination (a target) keeps: it pulls hinted pages from sources.
#[derive(Debug, Default)]
struct TargetRole {
    hints: HashMap<RequestId, RequestHint>,
    sources: HashMap<ControlEndpoint, SourcePeer>,
    ops: BTreeMap<OpHandle, TargetOp>,
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
    destinations: Vec<Vec<ElementRef>>,
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
    route_changes_due: HashMap<ControlEndpoint, u64>,
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
    stalled: bool,
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
            next_route_generation: 1,
            writes: HashMap::new(),
            writes_by_op: HashMap::new(),
            high_water: HashMap::new(),
            fences: HashMap::new(),
            next_write: 1,
            stalled: false,
            dead: Vec::new(),
        }
    }
}

impl PeerState {
    pub(crate) fn new(config: PeerConfig) -> Self {
        Self {
            config,
            target: TargetRole::default(),
            source: SourceRole::default(),
            last_tick: None,
            notices: Vec::new(),
            counters: PeerCounters::default(),
        }
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

/// An element of a target region, bounds-checked against its advertisement.
fn remote_address(region: &RegionAdvert, index: u64) -> Option<u64> {
    if index >= region.count {
        return None;
    }
    region.base.checked_add(index.checked_mul(region.stride)?)
}

impl Core {
    /// Enables the peer protocol.
    pub fn enable_peer(&mut self, config: PeerConfig) {
        self.peer = Some(PeerState::new(config));
    }

    pub(in crate::machine) fn send(&mut self, to: ControlEndpoint, body: Body) {
        let Some(peer) = self.peer.as_ref() else {
            return;
        };
        let message = Message {
            header: peer.header(),
            body,
        };
        self.actions.push_back(Action::Send { to, message });
    }

    /// One control message from a peer.
    pub fn handle_message(&mut self, now: u64, message: Message) {
        if self.peer.is_none() {
            return;
        }
        // A message is handled on a driver turn: measure the stall first, so a
        // request that queued up while this process was stopped is refused
        // rather than served with a fresh deadline.
        self.latch_stall(now);
        let Message { header, body } = message;
        if let Some(peer) = self.peer.as_mut()
            && !peer.config.allows(&header.sender_endpoint)
        {
            peer.counters.refused_peers += 1;
            return;
        }
        match body {
            Body::TargetMetadata {
                worker_address,
                regions,
                shared_memory,
                doorbell,
            } => self.on_target_metadata(
                now,
                &header,
                worker_address,
                regions,
                shared_memory,
                doorbell,
            ),
            Body::TargetMetadataAck { one_copy, .. } => self.on_metadata_ack(&header, one_copy),
            Body::StartWrite {
                op_handle,
                remaining_timeout_ms,
                source_incarnation,
                namespace,
                keys,
                destinations,
            } => self.on_start_write(
                now,
                &header,
                op_handle,
                remaining_timeout_ms,
                source_incarnation,
                namespace,
                &keys,
                &destinations,
            ),
            Body::WriteRefused { op_handle } => self.on_write_end(now, &header, op_handle, None),
            Body::WriteDone { op_handle, outcome } => {
                self.on_write_end(now, &header, op_handle, Some(outcome))
            }
            Body::WriteProbe {
                op_handle,
                source_incarnation,
            } => self.on_probe(&header, op_handle, source_incarnation),
            Body::WriteProbeAck {
                op_handle,
                terminal,
                dead_incarnation,
            } => self.on_probe_ack(now, &header, op_handle, terminal, dead_incarnation),
        }
    }

    /// Peer deadlines: target ops past their deadlines move on; source writes
    /// past theirs send a non-terminal cancellation once.
    pub fn handle_peer_timeout(&mut self, now: u64) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let unsent: Vec<OpHandle> = peer
            .target
            .ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::AwaitingAck && now >= o.deadline)
            .map(|(h, _)| *h)
            .collect();
        let expired: Vec<OpHandle> = peer
            .target
            .ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::WaitingWriteDone && now >= o.deadline)
            .map(|(h, _)| *h)
            .collect();
        let abandoned: Vec<OpHandle> = peer
            .target
            .ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::WaitingTerminal && now >= o.abandon_deadline)
            .map(|(h, _)| *h)
            .collect();
        let mut cancels = Vec::new();
        for w in peer.source.writes.values_mut() {
            if w.state == WriteState::Writing && now >= w.deadline {
                w.state = WriteState::CancelPending;
                cancels.push((w.target.clone(), w.op));
            }
        }
        for (target, op) in cancels {
            self.send(
                target,
                Body::WriteDone {
                    op_handle: op,
                    outcome: WriteOutcome::Failed { terminal: false },
                },
            );
        }
        for op in unsent {
            // Never sent, so nothing can write: fail and free at once.
            self.finish_target_op_with(now, op, None, FailReason::Timeout);
        }
        for op in expired {
            self.expire_target_op(now, op);
        }
        for op in abandoned {
            let Some(peer) = self.peer.as_mut() else {
                return;
            };
            let Some(target_op) = peer.target.ops.get_mut(&op) else {
                continue;
            };
            // Quarantine: held until proof, however long that takes.
            target_op.state = TargetState::Quarantined;
            target_op.uncertain = true;
            let (source, incarnation) = (target_op.source.clone(), target_op.source_incarnation);
            peer.counters.quarantined += 1;
            peer.notices.push(PeerNotice::Uncertain { op });
            self.send(
                source,
                Body::WriteProbe {
                    op_handle: op,
                    source_incarnation: incarnation,
                },
            );
        }
    }

    /// Called by the peer driver on every turn: a gap of a whole operation
    /// timeout between turns means this process was stalled (stopped,
    /// starved); such a source refuses new writes until restart.
    pub fn handle_tick(&mut self, now: u64) {
        self.latch_stall(now);
        if let Some(peer) = self.peer.as_mut() {
            peer.last_tick = Some(now);
        }
        self.handle_peer_timeout(now);
    }

    /// Latches `stalled` when a whole operation timeout has passed since the
    /// last driver turn (the tick or a message may come first after a stop).
    pub(in crate::machine) fn latch_stall(&mut self, now: u64) {
        let timeout = self.operation_timeout_ns;
        if let Some(peer) = self.peer.as_mut()
            && peer
                .last_tick
                .is_some_and(|t| now.saturating_sub(t) >= timeout)
        {
            peer.source.stalled = true;
        }
    }

    /// The earliest peer deadline.
    pub fn next_peer_deadline(&self) -> Option<u64> {
        let peer = self.peer.as_ref()?;
        let targets = peer.target.ops.values().filter_map(|o| match o.state {
            TargetState::AwaitingAck | TargetState::WaitingWriteDone => Some(o.deadline),
            TargetState::WaitingTerminal => Some(o.abandon_deadline),
            TargetState::Quarantined => None,
        });
        let sources = peer
            .source
            .writes
            .values()
            .filter(|w| w.state == WriteState::Writing)
            .map(|w| w.deadline);
        targets.chain(sources).min()
    }

    /// Target operations whose bytes may arrive through UCX, so this
    /// process's worker must progress for them (UCX 1.13 completes a put into
    /// private memory over shared memory only when the destination
    /// progresses): those from sources that did not map our shared segments.
    pub fn peer_transport_waits(&self) -> usize {
        self.peer.as_ref().map_or(0, |p| {
            p.target
                .ops
                .values()
                .filter(|o| !p.target.sources.get(&o.source).is_some_and(|s| s.one_copy))
                .count()
        })
    }

    /// When the peer driver must next run [`Core::handle_tick`]: the earliest
    /// peer deadline, and at the latest a quarter of the operation timeout
    /// after the last tick (so a stall of this process, a whole operation
    /// timeout between ticks, is still told from an idle sleep).
    pub fn peer_wake_at(&self) -> Option<u64> {
        let peer = self.peer.as_ref()?;
        let guard = peer
            .last_tick
            .map(|t| t.saturating_add(self.operation_timeout_ns / 4));
        match (self.next_peer_deadline(), guard) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether the peer side still has work that may touch memory.
    pub fn peer_busy(&self) -> (usize, usize) {
        self.peer
            .as_ref()
            .map_or((0, 0), |p| (p.target.ops.len(), p.source.writes.len()))
    }

    /// Whether target operation `op` still waits for its source's reply.
    pub fn peer_awaits_reply(&self, op: OpHandle) -> bool {
        self.peer.as_ref().is_some_and(|p| {
            p.target
                .ops
                .get(&op)
                .is_some_and(|o| o.state == TargetState::WaitingWriteDone)
        })
    }

    /// Where a write of the first `keys` keys of target operation `op`
    /// lands in our memory, while the operation waits for its source's
    /// reply: the address and length of every element granted to those
    /// keys, key by key in request order and each key's elements in layout
    /// order (the order a source's puts take). `None` unless `keys` is 1 to
    /// the operation's key count (a source holding only the first keys
    /// asked writes those) and each of them still holds its granted slots.
    ///
    /// A driver that receives a write's bytes as one message (rather than
    /// as puts into the granted elements) copies them here, in this order,
    /// and only while the core lock it asked under is held: the slots stay
    /// the operation's until its reply is handled.
    pub fn peer_landing_spans(&self, op: OpHandle, keys: u32) -> Option<Vec<(u64, u64)>> {
        let target_op = self
            .peer
            .as_ref()?
            .target
            .ops
            .get(&op)
            .filter(|o| o.state == TargetState::WaitingWriteDone)?;
        let keys = usize::try_from(keys).ok().filter(|k| *k > 0)?;
        let mut spans = Vec::new();
        for fill in target_op.fills.get(..keys)? {
            let fill = self.fills.get(*fill as usize)?.as_ref()?;
            if fill.source != (FillSource::Remote { target_op: op.0 }) {
                return None;
            }
            let elements = self.slot_refs(fill.record);
            if elements.is_empty() {
                return None;
            }
            for element in elements {
                spans.push(self.resolve(element).ok()?);
            }
        }
        Some(spans)
    }

    /// Drains the framework notices.
    pub fn take_notices(&mut self) -> Vec<PeerNotice> {
        self.peer
            .as_mut()
            .map(|p| std::mem::take(&mut p.notices))
            .unwrap_or_default()
    }

    /// How much per-peer state the core holds: what the bounds in the trust
    /// rules are checked against.
    pub fn peer_state_sizes(&self) -> PeerStateSizes {
        self.peer
            .as_ref()
            .map_or_else(PeerStateSizes::default, |p| PeerStateSizes {
                routes: p.source.routes.len(),
                fences: p.source.fences.values().map(BTreeSet::len).sum(),
                high_water: p.source.high_water.len(),
                hinted_requests: p.target.hints.len(),
                sources: p.target.sources.len(),
                target_ops: p.target.ops.len(),
            })
    }

    /// Peer counters.
    pub fn peer_counters(&self) -> PeerCounters {
        self.peer.as_ref().map(|p| p.counters).unwrap_or_default()
    }
}
