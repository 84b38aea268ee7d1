//! The crate's one error type.
//!
//! Every variant is bad input the caller can act on; returning one never
//! changes the state of the value that returned it.

use kvcr_contracts::{AttemptId, Incarnation, Tier};

use crate::attempt::{ClaimId, TransferId};
use crate::ledger::OffloadId;
use crate::linker::DeviceSlot;

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a linker contract can refuse.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The attempt's request has no live attempt (never started, finished or
    /// aborted).
    #[error("request {:?} has no live attempt (attempt generation {})", attempt.request.0, attempt.generation)]
    NoLiveAttempt {
        /// The attempt named by the caller.
        attempt: AttemptId,
    },
    /// A newer attempt of the same request superseded this one.
    #[error("attempt {} of request {:?} was superseded by generation {current_generation}", attempt.generation, attempt.request.0)]
    Superseded {
        /// The stale attempt named by the caller.
        attempt: AttemptId,
        /// The live generation of that request.
        current_generation: u64,
    },
    /// An attempt started that is not newer than the live one of its request
    /// (attempt generations only grow).
    #[error("attempt {} of request {:?} is not newer than live generation {current_generation}", attempt.generation, attempt.request.0)]
    AttemptOutOfOrder {
        /// The attempt that tried to start.
        attempt: AttemptId,
        /// The live generation of that request.
        current_generation: u64,
    },
    /// A transfer id that is not in flight (never accepted, or already landed).
    #[error("transfer {transfer:?} is not in flight")]
    UnknownTransfer {
        /// The transfer named by the caller.
        transfer: TransferId,
    },
    /// A claim the attempt does not hold (double release, or someone else's).
    #[error("attempt {} does not hold claim {claim:?}", attempt.generation)]
    ClaimNotHeld {
        /// The attempt named by the caller.
        attempt: AttemptId,
        /// The claim named by the caller.
        claim: ClaimId,
    },
    /// A load names a page the attempt holds no claim for; lookup never
    /// reported it, so loading it would read unowned memory.
    #[error("attempt {} loads page {page} without a held claim", attempt.generation)]
    LoadWithoutClaim {
        /// The loading attempt.
        attempt: AttemptId,
        /// The page (index into the prepared tail) that has no claim.
        page: usize,
    },
    /// A second load queued for an attempt whose first load is still in flight.
    #[error("attempt {} already has a load in flight", attempt.generation)]
    DuplicateLoad {
        /// The loading attempt.
        attempt: AttemptId,
    },
    /// Reset refused: accepted transfers have not landed yet, and their memory
    /// may still be touched. Drain them first.
    #[error("reset refused: {in_flight} accepted transfers have not landed")]
    TransfersInFlight {
        /// Transfers still in flight.
        in_flight: usize,
    },
    /// A device page slot outside the engine's pool.
    #[error("device slot {slot:?} is outside the pool of {slots} slots")]
    DeviceSlot {
        /// The slot named by the caller.
        slot: DeviceSlot,
        /// Slots in the pool.
        slots: u32,
    },
    /// A rank-agreement input with the wrong number of ranks.
    #[error("expected reports from {expected} ranks, got {got}")]
    RankCount {
        /// The world size.
        expected: usize,
        /// Reports given.
        got: usize,
    },
    /// A rank index not below the world size.
    #[error("rank {rank} is outside a world of {ranks} ranks")]
    RankOutOfRange {
        /// The rank named by the caller.
        rank: u32,
        /// The world size.
        ranks: u32,
    },
    /// A rank reported the outcome of one offload twice.
    #[error("rank {rank} already reported offload {offload:?}")]
    RankReportedTwice {
        /// The offload.
        offload: OffloadId,
        /// The rank that reported again.
        rank: u32,
    },
    /// An offload id that is not pending (never begun, already decided, or
    /// dropped by a reset).
    #[error("offload {offload:?} is not pending")]
    UnknownOffload {
        /// The offload named by the caller.
        offload: OffloadId,
    },
    /// An offload with no pages.
    #[error("offload has no pages")]
    EmptyOffload,
    /// GPU and the engine's host pool are framework-owned: the engine
    /// publishes them, never kvcr, and they cannot be opted in.
    #[error("tier {tier:?} is framework-owned inventory; kvcr never publishes it")]
    EngineTier {
        /// The tier named by the caller.
        tier: Tier,
    },
    /// A block size of zero tokens.
    #[error("block size must be at least one token")]
    ZeroBlockSize,
    /// A page whose token count is not the block size.
    #[error("page {page} has {got} tokens, expected {expected}")]
    TokenCount {
        /// Index of the page in its offload.
        page: usize,
        /// The block size.
        expected: u32,
        /// Tokens given.
        got: usize,
    },
    /// A reset to the incarnation already live; a reset must open a new one,
    /// or removals of the old one could be confused with the new.
    #[error("reset must open a new incarnation, {incarnation} is already live")]
    SameIncarnation {
        /// The incarnation named by the caller.
        incarnation: Incarnation,
    },
    /// A residency query over no pools.
    #[error("a residency query needs at least one pool")]
    NoPools,
    /// Pools of one query disagree on how many pages were queried.
    #[error("pool {pool} reports {got} pages, pool 0 reports {expected}")]
    PoolLength {
        /// The pool that disagrees.
        pool: usize,
        /// Pages in pool 0.
        expected: usize,
        /// Pages in this pool.
        got: usize,
    },
    /// A sliding-window pool with a window of zero pages.
    #[error("pool {pool} has a sliding window of zero pages")]
    ZeroWindow {
        /// The pool.
        pool: usize,
    },
    /// A linker implementation's own failure (a CUDA or store error), kept
    /// typed behind the box so this crate does not depend on the backend.
    #[error("linker backend failed")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}
