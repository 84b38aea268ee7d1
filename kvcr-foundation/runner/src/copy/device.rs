//! The seam between the runner and device memory: a framework may register
//! regions that live on a GPU, and every copy job that touches them goes to a
//! [`DeviceCopier`] it provides instead of the copy thread's memcpy.
//!
//! The runner keeps all the bookkeeping (claims, FILLING/READY, deadlines,
//! late completions, inventory); the copier only moves bytes. That is how the
//! direct linker (`kvcr-direct-linker`) gets every runner invariant for GPU
//! pages without a second state machine, and why this crate needs no CUDA.

use kvcr_runner_core::{CopySpan, PoolRange};

use crate::error::Result;

/// Moves bytes between runner pools (host DRAM) and device regions.
///
/// Lifecycle, driven by the runner: [`attach`](Self::attach) once when the
/// copier is set; [`copy`](Self::copy) from the runner's copy thread, one call
/// per job; [`detach`](Self::detach) once when the runner drops, after its copy
/// thread has stopped and before its pools are freed (so a registration of the
/// pools with a driver is always undone before the memory is unmapped). One
/// copier may serve several runners at once (ranks sharing a GPU, a runner
/// replaced on reset): attach and detach name the pools they are about.
pub trait DeviceCopier: Send + Sync {
    /// The runner's pools; pin or register them here. An error refuses the
    /// copier and leaves the runner as it was.
    fn attach(&self, pools: &[PoolRange]) -> Result<()>;

    /// Copies every span of every key. In each span one side is inside an
    /// attached pool and the other inside a registered device region; both
    /// were bounds-checked by the runner, which also guarantees nothing else
    /// writes the destinations or the sources during the call. Must return only
    /// when no copy of this call can touch memory any more, whatever the
    /// outcome: an error fails every key of the call (`FailReason::CopyFailed`)
    /// and the runner frees or reuses the slots right after.
    fn copy(&self, keys: &[&[CopySpan]]) -> Result<()>;

    /// As [`DeviceCopier::copy`], and each key's page digest (xxh3-64 of
    /// its bytes in span order, `kvcr_sys::digest`) where the copier took
    /// it from the device's bytes as it copied them; `None` where it did
    /// not (the runner then hashes the page in DRAM). One entry per key.
    /// The default copies and takes none.
    fn copy_digested(&self, keys: &[&[CopySpan]]) -> Result<Vec<Option<u64>>> {
        self.copy(keys).map(|()| vec![None; keys.len()])
    }

    /// Whether [`DeviceCopier::copy_digested`] takes digests on the device
    /// (then a deposit's job is one call, not groups hashed in DRAM while
    /// the next crosses). Default: no.
    fn digests_on_device(&self) -> bool {
        false
    }

    /// Undoes `attach` for these pools (they are about to be freed); other
    /// runners' pools stay attached.
    fn detach(&self, pools: &[PoolRange]);
}
