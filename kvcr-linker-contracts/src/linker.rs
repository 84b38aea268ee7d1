//! The linker contract: the operations every direct linker (GPU pools ↔ an
//! external store, no engine host tier) offers, sans-I/O.
//!
//! Work is accepted by the calling methods and lands only through
//! [`Linker::poll`], so a caller (or the conformance suite) decides when
//! completions are observed.

use kvcr_contracts::{AttemptId, BlockKey, Incarnation, NamespaceId, ScopedKey, Tier};

use crate::error::Result;
use crate::hooks::RequestHooks;
use crate::prefix::{RestorableLengths, RetireReason};

/// One page slot of the engine's device KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceSlot(pub u32);

/// Device pages to persist into the linker's store, in chain order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadBatch {
    /// The pages' namespace.
    pub namespace: NamespaceId,
    /// Each page's key and the device slot holding it (stable until the
    /// offload lands: the engine keeps it locked).
    pub pages: Vec<(BlockKey, DeviceSlot)>,
}

/// An accepted offload; its outcome comes back through [`Linker::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OffloadTicket(pub u64);

/// An accepted load; its outcome comes back through [`Linker::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LoadTicket(pub u64);

/// Why an offload was declined (the engine keeps the pages and may retry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeclineReason {
    /// More pages than the store could ever hold at once.
    OverCapacity,
    /// The linker is unhealthy and refuses work until reset.
    Unhealthy,
}

/// The answer to [`Linker::offload`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadOutcome {
    /// Accepted; the outcome follows through [`Linker::poll`].
    Queued(OffloadTicket),
    /// Not accepted; nothing changed.
    Declined(DeclineReason),
}

/// Where an attempt's preparation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreparationState {
    /// Staging is in flight; admission waits.
    Fetching,
    /// Staged and claimed; lookups may hit.
    Ready,
    /// A load consumed it.
    Loaded,
    /// Nothing to restore any more; admission proceeds (recompute).
    Retired(RetireReason),
}

/// What landed since the last [`Linker::poll`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkerEvent {
    /// An offload finished; outcomes come in submission order.
    OffloadDone {
        /// Which offload.
        ticket: OffloadTicket,
        /// Whether every page is committed in the store.
        success: bool,
    },
    /// A load finished.
    LoadDone {
        /// The attempt that queued it (possibly ended since).
        attempt: AttemptId,
        /// Which load.
        ticket: LoadTicket,
        /// Whether every page landed on the device.
        success: bool,
    },
    /// A pipelined restore (a linker's restore straight into device slots,
    /// each page moved on as soon as it reached the store) finished.
    RestoreDone {
        /// The attempt that queued it (possibly ended since).
        attempt: AttemptId,
        /// Which restore.
        ticket: LoadTicket,
        /// Leading pages on the device, byte exact; the engine recomputes
        /// the rest (a page after a failed one may have landed, but is not
        /// counted: a prefix is all an engine can use).
        restored: u32,
        /// Pages asked for.
        pages: u32,
    },
    /// A restore's or load's first layer is on the device for its first
    /// `pages` pages (copied first from KVCR DRAM, or by a same-host peer's
    /// one-hop copies), before the rest has landed: the engine may start
    /// layer 0 of those pages. Its [`LinkerEvent::RestoreDone`] or
    /// [`LinkerEvent::LoadDone`] (which always follows) alone says which
    /// pages landed byte exact, and work on a page it does not count must
    /// be thrown away. At most once per restore or load, and only where
    /// the copy reports it (a device pool).
    FirstLayerLanded {
        /// The attempt that queued the restore.
        attempt: AttemptId,
        /// Which restore or load.
        ticket: LoadTicket,
        /// Leading pages whose first layer is in place.
        pages: u32,
    },
    /// The store evicted pages (feed these to the inventory ledger).
    Evicted {
        /// The store's incarnation.
        incarnation: Incarnation,
        /// The tier evicted from.
        tier: Tier,
        /// The pages, each reported once.
        keys: Vec<ScopedKey>,
    },
}

/// Claim and transfer counts, for leak checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accounting {
    /// Claims held on staged pages (by attempts or by transfers in flight).
    pub claims_held: usize,
    /// Transfers (fetches, loads, offloads) accepted and not yet landed.
    pub transfers_in_flight: usize,
    /// Attempts started and not yet ended or superseded.
    pub live_attempts: usize,
}

/// A direct linker. One value serves one rank; agreement across ranks
/// ([`crate::agree_restorable_prefix`], [`crate::InventoryLedger`]) happens
/// outside it.
pub trait Linker: RequestHooks {
    /// Accepts device pages for persisting, or declines them.
    fn offload(&mut self, batch: OffloadBatch) -> Result<OffloadOutcome>;

    /// Where the live `attempt`'s preparation stands.
    fn preparation(&self, attempt: &AttemptId) -> Result<PreparationState>;

    /// The prefix lengths this rank can restore for the live `attempt` now
    /// that the engine holds `device_prefix_pages` pages and asks about
    /// `tail`. Only a ready preparation hits; a grown device prefix shifts it,
    /// a shrunk one retires it.
    fn lookup(
        &mut self,
        attempt: &AttemptId,
        device_prefix_pages: u32,
        tail: &[BlockKey],
    ) -> Result<RestorableLengths>;

    /// Queues a load of the first `slots.len()` prepared pages into `slots`.
    /// Every page must hold a claim, and only one load per attempt may be in
    /// flight. Once accepted it is never cancelled.
    fn load(&mut self, attempt: &AttemptId, slots: &[DeviceSlot]) -> Result<LoadTicket>;

    /// Lands whatever completed and returns what happened.
    #[must_use]
    fn poll(&mut self) -> Vec<LinkerEvent>;

    /// Claim and transfer counts.
    fn accounting(&self) -> Accounting;
}
