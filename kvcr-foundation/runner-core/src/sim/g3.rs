//! G3 jobs in virtual time: each reported after a seeded delay, in any order
//! with everything else; writes that fail (a full disk), reads that fail (an
//! I/O error), and the bytes they move in the model.

use super::*;

/// G3 jobs started, reported and landed.
impl Sim {
    /// The driver runs `peer`'s G3 job: each span reads what its source
    /// place holds now (nothing may write that place, nor touch the one it
    /// writes, until the job is reported) and may fail; the job is reported
    /// after a seeded delay, in any order with everything else.
    pub(super) fn start_g3(&mut self, peer: Peer, job: JobId, transfers: &[Vec<G3Transfer>]) {
        let mut keys = Vec::with_capacity(transfers.len());
        for key in transfers {
            let mut spans: Vec<G3Span> = Vec::with_capacity(key.len());
            for t in key {
                let dram = self.pool_slot(peer, t.addr).map(Place::Dram);
                let (from, to) = match (t.direction, dram, peer) {
                    (G3Direction::Store, Some(d), _) => (d, Place::File(t.slot)),
                    (G3Direction::Load, Some(d), _) => (Place::File(t.slot), d),
                    // A target's deliver reads G3 straight into its
                    // destination.
                    (G3Direction::Load, None, Peer::Target(_)) => {
                        match Target::element_of(t.addr) {
                            Some(e) => (Place::File(t.slot), Place::Element(e)),
                            None => {
                                return self.violation(format!(
                                    "{peer:?}'s G3 job {job:?} reads into {t:?}, no memory of its"
                                ));
                            }
                        }
                    }
                    _ => {
                        return self.violation(format!(
                            "{peer:?}'s G3 job {job:?} writes {t:?} from outside its pool"
                        ));
                    }
                };
                if t.len != BLOCK {
                    self.violation(format!("{peer:?}'s G3 job {job:?}: {t:?} is not one page"));
                }
                for place in [from, to] {
                    if let Place::Dram(slot) = place
                        && self.slot_free(peer, slot)
                    {
                        self.violation(format!(
                            "{peer:?}'s G3 job {job:?} touches its free slot {slot} ({t:?})"
                        ));
                    }
                }
                if let Some(other) = self.in_flight_at(peer, from, true, &spans) {
                    self.violation(format!(
                        "{peer:?}'s G3 job {job:?} reads {from:?} while {other} writes it"
                    ));
                }
                if let Some(other) = self.in_flight_at(peer, to, false, &spans) {
                    self.violation(format!(
                        "{peer:?}'s G3 job {job:?} writes {to:?} while {other} touches it"
                    ));
                }
                let store = t.direction == G3Direction::Store;
                let fail = if store {
                    self.g3_write_fail_percent
                } else {
                    self.g3_read_fail_percent
                };
                spans.push(G3Span {
                    from,
                    to,
                    bytes: self.bytes_at(peer, from),
                    ok: !self.rng.chance(fail),
                    store,
                });
            }
            keys.push(spans);
        }
        let took = if self.rng.chance(self.g3_slow_percent) {
            self.rng.below(2 * TIMEOUT)
        } else {
            self.rng.below(self.max_g3_time)
        };
        let incarnation = match peer {
            Peer::Source(s) => self.sources[s].incarnation,
            Peer::Target(_) => 0,
        };
        self.seq += 1;
        self.g3_jobs.push(InFlightG3 {
            peer,
            incarnation,
            job,
            cancelled: vec![false; keys.len()],
            keys,
            done_at: self.now + took,
            seq: self.seq,
        });
    }

    /// Reports the G3 jobs due by now (in time order; a stopped source's
    /// once it runs again): each span writes what it carries (garbage when
    /// it failed; a failed read leaves its G3 slot untrusted, garbage too),
    /// a key copied only when all its spans were.
    pub(super) fn complete_due_g3(&mut self) {
        let now = self.now;
        let (mut due, pending): (Vec<_>, Vec<_>) = std::mem::take(&mut self.g3_jobs)
            .into_iter()
            .partition(|j| j.done_at <= now && self.g3_report_at(j) <= now);
        self.g3_jobs = pending;
        due.sort_by_key(|j| (j.done_at, j.seq));
        for job in due {
            if let Peer::Source(s) = job.peer
                && self.sources[s].incarnation != job.incarnation
            {
                // Its process is gone: a new one must never hear of it.
                self.violation(format!("{job:?} outlived its source's process"));
                continue;
            }
            let mut outcomes = Vec::with_capacity(job.keys.len());
            for (spans, cancelled) in job.keys.iter().zip(&job.cancelled) {
                // The runner's driver runs a cancelled key anyway; a driver
                // may also skip one that has not started.
                if *cancelled && self.rng.chance(50) {
                    outcomes.push(CopyOutcome::Cancelled);
                    continue;
                }
                for span in spans {
                    self.land_g3(job.peer, span);
                }
                let copied = spans.iter().all(|span| span.ok);
                outcomes.push(if copied {
                    CopyOutcome::Copied
                } else {
                    CopyOutcome::Failed
                });
            }
            self.core(job.peer)
                .handle_copy_done(now, job.job, &outcomes);
            self.deliver_actions(job.peer);
        }
    }

    /// When job `j` can be reported: once done, and once its process runs.
    pub(super) fn g3_report_at(&self, j: &InFlightG3) -> u64 {
        match j.peer {
            Peer::Source(s) => j.done_at.max(self.sources[s].asleep_until),
            Peer::Target(_) => j.done_at,
        }
    }

    /// One G3 span of `peer` ends: its destination holds what it carried,
    /// or garbage.
    fn land_g3(&mut self, peer: Peer, span: &G3Span) {
        let bytes = if span.ok { span.bytes } else { GARBAGE };
        match (span.store, span.ok) {
            (true, true) => self.seen.spills += 1,
            (true, false) => self.seen.failed_spills += 1,
            (false, false) => self.seen.failed_fills += 1,
            (false, true) => match (peer, span.to) {
                (Peer::Source(_), _) => self.seen.source_fills += 1,
                (Peer::Target(_), Place::Element(_)) => self.seen.g3_delivers += 1,
                (Peer::Target(_), _) => self.seen.target_fills += 1,
            },
        }
        if let (false, false, Place::File(slot)) = (span.store, span.ok, span.from) {
            self.memory(peer).files.insert(slot, GARBAGE);
        }
        match span.to {
            Place::Dram(slot) => {
                self.memory(peer).dram.insert(slot, bytes);
                if let Peer::Source(s) = peer {
                    let filled = &mut self.sources[s].filled_from_g3;
                    if span.ok {
                        filled.insert(slot);
                    } else {
                        filled.remove(&slot);
                    }
                }
            }
            Place::File(slot) => {
                self.memory(peer).files.insert(slot, bytes);
            }
            Place::Element(e) => {
                let Peer::Target(t) = peer else {
                    return self.violation(format!("{peer:?} read G3 into element {e}"));
                };
                match self.targets[t].deliveries.get_mut(&e) {
                    None => self.violation(format!(
                        "target {t} read G3 into element {e}, asked by nobody"
                    )),
                    Some((want, copied)) if span.ok => {
                        let want = *want;
                        if bytes == want {
                            *copied = true;
                        } else {
                            self.violation(format!(
                                "target {t} delivers key {want} to element {e} from G3, which held {bytes}"
                            ));
                        }
                    }
                    Some(_) => {}
                }
            }
        }
    }
}
