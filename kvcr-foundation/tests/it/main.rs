//! Public-contract tests of kvcr-foundation (one integration binary).

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
mod tiers;
#[cfg(feature = "runner")]
mod ucx;
