//! The target role's requests: router hints, the metadata exchange with
//! sources, remote fills granted as `start_write`s, and the writes sent
//! once a source acknowledges.

use std::collections::HashSet;

use super::*;
use kvcr_contracts::protocol::codec::MAX_KEYS_PER_WRITE;

impl Core {
    /// Records a request's router hint. A second hint with the same source
    /// replaces the key set; one with another source poisons the request
    /// (every key of it becomes unfetchable), as the reference does.
    pub fn submit_hint(&mut self, now: u64, request: RequestId, hint: &FetchHint) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        if !peer.config.allows(&hint.source) {
            // A router hint never makes this rank dial a peer outside the
            // allowlist (nor tell it anything about our memory).
            peer.counters.refused_peers += 1;
            return;
        }
        let hashes: HashSet<BlockKey> = hint.block_hashes.iter().copied().collect();
        match peer.target.hints.get_mut(&request) {
            Some(existing) if existing.source != hint.source => existing.failed = true,
            Some(existing) => existing.hashes = hashes,
            None => {
                peer.target.hints.insert(
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
            peer.target.hints.remove(request);
        }
    }

    /// `query` with the request's hint: a miss the hint covers is `Fetchable`.
    pub fn query_request(&self, key: &ScopedKey, request: Option<&RequestId>) -> QueryStatus {
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

    pub(in crate::machine) fn ensure_metadata(&mut self, now: u64, source: &ControlEndpoint) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let retry = peer.config.metadata_retry_ns;
        if peer.target.sources.len() >= MAX_REMEMBERED_PEERS
            && !peer.target.sources.contains_key(source)
        {
            // Router hints name sources; forget those no hint or op uses.
            let TargetRole {
                hints,
                sources,
                ops,
                ..
            } = &mut peer.target;
            sources.retain(|endpoint, _| {
                hints.values().any(|h| &h.source == endpoint)
                    || ops.values().any(|o| &o.source == endpoint)
            });
        }
        let state = peer.target.sources.entry(source.clone()).or_default();
        let due = !state.acked
            && state
                .last_metadata_ns
                .is_none_or(|t| now.saturating_sub(t) >= retry);
        if !due {
            return;
        }
        let resent = state.last_metadata_ns.is_some();
        state.last_metadata_ns = Some(now);
        if resent {
            peer.counters.metadata_resent += 1;
        }
        let worker_address = peer.config.worker_address.clone();
        let shared_memory = peer.config.shared_memory.clone();
        let regions = self.advertised_regions();
        let device_regions = self.advertised_device_regions();
        if let Some(state) = self
            .peer
            .as_mut()
            .and_then(|p| p.target.sources.get_mut(source))
        {
            // In id order, as the adverts are.
            state.device_advertised = device_regions.iter().map(|d| d.id).collect();
        }
        self.send(
            source.clone(),
            Body::TargetMetadata {
                worker_address,
                regions,
                shared_memory,
                // The driver adds its doorbell (a key per session).
                doorbell: None,
                device_regions,
            },
        );
    }

    /// Our connection to `source` closed (or the caller forgot it): whatever
    /// incarnation answered there before may be gone, so the next write to
    /// it waits for a fresh metadata ack and names whoever answers then.
    /// Writes already requested keep the incarnation they named: only that
    /// process can end them.
    pub fn peer_connection_lost(&mut self, source: &ControlEndpoint) {
        if let Some(state) = self
            .peer
            .as_mut()
            .and_then(|p| p.target.sources.get_mut(source))
        {
            state.acked = false;
            state.one_copy = false;
            state.device = false;
            state.incarnation = None;
            state.last_metadata_ns = None;
        }
    }

    /// The runner-owned pool regions, as a target advertises them.
    pub(in crate::machine) fn advertised_regions(&self) -> Vec<RegionAdvert> {
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

    /// Keys of `layout` per remote write: as many as fit in the configured
    /// batch bytes, at least one, at most what one message may carry.
    pub(in crate::machine) fn keys_per_write(&self, layout: u16) -> usize {
        let batch_bytes = self.peer.as_ref().map_or(0, |p| p.config.write_batch_bytes);
        self.keys_in(layout, batch_bytes)
    }

    /// Keys of `layout` per one-hop write ([`PeerConfig::one_hop_write_batch_bytes`],
    /// else as [`Self::keys_per_write`]).
    pub(in crate::machine) fn keys_per_one_hop_write(&self, layout: u16) -> usize {
        let batch_bytes = self.peer.as_ref().map_or(0, |p| {
            p.config
                .one_hop_write_batch_bytes
                .unwrap_or(p.config.write_batch_bytes)
        });
        self.keys_in(layout, batch_bytes)
    }

    /// Keys of `layout` whose pages fit in `batch_bytes` (0: as many as a
    /// message may carry), at least one.
    fn keys_in(&self, layout: u16, batch_bytes: u64) -> usize {
        let key_bytes: u64 = self
            .layouts
            .get(layout as usize)
            .into_iter()
            .flatten()
            .filter_map(|pool| self.pools.get(pool.0 as usize))
            .map(|pool| pool.block_size)
            .sum();
        let keys = if batch_bytes == 0 || key_bytes == 0 {
            MAX_KEYS_PER_WRITE
        } else {
            usize::try_from(batch_bytes / key_bytes).unwrap_or(MAX_KEYS_PER_WRITE)
        };
        keys.clamp(1, MAX_KEYS_PER_WRITE)
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
            // A key named twice (a deliver to two destinations) is filled
            // once: the later entry waits on the fill the first started.
            if let Some(fill) = self
                .index
                .get(key)
                .filter(|e| e.state == Residency::Filling)
                .and_then(|e| self.filling.get(&e.record).copied())
            {
                results.push(Ok(fill));
                continue;
            }
            // A peer's write cannot wait for room: a spill started for it
            // makes room for the next request.
            let Allocation::Slots(slots) = self.allocate(now, layout, protected) else {
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
            self.journal_held(record);
            destinations.push(self.slot_runs(record));
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
            .and_then(|p| p.target.sources.get(&source))
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
            lead_elements: 0,
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
            peer.insert_target_op(
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
                    one_hop: Vec::new(),
                    lead: 0,
                    lead_landed: false,
                    uncertain: false,
                    start,
                },
            );
        }
        results
    }

    /// The source acknowledged our metadata: we now know its incarnation, and
    /// the writes that waited for it go out, naming it.
    pub(in crate::machine) fn on_metadata_ack(
        &mut self,
        now: u64,
        header: &Header,
        one_copy: bool,
        device: bool,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let Some(state) = peer.target.sources.get_mut(&header.sender_endpoint) else {
            peer.counters.refused += 1;
            return;
        };
        // A fresh ack (not a duplicate): a new process at the endpoint, or
        // the same one after an expiry or a lost session.
        let fresh = !state.acked || state.incarnation != Some(header.sender);
        state.acked = true;
        // Only decides whether our worker spins while this source writes: a
        // source that lies slows its own UCX writes into us, nothing else.
        state.one_copy = one_copy && peer.config.shared_memory.is_some();
        // Only decides whether a device deliver grants this source the
        // engine's own elements: it was advertised exactly those regions,
        // and what it writes there is checked before any key succeeds.
        state.device = device
            && peer.config.one_hop
            && peer.config.shared_memory.is_some()
            && !state.device_advertised.is_empty();
        state.incarnation = Some(header.sender);
        let mut ready = Vec::new();
        for (handle, op) in peer.target.ops.iter_mut() {
            if op.state == TargetState::AwaitingAck && op.source == header.sender_endpoint {
                op.state = TargetState::WaitingWriteDone;
                op.source_incarnation = Some(header.sender);
                if let Some(Body::StartWrite {
                    op_handle,
                    remaining_timeout_ms,
                    namespace,
                    keys,
                    destinations,
                    lead_elements,
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
                            lead_elements,
                        },
                    ));
                }
                let _ = handle;
            }
        }
        for (to, body) in ready {
            self.send(to, body);
        }
        if fresh {
            self.reprobe_quarantined(&header.sender_endpoint);
        }
        self.release_route_waits(now, &header.sender_endpoint);
    }
}
