//! What the device world checks after every step, besides both cores'
//! structural invariants: no lead reported before its elements landed or
//! after its deliver ended; no deliver entry reported while a copy into
//! its element may still land; and a success only where the element holds
//! its key's page.

use super::*;

impl DeviceWorld {
    pub(super) fn check(&mut self) -> Result<(), String> {
        if let Some(v) = self.violations.first() {
            return Err(v.clone());
        }
        self.target
            .check_invariants()
            .map_err(|e| format!("target: {e}"))?;
        self.source
            .check_invariants()
            .map_err(|e| format!("source: {e}"))?;
        for (deliver, pages) in self.target.drain_leads_landed() {
            // Reported once, before the deliver ends, over pages whose
            // copies have all got past their lead.
            let Some((placed, _)) = self.delivers.get(&deliver) else {
                return Err(format!("deliver {deliver:?}: lead reported after it ended"));
            };
            if !self.leads.insert(deliver) {
                return Err(format!("deliver {deliver:?}: lead reported twice"));
            }
            let covered = placed.get(..pages as usize).ok_or_else(|| {
                format!(
                    "deliver {deliver:?}: lead over {pages} of {} pages",
                    placed.len()
                )
            })?;
            for (key, element) in covered {
                let unlanded = self.transfers.iter().any(|t| {
                    t.device && t.lead_at.is_some() && t.pieces.iter().any(|(e, _)| e == element)
                });
                if unlanded || !self.device.contains_key(element) {
                    return Err(format!(
                        "deliver {deliver:?}: lead reported, key {key}'s element {element} \
                         not landed"
                    ));
                }
            }
            self.seen.leads_reported += 1;
        }
        let mut done = Vec::new();
        self.target.drain_completed(&mut done);
        for result in done {
            let Some((placed, sent_at)) = self.delivers.remove(&result.op) else {
                continue;
            };
            self.leads.remove(&result.op);
            for ((key, element), (_, entry)) in placed.iter().zip(&result.entries) {
                let in_flight = self
                    .transfers
                    .iter()
                    .any(|t| t.device && t.pieces.iter().any(|(e, _)| e == element));
                if in_flight {
                    return Err(format!(
                        "deliver {:?}: element {element} reported while a copy may land",
                        result.op
                    ));
                }
                let granted = self.granted.remove(element).is_some();
                if entry.status == EntryStatus::Success {
                    let held = self.device.get(element).copied().unwrap_or(GARBAGE);
                    if held != *key {
                        return Err(format!(
                            "deliver {:?}: key {key} reported delivered, element {element} \
                             holds {held:#x}",
                            result.op
                        ));
                    }
                    if granted {
                        self.seen.one_hop_successes += 1;
                    } else {
                        self.seen.two_hop_successes += 1;
                    }
                }
                if granted && self.now >= sent_at + TIMEOUT {
                    self.seen.held_past_deadline += 1;
                }
            }
        }
        let counters = self.target.peer_counters();
        self.seen.fallbacks = counters.one_hop_fallbacks;
        self.seen.dead_freed = counters.dead_freed;
        Ok(())
    }
}
