//! The copy lanes of one-copy peer writes.
//!
//! A write into a same-host target's mapped segments
//! ([`kvcr_sys::segment::PeerSegment`]) is a plan of plain copies, checked
//! against the runner's registered pools and the write's segments (one
//! registry read per piece) before a byte moves.
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

use kvcr_sys::MemoryRegistry;
use kvcr_sys::segment::PeerSegment;

use super::plan::{byte_span, cores, spans_disjoint, split_even};

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
    /// What the pieces copy through.
    memory: Arc<MemoryRegistry>,
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
    /// What the pieces copy through.
    memory: Arc<MemoryRegistry>,
    /// A piece's copy was refused (a span outside the registry and the
    /// segments): the write fails.
    failed: AtomicBool,
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
    /// Claims and copies every piece nobody has claimed yet. The submitter
    /// waits for [`Stripe::copied`] before it reports the write, so a piece
    /// is never copied after its sources or destinations change hands.
    /// Returns how many pieces this call copied.
    fn help(&self) -> usize {
        let mut copied = 0;
        for piece in &self.pieces {
            if piece
                .state
                .compare_exchange(UNCLAIMED, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                // The claim makes this thread the piece's only writer, and
                // pieces cover disjoint destination bytes (`split_even` of
                // pairwise-disjoint spans).
                if !copy_populated(&self.memory, &piece.copies, &self.segments) {
                    self.failed.store(true, Ordering::Release);
                }
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
    /// The runner's pools (the writes' sources), as registered.
    memory: Arc<MemoryRegistry>,
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
    /// Starts `count` lanes (at least one), tuned for this host, copying
    /// from memory registered in `memory`.
    pub(crate) fn start(count: usize, memory: Arc<MemoryRegistry>) -> std::io::Result<Self> {
        Self::start_tuned(count, LaneTuning::for_host(), memory)
    }

    /// Starts `count` lanes (at least one) with `tuning`.
    pub(crate) fn start_tuned(
        count: usize,
        tuning: LaneTuning,
        memory: Arc<MemoryRegistry>,
    ) -> std::io::Result<Self> {
        let mut lanes = Self {
            lanes: Vec::new(),
            memory,
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
    /// Every source must be registered (the runner's own pool pages, claimed
    /// by the write and unwritten until the report) and every destination
    /// inside one of `segments`, granted to this write by its target: a
    /// piece naming anything else is refused and the write fails.
    pub(crate) fn submit(
        &mut self,
        write: u64,
        copies: Vec<CopySpan>,
        segments: Vec<Arc<PeerSegment>>,
        done: &UnboundedSender<(u64, bool)>,
    ) -> Option<bool> {
        let total: u64 = copies.iter().map(|s| s.len).sum();
        if total < INLINE_BYTES {
            return Some(self.copy_small(copies, total, segments));
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
            memory: Arc::clone(&self.memory),
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
    /// Returns whether every piece was copied.
    fn copy_small(
        &self,
        copies: Vec<CopySpan>,
        total: u64,
        segments: Vec<Arc<PeerSegment>>,
    ) -> bool {
        let most_pieces = (total / MIN_STRIPE_BYTES).min(self.tuning.stripe_lanes as u64 + 1);
        let stripers: Vec<&Lane> = self
            .lanes
            .iter()
            .take(usize::try_from(most_pieces.saturating_sub(1)).unwrap_or(usize::MAX))
            .collect();
        if stripers.is_empty() || !spans_disjoint(copies.iter()) {
            // `segments` lives until after the copy (dropped at the end of
            // this call).
            return copy_populated(&self.memory, &copies, &segments);
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
            memory: Arc::clone(&self.memory),
            failed: AtomicBool::new(false),
            by_lanes: Arc::clone(&self.striped_by_lanes),
        });
        for lane in stripers {
            // A lane that was parked finds the stripe copied when it runs,
            // and lingers for the next one.
            lane.inbox.push(Work::Stripe(Arc::clone(&stripe)));
            lane.wake_if_parked();
        }
        // The wait below keeps the write ours until every piece, ours or a
        // lane's, is copied.
        let _ours = stripe.help();
        while !stripe.copied() {
            // Only pieces a lane claimed and is copying remain.
            std::hint::spin_loop();
        }
        !stripe.failed.load(Ordering::Acquire)
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
                // The submitter waits until the stripe is copied; pieces
                // already claimed are skipped, so a late lane copies nothing.
                let copied = stripe.help();
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
    // Sources are claimed pool pages (registered until the lanes are joined,
    // before the pools drop); destinations are inside mappings this piece
    // keeps alive, granted to this write alone; pieces of one write cover
    // disjoint destination bytes (`cut` of pairwise-disjoint spans).
    if !copy_populated(&piece.join.memory, &piece.copies, &piece.segments) {
        piece.join.failed.store(true, Ordering::Release);
    }
    finish_piece(&piece.join);
}

/// Prepares each destination's chunks of its segment (page-table entries
/// made once per chunk), then copies through `memory` (one check of every
/// span, under one read lock); `false` when the copy was refused.
fn copy_populated(
    memory: &MemoryRegistry,
    copies: &[CopySpan],
    segments: &[Arc<PeerSegment>],
) -> bool {
    for span in copies {
        if let Some(segment) = segments.iter().find(|s| s.holds(span.dst, span.len)) {
            segment.prepare(span.dst, span.len);
        }
    }
    memory
        .copy_streaming_into(copies.iter().map(byte_span), segments)
        .is_ok()
}

fn finish_piece(join: &WriteJoin) {
    if join.pieces_left.fetch_sub(1, Ordering::AcqRel) == 1 {
        let ok = !join.failed.load(Ordering::Acquire);
        // The peer thread may have stopped; then nobody waits for it.
        let _ = join.done.send((join.write, ok));
    }
}

#[cfg(test)]
mod tests;
