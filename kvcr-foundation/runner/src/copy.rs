//! The local copy engine: one thread that executes copy jobs off the caller's
//! thread and applies their outcomes to the shared core itself, so operations
//! complete without the caller polling. A large host job is shared with
//! scoped helper threads (up to the peer lanes' count), each streaming its own
//! keys' bytes.
//!
//! The thread blocks on its queue when idle (after a short bounded poll; no
//! busy loop, no sleep floor), so a single-block copy costs at most one thread
//! wake-up plus the memcpy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::device::DeviceCopier;
use super::memory::{copy_spans, copy_spans_streaming};
use crate::error::{Error, Result, RunnerReason};
use crate::shared::Shared;
use kvcr_runner_core::CopySpan;
use kvcr_runner_core::{CopyOutcome, JobId};

/// How long a thread that just finished work polls for more before it blocks.
/// A blocked thread costs a futex wake-up (tens of µs on a VM) to restart; a
/// short bounded poll lets back-to-back single-block operations skip it, and
/// an idle engine still sleeps after this long.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// One job for the copy thread.
pub(crate) struct Job {
    pub(crate) id: JobId,
    pub(crate) deadline: Instant,
    pub(crate) keys: Vec<Vec<CopySpan>>,
    pub(crate) cancel: Arc<[AtomicBool]>,
    /// Set for a job that touches device memory: it runs there, not here.
    pub(crate) device: Option<Arc<dyn DeviceCopier>>,
}

/// What the copy thread receives.
pub(crate) enum Msg {
    /// Copy this.
    Job(Job),
    /// Skip whatever is queued and exit.
    Stop,
}

/// Handle to the copy thread. Stopping (or dropping) it skips queued work,
/// lets the key in progress finish, and joins the thread: afterwards no copy
/// touches memory.
pub(crate) struct CopyEngine {
    stop: Sender<Msg>,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl CopyEngine {
    /// Starts the thread on `jobs`; it applies outcomes to `shared` while that
    /// is alive.
    pub(crate) fn start(
        shared: Weak<Shared>,
        stop: Sender<Msg>,
        jobs: Receiver<Msg>,
    ) -> Result<Self> {
        let shutdown = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&shutdown);
        let thread = std::thread::Builder::new()
            .name("kvcr-copy".into())
            .spawn(move || worker(&jobs, &shared, &flag))
            .map_err(|_| Error::runner(RunnerReason::CopyEngineStopped))?;
        Ok(Self {
            stop,
            shutdown,
            thread: Some(thread),
        })
    }

    /// Skips queued work and joins the thread.
    pub(crate) fn stop(&mut self) {
        self.shutdown.store(true, Ordering::Release);
        // If the thread is gone already the send fails; either way it ends.
        let _ = self.stop.send(Msg::Stop);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            // The worker only copies validated spans; a panic there is a bug.
            // Joining still guarantees it no longer touches memory.
            eprintln!("kvcr: copy thread panicked");
        }
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Polls `rx` for up to `budget` (bounded; never an idle busy loop).
pub(crate) fn spin_recv<T>(rx: &Receiver<T>, budget: Duration) -> Option<T> {
    #[allow(clippy::disallowed_methods)]
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(item) => return Some(item),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if start.elapsed() >= budget {
            return None;
        }
        std::hint::spin_loop();
    }
}

fn worker(jobs: &Receiver<Msg>, shared: &Weak<Shared>, shutdown: &AtomicBool) {
    loop {
        let Some(Msg::Job(job)) = spin_recv(jobs, SPIN).or_else(|| jobs.recv().ok()) else {
            return;
        };
        let outcomes = execute(&job, shutdown);
        match shared.upgrade() {
            Some(shared) => shared.copy_done(job.id, &outcomes),
            None => return,
        }
    }
}

/// Jobs at least this large are split over several threads (when their
/// destinations are pairwise disjoint) and written with non-temporal stores:
/// one thread copies ~5–10 GB/s on the hosts measured, several draw more of
/// the memory bandwidth, and a bulk move is read next by its consumer, not by
/// this thread.
const SPLIT_BYTES: u64 = 8 << 20;
/// The least bytes one thread of a split job takes (fewer threads otherwise:
/// a thread's start costs tens of microseconds).
const PART_BYTES: u64 = 4 << 20;

/// Key ranges of near-equal bytes, one per thread a job of `total` bytes
/// takes: at most the lanes' count (one per core, at most 8), at least
/// [`PART_BYTES`] each.
fn key_ranges(keys: &[Vec<CopySpan>], total: u64) -> Vec<std::ops::Range<usize>> {
    let parts = crate::lanes::default_lanes()
        .min(usize::try_from(total / PART_BYTES).unwrap_or(usize::MAX))
        .min(keys.len())
        .max(1);
    let mut ranges = Vec::with_capacity(parts);
    let (mut start, mut done) = (0, 0u64);
    for (i, spans) in keys.iter().enumerate() {
        done += spans.iter().map(|s| s.len).sum::<u64>();
        let boundary = total / parts as u64 * (ranges.len() as u64 + 1);
        if done >= boundary && ranges.len() + 1 < parts {
            ranges.push(start..i + 1);
            start = i + 1;
        }
    }
    ranges.push(start..keys.len());
    ranges.retain(|r| !r.is_empty());
    ranges
}

fn execute(job: &Job, shutdown: &AtomicBool) -> Vec<CopyOutcome> {
    if let Some(copier) = &job.device {
        return execute_on_device(job, copier.as_ref(), shutdown);
    }
    let total: u64 = job.keys.iter().flatten().map(|s| s.len).sum();
    if total < SPLIT_BYTES || !destinations_disjoint(&job.keys) {
        return execute_range(job, 0..job.keys.len(), shutdown, false);
    }
    let ranges = key_ranges(&job.keys, total);
    let Some((first, rest)) = ranges.split_first() else {
        return Vec::new();
    };
    // No two threads write the same bytes: destinations are pairwise
    // disjoint (checked above), and no source overlaps a destination (runner
    // pools and framework regions never overlap; checked at registration).
    std::thread::scope(|scope| {
        let helpers: Vec<_> = rest
            .iter()
            .map(|range| {
                let range = range.clone();
                (
                    range.clone(),
                    scope.spawn(move || execute_range(job, range, shutdown, true)),
                )
            })
            .collect();
        let mut outcomes = execute_range(job, first.clone(), shutdown, true);
        for (range, helper) in helpers {
            match helper.join() {
                Ok(done) => outcomes.extend(done),
                // A helper only runs validated copies; if it died, its keys
                // did not complete as far as we can prove: report them
                // cancelled.
                Err(_) => outcomes.extend(range.map(|_| CopyOutcome::Cancelled)),
            }
        }
        outcomes
    })
}

/// Runs a device job: keys cancelled or past the deadline are skipped as on
/// the host path; the rest go to the copier in one call (one batch of kernels
/// or driver copies), which succeeds or fails as a whole.
fn execute_on_device(
    job: &Job,
    copier: &dyn DeviceCopier,
    shutdown: &AtomicBool,
) -> Vec<CopyOutcome> {
    // The driver reads the clock; the core never does.
    #[allow(clippy::disallowed_methods)]
    let late = Instant::now() > job.deadline;
    let mut outcomes = Vec::with_capacity(job.keys.len());
    let mut batch: Vec<&[CopySpan]> = Vec::with_capacity(job.keys.len());
    for (i, spans) in job.keys.iter().enumerate() {
        let cancelled = shutdown.load(Ordering::Acquire)
            || job.cancel.get(i).is_some_and(|c| c.load(Ordering::Acquire));
        outcomes.push(if cancelled {
            CopyOutcome::Cancelled
        } else if late {
            CopyOutcome::DeadlinePassed
        } else {
            batch.push(spans);
            CopyOutcome::Copied
        });
    }
    if !batch.is_empty() && copier.copy(&batch).is_err() {
        for outcome in &mut outcomes {
            if *outcome == CopyOutcome::Copied {
                *outcome = CopyOutcome::Failed;
            }
        }
    }
    outcomes
}

/// Whether no two destination ranges of the job overlap.
fn destinations_disjoint(keys: &[Vec<CopySpan>]) -> bool {
    spans_disjoint(keys.iter().flatten())
}

/// Whether no two destination ranges among `spans` overlap.
pub(crate) fn spans_disjoint<'a>(spans: impl Iterator<Item = &'a CopySpan>) -> bool {
    let mut ranges: Vec<(u64, u64)> = spans
        .map(|s| (s.dst, s.dst.saturating_add(s.len)))
        .collect();
    ranges.sort_unstable();
    ranges.windows(2).all(|w| matches!(w, [a, b] if a.1 <= b.0))
}

/// Cuts `spans` at `at` bytes: the first part moves exactly the first `at`
/// bytes (in order), the second the rest (a span may be cut in two).
pub(crate) fn cut(spans: &[CopySpan], at: u64) -> (Vec<CopySpan>, Vec<CopySpan>) {
    let (mut first, mut second) = (Vec::new(), Vec::new());
    let mut done = 0u64;
    for s in spans {
        if done >= at {
            second.push(*s);
        } else if done + s.len <= at {
            first.push(*s);
        } else {
            let head = at - done;
            first.push(CopySpan { len: head, ..*s });
            second.push(CopySpan {
                src: s.src + head,
                dst: s.dst + head,
                len: s.len - head,
            });
        }
        done += s.len;
    }
    (first, second)
}

/// Cuts `copies` (`total` bytes) into `parts` pieces of near-equal bytes.
pub(crate) fn split_even(copies: Vec<CopySpan>, total: u64, parts: u64) -> Vec<Vec<CopySpan>> {
    let mut out = Vec::new();
    let mut rest = copies;
    let mut left = total;
    for remaining_parts in (2..=parts).rev() {
        let (head, tail) = cut(&rest, left / remaining_parts);
        left -= head.iter().map(|s| s.len).sum::<u64>();
        out.push(head);
        rest = tail;
    }
    out.push(rest);
    out.retain(|p| !p.is_empty());
    out
}

/// Copies `spans` in the caller's thread, with a second, scoped thread for
/// plans of [`SPLIT_BYTES`] or more whose destinations are pairwise disjoint:
/// the plan is cut at its byte midpoint, so a few long runs split as evenly as
/// many short ones. For `Runner::copy_claimed`, whose runs span several pages.
///
/// # Safety
/// As [`copy_spans`]: every range valid for the whole call, nothing else
/// touching a destination or writing a source, no source overlapping a
/// destination.
pub(crate) unsafe fn copy_plan(spans: &[CopySpan]) {
    let total: u64 = spans.iter().map(|s| s.len).sum();
    if total < SPLIT_BYTES || !spans_disjoint(spans.iter()) {
        // SAFETY: this function's contract.
        unsafe { copy_spans(spans) };
        return;
    }
    let (first, second) = cut(spans, total / 2);
    // The halves write disjoint bytes (destinations are pairwise disjoint, and
    // a cut span's two parts are disjoint ranges); the scope joins the helper
    // before this returns, inside the contract's window.
    std::thread::scope(|scope| {
        // SAFETY: the contract, over a subset of the ranges, disjoint from
        // what this thread writes.
        let helper = scope.spawn(|| unsafe { copy_spans(&second) });
        // SAFETY: as above.
        unsafe { copy_spans(&first) };
        if helper.join().is_err() {
            // A raw copy of validated ranges cannot panic; if the helper died
            // anyway, copy its half here so the result stays whole.
            // SAFETY: as above; the helper has ended.
            unsafe { copy_spans(&second) };
        }
    });
}

/// Copies the keys of `range`; `stream`: large spans with non-temporal
/// stores (fenced before returning, so before the job is reported).
fn execute_range(
    job: &Job,
    range: std::ops::Range<usize>,
    shutdown: &AtomicBool,
    stream: bool,
) -> Vec<CopyOutcome> {
    let mut outcomes = Vec::with_capacity(range.len());
    for i in range {
        let Some(spans) = job.keys.get(i) else {
            outcomes.push(CopyOutcome::Cancelled);
            continue;
        };
        let cancelled = shutdown.load(Ordering::Acquire)
            || job.cancel.get(i).is_some_and(|c| c.load(Ordering::Acquire));
        if cancelled {
            outcomes.push(CopyOutcome::Cancelled);
            continue;
        }
        // The driver reads the clock; the core never does.
        #[allow(clippy::disallowed_methods)]
        let late = Instant::now() > job.deadline;
        if late {
            outcomes.push(CopyOutcome::DeadlinePassed);
            continue;
        }
        // SAFETY: every span was produced by the core from registrations it
        // bounds-checked: sources and destinations lie inside either a
        // runner-owned pool (alive until this thread is joined, see `Runner`'s
        // field order) or a framework region the caller promised valid for the
        // runner's lifetime (`Runner::register_region`'s contract). A FILLING
        // slot is written only by its own fill, a READY slot is only read while
        // claimed, and the caller promised not to touch framework elements of an
        // operation until it completes; pool and framework regions never
        // overlap (checked at registration). When a job is split over two
        // threads, their destination ranges are pairwise disjoint
        // (`destinations_disjoint`), so no byte is written by both.
        unsafe {
            if stream {
                copy_spans_streaming(spans);
            } else {
                copy_spans(spans);
            }
        };
        outcomes.push(CopyOutcome::Copied);
    }
    outcomes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(src: u64, dst: u64, len: u64) -> CopySpan {
        CopySpan { src, dst, len }
    }

    #[test]
    fn even_split_moves_every_byte_once_in_order() {
        let copies = vec![c(0, 1000, 10), c(100, 2000, 7), c(200, 3000, 13)];
        for parts in 1..=8 {
            let pieces = split_even(copies.clone(), 30, parts);
            assert!(pieces.len() as u64 <= parts);
            let flat: Vec<CopySpan> = pieces.concat();
            let bytes: Vec<(u64, u64)> = flat
                .iter()
                .flat_map(|s| (0..s.len).map(move |i| (s.src + i, s.dst + i)))
                .collect();
            let expected: Vec<(u64, u64)> = copies
                .iter()
                .flat_map(|s| (0..s.len).map(move |i| (s.src + i, s.dst + i)))
                .collect();
            assert_eq!(bytes, expected, "parts {parts}");
            let sizes: Vec<u64> = pieces
                .iter()
                .map(|p| p.iter().map(|s| s.len).sum())
                .collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "parts {parts}: {sizes:?}");
        }
    }

    /// A large job's threads take every key once, in order, in contiguous
    /// ranges of near-equal bytes, never more than the lanes nor fewer than
    /// `PART_BYTES` each.
    #[rstest::rstest]
    #[case::equal_keys(vec![1 << 20; 64])]
    #[case::one_huge_key(vec![64 << 20])]
    #[case::uneven(vec![30 << 20, 1 << 20, 1 << 20, 2 << 20, 30 << 20])]
    #[case::just_over_split(vec![(SPLIT_BYTES / 2) as usize, (SPLIT_BYTES / 2) as usize + 1])]
    fn key_ranges_cover_every_key_once(#[case] sizes: Vec<usize>) {
        let keys: Vec<Vec<CopySpan>> = sizes.iter().map(|n| vec![c(0, 0, *n as u64)]).collect();
        let total: u64 = sizes.iter().map(|n| *n as u64).sum();
        let ranges = key_ranges(&keys, total);
        let flat: Vec<usize> = ranges.iter().cloned().flatten().collect();
        assert_eq!(flat, (0..keys.len()).collect::<Vec<_>>());
        assert!(ranges.len() <= crate::lanes::default_lanes());
        assert!(ranges.len() as u64 <= (total / PART_BYTES).max(1));
    }

    #[test]
    fn cutting_keeps_every_byte_once_and_in_order() {
        let spans = [c(0, 100, 10), c(50, 200, 6)];
        let (a, b) = cut(&spans, 8);
        assert_eq!(a, vec![c(0, 100, 8)]);
        assert_eq!(b, vec![c(8, 108, 2), c(50, 200, 6)]);
        let (a, b) = cut(&spans, 10);
        assert_eq!((a.len(), b.len()), (1, 1));
    }

    #[test]
    fn a_large_plan_copied_on_two_threads_matches() {
        let len = (SPLIT_BYTES + 12_345) as usize;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; len];
        let (s, d) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
        // Three pieces, the middle one reversed in placement.
        let third = (len / 3) as u64;
        let spans = [
            c(s, d + 2 * third, len as u64 - 2 * third),
            c(s + (len as u64 - 2 * third), d, third),
            c(s + (len as u64 - third), d + third, third),
        ];
        // SAFETY: (test) all ranges lie inside `src` / `dst`, which outlive
        // the call and are not otherwise touched; they do not overlap.
        unsafe { copy_plan(&spans) };
        let mut expect = vec![0u8; len];
        for k in spans {
            let (so, dof) = ((k.src - s) as usize, (k.dst - d) as usize);
            expect[dof..dof + k.len as usize].copy_from_slice(&src[so..so + k.len as usize]);
        }
        assert_eq!(dst, expect);
    }

    fn span(dst: u64, len: u64) -> CopySpan {
        CopySpan { src: 0, dst, len }
    }

    #[test]
    fn disjoint_destinations() {
        assert!(destinations_disjoint(&[
            vec![span(0, 10)],
            vec![span(10, 5)],
            vec![span(100, 1)]
        ]));
        assert!(!destinations_disjoint(&[
            vec![span(0, 10)],
            vec![span(9, 5)]
        ]));
        assert!(
            !destinations_disjoint(&[vec![span(50, 10)], vec![span(50, 10)]]),
            "the same element twice"
        );
        assert!(
            !destinations_disjoint(&[vec![span(0, 4), span(2, 4)]]),
            "within one key"
        );
        assert!(destinations_disjoint(&[]));
    }
}
