//! The target role's endings: sources' replies and probe answers,
//! quarantined ops probed again, death reports, and target ops finished or
//! expired (fills committed, failed or discarded).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::*;

impl Core {
    /// Probes again, each naming the incarnation it was sent to, up to
    /// [`MAX_REPROBES_PER_ACK`] of the quarantined ops of `source` (oldest
    /// first, starting after the last one the previous round probed): the
    /// process answering there now may know that incarnation dead (or be it,
    /// and know the write ended), and an earlier probe or its answer may
    /// have been lost with a session.
    pub(super) fn reprobe_quarantined(&mut self, source: &ControlEndpoint) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let quarantined: Vec<(OpHandle, Option<Incarnation>)> = peer
            .target
            .ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::Quarantined && o.source == *source)
            .map(|(h, o)| (*h, o.source_incarnation))
            .collect();
        let Some(state) = peer.target.sources.get_mut(source) else {
            return;
        };
        let after = state.reprobed_up_to;
        let start = quarantined
            .iter()
            .position(|(h, _)| after.is_none_or(|a| *h > a))
            .unwrap_or(0);
        let round: Vec<(OpHandle, Option<Incarnation>)> = quarantined
            .iter()
            .cycle()
            .skip(start)
            .take(quarantined.len().min(MAX_REPROBES_PER_ACK))
            .copied()
            .collect();
        state.reprobed_up_to = round.last().map(|(h, _)| *h);
        peer.counters.reprobes += round.len() as u64;
        for (op, incarnation) in round {
            self.send(
                source.clone(),
                Body::WriteProbe {
                    op_handle: op,
                    source_incarnation: incarnation,
                },
            );
        }
    }

    /// A source's answer to our probe. `dead`: a death report (the process
    /// now at the op's endpoint says the guard confirmed the incarnation the
    /// op was sent to dead). Otherwise a terminal answer is proof only from
    /// the incarnation the op was sent to.
    pub(in crate::machine) fn on_probe_ack(
        &mut self,
        now: u64,
        header: &Header,
        op: OpHandle,
        terminal: bool,
        dead: Option<Incarnation>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let Some(target_op) = peer.target.ops.get(&op) else {
            return; // a late duplicate, or an op from before a restart
        };
        let probed = matches!(
            target_op.state,
            TargetState::WaitingTerminal | TargetState::Quarantined
        );
        let from_source = target_op.source == header.sender_endpoint;
        match dead {
            Some(dead) => {
                // Believed only from the op's own source endpoint (the
                // session's identity, never the frame's), about the very
                // incarnation the op was sent to, and from another process
                // (one never reports itself dead).
                let believed = from_source
                    && probed
                    && target_op.source_incarnation == Some(dead)
                    && header.sender != dead;
                if believed {
                    self.on_incarnation_dead(now, &header.sender_endpoint, dead);
                } else {
                    peer.counters.dead_ignored += 1;
                }
            }
            None => {
                let proof = terminal
                    && from_source
                    && probed
                    && target_op.source_incarnation == Some(header.sender);
                if proof {
                    self.finish_target_op(now, op, None);
                }
            }
        }
    }

    /// `dead`, an incarnation of `source`, is guard-confirmed dead: it will
    /// never write again, so every op sent to it ends now and its slots are
    /// freed (a quarantined one with its quiesced notice; one still waiting
    /// for its `write_done` fails). The next write to `source` waits for a
    /// fresh ack.
    fn on_incarnation_dead(&mut self, now: u64, source: &ControlEndpoint, dead: Incarnation) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let ended: Vec<OpHandle> = peer
            .target
            .ops
            .iter()
            .filter(|(_, o)| {
                o.source == *source
                    && o.source_incarnation == Some(dead)
                    && o.state != TargetState::AwaitingAck
            })
            .map(|(h, _)| *h)
            .collect();
        peer.counters.dead_freed += ended.len() as u64;
        if let Some(state) = peer.target.sources.get_mut(source)
            && state.incarnation == Some(dead)
        {
            state.acked = false;
            state.one_copy = false;
            state.device = false;
            state.incarnation = None;
            state.last_metadata_ns = None;
        }
        for op in ended {
            if let Some(hint) = self.request_hint_of(op) {
                hint.failed = true;
            }
            self.finish_target_op(now, op, None);
        }
    }

    /// A write ended: `None` is a refusal; `Some(outcome)` a `write_done`.
    pub(in crate::machine) fn on_write_end(
        &mut self,
        now: u64,
        header: &Header,
        op: OpHandle,
        outcome: Option<WriteOutcome>,
    ) {
        let Some(target_op) = self.peer.as_ref().and_then(|p| p.target.ops.get(&op)) else {
            self.refuse(); // unknown op handle (e.g. from before a restart)
            return;
        };
        let from_source = target_op.source == header.sender_endpoint
            && target_op.source_incarnation == Some(header.sender)
            && target_op.state != TargetState::AwaitingAck;
        if !from_source {
            self.refuse(); // only this op's own source may end it
            return;
        }
        match outcome {
            Some(WriteOutcome::Failed { terminal: false }) => {
                // Cancelled but maybe still in flight: wait for proof.
                if target_op.state == TargetState::WaitingWriteDone {
                    self.expire_target_op(now, op);
                }
            }
            Some(WriteOutcome::Completed(indices)) => {
                let valid = indices
                    .as_slice()
                    .iter()
                    .all(|i| (*i as usize) < target_op.keys.len());
                if valid {
                    self.finish_target_op(now, op, Some(indices));
                } else {
                    self.refuse();
                    self.finish_target_op(now, op, None);
                }
            }
            Some(WriteOutcome::Failed { terminal: true }) | None => {
                if outcome.is_none()
                    && let Some(state) = self
                        .peer
                        .as_mut()
                        .and_then(|p| p.target.sources.get_mut(&header.sender_endpoint))
                {
                    state.acked = false;
                    state.device = false;
                    state.incarnation = None;
                }
                if let Some(hint) = self.request_hint_of(op) {
                    hint.failed = true;
                }
                self.finish_target_op(now, op, None);
            }
        }
    }

    pub(in crate::machine) fn request_hint_of(&mut self, op: OpHandle) -> Option<&mut RequestHint> {
        let peer = self.peer.as_mut()?;
        let request = peer.target.ops.get(&op)?.request.clone()?;
        peer.target.hints.get_mut(&request)
    }

    /// Ends a target op with terminal knowledge: `Some(indices)` commits those
    /// keys if the op is still waiting (a late success only frees); `None`
    /// fails or frees everything.
    pub(in crate::machine) fn finish_target_op(
        &mut self,
        now: u64,
        op: OpHandle,
        completed: Option<CompletedIndices>,
    ) {
        self.finish_target_op_with(now, op, completed, FailReason::NoSource);
    }

    pub(in crate::machine) fn finish_target_op_with(
        &mut self,
        now: u64,
        op: OpHandle,
        completed: Option<CompletedIndices>,
        failure: FailReason,
    ) {
        let Some(target_op) = self.peer.as_mut().and_then(|p| p.target.ops.remove(&op)) else {
            return;
        };
        let on_time = target_op.state == TargetState::WaitingWriteDone;
        let digests: HashMap<u32, u64> = completed
            .as_ref()
            .and_then(|c| {
                Some(
                    c.as_slice()
                        .iter()
                        .copied()
                        .zip(c.digests()?.iter().copied()),
                )
            })
            .into_iter()
            .flatten()
            .collect();
        let completed: HashSet<u32> = completed
            .map(|c| c.as_slice().iter().copied().collect())
            .unwrap_or_default();
        let mismatched: HashSet<u32> = match self.landing_mismatch.take() {
            Some((mismatch_op, keys)) if mismatch_op == op => keys.into_iter().collect(),
            other => {
                self.landing_mismatch = other;
                HashSet::new()
            }
        };
        if !target_op.one_hop.is_empty() {
            let checked = self.landing_checked == Some(op);
            let ended = super::one_hop::TargetEnd {
                target_op,
                on_time,
                checked,
                completed,
                digests,
                mismatched,
            };
            self.finish_one_hop(op, ended, failure);
            self.check_pressure();
            return;
        }
        let checked_in_copy = match self.landing_checked_in_copy {
            Some((checked_op, combined)) if checked_op == op && on_time => Some(combined),
            _ => None,
        };
        let mut late_pages = Vec::new();
        let mut stored = Vec::new();
        let mut deliver_next = BTreeMap::new();
        let mut received = 0;
        let mut missing = Vec::new();
        for (i, (fill, key)) in target_op.fills.iter().zip(&target_op.keys).enumerate() {
            let index = i as u32;
            let landed = on_time && completed.contains(&index);
            let altered = on_time && mismatched.contains(&index);
            if landed {
                received += 1;
                // The source's digest, which the driver checked against
                // the landed bytes: the page can be served on with it.
                let digest = digests.get(&index).copied();
                self.set_fill_digest(*fill, digest);
                if let (None, Some(_)) = (digest, checked_in_copy)
                    && let Some(fill) = self.fills.get(*fill as usize).and_then(Option::as_ref)
                {
                    late_pages.push((index, fill.record, *key));
                }
            } else if on_time {
                missing.push(key.key);
            }
            let result = match (landed, altered) {
                (true, _) => Ok(()),
                (false, true) => Err(FailReason::DigestMismatch),
                (false, false) => Err(failure),
            };
            if altered && let Some(peer) = self.peer.as_mut() {
                peer.counters.digest_mismatches += 1;
            }
            self.finish_fill(now, *fill, result, &mut stored, &mut deliver_next);
        }
        self.publish_stored(&stored);
        if let Some(combined) = checked_in_copy
            && !late_pages.is_empty()
        {
            let source = (target_op.source.clone(), target_op.source_incarnation);
            self.await_late_digests(op, source, combined, late_pages);
        }
        for (waiter_op, entries) in deliver_next {
            self.start_delivers(now, waiter_op, entries);
        }
        self.note_target_end(op, &target_op, received, missing);
        let ops: Vec<OpHandle> = self.ops.keys().copied().collect();
        for o in ops {
            self.finish_if_done(o);
        }
        self.check_pressure();
    }

    /// The op deadline passed: fills become DISCARDING (callers fail now, the
    /// slots stay owned), the peer's metadata is invalidated, probe #1 goes out.
    pub(in crate::machine) fn expire_target_op(&mut self, now: u64, op: OpHandle) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let Some(target_op) = peer.target.ops.get_mut(&op) else {
            return;
        };
        target_op.state = TargetState::WaitingTerminal;
        let fills = target_op.fills.clone();
        let source = target_op.source.clone();
        let source_incarnation = target_op.source_incarnation;
        if let Some(state) = peer.target.sources.get_mut(&source) {
            state.acked = false;
            state.device = false;
        }
        for fill in fills {
            let Some(f) = self.fills.get_mut(fill as usize).and_then(Option::as_mut) else {
                continue;
            };
            let record = f.record;
            let waiters = std::mem::take(&mut f.waiters);
            for (waiter_op, entry) in waiters {
                self.set_result(waiter_op, entry, EntryResult::failed(FailReason::Timeout));
            }
            if self
                .record(record)
                .is_some_and(|r| r.state == Residency::Filling)
            {
                self.transition(record, Residency::Discarding, "remote fill expired");
            }
        }
        let ops: Vec<OpHandle> = self.ops.keys().copied().collect();
        for o in ops {
            self.finish_if_done(o);
        }
        let _ = now;
        self.send(
            source,
            Body::WriteProbe {
                op_handle: op,
                source_incarnation,
            },
        );
    }

    /// What every end of a target operation records: the keys received,
    /// the notice that an uncertain operation is quiet now, and the keys
    /// its source lacked (the request's hint stops offering them).
    pub(in crate::machine::peer) fn note_target_end(
        &mut self,
        op: OpHandle,
        target_op: &TargetOp,
        received: u64,
        missing: Vec<BlockKey>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        peer.counters.keys_received += received;
        if target_op.uncertain {
            peer.notices.push(PeerNotice::Quiesced { op });
        }
        if let Some(hint) = target_op
            .request
            .as_ref()
            .and_then(|r| peer.target.hints.get_mut(r))
        {
            hint.missing.extend(missing);
        }
    }
}
