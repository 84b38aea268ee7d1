//! Integration tests through the kvcr-foundation facade (one binary): the
//! Guard. The runner's own integration tests are in `runner/tests/it`, the
//! publisher's in `publisher/tests/it`, the UCX layer's in `ucx/tests` and the
//! contracts' tables and snapshots in `contracts/tests`.

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
// the Guard's tests use only some of them.
#[allow(dead_code)]
#[path = "../../runner/tests/it/nodes.rs"]
mod nodes;
