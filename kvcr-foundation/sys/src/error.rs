//! The crate's one error type.

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
    /// A NUMA binding names no node.
    #[error("a NUMA binding needs at least one node")]
    NoNodes,
    /// `Preferred` takes exactly one node.
    #[error("a preferred NUMA policy takes exactly one node")]
    PreferredNeedsOneNode,
    /// A NUMA binding names a node that is not online.
    #[error("NUMA node {node} does not exist (online: {online:?})")]
    NoSuchNode {
        /// The node asked for.
        node: u16,
        /// The online nodes.
        online: Vec<u16>,
    },
    /// Huge pages were required and cannot be had.
    #[error("huge pages required but unavailable: {0}")]
    HugePagesUnavailable(&'static str),
    /// The kernel refused a call.
    #[error("{call} refused (errno {errno})")]
    Os {
        /// The call.
        call: &'static str,
        /// Its errno.
        errno: i32,
    },
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
        Self::Os {
            call,
            errno: last_errno(),
        }
    }
}

/// The calling thread's `errno` after a failed call (0 when none).
pub(crate) fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}
