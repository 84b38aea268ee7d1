//! The local copy engine: one thread that executes copy jobs off the caller's
//! thread and applies their outcomes to the shared core itself, so operations
//! complete without the caller polling. A large host job is shared with
//! scoped helper threads (up to the peer lanes' count), each streaming its own
//! keys' bytes.
//!
//! Every copy goes through the runner's [`MemoryRegistry`]: its spans are
//! checked against the registered pools and engine regions (one read lock
//! per key, or per half of a claimed copy) before a byte moves.
//!
//! The thread blocks on its queue when idle (after a short bounded poll; no
//! busy loop, no sleep floor), so a single-block copy costs at most one thread
//! wake-up plus the memcpy.

pub(crate) mod device;
pub(crate) mod lanes;
pub(crate) mod plan;
#[cfg(test)]
pub(crate) mod test_memory;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvcr_runner_core::{CopyOutcome, CopySpan, JobId};
use kvcr_sys::MemoryRegistry;

use self::device::DeviceCopier;
use self::plan::{copy_checked, cut, spans_disjoint};
use crate::error::{Error, Result, RunnerReason};
use crate::shared::Shared;

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
    /// Take each copied key's page digest over its destination (a deposit
    /// into the pools), where the bytes are still hot.
    pub(crate) digest: bool,
    /// A device job's leading spans per key to report landed ahead of the
    /// rest (`Shared::copy_lead_landed`); 0: none.
    pub(crate) lead: usize,
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
    /// Starts the thread on `jobs`, copying through `memory`; it applies
    /// outcomes to `shared` while that is alive.
    pub(crate) fn start(
        shared: Weak<Shared>,
        memory: Arc<MemoryRegistry>,
        stop: Sender<Msg>,
        jobs: Receiver<Msg>,
    ) -> Result<Self> {
        let shutdown = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&shutdown);
        let thread = std::thread::Builder::new()
            .name("kvcr-copy".into())
            .spawn(move || worker(&jobs, &shared, &memory, &flag))
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

fn worker(
    jobs: &Receiver<Msg>,
    shared: &Weak<Shared>,
    memory: &MemoryRegistry,
    shutdown: &AtomicBool,
) {
    loop {
        let Some(Msg::Job(job)) = spin_recv(jobs, SPIN).or_else(|| jobs.recv().ok()) else {
            return;
        };
        let lead_landed = || {
            if let Some(shared) = shared.upgrade() {
                shared.copy_lead_landed(job.id);
            }
        };
        let (outcomes, digests) = execute(&job, memory, shutdown, &lead_landed);
        match shared.upgrade() {
            Some(shared) => shared.copy_done_digested(job.id, &outcomes, &digests),
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
    let parts = plan::default_lanes()
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

/// Per key, what happened and (for a digested job) the page digest of its
/// destination bytes.
type Executed = (Vec<CopyOutcome>, Vec<Option<u64>>);

/// Runs `job`; a device job with a lead calls `lead_landed` once its lead
/// spans are in place (from inside the copier's call).
fn execute(
    job: &Job,
    memory: &MemoryRegistry,
    shutdown: &AtomicBool,
    lead_landed: &dyn Fn(),
) -> Executed {
    if let Some(copier) = &job.device {
        return execute_on_device(job, copier.as_ref(), memory, shutdown, lead_landed);
    }
    let total: u64 = job.keys.iter().flatten().map(|s| s.len).sum();
    if total < SPLIT_BYTES || !destinations_disjoint(&job.keys) {
        return execute_range(job, memory, 0..job.keys.len(), shutdown, false);
    }
    let ranges = key_ranges(&job.keys, total);
    let Some((first, rest)) = ranges.split_first() else {
        return (Vec::new(), Vec::new());
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
                    scope.spawn(move || execute_range(job, memory, range, shutdown, true)),
                )
            })
            .collect();
        let (mut outcomes, mut digests) = execute_range(job, memory, first.clone(), shutdown, true);
        for (range, helper) in helpers {
            match helper.join() {
                Ok((done, taken)) => {
                    outcomes.extend(done);
                    digests.extend(taken);
                }
                // A helper only runs validated copies; if it died, its keys
                // did not complete as far as we can prove: report them
                // cancelled.
                Err(_) => {
                    outcomes.extend(range.clone().map(|_| CopyOutcome::Cancelled));
                    digests.extend(range.map(|_| None));
                }
            }
        }
        (outcomes, digests)
    })
}

/// Runs a device job: keys cancelled or past the deadline are skipped as on
/// the host path; the rest go to the copier in one call (one batch of kernels
/// or driver copies), which succeeds or fails as a whole.
fn execute_on_device(
    job: &Job,
    copier: &dyn DeviceCopier,
    memory: &MemoryRegistry,
    shutdown: &AtomicBool,
    lead_landed: &dyn Fn(),
) -> Executed {
    // The driver reads the clock; the core never does.
    #[allow(clippy::disallowed_methods)]
    let late = Instant::now() > job.deadline;
    let mut outcomes = Vec::with_capacity(job.keys.len());
    let mut batch: Vec<usize> = Vec::with_capacity(job.keys.len());
    for i in 0..job.keys.len() {
        let cancelled = shutdown.load(Ordering::Acquire)
            || job.cancel.get(i).is_some_and(|c| c.load(Ordering::Acquire));
        outcomes.push(if cancelled {
            CopyOutcome::Cancelled
        } else if late {
            CopyOutcome::DeadlinePassed
        } else {
            batch.push(i);
            CopyOutcome::Copied
        });
    }
    let mut digests = vec![None; job.keys.len()];
    if job.digest && copier.digests_on_device() {
        // The copier takes the pages' digests from the device's bytes as
        // it copies them: one call, and only pages it could not hash are
        // read back from DRAM.
        match copier.copy_digested(&spans_of(&job.keys, &batch)) {
            Ok(found) => {
                place(&mut digests, &batch, found);
                let rest: Vec<usize> = batch
                    .iter()
                    .copied()
                    .filter(|&i| digests.get(i).is_some_and(Option::is_none))
                    .collect();
                let found = destination_digests(memory, &keys_of(&job.keys, &rest));
                place(&mut digests, &rest, found);
            }
            // A failed call fails every key of it.
            Err(_) => fail(&mut outcomes, &batch),
        }
        return (outcomes, digests);
    }
    let groups = device_groups(&job.keys, &batch, job.digest);
    // Each group is one call of the copier; a digested job's pages are
    // hashed (the device wrote the pools, so the bytes are read back from
    // DRAM) while the next group crosses, so the hash costs the offload only
    // its last group.
    std::thread::scope(|scope| {
        let mut hashing = None;
        for group in &groups {
            let spans = spans_of(&job.keys, group);
            // A lead is asked only of a deliver (never digested: one group).
            let copied = if job.lead > 0 && !job.digest {
                copier
                    .copy_led(&spans, job.lead, &mut || lead_landed())
                    .is_ok()
            } else {
                copier.copy(&spans).is_ok()
            };
            if !copied {
                // A failed call fails every key of it, as before.
                fail(&mut outcomes, group);
            }
            if let Some(previous) = hashing.take() {
                collect_digests(previous, &mut digests);
            }
            if job.digest && copied {
                let keys = &job.keys;
                hashing = Some((
                    group.clone(),
                    scope.spawn(move || destination_digests(memory, &keys_of(keys, group))),
                ));
            }
        }
        if let Some(last) = hashing.take() {
            collect_digests(last, &mut digests);
        }
    });
    (outcomes, digests)
}

/// The spans of the keys at `indices`.
fn spans_of<'a>(keys: &'a [Vec<CopySpan>], indices: &[usize]) -> Vec<&'a [CopySpan]> {
    indices
        .iter()
        .filter_map(|&i| keys.get(i))
        .map(Vec::as_slice)
        .collect()
}

/// The spans of the keys at `indices`, one entry per index.
fn keys_of<'a>(keys: &'a [Vec<CopySpan>], indices: &[usize]) -> Vec<Option<&'a [CopySpan]>> {
    indices
        .iter()
        .map(|&i| keys.get(i).map(Vec::as_slice))
        .collect()
}

/// Fails the keys at `indices`.
fn fail(outcomes: &mut [CopyOutcome], indices: &[usize]) {
    for &i in indices {
        if let Some(outcome) = outcomes.get_mut(i) {
            *outcome = CopyOutcome::Failed;
        }
    }
}

/// Puts `found` (one digest per index) in place by key index.
fn place(digests: &mut [Option<u64>], indices: &[usize], found: Vec<Option<u64>>) {
    for (&i, digest) in indices.iter().zip(found) {
        if let Some(slot) = digests.get_mut(i) {
            *slot = digest;
        }
    }
}

/// A hashing thread's digests, put in place by key index; a thread that
/// died leaves its keys without a digest, never a wrong one.
fn collect_digests(
    (group, hashing): (
        Vec<usize>,
        std::thread::ScopedJoinHandle<'_, Vec<Option<u64>>>,
    ),
    digests: &mut [Option<u64>],
) {
    if let Ok(found) = hashing.join() {
        place(digests, &group, found);
    }
}

/// The copier calls a device job makes: one for the whole batch, or, when
/// its pages are to be digested, groups of about [`DEVICE_GROUP_BYTES`] so
/// each is hashed while the next is copied.
fn device_groups(keys: &[Vec<CopySpan>], batch: &[usize], digest: bool) -> Vec<Vec<usize>> {
    if !digest {
        return if batch.is_empty() {
            Vec::new()
        } else {
            vec![batch.to_vec()]
        };
    }
    let mut groups = Vec::new();
    let mut group = Vec::new();
    let mut bytes = 0u64;
    for &i in batch {
        group.push(i);
        bytes += keys
            .get(i)
            .map_or(0, |spans| spans.iter().map(|s| s.len).sum::<u64>());
        if bytes >= DEVICE_GROUP_BYTES {
            groups.push(std::mem::take(&mut group));
            bytes = 0;
        }
    }
    if !group.is_empty() {
        groups.push(group);
    }
    groups
}

/// Bytes of a digested device job copied per call: large enough that a
/// call's fixed cost stays small beside the copy (a few microseconds
/// against tens of milliseconds at the PCIe rate), small enough that the
/// last group's hash, the part not hidden behind a copy, is a small share
/// of a large offload.
const DEVICE_GROUP_BYTES: u64 = 256 << 20;

/// Whether no two destination ranges of the job overlap.
fn destinations_disjoint(keys: &[Vec<CopySpan>]) -> bool {
    spans_disjoint(keys.iter().flatten())
}

/// Copies `spans` through `memory` in the caller's thread, with a second,
/// scoped thread for plans of [`SPLIT_BYTES`] or more whose destinations are
/// pairwise disjoint: the plan is cut at its byte midpoint, so a few long
/// runs split as evenly as many short ones. For `Runner::copy_claimed`,
/// whose runs span several pages. Every span is checked against `memory`
/// first (a refusal copies nothing of that half).
pub(crate) fn copy_plan(memory: &MemoryRegistry, spans: &[CopySpan]) -> kvcr_sys::Result<()> {
    let total: u64 = spans.iter().map(|s| s.len).sum();
    if total < SPLIT_BYTES || !spans_disjoint(spans.iter()) {
        return copy_checked(memory, spans, false);
    }
    let (first, second) = cut(spans, total / 2);
    // The halves write disjoint bytes (destinations are pairwise disjoint, and
    // a cut span's two parts are disjoint ranges); the scope joins the helper
    // before this returns.
    std::thread::scope(|scope| {
        let helper = scope.spawn(|| copy_checked(memory, &second, false));
        let mine = copy_checked(memory, &first, false);
        let theirs = helper.join().unwrap_or_else(|_| {
            // A checked copy cannot panic; if the helper died anyway, copy
            // its half here so the result stays whole.
            copy_checked(memory, &second, false)
        });
        mine.and(theirs)
    })
}

/// Copies the keys of `range`; `stream`: large spans with non-temporal
/// stores (fenced before returning, so before the job is reported).
fn execute_range(
    job: &Job,
    memory: &MemoryRegistry,
    range: std::ops::Range<usize>,
    shutdown: &AtomicBool,
    stream: bool,
) -> Executed {
    let mut outcomes = Vec::with_capacity(range.len());
    let mut digests = vec![None; range.len()];
    for (at, i) in range.enumerate() {
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
        // Every span was produced by the core from registrations it
        // bounds-checked, and is checked again against the registry: pools
        // and engine regions. A FILLING slot is written only by its own fill,
        // a READY slot is only read while claimed, and the caller promised
        // not to touch framework elements of an operation until it completes
        // (`Runner::register_region`). When a job is split over threads,
        // their destination ranges are pairwise disjoint
        // (`destinations_disjoint`), so no byte is written by both.
        let copied = if job.digest {
            // Hashed in the same pass as the copy: each stripe loaded once,
            // stored and hashed from the same registers.
            let byte_spans: Vec<kvcr_sys::ByteSpan> = spans.iter().map(plan::byte_span).collect();
            memory.copy_digested(&byte_spans, stream).map(|digest| {
                if let Some(slot) = digests.get_mut(at) {
                    *slot = Some(digest);
                }
            })
        } else {
            copy_checked(memory, spans, stream)
        };
        if copied.is_err() {
            // Unreachable while the core and the registry agree.
            outcomes.push(CopyOutcome::Failed);
            continue;
        }
        outcomes.push(CopyOutcome::Copied);
    }
    (outcomes, digests)
}

/// Each key's destination digest (`None` where not asked), on a thread per
/// core when there is enough to hash: after a device copy every byte is read
/// back from DRAM, and one thread alone holds an offload to a fraction of
/// the device's rate (the copy itself is the device's: no core copies).
fn destination_digests(memory: &MemoryRegistry, keys: &[Option<&[CopySpan]>]) -> Vec<Option<u64>> {
    let pages: Vec<Option<Vec<(u64, u64)>>> = keys
        .iter()
        .map(|spans| spans.map(|spans| spans.iter().map(|s| (s.dst, s.len)).collect()))
        .collect();
    let pages: Vec<Option<&[(u64, u64)]>> = pages.iter().map(Option::as_deref).collect();
    plan::page_digests(memory, &pages, SPLIT_BYTES, plan::cores())
}

#[cfg(test)]
mod tests {
    use super::test_memory::TestBuffer;
    use super::*;

    /// A digested device job goes in groups of about `DEVICE_GROUP_BYTES`
    /// (each hashed while the next is copied), every batched key once, in
    /// order; an undigested one in one call; an empty batch in none.
    #[test]
    fn device_jobs_are_grouped_only_when_digested() {
        let page = DEVICE_GROUP_BYTES / 4;
        let keys: Vec<Vec<CopySpan>> = (0..10)
            .map(|i| {
                vec![CopySpan {
                    src: i * page,
                    dst: i * page,
                    len: page,
                }]
            })
            .collect();
        let batch: Vec<usize> = (0..10).filter(|i| i % 5 != 3).collect();
        let groups = device_groups(&keys, &batch, true);
        assert_eq!(groups, vec![vec![0, 1, 2, 4], vec![5, 6, 7, 9]]);
        assert_eq!(device_groups(&keys, &batch, false), vec![batch.clone()]);
        assert!(device_groups(&keys, &[], true).is_empty());
        assert!(device_groups(&keys, &[], false).is_empty());
    }

    fn c(src: u64, dst: u64, len: u64) -> CopySpan {
        CopySpan { src, dst, len }
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
        assert!(ranges.len() <= plan::default_lanes());
        assert!(ranges.len() as u64 <= (total / PART_BYTES).max(1));
    }

    #[test]
    fn a_large_plan_copied_on_two_threads_matches() {
        let len = (SPLIT_BYTES + 12_345) as usize;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let memory = Arc::new(MemoryRegistry::new());
        let source = TestBuffer::with(&memory, len, &src);
        let destination = TestBuffer::new(&memory, len);
        let (s, d) = (source.addr(), destination.addr());
        // Three pieces, the middle one reversed in placement.
        let third = (len / 3) as u64;
        let spans = [
            c(s, d + 2 * third, len as u64 - 2 * third),
            c(s + (len as u64 - 2 * third), d, third),
            c(s + (len as u64 - third), d + third, third),
        ];
        copy_plan(&memory, &spans).unwrap();
        let mut expect = vec![0u8; len];
        for k in spans {
            let (so, dof) = ((k.src - s) as usize, (k.dst - d) as usize);
            expect[dof..dof + k.len as usize].copy_from_slice(&src[so..so + k.len as usize]);
        }
        assert_eq!(destination.read(len), expect);
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
