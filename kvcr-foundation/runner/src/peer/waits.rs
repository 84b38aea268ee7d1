//! How the peer thread waits while it is awake: a peek at what the core
//! awaits, the wait of a busy turn while a transfer moves, and how long
//! it stays awake after activity before it sleeps on its events.

use std::time::{Duration, Instant};

use crate::contention;
use crate::shared::Shared;

/// Whether a UCX transfer may be moving into us and whether a reply to us
/// is awaited, into `waits`, from the core if its lock is free; `false`:
/// it was not (`waits` keeps last turn's answer).
pub(super) fn peek_waits(shared: &Shared, waits: &mut (bool, bool)) -> bool {
    // A peek, not a wait: while a caller holds the core (planning
    // the very request this thread is about to send), blocking here
    // slept the thread in the kernel and its wake-up cost ~5 µs of
    // a one-block restore (traced); last turn's answer serves, and
    // this turn does not sleep.
    match shared.try_lock() {
        Some(inner) => {
            *waits = (
                inner.core.peer_awaits_transport(),
                inner.core.peer_busy().0 > 0,
            );
            true
        }
        None => false,
    }
}

/// One busy turn's wait (it began at `wait_began`), while a transfer moves:
/// a nap when nothing moved since `last_progress` for a while, else a yield
/// of the CPU when the turn found nothing (`progressed`, `drained`), then a
/// turn of the socket tasks; a turn that found nothing yet waited long is
/// noted for [`contention`].
pub(super) async fn wait_on_transfer(
    wait_began: Instant,
    last_progress: Instant,
    progressed: bool,
    drained: bool,
) {
    // Nothing moved for a while: leave the core to other threads
    // between rounds. The other side of the transfer may need
    // this very CPU: a write into us moves only while its source
    // runs, and our own put over TCP finishes only once the
    // destination has read it and acknowledged (traced beside
    // one busy process: a source spinning on its unfinished put
    // kept the destination it waited for off their shared CPU
    // for its whole 2.8 ms slice, every 64 KiB request). A short
    // sleep, not a yield: a yielding thread on a crowded machine
    // waits out other processes' whole time slices (4 ms each,
    // measured: shm fetches fell to 0.1 GB/s beside two busy
    // processes), while a sleeper is woken ahead of them when its
    // nap ends (timer slack is cut to 1 µs on this thread).
    // Sooner while the host's CPUs are contended (`contention`).
    let still = wait_began.saturating_duration_since(last_progress);
    let contended = !progressed && contention::contended();
    let napped = !progressed
        && (still >= SPIN_BEFORE_NAP || (still >= CONTENDED_SPIN_BEFORE_NAP && contended));
    if napped {
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(WAIT_NAP);
    }
    // A turn that found nothing hands its CPU to whoever else
    // is runnable there: on a host with fewer free cores than
    // awake threads that is often the very thread this one
    // waits for (the source's peer thread, sharing the CPU,
    // cannot read our `start_write` while we spin on its reply).
    // Traced hop by hop on the 2-vCPU VM: the slow stretches of
    // 64 KiB requests (250–450 µs, for tens to hundreds of
    // requests in a row) all stalled between our socket write
    // and the source decoding it. Yielding each empty turn:
    // no 50-request median above 200 µs in five runs of 600
    // requests per size, against nine (up to 1.6 ms) without,
    // and the 64 KiB median 2–3 µs higher. Not on a contended
    // host: a yield there gives a busy process a whole time
    // slice, and the nap above serves instead. A plain yield:
    // the wait it is part of is timed below, once.
    if !progressed && !drained && !napped && !contended {
        std::thread::yield_now();
    }
    tokio::task::yield_now().await;
    // A turn that found nothing to do yet waited long had the
    // CPU taken from it (`contention`).
    if !progressed && !drained {
        contention::note_wait(wait_began);
    }
}

/// How long a destination's peer thread stays awake for a reply after its
/// last activity (a request sent, a message): about a one-block fetch's
/// round trip here. Bounded, so a runner whose source went quiet sleeps.
pub(super) const ACTIVE_SPIN: Duration = Duration::from_micros(300);

/// How long a peer thread stays awake after its last activity when it
/// awaits nothing: a burst's next request then finds it running. Bounded, so
/// an idle node still sleeps (`peer.idle_cpu`).
///
/// Traced hop by hop on the H200 host, back-to-back one-block restores
/// reach the source 150–200 µs apart, and with 200 µs it had often gone to
/// sleep, noticing the next request 9–23 µs (median) after it was written
/// against 3–4 µs awake (the target's thread likewise, for its caller's next
/// request). On the 2-vCPU VM, where 1 MiB requests come 300 µs or more
/// apart (the caller checks each one's bytes), a source lingering 200 µs
/// was asleep for each and took 56 µs (median) to decode it against 10 µs;
/// 1 MiB requests went from 495–530 µs to 421–430 µs (p50, three
/// alternating runs each), smaller ones level. A lingering turn yields its
/// CPU to whoever else is runnable there, and the linger is skipped while
/// the host is contended (`contention`), so on a small host it takes only
/// a CPU nobody else wanted.
pub(super) const LINGER: Duration = Duration::from_millis(1);

/// How long the peer thread naps between progress rounds while a transfer is
/// under way and nothing moved for `SPIN_BEFORE_NAP` (`CONTENDED_SPIN_BEFORE_NAP`
/// on a contended host).
const WAIT_NAP: Duration = Duration::from_micros(10);

/// How long the peer thread spins without napping after its worker last made
/// progress (or a wait began): a quiet machine's transfers finish inside it.
pub(super) const SPIN_BEFORE_NAP: Duration = Duration::from_micros(200);

/// The same while the host's CPUs are contended (`contention`): long enough
/// that a transfer whose bytes are moving (a TCP put is many segments, each
/// its own progress turn) keeps going, short enough that a stalled one hands
/// the CPU to the other side of it well inside a time slice.
const CONTENDED_SPIN_BEFORE_NAP: Duration = Duration::from_micros(30);
