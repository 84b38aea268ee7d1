//! The peer protocol's plain values at the core's edge: why a connect
//! failed, a put span, the framework's notices, the counters and the sizes
//! of per-peer state.

use super::*;

/// Why the driver built no route ([`Core::handle_connect_failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectFailure {
    /// UCX refused the target's worker address or a remote key (counted in
    /// [`PeerCounters::refused`]).
    Unusable,
    /// The route would have gone through UCX while this process holds too
    /// many memory mappings (counted in [`PeerCounters::routes_refused`]).
    NoMappingsLeft,
    /// The advertised UCX worker never proved it is the target's own: the
    /// nonce the driver sent it did not come back on the session the
    /// metadata came on, in time (counted in [`PeerCounters::routes_unproven`]).
    Unproven,
}

/// A notice for the framework about memory a peer may still write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerNotice {
    /// The abandonment deadline passed without proof that the source stopped:
    /// the target's slots stay quarantined.
    Uncertain {
        /// The target operation.
        op: OpHandle,
    },
    /// Proof arrived that the source will not touch the slots again; they are free.
    Quiesced {
        /// The target operation.
        op: OpHandle,
    },
}

/// Counters of the peer protocol.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PeerCounters {
    /// `start_write`s sent.
    pub writes_requested: u64,
    /// Keys a source wrote for us.
    pub keys_received: u64,
    /// Keys we wrote for targets.
    pub keys_sent: u64,
    /// Bytes we wrote for targets.
    pub bytes_sent: u64,
    /// Messages refused: unknown op, wrong sender, foreign incarnation,
    /// out-of-range element, unknown region, size mismatch.
    pub refused: u64,
    /// Target operations that reached the abandonment deadline.
    pub quarantined: u64,
    /// Requests or hints refused because the peer is not on the allowlist.
    pub refused_peers: u64,
    /// Writes refused because the namespace is private to other targets.
    pub refused_private: u64,
    /// Routes to targets whose every region the driver mapped (writes are
    /// one copy, without UCX).
    pub one_copy_routes: u64,
    /// Routes written through UCX (no shared segments, or some refused).
    pub ucx_routes: u64,
    /// Route changes refused: a target over its [`RouteBudget`] (not
    /// acknowledged, so it re-sends), or a UCX route while this process was
    /// short of mappings ([`ConnectFailure::NoMappingsLeft`], acknowledged
    /// as no route).
    pub routes_refused: u64,
    /// Routes never used: their advertised UCX worker did not prove, on the
    /// target's own session, that it received the driver's nonce (a member
    /// advertising another process's worker address).
    pub routes_unproven: u64,
    /// (Source role) probes answered with a death report: the probed
    /// incarnation of this endpoint is guard-confirmed dead.
    pub dead_reported: u64,
    /// (Target role) operations ended by a death report (the probed one and
    /// the others sent to that incarnation).
    pub dead_freed: u64,
    /// (Target role) death reports not believed: from another endpoint,
    /// naming another incarnation than the op's, from the dead incarnation
    /// itself, or about an op that was never probed.
    pub dead_ignored: u64,
    /// (Target role) quarantined ops probed again on a fresh metadata ack.
    pub reprobes: u64,
    /// (Target role) metadata sent again to a source that had not
    /// acknowledged it within `metadata_retry_ns`. Growing while restores
    /// wait: the source is silent towards us (over its route budget, or
    /// refusing what we advertise), and those restores end at their
    /// deadlines.
    pub metadata_resent: u64,
    /// (Target role) keys a source reported landed whose bytes did not
    /// match the page digest that came with them: failed, never served.
    pub digest_mismatches: u64,
    /// (Source role) stalls of this process past an operation timeout
    /// (stopped, starved): writes were refused until the driver closed the
    /// sessions opened before it ([`Core::end_peer_stall`]).
    pub stalls: u64,
    /// Target: writes that granted a source the deliver's own device
    /// elements (the one-hop route).
    pub one_hop_writes: u64,
    /// Target: keys that landed in device memory in one hop, checked.
    pub one_hop_pages: u64,
    /// Target: device-deliver keys sent through KVCR DRAM (two hops)
    /// because their source did not offer the one-hop route.
    pub one_hop_fallbacks: u64,
    /// Source: routes whose device regions the driver could not open, or
    /// more than it opens for one target (acknowledged without the one-hop
    /// route).
    pub one_hop_refused: u64,
}

/// Sizes of the core's per-peer state ([`Core::peer_state_sizes`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PeerStateSizes {
    /// Routes to targets (one per target session).
    pub routes: usize,
    /// Fenced (probed, never started) ops, over all targets.
    pub fences: usize,
    /// Target incarnations with an op-handle high-water mark.
    pub high_water: usize,
    /// Requests with a router hint.
    pub hinted_requests: usize,
    /// Sources this runner fetched from or was hinted to.
    pub sources: usize,
    /// Target operations in flight or quarantined.
    pub target_ops: usize,
}

/// One put: local bytes into a remote element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutSpan {
    /// Local source address (inside a runner-owned pool).
    pub local: u64,
    /// Remote destination address (inside `region` of the target).
    pub remote: u64,
    /// Bytes.
    pub len: u64,
    /// The target's region (selects the rkey).
    pub region: RegionId,
}
