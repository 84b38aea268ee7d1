//! The source role's answers to probes: sticky fences and the op-handle
//! high-water mark they fold into, and death reports for the incarnations
//! of this endpoint a guard confirmed dead.

use std::collections::HashSet;

use super::*;

impl Core {
    /// The incarnations of this endpoint that a guard confirmed dead (it saw
    /// each process exit by its pidfd: none of them can write anyone's
    /// memory again), oldest first, as the guard's grant lists them. A probe
    /// naming one of them is answered `WriteProbeAck { terminal: true,
    /// dead_incarnation: Some(it) }`, which frees the target's slots of
    /// every op it sent to that incarnation.
    ///
    /// Replaces the previous list. Only the latest
    /// [`MAX_DEAD_INCARNATIONS`] are kept; this runner's own incarnation and
    /// repeats are dropped (a live process is never reported dead). Without
    /// the peer protocol enabled ([`Core::enable_peer`] first) it does
    /// nothing.
    pub fn set_dead_incarnations(&mut self, dead: Vec<Incarnation>) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let own = peer.config.incarnation;
        let mut kept: Vec<Incarnation> = Vec::with_capacity(MAX_DEAD_INCARNATIONS);
        // Newest first, so the bound keeps the latest.
        for incarnation in dead.into_iter().rev() {
            if kept.len() == MAX_DEAD_INCARNATIONS {
                break;
            }
            if incarnation != own && !kept.contains(&incarnation) {
                kept.push(incarnation);
            }
        }
        kept.reverse();
        peer.source.dead = kept;
    }

    /// The guard-confirmed dead incarnations this source reports (oldest
    /// first).
    pub fn dead_incarnations(&self) -> &[Incarnation] {
        self.peer.as_ref().map_or(&[], |p| &p.source.dead)
    }

    pub(in crate::machine) fn on_probe(
        &mut self,
        header: &Header,
        op: OpHandle,
        source_incarnation: Option<Incarnation>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        // A probe for an incarnation the guard saw die: that process writes
        // nothing any more, whatever it had started.
        if let Some(dead) = source_incarnation.filter(|i| peer.source.dead.contains(i)) {
            peer.counters.dead_reported += 1;
            self.send(
                header.sender_endpoint.clone(),
                Body::WriteProbeAck {
                    op_handle: op,
                    terminal: true,
                    dead_incarnation: Some(dead),
                },
            );
            return;
        }
        let ours = source_incarnation.is_none_or(|i| i == peer.config.incarnation);
        if ours {
            // Sticky: a start_write that arrives after its probe never writes.
            peer.source.fence(header.sender, op);
            // A write still being prepared has put nothing: it never will.
            if let Some(prep) = peer.source.preparing.get(&(header.sender, op))
                && let Some(p) = self.source_prepares.get_mut(prep)
            {
                p.refused = true;
            }
        }
        let terminal = ours && !peer.source.writes_by_op.contains_key(&(header.sender, op));
        self.send(
            header.sender_endpoint.clone(),
            Body::WriteProbeAck {
                op_handle: op,
                terminal,
                dead_incarnation: None,
            },
        );
    }
}

impl SourceRole {
    /// Records that `op` of `target` was accepted: ops at or below it never
    /// write again, so fences at or below it are redundant and go.
    pub(super) fn raise_high_water(&mut self, target: Incarnation, op: OpHandle) {
        let high = self.high_water.entry(target).or_insert(op);
        *high = (*high).max(op);
        let high = *high;
        if self.high_water.len() > MAX_REMEMBERED_PEERS {
            // Forget target incarnations with no session: their old frames
            // cannot be replayed into a new session (each has its own keys),
            // and an honest target never re-sends an op on a new session.
            let live: HashSet<Incarnation> = self.routes.values().map(|r| r.incarnation).collect();
            self.high_water
                .retain(|i, _| *i == target || live.contains(i));
            self.fences.retain(|i, _| *i == target || live.contains(i));
        }
        if let Some(fenced) = self.fences.get_mut(&target) {
            *fenced = fenced.split_off(&OpHandle(high.0.saturating_add(1)));
            if fenced.is_empty() {
                self.fences.remove(&target);
            }
        }
    }

    /// Fences `op` of `target`. Past [`MAX_FENCES_PER_TARGET`] the fences fold
    /// into the high-water mark: conservative (a not-yet-arrived lower op is
    /// refused too), and bounded under a probe flood.
    fn fence(&mut self, target: Incarnation, op: OpHandle) {
        if self.high_water.get(&target).is_some_and(|h| op <= *h) {
            return; // already refused by the high-water mark
        }
        let fenced = self.fences.entry(target).or_default();
        fenced.insert(op);
        if fenced.len() > MAX_FENCES_PER_TARGET
            && let Some(highest) = fenced.last().copied()
        {
            self.raise_high_water(target, highest);
        }
    }
}
