//! Integration tests of the runner (one binary): pools and copies over real
//! memory, the device seam, G3's disk tier, and peer restore over real UCX and
//! real TCP control channels, in one process and across processes (faults,
//! trust). The guard's tests are the `kvcr-guard` crate's.

// Test helpers outside `#[test]` functions panic on purpose: a failed helper is
// a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod device;
mod g3_tier;
mod local_users;
mod nodes;
mod one_hop;
mod peer;
mod peer_admission;
mod peer_faults;
mod peer_identity;
mod peer_routes;
mod peer_sealing;
mod peer_trust;
mod processes;
mod runner;

// The lock and the waits, one copy for the crate group's test binaries.
#[path = "../../../test-support/serial.rs"]
mod support;
use support::{serial, wait_until};
