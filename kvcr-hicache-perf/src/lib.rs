//! kvcr-hicache-perf (slice 3/5): opt-in delivery and placement controls on
//! top of `kvcr-hicache-storage`. Every control is off by default, and the
//! defaults behave exactly as the storage crate alone.
//!
//! - [`backend`]: [`KvcrHiCachePerf`], the storage crate's backend with the
//!   controls (same entry points and argument order; [`PerfConfig`] apart,
//!   or `perf_*` keys in the engine's extra config): read batching and
//!   metadata-query batching; runner tuning.
//! - [`window`]: bounded delivery windows (operations and bytes in flight),
//!   a sans-I/O core and a driver over a runner's `deliver`.
//! - [`coalesce`]: descriptor coalescing as a pure planner; [`restore`]: the
//!   coalesced restore fast path (claims held until copied, sparse fallback).
//! - [`layout`]: fixed page layouts as descriptor lists.
//! - [`placement`]: process-owned anonymous DRAM for the runner's pools
//!   (pre-faulted, optional huge pages, optional NUMA binding) and
//!   [`audit`], which reads back where the pages really are.
//! - UCX split sizing is a runner option
//!   (`kvcr_foundation::runner::PutSplit`, set in `PeerOptions::put_split`);
//!   [`placement::split_for`] picks per-transport values.
//!
//! Not carried over: the Python runner's opt-in thread-switch interval
//! tuning (`sys.setswitchinterval`) has no Rust analogue — the runner's
//! threads are OS threads without an interpreter lock, so there is nothing
//! to tune.

#![deny(unsafe_code)]

pub mod audit;
pub mod backend;
pub mod coalesce;
pub mod error;
pub mod layout;
pub mod placement;
pub mod restore;
pub mod window;

pub use backend::{KvcrHiCachePerf, PerfConfig};
pub use error::{PerfError, Result};
