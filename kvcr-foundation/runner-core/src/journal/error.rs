//! How the journal fails: why it is disabled, why a record is refused, and
//! its one error enum.

use super::layout::{CODE_OVERFLOW, CODE_REQUESTED};

/// Why a journal is disabled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DisabledReason {
    /// The live state and one record did not fit in a half.
    #[error("the live state outgrew the journal")]
    Overflow,
    /// The runner turned the journal off.
    #[error("turned off by the runner")]
    Requested,
    /// A state code this version does not know (only read, never written as
    /// such: writing it writes its code, or `u32::MAX` for a code that is 0 or
    /// a known one).
    #[error("unknown reason code {0}")]
    Unknown(u32),
}

impl DisabledReason {
    pub(super) fn code(self) -> u32 {
        match self {
            Self::Overflow => CODE_OVERFLOW,
            Self::Requested => CODE_REQUESTED,
            Self::Unknown(code) if code > CODE_REQUESTED => code,
            Self::Unknown(_) => u32::MAX,
        }
    }

    pub(super) fn from_code(code: u32) -> Self {
        match code {
            CODE_OVERFLOW => Self::Overflow,
            CODE_REQUESTED => Self::Requested,
            other => Self::Unknown(other),
        }
    }
}

/// Why a record does not follow the journal's state (the writer refuses it
/// and leaves the region unchanged; the reader calls it corrupt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// A page names a namespace never registered.
    #[error("namespace {0:#018x} is not registered")]
    UnknownNamespace(u64),
    /// A namespace id is registered already with other values.
    #[error("namespace {0:#018x} is registered with other values")]
    NamespaceConflict(u64),
    /// A Ready names a page that is live already.
    #[error("page {key:#018x} of namespace {namespace:#018x} is live already")]
    PageLive {
        /// Its namespace.
        namespace: u64,
        /// Its key.
        key: u64,
    },
    /// A Removed names a page that is not live.
    #[error("page {key:#018x} of namespace {namespace:#018x} is not live")]
    PageNotLive {
        /// Its namespace.
        namespace: u64,
        /// Its key.
        key: u64,
    },
    /// A Ready or Held names a slot a live page owns or a hold keeps.
    #[error("slot {0} belongs to a live page or is held")]
    SlotInUse(u32),
    /// A Freed names a slot that is not held.
    #[error("slot {0} is not held")]
    SlotNotHeld(u32),
    /// A record names a slot twice.
    #[error("slot {0} appears twice in one record")]
    DuplicateSlot(u32),
    /// A Ready, Held or Freed names no slot.
    #[error("a record needs at least one slot")]
    NoSlots,
    /// A list or string is over its cap.
    #[error("{what}: {len} over the cap of {max}")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The cap.
        max: usize,
    },
}

impl Refusal {
    /// The refusal as a fixed phrase (for [`JournalError::Corrupt`]).
    pub(super) fn why(self) -> &'static str {
        match self {
            Self::UnknownNamespace(_) => "a page names an unknown namespace",
            Self::NamespaceConflict(_) => "a namespace is registered twice with other values",
            Self::PageLive { .. } => "a Ready names a page that is live already",
            Self::PageNotLive { .. } => "a Removed names a page that is not live",
            Self::SlotInUse(_) => "a slot is owned by a live page or held",
            Self::SlotNotHeld(_) => "a Freed names a slot that is not held",
            Self::DuplicateSlot(_) => "a record names a slot twice",
            Self::NoSlots => "a record names no slot",
            Self::TooLong { .. } => "a list or string is over its cap",
        }
    }
}

/// Everything the journal can fail at.
///
/// Its own enum, not a variant of the crate's [`crate::Error`]: the runner
/// maps that one exhaustively, and a journal failure is never a refused
/// runner call (the runner degrades to serving without warm recovery).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// The region is too small for a journal.
    #[error("a journal needs at least {min} bytes, the region has {len}")]
    RegionTooSmall {
        /// The region's length.
        len: usize,
        /// The least accepted.
        min: usize,
    },
    /// A writer was handed a region of another length than it formatted.
    #[error("the region has {got} bytes, the journal was formatted for {expected}")]
    RegionLength {
        /// The region's length.
        got: usize,
        /// The formatted length.
        expected: usize,
    },
    /// The journal is disabled: appends are no-ops and a restart is cold.
    #[error("journal disabled: {0}")]
    Disabled(DisabledReason),
    /// The writer refused a record that does not follow its state; the region
    /// is unchanged.
    #[error("record refused: {0}")]
    Refused(Refusal),
    /// The bytes are not a journal this version can trust.
    #[error("corrupt journal at byte {offset}: {why}")]
    Corrupt {
        /// Byte offset in the region.
        offset: u64,
        /// What is wrong.
        why: &'static str,
    },
}

pub(super) fn corrupt(offset: usize, why: &'static str) -> JournalError {
    JournalError::Corrupt {
        offset: u64::try_from(offset).unwrap_or(u64::MAX),
        why,
    }
}
