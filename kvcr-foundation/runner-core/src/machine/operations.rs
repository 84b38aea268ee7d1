//! Operations: deposit, fetch, deliver, release and abort, validated whole before anything changes.

use super::*;
use crate::region::Span;

impl Core {
    pub(in crate::machine) fn new_op(
        &mut self,
        now: u64,
        kind: OpKind,
        entries: Vec<OpEntry>,
        memory: RegionMemory,
    ) -> OpHandle {
        let handle = OpHandle(self.next_op);
        self.next_op += 1;
        let deadline = now.saturating_add(self.operation_timeout_ns);
        let pending = entries.iter().filter(|e| e.result.is_none()).count();
        self.ops.insert(
            handle,
            Op {
                kind,
                deadline,
                entries,
                pending,
                jobs: 0,
                memory,
                lead_prefix: 0,
            },
        );
        self.deadlines.insert((deadline, handle));
        handle
    }

    pub(in crate::machine) fn layout_of(&mut self, pools: &[PoolId]) -> Result<u16> {
        // Layouts are only ever added, so the last one found is still its id.
        if let Some(id) = self.last_layout.filter(|id| {
            self.layouts
                .get(usize::from(*id))
                .is_some_and(|l| l == pools)
        }) {
            return Ok(id);
        }
        if let Some(id) = self.layout_ids.get(pools).copied() {
            self.last_layout = Some(id);
            return Ok(id);
        }
        let id = u16::try_from(self.layouts.len()).map_err(|_| {
            runner_err(RunnerReason::Config {
                field: "layouts",
                why: "more than 65535 distinct span layouts",
            })
        })?;
        self.layouts.push(pools.to_vec());
        self.layout_pool_counts.push(pool_counts(pools));
        self.layout_ids.insert(pools.to_vec(), id);
        self.last_layout = Some(id);
        Ok(id)
    }

    /// Validates a key's framework spans: resolves every element and returns
    /// the layout (pools in span order) and the spans.
    pub(in crate::machine) fn framework_spans(
        &mut self,
        spans: &[ElementRef],
    ) -> Result<(u16, Vec<CopySpan>, RegionMemory)> {
        let mut copies = Vec::with_capacity(spans.len().min(MAX_SPANS_PER_KEY));
        let (layout, memory) = self.framework_layout(spans, |span| {
            copies.push(CopySpan {
                src: span.addr,
                dst: 0,
                len: span.len,
            });
        })?;
        Ok((layout, copies, memory))
    }

    /// A deliver entry's elements validated as [`Self::framework_spans`]
    /// does, kept as a [`Destinations`] run where they form one (no span
    /// list is built for such a page).
    pub(in crate::machine) fn framework_destinations(
        &mut self,
        elements: &[ElementRef],
    ) -> Result<(u16, Destinations, RegionMemory)> {
        if let Some(run) = Destinations::run_of(elements) {
            let (layout, memory) = self.framework_layout(elements, |_| {})?;
            return Ok((layout, run, memory));
        }
        let mut spans = Vec::with_capacity(elements.len().min(MAX_SPANS_PER_KEY));
        let (layout, memory) =
            self.framework_layout(elements, |span| spans.push((span.addr, span.len)))?;
        Ok((layout, Destinations::Spans(spans), memory))
    }

    /// Resolves every element of a key (each a framework region's, all in
    /// one kind of memory, at most [`MAX_SPANS_PER_KEY`]), handing `each`
    /// its span; the layout (pools in element order) and the memory.
    fn framework_layout(
        &mut self,
        elements: &[ElementRef],
        mut each: impl FnMut(&Span),
    ) -> Result<(u16, RegionMemory)> {
        if elements.is_empty() || elements.len() > MAX_SPANS_PER_KEY {
            return Err(runner_err(RunnerReason::LayoutLength {
                got: elements.len(),
                max: MAX_SPANS_PER_KEY,
            }));
        }
        // The layout is looked up from a buffer kept between calls: a
        // restore's deliver resolves thousands of keys' spans, and a fresh
        // vector per key was most of its time (profiled).
        let mut pools = std::mem::take(&mut self.pool_scratch);
        pools.clear();
        let mut memory = None;
        for element in elements {
            let span = self.regions.resolve_framework(*element)?;
            same_memory(&mut memory, span.memory)?;
            pools.push(span.pool);
            each(&span);
        }
        let layout = self.layout_of(&pools);
        self.pool_scratch = pools;
        Ok((layout?, memory.unwrap_or(RegionMemory::Host)))
    }

    pub(in crate::machine) fn check_namespace(&self, key: &ScopedKey) -> Result<()> {
        if self.namespaces.contains_key(&key.namespace) {
            Ok(())
        } else {
            Err(runner_err(RunnerReason::UnknownNamespace(key.namespace.0)))
        }
    }

    /// Copies framework memory into KVCR DRAM. Validation errors refuse the
    /// whole call before anything changes.
    pub fn deposit(
        &mut self,
        now: u64,
        entries: Vec<DepositEntry>,
        no_evict: bool,
    ) -> Result<OpHandle> {
        // Validate everything first: a bad entry refuses the call unchanged.
        let mut validated = Vec::with_capacity(entries.len());
        let mut memory = None;
        for entry in entries {
            self.check_namespace(&entry.key)?;
            let (layout, spans, entry_memory) = self.framework_spans(&entry.spans)?;
            same_memory(&mut memory, entry_memory)?;
            validated.push((entry.key, layout, spans, entry.page));
        }
        let op_entries = validated
            .iter()
            .map(|(key, ..)| OpEntry {
                key: *key,
                result: None,
                wait: Wait::None,
                destinations: Destinations::default(),
            })
            .collect();
        let handle = self.new_op(
            now,
            OpKind::Deposit { no_evict },
            op_entries,
            memory.unwrap_or(RegionMemory::Host),
        );
        // Reserved now: allocations below may start G3 spill jobs.
        let job = self.reserve_job();
        let mut job_keys = Vec::new();
        let mut job_spans = Vec::new();
        let protected: Vec<ScopedKey> = validated.iter().map(|v| v.0).collect();
        for (i, (key, layout, mut spans, page)) in validated.into_iter().enumerate() {
            let entry = i as u32;
            match self.index.get(&key).copied() {
                Some(indexed) => {
                    let gone = FailReason::Discarding;
                    if let Some(record) =
                        self.settle_indexed((handle, entry), indexed, layout, gone)
                    {
                        let release = no_evict.then(|| self.claim_public(record));
                        self.set_result(handle, entry, EntryResult::success(release, Vec::new()));
                    }
                }
                None => {
                    let size: u64 = spans.iter().map(|s| s.len).sum();
                    let meta = BlockMeta {
                        key,
                        size_bytes: size,
                        access_count: 0,
                        last_access_ns: now,
                        inserted_seq: self.next_seq,
                    };
                    if self.policy.decide_ingest(&meta, no_evict) == IngestDecision::Drop {
                        self.counters.dropped += 1;
                        self.set_result(handle, entry, EntryResult::dropped());
                        continue;
                    }
                    let slots = match self.allocate(now, layout, &protected) {
                        Allocation::Slots(slots) => slots,
                        Allocation::Pending => {
                            // Spills to G3 are making room: wait for it.
                            self.wait_for_capacity(
                                handle,
                                entry,
                                key,
                                layout,
                                WaiterKind::Deposit { spans, page },
                            );
                            continue;
                        }
                        Allocation::Full => {
                            self.set_result(
                                handle,
                                entry,
                                EntryResult::failed(FailReason::CapacityExhausted),
                            );
                            continue;
                        }
                    };
                    let record = self.insert_record(now, key, layout, slots);
                    for (span, slot) in spans.iter_mut().zip(self.slot_spans(record)) {
                        span.dst = slot.src;
                    }
                    let fill = self.new_fill(Fill {
                        record,
                        source: FillSource::Copy {
                            job,
                            key: job_keys.len() as u32,
                        },
                        waiters: Vec::new(),
                        page,
                    });
                    self.filling.insert(record, fill);
                    job_keys.push(JobKey::Fill(fill));
                    job_spans.push(spans);
                    self.wait_on_fill(handle, entry, fill);
                }
            }
        }
        if !job_keys.is_empty() {
            self.submit_job(handle, job, job_keys, job_spans);
        }
        self.finish_if_done(handle);
        self.spill_ahead(now);
        self.check_pressure();
        Ok(handle)
    }

    /// Makes keys resident and claims them. Without a peer source (the peer
    /// slice adds one), a key that is not resident fails with `NoSource`.
    pub fn fetch(
        &mut self,
        now: u64,
        keys: &[ScopedKey],
        layout: &[PoolId],
        request: Option<&RequestId>,
    ) -> Result<OpHandle> {
        if layout.is_empty() || layout.len() > MAX_SPANS_PER_KEY {
            return Err(runner_err(RunnerReason::LayoutLength {
                got: layout.len(),
                max: MAX_SPANS_PER_KEY,
            }));
        }
        if layout.iter().any(|p| p.0 as usize >= self.pools.len()) {
            return Err(runner_err(RunnerReason::LayoutMismatch));
        }
        for key in keys {
            self.check_namespace(key)?;
        }
        let layout = self.layout_of(layout)?;
        // Keys are deduplicated in order.
        let mut seen = hashbrown::HashSet::with_capacity(keys.len());
        let unique: Vec<ScopedKey> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
        let entries = unique
            .iter()
            .map(|key| OpEntry {
                key: *key,
                result: None,
                wait: Wait::None,
                destinations: Destinations::default(),
            })
            .collect();
        let handle = self.new_op(now, OpKind::Fetch, entries, RegionMemory::Host);
        let mut remote = Vec::new();
        let mut g3_batch = Vec::new();
        for (i, key) in unique.iter().enumerate() {
            let entry = i as u32;
            match self.index.get(key).copied() {
                Some(indexed) => {
                    let gone = FailReason::NoSource;
                    if let Some(record) =
                        self.settle_indexed((handle, entry), indexed, layout, gone)
                    {
                        let release = self.claim_public(record);
                        self.touch(now, record);
                        let slots = self.slot_refs(record);
                        self.set_result(handle, entry, EntryResult::success(Some(release), slots));
                    }
                }
                None => {
                    if !self.start_g3_fill(now, handle, entry, *key, layout, &unique, &mut g3_batch)
                    {
                        remote.push((entry, *key));
                    }
                }
            }
        }
        self.submit_g3_fills(handle, g3_batch);
        self.start_remote(now, handle, request, layout, remote, &unique);
        self.finish_if_done(handle);
        self.check_pressure();
        Ok(handle)
    }

    /// Sends the keys of `op` that are not resident to the request's hinted
    /// source (when the hint covers them); the rest fail with `NoSource`.
    pub(in crate::machine) fn start_remote(
        &mut self,
        now: u64,
        op: OpHandle,
        request: Option<&RequestId>,
        layout: u16,
        missing: Vec<(u32, ScopedKey)>,
        protected: &[ScopedKey],
    ) {
        // One start_write per (source, namespace): the message carries one
        // namespace for all its keys.
        let mut by_source: BTreeMap<(ControlEndpoint, NamespaceId), Vec<(u32, ScopedKey)>> =
            BTreeMap::new();
        for (entry, key) in missing {
            match self
                .peer
                .as_ref()
                .and_then(|p| p.hinted_source(request, &key))
            {
                Some(source) => by_source
                    .entry((source.clone(), key.namespace))
                    .or_default()
                    .push((entry, key)),
                None => self.set_result(op, entry, EntryResult::failed(FailReason::NoSource)),
            }
        }
        let per_batch = self.keys_per_write(layout);
        for ((source, _), entries) in by_source {
            // Batches in key order, each its own write: the source writes them
            // concurrently, and each batch lands (and its delivers start) as
            // soon as its own write is done, not when the last one is.
            for batch in entries.chunks(per_batch) {
                let keys: Vec<ScopedKey> = batch.iter().map(|(_, k)| *k).collect();
                let fills =
                    self.start_remote_fills(now, request, source.clone(), &keys, layout, protected);
                for ((entry, _), fill) in batch.iter().zip(fills) {
                    match fill {
                        Ok(fill) => self.wait_on_fill(op, *entry, fill),
                        Err(reason) => self.set_result(op, *entry, EntryResult::failed(reason)),
                    }
                }
            }
        }
    }

    /// Copies resident pages into framework destinations.
    pub fn deliver(
        &mut self,
        now: u64,
        entries: Vec<DeliverEntry>,
        request: Option<&RequestId>,
    ) -> Result<OpHandle> {
        let mut validated = Vec::with_capacity(entries.len());
        let mut op_entries = Vec::with_capacity(entries.len());
        let mut memory = None;
        // The entries' own elements: what a one-hop write is granted.
        let mut elements = Vec::with_capacity(entries.len());
        for entry in entries {
            self.check_namespace(&entry.key)?;
            let (layout, destinations, entry_memory) =
                self.framework_destinations(&entry.destinations)?;
            elements.push(entry.destinations);
            same_memory(&mut memory, entry_memory)?;
            validated.push((entry.key, layout));
            op_entries.push(OpEntry {
                key: entry.key,
                result: None,
                wait: Wait::None,
                destinations,
            });
        }
        let handle = self.new_op(
            now,
            OpKind::Deliver,
            op_entries,
            memory.unwrap_or(RegionMemory::Host),
        );
        let mut ready = Vec::new();
        let mut remote: BTreeMap<u16, Vec<(u32, ScopedKey)>> = BTreeMap::new();
        for (i, (key, layout)) in validated.iter().enumerate() {
            let entry = i as u32;
            match self.index.get(key).copied() {
                Some(indexed) => {
                    let gone = FailReason::NoSource;
                    if let Some(record) =
                        self.settle_indexed((handle, entry), indexed, *layout, gone)
                    {
                        ready.push((entry, record));
                    }
                }
                None => remote.entry(*layout).or_default().push((entry, *key)),
            }
        }
        let protected: Vec<ScopedKey> = validated.iter().map(|v| v.0).collect();
        // A key DRAM lacks is filled from G3 when G3 holds it, else from the
        // hinted peer.
        let mut g3_batch = Vec::new();
        let mut g3_direct = Vec::new();
        for (layout, missing) in std::mem::take(&mut remote) {
            for (entry, key) in missing {
                if let Some(transfer) = self.g3_direct_deliver(handle, entry, key, layout) {
                    g3_direct.push((entry, key, transfer));
                } else if !self.start_g3_fill(
                    now,
                    handle,
                    entry,
                    key,
                    layout,
                    &protected,
                    &mut g3_batch,
                ) {
                    remote.entry(layout).or_default().push((entry, key));
                }
            }
        }
        self.submit_g3_delivers(handle, g3_direct);
        self.submit_g3_fills(handle, g3_batch);
        for (layout, missing) in remote {
            // Device destinations a same-host source can reach are granted
            // to it as they are; the rest go through KVCR DRAM.
            let missing = if memory == Some(RegionMemory::Device) {
                self.start_one_hop(now, handle, request, layout, missing, &mut elements)
            } else {
                missing
            };
            self.start_remote(now, handle, request, layout, missing, &protected);
        }
        self.start_delivers(now, handle, ready);
        self.finish_if_done(handle);
        self.check_pressure();
        Ok(handle)
    }

    /// Starts one deliver copy job for `entries` of `handle`, each reading a
    /// READY record under an internal claim.
    pub(in crate::machine) fn start_delivers(
        &mut self,
        now: u64,
        handle: OpHandle,
        entries: Vec<(u32, u32)>,
    ) {
        if entries.is_empty() {
            return;
        }
        let job = self.reserve_job();
        let mut keys = Vec::with_capacity(entries.len());
        let mut spans = Vec::with_capacity(entries.len());
        for (entry, record) in entries {
            let sources = self.slot_spans(record);
            let Some(e) = self
                .ops
                .get_mut(&handle)
                .and_then(|op| op.entries.get_mut(entry as usize))
            else {
                continue;
            };
            let copies: Option<Vec<CopySpan>> = e
                .destinations
                .spans(&self.regions)
                .zip(&sources)
                .map(|(d, s)| {
                    d.map(|(dst, len)| CopySpan {
                        src: s.src,
                        dst,
                        len,
                    })
                })
                .collect();
            let Some(copies) = copies else {
                // A destination that no longer resolves (see `Destinations`):
                // nothing of the entry is copied.
                self.set_result(handle, entry, EntryResult::failed(FailReason::CopyFailed));
                continue;
            };
            e.wait = Wait::Copy(job, keys.len() as u32);
            // Claimed only once its copies are built.
            self.claim_internal(record);
            self.touch(now, record);
            keys.push(JobKey::Deliver { record, entry });
            spans.push(copies);
        }
        self.submit_job(handle, job, keys, spans);
    }

    /// A fresh copy job id.
    pub(in crate::machine) fn reserve_job(&mut self) -> JobId {
        let job = JobId(self.next_job);
        self.next_job += 1;
        job
    }

    /// Registers `job` (an id from [`Self::reserve_job`]) for `op` and asks the
    /// driver to run its copies.
    pub(in crate::machine) fn submit_job(
        &mut self,
        op: OpHandle,
        job: JobId,
        keys: Vec<JobKey>,
        spans: Vec<Vec<CopySpan>>,
    ) {
        let deadline_ns = self.ops.get(&op).map_or(0, |o| o.deadline);
        let memory = self.ops.get(&op).map_or(RegionMemory::Host, |o| o.memory);
        let digest = self.page_digests && keys.iter().all(|k| matches!(k, JobKey::Fill(_)));
        let lead = self.copy_lead(memory, &keys, &spans);
        if let Some(o) = self.ops.get_mut(&op) {
            o.jobs += 1;
        }
        self.jobs.insert(job, Job::new(op, keys));
        self.actions.push_back(Action::Copy {
            job,
            deadline_ns,
            memory,
            keys: spans,
            digest,
            lead,
        });
    }

    /// Releases public claims. `true` for a live handle; unknown or already
    /// released handles give `false` and change nothing.
    pub fn release(&mut self, handles: &[ReleaseHandle]) -> Vec<bool> {
        let out = handles
            .iter()
            .map(|h| match self.claims.remove(h) {
                Some(record) => {
                    self.unclaim(record);
                    true
                }
                None => false,
            })
            .collect();
        self.check_pressure();
        out
    }

    /// Best-effort abort of `keys` of `op` (all keys when `None`). Keys waiting
    /// on shared work detach (the work continues for other waiters); a copy that
    /// has not started is cancelled; one in flight finishes, and the operation
    /// completes only after it, reporting `Aborted` for those keys.
    pub fn abort(&mut self, op: OpHandle, keys: Option<&[ScopedKey]>) -> bool {
        let Some(o) = self.ops.get(&op) else {
            return false;
        };
        let targets: Vec<u32> = o
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.result.is_none() && keys.is_none_or(|ks| ks.contains(&e.key)))
            .map(|(i, _)| i as u32)
            .collect();
        if targets.is_empty() {
            return false;
        }
        for entry in targets {
            self.fail_waiting_entry(op, entry, FailReason::Aborted);
        }
        self.finish_if_done(op);
        true
    }

    /// Fails one pending entry now (abort or deadline): detaches it from a
    /// shared fill (cancelling the fill's copy if nobody else waits), or
    /// cancels its own deliver copy.
    pub(in crate::machine) fn fail_waiting_entry(
        &mut self,
        op: OpHandle,
        entry: u32,
        reason: FailReason,
    ) {
        let wait = self
            .ops
            .get(&op)
            .and_then(|o| o.entries.get(entry as usize))
            .map_or(Wait::None, |e| e.wait);
        match wait {
            Wait::Fill(fill) => {
                let mut cancel = None;
                if let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::as_mut) {
                    f.waiters.retain(|w| *w != (op, entry));
                    // A local copy or G3 read nobody waits for is cancelled;
                    // a remote write cannot be, and its target operation
                    // still owns it.
                    if let (true, FillSource::Copy { job, key } | FillSource::G3 { job, key }) =
                        (f.waiters.is_empty(), f.source)
                    {
                        cancel = Some((job, key));
                    }
                }
                if let Some((job, key)) = cancel {
                    self.actions.push_back(Action::Cancel { job, key });
                }
            }
            Wait::Copy(job, key) => self.actions.push_back(Action::Cancel { job, key }),
            Wait::Capacity => self.forget_waiter(op, entry),
            // Nothing was granted yet: forget the hold.
            Wait::Route => self.forget_route_wait(op, entry),
            // The source may still write the destination: the entry's
            // result waits for the operation (its `jobs` count holds it).
            Wait::OneHop(_) | Wait::None => {}
        }
        self.set_result(op, entry, EntryResult::failed(reason));
    }
}

/// Each pool `pools` names, in order of first mention, and how often.
fn pool_counts(pools: &[PoolId]) -> Vec<(PoolId, u32)> {
    let mut counts: Vec<(PoolId, u32)> = Vec::new();
    for pool in pools {
        match counts.iter_mut().find(|(p, _)| p == pool) {
            Some((_, n)) => *n += 1,
            None => counts.push((*pool, 1)),
        }
    }
    counts
}
