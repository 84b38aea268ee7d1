//! Whether spinning pays on this host right now.
//!
//! A thread that stays awake for a reply (the peer thread's linger, a
//! caller's short wait for a completion) yields its CPU each turn. On a host
//! with free cores the yield returns at once, and the awake thread notices
//! the reply microseconds sooner than a sleeping one would be woken. On a
//! crowded host the yield hands the CPU to another process for its whole
//! time slice (~4 ms on the 2-vCPU VM), and a thread that never slept gets
//! no wake-up preference back: with two compilers beside it, each 64 KiB
//! TCP request waited 3.9–4.0 ms (median) for such slices, against
//! 0.2–0.6 ms when the same threads slept on their events instead.
//!
//! So awake waits are timed: a yield, or a spinning loop's turn that found
//! nothing to do, that lasted long shows another runnable thread took the
//! CPU meanwhile. Once such stolen time adds up to a quarter of a 100 ms
//! window, for [`CONTENDED_FOR`] the awake waits are skipped: waiters sleep
//! on their events (the kernel wakes them ahead of the busy processes), and
//! a spinning transfer naps once nothing has moved for a few tens of µs, so
//! the thread on the other side of it gets the CPU. Afterwards spinning is tried
//! again; re-checking costs one window's stolen slices per period. Beside
//! two busy loops on the 2-vCPU VM, 64 KiB TCP requests took 3.96 ms
//! (median) before and 0.12–0.40 ms after; on a quiet host nothing changes
//! (no wait runs late there).
//!
//! The state is process-wide, not per runner: contention is a property of
//! the host's CPUs, and every runner in the process learns from any one's
//! waits.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// An awake wait that took longer than this gave a time slice away: on a
/// free core a yield returns in well under a microsecond (a few when it
/// only trades turns with other yielding threads), and a spinning turn with
/// nothing to do takes microseconds. (Seen on the VM: late yields last
/// 1.5–5 ms.)
pub(crate) const PREEMPTED_AFTER: Duration = Duration::from_micros(200);

/// Late waits are summed over windows this long...
const WINDOW: Duration = Duration::from_millis(100);

/// ...and once they add up to this much of one, the host counts as
/// contended. A few late waits a second are the odd slice lost to a
/// neighbour, which spinning still repays (64 KiB TCP requests: 62 µs
/// spinning against 80–105 µs without, with seven late yields in the run);
/// busy neighbours on every core take a slice in nearly every wait.
const STOLEN_PER_WINDOW: Duration = Duration::from_millis(25);

/// How long a contended window keeps awake waits off; afterwards they are
/// tried again (re-checking costs one window's lost slices per period).
pub(crate) const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// The host's CPUs, as this process has seen them.
static HOST: Contention = Contention::new();

/// Set by [`force_contended`]: a test's way into the contended paths.
static FORCED: AtomicBool = AtomicBool::new(false);

/// Whether recent awake waits ran late often enough that they do not pay
/// now.
pub(crate) fn contended() -> bool {
    // Drivers read the clock; no sans-I/O core calls this.
    #[allow(clippy::disallowed_methods)]
    let measured = HOST.contended_at(Instant::now());
    measured || FORCED.load(Ordering::Relaxed)
}

/// Test support: while `on`, every runner of this process behaves as on a
/// contended host (no awake waits), whatever its waits measure. Not for
/// production use; the measured state is what a runner should follow.
#[doc(hidden)]
pub fn force_contended(on: bool) {
    FORCED.store(on, Ordering::Relaxed);
}

/// Yields the CPU once and records whether that gave another thread a time
/// slice (see the module documentation).
pub(crate) fn yield_cpu() {
    #[allow(clippy::disallowed_methods)]
    let before = Instant::now();
    std::thread::yield_now();
    note_wait(before);
}

/// Records a stretch of awake waiting, from `began` until now, that did no
/// work of its own (a yield, a spinning loop's turn that found nothing to
/// progress): if it lasted past [`PREEMPTED_AFTER`], another thread had the
/// CPU meanwhile.
pub(crate) fn note_wait(began: Instant) {
    #[allow(clippy::disallowed_methods)]
    HOST.note_wait(began, Instant::now());
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    // Only differences of later reads against this one are used.
    #[allow(clippy::disallowed_methods)]
    *EPOCH.get_or_init(Instant::now)
}

fn since_epoch(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX)
}

/// Late waits of the current window.
#[derive(Default)]
struct Window {
    /// When the window's first late wait ended (`None`: no window open).
    start: Option<Instant>,
    /// Their total length.
    stolen: Duration,
}

/// Until when awake waits are off, and the window being summed.
struct Contention {
    /// Nanoseconds since [`epoch`] (0: never contended). Read on every
    /// wait; written only after late waits.
    until: AtomicU64,
    /// Touched only after late waits (rare, each a slice long), so a lock.
    window: Mutex<Window>,
}

impl Contention {
    const fn new() -> Self {
        Self {
            until: AtomicU64::new(0),
            window: Mutex::new(Window {
                start: None,
                stolen: Duration::ZERO,
            }),
        }
    }

    fn contended_at(&self, now: Instant) -> bool {
        since_epoch(now) < self.until.load(Ordering::Relaxed)
    }

    /// Records an awake wait that lasted from `before` to `after`.
    fn note_wait(&self, before: Instant, after: Instant) {
        let took = after.saturating_duration_since(before);
        if took <= PREEMPTED_AFTER {
            return;
        }
        let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        match window.start {
            Some(start) if after.saturating_duration_since(start) < WINDOW => {
                window.stolen += took;
            }
            _ => {
                *window = Window {
                    start: Some(after),
                    stolen: took,
                };
            }
        }
        if window.stolen >= STOLEN_PER_WINDOW {
            *window = Window::default();
            self.until
                .fetch_max(since_epoch(after + CONTENDED_FOR), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LATE: Duration = Duration::from_millis(4);

    /// Yields of `took` each, one every `every`, from `t0`; returns when the
    /// last ended.
    fn yields(host: &Contention, t0: Instant, n: u32, took: Duration, every: Duration) -> Instant {
        let mut end = t0;
        for i in 0..n {
            let before = t0 + every * i;
            end = before + took;
            host.note_wait(before, end);
        }
        end
    }

    #[test]
    fn prompt_yields_never_count() {
        let host = Contention::new();
        let t0 = epoch() + Duration::from_secs(10);
        let end = yields(&host, t0, 10_000, PREEMPTED_AFTER, PREEMPTED_AFTER);
        assert!(!host.contended_at(end));
    }

    #[test]
    fn the_odd_lost_slice_leaves_spinning_on() {
        // Seven 4 ms slices lost over a second: what a quiet VM showed.
        let host = Contention::new();
        let t0 = epoch() + Duration::from_secs(10);
        let end = yields(&host, t0, 7, LATE, Duration::from_millis(150));
        assert!(!host.contended_at(end));
    }

    #[test]
    fn slices_lost_in_most_waits_turn_awake_waits_off_for_a_period() {
        let host = Contention::new();
        let t0 = epoch() + Duration::from_secs(10);
        // 4 ms lost every 5 ms: the seventh brings the window to 28 ms.
        let sixth = yields(&host, t0, 6, LATE, Duration::from_millis(5));
        assert!(!host.contended_at(sixth), "24 ms of 100 is below the share");
        let seventh = yields(&host, t0 + Duration::from_millis(30), 1, LATE, LATE);
        assert!(host.contended_at(seventh));
        assert!(host.contended_at(seventh + CONTENDED_FOR - Duration::from_micros(1)));
        assert!(!host.contended_at(seventh + CONTENDED_FOR));
        // An older late yield reported afterwards does not shorten it.
        host.note_wait(t0 - Duration::from_secs(5), t0 - Duration::from_secs(4));
        assert!(host.contended_at(seventh + CONTENDED_FOR - Duration::from_micros(1)));
    }

    #[test]
    fn a_window_that_ended_starts_over() {
        let host = Contention::new();
        let t0 = epoch() + Duration::from_secs(10);
        // 20 ms lost in one window, then 20 ms in the next: neither has 25.
        let first = yields(&host, t0, 5, LATE, Duration::from_millis(5));
        let second = yields(&host, first + WINDOW, 5, LATE, Duration::from_millis(5));
        assert!(!host.contended_at(second));
    }

    proptest::proptest! {
        /// Whatever the waits, contention ends `CONTENDED_FOR` after the
        /// last late one, and waits that were all prompt never start it.
        #[test]
        fn contention_is_bounded_by_the_late_waits(
            waits in proptest::collection::vec((0u64..20_000, 0u64..6_000), 0..200),
        ) {
            let host = Contention::new();
            let mut at = epoch() + Duration::from_secs(10);
            let mut last_late_end = None;
            for (gap_us, took_us) in waits {
                at += Duration::from_micros(gap_us);
                let end = at + Duration::from_micros(took_us);
                host.note_wait(at, end);
                if Duration::from_micros(took_us) > PREEMPTED_AFTER {
                    last_late_end = Some(end);
                }
                at = end;
                if last_late_end.is_none() {
                    proptest::prop_assert!(!host.contended_at(at));
                }
            }
            if let Some(end) = last_late_end {
                proptest::prop_assert!(!host.contended_at(end + CONTENDED_FOR));
            }
        }
    }
}
