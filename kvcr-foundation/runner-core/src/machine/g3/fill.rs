//! Fills: G3 copies read back into DRAM, or straight into a deliver's
//! memory.

use super::*;

/// Fills from G3: into DRAM slots for fetches, or direct into a deliver's spans.
impl Core {
    /// Starts filling `key` from its READY G3 copy into a new DRAM residency
    /// for entry `entry` of `op` (a fetch or deliver of a key DRAM lacks).
    /// Returns `false` when G3 has no READY copy of it in `layout` (the
    /// caller looks elsewhere).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::machine) fn start_g3_fill(
        &mut self,
        now: u64,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
        protected: &[ScopedKey],
        batch: &mut Vec<(u32, Vec<G3Transfer>)>,
    ) -> bool {
        let matches = self
            .g3
            .as_ref()
            .and_then(|g| g.entries.get(&key))
            .is_some_and(|e| e.state == G3State::Ready && !e.poisoned && e.layout == layout);
        if !matches {
            return false;
        }
        // Claimed first: making DRAM room may spill, and a spill must never
        // evict the G3 copy this fill is about to read.
        if let Some(g3) = self.g3.as_mut() {
            g3.dequeue(key);
            if let Some(e) = g3.entries.get_mut(&key) {
                e.claims += 1;
            }
        }
        // Another reader's fill of this key waits for room already: queue
        // behind it, and share its fill once it has a record (the room
        // coming is that reader's; asking for more would find none and
        // fail a key that is about to be in DRAM).
        let queued = self
            .capacity_waiters
            .iter()
            .any(|w| w.key == key && matches!(w.kind, WaiterKind::G3Fill));
        if queued {
            self.wait_for_capacity(op, entry, key, layout, WaiterKind::G3Fill);
            return true;
        }
        match self.allocate(now, layout, protected) {
            Allocation::Slots(slots) => {
                self.begin_g3_fill(now, op, entry, key, layout, slots, batch)
            }
            Allocation::Pending => {
                self.wait_for_capacity(op, entry, key, layout, WaiterKind::G3Fill)
            }
            Allocation::Full => {
                self.g3_release(key, G3Read::NotRead);
                self.set_result(
                    op,
                    entry,
                    EntryResult::failed(FailReason::CapacityExhausted),
                );
            }
        }
        true
    }

    /// With DRAM slots in hand: the DRAM residency FILLING from the G3 copy
    /// (already claimed by the caller, until the read is terminal).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn begin_g3_fill(
        &mut self,
        now: u64,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
        slots: Vec<u32>,
        batch: &mut Vec<(u32, Vec<G3Transfer>)>,
    ) {
        let Some((g3_slots, page)) = self.g3.as_mut().and_then(|g| {
            let e = g.entries.get(&key)?;
            let found = (e.slots.clone(), e.page.clone());
            g.counters.fills += 1;
            Some(found)
        }) else {
            // The slots go back: nothing reads into them.
            self.return_slots(layout, slots);
            self.set_result(op, entry, EntryResult::failed(FailReason::NoSource));
            return;
        };
        let record = self.insert_record(now, key, layout, slots);
        let dests = self.slot_spans(record);
        if dests.len() != g3_slots.len() {
            self.g3_release(key, G3Read::NotRead);
            self.remove_record(record, "g3 fill without its slots");
            self.set_result(op, entry, EntryResult::failed(FailReason::NoSource));
            return;
        }
        let fill = self.new_fill(Fill {
            record,
            // The job id is set when the batch is submitted.
            source: FillSource::G3 {
                job: JobId(0),
                key: 0,
            },
            waiters: Vec::new(),
            page,
        });
        self.filling.insert(record, fill);
        self.wait_on_fill(op, entry, fill);
        batch.push((
            fill,
            dests
                .iter()
                .zip(g3_slots)
                .map(|(dest, slot)| G3Transfer {
                    slot,
                    addr: dest.src,
                    len: dest.len,
                    direction: G3Direction::Load,
                })
                .collect(),
        ));
    }

    /// For entry `entry` of deliver `op` whose key DRAM lacks: when G3 holds
    /// it READY and its destinations are host spans of a whole slot each,
    /// claims the G3 copy and returns the transfers that read it straight
    /// into them (no DRAM slot, no eviction).
    pub(in crate::machine) fn g3_direct_deliver(
        &mut self,
        op: OpHandle,
        entry: u32,
        key: ScopedKey,
        layout: u16,
    ) -> Option<Vec<G3Transfer>> {
        let g3 = self.g3.as_ref()?;
        let e = g3.entries.get(&key)?;
        if e.state != G3State::Ready || e.poisoned || e.layout != layout {
            return None;
        }
        let o = self.ops.get(&op)?;
        if o.memory != RegionMemory::Host {
            return None;
        }
        // The driver bounces a destination off the files' alignment.
        let dests: Vec<(u64, u64)> = o
            .entries
            .get(entry as usize)?
            .destinations
            .spans(&self.regions)
            .collect::<Option<_>>()?;
        let direct = dests.len() == e.slots.len()
            && dests.iter().all(|(_, len)| *len == g3.config.slot_bytes);
        if !direct {
            return None;
        }
        let transfer: Vec<G3Transfer> = dests
            .iter()
            .zip(&e.slots)
            .map(|(&(addr, len), slot)| G3Transfer {
                slot: *slot,
                addr,
                len,
                direction: G3Direction::Load,
            })
            .collect();
        let g3 = self.g3.as_mut()?;
        g3.dequeue(key);
        if let Some(e) = g3.entries.get_mut(&key) {
            e.claims += 1;
        }
        g3.counters.fills += 1;
        Some(transfer)
    }

    /// Bytes of `key`'s G3 copy (0 when G3 does not hold it).
    pub(in crate::machine) fn g3_bytes(&self, key: &ScopedKey) -> u64 {
        self.g3.as_ref().map_or(0, |g| {
            g.entries
                .get(key)
                .map_or(0, |e| e.slots.len() as u64 * g.config.slot_bytes)
        })
    }

    /// Submits direct G3 delivers of `op` as one job.
    pub(in crate::machine) fn submit_g3_delivers(
        &mut self,
        op: OpHandle,
        batch: Vec<(u32, ScopedKey, Vec<G3Transfer>)>,
    ) {
        if batch.is_empty() {
            return;
        }
        let job = self.reserve_job();
        let mut keys = Vec::with_capacity(batch.len());
        let mut transfers = Vec::with_capacity(batch.len());
        for (i, (entry, key, transfer)) in batch.into_iter().enumerate() {
            if let Some(e) = self
                .ops
                .get_mut(&op)
                .and_then(|o| o.entries.get_mut(entry as usize))
            {
                e.wait = Wait::Copy(job, i as u32);
            }
            keys.push(JobKey::G3Deliver { entry, key });
            transfers.push(transfer);
        }
        self.submit_g3_job(op, job, keys, transfers);
    }

    /// Registers G3 job `job` of caller operation `op` (which then waits for
    /// it) and asks the driver to run it by the operation's deadline.
    fn submit_g3_job(
        &mut self,
        op: OpHandle,
        job: JobId,
        keys: Vec<JobKey>,
        transfers: Vec<Vec<G3Transfer>>,
    ) {
        let deadline_ns = self.ops.get(&op).map_or(0, |o| o.deadline);
        if let Some(o) = self.ops.get_mut(&op) {
            o.jobs += 1;
        }
        let digests = keys.iter().map(|k| self.g3_read_digest(k)).collect();
        self.jobs.insert(job, Job::new(op, keys));
        self.actions.push_back(Action::G3 {
            job,
            deadline_ns,
            transfers,
            digests,
        });
    }

    /// Submits the G3 fills gathered for `op` as one job.
    pub(in crate::machine) fn submit_g3_fills(
        &mut self,
        op: OpHandle,
        batch: Vec<(u32, Vec<G3Transfer>)>,
    ) {
        if batch.is_empty() {
            return;
        }
        let job = self.reserve_job();
        let mut keys = Vec::with_capacity(batch.len());
        let mut transfers = Vec::with_capacity(batch.len());
        for (i, (fill, transfer)) in batch.into_iter().enumerate() {
            if let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::as_mut) {
                f.source = FillSource::G3 { job, key: i as u32 };
            }
            keys.push(JobKey::Fill(fill));
            transfers.push(transfer);
        }
        self.submit_g3_job(op, job, keys, transfers);
    }

    /// The digest a G3 read of `key` (a fill or a direct deliver) must
    /// find, if its page was spilled with one.
    fn g3_read_digest(&self, key: &JobKey) -> Option<u64> {
        let scoped = match *key {
            JobKey::Fill(fill) => {
                let record = self.fills.get(fill as usize)?.as_ref()?.record;
                self.record(record)?.key
            }
            JobKey::G3Deliver { key, .. } => key,
            JobKey::Deliver { .. } | JobKey::Spill { .. } => return None,
        };
        self.g3_entry_digest(&scoped)
    }

    /// The digest G3's copy of `key` was spilled with.
    pub(in crate::machine) fn g3_entry_digest(&self, key: &ScopedKey) -> Option<u64> {
        self.g3.as_ref()?.entries.get(key)?.digest
    }

    /// Counts a G3 read whose bytes did not match its digest.
    pub(in crate::machine) fn count_g3_digest_mismatch(&mut self) {
        if let Some(g3) = self.g3.as_mut() {
            g3.counters.digest_mismatches += 1;
        }
    }
}
