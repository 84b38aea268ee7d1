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

/// Tests that open sockets, start runner threads or spawn processes take this
/// lock: on a 2-core machine they time out against each other otherwise.
/// (Cargo runs test binaries one after another, so this binary's lock also
/// keeps them clear of the other crates' tests.)
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
fn wait_for(limit: std::time::Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while !cond() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

mod device;
mod g3_tier;
mod nodes;
mod peer;
mod peer_faults;
mod peer_trust;
mod runner;
