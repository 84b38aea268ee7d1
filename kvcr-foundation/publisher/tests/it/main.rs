//! Integration tests of the publisher (one binary): the encoded bytes as insta
//! snapshots, the live PUB and replay sockets, bounds and leaks, and the real
//! clients (vLLM's wire classes, Dynamo's indexer) when installed.

// Test helpers outside `#[test]` functions panic on purpose: a failed helper is
// a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod bounds;
mod publisher;
