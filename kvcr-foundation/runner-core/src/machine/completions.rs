//! Completions: deadlines, copy outcomes, shared fills, per-key results and finished operations.

use super::*;

impl Core {
    /// Expires deadlines: keys still waiting on shared work fail with
    /// `Timeout`. Keys whose own copy is in flight wait for it (the copy engine
    /// skips it if it has not started by the deadline).
    pub fn handle_timeout(&mut self, now: u64) {
        self.handle_peer_timeout(now);
        while let Some(&(deadline, op)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            let Some(o) = self.ops.get(&op) else { continue };
            // (Entries waiting for room detach from the waiter queue below;
            // those waiting for a route's ack were granted nothing.)
            let waiting: Vec<u32> = o
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| {
                    e.result.is_none()
                        && matches!(e.wait, Wait::Fill(_) | Wait::Capacity | Wait::Route)
                })
                .map(|(i, _)| i as u32)
                .collect();
            for entry in waiting {
                let own_fill = self.entry_owns_fill(op, entry);
                if !own_fill {
                    self.fail_waiting_entry(op, entry, FailReason::Timeout);
                }
            }
            // A peer's write being prepared is past its deadline: refused,
            // not served, when its preparation ends (now or with its fills).
            if let Some(p) = self.source_prepares.get_mut(&op) {
                p.refused = true;
            }
            self.finish_if_done(op);
        }
        self.resume_capacity_waiters(now);
        self.check_pressure();
    }

    /// Whether entry `entry` of `op` waits on a fill whose copy `op` itself runs.
    pub(in crate::machine) fn entry_owns_fill(&self, op: OpHandle, entry: u32) -> bool {
        let Some(Wait::Fill(fill)) = self
            .ops
            .get(&op)
            .and_then(|o| o.entries.get(entry as usize))
            .map(|e| e.wait)
        else {
            return false;
        };
        match self
            .fills
            .get(fill as usize)
            .and_then(Option::as_ref)
            .map(|f| f.source)
        {
            Some(FillSource::Copy { job, .. } | FillSource::G3 { job, .. }) => {
                self.jobs.get(&job).is_some_and(|j| j.op == op)
            }
            _ => false,
        }
    }

    /// The earliest pending deadline.
    pub fn next_deadline(&self) -> Option<u64> {
        let ops = self.deadlines.first().map(|(d, _)| *d);
        match (ops, self.next_peer_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Feeds back a finished copy job.
    pub fn handle_copy_done(&mut self, now: u64, job: JobId, outcomes: &[CopyOutcome]) {
        self.handle_copy_done_digested(now, job, outcomes, &[]);
    }

    /// As [`Core::handle_copy_done`], with the page digest the driver took
    /// of each copied key (by position; `None` or missing: none taken).
    pub fn handle_copy_done_digested(
        &mut self,
        now: u64,
        job: JobId,
        outcomes: &[CopyOutcome],
        digests: &[Option<u64>],
    ) {
        let Some(Job { op, keys, .. }) = self.jobs.remove(&job) else {
            return;
        };
        let mut stored: Vec<(u32, Option<PageInfo>)> = Vec::new();
        let mut deliver_next: BTreeMap<OpHandle, Vec<(u32, u32)>> = BTreeMap::new();
        for (i, key) in keys.iter().enumerate() {
            let outcome = outcomes.get(i).copied().unwrap_or(CopyOutcome::Cancelled);
            match *key {
                JobKey::Fill(fill) => {
                    let result = match outcome {
                        CopyOutcome::Copied => Ok(()),
                        CopyOutcome::DeadlinePassed => Err(FailReason::Timeout),
                        CopyOutcome::Cancelled => Err(FailReason::Aborted),
                        CopyOutcome::Failed => Err(FailReason::CopyFailed),
                        CopyOutcome::Altered => Err(FailReason::DigestMismatch),
                    };
                    let digest = digests.get(i).copied().flatten().or_else(|| {
                        // A page filled from G3 keeps the digest it was
                        // spilled with (its bytes were checked against it).
                        let f = self.fills.get(fill as usize)?.as_ref()?;
                        let g3 = matches!(f.source, FillSource::G3 { .. });
                        let key = self.record(f.record)?.key;
                        g3.then(|| self.g3_entry_digest(&key)).flatten()
                    });
                    if result.is_ok() && digest.is_some() {
                        self.set_fill_digest(fill, digest);
                    }
                    self.finish_fill(now, fill, result, &mut stored, &mut deliver_next);
                }
                JobKey::Spill { record } => {
                    self.finish_spill(record, outcome == CopyOutcome::Copied);
                }
                JobKey::G3Deliver { entry, key } => {
                    let read = match outcome {
                        CopyOutcome::Copied => g3::G3Read::Read,
                        CopyOutcome::Failed | CopyOutcome::Altered => g3::G3Read::Failed,
                        CopyOutcome::Cancelled | CopyOutcome::DeadlinePassed => g3::G3Read::NotRead,
                    };
                    if outcome == CopyOutcome::Altered {
                        self.count_g3_digest_mismatch();
                    }
                    let bytes = self.g3_bytes(&key);
                    self.g3_release(key, read);
                    let result = match outcome {
                        CopyOutcome::Copied => {
                            self.counters.bytes_delivered += bytes;
                            EntryResult::success(None, Vec::new())
                        }
                        CopyOutcome::DeadlinePassed => EntryResult::failed(FailReason::Timeout),
                        CopyOutcome::Cancelled => EntryResult::failed(FailReason::Aborted),
                        CopyOutcome::Failed => EntryResult::failed(FailReason::CopyFailed),
                        CopyOutcome::Altered => EntryResult::failed(FailReason::DigestMismatch),
                    };
                    // A result set earlier (abort) stands: set_result keeps the first.
                    self.set_result(op, entry, result);
                }
                JobKey::Deliver { record, entry } => {
                    if outcome == CopyOutcome::Copied {
                        self.counters.bytes_delivered += self.record_bytes(record);
                    }
                    self.unclaim(record);
                    let result = match outcome {
                        CopyOutcome::Copied => EntryResult::success(None, Vec::new()),
                        CopyOutcome::DeadlinePassed => EntryResult::failed(FailReason::Timeout),
                        CopyOutcome::Cancelled => EntryResult::failed(FailReason::Aborted),
                        CopyOutcome::Failed => EntryResult::failed(FailReason::CopyFailed),
                        CopyOutcome::Altered => EntryResult::failed(FailReason::DigestMismatch),
                    };
                    // A result set earlier (abort) stands: set_result keeps the first.
                    self.set_result(op, entry, result);
                }
            }
        }
        self.publish_stored(&stored);
        if let Some(o) = self.ops.get_mut(&op) {
            o.jobs = o.jobs.saturating_sub(1);
        }
        for (waiter_op, entries) in deliver_next {
            self.start_delivers(now, waiter_op, entries);
        }
        // A spill that ended (or a fill that freed its slots) may have made
        // the room a waiting key needs; commits may call for spills ahead.
        self.resume_capacity_waiters(now);
        self.spill_ahead(now);
        self.finish_if_done(op);
        let waiting_ops: Vec<OpHandle> = self.ops.keys().copied().collect();
        for o in waiting_ops {
            self.finish_if_done(o);
        }
        self.check_pressure();
    }

    /// Ends a fill: commits its record READY (and serves its waiters) when
    /// the bytes landed, else frees it and fails its waiters with `reason`.
    pub(in crate::machine) fn finish_fill(
        &mut self,
        now: u64,
        fill: u32,
        result: std::result::Result<(), FailReason>,
        stored: &mut Vec<(u32, Option<PageInfo>)>,
        deliver_next: &mut BTreeMap<OpHandle, Vec<(u32, u32)>>,
    ) {
        let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::take) else {
            return;
        };
        self.free_fills.push(fill);
        self.filling.remove(&f.record);
        if let (FillSource::G3 { .. }, Some(key)) = (f.source, self.record(f.record).map(|r| r.key))
        {
            // A copy of bytes G3 could not read is never served again. A fill
            // cancelled or past its deadline did not read at all.
            let read = match result {
                Ok(()) => g3::G3Read::Read,
                Err(FailReason::CopyFailed) => g3::G3Read::Failed,
                Err(FailReason::DigestMismatch) => {
                    self.count_g3_digest_mismatch();
                    g3::G3Read::Failed
                }
                Err(_) => g3::G3Read::NotRead,
            };
            self.g3_release(key, read);
        }
        let filling = self
            .record(f.record)
            .is_some_and(|r| r.state == Residency::Filling);
        if result.is_ok() && filling {
            self.counters.bytes_deposited += self.record_bytes(f.record);
            self.counters.committed += 1;
            self.transition(f.record, Residency::Ready, "fill commit");
            self.journal_ready(f.record, f.page.as_ref());
            if let Some(r) = self.record_mut(f.record) {
                r.last_access = now;
            }
            stored.push((f.record, f.page));
            for (waiter_op, entry) in f.waiters {
                self.fill_committed_for(now, waiter_op, entry, f.record, deliver_next);
            }
            if self.record(f.record).is_some_and(|r| r.claims == 0) {
                self.make_evictable(f.record);
            }
        } else {
            let reason = result.err().unwrap_or(FailReason::Aborted);
            for (waiter_op, entry) in f.waiters {
                self.set_result(waiter_op, entry, EntryResult::failed(reason));
                self.finish_if_done(waiter_op);
            }
            self.remove_record(f.record, "fill failed");
        }
    }

    pub(in crate::machine) fn fill_committed_for(
        &mut self,
        now: u64,
        op: OpHandle,
        entry: u32,
        record: u32,
        deliver_next: &mut BTreeMap<OpHandle, Vec<(u32, u32)>>,
    ) {
        let Some(kind) = self.ops.get(&op).map(|o| o.kind) else {
            return;
        };
        match kind {
            OpKind::Deposit { no_evict } => {
                let release = no_evict.then(|| self.claim_public(record));
                self.set_result(op, entry, EntryResult::success(release, Vec::new()));
            }
            OpKind::Fetch => {
                let release = self.claim_public(record);
                self.touch(now, record);
                let slots = self.slot_refs(record);
                self.set_result(op, entry, EntryResult::success(Some(release), slots));
            }
            OpKind::Deliver => deliver_next.entry(op).or_default().push((entry, record)),
            OpKind::SourcePrepare => {
                // Pinned until the write it prepares has claimed what it
                // serves (room made meanwhile must not evict it).
                self.claim_internal(record);
                if let Some(p) = self.source_prepares.get_mut(&op) {
                    p.pinned.push(record);
                }
                self.set_result(op, entry, EntryResult::success(None, Vec::new()));
            }
        }
    }

    /// How entry `entry` of `op` goes on when its key is indexed as
    /// `record` in `state`: a page of another layout fails it
    /// (`LayoutMismatch`), one being filled makes it wait on that fill, one
    /// being discarded (or vacant) fails it with `gone`. A ready page is
    /// returned for the caller to serve its own way.
    pub(in crate::machine) fn settle_indexed(
        &mut self,
        (op, entry): (OpHandle, u32),
        IndexEntry { record, state }: IndexEntry,
        layout: u16,
        gone: FailReason,
    ) -> Option<u32> {
        let same_layout = self.record(record).is_some_and(|r| r.layout == layout);
        match state {
            _ if !same_layout => {
                self.set_result(op, entry, EntryResult::failed(FailReason::LayoutMismatch));
            }
            Residency::Ready => return Some(record),
            Residency::Filling => {
                let fill = self.filling.get(&record).copied().unwrap_or(NIL);
                self.wait_on_fill(op, entry, fill);
            }
            Residency::Discarding | Residency::Vacant => {
                self.set_result(op, entry, EntryResult::failed(gone));
            }
        }
        None
    }

    pub(in crate::machine) fn wait_on_fill(&mut self, op: OpHandle, entry: u32, fill: u32) {
        let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::as_mut) else {
            self.set_result(op, entry, EntryResult::failed(FailReason::NoSource));
            return;
        };
        f.waiters.push((op, entry));
        if let Some(e) = self
            .ops
            .get_mut(&op)
            .and_then(|o| o.entries.get_mut(entry as usize))
        {
            e.wait = Wait::Fill(fill);
        }
    }

    pub(in crate::machine) fn new_fill(&mut self, fill: Fill) -> u32 {
        if let Some(i) = self.free_fills.pop()
            && let Some(slot) = self.fills.get_mut(i as usize)
        {
            *slot = Some(fill);
            return i;
        }
        self.fills.push(Some(fill));
        (self.fills.len() - 1) as u32
    }

    /// Sets an entry's result if it has none (the first result stands).
    pub(in crate::machine) fn set_result(&mut self, op: OpHandle, entry: u32, result: EntryResult) {
        let Some(o) = self.ops.get_mut(&op) else {
            return;
        };
        let Some(e) = o.entries.get_mut(entry as usize) else {
            return;
        };
        if e.result.is_none() {
            e.result = Some(result);
            o.pending = o.pending.saturating_sub(1);
        } else if let Some(release) = result.release {
            // The entry already failed (abort, deadline): a claim taken for it
            // must not leak.
            if let Some(record) = self.claims.remove(&release) {
                self.unclaim(record);
            }
        }
    }

    /// Completes an operation once every key has a result and every copy it
    /// started is terminal.
    pub(in crate::machine) fn finish_if_done(&mut self, op: OpHandle) {
        let done = self
            .ops
            .get(&op)
            .is_some_and(|o| o.pending == 0 && o.jobs == 0);
        if !done {
            return;
        }
        if self
            .ops
            .get(&op)
            .is_some_and(|o| o.kind == OpKind::SourcePrepare)
        {
            if let Some(o) = self.ops.remove(&op) {
                self.deadlines.remove(&(o.deadline, op));
            }
            self.resume_source_write(op);
            return;
        }
        if let Some(o) = self.ops.remove(&op) {
            self.deadlines.remove(&(o.deadline, op));
            let entries = o
                .entries
                .into_iter()
                .map(|e| {
                    (
                        e.key,
                        e.result
                            .unwrap_or_else(|| EntryResult::failed(FailReason::Aborted)),
                    )
                })
                .collect();
            self.completed.push(OpResult { op, entries });
        }
    }
}
