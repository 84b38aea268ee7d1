//! The model of the bytes: per pool slot, G3 slot and deliver destination of
//! every node, the key whose bytes are there, and the transfers in flight
//! that read or write each place.

use super::*;

/// What each place holds, and what touches it.
impl Sim {
    pub(super) fn memory(&mut self, peer: Peer) -> &mut Contents {
        match peer {
            Peer::Target(t) => &mut self.targets[t].memory,
            Peer::Source(s) => &mut self.sources[s].memory,
        }
    }

    /// The pool slot of `peer` at `address`.
    pub(super) fn pool_slot(&self, peer: Peer, address: u64) -> Option<u64> {
        match peer {
            Peer::Target(t) => self.targets[t].slot_of(address),
            Peer::Source(s) => self.sources[s].slot_of(address),
        }
    }

    pub(super) fn slot_free(&self, peer: Peer, slot: u64) -> bool {
        let core = match peer {
            Peer::Target(t) => &self.targets[t].core,
            Peer::Source(s) => &self.sources[s].core,
        };
        core.slot_is_free(PoolId(0), slot as u32)
    }

    /// What the model holds at `place` of `peer`.
    pub(super) fn bytes_at(&self, peer: Peer, place: Place) -> u64 {
        let memory = match peer {
            Peer::Target(t) => &self.targets[t].memory,
            Peer::Source(s) => &self.sources[s].memory,
        };
        let bytes = match place {
            Place::Dram(slot) => memory.dram.get(&slot),
            Place::File(slot) => memory.files.get(&slot),
            Place::Element(_) => None,
        };
        bytes.copied().unwrap_or(GARBAGE)
    }

    /// What in flight on `peer` writes `place` (or, unless `writes_only`,
    /// reads it): a G3 span of `extra` (the job being planned) or of a job in
    /// flight, a put into a target's slot, or a put out of a source's slot.
    pub(super) fn in_flight_at(
        &self,
        peer: Peer,
        place: Place,
        writes_only: bool,
        extra: &[G3Span],
    ) -> Option<String> {
        let touches = |span: &G3Span| span.to == place || (!writes_only && span.from == place);
        if let Some(span) = extra.iter().find(|span| touches(span)) {
            return Some(format!("the same job's {span:?}"));
        }
        let g3 = self
            .g3_jobs
            .iter()
            .filter(|j| j.peer == peer)
            .find_map(|j| {
                j.keys
                    .iter()
                    .flatten()
                    .find(|span| touches(span))
                    .map(|span| (j.job, *span))
            });
        if let Some((job, span)) = g3 {
            return Some(format!("G3 job {job:?}'s {span:?}"));
        }
        let Place::Dram(slot) = place else {
            return None;
        };
        let put = match peer {
            Peer::Target(t) => self.puts.iter().find(|p| p.target == t && p.slot == slot),
            Peer::Source(s) if !writes_only => {
                let incarnation = self.sources[s].incarnation;
                self.puts
                    .iter()
                    .find(|p| p.source == s && p.incarnation == incarnation && p.from == slot)
            }
            Peer::Source(_) => None,
        };
        put.map(|p| format!("{p:?}"))
    }

    /// A deposit's copy into source `s`'s pool: the slot is allocated and
    /// nothing in flight touches it; it then holds the deposited key.
    pub(super) fn deposit_copy(&mut self, s: usize, keys: &[Vec<CopySpan>]) {
        let first = SOURCE_FIRST_KEY[s];
        for span in keys.iter().flatten() {
            let Some(slot) = self.sources[s].slot_of(span.dst) else {
                return self.violation(format!("source {s} copies {span:?} outside its pool"));
            };
            if self.slot_free(Peer::Source(s), slot) {
                self.violation(format!("source {s} deposits into its free slot {slot}"));
            }
            if let Some(other) = self.in_flight_at(Peer::Source(s), Place::Dram(slot), false, &[]) {
                self.violation(format!(
                    "source {s} deposits into slot {slot} while {other} touches it"
                ));
            }
            let bytes = host_key(first, span.src).unwrap_or(GARBAGE);
            let source = &mut self.sources[s];
            source.memory.dram.insert(slot, bytes);
            source.filled_from_g3.remove(&slot);
        }
    }
}
