//! The integration tests' one lock and their bounded waits, for the crate
//! group's test binaries that open sockets, start threads or spawn processes
//! (the runner's, the guard's, the publisher's). Each binary includes this
//! file by `#[path]`, so there is one copy and no crate to depend on.

/// Tests that open sockets, start runner threads or spawn processes take this
/// lock: on a 2-core machine they time out against each other otherwise.
/// (Cargo runs test binaries one after another, so a binary's lock also keeps
/// its tests clear of the other crates' tests.)
pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
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
