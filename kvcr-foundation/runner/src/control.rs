//! The peer control channel: authenticated, encrypted sessions over tokio TCP,
//! carrying the foundation codec's frames.
//!
//! # Sessions
//! * Every connection starts with a Noise `NNpsk0` handshake (X25519,
//!   ChaCha20-Poly1305, BLAKE2s; the `snow` crate) whose pre-shared key is
//!   derived from the cluster secret. Only a process that knows the secret
//!   completes it; an ephemeral key exchange gives each session its own keys,
//!   so nothing recorded from one session can be replayed into another.
//! * The acceptor's identity (its control endpoint and incarnation) travels in
//!   the handshake's second message; the dialer's in the first transport
//!   record. The acceptor treats a session as open only once that record
//!   decrypts: a replayed first handshake message gets nowhere.
//! * After the handshake every byte is a Noise transport record (`u16` length,
//!   ciphertext with a 16-byte tag, implicit counter nonce). A forged, altered,
//!   replayed, reordered or dropped record fails to decrypt and closes the
//!   session.
//! * **Identity comes from the session.** Each inbound message's header is
//!   rewritten with the session's peer (for a session we dialed: the endpoint
//!   we dialed and the incarnation that answered; for one we accepted: the
//!   identity the dialer authenticated), whatever the frame claimed.
//! * **One direction per role.** A session we dial carries our requests as a
//!   target (metadata, `start_write`, probes) and brings back only the
//!   source's replies; a session we accept brings only a target's requests and
//!   carries our replies back on the same session. A message in the wrong
//!   direction closes the session. So a completion can only come from the
//!   process we asked, on the connection we asked on.
//! * Without a cluster secret the key is a fixed public one: the runner then
//!   listens on loopback only (the peer driver enforces it), and everything
//!   above still holds between local processes.
//!
//! # Bounds (per [`ControlLimits`])
//! Sessions in total and per remote address (handshakes included), a
//! handshake deadline, a deadline for a started frame to complete, an idle
//! timeout on accepted sessions, a maximum frame length, and a per-session
//! budget of inbound bytes not yet handled by the runner (a flooding peer is
//! slowed by TCP backpressure; other peers' budgets are their own), and a
//! per-session bound of sealed bytes not yet written to the peer. Outgoing
//! queues drop (and count) on overflow; the protocol's deadlines and probes
//! recover. A failed `accept` (e.g. out of file descriptors) backs off instead
//! of spinning.
//!
//! # Sending
//! A message is sealed in the sender's turn onto its session's [`SessionOut`]
//! and written by [`ControlChannel::flush`] at the end of that turn (all of
//! a turn's messages to one peer in one write), not handed to the session
//! task first: from the peer thread's send to the socket write took 5–9 µs
//! through the task, 3–4 µs now (encoding and sealing), twice per one-block
//! restore. What the socket does not take at once (and anything sent while
//! no one flushes) the session task writes as the socket drains, under the
//! frame deadline; at most [`ControlLimits::outbound_bytes_per_session`]
//! bytes wait per session. Sealing
//! and writing happen under the session's lock, so records leave in nonce
//! order whoever writes them.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;

use kvcr_contracts::endpoint::{ControlEndpoint, Host};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::codec::FrameCodec;
use kvcr_contracts::protocol::{Body, Message};

/// Bound of each outgoing queue (messages) before its session is established.
pub(crate) const QUEUE_DEPTH: usize = 4096;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Sent by the dialer before the handshake: names the protocol and version.
const PREAMBLE: &[u8; 8] = b"KVCR-N1\0";
const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
const PROLOGUE: &[u8] = b"kvcr control channel v1";
/// Largest Noise message (record ciphertext).
pub(crate) const RECORD_MAX: usize = 65_535;
const TAG_LEN: usize = 16;
/// Largest plaintext per record.
const RECORD_PLAIN_MAX: usize = RECORD_MAX - TAG_LEN;
/// Handshake messages and the identity record are small; anything larger is
/// refused before it is buffered.
const HANDSHAKE_MESSAGE_MAX: usize = 1024;
/// One unit of the per-session inbound budget.
const BUDGET_UNIT: usize = 1024;

/// Limits of the control channel; the defaults suit a cluster of up to a few
/// hundred ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlLimits {
    /// Accepted sessions (and handshakes in progress) at once.
    pub max_sessions: usize,
    /// Accepted sessions (and handshakes) from one remote IP address.
    pub max_sessions_per_address: usize,
    /// Time a connection has to complete the handshake.
    pub handshake_timeout: Duration,
    /// Time a started record or frame has to arrive in full.
    pub frame_deadline: Duration,
    /// An accepted session that sends nothing for this long is closed (its
    /// dialer reconnects when it next needs us).
    pub idle_timeout: Duration,
    /// Largest control frame accepted or sent, in bytes.
    pub max_frame_len: usize,
    /// Bytes of a session's decoded messages the runner may hold unhandled;
    /// past it, that session is not read until the runner catches up.
    pub inbound_bytes_per_session: usize,
    /// Sealed bytes of a session the socket has not taken yet (a peer that
    /// stops reading); past it, messages to that peer are dropped (counted)
    /// until it drains, and the frame deadline ends the session. At least
    /// one frame's worth.
    pub outbound_bytes_per_session: usize,
}

impl Default for ControlLimits {
    fn default() -> Self {
        Self {
            max_sessions: 256,
            max_sessions_per_address: 16,
            handshake_timeout: Duration::from_secs(2),
            frame_deadline: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            max_frame_len: 2 << 20,
            inbound_bytes_per_session: 4 << 20,
            outbound_bytes_per_session: 4 << 20,
        }
    }
}

impl ControlLimits {
    /// The most memory one remote address can make the channel hold:
    /// per session a partial frame, one record, the inbound budget and the
    /// bytes waiting to be written to it.
    pub fn per_address_bound_bytes(&self) -> usize {
        self.max_sessions_per_address.saturating_mul(
            self.max_frame_len
                .saturating_add(RECORD_MAX + 2)
                .saturating_add(self.inbound_bytes_per_session)
                .saturating_add(self.outbound_bytes_per_session),
        )
    }

    pub(crate) fn check(&self) -> Result<(), &'static str> {
        if self.max_sessions == 0 || self.max_sessions_per_address == 0 {
            return Err("session caps must be at least 1");
        }
        if self.max_frame_len < 4096 {
            return Err("max_frame_len must be at least 4096 bytes");
        }
        if self.inbound_bytes_per_session < self.max_frame_len + BUDGET_UNIT {
            return Err("inbound_bytes_per_session must exceed max_frame_len");
        }
        if self.outbound_bytes_per_session < self.max_frame_len + RECORD_MAX {
            return Err("outbound_bytes_per_session must hold a frame");
        }
        if self.inbound_bytes_per_session / BUDGET_UNIT > Semaphore::MAX_PERMITS {
            return Err("inbound_bytes_per_session is too large");
        }
        if self.handshake_timeout.is_zero()
            || self.frame_deadline.is_zero()
            || self.idle_timeout.is_zero()
        {
            return Err("timeouts must be positive");
        }
        Ok(())
    }
}

/// Counters shared by the channel's tasks.
#[derive(Debug, Default)]
pub(crate) struct ControlStats {
    /// Sockets currently open (accepted and dialed).
    pub(crate) open_sockets: AtomicUsize,
    /// Outgoing messages dropped because a queue was full or no session to
    /// the peer exists.
    pub(crate) dropped: AtomicU64,
    /// Sessions closed for a frame that did not decode, a record that did not
    /// decrypt, or a message in the wrong direction.
    pub(crate) bad_frames: AtomicU64,
    /// Handshakes that failed (wrong or missing secret, garbage, too slow).
    pub(crate) refused_handshakes: AtomicU64,
    /// Connections refused at accept: over the total or per-address cap.
    pub(crate) refused_connections: AtomicU64,
    /// Sessions closed for a frame deadline or idleness.
    pub(crate) timeouts: AtomicU64,
    /// Doorbell records this runner wrote as a source.
    pub(crate) doorbells_rung: AtomicU64,
    /// Doorbell records this runner took as a target's `write_done`.
    pub(crate) doorbells_taken: AtomicU64,
    /// Records in a slot a target waited on, naming its operation, that did
    /// not verify (torn mid-write, or forged): ignored.
    pub(crate) doorbells_refused: AtomicU64,
    /// Write message parts this runner sent (bytes and completion).
    pub(crate) write_messages_sent: AtomicU64,
    /// Write message parts this runner took as a target (the last of a
    /// write as its `write_done`).
    pub(crate) write_messages_taken: AtomicU64,
    /// Write messages dropped unread: not verified, not awaited, or not
    /// exactly the operation's granted bytes.
    pub(crate) write_messages_refused: AtomicU64,
    /// Data streams bound (dialed and proven as a target; accepted and
    /// checked as a source).
    pub(crate) streams_opened: AtomicU64,
    /// Data streams a source refused: a proof that did not verify under the
    /// claimed target's session key, or no route from that target to bind.
    pub(crate) streams_refused: AtomicU64,
    /// Writes this runner sent as frames on a data stream.
    pub(crate) stream_writes_sent: AtomicU64,
    /// Frames this runner landed as a target (each its write's `write_done`
    /// when it was the last part).
    pub(crate) stream_writes_taken: AtomicU64,
    /// Frames a target read and discarded (not verified, not awaited, not
    /// exactly the operation's granted bytes, or its operation ended
    /// mid-payload).
    pub(crate) stream_writes_refused: AtomicU64,
    /// Requests this runner also posted to a source's mailbox (as a target).
    pub(crate) mailbox_requests_posted: AtomicU64,
    /// Requests this runner took from a target's mailbox, ahead of their
    /// copies on the control session (as a source).
    pub(crate) mailbox_requests_taken: AtomicU64,
    /// Mailbox records that changed but did not verify under the route's
    /// session key, or did not decode as a `start_write` (forged, torn,
    /// another session's).
    pub(crate) mailbox_requests_refused: AtomicU64,
    /// Control messages dropped on arrival because their mailbox copy had
    /// been taken.
    pub(crate) early_copies_dropped: AtomicU64,
}

impl ControlStats {
    pub(crate) fn snapshot(&self) -> ControlCounters {
        ControlCounters {
            open_sockets: self.open_sockets.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            bad_frames: self.bad_frames.load(Ordering::Relaxed),
            refused_handshakes: self.refused_handshakes.load(Ordering::Relaxed),
            refused_connections: self.refused_connections.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            doorbells_rung: self.doorbells_rung.load(Ordering::Relaxed),
            doorbells_taken: self.doorbells_taken.load(Ordering::Relaxed),
            doorbells_refused: self.doorbells_refused.load(Ordering::Relaxed),
            write_messages_sent: self.write_messages_sent.load(Ordering::Relaxed),
            write_messages_taken: self.write_messages_taken.load(Ordering::Relaxed),
            write_messages_refused: self.write_messages_refused.load(Ordering::Relaxed),
            streams_opened: self.streams_opened.load(Ordering::Relaxed),
            streams_refused: self.streams_refused.load(Ordering::Relaxed),
            stream_writes_sent: self.stream_writes_sent.load(Ordering::Relaxed),
            stream_writes_taken: self.stream_writes_taken.load(Ordering::Relaxed),
            stream_writes_refused: self.stream_writes_refused.load(Ordering::Relaxed),
            mailbox_requests_posted: self.mailbox_requests_posted.load(Ordering::Relaxed),
            mailbox_requests_taken: self.mailbox_requests_taken.load(Ordering::Relaxed),
            mailbox_requests_refused: self.mailbox_requests_refused.load(Ordering::Relaxed),
            early_copies_dropped: self.early_copies_dropped.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of the control channel's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ControlCounters {
    /// Sockets open now (accepted and dialed).
    pub open_sockets: usize,
    /// Outgoing messages dropped: a full queue, or a reply with no session.
    pub dropped: u64,
    /// Sessions cut for a record that did not open, a frame that did not
    /// decode, or a message in the wrong direction.
    pub bad_frames: u64,
    /// Handshakes that failed (no or wrong secret, garbage, too slow).
    pub refused_handshakes: u64,
    /// Connections refused at accept (over the total or per-address cap).
    pub refused_connections: u64,
    /// Sessions cut at a frame deadline or for idleness.
    pub timeouts: u64,
    /// Doorbell records written as a source (a write's completion, ahead of
    /// its `write_done`).
    pub doorbells_rung: u64,
    /// Doorbell records taken as a target: operations completed before
    /// their `write_done` arrived.
    pub doorbells_taken: u64,
    /// Records naming an awaited operation that did not verify (torn while
    /// being written, or forged): ignored, the `write_done` still counts.
    pub doorbells_refused: u64,
    /// UCX active messages sent carrying a write's bytes and completion (a
    /// source's small writes through UCX; one per part of a write).
    pub write_messages_sent: u64,
    /// Write messages (parts) taken as a target: their bytes copied into
    /// their share of the operation's granted elements, the last part's
    /// record taken as its `write_done`.
    pub write_messages_taken: u64,
    /// Write messages (parts) dropped unread: a record that did not verify
    /// under the session's key, an operation not (or no longer) awaited, a
    /// part already landed or cut unlike the write's first, data not
    /// exactly the part's share of the operation's granted bytes, or past
    /// the receive bounds (header or data size, messages held at once).
    pub write_messages_refused: u64,
    /// Data streams bound: dialed and proven as a target, accepted and
    /// checked as a source (see [`crate::DataStream`]).
    pub streams_opened: u64,
    /// Data streams refused as a source: a proof that did not verify under
    /// the claimed target's session key, or no route from it to bind to.
    pub streams_refused: u64,
    /// Writes sent as frames on a data stream (bytes and completion).
    pub stream_writes_sent: u64,
    /// Frames landed as a target: read straight into the operation's
    /// granted elements, the last part taken as its `write_done`.
    pub stream_writes_taken: u64,
    /// Frames read and discarded as a target: a header that did not verify
    /// under the session's key, an operation not (or no longer) awaited, a
    /// part already landed, or a length not exactly its share.
    pub stream_writes_refused: u64,
    /// Requests posted to a same-host source's mailbox beside their control
    /// message (as a target).
    pub mailbox_requests_posted: u64,
    /// Requests taken from a target's mailbox ahead of their control message
    /// (as a source).
    pub mailbox_requests_taken: u64,
    /// Mailbox records refused: changed but not verified under the session's
    /// key, or not a `start_write` (as a source).
    pub mailbox_requests_refused: u64,
    /// Control messages dropped on arrival because their mailbox copy had
    /// been taken (as a source).
    pub early_copies_dropped: u64,
}

/// Who is at the other end of a session, as the session proved it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerIdentity {
    /// The peer's control endpoint.
    pub(crate) endpoint: ControlEndpoint,
    /// The peer's incarnation.
    pub(crate) incarnation: Incarnation,
}

impl PeerIdentity {
    fn encode(&self) -> Vec<u8> {
        let endpoint = self.endpoint.to_string();
        let mut out = Vec::with_capacity(16 + endpoint.len());
        out.extend_from_slice(&self.incarnation.raw().to_be_bytes());
        out.extend_from_slice(endpoint.as_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let (raw, endpoint) = bytes.split_at_checked(16)?;
        let incarnation = Incarnation::from_raw(u128::from_be_bytes(raw.try_into().ok()?))?;
        let endpoint = ControlEndpoint::parse(std::str::from_utf8(endpoint).ok()?).ok()?;
        Some(Self {
            endpoint,
            incarnation,
        })
    }
}

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
    fn admits(self, body: &Body) -> bool {
        is_request(body) == (self == Self::Accepted)
    }
}

/// A target's request to a source (travels on the target's dialed session);
/// everything else is a source's reply (travels back on the same session).
fn is_request(body: &Body) -> bool {
    matches!(
        body,
        Body::TargetMetadata { .. } | Body::StartWrite { .. } | Body::WriteProbe { .. }
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

/// A data stream a target dialed to us (see [`crate::stream`]): who it
/// claims to be, the challenge we sent and the proof it answered; the
/// peer thread checks the proof against that target's session key.
pub(crate) struct AcceptedStream {
    pub(crate) claim: ControlEndpoint,
    pub(crate) challenge: [u8; 32],
    pub(crate) proof: [u8; 32],
    pub(crate) socket: TcpStream,
    /// Its place under the channel's caps, held while the stream lives.
    pub(crate) hold: StreamHold,
}

impl std::fmt::Debug for AcceptedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceptedStream")
            .field("claim", &self.claim)
            .finish_non_exhaustive()
    }
}

/// Holds an accepted data stream's place under the channel's caps.
pub(crate) struct StreamHold {
    _admission: AdmissionGuard,
    _socket: SocketGuard,
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

struct Session {
    id: u64,
    out: Arc<SessionOut>,
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

/// Most messages of one session taken early whose copies have not come on
/// the session yet; past it, none more is taken early (the session brings
/// them as before).
const MAX_TAKEN_EARLY: usize = 64;

/// The messages of one accepted session, numbered from 0 in the order its
/// peer sent them: those read from the socket, and those taken early from
/// the peer's mailbox (see `crate::doorbell`), whose copies are dropped
/// when the socket brings them. Sans-I/O: each message is handled once, in
/// the order sent, whichever way it came first.
#[derive(Debug, Default)]
pub(crate) struct MessageCount {
    /// Messages read from the socket (the next one's index).
    read: u64,
    /// Indexes from `read` on whose messages were taken early, in order.
    taken_early: VecDeque<u64>,
}

/// What to do with a message read from a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// Handle it.
    Handle,
    /// It was taken early: drop it.
    Drop,
}

impl MessageCount {
    /// The index the session's next message will have, counting those
    /// taken early.
    fn next_index(&self) -> u64 {
        self.taken_early.back().map_or(self.read, |last| last + 1)
    }

    /// Whether message `index`, found early, may be handled now: only the
    /// session's next message, and only while fewer than
    /// [`MAX_TAKEN_EARLY`] wait for their copies. `true` records it.
    pub(crate) fn take_early(&mut self, index: u64) -> bool {
        if self.next_index() != index || self.taken_early.len() >= MAX_TAKEN_EARLY {
            return false;
        }
        self.taken_early.push_back(index);
        true
    }

    /// The session brought its next message.
    pub(crate) fn arrived(&mut self) -> Arrival {
        let index = self.read;
        self.read += 1;
        if self.taken_early.front() == Some(&index) {
            self.taken_early.pop_front();
            Arrival::Drop
        } else {
            Arrival::Handle
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
    wake: Notify,
}

struct OutState {
    /// Frames of the messages sent before the session is established (at
    /// most [`QUEUE_DEPTH`] messages), encoded when sent; sealed, in order,
    /// when it is.
    queued: BytesMut,
    /// Messages in `queued`.
    queued_count: usize,
    /// Messages this session has carried or holds to carry: the next one's
    /// index in the session (a mailbox request names it, see
    /// `crate::doorbell`). Only a message whose frame is on the wire or
    /// queued counts, so the peer's count of what it read agrees.
    sent: u64,
    /// The established session's socket and cipher (the session task
    /// decrypts under this lock too: one Noise state serves both directions).
    link: Option<Link>,
    /// Sealed records the socket has not taken yet, in nonce order.
    wire: BytesMut,
    /// Since when `wire` has held bytes (the frame deadline runs from here).
    pending_since: Option<Instant>,
    /// The session ended, or the channel dropped it: nothing more is sent.
    closed: bool,
    sealed: Vec<u8>,
}

struct Link {
    stream: Arc<TcpStream>,
    transport: snow::TransportState,
}

impl SessionOut {
    fn new(link: Option<Link>) -> Arc<Self> {
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

    fn lock(&self) -> std::sync::MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Ends the session: nothing more is sent, and its task stops.
    fn close(&self) {
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
    fn shut(&mut self) {
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
    fn seal_queued(&mut self) {
        let queued = std::mem::take(&mut self.queued);
        self.queued_count = 0;
        if !queued.is_empty() {
            self.seal_frames(&queued);
        }
    }

    /// Writes from the front of `wire` until the socket would block.
    fn write_now(&mut self) {
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
struct Shared {
    psk: [u8; 32],
    limits: ControlLimits,
    codec: FrameCodec,
    stats: Arc<ControlStats>,
    /// Live accepted sessions (and handshakes) per remote address.
    per_address: Mutex<HashMap<IpAddr, usize>>,
    accepted: AtomicUsize,
    next_session: AtomicU64,
    inbound: mpsc::UnboundedSender<Inbound>,
    identity: PeerIdentity,
}

/// The channel's handle (used on the peer thread, inside its runtime).
pub(crate) struct ControlChannel {
    /// Sessions we dialed, by the endpoint we dialed.
    dialed: HashMap<ControlEndpoint, Session>,
    /// Sessions we accepted, by the identity their dialer proved. The newest
    /// session for an endpoint replaces (and so closes) an older one: one
    /// live session per peer identity.
    accepted: HashMap<ControlEndpoint, Session>,
    /// Sessions sent to since the last [`ControlChannel::flush`].
    unflushed: Vec<Arc<SessionOut>>,
    /// The frame of the message last sent (encoded once: a mailbox post
    /// reuses it).
    frame: BytesMut,
    shared: Arc<Shared>,
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

/// The Noise pre-shared key for a cluster secret. Without a secret the key is
/// public (loopback-only mode).
pub(crate) fn psk(secret: Option<&[u8]>) -> [u8; 32] {
    let mut hash = Sha256::new();
    match secret {
        Some(secret) => {
            hash.update(b"kvcr cluster secret v1\0");
            hash.update(secret);
        }
        None => hash.update(b"kvcr: no cluster secret (loopback only)\0"),
    }
    hash.finalize().into()
}

fn builder(psk: &[u8; 32]) -> Option<snow::Builder<'_>> {
    let params = NOISE_PARAMS.parse().ok()?;
    snow::Builder::new(params)
        .prologue(PROLOGUE)
        .ok()?
        .psk(0, psk)
        .ok()
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

    /// Starts accepting on `listener` as `identity`. Returns the channel and
    /// the receiver of inbound items (hand each to [`Self::on_inbound`]).
    pub(crate) fn start(
        listener: TcpListener,
        identity: PeerIdentity,
        secret: Option<&[u8]>,
        limits: ControlLimits,
    ) -> (Self, mpsc::UnboundedReceiver<Inbound>) {
        let (inbound, inbound_rx) = mpsc::unbounded_channel();
        let stats = Arc::new(ControlStats::default());
        let shared = Arc::new(Shared {
            psk: psk(secret),
            limits,
            codec: FrameCodec::new(limits.max_frame_len),
            stats: Arc::clone(&stats),
            per_address: Mutex::new(HashMap::new()),
            accepted: AtomicUsize::new(0),
            next_session: AtomicU64::new(1),
            inbound,
            identity,
        });
        tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        (
            Self {
                dialed: HashMap::new(),
                accepted: HashMap::new(),
                unflushed: Vec::new(),
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
                tokio::spawn(dial_session(
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

    /// Writes what was sent since the last flush, one write per session,
    /// as far as each socket takes it now (the session task writes the
    /// rest as the socket drains).
    pub(crate) fn flush(&mut self) {
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
                let session = Session::new(session, out, Some(peer.incarnation));
                if let Some(old) = self.accepted.insert(peer.endpoint, session) {
                    old.out.close();
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

    /// Sockets currently open.
    #[cfg(test)]
    pub(crate) fn open_sockets(&self) -> usize {
        self.stats.open_sockets.load(Ordering::Relaxed)
    }
}

/// Counts an open socket while alive.
struct SocketGuard(Arc<ControlStats>);

impl SocketGuard {
    fn new(stats: &Arc<ControlStats>) -> Self {
        stats.open_sockets.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(stats))
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.0.open_sockets.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Holds one accepted connection's place under the caps.
struct AdmissionGuard {
    shared: Arc<Shared>,
    address: IpAddr,
}

impl AdmissionGuard {
    fn admit(shared: &Arc<Shared>, address: IpAddr) -> Option<Self> {
        let mut per_address = shared.per_address.lock().unwrap_or_else(|e| e.into_inner());
        let here = per_address.entry(address).or_insert(0);
        let total = shared.accepted.load(Ordering::Relaxed);
        if *here >= shared.limits.max_sessions_per_address || total >= shared.limits.max_sessions {
            if *here == 0 {
                per_address.remove(&address);
            }
            return None;
        }
        *here += 1;
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        Some(Self {
            shared: Arc::clone(shared),
            address,
        })
    }
}

impl Drop for AdmissionGuard {
    fn drop(&mut self) {
        let mut per_address = self
            .shared
            .per_address
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(here) = per_address.get_mut(&self.address) {
            *here -= 1;
            if *here == 0 {
                per_address.remove(&self.address);
            }
        }
        self.shared.accepted.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(pair) => pair,
            Err(_) => {
                // Out of descriptors (or a transient error): back off rather
                // than spin; sessions closing will free descriptors.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        if shared.inbound.is_closed() {
            return;
        }
        let Some(admission) = AdmissionGuard::admit(&shared, from.ip()) else {
            shared
                .stats
                .refused_connections
                .fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(accept_session(stream, admission, Arc::clone(&shared)));
    }
}

async fn accept_session(mut stream: TcpStream, admission: AdmissionGuard, shared: Arc<Shared>) {
    let socket = SocketGuard::new(&shared.stats);
    let handshake = tokio::time::timeout(
        shared.limits.handshake_timeout,
        answer(&mut stream, &shared.psk, &shared.identity),
    )
    .await;
    let (transport, peer) = match handshake {
        Ok(Some(Accepted::Session(transport, peer))) => (transport, peer),
        Ok(Some(Accepted::Stream(claim, challenge, proof))) => {
            // Proven (or not) on the peer thread, which holds the keys.
            let accepted = AcceptedStream {
                claim,
                challenge,
                proof,
                socket: stream,
                hold: StreamHold {
                    _admission: admission,
                    _socket: socket,
                },
            };
            let _ = shared.inbound.send(Inbound::Stream(accepted));
            return;
        }
        _ => {
            shared
                .stats
                .refused_handshakes
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let _admission = admission;
    let _socket = socket;
    let id = shared.next_session.fetch_add(1, Ordering::Relaxed);
    let stream = Arc::new(stream);
    let out = SessionOut::new(Some(Link {
        stream: Arc::clone(&stream),
        transport,
    }));
    let opened = Inbound::Opened {
        session: id,
        side: Side::Accepted,
        peer: peer.clone(),
        out: Some(Arc::clone(&out)),
    };
    if shared.inbound.send(opened).is_err() {
        return;
    }
    run_session(&stream, (id, Side::Accepted), &peer, &out, &shared).await;
    out.close();
    let _ = shared.inbound.send(Inbound::Closed {
        session: id,
        side: Side::Accepted,
        peer,
    });
}

async fn dial_session(to: ControlEndpoint, id: u64, out: Arc<SessionOut>, shared: Arc<Shared>) {
    let mut peer = PeerIdentity {
        endpoint: to.clone(),
        incarnation: shared.identity.incarnation,
    };
    if let Some(mut stream) = dial(&to).await {
        let _socket = SocketGuard::new(&shared.stats);
        let _ = stream.set_nodelay(true);
        let handshake = tokio::time::timeout(
            shared.limits.handshake_timeout,
            initiate(&mut stream, &shared.psk, &shared.identity),
        )
        .await;
        if let Ok(Some((transport, answered))) = handshake {
            // The endpoint is the one we dialed (the name the core uses); the
            // incarnation is whoever answered there.
            peer.incarnation = answered.incarnation;
            let stream = Arc::new(stream);
            {
                // Established: what was sent meanwhile leaves first, in order.
                let mut state = out.lock();
                state.link = Some(Link {
                    stream: Arc::clone(&stream),
                    transport,
                });
                state.seal_queued();
                state.write_now();
            }
            let opened = Inbound::Opened {
                session: id,
                side: Side::Dialed,
                peer: peer.clone(),
                out: None,
            };
            if shared.inbound.send(opened).is_ok() {
                run_session(&stream, (id, Side::Dialed), &peer, &out, &shared).await;
            }
        } else {
            shared
                .stats
                .refused_handshakes
                .fetch_add(1, Ordering::Relaxed);
        }
    }
    out.close();
    let _ = shared.inbound.send(Inbound::Closed {
        session: id,
        side: Side::Dialed,
        peer,
    });
}

/// Connects to a peer's control endpoint within `CONNECT_TIMEOUT`.
pub(crate) async fn dial(to: &ControlEndpoint) -> Option<TcpStream> {
    let target = match to.host() {
        Host::Ip(ip) => format!("{}", SocketAddr::new(*ip, to.port())),
        Host::Name(name) => format!("{name}:{}", to.port()),
    };
    tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
        .await
        .ok()?
        .ok()
}

async fn write_record(stream: &mut TcpStream, record: &[u8]) -> Option<()> {
    let len = u16::try_from(record.len()).ok()?;
    let mut out = Vec::with_capacity(2 + record.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(record);
    stream.write_all(&out).await.ok()
}

/// Reads one length-prefixed record of at most `max` bytes.
async fn read_small_record(stream: &mut TcpStream, max: usize) -> Option<Vec<u8>> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await.ok()?;
    let len = usize::from(u16::from_be_bytes(len));
    if len > max {
        return None;
    }
    let mut record = vec![0u8; len];
    stream.read_exact(&mut record).await.ok()?;
    Some(record)
}

/// Dialer: `PREAMBLE`, handshake message 1 → message 2 (the acceptor's
/// identity) → first transport record (our identity).
pub(crate) async fn initiate(
    stream: &mut TcpStream,
    psk: &[u8; 32],
    identity: &PeerIdentity,
) -> Option<(snow::TransportState, PeerIdentity)> {
    let mut handshake = builder(psk)?.build_initiator().ok()?;
    let mut buf = vec![0u8; HANDSHAKE_MESSAGE_MAX];
    let len = handshake.write_message(&[], &mut buf).ok()?;
    stream.write_all(PREAMBLE).await.ok()?;
    write_record(stream, buf.get(..len)?).await?;
    let reply = read_small_record(stream, HANDSHAKE_MESSAGE_MAX).await?;
    let mut payload = vec![0u8; HANDSHAKE_MESSAGE_MAX];
    let n = handshake.read_message(&reply, &mut payload).ok()?;
    let acceptor = PeerIdentity::decode(payload.get(..n)?)?;
    let mut transport = handshake.into_transport_mode().ok()?;
    let n = transport.write_message(&identity.encode(), &mut buf).ok()?;
    write_record(stream, buf.get(..n)?).await?;
    Some((transport, acceptor))
}

/// What an accepted connection turned out to be.
pub(crate) enum Accepted {
    /// A control session, its handshake done: its transport and the dialer.
    Session(snow::TransportState, PeerIdentity),
    /// A data stream's claim, our challenge and its proof.
    Stream(ControlEndpoint, [u8; 32], [u8; 32]),
}

/// Acceptor side of an accepted connection: reads its preamble, then
/// answers a control session's handshake (as `identity`, under `psk`) or
/// challenges a data stream. `None` for anything else.
pub(crate) async fn answer(
    stream: &mut TcpStream,
    psk: &[u8; 32],
    identity: &PeerIdentity,
) -> Option<Accepted> {
    let mut preamble = [0u8; PREAMBLE.len()];
    stream.read_exact(&mut preamble).await.ok()?;
    if &preamble == crate::stream::PREAMBLE {
        let (claim, challenge, proof) = crate::stream::accept(stream).await?;
        return Some(Accepted::Stream(claim, challenge, proof));
    }
    if &preamble != PREAMBLE {
        return None;
    }
    let (transport, dialer) = respond(stream, psk, identity).await?;
    Some(Accepted::Session(transport, dialer))
}

/// Acceptor side of [`initiate`] (after its `PREAMBLE`).
async fn respond(
    stream: &mut TcpStream,
    psk: &[u8; 32],
    identity: &PeerIdentity,
) -> Option<(snow::TransportState, PeerIdentity)> {
    let mut handshake = builder(psk)?.build_responder().ok()?;
    let first = read_small_record(stream, HANDSHAKE_MESSAGE_MAX).await?;
    let mut payload = vec![0u8; HANDSHAKE_MESSAGE_MAX];
    // Fails unless the dialer knows the secret (the message is sealed under it).
    handshake.read_message(&first, &mut payload).ok()?;
    let mut buf = vec![0u8; HANDSHAKE_MESSAGE_MAX];
    let len = handshake.write_message(&identity.encode(), &mut buf).ok()?;
    write_record(stream, buf.get(..len)?).await?;
    let mut transport = handshake.into_transport_mode().ok()?;
    // Only a dialer holding this session's keys can produce this record: a
    // replayed first message stops here.
    let record = read_small_record(stream, HANDSHAKE_MESSAGE_MAX).await?;
    let n = transport.read_message(&record, &mut payload).ok()?;
    let dialer = PeerIdentity::decode(payload.get(..n)?)?;
    Some((transport, dialer))
}

/// Why a session ended (for counters).
enum End {
    Closed,
    Bad,
    TimedOut,
}

/// Moves frames both ways on an established session until either side ends
/// it, the peer misbehaves, or a deadline passes: reads, decrypts and hands
/// on what arrives, and writes what the sender's turn left unwritten.
async fn run_session(
    stream: &TcpStream,
    (session, side): (u64, Side),
    peer: &PeerIdentity,
    out: &SessionOut,
    shared: &Shared,
) {
    let limits = shared.limits;
    let budget = Arc::new(Semaphore::new(
        limits.inbound_bytes_per_session / BUDGET_UNIT,
    ));
    let mut raw = BytesMut::with_capacity(RECORD_MAX + 2);
    let mut plain = BytesMut::new();
    let mut scratch = vec![0u8; RECORD_MAX];
    let mut last_active = Instant::now();
    let mut partial_since: Option<Instant> = None;
    let end = loop {
        let (closed, unwritten_since) = {
            let mut state = out.lock();
            state.write_now();
            (state.closed, state.pending_since)
        };
        if closed {
            break End::Closed;
        }
        let read_deadline = match (partial_since, side) {
            (Some(since), _) => since + limits.frame_deadline,
            (None, Side::Accepted) => last_active + limits.idle_timeout,
            // Our own dialed sessions live as long as we keep them.
            (None, Side::Dialed) => last_active + Duration::from_secs(86_400),
        };
        let deadline = match unwritten_since {
            Some(since) => read_deadline.min(since + limits.frame_deadline),
            None => read_deadline,
        };
        tokio::select! {
            // More to write, or the session was dropped: go round.
            () = out.wake.notified() => {}
            writable = stream.writable(), if unwritten_since.is_some() => {
                if writable.is_err() {
                    break End::Closed;
                }
            }
            readable = stream.readable() => {
                if readable.is_err() {
                    break End::Closed;
                }
                match stream.try_read_buf(&mut raw) {
                    Ok(0) => break End::Closed,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => break End::Closed,
                }
                last_active = Instant::now();
                let opened = {
                    let mut state = out.lock();
                    match state.link.as_mut() {
                        Some(link) => {
                            open_records(&mut link.transport, &mut raw, &mut scratch, &mut plain)
                        }
                        None => None,
                    }
                };
                if opened.is_none() {
                    break End::Bad;
                }
                match deliver(&mut plain, (session, side), peer, &budget, shared).await {
                    Some(()) => {}
                    None => break End::Bad,
                }
                partial_since = if raw.is_empty() && plain.is_empty() {
                    None
                } else {
                    partial_since.or(Some(last_active))
                };
            }
            () = tokio::time::sleep_until(deadline) => {
                if unwritten_since.is_some_and(|since| Instant::now() >= since + limits.frame_deadline) {
                    break End::TimedOut;
                }
                if Instant::now() >= read_deadline {
                    break End::TimedOut;
                }
            }
        }
    };
    out.close();
    match end {
        End::Closed => {}
        End::Bad => {
            shared.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
        }
        End::TimedOut => {
            shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Encrypts `plain` into length-prefixed records appended to `wire`.
pub(crate) fn seal(
    transport: &mut snow::TransportState,
    plain: &[u8],
    sealed: &mut [u8],
    wire: &mut BytesMut,
) -> Option<()> {
    for chunk in plain.chunks(RECORD_PLAIN_MAX) {
        let n = transport.write_message(chunk, sealed).ok()?;
        wire.put_u16(u16::try_from(n).ok()?);
        wire.extend_from_slice(sealed.get(..n)?);
    }
    Some(())
}

/// Decrypts every complete record at the front of `raw` onto `plain`.
/// `None`: a record failed to decrypt (forged, replayed or corrupted).
pub(crate) fn open_records(
    transport: &mut snow::TransportState,
    raw: &mut BytesMut,
    scratch: &mut [u8],
    plain: &mut BytesMut,
) -> Option<()> {
    loop {
        let Some(&[high, low]) = raw.get(..2) else {
            return Some(());
        };
        let len = usize::from(u16::from_be_bytes([high, low]));
        if raw.len() < 2 + len {
            return Some(());
        }
        raw.advance(2);
        let record = raw.split_to(len);
        let n = transport.read_message(&record, scratch).ok()?;
        plain.extend_from_slice(scratch.get(..n)?);
    }
}

/// Decodes every complete frame in `plain` and hands it to the peer thread
/// with the session's identity; waits for inbound budget when the runner is
/// behind. `None`: a frame did not decode or came in the wrong direction.
async fn deliver(
    plain: &mut BytesMut,
    (session, side): (u64, Side),
    peer: &PeerIdentity,
    budget: &Arc<Semaphore>,
    shared: &Shared,
) -> Option<()> {
    loop {
        let len = plain.len();
        let Some(mut message) = shared.codec.decode(plain).ok()? else {
            return Some(());
        };
        if !side.admits(&message.body) {
            return None;
        }
        message.header.sender_endpoint = peer.endpoint.clone();
        message.header.sender = peer.incarnation;
        let consumed = len - plain.len();
        let units = u32::try_from(consumed.div_ceil(BUDGET_UNIT).max(1)).ok()?;
        let permit = Arc::clone(budget).acquire_many_owned(units).await.ok()?;
        shared
            .inbound
            .send(Inbound::Message {
                message,
                session,
                _budget: permit,
            })
            .ok()?;
    }
}

#[cfg(test)]
mod tests;
