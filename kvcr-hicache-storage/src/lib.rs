//! kvcr-hicache-storage (slice 2/5): kvcr as the HiCache L3 storage backend
//! behind an engine's own host page pool (mode A).
//!
//! This slice builds on `kvcr-foundation`'s runner; its backend is tracked as
//! its own issue and not written yet, so the crate exports nothing today.

#![forbid(unsafe_code)]
