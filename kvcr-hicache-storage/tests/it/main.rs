//! Public-contract tests of kvcr-hicache-storage (one integration binary).

// Test helpers outside `#[test]` functions panic on purpose: a failed helper is
// a failed test.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod config;
mod fixture;
mod g3;
mod guard;
mod layouts;
mod local;
mod peer;
mod publish;

/// Tests that start runners (copy threads, UCX workers, sockets) take this
/// lock: on a 2-core machine they time out against each other otherwise.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
