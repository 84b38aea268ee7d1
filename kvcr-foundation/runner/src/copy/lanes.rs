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
//! * A write whose pages carry digests ([`Lanes::submit_checked`]) is cut
//!   at page boundaries instead, and each page is hashed in the pass that
//!   copies it (`kvcr_sys::MemoryRegistry::copy_digested_into`): a page
//!   whose bytes no longer match the digest taken at its deposit fails the
//!   write (counted in [`CheckCounters`]), so the source never reports
//!   altered bytes as written, and the target need not read them again.
//!
//! Drop order: [`Lanes`] closes every lane and joins its threads (after they
//! finish what is queued) before the peer thread's pools are dropped — the
//! lanes read them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use kvcr_runner_core::CopySpan;
use tokio::sync::mpsc::UnboundedSender;

use kvcr_sys::MemoryRegistry;
use kvcr_sys::segment::PeerSegment;

use super::plan::{byte_span, cores, spans_disjoint, split_even, split_whole};

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

/// A page of a checked write: its spans (consecutive, in layout order) and
/// the digest its source took at deposit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CheckedPage {
    pub(crate) copies: Vec<CopySpan>,
    pub(crate) digest: u64,
}

impl CheckedPage {
    /// `copies` cut into pages of `pages` (per page: how many spans, its
    /// digest); `None` unless the counts add up to every span.
    pub(crate) fn group(copies: Vec<CopySpan>, pages: &[(usize, u64)]) -> Option<Vec<Self>> {
        if pages.iter().map(|p| p.0).sum::<usize>() != copies.len() {
            return None;
        }
        let mut rest = copies.into_iter();
        Some(
            pages
                .iter()
                .map(|&(spans, digest)| Self {
                    copies: rest.by_ref().take(spans).collect(),
                    digest,
                })
                .collect(),
        )
    }

    fn bytes(&self) -> u64 {
        self.copies.iter().map(|s| s.len).sum()
    }
}

/// Pages the lanes checked as they copied them (as a source).
#[derive(Debug, Default)]
pub(crate) struct CheckCounters {
    /// Pages whose digest, taken in the copy, matched their deposit's.
    pub(crate) checked: AtomicU64,
    /// Pages whose bytes no longer matched their deposit's digest: their
    /// write failed.
    pub(crate) altered: AtomicU64,
}

/// What one piece of a write copies.
#[derive(Debug)]
enum Copies {
    /// Spans, copied as they are.
    Plain(Vec<CopySpan>),
    /// Whole pages, each hashed in the pass that copies it and compared
    /// with its deposit digest.
    Checked(Vec<CheckedPage>),
}

impl Copies {
    fn spans(&self) -> Box<dyn Iterator<Item = &CopySpan> + '_> {
        match self {
            Self::Plain(copies) => Box::new(copies.iter()),
            Self::Checked(pages) => Box::new(pages.iter().flat_map(|p| p.copies.iter())),
        }
    }
}

/// A write's outcome, reported once all of its pieces ran.
#[derive(Debug)]
struct WriteJoin {
    write: u64,
    /// What the pieces copy through.
    memory: Arc<MemoryRegistry>,
    checks: Arc<CheckCounters>,
    pieces_left: AtomicUsize,
    failed: AtomicBool,
    done: UnboundedSender<(u64, bool)>,
}

struct Piece {
    copies: Copies,
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
    checks: Arc<CheckCounters>,
    /// A piece's copy was refused (a span outside the registry and the
    /// segments): the write fails.
    failed: AtomicBool,
    /// Pieces the lanes copied, all stripes together (for tests and audits:
    /// whether striping ever happens on this host).
    by_lanes: Arc<AtomicUsize>,
}

struct StripePiece {
    copies: Copies,
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
                if !copy_piece(&self.memory, &piece.copies, &self.segments, &self.checks) {
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
    checks: Arc<CheckCounters>,
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

    /// Counts checked pages in `checks` (a fresh count otherwise).
    pub(crate) fn counting_in(mut self, checks: Arc<CheckCounters>) -> Self {
        self.checks = checks;
        self
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
            checks: Arc::default(),
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
            return Some(self.copy_small(Copies::Plain(copies), total, segments));
        }
        let pieces = if spans_disjoint(copies.iter()) {
            split_even(copies, total, self.parts(total))
        } else {
            vec![copies]
        };
        self.hand_out(write, pieces.into_iter().map(Copies::Plain), segments, done);
        None
    }

    /// As [`Self::submit`], for a write of whole `pages` that carry their
    /// deposit digests: pieces are cut at page boundaries, and each page is
    /// hashed in the pass that copies it; a page whose digest differs fails
    /// the write (and is counted). A write reported `true` landed exactly
    /// the bytes that were deposited.
    pub(crate) fn submit_checked(
        &mut self,
        write: u64,
        pages: Vec<CheckedPage>,
        segments: Vec<Arc<PeerSegment>>,
        done: &UnboundedSender<(u64, bool)>,
    ) -> Option<bool> {
        let total: u64 = pages.iter().map(CheckedPage::bytes).sum();
        if total < INLINE_BYTES {
            return Some(self.copy_small(Copies::Checked(pages), total, segments));
        }
        let disjoint = spans_disjoint(pages.iter().flat_map(|p| p.copies.iter()));
        let pieces = if disjoint {
            let parts = self.parts(total);
            split_whole(pages, CheckedPage::bytes, parts)
        } else {
            vec![pages]
        };
        self.hand_out(
            write,
            pieces.into_iter().map(Copies::Checked),
            segments,
            done,
        );
        None
    }

    /// How many pieces a large write of `total` bytes of pairwise-disjoint
    /// spans is cut into: one per lane, none under [`MIN_PIECE_BYTES`].
    /// (Pieces write disjoint bytes only if the spans do: a target grants
    /// distinct slots; a hostile grant naming one twice stays one piece.)
    fn parts(&self, total: u64) -> u64 {
        (total / MIN_PIECE_BYTES).clamp(1, (self.lanes.len() as u64).max(1))
    }

    /// Queues a large write's `pieces` on the lanes, one each in turn.
    fn hand_out(
        &mut self,
        write: u64,
        pieces: impl ExactSizeIterator<Item = Copies>,
        segments: Vec<Arc<PeerSegment>>,
        done: &UnboundedSender<(u64, bool)>,
    ) {
        let join = Arc::new(WriteJoin {
            write,
            pieces_left: AtomicUsize::new(pieces.len()),
            failed: AtomicBool::new(false),
            done: done.clone(),
            memory: Arc::clone(&self.memory),
            checks: Arc::clone(&self.checks),
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
    }

    /// Copies a small write before returning: striped over the lanes awake
    /// now when the tuning allows and it is worth cutting, else alone.
    /// Returns whether every piece was copied.
    fn copy_small(&self, copies: Copies, total: u64, segments: Vec<Arc<PeerSegment>>) -> bool {
        let most_pieces = (total / MIN_STRIPE_BYTES).min(self.tuning.stripe_lanes as u64 + 1);
        let stripers: Vec<&Lane> = self
            .lanes
            .iter()
            .take(usize::try_from(most_pieces.saturating_sub(1)).unwrap_or(usize::MAX))
            .collect();
        let parts = stripers.len() as u64 + 1;
        let pieces: Vec<Copies> = match copies {
            _ if stripers.is_empty() => vec![copies],
            copies if !spans_disjoint(copies.spans()) => vec![copies],
            Copies::Plain(copies) => split_even(copies, total, parts)
                .into_iter()
                .map(Copies::Plain)
                .collect(),
            Copies::Checked(pages) => split_whole(pages, CheckedPage::bytes, parts)
                .into_iter()
                .map(Copies::Checked)
                .collect(),
        };
        if let [alone] = pieces.as_slice() {
            // `segments` lives until after the copy (dropped at the end of
            // this call).
            return copy_piece(&self.memory, alone, &segments, &self.checks);
        }
        // Pieces of whole pages may be fewer than the lanes awake.
        let helpers = pieces.len().saturating_sub(1);
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
            checks: Arc::clone(&self.checks),
            failed: AtomicBool::new(false),
            by_lanes: Arc::clone(&self.striped_by_lanes),
        });
        for lane in stripers.into_iter().take(helpers) {
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
    let join = &piece.join;
    if !copy_piece(&join.memory, &piece.copies, &piece.segments, &join.checks) {
        piece.join.failed.store(true, Ordering::Release);
    }
    finish_piece(&piece.join);
}

/// Prepares each destination's chunks of its segment (page-table entries
/// made once per chunk), then copies through `memory` (one check of every
/// span, under one read lock; for checked pages, one per page, each hashed
/// as it is copied and compared with its deposit digest); `false` when the
/// copy was refused or a page's bytes were not those deposited (the pages
/// after it are not copied: the write fails anyway).
fn copy_piece(
    memory: &MemoryRegistry,
    copies: &Copies,
    segments: &[Arc<PeerSegment>],
    checks: &CheckCounters,
) -> bool {
    for span in copies.spans() {
        if let Some(segment) = segments.iter().find(|s| s.holds(span.dst, span.len)) {
            segment.prepare(span.dst, span.len);
        }
    }
    match copies {
        Copies::Plain(copies) => memory
            .copy_streaming_into(copies.iter().map(byte_span), segments)
            .is_ok(),
        Copies::Checked(pages) => pages.iter().all(|page| {
            let spans: Vec<kvcr_sys::ByteSpan> = page.copies.iter().map(byte_span).collect();
            match memory.copy_digested_into(&spans, segments) {
                Ok(digest) if digest == page.digest => {
                    checks.checked.fetch_add(1, Ordering::Relaxed);
                    true
                }
                Ok(_) => {
                    checks.altered.fetch_add(1, Ordering::Relaxed);
                    false
                }
                Err(_) => false,
            }
        }),
    }
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
