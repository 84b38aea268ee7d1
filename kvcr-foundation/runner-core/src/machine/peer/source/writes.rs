//! The source role's writes: a `start_write` checked against the route,
//! fences and high-water mark, its G3-only or still-filling keys readied in
//! DRAM first, then its READY keys put into the granted elements.

use std::collections::HashSet;

use super::device::Grants;
use super::*;
use std::sync::Arc;

impl Core {
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
        destinations: &[ElementRuns],
        lead: u16,
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
        let regions = Arc::clone(&route.regions);
        let device_regions = route.device_regions_opened();
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
            if peer.source.stalled
                && let Some(peer) = self.peer.as_mut()
            {
                // The refusal frees the target's slots: a copy of this
                // request (or an older one) arriving after the stall is
                // over must find it refused already, not be served.
                peer.source.raise_high_water(header.sender, op);
            }
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
                    lead,
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
            (keys, destinations, lead),
            generation,
            &Grants {
                regions: &regions,
                device: device_regions.as_deref(),
            },
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
                destinations: Destinations::default(),
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
                .map(|r| {
                    (
                        r.local_generation,
                        Arc::clone(&r.regions),
                        r.device_regions_opened(),
                    )
                });
            if peer.source.stalled || fenced || p.refused {
                None
            } else {
                route
            }
        });
        match route {
            Some((generation, regions, device)) => self.source_write(
                p.target.clone(),
                p.target_incarnation,
                p.op,
                p.deadline,
                p.namespace,
                (&p.keys, &p.destinations, p.lead),
                generation,
                &Grants {
                    regions: &regions,
                    device: device.as_deref(),
                },
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
        (keys, destinations, lead): (&[BlockKey], &[ElementRuns], u16),
        generation: u64,
        grants: &Grants<'_>,
    ) {
        let regions = grants.regions;
        let device_write = grants.device_write(destinations);
        let device = device_write.is_some();
        // Only a one-hop write reports its lead: through KVCR DRAM the
        // bytes are checked and moved on by the target itself.
        let lead = if device { lead } else { 0 };
        // Elements named twice are looked for key by key only in a write
        // that has any (a hostile or broken target's): the common write is
        // checked once, by sorting, not hashed element by element.
        let mut seen = (device && device::names_an_element_twice(destinations)).then(HashSet::new);
        // One put per element where slots and elements are cut alike (a
        // grown vector was a third of a one-hop write's check, profiled).
        let mut puts = Vec::with_capacity(destinations.iter().map(ElementRuns::len).sum());
        let mut records = Vec::new();
        let mut indices = Vec::new();
        let mut page_spans = Vec::new();
        let mut bytes = 0;
        let mut bad_elements = 0u64;
        // Each key's slots, in one buffer for the whole write.
        let mut sources = Vec::new();
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
            self.slot_spans_into(record, &mut sources);
            if let Some(device_regions) = device_write {
                let before = puts.len();
                match device::device_puts(&sources, dests, device_regions, seen.as_mut(), &mut puts)
                {
                    Some(page) => {
                        // At most a page's slots times its elements, both
                        // bounded far below `u32::MAX`.
                        page_spans.push(u32::try_from(puts.len() - before).unwrap_or(u32::MAX));
                        bytes += page;
                        records.push(record);
                        indices.push(i as u32);
                    }
                    None => bad_elements += 1,
                }
                continue;
            }
            if sources.len() != dests.len() {
                continue;
            }
            let mut key_puts = Vec::with_capacity(dests.len());
            for (src, dst) in sources.iter().zip(dests.iter()) {
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
        // The lead report speaks for every key of the request: a write
        // that leaves some out (not held, a bad grant) says nothing early.
        let lead = if indices.len() == keys.len() { lead } else { 0 };
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let write = peer.source.next_write;
        peer.source.next_write += 1;
        peer.source.writes_by_op.insert((sender, op), write);
        peer.insert_source_write(
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
                device,
                lead,
            },
        );
        self.actions.push_back(Action::Put {
            write,
            target,
            generation,
            spans: puts,
            page_spans,
            device,
            lead_elements: lead,
        });
    }
}

/// An element of a target region, bounds-checked against its advertisement.
fn remote_address(region: &RegionAdvert, index: u64) -> Option<u64> {
    if index >= region.count {
        return None;
    }
    region.base.checked_add(index.checked_mul(region.stride)?)
}
