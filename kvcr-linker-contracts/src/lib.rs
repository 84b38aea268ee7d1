//! kvcr-linker-contracts (slice 4/5): what every direct linker (mode B: pages
//! move between the engine's GPU pools and an external store with no engine
//! host tier) shares, sans-I/O and with no-op defaults.
//!
//! * [`hooks`]: [`RequestHooks`] (request start, finish, abort, reset; every
//!   method defaults to nothing) and the frozen per-attempt [`RequestContext`]
//!   (attempt id, router-hint snapshot, [`PrefixQuery`]).
//! * [`attempt`]: [`AttemptTable`], cancellation ownership across request-id
//!   reuse: a newer attempt supersedes the live one and takes back its
//!   [`ClaimId`]s; ending an attempt never revokes an accepted transfer, and a
//!   late landing for a stale attempt is released, never handed to the new one.
//! * [`prefix`]: sparse shared-prefix residency. [`RestorableLengths`] per rank
//!   (from [`PoolPresence`], sliding-window pools included),
//!   [`agree_restorable_prefix`] (the largest length common to every rank,
//!   never the max of minima), and [`Preparation`], which shifts or retires
//!   as the engine's device prefix grows or shrinks.
//! * [`prepared`]: [`PreparedAttempts`], the attempt and preparation
//!   bookkeeping of a preparing linker (what the reference and the direct
//!   linker share); it returns the claims each step frees.
//! * [`ledger`]: [`InventoryLedger`], the owned-inventory ledger that turns
//!   rank-agreed offloads, store evictions and resets into
//!   `kvcr_contracts::InventoryEvent`s under an [`OwnershipPolicy`], keeping
//!   every removal identity until its one removal is sent.
//! * [`linker`]: the [`Linker`] trait a concrete linker implements (offload,
//!   lookup, load, poll) and its vocabulary ([`LinkerEvent`], [`Accounting`]).
//! * [`conformance`] and [`reference`](mod@reference): the suite every linker runs against
//!   itself (test-support code: its checks assert), and the in-memory
//!   [`reference::ReferenceLinker`] that passes it.
//!
//! Every fallible function returns the crate's one error type, [`Error`]; bad
//! input never panics and never changes state.

#![forbid(unsafe_code)]

pub mod attempt;
pub mod error;
pub mod hooks;
pub mod ledger;
pub mod linker;
pub mod prefix;
pub mod prepared;

// Always built (std only, no I/O): a feature-gated suite would need a
// self dev-dependency to reach this crate's own integration tests, and that
// self-edge trips the workspace layer check.
pub mod conformance;
pub mod reference;

pub use attempt::{AttemptTable, ClaimId, Landing, Superseded, TransferId};
pub use error::{Error, Result};
pub use hooks::{NoHooks, PrefixQuery, RequestContext, RequestHooks};
pub use ledger::{
    FrameworkChange, InventoryLedger, Offload, OffloadId, OffloadPage, OwnershipPolicy,
    RemovalIdentity,
};
pub use linker::{
    Accounting, DeclineReason, DeviceSlot, Linker, LinkerEvent, LoadTicket, OffloadBatch,
    OffloadOutcome, OffloadTicket, PreparationState,
};
pub use prefix::{
    Advance, LoadClaims, PoolKind, PoolPresence, Preparation, RestorableLengths, RetireReason,
    agree_restorable_prefix,
};
pub use prepared::PreparedAttempts;
