//! The G3 tier's one error type: every variant names what failed (the path,
//! the slot, the direction) and keeps the OS `errno` where there is one.

use std::path::PathBuf;

/// Which way an I/O moved bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum G3Op {
    /// G3 slot → caller memory (a fill or a deliver).
    Read,
    /// Caller memory → G3 slot (a spill).
    Write,
}

impl std::fmt::Display for G3Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Read => "read",
            Self::Write => "write",
        })
    }
}

/// How a file left the store's path (see [`G3Error::FileGone`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum G3Gone {
    /// The file has no name left (`fstat` says `st_nlink == 0`): it was
    /// removed, or another file was renamed over it.
    Unlinked,
    /// The file still has a name, but the configured path now leads to
    /// another file, or to nothing (it was moved away).
    PathElsewhere,
}

/// Everything the G3 file tier can fail at.
///
/// Open-time variants ([`Config`](Self::Config) through
/// [`Start`](Self::Start)) refuse the whole [`G3Store::open`](super::G3Store::open)
/// (files opened before the failing one are closed again, which releases
/// their locks). I/O-time variants are per item: one failed slot never fails
/// another.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum G3Error {
    /// The options are unusable as a whole (no paths, a zero or uneven
    /// capacity, a zero slot size, a slot count that overflows).
    #[error("g3 configuration: {why}")]
    Config {
        /// Why.
        why: &'static str,
    },
    /// A configured path cannot be used: its parent directory does not
    /// resolve, it is not a regular file (a directory, a FIFO, a device), it
    /// is a symlink (never followed: `ELOOP`), or opening it failed (`errno`; `EINVAL` from the
    /// open means the filesystem refuses `O_DIRECT`).
    #[error("g3 path {}: {why}{}", path.display(), Errno(*errno))]
    Path {
        /// The path as configured.
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
        /// The OS error, when a call failed.
        errno: Option<i32>,
    },
    /// Two configured paths name the same file (after resolving their
    /// directories' symlinks, or by device and inode).
    #[error("g3 path {} is the same file as {}", path.display(), same_as.display())]
    Duplicate {
        /// The later path, as configured.
        path: PathBuf,
        /// The earlier path it aliases, as configured.
        same_as: PathBuf,
    },
    /// Another open file description holds the file's lock (another store,
    /// in this process or another: `flock(LOCK_EX | LOCK_NB)` said
    /// `EWOULDBLOCK`).
    #[error("g3 file {} is locked by another user", path.display())]
    Locked {
        /// The path, as configured.
        path: PathBuf,
    },
    /// The file has more than one name (`st_nlink > 1`): a hard link would
    /// let a second path reach the same bytes without the path check.
    #[error("g3 file {} has {links} hard links (only 1 allowed)", path.display())]
    HardLink {
        /// The path, as configured.
        path: PathBuf,
        /// Its link count.
        links: u64,
    },
    /// The directory that holds a configured file is not the runner's
    /// alone: owned by another user, or writable by group or others
    /// (sticky or not; the rule is `local_users`'s, in the module docs).
    #[error("g3 directory {}: {why}", path.display())]
    SharedDirectory {
        /// The directory (resolved).
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A configured file existed before the store opened it and is another
    /// user's: the runner never reads or writes pages through a file someone
    /// else owns (they could read and rewrite them).
    #[error("g3 file {} belongs to uid {owner}, not to this process", path.display())]
    NotOwned {
        /// The path, as configured.
        path: PathBuf,
        /// The file's owner (`st_uid`).
        owner: u32,
    },
    /// A configured file existed before the store opened it and its group
    /// or others may read or write it (`st_mode & 0o077`).
    #[error("g3 file {} has mode {mode:#o}: others may read or write it", path.display())]
    Exposed {
        /// The path, as configured.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The slot size is not a multiple of a file's direct-I/O offset
    /// alignment.
    #[error("g3 slot size {slot_bytes} is not a multiple of {align}, the direct-I/O alignment of {}", path.display())]
    Alignment {
        /// The file whose alignment refused it.
        path: PathBuf,
        /// The slot size asked for.
        slot_bytes: u64,
        /// The file's offset alignment (`STATX_DIOALIGN`, or 4096).
        align: u64,
    },
    /// The store's worker threads could not be started.
    #[error("g3 worker threads could not start{}", Errno(*errno))]
    Start {
        /// The OS error.
        errno: Option<i32>,
    },
    /// An I/O item named a slot the store does not have.
    #[error("g3 slot {slot} out of range (the store has {slots})")]
    SlotRange {
        /// The slot asked for.
        slot: u64,
        /// The store's slot count.
        slots: u64,
    },
    /// An I/O item's memory cannot be moved without a bounce buffer: its
    /// length is not one slot, or its address is not aligned for direct
    /// I/O. Nothing was read or written.
    #[error(
        "g3 slot {slot}: memory at {addr:#x} ({len} bytes) must be {slot_bytes} bytes aligned to {align}"
    )]
    Buffer {
        /// The slot named.
        slot: u64,
        /// The memory's address.
        addr: u64,
        /// The memory's length.
        len: u64,
        /// The store's slot size.
        slot_bytes: u64,
        /// The required memory alignment.
        align: u64,
    },
    /// An I/O item's memory is not registered in the store's
    /// [`memory`](super::G3Store::memory) (for a read: not writable there).
    /// Nothing was read or written.
    #[error("g3 slot {slot}: memory at {addr:#x} ({len} bytes) is not registered")]
    Unregistered {
        /// The slot named.
        slot: u64,
        /// The memory's address.
        addr: u64,
        /// The memory's length.
        len: u64,
    },
    /// A read or write failed with an OS error (other than "no space").
    #[error("g3 {op} of slot {slot} in {} failed{}", path.display(), Errno(Some(*errno)))]
    Io {
        /// The file.
        path: PathBuf,
        /// The slot.
        slot: u64,
        /// The direction.
        op: G3Op,
        /// The OS error.
        errno: i32,
    },
    /// A write found no room: `ENOSPC` (the filesystem is full), `EDQUOT`
    /// (a quota) or `EFBIG` (a file-size limit: `RLIMIT_FSIZE` or the
    /// filesystem's largest file). The slot's bytes are undefined.
    #[error("g3 write of slot {slot} in {}: no space{}", path.display(), Errno(Some(*errno)))]
    NoSpace {
        /// The file.
        path: PathBuf,
        /// The slot.
        slot: u64,
        /// `ENOSPC`, `EDQUOT` or `EFBIG`.
        errno: i32,
    },
    /// The kernel moved fewer bytes than a slot and then none (a read past
    /// the end of the file: a slot never written; or a write that returned
    /// 0).
    #[error("g3 {op} of slot {slot} in {}: {done} of {len} bytes", path.display())]
    ShortIo {
        /// The file.
        path: PathBuf,
        /// The slot.
        slot: u64,
        /// The direction.
        op: G3Op,
        /// Bytes moved.
        done: u64,
        /// Bytes asked for (one slot).
        len: u64,
    },
    /// The configured path no longer leads to the store's file.
    ///
    /// On Linux an open descriptor keeps working after its file is removed:
    /// the store's reads and writes go on succeeding, against an inode that
    /// no path reaches and whose blocks the kernel frees when the store
    /// closes. So this is reported by [`G3Store::check`](super::G3Store::check)
    /// (which `fstat`s every file and `stat`s its path), and by a failed I/O
    /// whose file turns out to be unlinked (then `slot` and `errno` name that
    /// failure).
    #[error("g3 file {} is gone ({how:?}){}", path.display(), slot.map(|s| format!(", found when slot {s} failed")).unwrap_or_default())]
    FileGone {
        /// The path, as configured.
        path: PathBuf,
        /// What happened to it.
        how: G3Gone,
        /// The slot whose failed I/O revealed it, if any.
        slot: Option<u64>,
        /// That failure's OS error, if any.
        errno: Option<i32>,
    },
    /// A bug in the store (never expected): named rather than panicking.
    #[error("g3 internal error: {why}")]
    Internal {
        /// What went wrong.
        why: &'static str,
    },
}

impl G3Error {
    /// The OS error this carries, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Path { errno, .. } | Self::Start { errno } | Self::FileGone { errno, .. } => {
                *errno
            }
            Self::Io { errno, .. } | Self::NoSpace { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

/// Formats `": <strerror> (os error N)"`, or nothing.
struct Errno(Option<i32>);

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            // "No space left on device (os error 28)".
            Some(errno) => write!(f, ": {}", std::io::Error::from_raw_os_error(errno)),
            None => Ok(()),
        }
    }
}
