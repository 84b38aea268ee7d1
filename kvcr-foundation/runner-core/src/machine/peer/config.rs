//! What a runner configures for the peer protocol: its identity and
//! advertisements, allowlists, write batching, the per-target route-change
//! budget, and the bounds on what a peer may make the core remember.

use super::*;

/// Everything a runner needs to take part in the peer protocol.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// This runner's advertised control endpoint.
    pub endpoint: ControlEndpoint,
    /// This runner's incarnation.
    pub incarnation: Incarnation,
    /// Packed UCX worker address.
    pub worker_address: Vec<u8>,
    /// Packed remote key per runner-owned pool region.
    pub rkeys: Vec<(RegionId, Vec<u8>)>,
    /// The pools a same-host source may map and write itself (advertised
    /// with the metadata; `None`: UCX only).
    pub shared_memory: Option<SharedMemoryAdvert>,
    /// Abandonment budget, from op start (≥ 2 × the op timeout).
    pub abandon_timeout_ns: u64,
    /// How often unacknowledged metadata is re-sent.
    pub metadata_retry_ns: u64,
    /// When non-empty, the only peers this runner talks to: hints naming
    /// another source are dropped, messages from others refused.
    pub allowed_peers: Vec<ControlEndpoint>,
    /// Namespaces only the listed targets may fetch from this runner.
    pub private_namespaces: Vec<(NamespaceId, Vec<ControlEndpoint>)>,
    /// Bytes of pages asked of a source in one write (`start_write`); a
    /// fetch needing more sends several, which the source writes
    /// concurrently and which land one by one. 0: one write per source and
    /// operation.
    pub write_batch_bytes: u64,
    /// Bytes of pages granted to a source in one one-hop write (its pages
    /// straight into this GPU); `None`: [`Self::write_batch_bytes`]. Every
    /// write costs both ends a fixed share (its message, its checks, its
    /// lead report and completion) beside each page's, and the first
    /// layer waits on the last write's lead; the two-hop route's writes
    /// are sized for its DRAM lanes instead.
    pub one_hop_write_batch_bytes: Option<u64>,
    /// How often one member may make this source build routes (see
    /// [`RouteBudget`]).
    pub route_budget: RouteBudget,
    /// How often all members together may (a member may claim any number
    /// of names while members are told apart by the name they claim:
    /// this bounds what rotating them buys). Default
    /// [`RouteBudget::TOTAL`].
    pub route_budget_total: RouteBudget,
    /// Offer and use the one-hop route (default on): as a target, advertise
    /// the device regions the driver exported ([`Core::set_device_export`])
    /// with shared memory, and grant a same-host source that opened them
    /// the deliver's own device elements; as a source, write such grants.
    /// Off: device delivers take two hops through KVCR DRAM. A one-hop
    /// write asks its source for the first layer's landing
    /// ([`Core::set_lead_elements`]).
    pub one_hop: bool,
}

/// How often a target may make this source build it a new data-plane route
/// (a UCX endpoint and remote keys, or a mapping of its pools).
///
/// Building one takes the peer thread a UCX connect and the close of the
/// route it replaces, and a route to a same-host target through UCX's
/// shared-memory transport keeps the mappings of each distinct segment it
/// unpacked until the worker is destroyed. So route changes are
/// rate-limited per target (the driver also refuses UCX routes while the
/// process is short of mappings). A target's legitimate changes are rare: a
/// restart, a re-registration, a new session after an idle close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteBudget {
    /// Route changes one target may make at once after a quiet spell; 0
    /// counts as 1.
    pub burst: u32,
    /// Then one more per this many nanoseconds. A refused change is not
    /// acknowledged: the target re-sends its metadata (every 100 ms) and is
    /// served once its budget allows.
    pub refill_ns: u64,
}

impl Default for RouteBudget {
    /// 4 at once, then one a second, per target.
    fn default() -> Self {
        Self {
            burst: 4,
            refill_ns: 1_000_000_000,
        }
    }
}

impl RouteBudget {
    /// The default budget of all targets together: 64 route changes at
    /// once (a cluster's ranks starting together), then 20 a second.
    pub const TOTAL: Self = Self {
        burst: 64,
        refill_ns: 50_000_000,
    };

    /// Whether a target whose next change is theoretically due at `due`
    /// (`None`: never changed, or long enough ago) may change its route at
    /// `now`; if so, when its next change is due. A generic cell rate
    /// algorithm: one timestamp per target, no timer.
    pub(crate) fn admit(&self, now: u64, due: Option<u64>) -> Option<u64> {
        let due = due.map_or(now, |d| d.max(now));
        let tolerance = u64::from(self.burst.max(1) - 1).saturating_mul(self.refill_ns);
        (due.saturating_sub(tolerance) <= now).then(|| due.saturating_add(self.refill_ns))
    }
}

impl PeerConfig {
    /// Whether this runner talks to `peer` at all. A listed endpoint that
    /// names a key admits only that member ([`ControlEndpoint::names`]).
    pub fn allows(&self, peer: &ControlEndpoint) -> bool {
        self.allowed_peers.is_empty() || self.allowed_peers.iter().any(|p| p.names(peer))
    }

    /// Whether `target` may fetch keys of `namespace` from this runner (a
    /// listed endpoint that names a key admits only that member).
    pub fn may_fetch(&self, target: &ControlEndpoint, namespace: NamespaceId) -> bool {
        self.private_namespaces
            .iter()
            .filter(|(ns, _)| *ns == namespace)
            .all(|(_, members)| members.iter().any(|m| m.names(target)))
    }
}

/// Most regions one target may advertise.
pub const MAX_ADVERTISED_REGIONS: usize = 64;
/// Most device regions one target may advertise for the one-hop route: an
/// engine's per-layer K and V pools are a region each (a 64-layer model has
/// 128), and each costs the source one import it holds for the route. As
/// many as the wire carries; a target with more advertises none.
pub const MAX_ADVERTISED_DEVICE_REGIONS: usize =
    kvcr_contracts::protocol::codec::MAX_DEVICE_REGIONS;
/// Largest packed worker address accepted from a target.
pub const MAX_WORKER_ADDRESS_LEN: usize = 64 << 10;
/// Largest packed remote key accepted from a target.
pub const MAX_RKEY_LEN: usize = 4 << 10;
/// Target incarnations (source role) and sources (target role) remembered
/// beyond those in use; past it, the ones not in use are forgotten.
pub const MAX_REMEMBERED_PEERS: usize = 4096;
/// Fences kept per target incarnation; past it they fold into the op-handle
/// high-water mark (every op at or below the highest fenced one is refused).
pub const MAX_FENCES_PER_TARGET: usize = 1024;
/// Targets whose route-change budget a source remembers ([`RouteBudget`]);
/// past it, those whose budget has refilled are forgotten, and a new target
/// is refused while none has.
pub const MAX_ROUTE_BUDGETS: usize = MAX_REMEMBERED_PEERS;
/// Guard-confirmed dead incarnations a source remembers (the latest ones;
/// the guard keeps as many by default).
pub const MAX_DEAD_INCARNATIONS: usize = 64;
/// Quarantined ops probed again per endpoint when it acknowledges our
/// metadata afresh (the rest on later acks, in turn).
pub const MAX_REPROBES_PER_ACK: usize = 64;
