//! The binding's one error type.

use crate::status::{UcsStatus, UcxReason};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A UCX call failed, or the safe layer refused a request before calling UCX.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A UCX routine returned an error status.
    #[error("UCX {op}: {status}")]
    Call {
        /// The UCX routine (or safe-layer operation) that failed.
        op: &'static str,
        /// The status it returned.
        status: UcsStatus,
    },
    /// The safe layer refused a request before calling UCX, or a wait on UCX
    /// ended without a status.
    #[error("UCX {op}: {reason}")]
    Refused {
        /// The safe-layer operation.
        op: &'static str,
        /// Why it was refused.
        reason: UcxReason,
    },
}

impl Error {
    /// The UCX status, when a UCX call failed.
    pub fn status(&self) -> Option<UcsStatus> {
        match self {
            Self::Call { status, .. } => Some(*status),
            Self::Refused { .. } => None,
        }
    }

    /// The refusal reason, when the safe layer refused a request.
    pub fn reason(&self) -> Option<&UcxReason> {
        match self {
            Self::Refused { reason, .. } => Some(reason),
            Self::Call { .. } => None,
        }
    }
}
