//! Attempt ownership: which attempt of a request holds which claims, and which
//! accepted transfers are still in flight.
//!
//! Attempt ids are minted by the foundation's [`AttemptLedger`]
//! (see [`crate::RequestContext::begin`]); their generations only grow, so a
//! table can tell a newer attempt of a reused request id from a stale one
//! without sharing the ledger.
//!
//! The rules an [`AttemptTable`] enforces:
//!
//! * A newer attempt of a request **supersedes** the live one at once: the old
//!   attempt's claims come back for release, and admission of the new one never
//!   waits on the old.
//! * Ending an attempt (finish or abort) releases its claims but **never
//!   revokes an accepted transfer**: the transfer stays in flight until it
//!   lands, and what it lands is cleaned up then.
//! * A transfer that lands for an attempt that is no longer live hands its
//!   claims back for release at once; it can never add claims to the attempt
//!   that replaced it.
//!
//! [`AttemptLedger`]: kvcr_contracts::AttemptLedger

use std::collections::{BTreeMap, BTreeSet};

use kvcr_contracts::{AttemptId, RequestId};

use crate::error::{Error, Result};

#[cfg(test)]
mod tests;

/// A claim on one staged page, issued by the store that staged it. While held,
/// the page is never evicted and its slot never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimId(pub u64);

/// A transfer (a fetch into staging, a load into device pages) the table
/// accepted on behalf of an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(u64);

impl TransferId {
    /// The raw id (unique within one table).
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// What a superseded attempt gave up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superseded {
    /// The attempt that is no longer live.
    pub attempt: AttemptId,
    /// Its claims; the caller releases them in its store now.
    pub released: Vec<ClaimId>,
}

/// What a landed transfer means for claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Landing {
    /// The attempt the transfer was accepted for.
    pub attempt: AttemptId,
    /// Claims the transfer produced that its (still live) attempt now holds.
    pub kept: Vec<ClaimId>,
    /// Claims the caller must release now: the ones the transfer carried (it
    /// consumed them) and, when its attempt is no longer live, the ones it
    /// produced.
    pub release: Vec<ClaimId>,
}

#[derive(Debug)]
struct Live {
    generation: u64,
    claims: BTreeSet<ClaimId>,
}

#[derive(Debug)]
struct InFlight {
    attempt: AttemptId,
    carried: Vec<ClaimId>,
}

/// Live attempts, their claims, and the transfers accepted for them.
#[derive(Debug, Default)]
pub struct AttemptTable {
    live: BTreeMap<RequestId, Live>,
    in_flight: BTreeMap<TransferId, InFlight>,
    next_transfer: u64,
}

impl AttemptTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `attempt` the live attempt of its request. A live older attempt is
    /// superseded and its claims returned; an attempt not newer than the live
    /// one is refused.
    pub fn begin(&mut self, attempt: &AttemptId) -> Result<Option<Superseded>> {
        if let Some(live) = self.live.get(&attempt.request)
            && live.generation >= attempt.generation
        {
            return Err(Error::AttemptOutOfOrder {
                attempt: attempt.clone(),
                current_generation: live.generation,
            });
        }
        let previous = self.live.insert(
            attempt.request.clone(),
            Live {
                generation: attempt.generation,
                claims: BTreeSet::new(),
            },
        );
        Ok(previous.map(|old| Superseded {
            attempt: AttemptId {
                request: attempt.request.clone(),
                generation: old.generation,
            },
            released: old.claims.into_iter().collect(),
        }))
    }

    /// Whether `attempt` is the live attempt of its request.
    pub fn is_live(&self, attempt: &AttemptId) -> bool {
        self.live
            .get(&attempt.request)
            .is_some_and(|live| live.generation == attempt.generation)
    }

    /// `Ok` when `attempt` is live; otherwise why not.
    pub fn check_live(&self, attempt: &AttemptId) -> Result<()> {
        match self.live.get(&attempt.request) {
            Some(live) if live.generation == attempt.generation => Ok(()),
            Some(live) => Err(Error::Superseded {
                attempt: attempt.clone(),
                current_generation: live.generation,
            }),
            None => Err(Error::NoLiveAttempt {
                attempt: attempt.clone(),
            }),
        }
    }

    /// Whether the live `attempt` holds `claim`.
    pub fn holds(&self, attempt: &AttemptId, claim: ClaimId) -> bool {
        self.live.get(&attempt.request).is_some_and(|live| {
            live.generation == attempt.generation && live.claims.contains(&claim)
        })
    }

    /// Accepts a transfer for the live `attempt`. `carried` claims (a load's
    /// pages) move from the attempt to the transfer and are released when it
    /// lands; all of them must be held, or nothing changes.
    pub fn accept(&mut self, attempt: &AttemptId, carried: Vec<ClaimId>) -> Result<TransferId> {
        self.check_live(attempt)?;
        let live = self.live_mut(attempt)?;
        let mut seen = BTreeSet::new();
        for claim in &carried {
            if !live.claims.contains(claim) || !seen.insert(*claim) {
                return Err(Error::ClaimNotHeld {
                    attempt: attempt.clone(),
                    claim: *claim,
                });
            }
        }
        for claim in &carried {
            live.claims.remove(claim);
        }
        self.next_transfer += 1;
        let id = TransferId(self.next_transfer);
        self.in_flight.insert(
            id,
            InFlight {
                attempt: attempt.clone(),
                carried,
            },
        );
        Ok(id)
    }

    /// A transfer landed, producing `produced` claims (a fetch's staged pages;
    /// none for a load). Works whether or not its attempt is still live.
    pub fn land(&mut self, transfer: TransferId, produced: Vec<ClaimId>) -> Result<Landing> {
        let flight = self
            .in_flight
            .remove(&transfer)
            .ok_or(Error::UnknownTransfer { transfer })?;
        let mut release = flight.carried;
        let mut kept = Vec::new();
        match self.live.get_mut(&flight.attempt.request) {
            Some(live) if live.generation == flight.attempt.generation => {
                for claim in produced {
                    if live.claims.insert(claim) {
                        kept.push(claim);
                    }
                }
            }
            // Superseded or ended: whatever it staged is nobody's.
            _ => release.extend(produced),
        }
        Ok(Landing {
            attempt: flight.attempt,
            kept,
            release,
        })
    }

    /// Releases one claim of the live `attempt` (a page the device now holds).
    pub fn release(&mut self, attempt: &AttemptId, claim: ClaimId) -> Result<()> {
        let live = self.live_mut(attempt)?;
        if live.claims.remove(&claim) {
            Ok(())
        } else {
            Err(Error::ClaimNotHeld {
                attempt: attempt.clone(),
                claim,
            })
        }
    }

    /// Ends the live `attempt` (finish or abort) and returns its claims for
    /// release. Its transfers stay in flight until they land.
    pub fn end(&mut self, attempt: &AttemptId) -> Result<Vec<ClaimId>> {
        self.check_live(attempt)?;
        Ok(self
            .live
            .remove(&attempt.request)
            .map(|live| live.claims.into_iter().collect())
            .unwrap_or_default())
    }

    /// Forgets every attempt and returns their claims, but only once nothing
    /// is in flight (an accepted transfer may still touch its memory).
    pub fn reset(&mut self) -> Result<Vec<ClaimId>> {
        if !self.in_flight.is_empty() {
            return Err(Error::TransfersInFlight {
                in_flight: self.in_flight.len(),
            });
        }
        let live = std::mem::take(&mut self.live);
        Ok(live.into_values().flat_map(|live| live.claims).collect())
    }

    /// Claims held by live attempts plus those carried by transfers in flight.
    pub fn claims_held(&self) -> usize {
        self.live
            .values()
            .map(|live| live.claims.len())
            .sum::<usize>()
            + self
                .in_flight
                .values()
                .map(|f| f.carried.len())
                .sum::<usize>()
    }

    /// Claims held by the live `attempt` (zero if it is not live).
    pub fn claims_of(&self, attempt: &AttemptId) -> Vec<ClaimId> {
        match self.live.get(&attempt.request) {
            Some(live) if live.generation == attempt.generation => {
                live.claims.iter().copied().collect()
            }
            _ => Vec::new(),
        }
    }

    /// Transfers accepted and not yet landed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Transfers of `attempt` not yet landed (live or not).
    pub fn in_flight_of(&self, attempt: &AttemptId) -> usize {
        self.in_flight
            .values()
            .filter(|f| f.attempt == *attempt)
            .count()
    }

    /// Number of live attempts.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    fn live_mut(&mut self, attempt: &AttemptId) -> Result<&mut Live> {
        self.check_live(attempt)?;
        self.live
            .get_mut(&attempt.request)
            .ok_or_else(|| Error::NoLiveAttempt {
                attempt: attempt.clone(),
            })
    }
}
