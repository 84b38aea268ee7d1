//! The runner's named stats structs beyond the core's
//! [`RunnerStats`](kvcr_runner_core::RunnerStats): what the facets report
//! ([`Peers::stats`](crate::Peers::stats),
//! [`Pools::g3_stats`](crate::Pools::g3_stats)).

use kvcr_runner_core::{G3Counters, PeerCounters};

use crate::g3::G3Error;

/// The peer protocol's state: the core's counters and the driver's sockets.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PeerStats {
    /// What the peer protocol did: fetches, puts, refusals, deaths, ...
    pub counters: PeerCounters,
    /// Control sockets open now (zero without peers).
    pub open_sockets: usize,
}

/// G3's state: the core's counters and what its I/O reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct G3Stats {
    /// Spills, fills, evictions, bytes, occupancy.
    pub counters: G3Counters,
    /// Transfers the files refused (each failed its spill or fill).
    pub failed_transfers: u64,
    /// The last of those errors (a full disk, a file gone, ...).
    pub last_error: Option<G3Error>,
}
