//! The block index's records (residency transitions, slots, bytes) and claims.

use std::collections::HashSet;

use super::*;
use crate::types::ClaimedCopy;

impl Core {
    pub(in crate::machine) fn record(&self, idx: u32) -> Option<&Record> {
        self.records
            .get(idx as usize)
            .filter(|r| r.state != Residency::Vacant)
    }

    pub(in crate::machine) fn record_mut(&mut self, idx: u32) -> Option<&mut Record> {
        self.records
            .get_mut(idx as usize)
            .filter(|r| r.state != Residency::Vacant)
    }

    pub(in crate::machine) fn insert_record(
        &mut self,
        now: u64,
        key: ScopedKey,
        layout: u16,
        slot_vec: Vec<u32>,
    ) -> u32 {
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
        self.set_record_digest(idx, None);
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
    pub(in crate::machine) fn slot(&self, idx: u32, i: usize) -> Option<u32> {
        self.slots(idx)?.as_slice().get(i).copied()
    }

    /// A record's slots in layout order, found once: a record of many
    /// slots (a layer-first page: 128) is one map lookup, not one per
    /// slot (that was most of a one-hop write's check at the source).
    fn slots(&self, idx: u32) -> Option<Slots<'_>> {
        Some(match self.record(idx)?.slots {
            SlotList::One(a) => Slots::Inline([a, 0], 1),
            SlotList::Two(a, b) => Slots::Inline([a, b], 2),
            SlotList::Many => Slots::Many(self.many_slots.get(&idx)?),
        })
    }

    /// All slots of a record, in layout order.
    pub(in crate::machine) fn slot_vec(&self, idx: u32) -> Vec<u32> {
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

    /// Adds (or takes) a record's slots to (from) the evictable count of
    /// each pool in its layout, once per pool (`layout_pool_counts`), not
    /// once per span.
    pub(in crate::machine) fn adjust_evictable(&mut self, idx: u32, add: bool) {
        let Some(layout) = self.record(idx).map(|r| r.layout as usize) else {
            return;
        };
        let Some(counts) = self.layout_pool_counts.get(layout) else {
            return;
        };
        for &(pool, n) in counts {
            if let Some(p) = self.pools.get_mut(pool.0 as usize) {
                p.evictable = if add {
                    p.evictable + n
                } else {
                    p.evictable.saturating_sub(n)
                };
            }
        }
    }

    /// Moves a record to a new state, keeping the index in step. In debug
    /// builds an illegal transition aborts with the key and the call site.
    pub(in crate::machine) fn transition(&mut self, idx: u32, to: Residency, site: &'static str) {
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
    pub(in crate::machine) fn remove_record(&mut self, idx: u32, site: &'static str) {
        if let Some(stored) = self.free_record(idx, site) {
            self.publish_removed(&[stored]);
        }
    }

    /// Returns a record's slots to their pools and frees the record. Returns
    /// its key if it was READY (stored), so the caller publishes `Removed`
    /// exactly once (alone, or batched with other victims).
    pub(in crate::machine) fn free_record(
        &mut self,
        idx: u32,
        site: &'static str,
    ) -> Option<ScopedKey> {
        self.journal_freeing(idx);
        let r = self.record(idx)?;
        let stored = (r.state == Residency::Ready).then_some(r.key);
        let layout = r.layout as usize;
        let slots = self.slot_vec(idx);
        self.many_slots.remove(&idx);
        self.filling.remove(&idx);
        self.page_info.remove(&idx);
        self.recovered_pages.remove(&idx);
        self.set_record_digest(idx, None);
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

    pub(in crate::machine) fn record_bytes(&self, idx: u32) -> u64 {
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
    pub(in crate::machine) fn slot_spans(&self, idx: u32) -> Vec<CopySpan> {
        let mut spans = Vec::with_capacity(self.layout_len(idx));
        self.slot_spans_into(idx, &mut spans);
        spans
    }

    /// [`Self::slot_spans`] into `spans`, emptied first: a write of many
    /// keys reuses one buffer (a layer-first page's 128 spans were an
    /// allocation and a free per key of each `start_write`).
    pub(in crate::machine) fn slot_spans_into(&self, idx: u32, spans: &mut Vec<CopySpan>) {
        spans.clear();
        self.for_each_slot_ref(idx, |element| {
            if let Ok(span) = self.regions.resolve(element) {
                spans.push(CopySpan {
                    src: span.addr,
                    dst: 0,
                    len: span.len,
                });
            }
        });
    }

    /// How many spans [`Self::slot_spans`] gives, without building them.
    pub(in crate::machine) fn slot_span_count(&self, idx: u32) -> usize {
        let mut count = 0;
        self.for_each_slot_ref(idx, |element| {
            count += usize::from(self.regions.resolve(element).is_ok());
        });
        count
    }

    /// The record's slots as references into the runner-owned pool regions.
    pub(in crate::machine) fn slot_refs(&self, idx: u32) -> Vec<ElementRef> {
        let mut refs = Vec::with_capacity(self.layout_len(idx));
        self.for_each_slot_ref(idx, |element| refs.push(element));
        refs
    }

    /// [`Self::slot_refs`] as runs, as a `start_write` names them.
    pub(in crate::machine) fn slot_runs(&self, idx: u32) -> ElementRuns {
        let mut runs = ElementRuns::new();
        self.for_each_slot_ref(idx, |element| runs.push(element));
        runs
    }

    /// Spans in the record's layout.
    fn layout_len(&self, idx: u32) -> usize {
        self.record(idx)
            .and_then(|r| self.layouts.get(r.layout as usize))
            .map_or(0, Vec::len)
    }

    /// Calls `each` with the record's slots as references into the
    /// runner-owned pool regions, in layout order (a slot whose pool is
    /// unknown, or missing, is left out).
    fn for_each_slot_ref(&self, idx: u32, mut each: impl FnMut(ElementRef)) {
        let Some(r) = self.record(idx) else {
            return;
        };
        let (Some(pools), Some(slots)) = (self.layouts.get(r.layout as usize), self.slots(idx))
        else {
            return;
        };
        for (pool, slot) in pools.iter().zip(slots.as_slice()) {
            if let Some(pool) = self.pools.get(pool.0 as usize) {
                each(ElementRef {
                    region: pool.region,
                    index: u64::from(*slot),
                });
            }
        }
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

    pub(in crate::machine) fn touch(&mut self, now: u64, idx: u32) {
        if let Some(r) = self.record_mut(idx) {
            r.access_count = r.access_count.saturating_add(1);
            r.last_access = now;
        }
    }

    // ------------------------------------------------------------ claims

    pub(in crate::machine) fn claim_public(&mut self, idx: u32) -> ReleaseHandle {
        self.claim_internal(idx);
        let handle = ReleaseHandle(self.next_claim);
        self.next_claim += 1;
        self.claims.insert(handle, idx);
        handle
    }

    pub(in crate::machine) fn claim_internal(&mut self, idx: u32) {
        self.dequeue(idx);
        if let Some(r) = self.record_mut(idx) {
            r.claims += 1;
        }
    }

    pub(in crate::machine) fn unclaim(&mut self, idx: u32) {
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

    /// Validates `copies` out of the slots `handles` hold into framework host
    /// elements, and pins those records (an internal claim each) so their
    /// bytes stay put while the caller copies without the core's lock. Returns
    /// the copies as spans and the records to [`unpin`](Self::unpin).
    ///
    /// Refused whole, with nothing pinned, when a handle is not a live claim,
    /// a run is empty or leaves the slots the handles hold, or a destination
    /// is not framework host memory, leaves its region, or spans elements of
    /// a strided region.
    pub fn pin_claimed_copy(
        &mut self,
        handles: &[ReleaseHandle],
        copies: &[ClaimedCopy],
    ) -> Result<(Vec<CopySpan>, Vec<u32>)> {
        let refused = |why| Error::runner(RunnerReason::ClaimedCopy(why));
        let mut records = Vec::with_capacity(handles.len());
        let mut held: HashSet<ElementRef> = HashSet::new();
        for handle in handles {
            let record = self
                .claim_record(*handle)
                .ok_or(Error::runner(RunnerReason::UnknownClaim(handle.0)))?;
            held.extend(self.slot_refs(record));
            records.push(record);
        }
        let mut spans = Vec::with_capacity(copies.len());
        for copy in copies {
            let src = self.regions.get(copy.src.region)?;
            let dst = self.regions.get(copy.dst.region)?;
            if copy.len == 0 {
                return Err(refused("an empty run"));
            }
            if dst.owner != Owner::Framework {
                return Err(Error::runner(RunnerReason::NotFrameworkRegion(
                    copy.dst.region.0,
                )));
            }
            if dst.memory != RegionMemory::Host {
                return Err(refused("the destination is not host memory"));
            }
            let elements = |size: u64| copy.len.div_ceil(size.max(1));
            let src_elements = elements(src.desc.size);
            let covered = (0..src_elements).all(|i| {
                copy.src.index.checked_add(i).is_some_and(|index| {
                    held.contains(&ElementRef {
                        region: copy.src.region,
                        index,
                    })
                })
            });
            if !covered || (src_elements > 1 && src.desc.effective_stride() != src.desc.size) {
                return Err(refused("a run leaves the slots its claims hold"));
            }
            let dst_elements = elements(dst.desc.size);
            if dst_elements > 1 && dst.desc.effective_stride() != dst.desc.size {
                return Err(refused("a run spans elements of a strided region"));
            }
            let dst_in_region = copy
                .dst
                .index
                .checked_add(dst_elements)
                .is_some_and(|end| end <= dst.desc.count);
            if !dst_in_region {
                return Err(refused("a run leaves its destination region"));
            }
            spans.push(CopySpan {
                src: self.regions.resolve(copy.src)?.addr,
                dst: self.regions.resolve(copy.dst)?.addr,
                len: copy.len,
            });
        }
        for &record in &records {
            self.claim_internal(record);
        }
        Ok((spans, records))
    }

    /// Undoes [`pin_claimed_copy`](Self::pin_claimed_copy)'s pins.
    pub fn unpin(&mut self, records: &[u32]) {
        for &record in records {
            self.unclaim(record);
        }
        self.check_pressure();
    }
}

/// A record's slots, borrowed: inline ones copied out, many ones in place.
enum Slots<'a> {
    Inline([u32; 2], usize),
    Many(&'a [u32]),
}

impl Slots<'_> {
    fn as_slice(&self) -> &[u32] {
        match self {
            Slots::Inline(slots, n) => slots.get(..*n).unwrap_or_default(),
            Slots::Many(slots) => slots,
        }
    }
}
