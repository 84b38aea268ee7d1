//! The peer protocol's clock: target-op deadlines, the abandonment
//! quarantine, source-write cancellations, the stall latch, and when the
//! peer driver must next wake.

use super::*;

impl Core {
    /// Peer deadlines: target ops past their deadlines move on; source writes
    /// past theirs send a non-terminal cancellation once.
    pub fn handle_peer_timeout(&mut self, now: u64) {
        // Nothing can have expired before the floor: no scan (this runs on
        // every poll for completions and every peer turn).
        if self.peer.as_ref().is_none_or(|p| now < p.timer_floor) {
            return;
        }
        self.expire_peer_timers(now);
        if let Some(peer) = self.peer.as_mut() {
            peer.timer_floor = peer.earliest_timer().unwrap_or(u64::MAX);
        }
    }

    /// Expires every target operation and source write whose timer passed.
    fn expire_peer_timers(&mut self, now: u64) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let unsent: Vec<OpHandle> = peer
            .target
            .ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::AwaitingAck && now >= o.deadline)
            .map(|(h, _)| *h)
            .collect();
        let expired: Vec<OpHandle> = peer
            .target
            .ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::WaitingWriteDone && now >= o.deadline)
            .map(|(h, _)| *h)
            .collect();
        let abandoned: Vec<OpHandle> = peer
            .target
            .ops
            .iter()
            .filter(|(_, o)| o.state == TargetState::WaitingTerminal && now >= o.abandon_deadline)
            .map(|(h, _)| *h)
            .collect();
        let mut cancels = Vec::new();
        for w in peer.source.writes.values_mut() {
            if w.state == WriteState::Writing && now >= w.deadline {
                w.state = WriteState::CancelPending;
                cancels.push((w.target.clone(), w.op));
            }
        }
        for (target, op) in cancels {
            self.send(
                target,
                Body::WriteDone {
                    op_handle: op,
                    outcome: WriteOutcome::Failed { terminal: false },
                },
            );
        }
        for op in unsent {
            // Never sent, so nothing can write: fail and free at once.
            self.finish_target_op_with(now, op, None, FailReason::Timeout);
        }
        for op in expired {
            self.expire_target_op(now, op);
        }
        for op in abandoned {
            let Some(peer) = self.peer.as_mut() else {
                return;
            };
            let Some(target_op) = peer.target.ops.get_mut(&op) else {
                continue;
            };
            // Quarantine: held until proof, however long that takes.
            target_op.state = TargetState::Quarantined;
            target_op.uncertain = true;
            let (source, incarnation) = (target_op.source.clone(), target_op.source_incarnation);
            peer.counters.quarantined += 1;
            peer.notices.push(PeerNotice::Uncertain { op });
            self.send(
                source,
                Body::WriteProbe {
                    op_handle: op,
                    source_incarnation: incarnation,
                },
            );
        }
    }

    /// Called by the peer driver on every turn: a gap of a whole operation
    /// timeout between turns means this process was stalled (stopped,
    /// starved); such a source refuses new writes until its driver has
    /// closed the sessions opened before the stall ([`Core::take_peer_stall`]).
    pub fn handle_tick(&mut self, now: u64) {
        self.latch_stall(now);
        if let Some(peer) = self.peer.as_mut() {
            peer.last_tick = Some(now);
        }
        self.handle_peer_timeout(now);
        self.resend_unacknowledged_metadata(now);
    }

    /// A source that refused our metadata (over its route budget) says
    /// nothing: sources that operations still wait on for an acknowledgement
    /// (a fetch's write, or a device deliver held for the route's answer)
    /// get it again (at most every `metadata_retry_ns`), so they are served
    /// once the source's budget allows, not only the next request.
    fn resend_unacknowledged_metadata(&mut self, now: u64) {
        let Some(peer) = self.peer.as_ref() else {
            return;
        };
        // Every tick, over every op: distinct sources first (few), then
        // their names once each (a sort keyed by the name would format it
        // per comparison: with thousands of ops waiting, whole milliseconds
        // of the peer thread's turn).
        let distinct: HashSet<&ControlEndpoint> = peer
            .target
            .ops
            .values()
            .filter(|o| o.state == TargetState::AwaitingAck)
            .map(|o| &o.source)
            .chain(peer.target.route_waits.iter().map(|w| &w.source))
            .collect();
        let mut waiting: Vec<ControlEndpoint> = distinct.into_iter().cloned().collect();
        waiting.sort_by_cached_key(ToString::to_string);
        for source in waiting {
            self.ensure_metadata(now, &source);
        }
    }

    /// Latches `stalled` when a whole operation timeout has passed since the
    /// last driver turn (the tick or a message may come first after a stop).
    pub(in crate::machine) fn latch_stall(&mut self, now: u64) {
        let timeout = self.operation_timeout_ns;
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let Some(gap) = peer.last_tick.map(|t| now.saturating_sub(t)) else {
            return;
        };
        if gap >= timeout {
            peer.source.stalled = true;
            peer.source.stall_untaken = Some(gap);
            // What waited in the sockets is read within a few turns; a
            // quarter timeout is the idle driver's own wake interval.
            peer.source.drain_until = Some(now.saturating_add(timeout / 4));
            peer.counters.stalls += 1;
            // Counted once: the next turn measures from here.
            peer.last_tick = Some(now);
        }
    }

    /// A stall the driver has not acted on yet: how long this process had
    /// no turn (ns). Reported once per stall. The driver then notes which
    /// sessions were open (any request sent before the stall ended came on
    /// one of them), waits until [`Core::peer_stall_drained`], closes them,
    /// and once each has closed calls [`Core::end_peer_stall`]. Until then
    /// every `start_write` is refused (terminal), so the targets' slots are
    /// freed and nothing that waited is written.
    pub fn take_peer_stall(&mut self) -> Option<u64> {
        self.peer.as_mut()?.source.stall_untaken.take()
    }

    /// Whether a stall's waiting requests have had their time to be read
    /// and refused: the driver may close the sessions opened before it.
    /// `true` once per stall.
    pub fn peer_stall_drained(&mut self, now: u64) -> bool {
        let Some(peer) = self.peer.as_mut() else {
            return false;
        };
        let drained = peer.source.drain_until.is_some_and(|at| now >= at);
        if drained {
            peer.source.drain_until = None;
        }
        drained
    }

    /// Whether new writes are refused for a stall (see
    /// [`Core::take_peer_stall`]).
    pub fn peer_stalled(&self) -> bool {
        self.peer.as_ref().is_some_and(|p| p.source.stalled)
    }

    /// The driver closed every session opened before the stall and handled
    /// all they brought: no request that waited during it can arrive any
    /// more, so new writes are served again. Does nothing while a stall is
    /// still to be taken (a second stall came meanwhile).
    pub fn end_peer_stall(&mut self) {
        if let Some(peer) = self.peer.as_mut()
            && peer.source.stall_untaken.is_none()
        {
            peer.source.stalled = false;
        }
    }

    /// The earliest peer deadline, or earlier: the floor no timer fires
    /// before (an operation that ended since may have set it, or an
    /// abandon deadline that applies only if the write is given up on);
    /// [`Core::handle_peer_timeout`] at that time scans and raises it.
    /// `None` once no operation or write is left, whatever the floor says:
    /// an idle caller is never told to wait.
    pub fn next_peer_deadline(&self) -> Option<u64> {
        let peer = self.peer.as_ref()?;
        let idle = peer.target.ops.is_empty() && peer.source.writes.is_empty();
        (!idle && peer.timer_floor != u64::MAX).then_some(peer.timer_floor)
    }

    /// When the peer driver must next run [`Core::handle_tick`]: the earliest
    /// peer deadline, and at the latest a quarter of the operation timeout
    /// after the last tick (so a stall of this process, a whole operation
    /// timeout between ticks, is still told from an idle sleep).
    pub fn peer_wake_at(&self) -> Option<u64> {
        let peer = self.peer.as_ref()?;
        let guard = peer
            .last_tick
            .map(|t| t.saturating_add(self.operation_timeout_ns / 4));
        // A stall's drain ends on time, not at the next idle wake.
        let drain = peer.source.drain_until;
        let guard = match (guard, drain) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match (self.next_peer_deadline(), guard) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
