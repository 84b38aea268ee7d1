//! Rank agreement: the collective the engine lends the backend.
//!
//! Every decision that changes what the engine's tree or the router believes
//! must be identical on every tensor-parallel rank: hit counts are
//! MIN-reduced, per-page results are MIN-reduced (a page counts only if every
//! rank has it), and evictions are gathered so every rank retires the same
//! published pages. The engine implements [`RankGroup`] over its own
//! collective (a gloo group per controller thread in SGLang);
//! [`LocalRankGroup`] is an in-process implementation with threads as ranks.
//!
//! Rule the entry points follow: **every call performs the same collectives
//! on every rank, in the same order, whatever happened locally** (a local
//! fault contributes a miss, it never skips the collective), so one rank's
//! error cannot leave another rank waiting or shift later rounds.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::GroupError;

/// The engine's collective over the ranks that share one model replica's KV
/// (TP × CP ranks of one DP group). Calls on one group object must come from
/// one thread at a time, in the same order on every rank.
pub trait RankGroup: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> u32;
    /// Number of ranks.
    fn size(&self) -> u32;
    /// Element-wise minimum across ranks, in place. Every rank passes a
    /// slice of the same length.
    fn all_reduce_min(&self, values: &mut [u64]) -> Result<(), GroupError>;
    /// Every rank's list, in rank order (lists may differ in length).
    fn all_gather(&self, local: &[u64]) -> Result<Vec<Vec<u64>>, GroupError>;
}

/// The group of a single rank: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SoloGroup;

impl RankGroup for SoloGroup {
    fn rank(&self) -> u32 {
        0
    }

    fn size(&self) -> u32 {
        1
    }

    fn all_reduce_min(&self, _values: &mut [u64]) -> Result<(), GroupError> {
        Ok(())
    }

    fn all_gather(&self, local: &[u64]) -> Result<Vec<Vec<u64>>, GroupError> {
        Ok(vec![local.to_vec()])
    }
}

/// The two groups a backend uses: SGLang's controller runs prefetch
/// (`batch_exists`, `batch_get`) and backup (`batch_set`) on separate threads
/// with separate collective groups, so their rounds never interleave.
#[derive(Clone)]
pub struct RankGroups {
    /// Used by `batch_exists` and `batch_get`.
    pub prefetch: Arc<dyn RankGroup>,
    /// Used by `batch_set` and `sync_inventory`.
    pub backup: Arc<dyn RankGroup>,
}

impl RankGroups {
    /// A single rank.
    pub fn solo() -> Self {
        Self {
            prefetch: Arc::new(SoloGroup),
            backup: Arc::new(SoloGroup),
        }
    }

    /// One group for both (the caller serialises prefetch and backup calls).
    pub fn shared(group: Arc<dyn RankGroup>) -> Self {
        Self {
            prefetch: Arc::clone(&group),
            backup: group,
        }
    }
}

impl std::fmt::Debug for RankGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankGroups")
            .field("rank", &self.prefetch.rank())
            .field("size", &self.prefetch.size())
            .finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Min,
    Gather,
}

#[derive(Debug)]
struct Round {
    kind: Kind,
    contributions: Vec<Option<Vec<u64>>>,
    broken: Option<GroupError>,
    departed: u32,
}

#[derive(Debug, Default)]
struct Rendezvous {
    rounds: HashMap<u64, Round>,
}

#[derive(Debug)]
struct Hub {
    size: u32,
    timeout: Duration,
    state: Mutex<Rendezvous>,
    cv: Condvar,
}

/// An in-process [`RankGroup`]: threads as ranks. Round `k` of every rank
/// meets round `k` of the others; a round that does not fill within the
/// timeout fails on every rank that joined it (and on late arrivals).
#[derive(Debug)]
pub struct LocalRankGroup {
    hub: Arc<Hub>,
    rank: u32,
    next_round: Mutex<u64>,
}

impl LocalRankGroup {
    /// `size` connected group members, one per rank, in rank order.
    pub fn new(size: u32, timeout: Duration) -> Vec<Self> {
        let hub = Arc::new(Hub {
            size: size.max(1),
            timeout,
            state: Mutex::new(Rendezvous::default()),
            cv: Condvar::new(),
        });
        (0..size.max(1))
            .map(|rank| Self {
                hub: Arc::clone(&hub),
                rank,
                next_round: Mutex::new(0),
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Rendezvous> {
        self.hub
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn exchange(&self, kind: Kind, local: &[u64]) -> Result<Vec<Vec<u64>>, GroupError> {
        let round_id = {
            let mut next = self
                .next_round
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let id = *next;
            *next += 1;
            id
        };
        let size = self.hub.size as usize;
        let me = self.rank as usize;
        #[allow(clippy::disallowed_methods)] // a driver of real threads: its timeout is wall time
        let deadline = Instant::now() + self.hub.timeout;
        let mut state = self.lock();
        let round = state.rounds.entry(round_id).or_insert_with(|| Round {
            kind,
            contributions: vec![None; size],
            broken: None,
            departed: 0,
        });
        if round.kind != kind {
            round.broken = Some(GroupError::ShapeMismatch);
        }
        if let Some(slot) = round.contributions.get_mut(me) {
            *slot = Some(local.to_vec());
        }
        self.hub.cv.notify_all();
        let outcome = loop {
            let Some(round) = state.rounds.get_mut(&round_id) else {
                break Err(GroupError::ShapeMismatch);
            };
            if let Some(e) = &round.broken {
                break Err(e.clone());
            }
            if round.contributions.iter().all(Option::is_some) {
                let all: Vec<Vec<u64>> = round
                    .contributions
                    .iter()
                    .map(|c| c.clone().unwrap_or_default())
                    .collect();
                break Ok(all);
            }
            #[allow(clippy::disallowed_methods)]
            let now = Instant::now();
            if now >= deadline {
                let e = GroupError::Timeout(self.hub.timeout.as_millis() as u64);
                round.broken = Some(e.clone());
                self.hub.cv.notify_all();
                break Err(e);
            }
            state = self
                .hub
                .cv
                .wait_timeout(state, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        };
        if let Some(round) = state.rounds.get_mut(&round_id) {
            round.departed += 1;
            if round.departed == self.hub.size {
                state.rounds.remove(&round_id);
            }
        }
        outcome
    }
}

impl RankGroup for LocalRankGroup {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.hub.size
    }

    fn all_reduce_min(&self, values: &mut [u64]) -> Result<(), GroupError> {
        let all = self.exchange(Kind::Min, values)?;
        if all.iter().any(|c| c.len() != values.len()) {
            return Err(GroupError::ShapeMismatch);
        }
        for (i, v) in values.iter_mut().enumerate() {
            *v = all
                .iter()
                .filter_map(|c| c.get(i).copied())
                .min()
                .unwrap_or(*v);
        }
        Ok(())
    }

    fn all_gather(&self, local: &[u64]) -> Result<Vec<Vec<u64>>, GroupError> {
        self.exchange(Kind::Gather, local)
    }
}

/// MIN-reduces one count (a hit count, a number of finished acks).
pub fn agree_min(group: &dyn RankGroup, local: u64) -> Result<u64, GroupError> {
    let mut v = [local];
    group.all_reduce_min(&mut v)?;
    Ok(v[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_and_gather_across_threads() {
        let groups = LocalRankGroup::new(3, Duration::from_secs(10));
        let out: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let r = u64::from(g.rank());
                        let mut v = [10 - r, r];
                        g.all_reduce_min(&mut v).unwrap();
                        let gathered = g.all_gather(&vec![r; r as usize]).unwrap();
                        (v, gathered)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (v, gathered) in out {
            assert_eq!(v, [8, 0]);
            assert_eq!(gathered, vec![vec![], vec![1], vec![2, 2]]);
        }
    }

    #[test]
    fn a_missing_rank_times_out_instead_of_hanging() {
        let groups = LocalRankGroup::new(2, Duration::from_millis(50));
        let mut v = [1];
        assert_eq!(
            groups[0].all_reduce_min(&mut v),
            Err(GroupError::Timeout(50))
        );
    }

    #[test]
    fn mismatched_lengths_are_refused_on_every_rank() {
        let groups = LocalRankGroup::new(2, Duration::from_secs(10));
        let out: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let mut v = vec![1; 1 + g.rank() as usize];
                        g.all_reduce_min(&mut v)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(out.iter().all(|r| *r == Err(GroupError::ShapeMismatch)));
    }
}
