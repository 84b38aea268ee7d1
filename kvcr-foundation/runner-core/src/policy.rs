//! Cache policies: admission and eviction.
//!
//! The runner asks its policy whether to keep a newly deposited page, in which
//! order to consider pages for eviction, and whether a candidate may go. The
//! built-in [`Lru`] (the default) and [`Fifo`] declare an order the core keeps
//! in O(1) with an intrusive list; a user policy returns scores (lower goes
//! first) and the core keeps a sorted set.
//!
//! Every call into a policy is sanitised, as the reference runtime does: a
//! panic gives the safe default (keep on ingest, keep on eviction, previous
//! score), a `Drop` at ingest when the caller required the page locally becomes
//! `Keep`, and a score that is not finite keeps the previous score.

use std::panic::{AssertUnwindSafe, catch_unwind};

use kvcr_contracts::key::ScopedKey;

/// What a policy sees of a page.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockMeta {
    /// The page.
    pub key: ScopedKey,
    /// Bytes across all its spans.
    pub size_bytes: u64,
    /// Times it was claimed or delivered.
    pub access_count: u32,
    /// Runner time (ns) of the last access or commit.
    pub last_access_ns: u64,
    /// Insertion order (monotonic per runner).
    pub inserted_seq: u64,
}

/// Admission answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestDecision {
    /// Store it.
    Keep,
    /// Do not store it (the deposit entry reports `Dropped`).
    Drop,
}

/// Eviction answer for one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionDecision {
    /// Spare it this time.
    Keep,
    /// Evict it.
    Drop,
    /// Move it to the file tier (G3): the DRAM copy leaves once G3 holds the
    /// bytes. Without G3, for a page G3 cannot hold (more than one span, or
    /// larger than a G3 slot), or after a spill of it failed, this is `Drop`.
    MoveToG3,
}

/// How a policy orders eviction candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionOrder {
    /// Least recently accessed first (O(1) list).
    LeastRecentlyUsed,
    /// Oldest insertion first (O(1) list).
    Insertion,
    /// By [`CachePolicy::eviction_score`], lowest first; ties by insertion.
    Scored,
}

/// A cache policy. Called on the runner's thread; must be cheap.
pub trait CachePolicy: Send {
    /// A short name for stats and logs.
    fn name(&self) -> &str;

    /// The candidate order this policy wants.
    fn order(&self) -> EvictionOrder;

    /// Admission. `required_local` is true when the caller asked the page to be
    /// kept (a `no_evict` deposit); a `Drop` is then overridden.
    fn decide_ingest(&mut self, meta: &BlockMeta, required_local: bool) -> IngestDecision {
        let _ = (meta, required_local);
        IngestDecision::Keep
    }

    /// Score for [`EvictionOrder::Scored`] (lower is evicted first). `None`
    /// leaves the page unscored; it is retried when space is needed.
    fn eviction_score(&mut self, meta: &BlockMeta) -> Option<f64> {
        let _ = meta;
        Some(0.0)
    }

    /// Whether a candidate may be evicted now.
    fn decide_eviction(&mut self, meta: &BlockMeta) -> EvictionDecision {
        let _ = meta;
        EvictionDecision::Drop
    }
}

/// Least recently used (the default).
#[derive(Debug, Default, Clone, Copy)]
pub struct Lru;

impl CachePolicy for Lru {
    fn name(&self) -> &str {
        "lru"
    }
    fn order(&self) -> EvictionOrder {
        EvictionOrder::LeastRecentlyUsed
    }
}

/// First in, first out.
#[derive(Debug, Default, Clone, Copy)]
pub struct Fifo;

impl CachePolicy for Fifo {
    fn name(&self) -> &str {
        "fifo"
    }
    fn order(&self) -> EvictionOrder {
        EvictionOrder::Insertion
    }
}

/// Least recently used, moving victims to G3 (the default when G3 is configured).
#[derive(Debug, Default, Clone, Copy)]
pub struct G3Lru;

impl CachePolicy for G3Lru {
    fn name(&self) -> &str {
        "g3-lru"
    }
    fn order(&self) -> EvictionOrder {
        EvictionOrder::LeastRecentlyUsed
    }
    fn decide_eviction(&mut self, _meta: &BlockMeta) -> EvictionDecision {
        EvictionDecision::MoveToG3
    }
}

/// First in, first out, moving victims to G3.
#[derive(Debug, Default, Clone, Copy)]
pub struct G3Fifo;

impl CachePolicy for G3Fifo {
    fn name(&self) -> &str {
        "g3-fifo"
    }
    fn order(&self) -> EvictionOrder {
        EvictionOrder::Insertion
    }
    fn decide_eviction(&mut self, _meta: &BlockMeta) -> EvictionDecision {
        EvictionDecision::MoveToG3
    }
}

/// Looks a built-in policy up by name (`lru`, `fifo`, `g3-lru`, `g3-fifo`);
/// unknown names give `None`.
pub fn builtin(name: &str) -> Option<Box<dyn CachePolicy>> {
    match name {
        "lru" => Some(Box::new(Lru)),
        "fifo" => Some(Box::new(Fifo)),
        "g3-lru" => Some(Box::new(G3Lru)),
        "g3-fifo" => Some(Box::new(G3Fifo)),
        _ => None,
    }
}

/// Wraps a policy and sanitises every call; counts the faults it absorbed.
pub(crate) struct SanitizedPolicy {
    inner: Box<dyn CachePolicy>,
    order: EvictionOrder,
    pub(crate) faults: u64,
}

impl SanitizedPolicy {
    pub(crate) fn new(inner: Box<dyn CachePolicy>) -> Self {
        let order = catch_unwind(AssertUnwindSafe(|| inner.order()))
            .unwrap_or(EvictionOrder::LeastRecentlyUsed);
        Self {
            inner,
            order,
            faults: 0,
        }
    }

    pub(crate) fn order(&self) -> EvictionOrder {
        self.order
    }

    pub(crate) fn name(&self) -> String {
        catch_unwind(AssertUnwindSafe(|| self.inner.name().to_owned()))
            .unwrap_or_else(|_| "?".to_owned())
    }

    pub(crate) fn decide_ingest(
        &mut self,
        meta: &BlockMeta,
        required_local: bool,
    ) -> IngestDecision {
        let inner = &mut self.inner;
        match catch_unwind(AssertUnwindSafe(|| {
            inner.decide_ingest(meta, required_local)
        })) {
            Ok(IngestDecision::Drop) if required_local => IngestDecision::Keep,
            Ok(decision) => decision,
            Err(_) => {
                self.faults += 1;
                IngestDecision::Keep
            }
        }
    }

    /// `Ok(None)`: unscored; `Err(())`: keep the previous score.
    pub(crate) fn eviction_score(&mut self, meta: &BlockMeta) -> Result<Option<f64>, ()> {
        let inner = &mut self.inner;
        match catch_unwind(AssertUnwindSafe(|| inner.eviction_score(meta))) {
            Ok(Some(score)) if score.is_finite() => Ok(Some(score)),
            Ok(Some(_)) => {
                self.faults += 1;
                Err(())
            }
            Ok(None) => Ok(None),
            Err(_) => {
                self.faults += 1;
                Err(())
            }
        }
    }

    pub(crate) fn decide_eviction(&mut self, meta: &BlockMeta) -> EvictionDecision {
        let inner = &mut self.inner;
        match catch_unwind(AssertUnwindSafe(|| inner.decide_eviction(meta))) {
            Ok(decision) => decision,
            Err(_) => {
                self.faults += 1;
                EvictionDecision::Keep
            }
        }
    }
}

impl std::fmt::Debug for SanitizedPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SanitizedPolicy")
            .field("order", &self.order)
            .field("faults", &self.faults)
            .finish()
    }
}
