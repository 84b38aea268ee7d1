//! What G3 holds, as queries, counters and the structural invariants the
//! tests check.

use super::*;

use std::collections::HashSet;

/// G3 queries, counters and the invariants `check_invariants` runs.
impl Core {
    /// The layout of `key`'s READY G3 copy (a peer's write fills it first).
    pub(in crate::machine) fn g3_layout(&self, key: &ScopedKey) -> Option<u16> {
        let e = self.g3.as_ref()?.entries.get(key)?;
        (e.state == G3State::Ready && !e.poisoned).then_some(e.layout)
    }

    /// Whether G3 holds `key` READY (its bytes are in the file).
    pub fn g3_ready(&self, key: &ScopedKey) -> bool {
        self.g3.as_ref().is_some_and(|g| g.is_ready(key))
    }

    /// G3's counters (with its current occupancy), when configured.
    pub fn g3_counters(&self) -> Option<G3Counters> {
        self.g3.as_ref().map(|g| G3Counters {
            resident: g.entries.len() as u64,
            free_slots: g.free.len() as u64,
            ..g.counters
        })
    }

    /// G3's structural invariants (part of `check_invariants`).
    pub(in crate::machine) fn check_g3(&self) -> std::result::Result<(), String> {
        let Some(g3) = &self.g3 else {
            return if self.capacity_waiters.is_empty() {
                Ok(())
            } else {
                Err("capacity waiters without G3".into())
            };
        };
        let used: usize = g3.entries.values().map(|e| e.slots.len()).sum();
        if g3.free.len() + used != g3.config.slots as usize {
            return Err(format!(
                "g3: {} free + {used} used != {} slots",
                g3.free.len(),
                g3.config.slots
            ));
        }
        let mut slots: HashSet<u32> = HashSet::new();
        for slot in &g3.free {
            if !slots.insert(*slot) {
                return Err(format!("g3: slot {slot} free twice"));
            }
        }
        for (key, e) in &g3.entries {
            if e.slots.is_empty() {
                return Err(format!("g3: {key:?} holds no slot"));
            }
            for slot in &e.slots {
                if !slots.insert(*slot) {
                    return Err(format!("g3: slot {slot} used twice ({key:?})"));
                }
            }
            let should_queue = e.state == G3State::Ready && e.claims == 0 && !e.poisoned;
            if e.queued != should_queue || (e.queued && g3.queue.get(&e.seq) != Some(key)) {
                return Err(format!("g3: {key:?} queued={} but {e:?}", e.queued));
            }
            if e.state == G3State::Storing {
                // A move's DRAM source is claimed and retiring until the
                // spill ends; a spill ahead's is READY (and evicted by none).
                let source = self.index.get(key).and_then(|i| self.record(i.record));
                let held = if e.moving {
                    source.is_some_and(|r| r.claims > 0 && r.flags & FLAG_RETIRE != 0)
                } else {
                    source.is_some_and(|r| r.state == Residency::Ready)
                };
                if !held {
                    return Err(format!("g3: storing {key:?} without its DRAM source held"));
                }
            }
        }
        let ahead = g3
            .entries
            .values()
            .filter(|e| e.state == G3State::Storing && !e.moving)
            .count();
        if ahead != g3.ahead_in_flight {
            return Err(format!(
                "g3: {ahead} spills ahead writing, {} counted",
                g3.ahead_in_flight
            ));
        }
        if g3.queue.len() != g3.entries.values().filter(|e| e.queued).count() {
            return Err("g3: queue and entries disagree".into());
        }
        // Only a spill retires a DRAM page: a retiring page is in G3 (being
        // written, or written and waiting for its last DRAM reader); after a
        // failed spill it keeps serving from DRAM.
        for (key, entry) in &self.index {
            let retiring = self
                .record(entry.record)
                .is_some_and(|r| r.flags & FLAG_RETIRE != 0);
            if retiring && !g3.entries.contains_key(key) {
                return Err(format!("{key:?} retires from DRAM but G3 does not hold it"));
            }
        }
        for w in &self.capacity_waiters {
            let waiting = self
                .ops
                .get(&w.op)
                .and_then(|o| o.entries.get(w.entry as usize))
                .is_some_and(|e| e.result.is_none() && e.wait == Wait::Capacity);
            if !waiting {
                return Err(format!(
                    "capacity waiter {:?}/{} is not waiting",
                    w.op, w.entry
                ));
            }
        }
        Ok(())
    }
}
