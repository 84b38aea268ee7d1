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

/// Tests that open sockets or spawn processes take this lock: the leak test
/// counts the process's file descriptors and threads, which needs quiet
/// neighbours, and on a 2-core machine they time out against each other
/// otherwise. (Cargo runs test binaries one after another, so the other
/// crates' tests never run beside these.)
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A bounded wait on an explicit condition (never a sleep to settle).
pub(crate) fn wait_until(what: &str, limit: std::time::Duration, cond: impl FnMut() -> bool) {
    assert!(
        wait_for(limit, cond),
        "timed out after {limit:?} waiting for {what}"
    );
}

/// Whether `cond` became true within `limit`.
#[allow(clippy::disallowed_methods)]
pub(crate) fn wait_for(limit: std::time::Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while !cond() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

mod publisher;
