//! What the runner reports: [`Runner::stats`], its snapshot of the core's
//! counts and counters ([`RunnerStats`]), and the named structs its facets
//! report ([`Peers::stats`](crate::Peers::stats),
//! [`Pools::g3_stats`](crate::Pools::g3_stats)).

use kvcr_runner_core::{G3Counters, PeerCounters, RunnerStats};

use crate::Runner;
use crate::g3::G3Error;

impl Runner {
    /// A snapshot of counts and counters.
    pub fn stats(&self) -> RunnerStats {
        let inner = self.shared.lock();
        let core = &inner.core;
        let (ready, filling, discarding) = core.state_counts();
        RunnerStats {
            policy: core.policy_name(),
            ready,
            filling,
            discarding,
            public_claims: core.public_claims(),
            ops_in_flight: core.ops_in_flight(),
            copies_in_flight: core.jobs_in_flight(),
            pools: core.pool_stats(),
            counters: core.counters(),
        }
    }
}

/// The peer protocol's state: the core's counters and the driver's sockets.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PeerStats {
    /// What the peer protocol did: fetches, puts, refusals, deaths, ...
    pub counters: PeerCounters,
    /// Control sockets open now (zero without peers).
    pub open_sockets: usize,
    /// Writes are refused now: this process stalled past its operation
    /// timeout and is closing the sessions opened before it (counted in
    /// [`PeerCounters::stalls`]); it serves again once they are gone.
    pub stalled: bool,
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
