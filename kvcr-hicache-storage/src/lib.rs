//! kvcr-hicache-storage (slice 2/5): kvcr as the HiCache L3 storage backend
//! behind an engine's own host page pool (mode A).
//!
//! The engine keeps its host page pool (L2); each rank's
//! [`KvcrHiCacheStorage`] owns a rank-local runner (KVCR DRAM, L3) over it and
//! answers SGLang's `HiCacheStorage` contract:
//!
//! * [`KvcrHiCacheStorage::batch_exists`]: the leading run of pages the rank
//!   group can serve (local residency, or a router hint covering the page),
//!   MIN-reduced over the ranks;
//! * [`KvcrHiCacheStorage::batch_get`]: KVCR DRAM (or the hinted peer, over
//!   UCX, this rank dialling its own shard) → host pages; `true` per page every
//!   rank restored;
//! * [`KvcrHiCacheStorage::batch_set`]: host pages → KVCR DRAM; `true` per page
//!   every rank committed, and only those are published (`BlockStored`, owner
//!   kvcr); evictions on any rank publish exactly one `BlockRemoved` per page.
//!
//! Configuration comes from the engine's storage config ([`StorageConfig`])
//! and the backend's extra-config JSON ([`BackendConfig`]: strict keys, every
//! bound checked). Host layouts ([`HostLayout`]) map to span lists
//! ([`SpanPlan`]). Rank agreement goes through the engine's collective
//! ([`RankGroup`]; [`LocalRankGroup`] runs threads as ranks).
//!
//! Entry points never fail and never panic: an internal fault becomes a miss
//! of the right shape and is counted ([`StorageStats`]); nothing is latched,
//! so the next call is served normally.

#![deny(unsafe_code)]

mod config;
mod error;
mod faults;
mod group;
mod layout;
mod ledger;
mod mapping;
mod storage;

pub use config::{
    BackendConfig, CLUSTER_SECRET_ENV, ClusterSecret, EvictionPolicy, G3Dirs, MAX_LOCAL_DRAM_BYTES,
    MAX_OPERATION_TIMEOUT_MS, StorageConfig,
};
pub use error::{Error, GroupError, Result};
pub use faults::{FaultInjector, FaultKind, Method};
pub use group::{LocalRankGroup, RankGroup, RankGroups, SoloGroup, agree_min};
pub use layout::{
    HostLayout, HostPoolDesc, KvGeometry, POOL_NAME, SpanKind, SpanPlan, pages_from_token_indices,
};
pub use ledger::{MAX_REMOVED_BACKLOG, PageTokens};
pub use storage::{
    ExtraInfo, KvEventEndpoints, KvcrHiCacheStorage, ROUTER_HINT_KEYS, RunnerTuning, StorageStats,
    parse_router_hint,
};
