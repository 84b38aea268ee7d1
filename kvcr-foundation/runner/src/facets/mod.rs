//! The runner's facets: borrowed views that [`Runner`](crate::Runner) hands
//! out for everything an engine's hot path does not call. `Runner` itself
//! keeps the engine's operations (deposit, fetch, deliver, wait, ...); a
//! facet groups one concern, so a reader finds, say, every peer control in
//! [`Peers`] rather than among fifty methods.
//!
//! Each facet borrows the runner (`Copy`, no state of its own) and is made
//! per call site: `runner.peers().stats()`.

mod hints;
mod peers;
mod pools;
mod recovery;

pub use self::hints::Hints;
pub use self::peers::Peers;
pub use self::pools::Pools;
pub use self::recovery::Recovery;

use crate::Runner;

/// The facets' doors on the runner.
impl Runner {
    /// Operations under a request's router hint: `runner.hints().fetch(..)`.
    pub fn hints(&self) -> Hints<'_> {
        Hints::new(self)
    }

    /// The peer protocol's controls and counters: `runner.peers().stats()`.
    pub fn peers(&self) -> Peers<'_> {
        Peers::new(self)
    }

    /// KVCR's memory (DRAM pools, device copier, G3): `runner.pools().bytes()`.
    pub fn pools(&self) -> Pools<'_> {
        Pools::new(self)
    }

    /// What a guarded runner's warm start reports (how it started, its
    /// journal): `runner.recovery().warm_start()`.
    pub fn recovery(&self) -> Recovery<'_> {
        Recovery::new(self)
    }
}
