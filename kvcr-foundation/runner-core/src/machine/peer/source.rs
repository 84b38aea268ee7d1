//! The source role: a peer that holds pages writes them into a target's
//! grants. Metadata replies, `start_write` checks against the advertised
//! regions, puts, `write_done`, probes and fences, and death reports for the
//! incarnations of this endpoint a guard confirmed dead.

use std::collections::HashSet;

use super::*;

impl Core {
    pub(in crate::machine) fn refuse(&mut self) {
        if let Some(peer) = self.peer.as_mut() {
            peer.counters.refused += 1;
        }
    }

    pub(in crate::machine) fn on_target_metadata(
        &mut self,
        now: u64,
        header: &Header,
        worker_address: Vec<u8>,
        regions: Vec<RegionAdvert>,
        shared_memory: Option<SharedMemoryAdvert>,
        doorbell: Option<DoorbellAdvert>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let target = header.sender_endpoint.clone();
        let oversized = regions.len() > MAX_ADVERTISED_REGIONS
            || worker_address.len() > MAX_WORKER_ADDRESS_LEN
            || regions.iter().any(|r| r.rkey.len() > MAX_RKEY_LEN);
        if oversized {
            // Nothing of it is kept or handed to UCX, and it is not
            // acknowledged: the target's writes wait and fail by deadline.
            peer.counters.refused += 1;
            return;
        }
        let unchanged = peer.source.routes.get(&target).is_some_and(|r| {
            r.incarnation == header.sender
                && r.their_generation == header.route_generation
                && r.regions.len() == regions.len()
                && regions.iter().all(|a| r.regions.get(&a.id) == Some(a))
                && r.shared_memory == shared_memory
                && r.doorbell == doorbell
        });
        if !unchanged {
            let budget = peer.config.route_budget;
            if !peer.source.admit_route_change(now, &target, &budget) {
                // Not acknowledged and nothing kept: the target re-sends its
                // metadata and is served when its budget allows. Its old
                // route, if any, stays, and names its old incarnation.
                peer.counters.routes_refused += 1;
                return;
            }
            // A new process (or new registrations) at this name: a new route
            // generation, so writes queued for the old one are never submitted.
            let generation = peer.source.next_route_generation;
            peer.source.next_route_generation += 1;
            let rkeys = regions
                .iter()
                .map(|r| (r.id, r.base, r.rkey.clone()))
                .collect();
            // The codec checked that each extent fits (no overflow).
            let extents = regions
                .iter()
                .map(|r| {
                    let last = r.count.saturating_sub(1).saturating_mul(r.stride);
                    (r.id, last.saturating_add(r.element_size))
                })
                .collect();
            peer.source.routes.insert(
                target.clone(),
                Route {
                    incarnation: header.sender,
                    their_generation: header.route_generation,
                    local_generation: generation,
                    regions: regions.into_iter().map(|r| (r.id, r)).collect(),
                    shared_memory: shared_memory.clone(),
                    doorbell: doorbell.clone(),
                    one_copy: None,
                },
            );
            // The ack waits for the driver's connect (`handle_connected`),
            // so it can say whether the writes will land with one copy.
            self.actions.push_back(Action::Connect {
                peer: target.clone(),
                generation,
                worker_address,
                rkeys,
                shared_memory,
                extents,
                doorbell,
            });
            return;
        }
        let one_copy = peer.source.routes.get(&target).and_then(|r| r.one_copy);
        if let Some(one_copy) = one_copy {
            self.send(
                target,
                Body::TargetMetadataAck {
                    op_handle: None,
                    one_copy,
                },
            );
        }
    }

    /// The driver built the route of `generation` to `target`; `one_copy`:
    /// it mapped every shared segment the target advertised. Acknowledges
    /// the metadata.
    pub fn handle_connected(&mut self, target: &ControlEndpoint, generation: u64, one_copy: bool) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let Some(route) = peer
            .source
            .routes
            .get_mut(target)
            .filter(|r| r.local_generation == generation)
        else {
            return; // replaced meanwhile; the newer connect acknowledges
        };
        route.one_copy = Some(one_copy);
        if one_copy {
            peer.counters.one_copy_routes += 1;
        } else {
            peer.counters.ucx_routes += 1;
        }
        self.send(
            target.clone(),
            Body::TargetMetadataAck {
                op_handle: None,
                one_copy,
            },
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::machine) fn on_start_write(
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
            .source
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
        let fenced = peer
            .source
            .fences
            .get(&header.sender)
            .is_some_and(|f| f.contains(&op));
        if !peer.config.may_fetch(&target, namespace) {
            if let Some(peer) = self.peer.as_mut() {
                peer.counters.refused_private += 1;
            }
            self.send(target, failed);
            return;
        }
        if peer.source.writes_by_op.contains_key(&(header.sender, op))
            || peer.source.preparing.contains_key(&(header.sender, op))
        {
            return; // a duplicate of a write in progress: the first one stands
        }
        let stale = peer
            .source
            .high_water
            .get(&header.sender)
            .is_some_and(|high| op <= *high);
        if peer.source.stalled || foreign || fenced || stale {
            self.refuse();
            self.send(target, failed);
            return;
        }
        if let Some(peer) = self.peer.as_mut() {
            peer.source.raise_high_water(header.sender, op);
        }
        let deadline = now
            .saturating_add((u64::from(remaining_ms) * 1_000_000).min(self.operation_timeout_ns));
        // Keys only G3 holds are filled into DRAM first, and keys being
        // filled already (another write's preparation, a deposit) are waited
        // for; the write is served when that ends (by its deadline at the
        // latest).
        let awaited: Vec<(ScopedKey, Awaited)> = keys
            .iter()
            .map(|key| ScopedKey {
                namespace,
                key: *key,
            })
            .filter_map(|k| match self.index.get(&k) {
                Some(IndexEntry {
                    record,
                    state: Residency::Filling,
                }) => Some((k, Awaited::Filling(*record))),
                Some(_) => None,
                None => self
                    .g3_layout(&k)
                    .map(|layout| (k, Awaited::FromG3(layout))),
            })
            .collect();
        if !awaited.is_empty() {
            self.prepare_source_write(
                now,
                PendingSourceWrite {
                    target,
                    target_incarnation: header.sender,
                    op,
                    deadline,
                    namespace,
                    keys: keys.to_vec(),
                    destinations: destinations.to_vec(),
                    pinned: Vec::new(),
                    refused: false,
                },
                awaited,
            );
            return;
        }
        self.source_write(
            target,
            header.sender,
            op,
            deadline,
            namespace,
            keys,
            destinations,
            generation,
            &regions,
        );
    }

    /// Readies the `awaited` keys of the write `pending` in DRAM (an
    /// operation of the runner's own, by the write's deadline), then serves
    /// it. The write's keys READY now are pinned meanwhile, so that room made
    /// for fills (its own or another write's) never moves them away. A write
    /// is served from DRAM: its pages must fit there together (those that do
    /// not are not written, and the target reports them missing).
    fn prepare_source_write(
        &mut self,
        now: u64,
        mut pending: PendingSourceWrite,
        awaited: Vec<(ScopedKey, Awaited)>,
    ) {
        for key in &pending.keys {
            let key = ScopedKey {
                namespace: pending.namespace,
                key: *key,
            };
            if let Some(IndexEntry {
                record,
                state: Residency::Ready,
            }) = self.index.get(&key).copied()
            {
                self.claim_internal(record);
                pending.pinned.push(record);
            }
        }
        let entries = awaited
            .iter()
            .map(|(key, _)| OpEntry {
                key: *key,
                result: None,
                wait: Wait::None,
                destinations: Vec::new(),
            })
            .collect();
        let prep = self.new_op(now, OpKind::SourcePrepare, entries, RegionMemory::Host);
        if let Some(o) = self.ops.get_mut(&prep) {
            self.deadlines.remove(&(o.deadline, prep));
            o.deadline = pending.deadline;
            self.deadlines.insert((pending.deadline, prep));
        }
        if let Some(peer) = self.peer.as_mut() {
            peer.source
                .preparing
                .insert((pending.target_incarnation, pending.op), prep);
        }
        self.source_prepares.insert(prep, pending);
        // The write's other keys stay where they are: making room for the
        // fills must not move away what the write is about to serve.
        let protected: Vec<ScopedKey> = self
            .source_prepares
            .get(&prep)
            .map(|p| {
                p.keys
                    .iter()
                    .map(|key| ScopedKey {
                        namespace: p.namespace,
                        key: *key,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut batch = Vec::new();
        for (entry, (key, awaited)) in awaited.into_iter().enumerate() {
            let entry = entry as u32;
            match awaited {
                Awaited::FromG3(layout) => {
                    if !self.start_g3_fill(now, prep, entry, key, layout, &protected, &mut batch) {
                        self.set_result(prep, entry, EntryResult::failed(FailReason::NoSource));
                    }
                }
                Awaited::Filling(record) => {
                    let fill = self.filling.get(&record).copied().unwrap_or(NIL);
                    self.wait_on_fill(prep, entry, fill);
                }
            }
        }
        self.submit_g3_fills(prep, batch);
        self.finish_if_done(prep);
    }

    /// The preparation `prep` ended: serves its write with what is resident
    /// now (rechecked: a probe, a passed deadline, a stall or a new route
    /// since refuse it), then drops the pins.
    pub(in crate::machine) fn resume_source_write(&mut self, prep: OpHandle) {
        let Some(p) = self.source_prepares.remove(&prep) else {
            return;
        };
        let key = (p.target_incarnation, p.op);
        let route = self.peer.as_mut().and_then(|peer| {
            peer.source.preparing.remove(&key);
            let fenced = peer
                .source
                .fences
                .get(&p.target_incarnation)
                .is_some_and(|f| f.contains(&p.op));
            let route = peer
                .source
                .routes
                .get(&p.target)
                .filter(|r| r.incarnation == p.target_incarnation)
                .map(|r| (r.local_generation, r.regions.clone()));
            if peer.source.stalled || fenced || p.refused {
                None
            } else {
                route
            }
        });
        match route {
            Some((generation, regions)) => self.source_write(
                p.target.clone(),
                p.target_incarnation,
                p.op,
                p.deadline,
                p.namespace,
                &p.keys,
                &p.destinations,
                generation,
                &regions,
            ),
            None => {
                self.refuse();
                self.send(
                    p.target.clone(),
                    Body::WriteDone {
                        op_handle: p.op,
                        outcome: WriteOutcome::Failed { terminal: true },
                    },
                );
            }
        }
        for record in p.pinned {
            self.unclaim(record);
        }
    }

    /// Serves a checked write: puts the READY keys into the granted
    /// elements (or answers that none could be).
    #[allow(clippy::too_many_arguments)]
    fn source_write(
        &mut self,
        target: ControlEndpoint,
        sender: Incarnation,
        op: OpHandle,
        deadline: u64,
        namespace: NamespaceId,
        keys: &[BlockKey],
        destinations: &[Vec<ElementRef>],
        generation: u64,
        regions: &HashMap<RegionId, RegionAdvert>,
    ) {
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
        let write = peer.source.next_write;
        peer.source.next_write += 1;
        peer.source.writes_by_op.insert((sender, op), write);
        peer.source.writes.insert(
            write,
            SourceWrite {
                target: target.clone(),
                target_incarnation: sender,
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

    /// What write `write` will report when its bytes land, if that is the
    /// first `n` keys it was asked for (`0..n`, the only outcome a doorbell
    /// record or a write message carries): the target's op and `n`. `None`
    /// once it was cancelled or ended, or when a key before its last was
    /// left out (those writes are reported by `write_done` alone).
    pub fn peer_write_completion(&self, write: u64) -> Option<(OpHandle, u32)> {
        let w = self.peer.as_ref()?.source.writes.get(&write)?;
        let whole = w
            .indices
            .iter()
            .enumerate()
            .all(|(i, index)| usize::try_from(*index).ok() == Some(i));
        if w.state != WriteState::Writing || !whole {
            return None;
        }
        Some((w.op, u32::try_from(w.indices.len()).ok()?))
    }

    /// The driver's report that a put (and its flush) finished.
    pub fn handle_put_done(&mut self, now: u64, write: u64, ok: bool) {
        self.end_write(now, write, ok, false);
    }

    /// The driver's report that write `write` left as one message carrying
    /// its bytes and its completion (the record
    /// [`Core::peer_write_completion`] gave), sent `ok` or not. The message
    /// is the target's `write_done`: a successful one sends none (a second
    /// could overtake the bytes, which travel another way); a failed or
    /// cancelled one ends as a put would.
    pub fn handle_message_sent(&mut self, now: u64, write: u64, ok: bool) {
        self.end_write(now, write, ok, true);
    }

    fn end_write(&mut self, now: u64, write: u64, ok: bool, completion_sent: bool) {
        let Some(w) = self
            .peer
            .as_mut()
            .and_then(|p| p.source.writes.remove(&write))
        else {
            return;
        };
        if let Some(peer) = self.peer.as_mut() {
            peer.source
                .writes_by_op
                .remove(&(w.target_incarnation, w.op));
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
            (true, WriteState::Writing) if completion_sent => return,
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

    /// The session from `target` closed: its route goes (writes already
    /// accepted keep their own copy of what they need and end as usual); its
    /// fences fold into the high-water mark, which outlives the session.
    pub fn peer_target_gone(&mut self, target: &ControlEndpoint) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        if let Some(route) = peer.source.routes.remove(target)
            && let Some(fenced) = peer.source.fences.remove(&route.incarnation)
            && let Some(highest) = fenced.last()
        {
            peer.source.raise_high_water(route.incarnation, *highest);
        }
    }

    /// The driver built no route from `target`'s metadata (`why`): nothing
    /// of it is kept, and its writes are refused until new metadata
    /// connects.
    pub fn handle_connect_failed(
        &mut self,
        target: &ControlEndpoint,
        generation: u64,
        why: ConnectFailure,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        if peer
            .source
            .routes
            .get(target)
            .is_none_or(|r| r.local_generation != generation)
        {
            return; // replaced meanwhile; the newer connect answers
        }
        peer.source.routes.remove(target);
        match why {
            ConnectFailure::Unusable => peer.counters.refused += 1,
            ConnectFailure::NoMappingsLeft => peer.counters.routes_refused += 1,
        }
        // Acknowledged anyway, so the target's writes are refused at once
        // (there is no route) instead of waiting out their deadline.
        self.send(
            target.clone(),
            Body::TargetMetadataAck {
                op_handle: None,
                one_copy: false,
            },
        );
    }

    /// The incarnations of this endpoint that a guard confirmed dead (it saw
    /// each process exit by its pidfd: none of them can write anyone's
    /// memory again), oldest first, as the guard's grant lists them. A probe
    /// naming one of them is answered `WriteProbeAck { terminal: true,
    /// dead_incarnation: Some(it) }`, which frees the target's slots of
    /// every op it sent to that incarnation.
    ///
    /// Replaces the previous list. Only the latest
    /// [`MAX_DEAD_INCARNATIONS`] are kept; this runner's own incarnation and
    /// repeats are dropped (a live process is never reported dead). Without
    /// the peer protocol enabled ([`Core::enable_peer`] first) it does
    /// nothing.
    pub fn set_dead_incarnations(&mut self, dead: Vec<Incarnation>) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let own = peer.config.incarnation;
        let mut kept: Vec<Incarnation> = Vec::with_capacity(MAX_DEAD_INCARNATIONS);
        // Newest first, so the bound keeps the latest.
        for incarnation in dead.into_iter().rev() {
            if kept.len() == MAX_DEAD_INCARNATIONS {
                break;
            }
            if incarnation != own && !kept.contains(&incarnation) {
                kept.push(incarnation);
            }
        }
        kept.reverse();
        peer.source.dead = kept;
    }

    /// The guard-confirmed dead incarnations this source reports (oldest
    /// first).
    pub fn dead_incarnations(&self) -> &[Incarnation] {
        self.peer.as_ref().map_or(&[], |p| &p.source.dead)
    }

    pub(in crate::machine) fn on_probe(
        &mut self,
        header: &Header,
        op: OpHandle,
        source_incarnation: Option<Incarnation>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        // A probe for an incarnation the guard saw die: that process writes
        // nothing any more, whatever it had started.
        if let Some(dead) = source_incarnation.filter(|i| peer.source.dead.contains(i)) {
            peer.counters.dead_reported += 1;
            self.send(
                header.sender_endpoint.clone(),
                Body::WriteProbeAck {
                    op_handle: op,
                    terminal: true,
                    dead_incarnation: Some(dead),
                },
            );
            return;
        }
        let ours = source_incarnation.is_none_or(|i| i == peer.config.incarnation);
        if ours {
            // Sticky: a start_write that arrives after its probe never writes.
            peer.source.fence(header.sender, op);
            // A write still being prepared has put nothing: it never will.
            if let Some(prep) = peer.source.preparing.get(&(header.sender, op))
                && let Some(p) = self.source_prepares.get_mut(prep)
            {
                p.refused = true;
            }
        }
        let terminal = ours && !peer.source.writes_by_op.contains_key(&(header.sender, op));
        self.send(
            header.sender_endpoint.clone(),
            Body::WriteProbeAck {
                op_handle: op,
                terminal,
                dead_incarnation: None,
            },
        );
    }
}

impl SourceRole {
    /// Whether `target` may change its route at `now` under `budget`
    /// (charging it if so). The remembered targets stay bounded: past
    /// [`MAX_ROUTE_BUDGETS`] those whose budget has refilled (as good as
    /// new) are forgotten, and while none has a new target is refused.
    fn admit_route_change(
        &mut self,
        now: u64,
        target: &ControlEndpoint,
        budget: &RouteBudget,
    ) -> bool {
        let due = self.route_changes_due.get(target).copied();
        if due.is_none() && self.route_changes_due.len() >= MAX_ROUTE_BUDGETS {
            self.route_changes_due.retain(|_, due| *due > now);
            if self.route_changes_due.len() >= MAX_ROUTE_BUDGETS {
                return false;
            }
        }
        match budget.admit(now, due) {
            Some(next) => {
                self.route_changes_due.insert(target.clone(), next);
                true
            }
            None => false,
        }
    }

    /// Records that `op` of `target` was accepted: ops at or below it never
    /// write again, so fences at or below it are redundant and go.
    fn raise_high_water(&mut self, target: Incarnation, op: OpHandle) {
        let high = self.high_water.entry(target).or_insert(op);
        *high = (*high).max(op);
        let high = *high;
        if self.high_water.len() > MAX_REMEMBERED_PEERS {
            // Forget target incarnations with no session: their old frames
            // cannot be replayed into a new session (each has its own keys),
            // and an honest target never re-sends an op on a new session.
            let live: HashSet<Incarnation> = self.routes.values().map(|r| r.incarnation).collect();
            self.high_water
                .retain(|i, _| *i == target || live.contains(i));
            self.fences.retain(|i, _| *i == target || live.contains(i));
        }
        if let Some(fenced) = self.fences.get_mut(&target) {
            *fenced = fenced.split_off(&OpHandle(high.0.saturating_add(1)));
            if fenced.is_empty() {
                self.fences.remove(&target);
            }
        }
    }

    /// Fences `op` of `target`. Past [`MAX_FENCES_PER_TARGET`] the fences fold
    /// into the high-water mark: conservative (a not-yet-arrived lower op is
    /// refused too), and bounded under a probe flood.
    fn fence(&mut self, target: Incarnation, op: OpHandle) {
        if self.high_water.get(&target).is_some_and(|h| op <= *h) {
            return; // already refused by the high-water mark
        }
        let fenced = self.fences.entry(target).or_default();
        fenced.insert(op);
        if fenced.len() > MAX_FENCES_PER_TARGET
            && let Some(highest) = fenced.last().copied()
        {
            self.raise_high_water(target, highest);
        }
    }
}
