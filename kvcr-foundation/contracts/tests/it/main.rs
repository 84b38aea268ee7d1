//! Contract tests of kvcr-contracts (one integration binary): endpoint, key,
//! hint and tier tables, frame snapshots and property tests.

// Test helpers outside `#[test]` functions panic on purpose: a failed helper is
// a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod endpoints;
mod frames;
mod hints;
mod keys;
mod member_keys;
mod tiers;
