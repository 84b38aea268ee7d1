//! Integration tests of kvcr-ucx against the system UCX (one binary): real
//! puts on loopback between contexts and processes, and the refusals the
//! safe layer makes before UCX sees bad input.
//!
//! No lock between tests: each context picks its transports itself
//! (`ContextConfig::loopback_tls`), so they run in parallel.

// Test helpers outside `#[test]` functions panic on purpose: a failed helper is
// a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod ucx;
