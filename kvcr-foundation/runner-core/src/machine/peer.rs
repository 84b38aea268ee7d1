//! The peer protocol's two state machines, inside the sans-I/O core.
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
//! Elapsed time alone never frees a quarantined destination.
//!
//! **Source** (the peer that holds the pages): a `start_write` is checked
//! against the target's advertised regions (every element in range, sizes
//! equal), READY keys are claimed, and one put action covers them; after the
//! put and flush complete, `write_done` reports the completed indices. Probes
//! install sticky cancellation fences; a stalled source refuses new writes
//! until restart; a refused or foreign request gets `write_refused` or a
//! terminal failure, and is counted.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::*;
use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::hint::{FetchHint, RequestId};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{
    Body, CompletedIndices, Header, Message, RegionAdvert, RouteGeneration, WriteOutcome,
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
    /// Abandonment budget, from op start (≥ 2 × the op timeout).
    pub abandon_timeout_ns: u64,
    /// How often unacknowledged metadata is re-sent.
    pub metadata_retry_ns: u64,
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
    incarnation: Option<Incarnation>,
    last_metadata_ns: Option<u64>,
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

/// The peer half of the core's state.
#[derive(Debug)]
pub(crate) struct PeerState {
    config: PeerConfig,
    hints: HashMap<RequestId, RequestHint>,
    sources: HashMap<ControlEndpoint, SourcePeer>,
    target_ops: BTreeMap<OpHandle, TargetOp>,
    routes: HashMap<ControlEndpoint, Route>,
    next_route_generation: u64,
    writes: HashMap<u64, SourceWrite>,
    writes_by_op: HashMap<(Incarnation, OpHandle), u64>,
    /// Highest op handle accepted per target incarnation: a duplicate or late
    /// `start_write` at or below it never writes (the slots it names may have
    /// been reused by the target since).
    high_water: HashMap<Incarnation, OpHandle>,
    fences: HashSet<(Incarnation, OpHandle)>,
    next_write: u64,
    stalled: bool,
    last_tick: Option<u64>,
    pub(crate) notices: Vec<PeerNotice>,
    pub(crate) counters: PeerCounters,
}

impl PeerState {
    pub(crate) fn new(config: PeerConfig) -> Self {
        Self {
            config,
            hints: HashMap::new(),
            sources: HashMap::new(),
            target_ops: BTreeMap::new(),
            routes: HashMap::new(),
            next_route_generation: 1,
            writes: HashMap::new(),
            writes_by_op: HashMap::new(),
            high_water: HashMap::new(),
            fences: HashSet::new(),
            next_write: 1,
            stalled: false,
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
        let hint = self.hints.get(request?)?;
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

    fn send(&mut self, to: ControlEndpoint, body: Body) {
        let Some(peer) = self.peer.as_ref() else {
            return;
        };
        let message = Message {
            header: peer.header(),
            body,
        };
        self.actions.push_back(Action::Send { to, message });
    }

    /// Records a request's router hint. A second hint with the same source
    /// replaces the key set; one with another source poisons the request
    /// (every key of it becomes unfetchable), as the reference does.
    pub fn submit_hint(&mut self, now: u64, request: RequestId, hint: &FetchHint) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let hashes: HashSet<BlockKey> = hint.block_hashes.iter().copied().collect();
        match peer.hints.get_mut(&request) {
            Some(existing) if existing.source != hint.source => existing.failed = true,
            Some(existing) => existing.hashes = hashes,
            None => {
                peer.hints.insert(
                    request,
                    RequestHint {
                        source: hint.source.clone(),
                        hashes,
                        failed: false,
                        missing: HashSet::new(),
                    },
                );
            }
        }
        // Eager handshake: the metadata exchange happens off the fetch path.
        self.ensure_metadata(now, &hint.source);
    }

    /// Ends a request's hint scope.
    pub fn discard_hint(&mut self, request: &RequestId) {
        if let Some(peer) = self.peer.as_mut() {
            peer.hints.remove(request);
        }
    }

    /// `query` with the request's hint: a miss the hint covers is `Fetchable`.
    pub fn query_request(
        &self,
        key: &ScopedKey,
        request: Option<&RequestId>,
    ) -> QueryStatus {
        match self.query(key) {
            QueryStatus::Miss => match self
                .peer
                .as_ref()
                .and_then(|p| p.hinted_source(request, key))
            {
                Some(_) => QueryStatus::Fetchable(kvcr_contracts::tier::Tier::External),
                None => QueryStatus::Miss,
            },
            status => status,
        }
    }

    fn ensure_metadata(&mut self, now: u64, source: &ControlEndpoint) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let retry = peer.config.metadata_retry_ns;
        let state = peer.sources.entry(source.clone()).or_default();
        let due = !state.acked
            && state
                .last_metadata_ns
                .is_none_or(|t| now.saturating_sub(t) >= retry);
        if !due {
            return;
        }
        state.last_metadata_ns = Some(now);
        let worker_address = peer.config.worker_address.clone();
        let regions = self.advertised_regions();
        self.send(
            source.clone(),
            Body::TargetMetadata {
                worker_address,
                regions,
            },
        );
    }

    /// Our connection to `source` closed (or the caller forgot it): whatever
    /// incarnation answered there before may be gone, so the next write to
    /// it waits for a fresh metadata ack and names whoever answers then.
    /// Writes already requested keep the incarnation they named: only that
    /// process can end them.
    pub fn peer_connection_lost(&mut self, source: &ControlEndpoint) {
        if let Some(state) = self.peer.as_mut().and_then(|p| p.sources.get_mut(source)) {
            state.acked = false;
            state.incarnation = None;
            state.last_metadata_ns = None;
        }
    }

    /// The runner-owned pool regions, as a target advertises them.
    fn advertised_regions(&self) -> Vec<RegionAdvert> {
        let Some(peer) = self.peer.as_ref() else {
            return Vec::new();
        };
        peer.config
            .rkeys
            .iter()
            .filter_map(|(id, rkey)| {
                let region = self.regions.get(*id).ok()?;
                Some(RegionAdvert {
                    id: *id,
                    label: region.desc.label.clone(),
                    base: region.desc.base,
                    element_size: region.desc.size,
                    stride: region.desc.effective_stride(),
                    count: region.desc.count,
                    rkey: rkey.clone(),
                })
            })
            .collect()
    }

    /// Starts remote fills for `keys` (missing locally, covered by the hint
    /// of `request`): reserves FILLING slots and sends one `start_write`.
    /// Returns, per key, the fill to wait on or the reason it failed.
    pub fn start_remote_fills(
        &mut self,
        now: u64,
        request: Option<&RequestId>,
        source: ControlEndpoint,
        keys: &[ScopedKey],
        layout: u16,
        protected: &[ScopedKey],
    ) -> Vec<std::result::Result<u32, FailReason>> {
        let Some(timeout) = self.peer.as_ref().map(|_| self.operation_timeout_ns) else {
            return vec![Err(FailReason::NoSource); keys.len()];
        };
        let target_op = OpHandle(self.next_op);
        self.next_op += 1;
        let mut results = Vec::with_capacity(keys.len());
        let mut op_keys = Vec::new();
        let mut fills = Vec::new();
        let mut destinations = Vec::new();
        for key in keys {
            let Some(slots) = self.allocate(now, layout, protected) else {
                results.push(Err(FailReason::CapacityExhausted));
                continue;
            };
            let record = self.insert_record(now, *key, layout, slots);
            let fill = self.new_fill(Fill {
                record,
                source: FillSource::Remote {
                    target_op: target_op.0,
                },
                waiters: Vec::new(),
                page: None,
            });
            self.filling.insert(record, fill);
            destinations.push(self.slot_refs(record));
            op_keys.push(*key);
            fills.push(fill);
            results.push(Ok(fill));
        }
        if op_keys.is_empty() {
            return results;
        }
        self.ensure_metadata(now, &source);
        let abandon = self
            .peer
            .as_ref()
            .map_or(timeout, |p| p.config.abandon_timeout_ns);
        // Only an acknowledged incarnation is named: after an expiry or a
        // refusal the peer is invalidated and the write waits for a fresh ack,
        // so a process restarted at the same address is asked by its own
        // incarnation (and a dead one's silence frees the never-sent fills).
        let source_incarnation = self
            .peer
            .as_ref()
            .and_then(|p| p.sources.get(&source))
            .filter(|s| s.acked)
            .and_then(|s| s.incarnation);
        let namespace = op_keys.first().map_or(NamespaceId(0), |k| k.namespace);
        let remaining_ms = u32::try_from(timeout / 1_000_000)
            .unwrap_or(u32::MAX)
            .max(1);
        let start = Body::StartWrite {
            op_handle: target_op,
            remaining_timeout_ms: remaining_ms,
            source_incarnation,
            namespace,
            keys: op_keys.iter().map(|k| k.key).collect(),
            destinations,
        };
        let (state, start) = match source_incarnation {
            Some(_) => {
                self.send(source.clone(), start);
                (TargetState::WaitingWriteDone, None)
            }
            None => (TargetState::AwaitingAck, Some(start)),
        };
        if let Some(peer) = self.peer.as_mut() {
            peer.counters.writes_requested += 1;
            peer.target_ops.insert(
                target_op,
                TargetOp {
                    source,
                    source_incarnation,
                    request: request.cloned(),
                    state,
                    deadline: now.saturating_add(timeout),
                    abandon_deadline: now.saturating_add(abandon),
                    keys: op_keys,
                    fills,
                    uncertain: false,
                    start,
                },
            );
        }
        results
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
        match body {
            Body::TargetMetadata {
                worker_address,
                regions,
            } => self.on_target_metadata(&header, worker_address, regions),
            Body::TargetMetadataAck { .. } => self.on_metadata_ack(&header),
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
                ..
            } => {
                let proof = terminal
                    && self
                        .peer
                        .as_ref()
                        .and_then(|p| p.target_ops.get(&op_handle))
                        .is_some_and(|op| {
                            op.source == header.sender_endpoint
                                && matches!(
                                    op.state,
                                    TargetState::WaitingTerminal | TargetState::Quarantined
                                )
                                && op.source_incarnation == Some(header.sender)
                        });
                if proof {
                    self.finish_target_op(now, op_handle, None);
                }
            }
        }
    }

    /// The source acknowledged our metadata: we now know its incarnation, and
    /// the writes that waited for it go out, naming it.
    fn on_metadata_ack(&mut self, header: &Header) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let Some(state) = peer.sources.get_mut(&header.sender_endpoint) else {
            peer.counters.refused += 1;
            return;
        };
        state.acked = true;
        state.incarnation = Some(header.sender);
        let mut ready = Vec::new();
        for (handle, op) in peer.target_ops.iter_mut() {
            if op.state == TargetState::AwaitingAck && op.source == header.sender_endpoint {
                op.state = TargetState::WaitingWriteDone;
                op.source_incarnation = Some(header.sender);
                if let Some(Body::StartWrite {
                    op_handle,
                    remaining_timeout_ms,
                    namespace,
                    keys,
                    destinations,
                    ..
                }) = op.start.take()
                {
                    ready.push((
                        op.source.clone(),
                        Body::StartWrite {
                            op_handle,
                            remaining_timeout_ms,
                            source_incarnation: Some(header.sender),
                            namespace,
                            keys,
                            destinations,
                        },
                    ));
                }
                let _ = handle;
            }
        }
        for (to, body) in ready {
            self.send(to, body);
        }
    }

    // ------------------------------------------------------------ source side

    fn refuse(&mut self) {
        if let Some(peer) = self.peer.as_mut() {
            peer.counters.refused += 1;
        }
    }

    fn on_target_metadata(
        &mut self,
        header: &Header,
        worker_address: Vec<u8>,
        regions: Vec<RegionAdvert>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let target = header.sender_endpoint.clone();
        let unchanged = peer.routes.get(&target).is_some_and(|r| {
            r.incarnation == header.sender
                && r.their_generation == header.route_generation
                && r.regions.len() == regions.len()
                && regions.iter().all(|a| r.regions.get(&a.id) == Some(a))
        });
        if !unchanged {
            // A new process (or new registrations) at this name: a new route
            // generation, so writes queued for the old one are never submitted.
            let generation = peer.next_route_generation;
            peer.next_route_generation += 1;
            let rkeys = regions
                .iter()
                .map(|r| (r.id, r.base, r.rkey.clone()))
                .collect();
            peer.routes.insert(
                target.clone(),
                Route {
                    incarnation: header.sender,
                    their_generation: header.route_generation,
                    local_generation: generation,
                    regions: regions.into_iter().map(|r| (r.id, r)).collect(),
                },
            );
            self.actions.push_back(Action::Connect {
                peer: target.clone(),
                generation,
                worker_address,
                rkeys,
            });
        }
        self.send(target, Body::TargetMetadataAck { op_handle: None });
    }

    #[allow(clippy::too_many_arguments)]
    fn on_start_write(
        &mut self,
        now: u64,
        header: &Header,
        op: OpHandle,
        remaining_ms: u32,
        source_incarnation: Option<Incarnation>,
        namespace: NamespaceId,
        keys: &[BlockKey],
        destinations: &[Vec<ElementRef>],
    ) {
        let Some(peer) = self.peer.as_ref() else {
            return;
        };
        let target = header.sender_endpoint.clone();
        let failed = Body::WriteDone {
            op_handle: op,
            outcome: WriteOutcome::Failed { terminal: true },
        };
        let Some(route) = peer
            .routes
            .get(&target)
            .filter(|r| r.incarnation == header.sender)
        else {
            // No route to this incarnation of the target: refuse (terminal).
            self.refuse();
            self.send(target, Body::WriteRefused { op_handle: op });
            return;
        };
        let generation = route.local_generation;
        let regions = route.regions.clone();
        // A write must name this incarnation: replies then prove something
        // about exactly the process that may have written.
        let foreign = source_incarnation != Some(peer.config.incarnation);
        let fenced = peer.fences.contains(&(header.sender, op));
        if peer.writes_by_op.contains_key(&(header.sender, op)) {
            return; // a duplicate of a write in progress: the first one stands
        }
        let stale = peer
            .high_water
            .get(&header.sender)
            .is_some_and(|high| op <= *high);
        if peer.stalled || foreign || fenced || stale {
            self.refuse();
            self.send(target, failed);
            return;
        }
        if let Some(peer) = self.peer.as_mut() {
            peer.high_water.insert(header.sender, op);
        }
        let deadline = now
            .saturating_add((u64::from(remaining_ms) * 1_000_000).min(self.operation_timeout_ns));
        let mut puts = Vec::new();
        let mut records = Vec::new();
        let mut indices = Vec::new();
        let mut bytes = 0;
        let mut bad_elements = 0u64;
        for (i, (key, dests)) in keys.iter().zip(destinations).enumerate() {
            let scoped = ScopedKey {
                namespace,
                key: *key,
            };
            let Some(record) = self
                .index
                .get(&scoped)
                .filter(|e| e.state == Residency::Ready)
                .map(|e| e.record)
            else {
                continue;
            };
            let sources = self.slot_spans(record);
            if sources.len() != dests.len() {
                continue;
            }
            let mut key_puts = Vec::with_capacity(dests.len());
            for (src, dst) in sources.iter().zip(dests) {
                let region = regions.get(&dst.region);
                let remote = region
                    .filter(|r| r.element_size == src.len)
                    .and_then(|r| remote_address(r, dst.index));
                match remote {
                    Some(remote) => key_puts.push(PutSpan {
                        local: src.src,
                        remote,
                        len: src.len,
                        region: dst.region,
                    }),
                    None => {
                        bad_elements += 1;
                        break;
                    }
                }
            }
            if key_puts.len() != dests.len() {
                continue;
            }
            bytes += key_puts.iter().map(|p| p.len).sum::<u64>();
            puts.extend(key_puts);
            records.push(record);
            indices.push(i as u32);
        }
        if bad_elements > 0 {
            // Out-of-range elements, unknown regions or size mismatches: never
            // written, and counted.
            if let Some(peer) = self.peer.as_mut() {
                peer.counters.refused += bad_elements;
            }
        }
        if puts.is_empty() {
            self.send(
                target,
                Body::WriteDone {
                    op_handle: op,
                    outcome: WriteOutcome::Completed(CompletedIndices::new(Vec::new())),
                },
            );
            return;
        }
        for record in &records {
            self.claim_internal(*record);
        }
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let write = peer.next_write;
        peer.next_write += 1;
        peer.writes_by_op.insert((header.sender, op), write);
        peer.writes.insert(
            write,
            SourceWrite {
                target: target.clone(),
                target_incarnation: header.sender,
                op,
                records,
                indices,
                bytes,
                deadline,
                state: WriteState::Writing,
            },
        );
        self.actions.push_back(Action::Put {
            write,
            target,
            generation,
            spans: puts,
        });
    }

    /// The driver's report that a put (and its flush) finished.
    pub fn handle_put_done(&mut self, now: u64, write: u64, ok: bool) {
        let Some(w) = self.peer.as_mut().and_then(|p| p.writes.remove(&write)) else {
            return;
        };
        if let Some(peer) = self.peer.as_mut() {
            peer.writes_by_op.remove(&(w.target_incarnation, w.op));
            if ok && w.state == WriteState::Writing {
                peer.counters.keys_sent += w.indices.len() as u64;
                peer.counters.bytes_sent += w.bytes;
            }
        }
        for record in &w.records {
            self.touch(now, *record);
            self.unclaim(*record);
        }
        // After a cancellation the target already gave up: only a terminal
        // failure is proof that we are done with its memory.
        let outcome = match (ok, w.state) {
            (true, WriteState::Writing) => {
                WriteOutcome::Completed(CompletedIndices::new(w.indices))
            }
            _ => WriteOutcome::Failed { terminal: true },
        };
        self.send(
            w.target,
            Body::WriteDone {
                op_handle: w.op,
                outcome,
            },
        );
    }

    fn on_probe(&mut self, header: &Header, op: OpHandle, source_incarnation: Option<Incarnation>) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let ours = source_incarnation.is_none_or(|i| i == peer.config.incarnation);
        if ours {
            // Sticky: a start_write that arrives after its probe never writes.
            peer.fences.insert((header.sender, op));
        }
        let terminal = ours && !peer.writes_by_op.contains_key(&(header.sender, op));
        self.send(
            header.sender_endpoint.clone(),
            Body::WriteProbeAck {
                op_handle: op,
                terminal,
                dead_incarnation: None,
            },
        );
    }

    // ------------------------------------------------------------ target side

    /// A write ended: `None` is a refusal; `Some(outcome)` a `write_done`.
    fn on_write_end(
        &mut self,
        now: u64,
        header: &Header,
        op: OpHandle,
        outcome: Option<WriteOutcome>,
    ) {
        let Some(target_op) = self.peer.as_ref().and_then(|p| p.target_ops.get(&op)) else {
            self.refuse(); // unknown op handle (e.g. from before a restart)
            return;
        };
        let from_source = target_op.source == header.sender_endpoint
            && target_op.source_incarnation == Some(header.sender)
            && target_op.state != TargetState::AwaitingAck;
        if !from_source {
            self.refuse(); // only this op's own source may end it
            return;
        }
        match outcome {
            Some(WriteOutcome::Failed { terminal: false }) => {
                // Cancelled but maybe still in flight: wait for proof.
                if target_op.state == TargetState::WaitingWriteDone {
                    self.expire_target_op(now, op);
                }
            }
            Some(WriteOutcome::Completed(indices)) => {
                let valid = indices
                    .as_slice()
                    .iter()
                    .all(|i| (*i as usize) < target_op.keys.len());
                if valid {
                    self.finish_target_op(now, op, Some(indices));
                } else {
                    self.refuse();
                    self.finish_target_op(now, op, None);
                }
            }
            Some(WriteOutcome::Failed { terminal: true }) | None => {
                if outcome.is_none()
                    && let Some(state) = self
                        .peer
                        .as_mut()
                        .and_then(|p| p.sources.get_mut(&header.sender_endpoint))
                {
                    state.acked = false;
                    state.incarnation = None;
                }
                if let Some(hint) = self.request_hint_of(op) {
                    hint.failed = true;
                }
                self.finish_target_op(now, op, None);
            }
        }
    }

    fn request_hint_of(&mut self, op: OpHandle) -> Option<&mut RequestHint> {
        let peer = self.peer.as_mut()?;
        let request = peer.target_ops.get(&op)?.request.clone()?;
        peer.hints.get_mut(&request)
    }

    /// Ends a target op with terminal knowledge: `Some(indices)` commits those
    /// keys if the op is still waiting (a late success only frees); `None`
    /// fails or frees everything.
    fn finish_target_op(&mut self, now: u64, op: OpHandle, completed: Option<CompletedIndices>) {
        self.finish_target_op_with(now, op, completed, FailReason::NoSource);
    }

    fn finish_target_op_with(
        &mut self,
        now: u64,
        op: OpHandle,
        completed: Option<CompletedIndices>,
        failure: FailReason,
    ) {
        let Some(target_op) = self.peer.as_mut().and_then(|p| p.target_ops.remove(&op)) else {
            return;
        };
        let on_time = target_op.state == TargetState::WaitingWriteDone;
        let completed: HashSet<u32> = completed
            .map(|c| c.as_slice().iter().copied().collect())
            .unwrap_or_default();
        let mut stored = Vec::new();
        let mut deliver_next = BTreeMap::new();
        let mut received = 0;
        let mut missing = Vec::new();
        for (i, (fill, key)) in target_op.fills.iter().zip(&target_op.keys).enumerate() {
            let landed = on_time && completed.contains(&(i as u32));
            if landed {
                received += 1;
            } else if on_time {
                missing.push(key.key);
            }
            let result = if landed { Ok(()) } else { Err(failure) };
            self.finish_fill(now, *fill, result, &mut stored, &mut deliver_next);
        }
        self.publish_stored(&stored);
        for (waiter_op, entries) in deliver_next {
            self.start_delivers(now, waiter_op, entries);
        }
        if let Some(peer) = self.peer.as_mut() {
            peer.counters.keys_received += received;
            if target_op.uncertain {
                peer.notices.push(PeerNotice::Quiesced { op });
            }
            if let Some(hint) = target_op
                .request
                .as_ref()
                .and_then(|r| peer.hints.get_mut(r))
            {
                hint.missing.extend(missing);
            }
        }
        let ops: Vec<OpHandle> = self.ops.keys().copied().collect();
        for o in ops {
            self.finish_if_done(o);
        }
        self.check_pressure();
    }

    /// The op deadline passed: fills become DISCARDING (callers fail now, the
    /// slots stay owned), the peer's metadata is invalidated, probe #1 goes out.
    fn expire_target_op(&mut self, now: u64, op: OpHandle) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let Some(target_op) = peer.target_ops.get_mut(&op) else {
            return;
        };
        target_op.state = TargetState::WaitingTerminal;
        let fills = target_op.fills.clone();
        let source = target_op.source.clone();
        let source_incarnation = target_op.source_incarnation;
        if let Some(state) = peer.sources.get_mut(&source) {
            state.acked = false;
        }
        for fill in fills {
            let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::as_mut) else {
                continue;
            };
            let record = f.record;
            let waiters = std::mem::take(&mut f.waiters);
            for (waiter_op, entry) in waiters {
                self.set_result(waiter_op, entry, EntryResult::failed(FailReason::Timeout));
            }
            if self
                .record(record)
                .is_some_and(|r| r.state == Residency::Filling)
            {
                self.transition(record, Residency::Discarding, "remote fill expired");
            }
        }
        let ops: Vec<OpHandle> = self.ops.keys().copied().collect();
        for o in ops {
            self.finish_if_done(o);
        }
        let _ = now;
        self.send(
            source,
            Body::WriteProbe {
                op_handle: op,
                source_incarnation,
            },
        );
    }

    /// Peer deadlines: target ops past their deadlines move on; source writes
    /// past theirs send a non-terminal cancellation once.
    pub fn handle_peer_timeout(&mut self, now: u64) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let unsent: Vec<OpHandle> = peer
            .target_ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::AwaitingAck && now >= o.deadline)
            .map(|(h, _)| *h)
            .collect();
        let expired: Vec<OpHandle> = peer
            .target_ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::WaitingWriteDone && now >= o.deadline)
            .map(|(h, _)| *h)
            .collect();
        let abandoned: Vec<OpHandle> = peer
            .target_ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::WaitingTerminal && now >= o.abandon_deadline)
            .map(|(h, _)| *h)
            .collect();
        let mut cancels = Vec::new();
        for w in peer.writes.values_mut() {
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
            let Some(target_op) = peer.target_ops.get_mut(&op) else {
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
    fn latch_stall(&mut self, now: u64) {
        let timeout = self.operation_timeout_ns;
        if let Some(peer) = self.peer.as_mut()
            && peer
                .last_tick
                .is_some_and(|t| now.saturating_sub(t) >= timeout)
        {
            peer.stalled = true;
        }
    }

    /// The earliest peer deadline.
    pub fn next_peer_deadline(&self) -> Option<u64> {
        let peer = self.peer.as_ref()?;
        let targets = peer.target_ops.values().filter_map(|o| match o.state {
            TargetState::AwaitingAck | TargetState::WaitingWriteDone => Some(o.deadline),
            TargetState::WaitingTerminal => Some(o.abandon_deadline),
            TargetState::Quarantined => None,
        });
        let sources = peer
            .writes
            .values()
            .filter(|w| w.state == WriteState::Writing)
            .map(|w| w.deadline);
        targets.chain(sources).min()
    }

    /// Whether the peer side still has work that may touch memory.
    pub fn peer_busy(&self) -> (usize, usize) {
        self.peer
            .as_ref()
            .map_or((0, 0), |p| (p.target_ops.len(), p.writes.len()))
    }

    /// Drains the framework notices.
    pub fn take_notices(&mut self) -> Vec<PeerNotice> {
        self.peer
            .as_mut()
            .map(|p| std::mem::take(&mut p.notices))
            .unwrap_or_default()
    }

    /// Peer counters.
    pub fn peer_counters(&self) -> PeerCounters {
        self.peer.as_ref().map(|p| p.counters).unwrap_or_default()
    }
}
