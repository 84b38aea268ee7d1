//! kvcr-sys: every piece of the runner's unsafe code that is not the UCX
//! binding, behind safe types and functions.
//!
//! The runner above works with plain addresses (`u64`) that its sans-I/O
//! core bounds-checks against registrations; this crate turns them into
//! memory accesses and system calls. What lives here:
//!
//! | module | what |
//! |---|---|
//! | [`placement`] | pool placement options and the host's sysfs/procfs answers (no unsafe) |
//! | [`mapping`] | [`DramPool`](mapping::DramPool), anonymous mappings, `mbind`/`madvise`, NUMA audit queries |
//! | [`memfd`] | sealed memfd pool and journal files, [`SharedPool`](memfd::SharedPool), [`JournalMap`](memfd::JournalMap) |
//! | [`segment`] | [`PeerSegment`](segment::PeerSegment): a same-host peer's pool, mapped for one-copy writes |
//! | [`seqlock`] | volatile loads and stores of memory other processes share |
//! | [`copy`] | span copy kernels and [`MemoryRegistry`], which makes copies safe |
//! | [`digest`] | page digests (xxh3-64) over registered memory, taken and checked through the registry |
//! | [`owned`] | owned memory held by the registry and a UCX registration at once |
//! | `vectored` (private, behind `MemoryRegistry`) | `readv`/`writev` between a socket and spans of memory |
//! | `in_place` (private, behind `MemoryRegistry`) | registered bytes read out, or changed in place |
//! | [`direct_io`] | `openat`, `flock`, `statx`, slot `pread`/`pwrite`, [`DirectBuf`](direct_io::DirectBuf) |
//! | [`fd_passing`] | `SCM_RIGHTS`, peer credentials, pidfds |
//! | [`thread`] | per-thread knobs: timer slack, priority |
//! | [`process`] | another process's memory (`process_vm_readv`), clock ticks, the raw monotonic clock |
//! | [`heap`] | [`CountingAllocator`](heap::CountingAllocator): live heap bytes, for benchmarks |
//!
//! Every `unsafe` block carries a `// SAFETY:` comment and every `unsafe fn`
//! a `# Safety` section. The one promise this crate cannot check is the
//! caller's that foreign memory stays valid: [`copy::MemoryRegistry::insert`]
//! is where an engine's raw region enters, and every copy through the
//! registry is checked against what was inserted.

pub mod copy;
pub mod digest;
pub mod direct_io;
pub mod error;
pub mod fd_passing;
pub mod heap;
mod in_place;
pub mod mapping;
pub mod memfd;
pub mod owned;
pub mod placement;
pub mod process;
pub mod segment;
pub mod seqlock;
pub mod thread;
mod vectored;

pub use self::copy::{ByteSpan, MemoryRegistry};
pub use self::digest::{PageDigest, combine_digests};
pub use self::error::{Result, SysError};
pub use self::owned::{RegisteredMemory, SharedMemory};
