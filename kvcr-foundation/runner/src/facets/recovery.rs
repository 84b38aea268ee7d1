//! [`Recovery`]: what a runner under a guard reports about its warm start:
//! how it started (warm or fresh, what recovery seated, or why the guard was
//! disabled) and the residency journal that lets the next incarnation
//! recover. Both read as `None` without a guard.

use crate::warm::{self, WarmStart};
use crate::{JournalStats, Runner};

/// The runner's warm-start report and journal, from [`Runner::recovery`].
///
/// ```ignore
/// let warm = runner.recovery().warm_start().is_some_and(|w| w.warm);
/// ```
#[derive(Clone, Copy)]
pub struct Recovery<'a> {
    runner: &'a Runner,
}

impl<'a> Recovery<'a> {
    pub(crate) fn new(runner: &'a Runner) -> Self {
        Self { runner }
    }

    /// How this runner started under its guard
    /// ([`PeerOptions::guard`](crate::PeerOptions::guard)): warm or fresh,
    /// what the recovery seated, or why it was disabled.
    pub fn warm_start(&self) -> Option<&'a WarmStart> {
        self.runner.warm_start.as_ref()
    }

    /// The residency journal's counters (under a guard, while it runs).
    pub fn journal_stats(&self) -> Option<JournalStats> {
        self.runner
            .shared
            .lock()
            .journal
            .as_ref()
            .and_then(warm::RunnerJournal::stats)
    }
}

impl std::fmt::Debug for Recovery<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recovery").finish_non_exhaustive()
    }
}
