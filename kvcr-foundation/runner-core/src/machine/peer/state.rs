//! The peer half of the core's state: the target role's hints, sources and
//! operations, the source role's routes, writes, fences and high-water
//! marks, and the writes held back while their keys are readied in DRAM.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::*;

#[derive(Debug)]
pub(crate) struct RequestHint {
    pub(super) source: ControlEndpoint,
    pub(super) hashes: HashSet<BlockKey>,
    pub(super) failed: bool,
    pub(super) missing: HashSet<BlockKey>,
}

#[derive(Debug, Default)]
pub(super) struct SourcePeer {
    pub(super) acked: bool,
    /// The source's ack said it maps our shared segments: its writes need
    /// nothing from our UCX worker.
    pub(super) one_copy: bool,
    pub(super) incarnation: Option<Incarnation>,
    pub(super) last_metadata_ns: Option<u64>,
    /// The last quarantined op probed again on an ack: the next round
    /// starts after it (so more than [`MAX_REPROBES_PER_ACK`] ops all get
    /// their turn).
    pub(super) reprobed_up_to: Option<OpHandle>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TargetState {
    /// The source's incarnation is not known yet: `start_write` waits for the
    /// metadata ack, so that every reply can be checked against it.
    AwaitingAck,
    WaitingWriteDone,
    WaitingTerminal,
    Quarantined,
}

#[derive(Debug)]
pub(super) struct TargetOp {
    pub(super) source: ControlEndpoint,
    pub(super) source_incarnation: Option<Incarnation>,
    pub(super) request: Option<RequestId>,
    pub(super) state: TargetState,
    pub(super) deadline: u64,
    pub(super) abandon_deadline: u64,
    pub(super) keys: Vec<ScopedKey>,
    pub(super) fills: Vec<u32>,
    pub(super) uncertain: bool,
    /// The request, until it is sent.
    pub(super) start: Option<Body>,
}

#[derive(Debug)]
pub(super) struct Route {
    pub(super) incarnation: Incarnation,
    pub(super) their_generation: RouteGeneration,
    pub(super) local_generation: u64,
    pub(super) regions: HashMap<RegionId, RegionAdvert>,
    pub(super) shared_memory: Option<SharedMemoryAdvert>,
    pub(super) doorbell: Option<DoorbellAdvert>,
    /// `None` while the driver connects; then whether it mapped every
    /// shared segment (the metadata ack waits for this and carries it).
    pub(super) one_copy: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WriteState {
    Writing,
    CancelPending,
}

#[derive(Debug)]
pub(super) struct SourceWrite {
    pub(super) target: ControlEndpoint,
    pub(super) target_incarnation: Incarnation,
    pub(super) op: OpHandle,
    pub(super) records: Vec<u32>,
    pub(super) indices: Vec<u32>,
    pub(super) bytes: u64,
    pub(super) deadline: u64,
    pub(super) state: WriteState,
}

/// The peer half of the core's state: the two roles, and what they share.
#[derive(Debug)]
pub(crate) struct PeerState {
    pub(super) config: PeerConfig,
    /// The destination role: hints, sources' metadata, target operations.
    pub(super) target: TargetRole,
    /// The source role: routes to targets, writes, fences, the stall latch.
    pub(super) source: SourceRole,
    pub(super) last_tick: Option<u64>,
    pub(crate) notices: Vec<PeerNotice>,
    pub(crate) counters: PeerCounters,
}

/// What a destination (a target) keeps: it pulls hinted pages from sources.
#[derive(Debug, Default)]
pub(super) struct TargetRole {
    pub(super) hints: HashMap<RequestId, RequestHint>,
    pub(super) sources: HashMap<ControlEndpoint, SourcePeer>,
    pub(super) ops: BTreeMap<OpHandle, TargetOp>,
}

/// A peer's write held back while the keys only G3 holds are filled into
/// DRAM (the write is then served as if it had just arrived, rechecked).
#[derive(Debug)]
pub(in crate::machine) struct PendingSourceWrite {
    pub(super) target: ControlEndpoint,
    pub(super) target_incarnation: Incarnation,
    pub(super) op: OpHandle,
    pub(super) deadline: u64,
    pub(super) namespace: NamespaceId,
    pub(super) keys: Vec<BlockKey>,
    pub(super) destinations: Vec<Vec<ElementRef>>,
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
pub(super) struct SourceRole {
    /// Writes being prepared (G3 fills first), by target incarnation and op.
    pub(super) preparing: HashMap<(Incarnation, OpHandle), OpHandle>,
    pub(super) routes: HashMap<ControlEndpoint, Route>,
    /// When each target's next route change is due ([`RouteBudget::admit`]);
    /// at most [`MAX_ROUTE_BUDGETS`], outliving the routes (a target that
    /// reconnects keeps its budget).
    pub(super) route_changes_due: HashMap<ControlEndpoint, u64>,
    pub(super) next_route_generation: u64,
    pub(super) writes: HashMap<u64, SourceWrite>,
    pub(super) writes_by_op: HashMap<(Incarnation, OpHandle), u64>,
    /// Highest op handle accepted per target incarnation: a duplicate or late
    /// `start_write` at or below it never writes (the slots it names may have
    /// been reused by the target since).
    pub(super) high_water: HashMap<Incarnation, OpHandle>,
    /// Probed ops per target incarnation: a `start_write` arriving after its
    /// probe never writes. Bounded by [`MAX_FENCES_PER_TARGET`].
    pub(super) fences: HashMap<Incarnation, BTreeSet<OpHandle>>,
    pub(super) next_write: u64,
    pub(super) stalled: bool,
    /// Incarnations of this endpoint the guard confirmed dead (oldest
    /// first, at most [`MAX_DEAD_INCARNATIONS`], never our own).
    pub(super) dead: Vec<Incarnation>,
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

    pub(super) fn header(&self) -> Header {
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
