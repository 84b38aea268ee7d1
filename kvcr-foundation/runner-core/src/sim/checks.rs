//! The invariants checked after every step, and the coverage count of what
//! a run exercised.

use super::*;

impl Coverage {
    pub(super) fn add(&mut self, o: &Self) {
        self.requests += o.requests;
        self.split_requests += o.split_requests;
        for (mine, theirs) in [
            (&mut self.writes, o.writes),
            (&mut self.committed, o.committed),
            (&mut self.successes, o.successes),
        ] {
            for (a, b) in mine.iter_mut().zip(theirs) {
                *a += b;
            }
        }
        self.multi_lane_writes += o.multi_lane_writes;
        self.concurrent_writes += o.concurrent_writes;
        self.shared_source_writes += o.shared_source_writes;
        self.out_of_order_reports += o.out_of_order_reports;
        self.overlapping_keys += o.overlapping_keys;
        self.delivered += o.delivered;
        self.late_ends += o.late_ends;
        self.failed_pieces += o.failed_pieces;
        self.late_pieces += o.late_pieces;
        self.crashes += o.crashes;
        self.stalls += o.stalls;
        self.stall_recoveries += o.stall_recoveries;
        self.quarantined += o.quarantined;
        self.timeouts += o.timeouts;
        self.g3_runs += o.g3_runs;
        self.spills += o.spills;
        self.failed_spills += o.failed_spills;
        self.source_fills += o.source_fills;
        self.target_fills += o.target_fills;
        self.g3_delivers += o.g3_delivers;
        self.failed_fills += o.failed_fills;
        self.served_from_g3 += o.served_from_g3;
        self.crashes_mid_spill += o.crashes_mid_spill;
        self.g3_evictions += o.g3_evictions;
        self.guarded_crashes += o.guarded_crashes;
        self.guard_resolved_puts += o.guard_resolved_puts;
        self.dead_reported += o.dead_reported;
        self.dead_freed += o.dead_freed;
        self.dead_freed_quarantined += o.dead_freed_quarantined;
        self.dead_reports_ending_several += o.dead_reports_ending_several;
        self.dead_ignored += o.dead_ignored;
        self.reprobes += o.reprobes;
        self.routes_refused += o.routes_refused;
        self.message_writes += o.message_writes;
        self.messages_taken += o.messages_taken;
        self.messages_dropped += o.messages_dropped;
    }
}

/// Invariant checks and coverage.
impl Sim {
    pub(super) fn violation(&mut self, what: String) {
        self.violations.push(what);
    }

    /// A deliver's copy out of target `t`'s slots: each must hold the key
    /// that the destination element was asked for.
    pub(super) fn check_copy(&mut self, t: usize, keys: &[Vec<CopySpan>]) {
        for span in keys.iter().flatten() {
            let target = &mut self.targets[t];
            let slot = target.slot_of(span.src);
            let element = span
                .dst
                .checked_sub(FRAMEWORK)
                .filter(|o| o % BLOCK == 0)
                .map(|o| o / BLOCK);
            let wanted = element.and_then(|e| target.deliveries.get_mut(&e));
            let (Some(slot), Some((key, copied))) = (slot, wanted) else {
                return self.violation(format!("target {t} copies {span:?}, asked by nobody"));
            };
            let (key, landed) = (*key, target.memory.dram.get(&slot).copied());
            *copied = true;
            if landed != Some(key) {
                self.violation(format!(
                    "target {t} delivers key {key} from slot {slot}, which holds {landed:?}"
                ));
            }
            if let Some(other) = self.in_flight_at(Peer::Target(t), Place::Dram(slot), true, &[]) {
                self.violation(format!(
                    "target {t} delivers from slot {slot} while {other} may still write it"
                ));
            }
        }
    }

    /// Target `t` committed `stored` on the end of write `op`: the op was
    /// not probed, granted those keys, and their slots hold their bytes.
    pub(super) fn check_commits(&mut self, t: usize, op: Option<OpHandle>, stored: &[u64]) {
        let target = &self.targets[t];
        let Some(op) = op else {
            return self.violation(format!("target {t} committed {stored:?} outside a write"));
        };
        if target.probed.contains(&op) {
            return self.violation(format!(
                "target {t} committed {stored:?} from op {op:?}, which it probed (past its deadline)"
            ));
        }
        let Some(grants) = target.grants.get(&op) else {
            return self.violation(format!(
                "target {t} committed {stored:?} from op {op:?}, which it never sent"
            ));
        };
        let mut problems = Vec::new();
        for key in stored {
            let Some(&(_, slot)) = grants.iter().find(|(k, _)| k == key) else {
                problems.push(format!("op {op:?} never asked for key {key}"));
                continue;
            };
            let landed = target.memory.dram.get(&slot).copied();
            if landed != Some(*key) {
                problems.push(format!(
                    "key {key} committed in slot {slot}, where the last put was {landed:?}"
                ));
            }
            if let Some(other) = self.in_flight_at(Peer::Target(t), Place::Dram(slot), true, &[]) {
                problems.push(format!(
                    "key {key} committed in slot {slot} while {other} may still write it"
                ));
            }
        }
        self.seen.committed[t] += stored.len() as u64;
        self.targets[t].committed.extend(stored);
        for problem in problems {
            self.violation(format!("target {t}: {problem}"));
        }
    }

    /// Source `s` (this process) builds a route to `target` now: in every
    /// window ending now, it built at most the budget's burst plus one per
    /// refill there.
    pub(super) fn check_route_rate(&mut self, s: usize, target: &ControlEndpoint) {
        let now = self.now;
        let builds = self.sources[s]
            .route_builds
            .entry(target.clone())
            .or_default();
        builds.push(now);
        let over = builds.iter().rev().enumerate().find(|&(back, &since)| {
            back as u64 + 1 > u64::from(ROUTE_BURST) + (now - since) / ROUTE_REFILL
        });
        if let Some((back, since)) = over {
            let message = format!(
                "source {s} built {} routes to {target:?} in {} ns",
                back + 1,
                now - since
            );
            self.violation(message);
        }
    }

    pub(super) fn check(&mut self) -> Result<(), String> {
        for (t, target) in self.targets.iter().enumerate() {
            target
                .core
                .check_invariants()
                .map_err(|e| format!("target {t}: {e}"))?;
        }
        for (s, source) in self.sources.iter().enumerate() {
            source
                .core
                .check_invariants()
                .map_err(|e| format!("source {s}: {e}"))?;
        }
        if let Some(violation) = self.violations.first() {
            return Err(violation.clone());
        }
        for t in 0..self.targets.len() {
            self.check_results(t)?;
        }
        // No slot a put may still write is free.
        for put in &self.puts {
            if self.targets[put.target]
                .core
                .slot_is_free(PoolId(0), put.slot as u32)
            {
                return Err(format!(
                    "target {}'s slot {} is free while a put may still write it ({put:?})",
                    put.target, put.slot
                ));
            }
            // Nor is a slot a put of a live source still reads.
            let source = &self.sources[put.source];
            if put.incarnation == source.incarnation
                && source.core.slot_is_free(PoolId(0), put.from as u32)
            {
                return Err(format!(
                    "source {}'s slot {} is free while a put still reads it ({put:?})",
                    put.source, put.from
                ));
            }
        }
        // No slot a G3 job still reads or writes is free.
        for job in &self.g3_jobs {
            for span in job.keys.iter().flatten() {
                for place in [span.from, span.to] {
                    if let Place::Dram(slot) = place
                        && self.slot_free(job.peer, slot)
                    {
                        return Err(format!(
                            "{:?}'s slot {slot} is free while G3 job {:?} still touches it ({span:?})",
                            job.peer, job.job
                        ));
                    }
                }
            }
        }
        for t in &mut self.targets {
            t.core.drain_events().for_each(drop);
        }
        for s in &mut self.sources {
            s.core.drain_events().for_each(drop);
            // An engine's deposits on a source: nobody waits on them.
            let mut done = Vec::new();
            s.core.drain_completed(&mut done);
        }
        Ok(())
    }

    /// Target `t`'s completed operations: each completes once, a key failed
    /// by deadline never succeeds, a fetched page holds its key's bytes and
    /// a delivered one was copied from such a page.
    fn check_results(&mut self, t: usize) -> Result<(), String> {
        let mut done = Vec::new();
        self.targets[t].core.drain_completed(&mut done);
        for result in done {
            if !self.targets[t].completed_ops.insert(result.op) {
                return Err(format!("target {t}: op {:?} completed twice", result.op));
            }
            for (key, entry) in &result.entries {
                let target = &mut self.targets[t];
                if entry.status == EntryStatus::Failed(FailReason::Timeout) {
                    target.timed_out.insert((result.op, *key));
                    self.seen.timeouts += 1;
                }
                if !entry.is_success() {
                    continue;
                }
                if target.timed_out.contains(&(result.op, *key)) {
                    return Err(format!("target {t}: {key:?} timed out, then succeeded"));
                }
                self.seen.successes[t] += 1;
                let k = key.key.as_u64();
                if let Some(element) = target.deliver_elements.get(&(result.op, k)) {
                    if target.deliveries.get(element) != Some(&(k, true)) {
                        return Err(format!(
                            "target {t}: {key:?} delivered to element {element} without a copy of it"
                        ));
                    }
                    self.seen.delivered += 1;
                } else {
                    let slot = entry.slots.first().ok_or("success without a slot")?.index;
                    let landed = target.memory.dram.get(&slot);
                    if landed != Some(&k) {
                        return Err(format!(
                            "target {t}: {key:?} fetched from slot {slot} but the last put there was {landed:?}"
                        ));
                    }
                    if let Some(other) =
                        self.in_flight_at(Peer::Target(t), Place::Dram(slot), true, &[])
                    {
                        return Err(format!(
                            "target {t}: {key:?} fetched from slot {slot} while {other} may still write it"
                        ));
                    }
                }
                if let Some(release) = entry.release {
                    self.targets[t].core.release(&[release]);
                }
            }
        }
        Ok(())
    }

    /// What the run exercised.
    pub(super) fn coverage(&self) -> Coverage {
        let mut seen = self.seen;
        seen.overlapping_keys = self.targets[0]
            .committed
            .intersection(&self.targets[1].committed)
            .count() as u64;
        seen.quarantined = self
            .targets
            .iter()
            .map(|t| t.core.peer_counters().quarantined)
            .sum();
        for t in &self.targets {
            let counters = t.core.peer_counters();
            seen.dead_freed += counters.dead_freed;
            seen.dead_ignored += counters.dead_ignored;
            seen.reprobes += counters.reprobes;
        }
        seen.routes_refused = self
            .sources
            .iter()
            .map(|s| s.core.peer_counters().routes_refused)
            .sum();
        let cores = self.targets.iter().map(|t| &t.core);
        seen.g3_evictions = cores
            .chain(self.sources.iter().map(|s| &s.core))
            .filter_map(Core::g3_counters)
            .map(|c| c.evictions)
            .sum();
        seen
    }
}
