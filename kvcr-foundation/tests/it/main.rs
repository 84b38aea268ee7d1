//! Public-contract tests of kvcr-foundation (one integration binary).

// Test helpers outside `#[test]` functions panic on purpose: a failed helper is
// a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

/// Tests that open sockets, start runner threads or spawn processes take this
/// lock: on a 2-core machine they time out against each other otherwise, and
/// the publisher's leak counts need quiet neighbours.
#[cfg(feature = "runner")]
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(feature = "runner")]
mod device;
mod endpoints;
mod frames;
mod hints;
mod keys;
#[cfg(feature = "runner")]
mod peer;
#[cfg(feature = "runner")]
mod peer_faults;
#[cfg(feature = "runner")]
mod publisher;
#[cfg(feature = "runner")]
mod runner;
mod tiers;
#[cfg(feature = "runner")]
mod ucx;
