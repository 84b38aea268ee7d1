//! Sparse shared-prefix residency: which prefix lengths a rank can restore,
//! how ranks agree on one, and how a preparation follows the engine's own
//! device prefix as it grows or shrinks.
//!
//! Lengths are counted in pages from the start of the queried tail (the pages
//! after the engine's device prefix). A rank with a sliding-window or sparse
//! pool can restore some lengths and not the ones between them, so a rank
//! reports a **set** ([`RestorableLengths`]); ranks agree on the largest length
//! in every rank's set ([`agree_restorable_prefix`]). Taking the minimum of the
//! per-rank maxima would be wrong: ranks reporting `{2}` and `{4}` share no
//! length, and the answer is 0, not 2.

use std::collections::BTreeSet;

use kvcr_contracts::BlockKey;

use crate::attempt::ClaimId;
use crate::error::{Error, Result};

#[cfg(test)]
mod tests;

/// How a pool's pages make a prefix restorable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// Full attention: every page below the boundary must be present.
    Full,
    /// Sliding-window attention: only the last `window_pages` pages below the
    /// boundary are needed.
    SlidingWindow {
        /// Pages the window spans (at least one).
        window_pages: u32,
    },
}

/// One pool's presence over the queried tail: `present[i]` says whether tail
/// page `i` of this pool can be restored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPresence {
    /// How the pool's pages combine.
    pub kind: PoolKind,
    /// Presence per tail page.
    pub present: Vec<bool>,
}

/// The prefix lengths (in pages, each at least one) one rank can restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestorableLengths(BTreeSet<u32>);

impl RestorableLengths {
    /// No restorable length.
    pub fn none() -> Self {
        Self::default()
    }

    /// From explicit lengths; a length of zero restores nothing and is dropped.
    pub fn new(lengths: impl IntoIterator<Item = u32>) -> Self {
        Self(lengths.into_iter().filter(|&l| l > 0).collect())
    }

    /// The lengths at which every pool can restore the prefix. All pools must
    /// cover the same number of pages; a sliding window must span at least one
    /// page.
    pub fn from_pools(pools: &[PoolPresence]) -> Result<Self> {
        let first = pools.first().ok_or(Error::NoPools)?;
        let pages = first.present.len();
        for (pool, presence) in pools.iter().enumerate() {
            if presence.present.len() != pages {
                return Err(Error::PoolLength {
                    pool,
                    expected: pages,
                    got: presence.present.len(),
                });
            }
            if presence.kind == (PoolKind::SlidingWindow { window_pages: 0 }) {
                return Err(Error::ZeroWindow { pool });
            }
        }
        let lengths = (1..=pages)
            .filter(|&boundary| pools.iter().all(|pool| pool.restores(boundary)))
            .filter_map(|boundary| u32::try_from(boundary).ok());
        Ok(Self::new(lengths))
    }

    /// The longest restorable length, or 0.
    pub fn longest(&self) -> u32 {
        self.0.last().copied().unwrap_or(0)
    }

    /// Whether `length` is restorable.
    pub fn contains(&self, length: u32) -> bool {
        self.0.contains(&length)
    }

    /// Whether nothing is restorable.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The lengths, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    /// The lengths common to `self` and `other`.
    pub fn intersection(&self, other: &Self) -> Self {
        Self(self.0.intersection(&other.0).copied().collect())
    }

    /// The lengths seen from `by` pages later (lengths not beyond `by` vanish).
    fn shifted(&self, by: u32) -> Self {
        Self::new(self.0.iter().filter_map(|l| l.checked_sub(by)))
    }

    /// Only lengths up to `limit`.
    fn capped(&self, limit: usize) -> Self {
        Self(
            self.0
                .iter()
                .copied()
                .filter(|&l| usize::try_from(l).is_ok_and(|l| l <= limit))
                .collect(),
        )
    }
}

impl PoolPresence {
    fn restores(&self, boundary: usize) -> bool {
        let needed_from = match self.kind {
            PoolKind::Full => 0,
            PoolKind::SlidingWindow { window_pages } => {
                boundary.saturating_sub(usize::try_from(window_pages).unwrap_or(usize::MAX))
            }
        };
        self.present
            .get(needed_from..boundary)
            .is_some_and(|pages| pages.iter().all(|&p| p))
    }
}

/// The prefix length every rank can restore: the largest length in the
/// intersection of all `ranks` reports, or 0 when they share none. Exactly one
/// report per rank is required.
pub fn agree_restorable_prefix(reports: &[RestorableLengths], ranks: usize) -> Result<u32> {
    if ranks == 0 || reports.len() != ranks {
        return Err(Error::RankCount {
            expected: ranks,
            got: reports.len(),
        });
    }
    let mut common = reports.first().cloned().unwrap_or_default();
    for report in reports.iter().skip(1) {
        common = common.intersection(report);
    }
    Ok(common.longest())
}

/// Why a preparation stopped being usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetireReason {
    /// The engine's device prefix shrank below where the preparation starts:
    /// its pages no longer follow the device prefix.
    TailShrunk,
    /// The queried tail is not the prepared one.
    TailMismatch,
    /// The device prefix grew over every prepared page.
    DevicePassed,
    /// A newer attempt of the request replaced it.
    Superseded,
    /// The request finished or was aborted.
    Released,
}

/// A prepared (staged and claimed) tail, relative to the device prefix it was
/// prepared against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preparation {
    start: u32,
    keys: Vec<BlockKey>,
    claims: Vec<Option<ClaimId>>,
    lengths: RestorableLengths,
}

/// What a lookup did to a preparation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advance {
    /// Still usable; `lengths` is this rank's report for the lookup.
    Current {
        /// Restorable lengths from the current device prefix.
        lengths: RestorableLengths,
        /// Pages the device prefix grew over (now on the device).
        shifted_by: u32,
        /// Claims of those pages; the caller releases them.
        released: Vec<ClaimId>,
    },
    /// No longer usable: the lookup reports nothing and the caller releases
    /// every claim and drops the preparation.
    Retired {
        /// Why.
        reason: RetireReason,
        /// Every claim the preparation held.
        released: Vec<ClaimId>,
    },
}

/// Whether a load's pages are all claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadClaims {
    /// The claims of the loaded pages, in page order.
    Ready(Vec<ClaimId>),
    /// The first page without a claim (or beyond the prepared tail).
    Missing {
        /// Its index in the prepared tail.
        page: usize,
    },
}

impl Preparation {
    /// A ready preparation of the tail that starts after `device_prefix`
    /// pages: `pages` are the tail's keys with the claim staged for each (if
    /// any), `lengths` what the pools can restore. A length is kept only if
    /// every page below it is claimed, so a lookup never reports a page that a
    /// load could not take.
    pub fn new(
        device_prefix: u32,
        pages: Vec<(BlockKey, Option<ClaimId>)>,
        lengths: RestorableLengths,
    ) -> Self {
        let claimed_prefix = pages.iter().take_while(|(_, c)| c.is_some()).count();
        let (keys, claims) = pages.into_iter().unzip();
        Self {
            start: device_prefix,
            keys,
            claims,
            lengths: lengths.capped(claimed_prefix),
        }
    }

    /// The device prefix (in pages) the preparation follows.
    pub fn start(&self) -> u32 {
        self.start
    }

    /// The prepared tail's keys.
    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// Restorable lengths from [`Self::start`].
    pub fn lengths(&self) -> &RestorableLengths {
        &self.lengths
    }

    /// Every claim held, in page order.
    pub fn claims(&self) -> Vec<ClaimId> {
        self.claims.iter().flatten().copied().collect()
    }

    /// Follows the engine's device prefix: the engine now holds
    /// `device_prefix` pages and asks about `tail`.
    ///
    /// * Shrunk below the start: retired ([`RetireReason::TailShrunk`]).
    /// * Grown over every prepared page: retired ([`RetireReason::DevicePassed`]).
    /// * Grown by `g` pages: the first `g` pages' claims are released, lengths
    ///   shift down by `g`.
    /// * The tail's first page is not the prepared page there: retired
    ///   ([`RetireReason::TailMismatch`]).
    ///
    /// Reported lengths never exceed the pages on which `tail` and the
    /// preparation agree.
    pub fn lookup(&mut self, device_prefix: u32, tail: &[BlockKey]) -> Advance {
        let Some(grown) = device_prefix.checked_sub(self.start) else {
            return self.retire(RetireReason::TailShrunk);
        };
        let grown_pages = usize::try_from(grown).unwrap_or(usize::MAX);
        if grown_pages >= self.keys.len() {
            return self.retire(RetireReason::DevicePassed);
        }
        let matching = self
            .keys
            .iter()
            .skip(grown_pages)
            .zip(tail)
            .take_while(|(prepared, asked)| prepared == asked)
            .count();
        if matching == 0 {
            return self.retire(RetireReason::TailMismatch);
        }
        self.keys.drain(..grown_pages);
        let released = self.claims.drain(..grown_pages).flatten().collect();
        self.start = device_prefix;
        self.lengths = self.lengths.shifted(grown);
        Advance::Current {
            lengths: self.lengths.capped(matching),
            shifted_by: grown,
            released,
        }
    }

    /// The claims a load of the first `pages` prepared pages would consume.
    pub fn load_claims(&self, pages: usize) -> LoadClaims {
        let mut claims = Vec::with_capacity(pages.min(self.claims.len()));
        for page in 0..pages {
            match self.claims.get(page).copied().flatten() {
                Some(claim) => claims.push(claim),
                None => return LoadClaims::Missing { page },
            }
        }
        LoadClaims::Ready(claims)
    }

    /// Drops the preparation, returning every claim for release.
    pub fn into_claims(self) -> Vec<ClaimId> {
        self.claims.into_iter().flatten().collect()
    }

    fn retire(&mut self, reason: RetireReason) -> Advance {
        let released = self.claims();
        self.claims.iter_mut().for_each(|c| *c = None);
        self.lengths = RestorableLengths::none();
        Advance::Retired { reason, released }
    }
}
