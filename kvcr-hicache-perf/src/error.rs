//! The crate's one error type.

/// Errors of the performance controls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PerfError {
    /// A runner or contract error from the layers below.
    #[error(transparent)]
    Foundation(#[from] kvcr_foundation::runner::Error),
    /// The storage backend refused.
    #[error(transparent)]
    Storage(#[from] kvcr_hicache_storage::Error),
    /// A kernel call the audit makes failed.
    #[error("{call} failed (errno {errno})")]
    Os {
        /// The call.
        call: &'static str,
        /// Its errno.
        errno: i32,
    },
    /// A configuration value is out of bounds.
    #[error("invalid configuration: {field}: {why}")]
    Config {
        /// Which field.
        field: &'static str,
        /// What is wrong.
        why: &'static str,
    },
}

/// Result with [`PerfError`].
pub type Result<T> = std::result::Result<T, PerfError>;
