//! Data streams: TCP connections of kvcr's own that a target dials to a
//! source whose route to it is not one-copy (`crate::net::stream`). As a
//! target we dial them and land their frames into granted slots; as a
//! source we bind each to the route whose session key it proves, and send
//! writes on it as frames.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::protocol::{Body, CompletedIndices, Message, WriteOutcome};
use kvcr_runner_core::PutSpan;

use super::State;
use super::puts::pool_holding;
use super::routes::Route;
use crate::net::ControlChannel;
use crate::net::doorbell::TargetDoorbell;
use crate::net::stream::{InStream, Lander, Landing, OutStream};
use crate::shared::Shared;
use crate::wire::doorbell::OpenedMessage;
use crate::wire::part::{Part, PartFit};
use crate::wire::record::SLOT_BYTES;
use crate::wire::sealing::{KeyInput, Opener, Sealer};

/// Most data streams held while their routes are built (each also holds
/// its place under the control channel's caps until then).
const MAX_PARKED_STREAMS: usize = 64;

/// A data stream dial's outcome: the source, the session (ours, to it)
/// whose key it proved, and the connection with its records' opener
/// (`None`: it failed).
pub(super) type DialedStream = (
    ControlEndpoint,
    u64,
    Option<(tokio::net::TcpStream, Option<Opener>)>,
);

impl State {
    /// Dials a data stream to `source` (beside the metadata we send it, and
    /// again once it acknowledged a route that is not one-copy), proving the
    /// key of our current session to it, unless one for that session is
    /// open or being dialed.
    pub(super) fn dial_stream(&mut self, source: &ControlEndpoint) {
        let Some((session, key)) = self.doorbell.session_key(source) else {
            return;
        };
        if self.dialing.contains(source)
            || self
                .in_streams
                .get(source)
                .is_some_and(|s| s.session == session)
        {
            return;
        }
        self.dialing.insert(source.clone());
        let (source, claim, tx) = (
            source.clone(),
            self.endpoint.clone(),
            self.streams_dialed_tx.clone(),
        );
        let (within, sealed) = (self.stream_limits.0, self.seal_streams);
        tokio::spawn(async move {
            let dial = crate::net::stream::dial(&source, &claim, &key, sealed);
            let socket = tokio::time::timeout(within, dial).await;
            let _ = tx.send((source, session, socket.ok().flatten()));
        });
    }

    /// A data stream dial ended: kept if it proved the session we still
    /// hold to that source and that source does not map us (an
    /// acknowledgement saying it does may have come while the dial ran).
    pub(super) fn stream_dialed(&mut self, (source, session, socket): DialedStream) {
        self.dialing.remove(&source);
        let current = self
            .doorbell
            .session_key(&source)
            .is_some_and(|(s, _)| s == session);
        if let (Some((socket, opener)), true, false) =
            (socket, current, self.doorbell.maps_us(&source))
        {
            self.in_streams
                .insert(source, InStream::new(session, socket, opener));
            self.control
                .stats
                .streams_opened
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A target dialed us a data stream: bound to it (replacing an older
    /// one) only if its proof verifies under the key of the route we built
    /// from that target's session, and it asks for sealed records unless we
    /// allow plain ones; dropped otherwise.
    pub(super) fn bind_out_stream(
        &mut self,
        shared: &Arc<Shared>,
        accepted: crate::net::AcceptedStream,
    ) {
        let Some(route) = self.routes.get(accepted.claim()) else {
            // Its route is not built yet (the target dials beside its
            // metadata): held until it is, or until the handshake deadline.
            let claim = accepted.claim().clone();
            if self.parked_streams.len() < MAX_PARKED_STREAMS
                || self.parked_streams.contains_key(&claim)
            {
                #[allow(clippy::disallowed_methods)]
                let now = Instant::now();
                if self.parked_streams.insert(claim, (now, accepted)).is_some() {
                    self.count_refused_streams(1);
                }
            } else {
                self.count_refused_streams(1);
            }
            return;
        };
        let key = route
            .session_key
            .as_ref()
            .filter(|(key, _)| accepted.proves(key))
            .map(|(_, bytes)| *bytes);
        let hello = &accepted.hello;
        let sealer = match (key, hello.terms.sealed) {
            (Some(key), true) => Sealer::new(&KeyInput {
                session_key: &key,
                challenge: &hello.challenge,
                nonce: &hello.terms.nonce,
                claim: &hello.claim,
            })
            .map(|sealer| (key, Some(sealer))),
            // Plain, where we allow it.
            (Some(key), false) if !self.seal_streams => Some((key, None)),
            _ => None,
        };
        let Some((key, sealer)) = sealer else {
            self.count_refused_streams(1);
            return;
        };
        // Proven: it now takes a session's place (waiting until here).
        let mut accepted = accepted;
        if !accepted.hold.admit() {
            self.count_refused_streams(1);
            return;
        }
        self.control
            .stats
            .streams_opened
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let target = accepted.claim().clone();
        self.drop_out_stream(shared, &target);
        self.out_streams.insert(
            target,
            OutStream::new(key, accepted.socket, sealer, Some(accepted.hold)),
        );
    }

    /// Drops a data stream held for `target`'s route (the route failed, or
    /// its session went).
    pub(super) fn refuse_parked(&mut self, target: &ControlEndpoint) {
        if self.parked_streams.remove(target).is_some() {
            self.count_refused_streams(1);
        }
    }

    fn count_refused_streams(&self, count: u64) {
        self.control
            .stats
            .streams_refused
            .fetch_add(count, std::sync::atomic::Ordering::Relaxed);
    }

    /// Drops the data stream to `target`; the writes it had not sent whole
    /// fail as a failed put would.
    pub(super) fn drop_out_stream(&mut self, shared: &Arc<Shared>, target: &ControlEndpoint) {
        let Some(mut out) = self.out_streams.remove(target) else {
            return;
        };
        let failed = out.take_unsent();
        if !failed.is_empty() {
            shared.with_core_now(|core, now| {
                for write in failed {
                    core.handle_message_sent(now, write, false);
                }
            });
        }
    }

    /// Queues write `write` on `target`'s data stream, when it has one bound
    /// to this route's session key and the write is one a frame can carry
    /// (its completion is the first keys asked for, as a message's is).
    /// `false`: it goes through UCX.
    pub(super) fn send_on_stream(
        &mut self,
        shared: &Arc<Shared>,
        write: u64,
        target: &ControlEndpoint,
        route: &Route,
        spans: &[PutSpan],
    ) -> bool {
        let Some((key, bytes)) = route.session_key.as_ref() else {
            return false;
        };
        // A stream its target closed (it found a record that did not open,
        // say) carries nothing more: its writes go through UCX.
        if self.out_streams.get(target).is_some_and(OutStream::closed) {
            self.drop_out_stream(shared, target);
        }
        let Some(out) = self
            .out_streams
            .get_mut(target)
            .filter(|o| o.key() == bytes)
        else {
            return false;
        };
        let Some(part) = Part::new(0, 1) else {
            return false;
        };
        let Some((op, keys, digest)) = super::landing::write_record(&shared.lock().core, write)
        else {
            return false;
        };
        // Every span is read from our pools only (checked here, once).
        let pieces: Option<Vec<(u64, u64)>> = spans
            .iter()
            .map(|s| pool_holding(&self.pools, s.local, s.len).map(|_| (s.local, s.len)))
            .collect();
        let Some(pieces) = pieces else {
            return false;
        };
        let header = key.seal_message_digested(op, keys, part, digest);
        out.push(write, &header, pieces);
        self.control
            .stats
            .stream_writes_sent
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// Moves bytes on every data stream: frames out as far as the sockets
    /// take them (reporting each write sent whole, or failed with its
    /// stream), frames in as far as they have arrived. `true`: bytes moved.
    pub(super) fn pump_streams(&mut self, shared: &Arc<Shared>) -> bool {
        let mut moved = false;
        if !self.parked_streams.is_empty() {
            #[allow(clippy::disallowed_methods)]
            let now = Instant::now();
            let within = self.stream_limits.0;
            let held = self.parked_streams.len();
            // Past the handshake deadline, or its waiting place taken by a
            // newer connection: dropped.
            self.parked_streams.retain(|_, (since, parked)| {
                now.saturating_duration_since(*since) < within && !parked.hold.displaced()
            });
            self.count_refused_streams((held - self.parked_streams.len()) as u64);
        }
        if !self.out_streams.is_empty() {
            #[allow(clippy::disallowed_methods)]
            let now = Instant::now();
            let (mut sent, mut failed, mut broken) = (Vec::new(), Vec::new(), Vec::new());
            for (target, out) in &mut self.out_streams {
                // Its target closed it (a record did not open, say): nothing
                // queued on it would land, and the next write goes through
                // UCX. Seen at once: its socket turns readable.
                if out.closed() {
                    failed.extend(out.take_unsent());
                    broken.push(target.clone());
                    continue;
                }
                if !out.wants_write() {
                    continue;
                }
                // Every queued span lies in one of our pools (checked by
                // `send_on_stream`, and by the registry), claimed by its
                // write until that write is reported below.
                let pumped = out.pump(&self.memory, &mut sent, now, self.stream_limits.1);
                moved |= pumped.moved;
                if pumped.broken {
                    failed.extend(out.take_unsent());
                    broken.push(target.clone());
                }
            }
            for target in broken {
                self.out_streams.remove(&target);
            }
            if !sent.is_empty() || !failed.is_empty() {
                shared.with_core_now(|core, now| {
                    for write in sent {
                        core.handle_message_sent(now, write, true);
                    }
                    for write in failed {
                        core.handle_message_sent(now, write, false);
                    }
                });
            }
        }
        let (mut broken, mut torn) = (Vec::new(), Vec::new());
        for (source, stream) in &mut self.in_streams {
            let mut lander = FrameLander {
                doorbell: &mut self.doorbell,
                control: &self.control,
                shared,
                source,
                session: stream.session,
                torn: None,
            };
            // The lander grants only the elements of an operation that
            // waits for its reply from this stream's source (the core's
            // landing spans, under its lock), and re-checks that it still
            // waits before every read; only a reply frees those slots, and
            // replies are handed to the core on this thread alone (control
            // messages, doorbells, write messages and these frames), never
            // while this read runs.
            let pumped = stream.pump(&self.memory, &mut lander);
            moved |= pumped.moved;
            torn.extend(lander.torn.take());
            if pumped.broken {
                broken.push(source.clone());
            }
        }
        for source in broken {
            self.in_streams.remove(&source);
        }
        // Failed once their streams are closed: the source sees the close
        // before any request this failure leads to.
        for opened in torn {
            fail_torn(&mut self.doorbell, shared, opened);
        }
        moved
    }
}

/// Ready when a data stream has bytes to read, room for frames that wait,
/// or (ours to a target) was closed; registers every stream for a wake-up
/// otherwise.
pub(super) fn streams_ready(
    in_streams: &HashMap<ControlEndpoint, InStream<OpenedMessage>>,
    out_streams: &HashMap<ControlEndpoint, OutStream>,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<()> {
    let mut ready = false;
    for stream in in_streams.values() {
        ready |= stream.poll_readable(cx).is_ready();
    }
    for stream in out_streams.values() {
        ready |= stream.poll_writable(cx).is_ready();
        ready |= stream.poll_closed(cx).is_ready();
    }
    if ready {
        std::task::Poll::Ready(())
    } else {
        std::task::Poll::Pending
    }
}

/// Lands frames of a data stream from `source` as write messages are
/// landed: a header that opens under the key of the session it proved (the
/// one we still hold to `source`), for an operation sent to `source` that
/// waits for its reply, a part that fits, a length exactly its share.
struct FrameLander<'a> {
    doorbell: &'a mut TargetDoorbell,
    control: &'a ControlChannel,
    shared: &'a Arc<Shared>,
    source: &'a ControlEndpoint,
    session: u64,
    /// The write a record that did not open belonged to.
    torn: Option<OpenedMessage>,
}

impl Lander for FrameLander<'_> {
    type Opened = OpenedMessage;

    fn open(&mut self, len: u64, header: &[u8; SLOT_BYTES]) -> Landing<OpenedMessage> {
        let control = self.control;
        let same_session = self
            .doorbell
            .session_key(self.source)
            .is_some_and(|(s, _)| s == self.session);
        let opened = self
            .doorbell
            .open_message(header, |source| control.dialed_peer(source))
            .filter(|o| same_session && o.done.header.sender_endpoint == *self.source)
            .filter(|o| self.doorbell.fit_part(o) != PartFit::Refused);
        let Some(opened) = opened else {
            return Landing::Discard;
        };
        let spans = self.shared.with_core_now(|core, _| {
            let granted = core.peer_landing_spans(opened.op, opened.keys)?;
            opened.part_pieces(&granted, len)
        });
        match spans {
            Some(spans) => Landing::Into(opened, spans),
            None => Landing::Discard,
        }
    }

    fn still_granted(&mut self, opened: &OpenedMessage) -> bool {
        self.shared
            .with_core_now(|core, _| core.peer_awaits_reply(opened.op))
    }

    fn landed(&mut self, opened: OpenedMessage) {
        let stats = &self.control.stats;
        let doorbell = &mut *self.doorbell;
        let fit = doorbell.fit_part(&opened);
        if fit == PartFit::Refused {
            // Another part landed meanwhile as this one (a source that sent
            // it twice): its bytes were the operation's own; it completes
            // nothing.
            stats
                .stream_writes_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        doorbell.land_part(&opened);
        // Counted before the operation completes: whoever it wakes sees it.
        stats
            .stream_writes_taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if fit == PartFit::Last {
            doorbell.forget_op(opened.op);
            let sent = super::landing::Sent::Write(opened.digest);
            let checked = super::landing::check(self.shared, opened.done, sent);
            self.shared
                .with_core_now(|core, now| checked.hand(core, now));
        }
    }

    fn discarded(&mut self) {
        self.control
            .stats
            .stream_writes_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn torn(&mut self, opened: Option<OpenedMessage>) {
        self.control
            .stats
            .stream_records_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.torn = opened;
    }
}

/// A write whose stream tore while it landed: its slots hold bytes that are
/// not its source's, so every key of it fails as a key whose digest did
/// not match (counted, never seated), at once rather than at its deadline.
fn fail_torn(doorbell: &mut TargetDoorbell, shared: &Arc<Shared>, opened: OpenedMessage) {
    doorbell.forget_op(opened.op);
    let mismatched: Vec<u32> = (0..opened.keys).collect();
    let done = Message {
        header: opened.done.header,
        body: Body::WriteDone {
            op_handle: opened.op,
            outcome: WriteOutcome::Completed(CompletedIndices::new(Vec::new())),
        },
    };
    shared.with_core_now(|core, now| {
        core.handle_write_done_checked(now, done, &mismatched);
    });
}
