//! The runner core's one error type.
//!
//! The core refuses a call (a bad configuration, region, layout or handle, or a
//! lifecycle step that is not safe yet) with a [`RunnerReason`] and leaves its
//! state unchanged. The runner crate (`kvcr-runner`) flattens this into its own
//! error, which adds what only a driver can fail at (UCX, startup).

pub use kvcr_contracts::error::{Echo, PoolMemoryReason};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the core can refuse.
///
/// Exhaustive on purpose: the runner maps every variant into its own error,
/// so a new one must be handled there (the reasons stay `non_exhaustive`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A contract value (endpoint, key, frame, ...) was refused.
    #[error(transparent)]
    Contract(#[from] kvcr_contracts::Error),
    /// The runner refused a call. The runner is unchanged.
    #[error("runner: {reason}")]
    Runner {
        /// Why.
        reason: RunnerReason,
    },
}

impl Error {
    /// A runner error.
    pub fn runner(reason: RunnerReason) -> Self {
        Self::Runner { reason }
    }

    /// The runner reason, when this is a runner error.
    pub fn runner_reason(&self) -> Option<&RunnerReason> {
        match self {
            Self::Runner { reason } => Some(reason),
            Self::Contract(_) => None,
        }
    }
}

/// Why the runner refused a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerReason {
    /// A configuration value is out of bounds.
    #[error("invalid configuration: {field}: {why}")]
    Config {
        /// Which field.
        field: &'static str,
        /// What is wrong.
        why: &'static str,
    },
    /// Two pools share a name.
    #[error("pool {0} configured twice")]
    DuplicatePool(Echo),
    /// A region descriptor is malformed.
    #[error("region {label}: {why}")]
    Region {
        /// The region's label.
        label: Echo,
        /// What is wrong.
        why: &'static str,
    },
    /// A region's label names no configured pool.
    #[error("region {0}: no pool of that name (labels are `pool` or `pool:part`)")]
    RegionPool(Echo),
    /// A region's element size differs from its pool's block size.
    #[error("region {label}: element size {size} differs from the pool's block size {block}")]
    RegionSize {
        /// The region's label.
        label: Echo,
        /// Its element size.
        size: u64,
        /// The pool's block size.
        block: u64,
    },
    /// A region overlaps one already registered.
    #[error("region {label} overlaps region {other}")]
    RegionOverlap {
        /// The new region.
        label: Echo,
        /// The registered one.
        other: Echo,
    },
    /// A label is registered already.
    #[error("region {0} is registered already")]
    DuplicateRegion(Echo),
    /// A reference names no registered region.
    #[error("no region with id {0}")]
    UnknownRegion(u32),
    /// A reference's element index is outside its region.
    #[error("element {index} is outside region {region} ({count} elements)")]
    ElementOutOfRange {
        /// Region id.
        region: u32,
        /// Index given.
        index: u64,
        /// Elements in the region.
        count: u64,
    },
    /// A reference names a runner-owned region where framework memory is required.
    #[error("region {0} is runner-owned; callers may only name framework regions here")]
    NotFrameworkRegion(u32),
    /// One call named both host and device framework memory.
    #[error("one call must name only host or only device memory, not both")]
    MixedMemory,
    /// A device region was registered before a device copier was set.
    #[error("device memory needs a device copier (set one before registering device regions)")]
    NoDeviceCopier,
    /// A second device copier was offered.
    #[error("a device copier is already set")]
    DeviceCopierSet,
    /// A key has no spans, or more than the layout bound.
    #[error("a key needs 1..={max} spans, got {got}")]
    LayoutLength {
        /// Spans given.
        got: usize,
        /// Bound.
        max: usize,
    },
    /// Keys of one call disagree on their layout, or a destination's layout
    /// differs from the stored one.
    #[error("span layout does not match")]
    LayoutMismatch,
    /// A namespace id was never registered.
    #[error("namespace {0:#018x} is not registered")]
    UnknownNamespace(u64),
    /// The operation handle is unknown (never issued or already completed).
    #[error("unknown operation handle {0}")]
    UnknownOperation(u64),
    /// The pool allocation failed.
    #[error("could not allocate {bytes} bytes of KVCR DRAM")]
    Allocation {
        /// Bytes asked for.
        bytes: u64,
    },
    /// The pool memory placement asked for cannot be had.
    #[error("pool memory: {0}")]
    PoolMemory(PoolMemoryReason),
    /// Close refused: copies are still in flight.
    #[error("{0} copies still in flight; poll and retry")]
    Busy(usize),
    /// Close refused: public claims are still held.
    #[error("{0} claims still held; release them first")]
    ClaimsOutstanding(usize),
    /// The copy engine thread is gone.
    #[error("the copy engine stopped")]
    CopyEngineStopped,
    /// The device copier failed (attaching the pools or copying).
    #[error("device copy failed: {0}")]
    DeviceCopy(Echo),
    /// A copy out of claimed KVCR DRAM (`Runner::copy_claimed`) was refused.
    #[error("copy out of claimed pages refused: {0}")]
    ClaimedCopy(&'static str),
    /// A slot read named a handle that is not a live claim.
    #[error("release handle {0} is not a live claim")]
    UnknownClaim(u64),
}
