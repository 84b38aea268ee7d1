//! Public-contract tests of kvcr-linker-contracts (one integration binary).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod conformance;
