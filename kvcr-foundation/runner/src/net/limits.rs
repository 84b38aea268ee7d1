//! The control channel's bounds and counters: [`ControlLimits`] (what one
//! peer, or one remote address, can make the channel hold), the counters the
//! channel's tasks share ([`ControlStats`]), their public snapshot
//! ([`ControlCounters`]) and the guard that counts an open socket.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::session::RECORD_MAX;

/// One unit of the per-session inbound budget.
pub(super) const BUDGET_UNIT: usize = 1024;

/// Limits of the control channel; the defaults suit a cluster of up to a few
/// hundred ranks.
///
/// # What one peer can make the channel hold
/// * **Before its handshake** (a stranger needs nothing to get here): a
///   socket, a task and at most 4 KiB of handshake buffers (a data stream:
///   until its proof is checked), for at most `handshake_timeout`, in
///   places of their own: `max_handshakes` in total,
///   `max_handshakes_per_address` per remote address. When they are full a
///   new connection displaces the oldest waiting one of the address holding
///   the most (counted in `evicted_handshakes`), so silent connections
///   never keep a member out and never take a session's place.
/// * **An established session** (only a secret holder gets here): up to
///   [`Self::per_address_bound_bytes`] / `max_sessions_per_address` while
///   busy; idle, its socket, its task and about 192 KiB of record buffers
///   (read, decrypt and seal, one record each), until `idle_timeout`. At
///   most `max_sessions_per_address` from one address and `max_sessions` in
///   all (proven data streams included); past them a finished handshake is
///   refused (`refused_connections`). One live session per peer identity
///   (its endpoint and the member key it proved): a newer one of the same
///   identity replaces it (`sessions_replaced`); another member's claim of
///   it is refused (`claims_refused`).
/// * The core adds one route of bounded metadata per session, fences and
///   high-water marks per target incarnation (`MAX_FENCES_PER_TARGET`,
///   `MAX_REMEMBERED_PEERS`), a route budget per member key
///   (`PeerOptions::route_budget`) and one over all members
///   (`route_budget_total`); routes that would attach this host's shared
///   memory stop at `ucx_route_mapping_limit`.
/// * Outside the channel: the KV-event replay socket's `ReplayLimits`
///   (replies in progress, bytes queued over all peers, requests per peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlLimits {
    /// Established sessions and proven data streams accepted at once.
    pub max_sessions: usize,
    /// Established sessions and proven data streams accepted from one
    /// remote IP address.
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
    // Admission: connections before their handshake (issue 40, item 6).
    /// Accepted connections whose handshake is not done yet (a data
    /// stream: whose proof is not checked yet), at once, apart from
    /// `max_sessions`; a new one past it displaces the oldest of the address
    /// holding the most.
    pub max_handshakes: usize,
    /// The same from one remote IP address; a new one past it displaces
    /// that address's oldest.
    pub max_handshakes_per_address: usize,
}

/// The most a connection waiting for its handshake holds besides its socket
/// (the handshake's messages and payloads, each at most 1 KiB, or a data
/// stream's hello).
pub(super) const WAITING_CONNECTION_BYTES: usize = 4 << 10;

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
            max_handshakes: 256,
            max_handshakes_per_address: 16,
        }
    }
}

impl ControlLimits {
    /// The most memory one remote address can make the channel hold: per
    /// session a partial frame, one record, the inbound budget and the
    /// bytes waiting to be written to it, plus its waiting connections'
    /// handshake buffers.
    pub fn per_address_bound_bytes(&self) -> usize {
        self.max_sessions_per_address
            .saturating_mul(
                self.max_frame_len
                    .saturating_add(RECORD_MAX + 2)
                    .saturating_add(self.inbound_bytes_per_session)
                    .saturating_add(self.outbound_bytes_per_session),
            )
            .saturating_add(
                self.max_handshakes_per_address
                    .saturating_mul(WAITING_CONNECTION_BYTES),
            )
    }

    pub(crate) fn check(&self) -> Result<(), &'static str> {
        if self.max_sessions == 0 || self.max_sessions_per_address == 0 {
            return Err("session caps must be at least 1");
        }
        if self.max_handshakes == 0 || self.max_handshakes_per_address == 0 {
            return Err("handshake caps must be at least 1");
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
    /// Finished handshakes refused: over the total or per-address cap on
    /// sessions.
    pub(crate) refused_connections: AtomicU64,
    /// Connections waiting for their handshake, displaced by newer ones.
    pub(crate) evicted_handshakes: AtomicU64,
    /// Connections waiting for their handshake now.
    pub(crate) handshakes_waiting: AtomicUsize,
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
    /// Sealed records a target read on a data stream that did not open
    /// (each ended its stream).
    pub(crate) stream_records_refused: AtomicU64,
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
    // Member identity (see `session`).
    /// Dials refused: the source answered with another key than the one
    /// its endpoint named.
    pub(crate) sources_wrong_key: AtomicU64,
    /// Dials refused: the source's endpoint named no key, and keyless
    /// sources are not allowed.
    pub(crate) sources_keyless_refused: AtomicU64,
    /// Accepted sessions refused: the dialer claimed an endpoint naming
    /// another key than the one it proved.
    pub(crate) claims_refused: AtomicU64,
    /// Accepted sessions closed because a newer one proved the same
    /// identity.
    pub(crate) sessions_replaced: AtomicU64,
    /// Route-proof nonces handed back (as a target).
    pub(crate) route_proofs_answered: AtomicU64,
    /// Route-proof nonces and proofs ignored (see [`ControlCounters`]).
    pub(crate) route_proofs_refused: AtomicU64,
    /// Pages the copy lanes checked as they copied them (as a source).
    pub(crate) source_checks: Arc<crate::copy::lanes::CheckCounters>,
    /// Doorbell records taken whose pages were checked in the source's copy
    /// and not read again (as a target).
    pub(crate) landings_checked_in_copy: AtomicU64,
    /// Copy passes the one-hop writer ran and the time inside them (as a
    /// source; shared with it).
    pub(crate) one_hop_passes: Arc<crate::peer::PassCounters>,
    /// Digest launches over one-hop completions (as a target).
    pub(crate) device_check_launches: AtomicU64,
    /// Targets' device regions open here now (as a source).
    pub(crate) device_imports_open: Arc<AtomicU64>,
}

impl ControlStats {
    pub(crate) fn snapshot(&self) -> ControlCounters {
        ControlCounters {
            open_sockets: self.open_sockets.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            bad_frames: self.bad_frames.load(Ordering::Relaxed),
            refused_handshakes: self.refused_handshakes.load(Ordering::Relaxed),
            refused_connections: self.refused_connections.load(Ordering::Relaxed),
            evicted_handshakes: self.evicted_handshakes.load(Ordering::Relaxed),
            handshakes_waiting: self.handshakes_waiting.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            doorbells_rung: self.doorbells_rung.load(Ordering::Relaxed),
            pages_checked_in_copy: self.source_checks.checked.load(Ordering::Relaxed),
            pages_altered_at_source: self.source_checks.altered.load(Ordering::Relaxed),
            landings_checked_in_copy: self.landings_checked_in_copy.load(Ordering::Relaxed),
            one_hop_passes: self.one_hop_passes.passes.load(Ordering::Relaxed),
            one_hop_copy_ns: self.one_hop_passes.busy_ns.load(Ordering::Relaxed),
            device_check_launches: self.device_check_launches.load(Ordering::Relaxed),
            device_imports_open: self.device_imports_open.load(Ordering::Relaxed),
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
            stream_records_refused: self.stream_records_refused.load(Ordering::Relaxed),
            mailbox_requests_posted: self.mailbox_requests_posted.load(Ordering::Relaxed),
            mailbox_requests_taken: self.mailbox_requests_taken.load(Ordering::Relaxed),
            mailbox_requests_refused: self.mailbox_requests_refused.load(Ordering::Relaxed),
            early_copies_dropped: self.early_copies_dropped.load(Ordering::Relaxed),
            sources_wrong_key: self.sources_wrong_key.load(Ordering::Relaxed),
            sources_keyless_refused: self.sources_keyless_refused.load(Ordering::Relaxed),
            claims_refused: self.claims_refused.load(Ordering::Relaxed),
            sessions_replaced: self.sessions_replaced.load(Ordering::Relaxed),
            route_proofs_answered: self.route_proofs_answered.load(Ordering::Relaxed),
            route_proofs_refused: self.route_proofs_refused.load(Ordering::Relaxed),
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
    /// Connections refused once their handshake was done: over the total or
    /// per-address cap on sessions ([`ControlLimits::max_sessions`]).
    pub refused_connections: u64,
    /// Connections that had not finished their handshake, closed to make
    /// room for a newer one ([`ControlLimits::max_handshakes`]).
    pub evicted_handshakes: u64,
    /// Connections waiting for their handshake now.
    pub handshakes_waiting: usize,
    /// Sessions cut at a frame deadline or for idleness.
    pub timeouts: u64,
    /// Doorbell records written as a source (a write's completion, ahead of
    /// its `write_done`).
    pub doorbells_rung: u64,
    /// Pages a source's copy lanes hashed as they copied them into a
    /// same-host target and found as deposited (see
    /// [`crate::LandingCheck`]).
    pub pages_checked_in_copy: u64,
    /// Pages whose bytes no longer matched the digest taken at their
    /// deposit when a source copied them: the write failed and nothing was
    /// reported written.
    pub pages_altered_at_source: u64,
    /// Doorbell records taken as a target whose pages the source checked in
    /// its copy, so they were not read again here
    /// ([`crate::LandingCheck::TrustCopyCheck`]).
    pub landings_checked_in_copy: u64,
    /// Copy passes a source's one-hop writer ran: the writes queued
    /// together go in one pass (layer 0 of all of them first), so a
    /// restore's writes over fewer passes land their first layer sooner.
    pub one_hop_passes: u64,
    /// Nanoseconds a source's one-hop writer spent inside its copy passes
    /// (issuing and waiting for the copy engines): set against a restore's
    /// wall time, what went between passes.
    pub one_hop_copy_ns: u64,
    /// Device digest launches a target ran over one-hop completions: those
    /// that came together share one (see `one_hop_writes` for how many
    /// completions there were).
    pub device_check_launches: u64,
    /// Same-host targets' device regions this source holds open now (the
    /// one-hop route's imports). A gauge: each closes once its target's
    /// session has ended and no copy through it is in flight, so a target
    /// that went away leaves none behind (its GPU memory is freed only when
    /// every importer has closed it).
    pub device_imports_open: u64,
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
    /// Sealed records that did not open as a target (altered, replayed,
    /// moved, dropped or cut short on the way, or not sealed under the
    /// stream's key): each ended its data stream, and the write it was
    /// landing failed its keys (`FailReason::DigestMismatch`).
    pub stream_records_refused: u64,
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
    // Member identity.
    /// Sessions to a source refused as a target: the static key that
    /// answered was not the one the source's endpoint named (`?key=`).
    pub sources_wrong_key: u64,
    /// Sessions to a source not dialed as a target: its endpoint named no
    /// key and [`crate::KeylessSources`] refuses that.
    pub sources_keyless_refused: u64,
    /// Sessions refused as a source: the dialer claimed an endpoint naming
    /// another key than the static key it proved in the handshake.
    pub claims_refused: u64,
    /// Sessions accepted as a source that closed an older one of the same
    /// identity (endpoint and key): the member reconnected or restarted.
    pub sessions_replaced: u64,
    /// Route-proof nonces our UCX worker received and handed back on the
    /// session we dialed to the source that sent them (as a target).
    pub route_proofs_answered: u64,
    /// Route-proof nonces and proofs ignored: a nonce naming a source we
    /// have no session to (or another incarnation of it), a proof that is
    /// not the nonce we sent on the session the route's advert came on, or
    /// a same-host advert whose pools hold no owner tag for us (written
    /// through UCX instead).
    pub route_proofs_refused: u64,
}

/// Counts an open socket while alive.
pub(super) struct SocketGuard(Arc<ControlStats>);

impl SocketGuard {
    pub(super) fn new(stats: &Arc<ControlStats>) -> Self {
        stats.open_sockets.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(stats))
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.0.open_sockets.fetch_sub(1, Ordering::Relaxed);
    }
}
