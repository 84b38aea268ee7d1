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

/// Tests that open sockets, start runner threads or spawn processes take this
/// lock: on a 2-core machine they time out against each other otherwise.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

mod guard;
// The runner's peer-test nodes, shared with its own tests rather than copied;
// the guard's tests use only some of them.
#[allow(dead_code)]
#[path = "../../../runner/tests/it/nodes.rs"]
mod nodes;
