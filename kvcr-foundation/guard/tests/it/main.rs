//! Integration tests of the guard (one binary): runners under a guard
//! served in this process. The guard's unit tests (its service, leases,
//! deaths, over real sockets and processes) are in `src/tests.rs`; an engine
//! killed mid-serve is `cargo xtask e2e --only engine-crash`.

// Test helpers outside `#[test]` functions panic on purpose: a failed helper is
// a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod guard;
// The runner's peer-test nodes, shared with its own tests rather than copied;
// the guard's tests use only some of them.
#[allow(dead_code)]
#[path = "../../../runner/tests/it/nodes.rs"]
mod nodes;

// The lock, one copy for the crate group's test binaries (the guard's tests
// need no waits of their own).
#[allow(dead_code)]
#[path = "../../../test-support/serial.rs"]
mod support;
use support::serial;
