//! Unsafe, named: the copy lanes of one-copy peer writes.
//!
//! A write into a same-host target's mapped segments
//! ([`crate::shared_memory::PeerSegment`]) is a plan of plain copies.
//!
//! * A large write (1 MiB or more) is cut at byte boundaries into one piece
//!   per lane and handed to the lane threads; the last lane to finish reports
//!   the write on a channel the peer thread sleeps on. The peer thread itself
//!   never copies it, so it keeps serving control messages while bytes move.
//! * A small write (a one-block restore) is on the latency path: the peer
//!   thread copies it before it answers. On a host with cores to spare it is
//!   striped: cut into pieces handed to the striping lanes (the first
//!   [`LaneTuning::stripe_lanes`]), while the peer thread copies a piece
//!   itself and then takes every piece no lane has claimed yet, so a stripe
//!   is never slower than copying alone by more than a queue push and, for a
//!   parked lane, a wake-up (measured on the 16-core H200 host: 256 KiB in
//!   38–39 µs on one thread, 22 µs over two, 14 µs over four). A woken lane
//!   rarely helps the write that woke it; it stays awake for
//!   [`LaneTuning::linger`] after its last piece, for the writes behind it.
//!
//! Drop order: [`Lanes`] closes every lane and joins its threads (after they
//! finish what is queued) before the peer thread's pools are dropped — the
//! lanes read them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use kvcr_runner_core::CopySpan;
use tokio::sync::mpsc::UnboundedSender;

use crate::copy::{spans_disjoint, split_even};
use crate::shared_memory::PeerSegment;

/// Below this many bytes a write is one piece on one lane: a hand-off costs
/// more than a lane could save.
const MIN_PIECE_BYTES: u64 = 2 << 20;

/// Below this many bytes the peer thread copies the write itself (striped
/// over awake lanes where [`LaneTuning::stripe`] allows): two thread
/// wake-ups (to a lane and back) cost more than the copy (256 KiB: ~25 µs).
const INLINE_BYTES: u64 = 1 << 20;

/// The smallest piece of a striped write: below it a piece's hand-off and
/// cache traffic cost more than its copy.
const MIN_STRIPE_BYTES: u64 = 32 << 10;

/// Hosts with fewer cores never stripe and lanes never linger: a spinning
/// lane would take the CPU the engine, the peer thread or the other side of
/// the copy needs (on the 2-vCPU VMs here striping made one-block restores
/// slower).
pub(crate) const STRIPE_MIN_CORES: usize = 4;

/// Lanes that take stripes (with the peer thread, four pieces: a 256 KiB
/// page in 14 µs on the H200 host, against 12 µs over eight lanes, for
/// half the cores kept awake).
const STRIPE_LANES: usize = 3;

/// How long a striping lane spins for more work after its last piece. Longer
/// than the gap between an engine's back-to-back one-block restores (a
/// restore, its use and the next request: ~200–300 µs in the peer bench);
/// with 200 µs the lanes parked between restores and no stripe was ever
/// taken. At most [`STRIPE_LANES`] cores, for a millisecond after work.
const LANE_LINGER: Duration = Duration::from_millis(1);

/// Spins between clock reads while a lane lingers.
const SPINS_PER_CLOCK_READ: u32 = 256;

/// The lanes' default count: one per core, at most 8 (12 threads reach the
/// H200 host's copy limit; 8 are within 80 % of it).
pub(crate) fn default_lanes() -> usize {
    cores().clamp(1, 8)
}

pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// How the lanes treat small writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneTuning {
    /// How many lanes (the first ones) take pieces of small writes and
    /// linger; zero: small writes are never striped.
    pub(crate) stripe_lanes: usize,
    /// How long a striping lane stays awake after its last piece (zero: it
    /// parks at once). Other lanes park at once.
    pub(crate) linger: Duration,
}

impl LaneTuning {
    /// Striping and lingering on hosts with at least [`STRIPE_MIN_CORES`]
    /// cores, neither below.
    pub(crate) fn for_host() -> Self {
        if cores() >= STRIPE_MIN_CORES {
            Self {
                stripe_lanes: STRIPE_LANES,
                linger: LANE_LINGER,
            }
        } else {
            Self {
                stripe_lanes: 0,
                linger: Duration::ZERO,
            }
        }
    }
}

/// A write's outcome, reported once all of its pieces ran.
#[derive(Debug)]
struct WriteJoin {
    write: u64,
    pieces_left: AtomicUsize,
    failed: AtomicBool,
    done: UnboundedSender<(u64, bool)>,
}

struct Piece {
    copies: Vec<CopySpan>,
    /// Keeps the destination mappings alive until the copy ran.
    segments: Arc<Vec<Arc<PeerSegment>>>,
    join: Arc<WriteJoin>,
}

/// A small write's pieces, claimed one by one by whoever gets to them first:
/// the awake lanes it was handed to and the peer thread that waits for it.
struct Stripe {
    pieces: Vec<StripePiece>,
    /// Keeps the destination mappings alive until every piece ran.
    segments: Vec<Arc<PeerSegment>>,
    /// Pieces the lanes copied, all stripes together (for tests and audits:
    /// whether striping ever happens on this host).
    by_lanes: Arc<AtomicUsize>,
}

struct StripePiece {
    copies: Vec<CopySpan>,
    state: AtomicU8,
}

const UNCLAIMED: u8 = 0;
const CLAIMED: u8 = 1;
const COPIED: u8 = 2;

impl Stripe {
    /// Claims and copies every piece nobody has claimed yet.
    ///
    /// # Safety
    /// [`Lanes::submit`]'s contract, until the stripe is [`Stripe::copied`]:
    /// the submitter waits for that before it reports the write, so a piece
    /// is never copied after its sources or destinations may change hands.
    /// Returns how many pieces this call copied.
    unsafe fn help(&self) -> usize {
        let mut copied = 0;
        for piece in &self.pieces {
            if piece
                .state
                .compare_exchange(UNCLAIMED, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                // SAFETY: this function's contract; the claim makes this
                // thread the piece's only writer, and pieces cover disjoint
                // destination bytes (`split_even` of pairwise-disjoint spans).
                unsafe { copy_populated(&piece.copies, &self.segments) };
                // Release after the copy's store fence: whoever sees COPIED
                // sees the bytes.
                piece.state.store(COPIED, Ordering::Release);
                copied += 1;
            }
        }
        copied
    }

    fn copied(&self) -> bool {
        self.pieces
            .iter()
            .all(|p| p.state.load(Ordering::Acquire) == COPIED)
    }
}

enum Work {
    Piece(Piece),
    Stripe(Arc<Stripe>),
}

/// What a lane thread and the submitter share.
struct LaneInbox {
    queue: Mutex<VecDeque<Work>>,
    /// The lane is parked (or about to park): pushing work must unpark it.
    parked: AtomicBool,
    /// No more work comes: the lane exits once its queue is empty.
    closed: AtomicBool,
}

impl LaneInbox {
    fn push(&self, work: Work) {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(work);
    }

    fn pop(&self) -> Option<Work> {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    }

    fn is_empty(&self) -> bool {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }
}

struct Lane {
    inbox: Arc<LaneInbox>,
    thread: Thread,
}

impl Lane {
    fn wake_if_parked(&self) {
        if self.inbox.parked.load(Ordering::SeqCst) {
            self.thread.unpark();
        }
    }
}

/// The lane threads.
pub(crate) struct Lanes {
    lanes: Vec<Lane>,
    threads: Vec<JoinHandle<()>>,
    tuning: LaneTuning,
    next: usize,
    /// Pieces of small writes the lanes copied (see [`Stripe::by_lanes`]).
    striped_by_lanes: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Lanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("lanes", &self.lanes.len())
            .field("tuning", &self.tuning)
            .finish()
    }
}

impl Lanes {
    /// Starts `count` lanes (at least one), tuned for this host.
    pub(crate) fn start(count: usize) -> std::io::Result<Self> {
        Self::start_tuned(count, LaneTuning::for_host())
    }

    /// Starts `count` lanes (at least one) with `tuning`.
    pub(crate) fn start_tuned(count: usize, tuning: LaneTuning) -> std::io::Result<Self> {
        let mut lanes = Self {
            lanes: Vec::new(),
            threads: Vec::new(),
            tuning,
            next: 0,
            striped_by_lanes: Arc::new(AtomicUsize::new(0)),
        };
        for i in 0..count.max(1) {
            let inbox = Arc::new(LaneInbox {
                queue: Mutex::new(VecDeque::new()),
                parked: AtomicBool::new(false),
                closed: AtomicBool::new(false),
            });
            let mine = Arc::clone(&inbox);
            let linger = if i < tuning.stripe_lanes {
                tuning.linger
            } else {
                Duration::ZERO
            };
            let thread = std::thread::Builder::new()
                .name(format!("kvcr-lane-{i}"))
                .spawn(move || lane_loop(&mine, linger))?;
            lanes.lanes.push(Lane {
                inbox,
                thread: thread.thread().clone(),
            });
            lanes.threads.push(thread);
        }
        Ok(lanes)
    }

    /// Runs the copies of `write`: a small write here and now (returns
    /// `Some(ok)`, striped over awake lanes where the tuning allows), a
    /// larger one on the lanes (returns `None`; `(write, ok)` arrives on
    /// `done` once every byte was copied or the write failed).
    ///
    /// # Safety
    /// Every source range must stay valid for reads and unwritten until the
    /// report (the runner's own pool pages, claimed by the write); every
    /// destination range must lie inside one of `segments` (checked by
    /// [`PeerSegment::destination`]), granted to this write by its target.
    pub(crate) unsafe fn submit(
        &mut self,
        write: u64,
        copies: Vec<CopySpan>,
        segments: Vec<Arc<PeerSegment>>,
        done: &UnboundedSender<(u64, bool)>,
    ) -> Option<bool> {
        let total: u64 = copies.iter().map(|s| s.len).sum();
        if total < INLINE_BYTES {
            // SAFETY: this function's contract.
            unsafe { self.copy_small(copies, total, segments) };
            return Some(true);
        }
        let lanes = self.lanes.len() as u64;
        // Pieces write disjoint bytes only if the spans do (a target grants
        // distinct slots; a hostile grant naming one twice stays one piece).
        let parts = if spans_disjoint(copies.iter()) {
            (total / MIN_PIECE_BYTES).clamp(1, lanes.max(1))
        } else {
            1
        };
        let pieces = split_even(copies, total, parts);
        let join = Arc::new(WriteJoin {
            write,
            pieces_left: AtomicUsize::new(pieces.len()),
            failed: AtomicBool::new(false),
            done: done.clone(),
        });
        let segments = Arc::new(segments);
        for copies in pieces {
            let lane = self.next % self.lanes.len().max(1);
            self.next = self.next.wrapping_add(1);
            let piece = Piece {
                copies,
                segments: Arc::clone(&segments),
                join: Arc::clone(&join),
            };
            match self.lanes.get(lane) {
                Some(lane) if !lane.inbox.closed.load(Ordering::Acquire) => {
                    lane.inbox.push(Work::Piece(piece));
                    lane.wake_if_parked();
                }
                _ => {
                    // No lane to copy it: the write fails (its slots stay
                    // the target's to reclaim), it is not lost.
                    join.failed.store(true, Ordering::Release);
                    finish_piece(&join);
                }
            }
        }
        None
    }

    /// Copies a small write before returning: striped over the lanes awake
    /// now when the tuning allows and it is worth cutting, else alone.
    ///
    /// # Safety
    /// As [`Lanes::submit`].
    unsafe fn copy_small(
        &self,
        copies: Vec<CopySpan>,
        total: u64,
        segments: Vec<Arc<PeerSegment>>,
    ) {
        let most_pieces = (total / MIN_STRIPE_BYTES).min(self.tuning.stripe_lanes as u64 + 1);
        let stripers: Vec<&Lane> = self
            .lanes
            .iter()
            .take(usize::try_from(most_pieces.saturating_sub(1)).unwrap_or(usize::MAX))
            .collect();
        if stripers.is_empty() || !spans_disjoint(copies.iter()) {
            // SAFETY: this function's contract; `segments` lives until after
            // the copy (dropped at the end of this call).
            unsafe { copy_populated(&copies, &segments) };
            return;
        }
        let pieces = split_even(copies, total, stripers.len() as u64 + 1);
        let stripe = Arc::new(Stripe {
            pieces: pieces
                .into_iter()
                .map(|copies| StripePiece {
                    copies,
                    state: AtomicU8::new(UNCLAIMED),
                })
                .collect(),
            segments,
            by_lanes: Arc::clone(&self.striped_by_lanes),
        });
        for lane in stripers {
            // A lane that was parked finds the stripe copied when it runs,
            // and lingers for the next one.
            lane.inbox.push(Work::Stripe(Arc::clone(&stripe)));
            lane.wake_if_parked();
        }
        // SAFETY: this function's contract; the wait below keeps it until
        // every piece, ours or a lane's, is copied.
        let _ours = unsafe { stripe.help() };
        while !stripe.copied() {
            // Only pieces a lane claimed and is copying remain.
            std::hint::spin_loop();
        }
    }
}

impl Drop for Lanes {
    fn drop(&mut self) {
        // Each lane exits after the work it holds.
        for lane in &self.lanes {
            lane.inbox.closed.store(true, Ordering::SeqCst);
            lane.thread.unpark();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A lane: runs its queue; once empty, spins for `linger`, then parks until
/// work is pushed (or the lanes close).
fn lane_loop(inbox: &LaneInbox, linger: Duration) {
    #[allow(clippy::disallowed_methods)] // a driver thread's own idle clock
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        match inbox.pop() {
            Some(Work::Piece(piece)) => run(piece),
            Some(Work::Stripe(stripe)) => {
                // SAFETY: the submitter's contract holds until the stripe
                // is copied, and it waits for that; pieces already claimed
                // are skipped, so a late lane copies nothing.
                let copied = unsafe { stripe.help() };
                stripe.by_lanes.fetch_add(copied, Ordering::Relaxed);
            }
            None => {
                if inbox.closed.load(Ordering::SeqCst) {
                    return;
                }
                spins = spins.wrapping_add(1);
                if !spins.is_multiple_of(SPINS_PER_CLOCK_READ) || idle_since.elapsed() < linger {
                    std::hint::spin_loop();
                    continue;
                }
                // Say we park, then look once more: a submitter pushes and
                // then reads `parked`, so either it sees us parked and
                // unparks, or we see its work here (and `unpark` before
                // `park` makes `park` return at once).
                inbox.parked.store(true, Ordering::SeqCst);
                if inbox.is_empty() && !inbox.closed.load(Ordering::SeqCst) {
                    std::thread::park();
                }
                inbox.parked.store(false, Ordering::SeqCst);
                continue;
            }
        }
        #[allow(clippy::disallowed_methods)]
        {
            idle_since = Instant::now();
        }
    }
}

fn run(piece: Piece) {
    // SAFETY: `Lanes::submit`'s contract: sources are claimed pool pages
    // alive until the lanes are joined (before the pools drop), destinations
    // are inside mappings this piece keeps alive, granted to this write
    // alone; pieces of one write cover disjoint destination bytes (`cut` of
    // pairwise-disjoint spans), and a pool never overlaps a peer's mapping.
    unsafe { copy_populated(&piece.copies, &piece.segments) };
    finish_piece(&piece.join);
}

/// Prepares each destination's chunks of its segment (page-table entries
/// made once per chunk), then copies.
///
/// # Safety
/// As [`crate::memory::copy_spans`].
unsafe fn copy_populated(copies: &[CopySpan], segments: &[Arc<PeerSegment>]) {
    for span in copies {
        if let Some(segment) = segments.iter().find(|s| s.holds(span.dst, span.len)) {
            segment.prepare(span.dst, span.len);
        }
    }
    // SAFETY: the caller's contract.
    unsafe { crate::memory::copy_spans_streaming(copies) };
}

fn finish_piece(join: &WriteJoin) {
    if join.pieces_left.fetch_sub(1, Ordering::AcqRel) == 1 {
        let ok = !join.failed.load(Ordering::Acquire);
        // The peer thread may have stopped; then nobody waits for it.
        let _ = join.done.send((join.write, ok));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    /// A test's source and destination buffers and the copy plan between
    /// them: `spans` of (source offset, destination offset, length).
    struct Plan {
        src: Vec<u8>,
        dst: Vec<u8>,
        spans: Vec<(usize, usize, usize)>,
    }

    impl Plan {
        fn new(bytes: usize, spans: Vec<(usize, usize, usize)>) -> Self {
            Self {
                src: (0..bytes).map(|i| (i % 251) as u8).collect(),
                dst: vec![0u8; bytes],
                spans,
            }
        }

        fn copies(&mut self) -> Vec<CopySpan> {
            let (src, dst) = (self.src.as_ptr() as u64, self.dst.as_mut_ptr() as u64);
            self.spans
                .iter()
                .map(|&(s, d, len)| CopySpan {
                    src: src + s as u64,
                    dst: dst + d as u64,
                    len: len as u64,
                })
                .collect()
        }

        /// `dst` as copying the spans one after another leaves it.
        fn expected(&self) -> Vec<u8> {
            let mut want = vec![0u8; self.dst.len()];
            for &(s, d, len) in &self.spans {
                want[d..d + len].copy_from_slice(&self.src[s..s + len]);
            }
            want
        }

        /// Submits the plan (no segment: the destinations are plain memory
        /// of this test) and returns the inline outcome.
        fn submit(&mut self, lanes: &mut Lanes, tx: &UnboundedSender<(u64, bool)>) -> Option<bool> {
            let copies = self.copies();
            // SAFETY: both buffers outlive the call (a small write is copied
            // before it returns) and nothing else touches them meanwhile;
            // source and destination are distinct vectors.
            unsafe { lanes.submit(1, copies, Vec::new(), tx) }
        }
    }

    #[test]
    fn every_write_reports_once_even_across_lanes() {
        let mut lanes = Lanes::start(3).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let src = vec![7u8; 8 << 20];
        let mut dst = vec![0u8; 8 << 20];
        let copies = vec![CopySpan {
            src: src.as_ptr() as u64,
            dst: dst.as_mut_ptr() as u64,
            len: src.len() as u64,
        }];
        // SAFETY: both buffers outlive the wait below and nothing else
        // touches them meanwhile; they do not overlap. (No segment: these
        // destinations are plain memory of this test.)
        assert_eq!(unsafe { lanes.submit(9, copies, Vec::new(), &tx) }, None);
        assert_eq!(rx.blocking_recv(), Some((9, true)));
        assert!(rx.try_recv().is_err(), "reported once");
        assert!(dst.iter().all(|b| *b == 7));
        drop(lanes);
    }

    /// Lanes that stay awake (striping on), so small writes are striped.
    fn lingering(count: usize) -> Lanes {
        Lanes::start_tuned(
            count,
            LaneTuning {
                stripe_lanes: count,
                linger: Duration::from_secs(30),
            },
        )
        .unwrap()
    }

    #[rstest]
    #[case::one_block(256 << 10, vec![(0, 0, 256 << 10)])]
    #[case::odd_length(300_001, vec![(0, 0, 300_001)])]
    #[case::scattered_pages(512 << 10, vec![(0, 256 << 10, 64 << 10), (64 << 10, 0, 128 << 10), (300 << 10, 400 << 10, 100 << 10)])]
    #[case::below_a_stripe(48 << 10, vec![(0, 0, 48 << 10)])]
    #[case::just_under_inline((1 << 20) - 1, vec![(0, 0, (1 << 20) - 1)])]
    fn small_writes_are_copied_before_submit_returns(
        #[case] bytes: usize,
        #[case] spans: Vec<(usize, usize, usize)>,
        #[values(1, 3)] lanes: usize,
    ) {
        let mut lanes = lingering(lanes);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..20 {
            let mut plan = Plan::new(bytes, spans.clone());
            assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
            assert!(plan.dst == plan.expected(), "every byte, at once");
        }
        assert!(
            rx.try_recv().is_err(),
            "a small write is not reported later"
        );
    }

    #[test]
    fn awake_lanes_take_pieces_of_small_writes() {
        let mut lanes = lingering(1);
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        // A spinning lane may be descheduled on a loaded machine; it takes
        // a piece within a few writes once it runs.
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        while lanes.striped_by_lanes.load(Ordering::Relaxed) == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no lane ever took a piece of a striped write"
            );
            let mut plan = Plan::new(1 << 20, vec![(0, 0, (1 << 20) - 4096)]);
            assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
            assert!(plan.dst == plan.expected());
        }
    }

    #[test]
    fn a_small_write_wakes_parked_striping_lanes() {
        let tuning = LaneTuning {
            stripe_lanes: 2,
            linger: Duration::ZERO,
        };
        let mut lanes = Lanes::start_tuned(3, tuning).unwrap();
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        while !lanes
            .lanes
            .iter()
            .all(|l| l.inbox.parked.load(Ordering::SeqCst))
        {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "lanes never parked"
            );
            std::thread::yield_now();
        }
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let mut plan = Plan::new(256 << 10, vec![(0, 0, 256 << 10)]);
        assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
        assert!(plan.dst == plan.expected());
        // A parked lane left unwoken would hold its stripe forever.
        while !lanes.lanes.iter().all(|l| l.inbox.is_empty()) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "a striping lane was not woken"
            );
            std::thread::yield_now();
        }
        assert!(
            lanes.lanes[2].inbox.is_empty(),
            "only the striping lanes are handed pieces"
        );
    }

    #[test]
    fn without_striping_a_small_write_is_copied_alone() {
        let tuning = LaneTuning {
            stripe_lanes: 0,
            linger: Duration::from_secs(30),
        };
        let mut lanes = Lanes::start_tuned(2, tuning).unwrap();
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..20 {
            let mut plan = Plan::new(256 << 10, vec![(0, 0, 256 << 10)]);
            assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
            assert!(plan.dst == plan.expected());
        }
        assert_eq!(lanes.striped_by_lanes.load(Ordering::Relaxed), 0);
        assert!(lanes.lanes.iter().all(|l| l.inbox.is_empty()));
    }

    #[test]
    fn a_small_write_naming_one_destination_twice_is_copied_in_order() {
        // A hostile grant may name one slot twice: never striped, so the
        // bytes are those of copying the spans in order.
        let mut lanes = lingering(3);
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let mut plan = Plan::new(
            512 << 10,
            vec![(0, 0, 256 << 10), (256 << 10, 0, 256 << 10)],
        );
        assert_eq!(plan.submit(&mut lanes, &tx), Some(true));
        assert!(plan.dst == plan.expected());
        assert_eq!(lanes.striped_by_lanes.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn closing_joins_lanes_after_their_queued_work() {
        let mut lanes = Lanes::start_tuned(2, LaneTuning::for_host()).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut plans: Vec<Plan> = (0..4)
            .map(|_| Plan::new(4 << 20, vec![(0, 0, 4 << 20)]))
            .collect();
        for (i, plan) in plans.iter_mut().enumerate() {
            let copies = plan.copies();
            // SAFETY: the buffers outlive the lanes, joined below before
            // they are read; nothing else touches them.
            let inline = unsafe { lanes.submit(i as u64, copies, Vec::new(), &tx) };
            assert_eq!(inline, None);
        }
        drop(lanes);
        let mut reported: Vec<u64> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|(write, ok)| {
                assert!(ok);
                write
            })
            .collect();
        reported.sort_unstable();
        assert_eq!(
            reported,
            vec![0, 1, 2, 3],
            "every queued write ran and reported"
        );
        assert!(plans.iter().all(|p| p.dst == p.expected()));
    }
}
