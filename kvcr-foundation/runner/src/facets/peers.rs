//! [`Peers`]: the runner's side of the peer protocol as its owner sees it:
//! where it listens, what its peers did (counters, notices, state sizes),
//! and forgetting a peer. All of it reads as empty or zero without peers.

use std::sync::atomic::Ordering;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_runner_core::{PeerNotice, PeerStateSizes};

use crate::net::ControlCounters;
use crate::stats::PeerStats;
use crate::{Runner, peer};

/// The runner's peer controls and counters, from [`Runner::peers`].
///
/// ```ignore
/// let PeerStats { counters, open_sockets, stalled } = runner.peers().stats();
/// ```
#[derive(Clone, Copy)]
pub struct Peers<'a> {
    runner: &'a Runner,
}

impl<'a> Peers<'a> {
    pub(crate) fn new(runner: &'a Runner) -> Self {
        Self { runner }
    }

    /// This runner's advertised control endpoint (peer mode only).
    pub fn endpoint(&self) -> Option<&'a ControlEndpoint> {
        self.runner.endpoint.as_ref()
    }

    /// Test support: this runner's UCX worker address, which every source
    /// it dials receives in its metadata (the hostile-member tests connect
    /// to it as such a member would). Not for production use.
    #[doc(hidden)]
    pub fn worker_address(&self) -> Option<&'a [u8]> {
        self.runner.worker_address.as_deref()
    }

    /// Notices about memory a peer may still write (uncertain / quiesced).
    pub fn take_notices(&self) -> Vec<PeerNotice> {
        self.runner.shared.lock().core.take_notices()
    }

    /// Peer protocol counters, and the control sockets open now.
    pub fn stats(&self) -> PeerStats {
        let (counters, stalled) = {
            let inner = self.runner.shared.lock();
            (inner.core.peer_counters(), inner.core.peer_stalled())
        };
        let open_sockets = self
            .runner
            .peer
            .as_ref()
            .map_or(0, |p| p.stats.open_sockets.load(Ordering::Relaxed));
        PeerStats {
            counters,
            open_sockets,
            stalled,
        }
    }

    /// The control channel's counters: what it refused and cut (all zero
    /// without peers).
    pub fn control_stats(&self) -> ControlCounters {
        self.runner
            .peer
            .as_ref()
            .map_or_else(ControlCounters::default, |p| p.stats.snapshot())
    }

    /// Sizes of the core's per-peer state (routes, fences, hints, ...): what
    /// the trust rules bound.
    pub fn state_sizes(&self) -> PeerStateSizes {
        self.runner.shared.lock().core.peer_state_sizes()
    }

    /// Forgets a peer: closes its control socket and data route.
    pub fn forget(&self, peer: &ControlEndpoint) {
        if let Some(driver) = self.runner.peer.as_ref() {
            let _ = driver.tx.send(peer::PeerCmd::Forget(peer.clone()));
        }
    }
}

impl std::fmt::Debug for Peers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers").finish_non_exhaustive()
    }
}
