//! The one-hop route, target side: a same-host source's KVCR DRAM straight
//! into the engine's device memory, with no stop in this rank's KVCR DRAM.
//!
//! The driver exports the framework's device regions
//! ([`Core::set_device_export`]); the metadata advertises them only beside
//! shared memory (a same-host offer) and only with [`PeerConfig::one_hop`].
//! A hinted deliver into device memory, for missing keys whose source acked
//! `device` on its current incarnation, then grants that source the deliver
//! entries' own elements: no FILLING record, no DRAM slot. Each entry waits
//! on the target operation ([`Wait::OneHop`]) and the deliver holds one
//! `jobs` count per such operation, so neither the deliver's deadline nor an
//! abort reports it: the engine's elements stay quarantined until the
//! operation's terminal end (a `write_done`, a refusal, a terminal probe
//! answer or a believed death report). A key succeeds only when it ended on
//! time, came with its page digest, and the driver checked the landed bytes
//! against it ([`Core::handle_one_hop_checked`]); otherwise it fails.

use super::*;
use kvcr_contracts::protocol::codec::MAX_DEVICE_EXPORT;

/// Whether every element lies in a region of `advertised` (sorted), each
/// looked for after the last found ([`crate::region::position_after`]).
fn all_advertised(advertised: &[RegionId], elements: &[ElementRef]) -> bool {
    let mut last = None;
    elements.iter().all(|e| {
        last = crate::region::position_after(advertised, e.region, last, |r| *r);
        last.is_some()
    })
}

impl Core {
    /// Framework device regions the driver may export for the one-hop
    /// route: id, base address and extent (bytes to the last element's end).
    pub fn device_regions(&self) -> Vec<(RegionId, u64, u64)> {
        (0..)
            .map(|id| RegionId(id as u32))
            .map_while(|id| self.regions.get(id).ok().map(|r| (id, r)))
            .filter(|(_, r)| r.memory == RegionMemory::Device && r.owner == Owner::Framework)
            .filter_map(|(id, r)| {
                let stride = r.desc.effective_stride();
                let extent = stride
                    .checked_mul(r.desc.count.checked_sub(1)?)?
                    .checked_add(r.desc.size)?;
                Some((id, r.desc.base, extent))
            })
            .collect()
    }

    /// The driver's export name of framework device region `region`
    /// (what its device copier's `export_device` gave for the region's
    /// extent): advertised to same-host sources from the next metadata on.
    /// Refused: not a framework device region, or a name empty or longer
    /// than the wire allows.
    pub fn set_device_export(&mut self, region: RegionId, export: Vec<u8>) -> Result<()> {
        let known = self.regions.get(region)?;
        if known.memory != RegionMemory::Device || known.owner != Owner::Framework {
            return Err(runner_err(RunnerReason::NotFrameworkRegion(region.0)));
        }
        if export.is_empty() || export.len() > MAX_DEVICE_EXPORT {
            return Err(runner_err(RunnerReason::Config {
                field: "device export",
                why: "an export name is 1..=256 bytes",
            }));
        }
        if let Some(peer) = self.peer.as_mut() {
            peer.device_exports.insert(region, export);
        }
        Ok(())
    }

    /// The device regions a target's metadata advertises: those exported,
    /// only with one hop on and shared memory offered, in id order; none
    /// when there are more than a source opens for one target (the wire's
    /// bound too), so every deliver takes two hops rather than some.
    pub(in crate::machine) fn advertised_device_regions(&self) -> Vec<DeviceRegionAdvert> {
        let Some(peer) = self.peer.as_ref() else {
            return Vec::new();
        };
        if !peer.config.one_hop || peer.config.shared_memory.is_none() {
            return Vec::new();
        }
        if peer.device_exports.len() > MAX_ADVERTISED_DEVICE_REGIONS {
            return Vec::new();
        }
        // The exports are keyed by region id: the adverts come in id order.
        peer.device_exports
            .iter()
            .filter_map(|(id, export)| {
                let region = self.regions.get(*id).ok()?;
                Some(DeviceRegionAdvert {
                    id: *id,
                    base: region.desc.base,
                    element_size: region.desc.size,
                    stride: region.desc.effective_stride(),
                    count: region.desc.count,
                    export: export.clone(),
                })
            })
            .collect()
    }

    /// Where one-hop operation `op`'s keys land: per key (in request order),
    /// its device spans (address and length) in layout order. `None` for
    /// any other operation, or once it is no longer awaited. The engine's
    /// elements stay granted until the reply is handled.
    pub fn target_device_landing(&self, op: OpHandle) -> Option<Vec<Vec<(u64, u64)>>> {
        let target_op = self.peer.as_ref()?.target.ops.get(&op)?;
        if target_op.one_hop.is_empty() {
            return None;
        }
        target_op
            .one_hop
            .iter()
            .map(|(deliver, entry)| {
                let e = self.ops.get(deliver)?.entries.get(*entry as usize)?;
                e.destinations.spans(&self.regions).collect()
            })
            .collect()
    }

    /// Whether `key` of a device deliver may go in one hop: its hinted
    /// source acked `device` on its current incarnation, and every
    /// destination is an element of a device region it was advertised.
    fn one_hop_source(
        &self,
        request: Option<&RequestId>,
        key: &ScopedKey,
        elements: &[ElementRef],
    ) -> Option<(ControlEndpoint, Incarnation)> {
        let peer = self.peer.as_ref()?;
        if !peer.config.one_hop {
            return None;
        }
        let source = peer.hinted_source(request, key)?;
        let state = peer.target.sources.get(source)?;
        (state.acked && state.device && all_advertised(&state.device_advertised, elements))
            .then_some((source.clone(), state.incarnation?))
    }

    /// Grants the missing keys of device deliver `op` whose source offers
    /// the one-hop route their own destination elements (`elements`, per
    /// entry), one `start_write` per source, namespace and batch. Returns
    /// the keys left for the two-hop path (counted as fallbacks where a
    /// source was hinted).
    pub(in crate::machine) fn start_one_hop(
        &mut self,
        now: u64,
        op: OpHandle,
        request: Option<&RequestId>,
        layout: u16,
        missing: Vec<(u32, ScopedKey)>,
        elements: &mut [Vec<ElementRef>],
    ) -> Vec<(u32, ScopedKey)> {
        type Group = Vec<(u32, ScopedKey)>;
        let mut by_source: BTreeMap<(ControlEndpoint, NamespaceId), (Incarnation, Group)> =
            BTreeMap::new();
        let mut rest = Vec::new();
        let mut fallbacks = 0;
        for (entry, key) in missing {
            let granted = elements.get(entry as usize).map_or(&[][..], Vec::as_slice);
            match self.one_hop_source(request, &key, granted) {
                Some((source, incarnation)) => by_source
                    .entry((source, key.namespace))
                    .or_insert_with(|| (incarnation, Vec::new()))
                    .1
                    .push((entry, key)),
                None => {
                    let hinted = self
                        .peer
                        .as_ref()
                        .and_then(|p| p.hinted_source(request, &key))
                        .cloned();
                    if let Some(source) = hinted.as_ref().filter(|s| self.route_pending(s)) {
                        let source = source.clone();
                        let granted = elements
                            .get_mut(entry as usize)
                            .map(std::mem::take)
                            .unwrap_or_default();
                        self.wait_for_route(op, entry, key, layout, request, source, granted);
                        continue;
                    }
                    fallbacks += u64::from(hinted.is_some());
                    rest.push((entry, key));
                }
            }
        }
        if let Some(peer) = self.peer.as_mut() {
            peer.counters.one_hop_fallbacks += fallbacks;
        }
        let per_batch = self.keys_per_one_hop_write(layout);
        for ((source, namespace), (incarnation, entries)) in by_source {
            for batch in entries.chunks(per_batch) {
                self.send_one_hop(
                    now,
                    op,
                    request,
                    (&source, incarnation),
                    namespace,
                    batch,
                    {
                        batch
                            .iter()
                            .map(|(entry, _)| elements.get_mut(*entry as usize).map(std::mem::take))
                            .collect::<Option<Vec<_>>>()
                            .unwrap_or_default()
                    },
                );
            }
        }
        rest
    }

    /// Whether `source`'s route is still being set up (our metadata went
    /// out, no ack yet) while we offer the one-hop route: its ack decides.
    fn route_pending(&self, source: &ControlEndpoint) -> bool {
        let Some(peer) = self.peer.as_ref() else {
            return false;
        };
        peer.target.sources.get(source).is_some_and(|s| !s.acked)
            && !self.advertised_device_regions().is_empty()
    }

    /// Holds entry `entry` of device deliver `op` until `source` acks.
    #[allow(clippy::too_many_arguments)]
    fn wait_for_route(
        &mut self,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
        request: Option<&RequestId>,
        source: ControlEndpoint,
        elements: Vec<ElementRef>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        peer.target.route_waits.push(RouteWait {
            deliver: op,
            entry,
            key,
            layout,
            request: request.cloned(),
            source,
            elements,
        });
        if let Some(e) = self
            .ops
            .get_mut(&op)
            .and_then(|o| o.entries.get_mut(entry as usize))
        {
            e.wait = Wait::Route;
        }
    }

    /// Forgets a held entry (its deliver failed it: a deadline or abort).
    pub(in crate::machine) fn forget_route_wait(&mut self, op: OpHandle, entry: u32) {
        if let Some(peer) = self.peer.as_mut() {
            peer.target
                .route_waits
                .retain(|w| (w.deliver, w.entry) != (op, entry));
        }
    }

    /// `source` acknowledged our metadata: the entries held for its route
    /// go on, in one hop where it now offers it, else through KVCR DRAM.
    pub(in crate::machine) fn release_route_waits(&mut self, now: u64, source: &ControlEndpoint) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let (due, kept): (Vec<RouteWait>, Vec<RouteWait>) =
            std::mem::take(&mut peer.target.route_waits)
                .into_iter()
                .partition(|w| &w.source == source);
        peer.target.route_waits = kept;
        // Per deliver, layout and request, in entry order.
        let mut groups: BTreeMap<(OpHandle, u16), (Option<RequestId>, Vec<RouteWait>)> =
            BTreeMap::new();
        for wait in due {
            let still_held = self
                .ops
                .get(&wait.deliver)
                .and_then(|o| o.entries.get(wait.entry as usize))
                .is_some_and(|e| e.result.is_none() && e.wait == Wait::Route);
            if still_held {
                groups
                    .entry((wait.deliver, wait.layout))
                    .or_insert_with(|| (wait.request.clone(), Vec::new()))
                    .1
                    .push(wait);
            }
        }
        for ((deliver, layout), (request, waits)) in groups {
            let width = waits
                .iter()
                .map(|w| w.entry as usize + 1)
                .max()
                .unwrap_or(0);
            let mut elements = vec![Vec::new(); width];
            let mut missing = Vec::with_capacity(waits.len());
            let mut ready = Vec::new();
            for wait in waits {
                if let Some(e) = self
                    .ops
                    .get_mut(&deliver)
                    .and_then(|o| o.entries.get_mut(wait.entry as usize))
                {
                    e.wait = Wait::None;
                }
                // Another operation may have brought the key meanwhile:
                // it is served as `deliver` serves a key it finds.
                match self.index.get(&wait.key).copied() {
                    None => {
                        if let Some(slot) = elements.get_mut(wait.entry as usize) {
                            *slot = wait.elements;
                        }
                        missing.push((wait.entry, wait.key));
                    }
                    Some(indexed) => {
                        let gone = FailReason::NoSource;
                        if let Some(record) =
                            self.settle_indexed((deliver, wait.entry), indexed, layout, gone)
                        {
                            ready.push((wait.entry, record));
                        }
                    }
                }
            }
            let protected: Vec<ScopedKey> = missing.iter().map(|(_, k)| *k).collect();
            let rest = self.start_one_hop(
                now,
                deliver,
                request.as_ref(),
                layout,
                missing,
                &mut elements,
            );
            self.start_remote(now, deliver, request.as_ref(), layout, rest, &protected);
            self.start_delivers(now, deliver, ready);
            self.finish_if_done(deliver);
        }
    }

    /// One one-hop `start_write` for `batch` (entries of deliver `op`),
    /// named to the source's acknowledged incarnation.
    #[allow(clippy::too_many_arguments)]
    fn send_one_hop(
        &mut self,
        now: u64,
        op: OpHandle,
        request: Option<&RequestId>,
        (source, incarnation): (&ControlEndpoint, Incarnation),
        namespace: NamespaceId,
        batch: &[(u32, ScopedKey)],
        destinations: Vec<Vec<ElementRef>>,
    ) {
        if destinations.len() != batch.len() {
            return;
        }
        let timeout = self.operation_timeout_ns;
        let Some(abandon) = self.peer.as_ref().map(|p| p.config.abandon_timeout_ns) else {
            return;
        };
        let target_op = OpHandle(self.next_op);
        self.next_op += 1;
        if let Some(o) = self.ops.get_mut(&op) {
            // Held until the operation's terminal end, whatever else ends.
            o.jobs += 1;
            for (entry, _) in batch {
                if let Some(e) = o.entries.get_mut(*entry as usize) {
                    e.wait = Wait::OneHop(target_op);
                }
            }
        }
        let remaining_ms = u32::try_from(timeout / 1_000_000)
            .unwrap_or(u32::MAX)
            .max(1);
        // Asked only where every key has that many elements (the wire
        // refuses more).
        let lead = self.lead_within(destinations.iter().map(Vec::len));
        // Sent as runs: a layer-first page's elements are one.
        let destinations = destinations
            .iter()
            .map(|elements| ElementRuns::from_elements(elements))
            .collect();
        self.send(
            source.clone(),
            Body::StartWrite {
                op_handle: target_op,
                remaining_timeout_ms: remaining_ms,
                source_incarnation: Some(incarnation),
                namespace,
                keys: batch.iter().map(|(_, k)| k.key).collect(),
                destinations,
                lead_elements: lead,
            },
        );
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        peer.counters.writes_requested += 1;
        peer.counters.one_hop_writes += 1;
        peer.insert_target_op(
            target_op,
            TargetOp {
                source: source.clone(),
                source_incarnation: Some(incarnation),
                request: request.cloned(),
                state: TargetState::WaitingWriteDone,
                deadline: now.saturating_add(timeout),
                abandon_deadline: now.saturating_add(abandon),
                keys: batch.iter().map(|(_, k)| *k).collect(),
                fills: Vec::new(),
                one_hop: batch.iter().map(|(entry, _)| (op, *entry)).collect(),
                lead,
                lead_landed: false,
                uncertain: false,
                start: None,
            },
        );
    }

    /// One-hop operation `op`'s source says the write's lead elements have
    /// landed for every key. Heard once, from that operation's own source
    /// and incarnation while it is awaited, and only for the count it was
    /// asked; anything else is refused. Each deliver it serves is then
    /// reported if it has become ready to start (`Core::note_lead`).
    pub(super) fn on_lead_landed(&mut self, header: &Header, op: OpHandle, elements: u16) {
        let Some(target_op) = self.peer.as_mut().and_then(|p| p.target.ops.get_mut(&op)) else {
            self.refuse(); // unknown op handle, or one that ended
            return;
        };
        let expected = target_op.source == header.sender_endpoint
            && target_op.source_incarnation == Some(header.sender)
            && target_op.state == TargetState::WaitingWriteDone
            && target_op.lead != 0
            && target_op.lead == elements
            && !target_op.lead_landed;
        if !expected {
            self.refuse();
            return;
        }
        target_op.lead_landed = true;
        let delivers: BTreeSet<OpHandle> = target_op.one_hop.iter().map(|(d, _)| *d).collect();
        for deliver in delivers {
            self.note_lead(deliver);
        }
    }

    /// Whether one-hop operation `op`'s source said its lead landed.
    pub(in crate::machine) fn one_hop_lead_landed(&self, op: OpHandle) -> bool {
        self.peer
            .as_ref()
            .and_then(|p| p.target.ops.get(&op))
            .is_some_and(|t| t.lead_landed)
    }

    /// Ends one-hop operation `op` (already removed from the target's
    /// operations) with terminal knowledge: a key succeeds only when the
    /// write ended on time, the key is among `completed` with its digest,
    /// and the driver checked the landed bytes against it (`checked`) and
    /// found them equal; every other key fails. The deliver entries are
    /// resolved and the deliver released to finish.
    pub(super) fn finish_one_hop(&mut self, op: OpHandle, ended: TargetEnd, failure: FailReason) {
        let TargetEnd {
            target_op,
            on_time,
            checked,
            completed,
            digests,
            mismatched,
        } = ended;
        let mut landed_keys = 0;
        let mut missing = Vec::new();
        let mut delivers = BTreeSet::new();
        for (i, ((deliver, entry), key)) in
            target_op.one_hop.iter().zip(&target_op.keys).enumerate()
        {
            let index = i as u32;
            let altered = on_time && mismatched.contains(&index);
            let landed = on_time
                && checked
                && !altered
                && completed.contains(&index)
                && digests.contains_key(&index);
            let result = if landed {
                landed_keys += 1;
                EntryResult::success(None, Vec::new())
            } else if altered {
                EntryResult::failed(FailReason::DigestMismatch)
            } else if on_time {
                missing.push(key.key);
                EntryResult::failed(failure)
            } else {
                EntryResult::failed(FailReason::Timeout)
            };
            self.set_result(*deliver, *entry, result);
            if let Some(e) = self
                .ops
                .get_mut(deliver)
                .and_then(|o| o.entries.get_mut(*entry as usize))
            {
                e.wait = Wait::None;
            }
            delivers.insert(*deliver);
            if altered && let Some(peer) = self.peer.as_mut() {
                peer.counters.digest_mismatches += 1;
            }
        }
        for deliver in &delivers {
            if let Some(o) = self.ops.get_mut(deliver) {
                o.jobs = o.jobs.saturating_sub(1);
            }
        }
        if let Some(peer) = self.peer.as_mut() {
            peer.counters.one_hop_pages += landed_keys;
        }
        self.note_target_end(op, &target_op, landed_keys, missing);
        for deliver in delivers {
            self.finish_if_done(deliver);
        }
    }
}

/// What a target operation's end knows, handed to [`Core::finish_one_hop`].
pub(super) struct TargetEnd {
    pub(super) target_op: TargetOp,
    /// It ended while still awaited (before its deadline).
    pub(super) on_time: bool,
    /// The driver checked the landed bytes of this `write_done`.
    pub(super) checked: bool,
    /// Indices the source reported landed.
    pub(super) completed: std::collections::HashSet<u32>,
    /// The source's page digest per landed index.
    pub(super) digests: HashMap<u32, u64>,
    /// Indices whose landed bytes the driver found altered.
    pub(super) mismatched: std::collections::HashSet<u32>,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The guided search answers as a search per element would,
        /// whatever the order the elements name their regions in.
        #[test]
        fn all_advertised_is_a_search_per_element(
            advertised in prop::collection::btree_set(0u32..16, 0..8),
            named in prop::collection::vec(0u32..16, 0..12),
        ) {
            let advertised: Vec<RegionId> = advertised.into_iter().map(RegionId).collect();
            let elements: Vec<ElementRef> = named
                .iter()
                .map(|&r| ElementRef { region: RegionId(r), index: 0 })
                .collect();
            let expected = elements.iter().all(|e| advertised.contains(&e.region));
            prop_assert_eq!(all_advertised(&advertised, &elements), expected);
        }
    }
}
