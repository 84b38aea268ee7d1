//! The source role's write completions: what a write will report, and the
//! driver's reports that its puts finished or its message left, answered
//! to the target with `write_done`.

use super::*;

impl Core {
    /// What write `write` will report when its bytes land, if that is the
    /// first `n` keys it was asked for (`0..n`, the only outcome a doorbell
    /// record or a write message carries): the target's op and `n`. `None`
    /// once it was cancelled or ended, or when a key before its last was
    /// left out (those writes are reported by `write_done` alone).
    pub fn peer_write_completion(&self, write: u64) -> Option<(OpHandle, u32)> {
        let w = self.peer.as_ref()?.source.writes.get(&write)?;
        let whole = w
            .indices
            .iter()
            .enumerate()
            .all(|(i, index)| usize::try_from(*index).ok() == Some(i));
        // A one-hop write reports by `write_done` alone: its target checks
        // every landed page against that message's digests.
        if w.state != WriteState::Writing || !whole || w.device {
            return None;
        }
        Some((w.op, u32::try_from(w.indices.len()).ok()?))
    }

    /// The driver's report that a put (and its flush) finished.
    pub fn handle_put_done(&mut self, now: u64, write: u64, ok: bool) {
        self.end_write(now, write, ok, false, false);
    }

    /// The driver's report that the first `lead_elements` spans of every
    /// key of one-hop write `write` have landed (its `Action::Put` asked
    /// for it): the target hears it once, while the write is still
    /// running. Nothing is committed; `write_done` still ends the write.
    pub fn handle_put_lead_landed(&mut self, write: u64) {
        let Some(w) = self
            .peer
            .as_mut()
            .and_then(|p| p.source.writes.get_mut(&write))
        else {
            return;
        };
        if w.state != WriteState::Writing || w.lead == 0 {
            return;
        }
        let (target, op, elements) = (w.target.clone(), w.op, w.lead);
        w.lead = 0;
        self.send(
            target,
            Body::WriteLeadLanded {
                op_handle: op,
                elements,
            },
        );
    }

    /// The driver's report that write `write`'s copies into a mapped
    /// target ended well, each page hashed in the pass that copied it and
    /// found as deposited ([`Core::peer_write_pages`]): its `write_done`
    /// says so, and its target need not read the bytes again.
    pub fn handle_put_done_checked_in_copy(&mut self, now: u64, write: u64) {
        self.end_write(now, write, true, false, true);
    }

    /// The driver's report that write `write` left as one message carrying
    /// its bytes and its completion (the record
    /// [`Core::peer_write_completion`] gave), sent `ok` or not. The message
    /// is the target's `write_done`: a successful one sends none (a second
    /// could overtake the bytes, which travel another way); a failed or
    /// cancelled one ends as a put would.
    pub fn handle_message_sent(&mut self, now: u64, write: u64, ok: bool) {
        self.end_write(now, write, ok, true, false);
    }

    fn end_write(
        &mut self,
        now: u64,
        write: u64,
        ok: bool,
        completion_sent: bool,
        checked_in_copy: bool,
    ) {
        let Some(w) = self
            .peer
            .as_mut()
            .and_then(|p| p.source.writes.remove(&write))
        else {
            return;
        };
        if let Some(peer) = self.peer.as_mut() {
            peer.source
                .writes_by_op
                .remove(&(w.target_incarnation, w.op));
            if ok && w.state == WriteState::Writing {
                peer.counters.keys_sent += w.indices.len() as u64;
                peer.counters.bytes_sent += w.bytes;
            }
        }
        // The digests are read while the records are still claimed.
        let digests: Option<Vec<u64>> = w.records.iter().map(|r| self.record_digest(*r)).collect();
        for record in &w.records {
            self.touch(now, *record);
            self.unclaim(*record);
        }
        // After a cancellation the target already gave up: only a terminal
        // failure is proof that we are done with its memory.
        // A one-hop target hashes the device bytes itself: no copy-pass
        // claim for it.
        let checked_in_copy = checked_in_copy && !w.device;
        let outcome = match (ok, w.state) {
            (true, WriteState::Writing) if completion_sent => return,
            (true, WriteState::Writing) => WriteOutcome::Completed(match digests {
                Some(digests) => {
                    let completed = CompletedIndices::with_digests(
                        w.indices.into_iter().zip(digests).collect(),
                    );
                    if checked_in_copy {
                        completed.checked_in_copy()
                    } else {
                        completed
                    }
                }
                None => CompletedIndices::new(w.indices),
            }),
            _ => WriteOutcome::Failed { terminal: true },
        };
        self.send(
            w.target,
            Body::WriteDone {
                op_handle: w.op,
                outcome,
            },
        );
    }
}
