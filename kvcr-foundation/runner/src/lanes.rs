//! Unsafe, named: the copy lanes of one-copy peer writes.
//!
//! A write into a same-host target's mapped segments
//! ([`crate::shared_memory::PeerSegment`]) is a plan of plain copies. The
//! peer thread cuts it at byte boundaries into one piece per lane (small
//! writes stay one piece) and hands the pieces to the lane threads; the last
//! lane to finish reports the write on a channel the peer thread sleeps on.
//! The peer thread itself never copies, so it keeps serving control messages
//! while bytes move, and nobody spins.
//!
//! Drop order: [`Lanes`] joins its threads (after they finish what is
//! queued) before the peer thread's pools are dropped — the lanes read them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use kvcr_runner_core::CopySpan;
use tokio::sync::mpsc::UnboundedSender;

use crate::copy::{spans_disjoint, split_even};
use crate::shared_memory::PeerSegment;

/// Below this many bytes a write is one piece on one lane: a hand-off costs
/// more than a lane could save.
const MIN_PIECE_BYTES: u64 = 2 << 20;

/// Below this many bytes the caller copies the write itself: two thread
/// wake-ups (to a lane and back) cost more than the copy (256 KiB: ~25 µs).
const INLINE_BYTES: u64 = 1 << 20;

/// The lanes' default count: one per core, at most 8 (12 threads reach the
/// H200 host's copy limit; 8 are within 80 % of it).
pub(crate) fn default_lanes() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .clamp(1, 8)
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

/// The lane threads.
pub(crate) struct Lanes {
    senders: Vec<std::sync::mpsc::Sender<Piece>>,
    threads: Vec<JoinHandle<()>>,
    next: usize,
}

impl std::fmt::Debug for Lanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("lanes", &self.senders.len())
            .finish()
    }
}

impl Lanes {
    /// Starts `count` lanes (at least one).
    pub(crate) fn start(count: usize) -> std::io::Result<Self> {
        let mut lanes = Self {
            senders: Vec::new(),
            threads: Vec::new(),
            next: 0,
        };
        for i in 0..count.max(1) {
            let (tx, rx) = std::sync::mpsc::channel::<Piece>();
            let thread = std::thread::Builder::new()
                .name(format!("kvcr-lane-{i}"))
                .spawn(move || {
                    for piece in rx {
                        run(piece);
                    }
                })?;
            lanes.senders.push(tx);
            lanes.threads.push(thread);
        }
        Ok(lanes)
    }

    /// Runs the copies of `write`: a small write here and now (returns
    /// `Some(ok)`), a larger one on the lanes (returns `None`; `(write, ok)`
    /// arrives on `done` once every byte was copied or the write failed).
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
            // SAFETY: this function's contract; `segments` lives until after
            // the copy (dropped at the end of this call).
            unsafe { copy_populated(&copies, &segments) };
            drop(segments);
            return Some(true);
        }
        let lanes = self.senders.len() as u64;
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
            let lane = self.next % self.senders.len().max(1);
            self.next = self.next.wrapping_add(1);
            let piece = Piece {
                copies,
                segments: Arc::clone(&segments),
                join: Arc::clone(&join),
            };
            let sent = self.senders.get(lane).map(|tx| tx.send(piece));
            if !matches!(sent, Some(Ok(()))) {
                // A lane that died never copies: the write fails (its slots
                // stay the target's to reclaim), it is not lost.
                join.failed.store(true, Ordering::Release);
                finish_piece(&join);
            }
        }
        None
    }
}

impl Drop for Lanes {
    fn drop(&mut self) {
        // Closing the channels ends each lane after the pieces it holds.
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
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
}
