//! Spills: DRAM pages written into G3, on eviction (a move) or ahead of it.

use super::*;

/// Spills into G3: starting them, submitting their jobs, landing their outcomes.
impl Core {
    /// Starts spilling DRAM records `victims` (each checked by
    /// [`Self::g3_move_kind`] to need a spill) in one G3 job: each is
    /// claimed and marked to retire, and gets a `Storing` G3 residency.
    /// A victim G3 finds no slot for is dropped instead (returned).
    pub(in crate::machine) fn start_spills(&mut self, now: u64, victims: &[u32]) -> Vec<u32> {
        let mut dropped = Vec::new();
        let mut job = Vec::new();
        for &idx in victims {
            match self.begin_spill(idx, true) {
                Some(transfers) => job.push((idx, transfers)),
                None => dropped.push(idx),
            }
        }
        self.submit_spills(now, job);
        dropped
    }

    /// Takes G3 slots for DRAM record `idx` (one per span of a resolving
    /// source), records its `Storing` G3 residency and returns the writes;
    /// `None` (nothing changed) when G3 has no room or a span does not
    /// resolve. A move (`moving`) claims the DRAM page and marks it to
    /// retire; a spill ahead leaves it as it is.
    fn begin_spill(&mut self, idx: u32, moving: bool) -> Option<Vec<G3Transfer>> {
        let (key, layout) = self.record(idx).map(|r| (r.key, r.layout))?;
        let sources = self.slot_spans(idx);
        let spans = self.layouts.get(layout as usize).map_or(0, Vec::len);
        if sources.is_empty() || sources.len() != spans {
            return None;
        }
        let slots = self.g3_take_slots(sources.len())?;
        if moving {
            self.claim_internal(idx);
            if let Some(r) = self.record_mut(idx) {
                r.flags |= FLAG_RETIRE;
            }
        }
        let page = self.page_info.get(&idx).cloned();
        let digest = self.record_digest(idx);
        let transfers = sources
            .iter()
            .zip(&slots)
            .map(|(source, slot)| G3Transfer {
                slot: *slot,
                addr: source.src,
                len: source.len,
                direction: G3Direction::Store,
            })
            .collect();
        let g3 = self.g3.as_mut()?;
        g3.entries.insert(
            key,
            G3Entry {
                slots,
                state: G3State::Storing,
                claims: 0,
                seq: 0,
                queued: false,
                layout,
                page,
                poisoned: false,
                moving,
                digest,
            },
        );
        g3.counters.spills += 1;
        if !moving {
            g3.counters.spills_ahead += 1;
            g3.ahead_in_flight += 1;
        }
        Some(transfers)
    }

    /// Submits spills begun with [`Self::begin_spill`] as one G3 job of the
    /// runner's own.
    fn submit_spills(&mut self, now: u64, spills: Vec<(u32, Vec<G3Transfer>)>) {
        if spills.is_empty() {
            return;
        }
        let job = self.reserve_job();
        let (keys, transfers): (Vec<JobKey>, Vec<Vec<G3Transfer>>) = spills
            .into_iter()
            .map(|(record, transfers)| (JobKey::Spill { record }, transfers))
            .unzip();
        self.jobs.insert(job, Job::new(BACKGROUND, keys));
        let digests = vec![None; transfers.len()];
        self.actions.push_back(Action::G3 {
            job,
            deadline_ns: now.saturating_add(self.operation_timeout_ns),
            transfers,
            digests,
        });
    }

    /// Ends the spill of DRAM record `record`: on success the G3 copy is
    /// READY (published) and the DRAM copy retires with its last reader; on
    /// failure the G3 slot is freed and the DRAM copy stays.
    pub(in crate::machine) fn finish_spill(&mut self, record: u32, copied: bool) {
        let Some(key) = self.record(record).map(|r| r.key) else {
            return;
        };
        let bytes = self.record_bytes(record);
        let Some(g3) = self.g3.as_mut() else { return };
        let moving = g3.entries.get(&key).is_some_and(|e| e.moving);
        if !moving {
            g3.ahead_in_flight = g3.ahead_in_flight.saturating_sub(1);
        }
        if copied {
            let mut stored = None;
            if let Some(e) = g3.entries.get_mut(&key) {
                e.state = G3State::Ready;
                stored = Some(e.page.clone());
            }
            g3.enqueue(key);
            g3.counters.spills_committed += 1;
            g3.counters.bytes_spilled += bytes;
            if let Some(page) = stored {
                let event = self.stored_event(Self::g3_scope(key.namespace), key, page.as_ref());
                self.events.push(event);
            }
            if moving {
                // The DRAM copy goes once its last reader is done (retire).
                self.unclaim(record);
            }
        } else {
            g3.remove(key);
            g3.counters.spills_failed += 1;
            if let Some(r) = self.record_mut(record) {
                r.flags &= !FLAG_RETIRE;
                r.flags |= FLAG_SPILL_FAILED;
            }
            if moving {
                self.unclaim(record);
            }
        }
    }

    /// Spills ahead: once the pool is half full, copies the pages next in
    /// line for eviction (the oldest quarter of the queue, at most
    /// [`AHEAD_WINDOW`] looked at) that the policy would move, at most
    /// [`AHEAD_IN_FLIGHT`] at a time, into free G3 slots. Their DRAM copies
    /// stay READY and evictable; once G3 holds them, evicting them is a drop,
    /// so a deposit into a full pool waits for no disk write.
    pub(in crate::machine) fn spill_ahead(&mut self, now: u64) {
        let Some(g3) = self.g3.as_ref().filter(|g| g.config.spill_ahead) else {
            return;
        };
        // Only once the pool is half full: an emptier pool evicts nothing soon.
        let (free, total) = self.pools.iter().fold((0usize, 0usize), |(f, t), p| {
            (f + p.free.len(), t + p.total as usize)
        });
        if free * 2 > total {
            return;
        }
        let mut budget = AHEAD_IN_FLIGHT.saturating_sub(g3.ahead_in_flight);
        if budget == 0 {
            return;
        }
        let window = (total / 4).clamp(1, AHEAD_WINDOW);
        let mut chosen = Vec::new();
        let mut promised = 0;
        let mut cursor = self.first_candidate();
        for _ in 0..window {
            let Some(idx) = cursor else { break };
            cursor = self.next_candidate(idx);
            if self.g3_move_kind(idx) != Move::Spill {
                continue;
            }
            let Some(meta) = self.meta(idx) else { continue };
            if self.policy.decide_eviction(&meta) != EvictionDecision::MoveToG3 {
                continue;
            }
            let spans = self
                .record(idx)
                .and_then(|r| self.layouts.get(r.layout as usize))
                .map_or(0, Vec::len);
            // Ahead of time, only free G3 slots: never evict G3 pages for it.
            if self
                .g3
                .as_ref()
                .is_none_or(|g| g.free.len() < promised + spans)
            {
                break;
            }
            promised += spans;
            chosen.push(idx);
            budget -= 1;
            if budget == 0 {
                break;
            }
        }
        let spills = chosen
            .into_iter()
            .filter_map(|idx| self.begin_spill(idx, false).map(|t| (idx, t)))
            .collect();
        self.submit_spills(now, spills);
    }
}
