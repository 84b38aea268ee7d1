//! Puts: a source's writes into a target's slots, cut into pieces over its
//! copy lanes, landing (or failing, or landing late) in any order.

use super::*;

/// Puts started and landed.
impl Sim {
    /// The driver runs a put on source `s`'s lanes: cut into pieces, one
    /// lane each, a lane's pieces one after the other.
    pub(super) fn start_put(
        &mut self,
        s: usize,
        write: u64,
        target: &ControlEndpoint,
        generation: u64,
        spans: &[PutSpan],
    ) {
        if self.sources[s].routes.get(target) != Some(&generation) {
            // The route is gone or was replaced: never written through (as
            // the driver does; rare here, where connects are immediate).
            let now = self.now;
            self.sources[s].core.handle_put_done(now, write, false);
            return;
        }
        let Some(Peer::Target(t)) = self.peer_of(target) else {
            self.violation(format!("source {s} writes to {target:?}"));
            return;
        };
        // Each span: (target slot, source slot, the key whose bytes that
        // source slot holds now).
        let mut resolved = Vec::new();
        for span in spans {
            let slot = self.targets[t].slot_of(span.remote);
            let from = self.sources[s].slot_of(span.local);
            match (slot, from) {
                (Some(slot), Some(from)) if span.len == BLOCK => {
                    let key = self.bytes_at(Peer::Source(s), Place::Dram(from));
                    resolved.push((slot, from, key));
                }
                _ => {
                    return self.violation(format!(
                        "source {s}'s put {span:?} is not a page of its pool into target {t}'s"
                    ));
                }
            }
        }
        if resolved.is_empty() {
            return self.violation(format!("source {s} issued an empty put"));
        }
        for &(slot, from, _) in &resolved {
            if self.targets[t].core.slot_is_free(PoolId(0), slot as u32) {
                self.violation(format!("source {s} writes target {t}'s free slot {slot}"));
            }
            if let Some(other) = self.puts.iter().find(|p| p.target == t && p.slot == slot) {
                self.violation(format!(
                    "two writes in flight into target {t}'s slot {slot}: {other:?} and write {write} of source {s}"
                ));
            }
            if let Some(other) = self.in_flight_at(Peer::Target(t), Place::Dram(slot), false, &[]) {
                self.violation(format!(
                    "source {s} writes target {t}'s slot {slot} while {other} touches it"
                ));
            }
            if self.slot_free(Peer::Source(s), from) {
                self.violation(format!("source {s} puts from its free slot {from}"));
            }
            if let Some(other) = self.in_flight_at(Peer::Source(s), Place::Dram(from), true, &[]) {
                self.violation(format!(
                    "source {s} puts from slot {from} while {other} writes it"
                ));
            }
            if self.sources[s].filled_from_g3.contains(&from) {
                self.seen.served_from_g3 += 1;
            }
        }
        let incarnation = self.sources[s].incarnation;
        if let Some((op, keys)) = self.sources[s].core.peer_write_completion(write)
            && self.rng.chance(self.message_percent)
        {
            // The driver reads the source slots into the message now and
            // reports the write once it has left (here: at once).
            self.seen.message_writes += 1;
            self.seen.writes[s] += 1;
            self.messages.push(InFlightMessage {
                source: s,
                incarnation,
                target: t,
                op,
                keys,
                pieces: resolved.iter().map(|&(slot, _, key)| (slot, key)).collect(),
                arrives_at: self.now + self.rng.below(self.max_put_time),
                lost: self.rng.chance(self.put_fail_percent),
            });
            let now = self.now;
            self.sources[s].core.handle_message_sent(now, write, true);
            return;
        }
        let mine: Vec<usize> = self
            .writes
            .iter()
            .filter(|((ws, wi, _), _)| *ws == s && *wi == incarnation)
            .map(|(_, w)| w.target)
            .collect();
        self.seen.writes[s] += 1;
        if !mine.is_empty() {
            self.seen.concurrent_writes += 1;
        }
        if mine.iter().any(|o| *o != t) {
            self.seen.shared_source_writes += 1;
        }
        let lanes = self.sources[s].lane_free_at.len();
        let parts = 1 + self.rng.below(resolved.len().min(lanes) as u64) as usize;
        if parts > 1 {
            self.seen.multi_lane_writes += 1;
        }
        for piece in resolved.chunks(resolved.len().div_ceil(parts)) {
            let source = &mut self.sources[s];
            let lane = source.next_lane % lanes;
            source.next_lane += 1;
            let start = self.now.max(source.lane_free_at[lane]);
            let late = self.rng.chance(self.late_percent);
            let took = if late {
                self.seen.late_pieces += 1;
                self.rng.below(6 * TIMEOUT)
            } else {
                self.rng.below(self.max_put_time)
            };
            let done_at = start + took;
            // A late piece is a late report: its lane moves on meanwhile.
            self.sources[s].lane_free_at[lane] = if late { start } else { done_at };
            let ok = !self.rng.chance(self.put_fail_percent);
            if !ok {
                self.seen.failed_pieces += 1;
            }
            for &(slot, from, key) in piece {
                self.seq += 1;
                self.puts.push(InFlightPut {
                    source: s,
                    incarnation,
                    write,
                    target: t,
                    slot,
                    from,
                    key,
                    done_at,
                    ok,
                    seq: self.seq,
                });
            }
        }
        self.writes.insert(
            (s, incarnation, write),
            WriteTrack {
                target: t,
                left: resolved.len(),
                ok: true,
            },
        );
    }

    pub(super) fn complete_due_puts(&mut self) {
        let now = self.now;
        let (mut due, pending): (Vec<_>, Vec<_>) = self.puts.iter().partition(|p| p.done_at <= now);
        self.puts = pending;
        due.sort_by_key(|p| (p.done_at, p.seq));
        for put in due {
            let target = &mut self.targets[put.target];
            if target.core.slot_is_free(PoolId(0), put.slot as u32) {
                self.violations.push(format!(
                    "a put landed in target {}'s free slot {} ({put:?})",
                    put.target, put.slot
                ));
            }
            let bytes = if put.ok { put.key } else { GARBAGE };
            target.memory.dram.insert(put.slot, bytes);
            let id = (put.source, put.incarnation, put.write);
            if let Some(w) = self.writes.get_mut(&id) {
                w.left -= 1;
                w.ok &= put.ok;
                if w.left == 0 {
                    self.reports.push((id, w.ok));
                    self.writes.remove(&id);
                }
            }
        }
        let (asleep, reports): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reports)
            .into_iter()
            .partition(|((s, ..), _)| self.sources[*s].asleep_until > now);
        self.reports = asleep;
        for ((s, incarnation, write), ok) in reports {
            let source = &mut self.sources[s];
            if incarnation != source.incarnation {
                continue;
            }
            if write < source.max_reported {
                self.seen.out_of_order_reports += 1;
            }
            source.max_reported = source.max_reported.max(write);
            source.core.handle_put_done(now, write, ok);
        }
    }
}
