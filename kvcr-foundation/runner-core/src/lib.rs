//! kvcr-runner-core: the rank-local runner's sans-I/O core.
//!
//! Plain data fed `(now, input)` that returns results and [`Action`]s, like
//! quinn-proto: the block index, residencies (FILLING / READY / DISCARDING),
//! slot pools, claims, the eviction queue, operations with deadlines, the
//! inventory events they cause, and the peer protocol's target and source
//! roles. It never touches memory, threads or clocks (`clippy.toml` forbids
//! clock reads); the runner (`kvcr-runner`) owns the memory and the threads,
//! executes the actions and feeds their outcomes back.
//!
//! * [`machine`]: [`Core`], its [`Action`]s and [`CopyOutcome`]s.
//! * [`policy`]: [`CachePolicy`] (LRU default, FIFO, user policies).
//! * [`region`]: registered strided regions and their bounds checks.
//! * [`types`]: what goes in and comes out (entries, results, statistics).
//! * [`journal`]: the residency journal a guard keeps for a restarted
//!   runner (records, codec, layout, writer, recovery).
//! * [`error`]: the crate's one error type.
//!
//! The model-based property tests (`tests`) and the peer simulator
//! (`sim`) drive the core directly, with virtual time.

#![forbid(unsafe_code)]

pub mod error;
pub mod journal;
pub mod machine;
pub mod policy;
pub mod region;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
pub mod types;

pub use error::{Echo, Error, PoolMemoryReason, Result, RunnerReason};
pub use machine::{
    Action, ConnectFailure, CopyOutcome, Core, CoreConfig, CoreCounters, G3Config, G3Counters,
    G3Direction, G3Transfer, JobId, KVCR_REGION_PREFIX, MAX_ADVERTISED_DEVICE_REGIONS,
    MAX_ADVERTISED_REGIONS, MAX_DEAD_INCARNATIONS, MAX_FENCES_PER_TARGET, MAX_REMEMBERED_PEERS,
    MAX_REPROBES_PER_ACK, MAX_RKEY_LEN, MAX_ROUTE_BUDGETS, MAX_SPANS_PER_KEY,
    MAX_WORKER_ADDRESS_LEN, PeerConfig, PeerCounters, PeerNotice, PeerStateSizes, PutSpan,
    RecoveryReport, RouteBudget,
};
pub use policy::CachePolicy;
pub use region::{MAX_REGION_ELEMENTS, MAX_REGION_LABEL, RegionDesc, RegionMemory, position_after};
pub use types::{
    ClaimedCopy, CopySpan, DeliverEntry, DepositEntry, EntryResult, EntryStatus, FailReason,
    OpResult, PageInfo, PoolConfig, PoolId, PoolRange, PoolStats, QueryStatus, ReleaseHandle,
    RunnerStats,
};
