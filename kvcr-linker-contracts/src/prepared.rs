//! [`PreparedAttempts`]: the request-scoped bookkeeping every preparing
//! linker needs, in one place: which attempt is live per request, its
//! preparation (fetching, ready, loaded, retired), the staging and load
//! transfers accepted for it, and which claims each step hands back.
//!
//! It never touches a store. Every method that frees claims returns them, and
//! the linker releases them in its store; so the reference linker and the
//! direct linker share these rules instead of keeping two copies of them.

use std::collections::BTreeMap;

use kvcr_contracts::{AttemptId, BlockKey, RequestId};

use crate::attempt::{AttemptTable, ClaimId, TransferId};
use crate::error::{Error, Result};
use crate::linker::PreparationState;
use crate::prefix::{
    Advance, LoadClaims, PoolKind, PoolPresence, Preparation, RestorableLengths, RetireReason,
};

#[derive(Debug)]
enum Prep {
    Fetching,
    Ready(Preparation),
    Loaded,
    Retired(RetireReason),
}

/// Live attempts, their preparations and their transfers (see the module
/// docs).
#[derive(Debug, Default)]
pub struct PreparedAttempts {
    attempts: AttemptTable,
    preps: BTreeMap<RequestId, (AttemptId, Prep)>,
    /// Loads accepted and not landed, by transfer (one per attempt at most).
    loads: BTreeMap<TransferId, AttemptId>,
}

impl PreparedAttempts {
    /// No attempts.
    pub fn new() -> Self {
        Self::default()
    }

    /// The attempt table (liveness, claims and transfers in flight).
    pub fn attempts(&self) -> &AttemptTable {
        &self.attempts
    }

    /// Begins `attempt` (superseding the live attempt of its request) and
    /// accepts its staging transfer. Returns the transfer and the superseded
    /// attempt's claims to release.
    pub fn start(&mut self, attempt: &AttemptId) -> Result<(TransferId, Vec<ClaimId>)> {
        let released = self
            .attempts
            .begin(attempt)?
            .map(|superseded| superseded.released)
            .unwrap_or_default();
        // Cannot fail: the attempt was just made live.
        let transfer = self.attempts.accept(attempt, Vec::new())?;
        self.preps
            .insert(attempt.request.clone(), (attempt.clone(), Prep::Fetching));
        Ok((transfer, released))
    }

    /// The staging `transfer` of `attempt` landed: `pages` are the tail's keys
    /// in order, each with the claim the store staged for it. Only a
    /// contiguous run of claimed pages from the start counts (a page after a
    /// miss could never be loaded). Returns the claims to release: those after
    /// the run, and every one if the attempt is no longer live.
    pub fn land_staging(
        &mut self,
        transfer: TransferId,
        attempt: &AttemptId,
        device_prefix_pages: u32,
        mut pages: Vec<(BlockKey, Option<ClaimId>)>,
    ) -> Vec<ClaimId> {
        let run = pages.iter().take_while(|(_, c)| c.is_some()).count();
        let mut release: Vec<ClaimId> = pages
            .iter_mut()
            .skip(run)
            .filter_map(|(_, c)| c.take())
            .collect();
        let produced: Vec<ClaimId> = pages.iter().filter_map(|(_, c)| *c).collect();
        let Ok(landing) = self.attempts.land(transfer, produced) else {
            return release;
        };
        release.extend(landing.release);
        let Some((owner, prep)) = self.preps.get_mut(&attempt.request) else {
            return release;
        };
        if owner != attempt || !matches!(prep, Prep::Fetching) {
            return release;
        }
        let presence = PoolPresence {
            kind: PoolKind::Full,
            present: pages.iter().map(|(_, c)| c.is_some()).collect(),
        };
        let lengths = RestorableLengths::from_pools(&[presence]).unwrap_or_default();
        *prep = Prep::Ready(Preparation::new(device_prefix_pages, pages, lengths));
        release
    }

    /// Where the live `attempt`'s preparation stands.
    pub fn state(&self, attempt: &AttemptId) -> Result<PreparationState> {
        self.attempts.check_live(attempt)?;
        Ok(match self.preps.get(&attempt.request) {
            Some((_, Prep::Fetching)) => PreparationState::Fetching,
            Some((_, Prep::Ready(_))) => PreparationState::Ready,
            Some((_, Prep::Loaded)) => PreparationState::Loaded,
            Some((_, Prep::Retired(reason))) => PreparationState::Retired(*reason),
            None => PreparationState::Retired(RetireReason::Released),
        })
    }

    /// A lookup of the live `attempt` (see [`Preparation::lookup`]): the
    /// lengths this rank can restore, and the claims to release (pages the
    /// device prefix grew over, or all of them when the preparation retires).
    pub fn lookup(
        &mut self,
        attempt: &AttemptId,
        device_prefix_pages: u32,
        tail: &[BlockKey],
    ) -> Result<(RestorableLengths, Vec<ClaimId>)> {
        self.attempts.check_live(attempt)?;
        let Some((_, prep)) = self.preps.get_mut(&attempt.request) else {
            return Ok((RestorableLengths::none(), Vec::new()));
        };
        let Prep::Ready(preparation) = prep else {
            return Ok((RestorableLengths::none(), Vec::new()));
        };
        let (lengths, released) = match preparation.lookup(device_prefix_pages, tail) {
            Advance::Current {
                lengths, released, ..
            } => (lengths, released),
            Advance::Retired { reason, released } => {
                *prep = Prep::Retired(reason);
                (RestorableLengths::none(), released)
            }
        };
        for claim in &released {
            self.attempts.release(attempt, *claim)?;
        }
        Ok((lengths, released))
    }

    /// Whether the live `attempt` may queue a load: refused while it has one
    /// in flight (one load per attempt).
    pub fn check_can_load(&self, attempt: &AttemptId) -> Result<()> {
        self.attempts.check_live(attempt)?;
        if self.loads.values().any(|a| a == attempt) {
            return Err(Error::DuplicateLoad {
                attempt: attempt.clone(),
            });
        }
        Ok(())
    }

    /// The claims a load of the first `pages` prepared pages of the live
    /// `attempt` would consume, in page order; changes nothing. Refused
    /// unless every page is claimed.
    pub fn load_claims(&self, attempt: &AttemptId, pages: usize) -> Result<Vec<ClaimId>> {
        self.check_can_load(attempt)?;
        let missing = |page| Error::LoadWithoutClaim {
            attempt: attempt.clone(),
            page,
        };
        let Some((_, Prep::Ready(preparation))) = self.preps.get(&attempt.request) else {
            return Err(missing(0));
        };
        if pages == 0 {
            return Err(missing(0));
        }
        match preparation.load_claims(pages) {
            LoadClaims::Ready(claims) => Ok(claims),
            LoadClaims::Missing { page } => Err(missing(page)),
        }
    }

    /// Accepts the load of `claims` (from [`Self::load_claims`]) for the live
    /// `attempt`: the transfer carries them, and the rest of the preparation
    /// is spent. Returns the transfer and the unloaded pages' claims to
    /// release.
    pub fn accept_load(
        &mut self,
        attempt: &AttemptId,
        claims: &[ClaimId],
    ) -> Result<(TransferId, Vec<ClaimId>)> {
        let transfer = self.attempts.accept(attempt, claims.to_vec())?;
        self.loads.insert(transfer, attempt.clone());
        let mut unused = Vec::new();
        if let Some((_, prep)) = self.preps.get_mut(&attempt.request)
            && let Prep::Ready(preparation) = std::mem::replace(prep, Prep::Loaded)
        {
            unused = preparation
                .into_claims()
                .into_iter()
                .filter(|c| !claims.contains(c))
                .collect();
        }
        for claim in &unused {
            self.attempts.release(attempt, *claim)?;
        }
        Ok((transfer, unused))
    }

    /// A load transfer landed (or was never queued): returns the claims it
    /// carried, for release.
    pub fn land_load(&mut self, transfer: TransferId) -> Vec<ClaimId> {
        self.loads.remove(&transfer);
        self.attempts
            .land(transfer, Vec::new())
            .map(|landing| landing.release)
            .unwrap_or_default()
    }

    /// Ends the live `attempt` (finished or aborted): its preparation goes,
    /// and its claims are returned for release. Its transfers stay in flight.
    pub fn end(&mut self, attempt: &AttemptId) -> Result<Vec<ClaimId>> {
        let released = self.attempts.end(attempt)?;
        // The attempt was live, so the preparation is its own.
        self.preps.remove(&attempt.request);
        Ok(released)
    }

    /// Forgets every attempt (refused while transfers are in flight) and
    /// returns their claims for release.
    pub fn reset(&mut self) -> Result<Vec<ClaimId>> {
        let released = self.attempts.reset()?;
        self.preps.clear();
        Ok(released)
    }
}
