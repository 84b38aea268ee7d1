//! A pipelined restore's bookkeeping: one engine restore may go to the
//! runner as several deliver operations ("parts") of at most
//! [`DirectLinker::set_restore_part_pages`] pages, in page order, and its
//! events are the parts' results put back together.
//!
//! Why parts: a deliver is one call under the runner's lock, and a peer's
//! writes for it leave only after that call returns. One deliver of the
//! seed's 1812 pages (232,000 elements) held the first `start_write` back
//! 6–11 ms on the H100 hosts (traced), while the source, which checks
//! each write as it arrives, sat idle. In parts, the first writes can
//! leave after the first part's call.
//!
//! Why 64 pages: on the H100 lease that first measured parts of 64 after
//! the peer thread stopped blocking on that lock, the seed's first layer
//! came at 20.6 ms against 30.3 ms whole (the destination's writes left
//! part by part from 0.4 ms on; `BENCH-HISTORY.md`). A part of 64 pages is
//! 16 of the seed's `start_write`s and 0.3–0.4 ms of the core's time: small
//! enough that the source starts early, large enough that a part's fixed
//! costs stay small. [`DirectLinker::set_restore_part_pages`] with at
//! least a restore's pages makes it one part.
//!
//! [`DirectLinker::set_restore_part_pages`]: super::DirectLinker::set_restore_part_pages

use std::num::NonZeroUsize;

use kvcr_foundation::AttemptId;
use kvcr_linker_contracts::{LinkerEvent, LoadTicket};

/// Most pages one part of a restore delivers unless set (see the module's
/// docs).
pub(crate) const RESTORE_PART_PAGES: NonZeroUsize = NonZeroUsize::new(64).unwrap();

/// One engine restore in flight.
#[derive(Debug)]
pub(super) struct Restore {
    attempt: AttemptId,
    /// Pages the engine asked for (every part's, and any that never went).
    pages: u32,
    /// The parts in page order.
    parts: Vec<Part>,
    /// The first layer was reported (at most once).
    first_layer_said: bool,
}

#[derive(Debug)]
struct Part {
    pages: u32,
    /// Leading pages of the part that landed, once its result came.
    restored: Option<u32>,
    /// Leading pages of the part whose first layer is in place, once said.
    first_layer: Option<u32>,
}

impl Restore {
    pub(super) fn new(attempt: AttemptId, pages: u32) -> Self {
        Self {
            attempt,
            pages,
            parts: Vec::new(),
            first_layer_said: false,
        }
    }

    /// Adds the next part (`pages` pages after the previous parts'); its
    /// index.
    pub(super) fn push(&mut self, pages: u32) -> usize {
        self.parts.push(Part {
            pages,
            restored: None,
            first_layer: None,
        });
        self.parts.len() - 1
    }

    /// Whether no part went to the runner.
    pub(super) fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Part `part` says the first layer of its `landed` leading pages is in
    /// place. Once every part has, the restore's [`LinkerEvent::FirstLayerLanded`]
    /// (leading pages across parts: a part short of its pages ends the
    /// count).
    pub(super) fn first_layer(
        &mut self,
        ticket: LoadTicket,
        part: usize,
        landed: u32,
    ) -> Option<LinkerEvent> {
        let pages = self.record(part, landed, |p| &mut p.first_layer)?;
        if std::mem::replace(&mut self.first_layer_said, true) {
            return None;
        }
        Some(LinkerEvent::FirstLayerLanded {
            attempt: self.attempt.clone(),
            ticket,
            pages,
        })
    }

    /// Part `part` ended with `restored` leading pages landed. Once every
    /// part has, the restore's [`LinkerEvent::RestoreDone`]: leading pages
    /// across parts (a page after a short part is not counted, as a page
    /// after a failed one within a part is not).
    pub(super) fn part_done(
        &mut self,
        ticket: LoadTicket,
        part: usize,
        restored: u32,
    ) -> Option<LinkerEvent> {
        let restored = self.record(part, restored, |p| &mut p.restored)?;
        Some(LinkerEvent::RestoreDone {
            attempt: self.attempt.clone(),
            ticket,
            restored: restored.min(self.pages),
            pages: self.pages,
        })
    }

    /// Keeps `count` (at most the part's pages) in part `part`'s `field`;
    /// once every part has one, the leading pages across parts.
    fn record(
        &mut self,
        part: usize,
        count: u32,
        field: fn(&mut Part) -> &mut Option<u32>,
    ) -> Option<u32> {
        let part = self.parts.get_mut(part)?;
        let pages = part.pages;
        *field(part) = Some(count.min(pages));
        if self.parts.iter_mut().any(|p| field(p).is_none()) {
            return None;
        }
        Some(leading(self.parts.iter_mut().map(|p| {
            let pages = p.pages;
            (field(p).unwrap_or(0), pages)
        })))
    }
}

/// Leading pages across parts given each part's `(count, pages)`: parts
/// are summed up to and including the first that is short of its pages.
fn leading(parts: impl Iterator<Item = (u32, u32)>) -> u32 {
    let mut total = 0u32;
    for (count, pages) in parts {
        total = total.saturating_add(count);
        if count < pages {
            break;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn restore(parts: &[u32]) -> Restore {
        let attempt = AttemptId {
            request: kvcr_foundation::RequestId("r".into()),
            generation: 1,
        };
        let mut restore = Restore::new(attempt, parts.iter().sum());
        for pages in parts {
            restore.push(*pages);
        }
        restore
    }

    fn done(event: Option<LinkerEvent>) -> Option<u32> {
        match event? {
            LinkerEvent::RestoreDone { restored, .. } => Some(restored),
            other => panic!("{other:?}"),
        }
    }

    fn first(event: Option<LinkerEvent>) -> Option<u32> {
        match event? {
            LinkerEvent::FirstLayerLanded { pages, .. } => Some(pages),
            other => panic!("{other:?}"),
        }
    }

    const T: LoadTicket = LoadTicket(7);

    #[rstest::rstest]
    #[case::all_landed(&[64, 64, 10], &[64, 64, 10], 138)]
    #[case::first_part_short(&[64, 64, 10], &[3, 64, 10], 3)]
    #[case::middle_part_short(&[64, 64, 10], &[64, 0, 10], 64)]
    #[case::last_part_short(&[64, 64, 10], &[64, 64, 9], 137)]
    #[case::a_part_claims_more_than_it_has(&[4, 4], &[9, 4], 8)]
    fn the_restore_reports_leading_pages_across_its_parts(
        #[case] parts: &[u32],
        #[case] restored: &[u32],
        #[case] expected: u32,
    ) {
        let mut r = restore(parts);
        // Parts end in any order; only the last one to end reports.
        for (i, n) in restored.iter().enumerate().skip(1).rev() {
            assert_eq!(done(r.part_done(T, i, *n)), None);
        }
        assert_eq!(done(r.part_done(T, 0, restored[0])), Some(expected));
    }

    #[test]
    fn the_first_layer_is_said_once_every_part_said_it() {
        let mut r = restore(&[64, 64, 10]);
        assert_eq!(first(r.first_layer(T, 2, 10)), None);
        assert_eq!(first(r.first_layer(T, 0, 64)), None);
        assert_eq!(first(r.first_layer(T, 1, 60)), Some(124));
        // Never twice, whatever comes after.
        assert_eq!(first(r.first_layer(T, 1, 64)), None);
        // A part the restore does not have says nothing.
        assert_eq!(first(restore(&[4]).first_layer(T, 3, 4)), None);
    }
}
