//! The channel: the peer thread's handle on its control sessions
//! ([`ControlChannel`]), each session's sending side and queue
//! ([`SessionOut`]), and the items the channel's tasks hand the peer thread
//! ([`Inbound`], turned into [`ChannelEvent`]s).
//!
//! A target's requests go on the session it dials to a source (dialed on
//! first use, queued until established); a source's replies go back on the
//! session the target opened. A message is sealed in the sender's turn and
//! written by [`ControlChannel::flush`] at the end of it; what the socket
//! does not take, the session task writes as it drains.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Buf, BytesMut};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, mpsc};
use tokio::time::Instant;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::codec::FrameCodec;
use kvcr_contracts::protocol::{Body, Message};

use super::admission::Waiting;
use super::limits::{ControlLimits, ControlStats};
use super::listener::accept_loop;
use super::member::{KeylessSources, StaticKey};
use super::session::{
    self, LocalMember, PeerIdentity, RECORD_MAX, RECORD_PLAIN_MAX, TAG_LEN, seal,
};
use super::stream::AcceptedStream;
use crate::wire::numbering::{Arrival, MessageCount};

/// Bound of each outgoing queue (messages) before its session is established.
pub(crate) const QUEUE_DEPTH: usize = 4096;

/// Which end of a session this runner is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// We dialed: we are the target; the peer is a source.
    Dialed,
    /// We accepted: the peer is a target; we are its source.
    Accepted,
}

impl Side {
    /// Whether a message with this body may arrive on a session of this side.
    pub(super) fn admits(self, body: &Body) -> bool {
        is_request(body) == (self == Self::Accepted)
    }
}

/// A target's request to a source (travels on the target's dialed session);
/// everything else is a source's reply (travels back on the same session).
fn is_request(body: &Body) -> bool {
    matches!(
        body,
        Body::TargetMetadata { .. }
            | Body::StartWrite { .. }
            | Body::WriteProbe { .. }
            | Body::RouteProof { .. }
    )
}

/// What a session task tells the peer thread, in session order.
pub(crate) enum Inbound {
    Opened {
        session: u64,
        side: Side,
        peer: PeerIdentity,
        /// The session's sending side (accepted sessions: the channel
        /// registers it for replies; dialed ones are registered when dialed).
        out: Option<Arc<SessionOut>>,
    },
    Message {
        message: Message,
        /// The session it came on.
        session: u64,
        /// Returned to the session's inbound budget when handled.
        _budget: OwnedSemaphorePermit,
    },
    Closed {
        session: u64,
        side: Side,
        peer: PeerIdentity,
    },
    /// A data stream was dialed to us (its proof not yet checked).
    Stream(AcceptedStream),
}

/// What the peer thread does with an [`Inbound`] item.
#[derive(Debug)]
pub(crate) enum ChannelEvent {
    /// A message from a peer, its header rewritten with the session's
    /// identity, and the session it came on.
    Message(Message, u64),
    /// A session we dialed (to a source) closed: what answered there may be
    /// gone.
    SourceLost(ControlEndpoint),
    /// The current session from a target closed: its routes can go.
    TargetGone(ControlEndpoint),
    /// A data stream arrived, to be proven.
    Stream(AcceptedStream),
}

/// One session as the channel holds it.
pub(super) struct Session {
    pub(super) id: u64,
    pub(super) out: Arc<SessionOut>,
    /// Who answered a session we dialed, once its handshake proved it.
    answered: Option<Incarnation>,
    /// An accepted session's messages, as read and as taken early.
    count: MessageCount,
}

impl Session {
    fn new(id: u64, out: Arc<SessionOut>, answered: Option<Incarnation>) -> Self {
        Self {
            id,
            out,
            answered,
            count: MessageCount::default(),
        }
    }
}

/// A message [`ControlChannel::send`] sealed or queued: the session it
/// went on, its index there, and its encoded frame.
pub(crate) struct Sent<'a> {
    pub(crate) session: u64,
    pub(crate) index: u64,
    pub(crate) frame: &'a [u8],
}

/// The sending side of one session, shared by the channel (the peer
/// thread's sends) and the session task. Both run on the peer thread's
/// runtime, so its lock is never contended.
pub(crate) struct SessionOut {
    state: Mutex<OutState>,
    /// Wakes the session task: bytes wait, or the session was dropped.
    pub(super) wake: Notify,
}

/// A session's sending state, under [`SessionOut`]'s lock.
pub(super) struct OutState {
    /// Frames of the messages sent before the session is established (at
    /// most [`QUEUE_DEPTH`] messages), encoded when sent; sealed, in order,
    /// when it is.
    queued: BytesMut,
    /// Messages in `queued`.
    queued_count: usize,
    /// Messages this session has carried or holds to carry: the next one's
    /// index in the session (a mailbox request names it, see
    /// `crate::wire::mailbox`). Only a message whose frame is on the wire or
    /// queued counts, so the peer's count of what it read agrees.
    sent: u64,
    /// The established session's socket and cipher (the session task
    /// decrypts under this lock too: one Noise state serves both directions).
    pub(super) link: Option<Link>,
    /// Sealed records the socket has not taken yet, in nonce order.
    pub(super) wire: BytesMut,
    /// Since when `wire` has held bytes (the frame deadline runs from here).
    pub(super) pending_since: Option<Instant>,
    /// The session ended, or the channel dropped it: nothing more is sent.
    pub(super) closed: bool,
    sealed: Vec<u8>,
}

/// An established session's socket and Noise transport.
pub(super) struct Link {
    pub(super) stream: Arc<TcpStream>,
    pub(super) transport: snow::TransportState,
}

impl SessionOut {
    pub(super) fn new(link: Option<Link>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(OutState {
                queued: BytesMut::new(),
                queued_count: 0,
                sent: 0,
                link,
                wire: BytesMut::new(),
                pending_since: None,
                closed: false,
                sealed: vec![0u8; RECORD_MAX],
            }),
            wake: Notify::new(),
        })
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Ends the session: nothing more is sent, and its task stops.
    pub(super) fn close(&self) {
        self.lock().shut();
        self.wake.notify_one();
    }

    /// Seals `frame` (one encoded message) onto the wire, or queues it until
    /// the session is established; `Some(its index in the session)`, or
    /// `None`: dropped (closed, queue full, or it could not be sealed,
    /// which closes the session).
    fn send(&self, limits: &ControlLimits, frame: &[u8]) -> Option<u64> {
        let mut state = self.lock();
        let st = &mut *state;
        if st.closed {
            return None;
        }
        if st.link.is_none() {
            if st.queued_count >= QUEUE_DEPTH {
                return None;
            }
            st.queued.extend_from_slice(frame);
            st.queued_count += 1;
            return Some(st.take_index());
        }
        let records = frame.len().div_ceil(RECORD_PLAIN_MAX);
        let sealed_len = frame.len() + records * (2 + TAG_LEN);
        if st.wire.len() + sealed_len > limits.outbound_bytes_per_session {
            return None;
        }
        let index = st.seal_frames(frame).then(|| st.take_index());
        drop(state);
        // The session task writes it if nobody flushes first.
        self.wake.notify_one();
        index
    }

    /// Writes what the socket takes now, without waiting.
    fn write_now(&self) {
        let mut state = self.lock();
        state.write_now();
        if state.closed {
            drop(state);
            self.wake.notify_one();
        }
    }
}

impl OutState {
    /// Ends the session: drops its socket (the session task's own handle
    /// goes with the task, so the connection closes) and whatever was not
    /// written.
    pub(super) fn shut(&mut self) {
        self.closed = true;
        self.link = None;
        self.queued.clear();
        self.queued_count = 0;
        self.wire.clear();
        self.pending_since = None;
    }

    /// Seals `frames` onto `wire`; a sealing failure closes the session.
    fn seal_frames(&mut self, frames: &[u8]) -> bool {
        let Some(link) = self.link.as_mut() else {
            return false;
        };
        if self.wire.is_empty() {
            self.pending_since = Some(Instant::now());
        }
        if seal(
            &mut link.transport,
            frames,
            &mut self.sealed,
            &mut self.wire,
        )
        .is_none()
        {
            self.shut();
            return false;
        }
        true
    }

    /// The index of the message just sealed or queued.
    fn take_index(&mut self) -> u64 {
        let index = self.sent;
        self.sent += 1;
        index
    }

    /// Seals every message queued before the session was established.
    pub(super) fn seal_queued(&mut self) {
        let queued = std::mem::take(&mut self.queued);
        self.queued_count = 0;
        if !queued.is_empty() {
            self.seal_frames(&queued);
        }
    }

    /// Writes from the front of `wire` until the socket would block.
    pub(super) fn write_now(&mut self) {
        let Some(link) = self.link.as_ref() else {
            return;
        };
        while !self.wire.is_empty() {
            match link.stream.try_write(&self.wire) {
                Ok(0) => {
                    self.shut();
                    return;
                }
                Ok(n) => self.wire.advance(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(_) => {
                    self.shut();
                    return;
                }
            }
        }
        self.pending_since = None;
    }
}

/// Settings every task of the channel shares.
pub(super) struct Shared {
    pub(super) psk: [u8; 32],
    pub(super) limits: ControlLimits,
    pub(super) codec: FrameCodec,
    pub(super) stats: Arc<ControlStats>,
    /// Accepted connections still in their handshake, per remote address.
    pub(super) waiting: Mutex<Waiting>,
    /// Live accepted sessions (and data streams) per remote address.
    pub(super) per_address: Mutex<HashMap<IpAddr, usize>>,
    pub(super) accepted: AtomicUsize,
    pub(super) next_session: AtomicU64,
    pub(super) inbound: mpsc::UnboundedSender<Inbound>,
    pub(super) identity: PeerIdentity,
    // Member identity.
    /// The static key our sessions prove (`identity`'s endpoint names it).
    pub(super) static_key: StaticKey,
    /// Whether keyless sources are dialed, and whether a secret is set.
    pub(super) keyless_sources: KeylessSources,
    pub(super) secret_set: bool,
}

impl Shared {
    /// Our end of a handshake.
    pub(super) fn local_member(&self) -> LocalMember<'_> {
        LocalMember {
            key: &self.static_key,
            identity: &self.identity,
        }
    }
}

/// The channel's handle (used on the peer thread, inside its runtime).
pub(crate) struct ControlChannel {
    /// Sessions we dialed, by the endpoint we dialed.
    dialed: HashMap<ControlEndpoint, Session>,
    /// Sessions we accepted, by the identity their dialer proved: its
    /// endpoint, which always names the static key the dialer proved, so
    /// another member claiming the same address is another identity. The
    /// newest session for an identity replaces (and so closes) an older
    /// one: one live session per peer identity.
    pub(super) accepted: HashMap<ControlEndpoint, Session>,
    /// Sessions sent to since the last [`ControlChannel::flush`].
    unflushed: Vec<Arc<SessionOut>>,
    /// Accepted sessions whose `Closed` has not come yet (replaced ones
    /// included), by id.
    live_accepted: HashSet<u64>,
    /// After a stall of this process ([`ControlChannel::note_stall`]): the
    /// first session id opened after it.
    stall_boundary: Option<u64>,
    /// Accepted sessions closed by [`ControlChannel::retire_stalled`] whose
    /// `Closed` (the last item a session sends) has not come yet.
    retiring: HashSet<u64>,
    /// The frame of the message last sent (encoded once: a mailbox post
    /// reuses it).
    frame: BytesMut,
    pub(super) shared: Arc<Shared>,
    pub(crate) stats: Arc<ControlStats>,
}

impl Drop for ControlChannel {
    fn drop(&mut self) {
        // Every session task ends with the channel.
        for session in self.dialed.values().chain(self.accepted.values()) {
            session.out.close();
        }
    }
}

impl ControlChannel {
    /// Binds `addr` (no session is accepted until [`Self::start`]).
    pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        Ok((listener, local))
    }

    /// Takes over a listener bound elsewhere (a guard's, handed over with
    /// the pools): peers keep dialling the address it was bound at.
    pub(crate) fn adopt(
        listener: std::net::TcpListener,
    ) -> std::io::Result<(TcpListener, SocketAddr)> {
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let local = listener.local_addr()?;
        Ok((listener, local))
    }

    /// Starts accepting on `listener` as `identity`, proving `member`'s
    /// static key (which `identity`'s endpoint should name). Returns the
    /// channel and the receiver of inbound items (hand each to
    /// [`Self::on_inbound`]).
    pub(crate) fn start(
        listener: TcpListener,
        identity: PeerIdentity,
        secret: Option<&[u8]>,
        limits: ControlLimits,
        member: (StaticKey, KeylessSources),
    ) -> (Self, mpsc::UnboundedReceiver<Inbound>) {
        let (inbound, inbound_rx) = mpsc::unbounded_channel();
        let stats = Arc::new(ControlStats::default());
        let shared = Arc::new(Shared {
            psk: session::psk(secret),
            limits,
            codec: FrameCodec::new(limits.max_frame_len),
            stats: Arc::clone(&stats),
            waiting: Mutex::new(Waiting::default()),
            per_address: Mutex::new(HashMap::new()),
            accepted: AtomicUsize::new(0),
            next_session: AtomicU64::new(1),
            inbound,
            identity,
            static_key: member.0,
            keyless_sources: member.1,
            secret_set: secret.is_some(),
        });
        tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        (
            Self {
                dialed: HashMap::new(),
                accepted: HashMap::new(),
                unflushed: Vec::new(),
                live_accepted: HashSet::new(),
                stall_boundary: None,
                retiring: HashSet::new(),
                frame: BytesMut::new(),
                shared,
                stats,
            },
            inbound_rx,
        )
    }

    /// Seals `message` for `to` (written by the next [`Self::flush`], or
    /// by the session task). A target's request goes on the session we dial
    /// to `to` (dialed on first use; queued until it is established); a
    /// source's reply goes back on the session `to` opened to us, and is
    /// dropped (counted) when there is none. Never blocks; a full queue
    /// drops the message (counted).
    pub(crate) fn send(&mut self, to: &ControlEndpoint, message: &Message) -> Option<Sent<'_>> {
        let session = if is_request(&message.body) {
            self.dial(to);
            self.dialed.get(to)
        } else {
            self.accepted.get(to)
        };
        self.frame.clear();
        // Encoded once, and only for a session to carry it; a message that
        // does not encode is never counted in the session's numbering.
        let sent = session.and_then(|s| {
            self.shared.codec.encode(message, &mut self.frame).ok()?;
            let index = s.out.send(&self.shared.limits, &self.frame)?;
            Some((s, index))
        });
        match sent {
            Some((session, index)) => {
                if !self.unflushed.iter().any(|o| Arc::ptr_eq(o, &session.out)) {
                    self.unflushed.push(Arc::clone(&session.out));
                }
                Some(Sent {
                    session: session.id,
                    index,
                    frame: &self.frame,
                })
            }
            None => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Decodes one whole frame (a mailbox's): `None` unless it is exactly
    /// one message.
    pub(crate) fn decode(&self, frame: &[u8]) -> Option<Message> {
        let mut bytes = BytesMut::from(frame);
        let message = self.shared.codec.decode(&mut bytes).ok()??;
        bytes.is_empty().then_some(message)
    }

    /// Takes message `index` of our accepted session `session` from `from`
    /// early (read from `from`'s mailbox), if it is that session's next
    /// message: its copy on the session is then dropped when it comes.
    /// `Some(the incarnation the session proved)`: it may be handled now,
    /// as from that identity; `None`: not now (the session is another, a
    /// message before it is still unread, or too many wait for their
    /// copies), and it comes on the session as before.
    pub(crate) fn take_early(
        &mut self,
        from: &ControlEndpoint,
        session: u64,
        index: u64,
    ) -> Option<Incarnation> {
        let accepted = self
            .accepted
            .get_mut(from)
            .filter(|s| s.id == session && !s.out.is_closed())?;
        if !accepted.count.take_early(index) {
            return None;
        }
        accepted.answered
    }

    /// The id of the session our requests to `to` go on, dialing it when
    /// there is none (or it closed).
    pub(crate) fn dial(&mut self, to: &ControlEndpoint) -> u64 {
        match self.dialed.get(to) {
            Some(session) if !session.out.is_closed() => session.id,
            _ => {
                let out = SessionOut::new(None);
                let id = self.shared.next_session.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(session::dial_session(
                    to.clone(),
                    id,
                    Arc::clone(&out),
                    Arc::clone(&self.shared),
                ));
                let session = Session::new(id, out, None);
                if let Some(old) = self.dialed.insert(to.clone(), session) {
                    old.out.close();
                }
                id
            }
        }
    }

    /// The session we dialed to `to`, if it is open and its handshake
    /// proved who answered: its id and that incarnation.
    pub(crate) fn dialed_peer(&self, to: &ControlEndpoint) -> Option<(u64, Incarnation)> {
        let session = self.dialed.get(to).filter(|s| !s.out.is_closed())?;
        Some((session.id, session.answered?))
    }

    /// Whether we dialed `to` on a session still open whose handshake has
    /// not been reported to this thread yet.
    pub(crate) fn dialed_unproven(&self, to: &ControlEndpoint) -> bool {
        self.dialed
            .get(to)
            .is_some_and(|s| !s.out.is_closed() && s.answered.is_none())
    }

    /// Writes what was sent since the last flush, one write per session,
    /// as far as each socket takes it now (the session task writes the
    /// rest as the socket drains).
    pub(crate) fn flush(&mut self) {
        if !self.unflushed.is_empty() {
            crate::timeline::mark("control_flush", self.unflushed.len() as u64);
        }
        for out in self.unflushed.drain(..) {
            out.write_now();
        }
    }

    /// Applies an inbound item; returns what the peer thread must act on.
    pub(crate) fn on_inbound(&mut self, item: Inbound) -> Option<ChannelEvent> {
        match item {
            Inbound::Opened {
                session,
                side: Side::Accepted,
                peer,
                out: Some(out),
            } => {
                // The newest session from an endpoint carries its replies;
                // an older one from it ends.
                self.live_accepted.insert(session);
                let session = Session::new(session, out, Some(peer.incarnation));
                if let Some(old) = self.accepted.insert(peer.endpoint, session) {
                    old.out.close();
                    self.stats.sessions_replaced.fetch_add(1, Ordering::Relaxed);
                }
                None
            }
            Inbound::Opened {
                session,
                side: Side::Dialed,
                peer,
                ..
            } => {
                if let Some(dialed) = self
                    .dialed
                    .get_mut(&peer.endpoint)
                    .filter(|s| s.id == session)
                {
                    dialed.answered = Some(peer.incarnation);
                }
                None
            }
            Inbound::Opened { .. } => None,
            Inbound::Message {
                message,
                session,
                _budget,
            } => {
                // An accepted session's message taken early from its
                // sender's mailbox arrives here a second time: dropped.
                if let Some(accepted) = self
                    .accepted
                    .get_mut(&message.header.sender_endpoint)
                    .filter(|s| s.id == session)
                    && accepted.count.arrived() == Arrival::Drop
                {
                    self.stats
                        .early_copies_dropped
                        .fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                Some(ChannelEvent::Message(message, session))
            }
            Inbound::Stream(stream) => Some(ChannelEvent::Stream(stream)),
            Inbound::Closed {
                session,
                side: Side::Dialed,
                peer,
            } => {
                // A session that was already replaced (we re-dialed after it
                // failed) says nothing about the current one.
                let current = self
                    .dialed
                    .get(&peer.endpoint)
                    .is_none_or(|s| s.id == session);
                current.then(|| {
                    self.dialed.remove(&peer.endpoint);
                    ChannelEvent::SourceLost(peer.endpoint)
                })
            }
            Inbound::Closed {
                session,
                side: Side::Accepted,
                peer,
            } => {
                self.live_accepted.remove(&session);
                self.retiring.remove(&session);
                let current = self
                    .accepted
                    .get(&peer.endpoint)
                    .is_some_and(|s| s.id == session);
                current.then(|| {
                    self.accepted.remove(&peer.endpoint);
                    ChannelEvent::TargetGone(peer.endpoint)
                })
            }
        }
    }

    /// Forgets a peer we dialed and closes that session.
    pub(crate) fn remove_peer(&mut self, peer: &ControlEndpoint) {
        // Closing ends the session task, which closes the socket.
        if let Some(session) = self.dialed.remove(peer) {
            session.out.close();
        }
    }

    /// Notes that this process stalled: every session open now may hold
    /// requests that waited meanwhile; [`Self::retire_stalled`] closes the
    /// accepted ones.
    pub(crate) fn note_stall(&mut self) {
        self.stall_boundary = Some(self.shared.next_session.load(Ordering::Relaxed));
    }

    /// Closes every accepted session opened before the stall
    /// [`Self::note_stall`] noted (whatever waited in them must not be
    /// served late). [`Self::retired`] says when each has ended.
    pub(crate) fn retire_stalled(&mut self) {
        let Some(boundary) = self.stall_boundary.take() else {
            return;
        };
        for session in self.accepted.values().filter(|s| s.id < boundary) {
            session.out.close();
        }
        // Replaced sessions were closed when replaced; they count too.
        let older = self.live_accepted.iter().filter(|id| **id < boundary);
        self.retiring.extend(older);
    }

    /// Whether every accepted session open at a noted stall has ended and
    /// handed on everything it brought (its `Closed` is its last item).
    pub(crate) fn retired(&self) -> bool {
        self.stall_boundary.is_none() && self.retiring.is_empty()
    }

    /// Sockets currently open.
    #[cfg(test)]
    pub(crate) fn open_sockets(&self) -> usize {
        self.stats.open_sockets.load(Ordering::Relaxed)
    }
}
