//! Waiting for DRAM room: keys of operations parked until spills free
//! slots, resumed when they do or at their deadline.

use super::*;

/// Capacity waiters: parking keys until DRAM room appears, and resuming them.
impl Core {
    /// Puts slots taken for `layout` back at the front of their free lists.
    pub(in crate::machine) fn return_slots(&mut self, layout: u16, slots: Vec<u32>) {
        for (i, slot) in slots.into_iter().enumerate() {
            let pool = self
                .layouts
                .get(layout as usize)
                .and_then(|l| l.get(i))
                .map(|p| p.0 as usize);
            if let Some(p) = pool.and_then(|p| self.pools.get_mut(p)) {
                p.free.push_front(slot);
            }
        }
    }

    /// Sets what entry `entry` of `op` waits on.
    fn set_wait(&mut self, op: OpHandle, entry: u32, wait: Wait) {
        if let Some(e) = self
            .ops
            .get_mut(&op)
            .and_then(|o| o.entries.get_mut(entry as usize))
        {
            e.wait = wait;
        }
    }

    /// Parks entry `entry` of `op` until DRAM room appears.
    pub(in crate::machine) fn wait_for_capacity(
        &mut self,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
        kind: WaiterKind,
    ) {
        self.set_wait(op, entry, Wait::Capacity);
        if let Some(g3) = self.g3.as_mut() {
            g3.counters.capacity_waits += 1;
        }
        self.capacity_waiters.push_back(CapacityWaiter {
            op,
            entry,
            key,
            layout,
            kind,
        });
    }

    /// Drops the waiter of entry `entry` of `op` (it failed or was aborted),
    /// with the G3 claim a waiting fill holds.
    pub(in crate::machine) fn forget_waiter(&mut self, op: OpHandle, entry: u32) {
        let (gone, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.capacity_waiters)
            .into_iter()
            .partition(|w| w.op == op && w.entry == entry);
        self.capacity_waiters = kept;
        for w in gone {
            self.drop_waiter(w);
        }
    }

    /// Lets a waiter go: a waiting G3 fill unclaims the copy it would read.
    fn drop_waiter(&mut self, w: CapacityWaiter) {
        if matches!(w.kind, WaiterKind::G3Fill) {
            self.g3_release(w.key, G3Read::NotRead);
        }
    }

    /// Retries the waiting keys, oldest first, after room may have appeared:
    /// a key now resident is served from DRAM; one that gets slots starts its
    /// copy or G3 fill; the first that must still wait keeps its place and
    /// every later one with it.
    pub(in crate::machine) fn resume_capacity_waiters(&mut self, now: u64) {
        if self.capacity_waiters.is_empty() {
            return;
        }
        let mut copies: BTreeMap<OpHandle, GatheredCopy> = BTreeMap::new();
        let mut g3_batches: BTreeMap<OpHandle, Vec<(u32, Vec<G3Transfer>)>> = BTreeMap::new();
        let mut deliver_next: BTreeMap<OpHandle, Vec<(u32, u32)>> = BTreeMap::new();
        let mut touched = Vec::new();
        while let Some(w) = self.capacity_waiters.pop_front() {
            let live = self
                .ops
                .get(&w.op)
                .and_then(|o| o.entries.get(w.entry as usize))
                .is_some_and(|e| e.result.is_none() && e.wait == Wait::Capacity);
            if !live {
                self.drop_waiter(w);
                continue;
            }
            touched.push(w.op);
            // No longer waiting for room (set back below if it still must).
            self.set_wait(w.op, w.entry, Wait::None);
            if let Some(indexed) = self.index.get(&w.key).copied() {
                // Resident after all: a waiting fill's G3 claim is not needed.
                if matches!(w.kind, WaiterKind::G3Fill) {
                    self.g3_release(w.key, G3Read::NotRead);
                }
                let gone = FailReason::Discarding;
                if let Some(record) = self.settle_indexed((w.op, w.entry), indexed, w.layout, gone)
                {
                    self.fill_committed_for(now, w.op, w.entry, record, &mut deliver_next);
                }
                continue;
            }
            let protected = [w.key];
            match self.allocate(now, w.layout, &protected) {
                Allocation::Pending => {
                    self.set_wait(w.op, w.entry, Wait::Capacity);
                    self.capacity_waiters.push_front(w);
                    break;
                }
                Allocation::Full => {
                    if matches!(w.kind, WaiterKind::G3Fill) {
                        self.g3_release(w.key, G3Read::NotRead);
                    }
                    self.set_result(
                        w.op,
                        w.entry,
                        EntryResult::failed(FailReason::CapacityExhausted),
                    );
                }
                Allocation::Slots(slots) => match w.kind {
                    WaiterKind::Deposit { mut spans, page } => {
                        let record = self.insert_record(now, w.key, w.layout, slots);
                        for (span, slot) in spans.iter_mut().zip(self.slot_spans(record)) {
                            span.dst = slot.src;
                        }
                        let (job, keys, job_spans) = copies
                            .entry(w.op)
                            .or_insert_with(|| (self.reserve_job(), Vec::new(), Vec::new()));
                        let fill = self.new_fill(Fill {
                            record,
                            source: FillSource::Copy {
                                job: *job,
                                key: keys.len() as u32,
                            },
                            waiters: Vec::new(),
                            page,
                        });
                        self.filling.insert(record, fill);
                        keys.push(JobKey::Fill(fill));
                        job_spans.push(spans);
                        self.wait_on_fill(w.op, w.entry, fill);
                    }
                    WaiterKind::G3Fill => {
                        // Claimed while waiting, so still there; but another
                        // reader may have found it unreadable meanwhile.
                        if self.g3_ready(&w.key) {
                            let batch = g3_batches.entry(w.op).or_default();
                            self.begin_g3_fill(now, w.op, w.entry, w.key, w.layout, slots, batch);
                        } else {
                            self.return_slots(w.layout, slots);
                            self.g3_release(w.key, G3Read::NotRead);
                            self.set_result(
                                w.op,
                                w.entry,
                                EntryResult::failed(FailReason::NoSource),
                            );
                        }
                    }
                },
            }
        }
        for (op, (job, keys, spans)) in copies {
            self.submit_job(op, job, keys, spans);
        }
        for (op, batch) in g3_batches {
            self.submit_g3_fills(op, batch);
        }
        for (op, entries) in deliver_next {
            self.start_delivers(now, op, entries);
        }
        for op in touched {
            self.finish_if_done(op);
        }
    }

    /// Per pool, the DRAM slots spills in flight will free, less what the
    /// keys already waiting for room need.
    pub(in crate::machine) fn room_coming(&self) -> Vec<u32> {
        let mut room = vec![0u32; self.pools.len()];
        let Some(g3) = &self.g3 else { return room };
        let pools_of = |layout: u16| self.layouts.get(layout as usize).into_iter().flatten();
        for (key, e) in &g3.entries {
            if e.state != G3State::Storing || !e.moving {
                continue;
            }
            let Some(layout) = self
                .index
                .get(key)
                .and_then(|i| self.record(i.record))
                .map(|r| r.layout)
            else {
                continue;
            };
            for pool in pools_of(layout) {
                if let Some(n) = room.get_mut(pool.0 as usize) {
                    *n += 1;
                }
            }
        }
        for w in &self.capacity_waiters {
            for pool in pools_of(w.layout) {
                if let Some(n) = room.get_mut(pool.0 as usize) {
                    *n = n.saturating_sub(1);
                }
            }
        }
        room
    }
}
