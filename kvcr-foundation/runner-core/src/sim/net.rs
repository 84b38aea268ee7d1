//! The virtual network and clock: messages in flight (dropped, duplicated,
//! delayed), each core's actions carried out, and time moved event by event.

use super::*;

/// Messages, actions and virtual time.
impl Sim {
    /// Takes the messages due by now off the network, in arrival order.
    pub(super) fn take_due(&mut self) -> Vec<(ControlEndpoint, Message)> {
        let due: Vec<(u64, u64)> = self
            .network
            .range(..=(self.now, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        due.into_iter()
            .filter_map(|k| self.network.remove(&k))
            .collect()
    }

    /// Moves the clock by `dt` for a scripted run: every message due is
    /// handled, due puts and messages complete, every core acts; unlike
    /// [`Sim::advance_to`], no core's timers run.
    pub(super) fn deliver_for(&mut self, dt: u64) {
        self.now += dt;
        let now = self.now;
        for (to, message) in self.take_due() {
            self.handle(&to, now, message);
        }
        self.complete_due_puts();
        self.complete_due_messages();
        self.flush();
    }

    /// Runs every core's actions.
    pub(super) fn flush(&mut self) {
        for t in 0..self.targets.len() {
            self.deliver_actions(Peer::Target(t));
        }
        for s in 0..self.sources.len() {
            self.deliver_actions(Peer::Source(s));
        }
    }

    /// Runs `peer`'s actions: sends go on the network, puts on the lanes,
    /// copies and connects are done at once.
    pub(super) fn deliver_actions(&mut self, peer: Peer) {
        while let Some(action) = self.core(peer).poll_action() {
            match action {
                // Replies to the hostile member go nowhere.
                Action::Send { to, .. } if to == endpoint(HOSTILE) => {}
                Action::Send { to, message } => {
                    if let Peer::Target(t) = peer {
                        self.note_target_send(t, &message.body);
                    }
                    if let Body::WriteProbeAck {
                        dead_incarnation: Some(_),
                        ..
                    } = message.body
                    {
                        self.seen.dead_reported += 1;
                    }
                    self.send(to, message);
                }
                Action::Put {
                    write,
                    target,
                    generation,
                    spans,
                    device: false,
                    ..
                } => match peer {
                    Peer::Source(s) => self.start_put(s, write, &target, generation, &spans),
                    Peer::Target(t) => self.violation(format!("target {t} issued a put")),
                },
                // These targets export no device region: nothing grants one.
                Action::Put { device: true, .. } => {
                    self.violation(format!("{peer:?} wrote a device grant nobody made"));
                }
                Action::G3 { job, transfers, .. } => self.start_g3(peer, job, &transfers),
                Action::Copy { job, keys, .. } => {
                    match peer {
                        Peer::Target(t) => self.check_copy(t, &keys),
                        Peer::Source(s) => self.deposit_copy(s, &keys),
                    }
                    let now = self.now;
                    self.core(peer).handle_copy_done(
                        now,
                        job,
                        &vec![CopyOutcome::Copied; keys.len()],
                    );
                }
                Action::Connect {
                    peer: target,
                    generation,
                    shared_memory,
                    ..
                } => {
                    let Peer::Source(s) = peer else {
                        self.violation(format!("{peer:?} connected to {target:?}"));
                        continue;
                    };
                    self.check_route_rate(s, &target);
                    // The driver's connect: now and then UCX refuses it; a
                    // target with shared segments is mapped or not.
                    if self.rng.chance(self.connect_fail_percent) {
                        self.sources[s].routes.remove(&target);
                        let why = if self.rng.chance(50) {
                            ConnectFailure::Unusable
                        } else {
                            ConnectFailure::NoMappingsLeft
                        };
                        self.sources[s]
                            .core
                            .handle_connect_failed(&target, generation, why);
                    } else {
                        let one_copy = shared_memory.is_some() && self.rng.chance(50);
                        self.sources[s].routes.insert(target.clone(), generation);
                        self.sources[s]
                            .core
                            .handle_connected(&target, generation, one_copy);
                    }
                }
                // A copy is done at once (nothing left to cancel); a G3
                // job's key may be skipped when it is reported.
                Action::Cancel { job, key } => {
                    let cancelled = self
                        .g3_jobs
                        .iter_mut()
                        .find(|j| j.peer == peer && j.job == job)
                        .and_then(|j| j.cancelled.get_mut(key as usize));
                    if let Some(cancelled) = cancelled {
                        *cancelled = true;
                    }
                }
            }
        }
    }

    /// What a target sent that the model needs: the slots each write grants,
    /// and which ops it probed (past their deadline).
    fn note_target_send(&mut self, t: usize, body: &Body) {
        let target = &mut self.targets[t];
        match body {
            Body::StartWrite {
                op_handle,
                keys,
                destinations,
                ..
            } => {
                let granted = keys
                    .iter()
                    .zip(destinations)
                    .filter_map(|(k, d)| Some((k.as_u64(), d.first()?.index)))
                    .collect();
                target.grants.entry(*op_handle).or_insert(granted);
            }
            Body::WriteProbe { op_handle, .. } => {
                target.probed.insert(*op_handle);
            }
            _ => {}
        }
    }

    /// Puts a message on the network: maybe dropped, maybe duplicated, each
    /// copy with its own delay, each direction in order.
    fn send(&mut self, to: ControlEndpoint, message: Message) {
        let copies = if self.rng.chance(self.drop_percent) {
            0
        } else if self.rng.chance(5) {
            2
        } else {
            1
        };
        let link = (message.header.sender_endpoint.clone(), to.clone());
        for _ in 0..copies {
            let last = self.link_clock.get(&link).copied().unwrap_or(0);
            let delay = if self.rng.chance(self.slow_percent) {
                self.rng.below(TIMEOUT)
            } else {
                self.rng.below(self.max_delay)
            };
            let at = (self.now + delay).max(last);
            self.link_clock.insert(link.clone(), at);
            self.seq += 1;
            self.network
                .insert((at, self.seq), (to.clone(), message.clone()));
        }
    }

    /// Hands a message to the core it is addressed to, and runs that core's
    /// actions. A target's commits are checked as they happen.
    pub(super) fn handle(&mut self, to: &ControlEndpoint, now: u64, message: Message) {
        match self.peer_of(to) {
            Some(Peer::Target(t)) => {
                let ended = match &message.body {
                    Body::WriteDone { op_handle, outcome } => {
                        Some((*op_handle, matches!(outcome, WriteOutcome::Completed(_))))
                    }
                    Body::WriteRefused { op_handle } => Some((*op_handle, false)),
                    Body::WriteProbeAck { op_handle, .. } => Some((*op_handle, false)),
                    _ => None,
                };
                let from_peer = self.peer_of(&message.header.sender_endpoint).is_some();
                let death_report = matches!(
                    message.body,
                    Body::WriteProbeAck {
                        dead_incarnation: Some(_),
                        ..
                    }
                );
                let target = &mut self.targets[t];
                target.core.drain_events().for_each(drop);
                target.core.take_notices();
                let freed = target.core.peer_counters().dead_freed;
                target.core.handle_message(now, message);
                if death_report {
                    let quiesced = target
                        .core
                        .take_notices()
                        .iter()
                        .filter(|n| matches!(n, crate::PeerNotice::Quiesced { .. }))
                        .count();
                    self.seen.dead_freed_quarantined += quiesced as u64;
                    if target.core.peer_counters().dead_freed > freed + 1 {
                        self.seen.dead_reports_ending_several += 1;
                    }
                }
                let stored: Vec<u64> = target
                    .core
                    .drain_events()
                    .flat_map(|e| match e {
                        // Pages committed in the pool (G3's are stored when
                        // a spill is reported, not here).
                        InventoryEvent::Stored { keys, scope, .. }
                            if scope.medium != Medium::Disk =>
                        {
                            keys
                        }
                        _ => Vec::new(),
                    })
                    .map(BlockKey::as_u64)
                    .collect();
                if let Some((op, true)) = ended
                    && target.probed.contains(&op)
                    && target.grants.contains_key(&op)
                    && from_peer
                {
                    self.seen.late_ends += 1;
                }
                if !stored.is_empty() {
                    self.check_commits(t, ended.map(|(op, _)| op), &stored);
                }
                self.deliver_actions(Peer::Target(t));
            }
            Some(Peer::Source(s)) => {
                self.sources[s].core.handle_message(now, message);
                self.deliver_actions(Peer::Source(s));
            }
            None => {}
        }
    }

    /// Lands the pieces due by now (in time order), then reports each write
    /// whose pieces have all landed to the source incarnation that issued it
    /// (a crashed incarnation's puts may still land, but nobody reports
    /// them).
    /// Write messages that arrived: each is copied into its operation's
    /// landing spans and handled as the write's `write_done`, under one
    /// step (as the driver does under the core lock), or dropped when the
    /// target no longer waits on it or its sender was restarted (the
    /// session key it was sealed with is gone).
    pub(super) fn complete_due_messages(&mut self) {
        let now = self.now;
        let (due, pending): (Vec<_>, Vec<_>) = std::mem::take(&mut self.messages)
            .into_iter()
            .partition(|m| m.arrives_at <= now);
        self.messages = pending;
        for m in due {
            if m.lost || m.incarnation != self.sources[m.source].incarnation {
                continue;
            }
            let target = &mut self.targets[m.target];
            let Some(spans) = target.core.peer_landing_spans(m.op, m.keys) else {
                self.seen.messages_dropped += 1;
                continue;
            };
            let slots: Vec<Option<u64>> = spans
                .iter()
                .map(|&(addr, len)| {
                    if len == BLOCK {
                        target.slot_of(addr)
                    } else {
                        None
                    }
                })
                .collect();
            let addressed: Vec<Option<u64>> =
                m.pieces.iter().map(|&(slot, _)| Some(slot)).collect();
            if slots != addressed {
                self.violations.push(format!(
                    "target {}'s landing spans {slots:?} are not the slots the source addressed: {m:?}",
                    m.target
                ));
                continue;
            }
            for &(slot, key) in &m.pieces {
                target.memory.dram.insert(slot, key);
            }
            self.seen.messages_taken += 1;
            let done = Message {
                header: Header {
                    sender: Incarnation::from_raw(m.incarnation).unwrap(),
                    route_generation: RouteGeneration(0),
                    sender_endpoint: self.sources[m.source].endpoint.clone(),
                },
                body: Body::WriteDone {
                    op_handle: m.op,
                    outcome: WriteOutcome::Completed(CompletedIndices::new((0..m.keys).collect())),
                },
            };
            let to = self.targets[m.target].endpoint.clone();
            self.handle(&to, now, done);
        }
    }

    /// When `peer`'s driver next runs a turn: at its earliest deadline or
    /// stall guard, and not before its process wakes.
    fn wake_at(&self, peer: Peer) -> Option<u64> {
        let (core, asleep_until) = match peer {
            Peer::Target(t) => (&self.targets[t].core, 0),
            Peer::Source(s) => (&self.sources[s].core, self.sources[s].asleep_until),
        };
        let wake = match (core.peer_wake_at(), core.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        wake.map(|w| w.max(asleep_until))
    }

    fn peers(&self) -> impl Iterator<Item = Peer> + use<> {
        let (targets, sources) = (self.targets.len(), self.sources.len());
        (0..targets)
            .map(Peer::Target)
            .chain((0..sources).map(Peer::Source))
    }

    /// Moves time on to `end`, everything in time order: pieces land when
    /// due, messages arrive when due, and each driver runs its turns when it
    /// asks to (as the real one sleeps until `peer_wake_at`); a stopped
    /// process handles nothing until it wakes.
    pub(super) fn advance_to(&mut self, end: u64) {
        for _ in 0..10_000 {
            let wakes: Vec<(Peer, Option<u64>)> =
                self.peers().map(|p| (p, self.wake_at(p))).collect();
            let lands = self.puts.iter().map(|p| p.done_at);
            let reports = self
                .reports
                .iter()
                .map(|((s, ..), _)| self.sources[*s].asleep_until);
            let messages = self.network.keys().next().map(|k| k.0);
            let write_messages = self.messages.iter().map(|m| m.arrives_at);
            let g3 = self.g3_jobs.iter().map(|j| self.g3_report_at(j));
            let next = wakes
                .iter()
                .filter_map(|(_, w)| *w)
                .chain(lands)
                .chain(reports)
                .chain(messages)
                .chain(write_messages)
                .chain(g3)
                .min()
                .filter(|w| *w <= end);
            let Some(at) = next else { break };
            self.now = self.now.max(at);
            let now = self.now;
            self.complete_due_puts();
            self.complete_due_messages();
            self.complete_due_g3();
            while let Some(&(at, seq)) = self.network.keys().next().filter(|k| k.0 <= now) {
                let Some((to, message)) = self.network.remove(&(at, seq)) else {
                    break;
                };
                if let Some(until) = self.asleep_until(&to) {
                    // Waits in the socket until its process runs again.
                    self.seq += 1;
                    self.network.insert((until, self.seq), (to, message));
                } else {
                    self.handle(&to, now, message);
                }
            }
            for (peer, wake) in wakes {
                if wake.is_some_and(|w| w <= now) {
                    let core = self.core(peer);
                    core.handle_tick(now);
                    core.handle_timeout(now);
                    // The driver's stall recovery: every request that waited
                    // while the process slept came when it woke, before the
                    // drain ends (the runner closes the sessions they came
                    // on), so it serves again then.
                    core.take_peer_stall();
                    if core.peer_stall_drained(now) {
                        core.end_peer_stall();
                        self.seen.stall_recoveries += 1;
                    }
                    if self.wake_at(peer).is_some_and(|w| w <= now) {
                        self.violation(format!("{peer:?} asks to wake at {now} again"));
                        return;
                    }
                }
            }
            self.flush();
        }
        self.now = self.now.max(end);
    }

    /// Moves time on by a random amount below `most`.
    pub(super) fn advance(&mut self, most: u64) {
        let end = self.now + self.rng.below(most);
        self.advance_to(end);
    }

    /// Whether the process at `to` is stopped at the moment.
    fn asleep_until(&self, to: &ControlEndpoint) -> Option<u64> {
        match self.peer_of(to) {
            Some(Peer::Source(s)) => Some(self.sources[s].asleep_until).filter(|u| *u > self.now),
            _ => None,
        }
    }
}
