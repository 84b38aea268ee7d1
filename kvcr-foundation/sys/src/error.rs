//! The crate's one error type.

pub use kvcr_contracts::error::PoolMemoryReason;

/// Result alias of this crate.
pub type Result<T, E = SysError> = std::result::Result<T, E>;

/// Everything a system call or a checked copy of this crate can refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SysError {
    /// Memory of this size could not be had (zero, too large, or refused).
    #[error("cannot allocate {bytes} bytes")]
    Allocation {
        /// Bytes asked for.
        bytes: u64,
    },
    /// A pool's memory placement was refused, or the kernel refused a call
    /// (`Os`: the memory calls, and the process calls of [`crate::process`]).
    #[error(transparent)]
    PoolMemory(#[from] PoolMemoryReason),
    /// A file handed over (by a guard) is not what it must be.
    #[error("guard grant: {why}")]
    Grant {
        /// What is wrong with it.
        why: &'static str,
    },
    /// A copy names bytes outside every registered range (nothing copied).
    #[error("{len} bytes at {addr:#x} lie outside every registered range")]
    Unregistered {
        /// First byte.
        addr: u64,
        /// Bytes.
        len: u64,
    },
    /// A copy's source and destination overlap (nothing copied).
    #[error("a copy's source and destination overlap")]
    Overlap,
    /// A range to register overlaps one registered already.
    #[error("{len} bytes at {addr:#x} overlap a registered range")]
    AlreadyRegistered {
        /// First byte.
        addr: u64,
        /// Bytes.
        len: u64,
    },
}

impl SysError {
    /// `Os` for `call`, with the calling thread's `errno`.
    pub(crate) fn os(call: &'static str) -> Self {
        Self::os_errno(call, last_errno())
    }

    /// `Os` for `call`, refused with `errno`.
    pub(crate) fn os_errno(call: &'static str, errno: i32) -> Self {
        Self::PoolMemory(PoolMemoryReason::Os { call, errno })
    }
}

/// The calling thread's `errno` after a failed call (0 when none).
pub(crate) fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}
