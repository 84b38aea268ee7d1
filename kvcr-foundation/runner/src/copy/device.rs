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

/// The most bytes a [`DeviceCopier::export_device`] name may take on the wire.
pub const MAX_DEVICE_EXPORT: usize = 256;

/// A same-host peer's device memory, opened in this process by
/// [`DeviceCopier::import_device`]: the one-hop route (a source's KVCR DRAM
/// straight into the target's GPU). Dropping it closes the mapping; the
/// runner drops it only when no copy through it is in flight.
pub trait DeviceImport: Send + Sync {
    /// Bytes of the imported extent; every destination offset lies below it.
    fn len(&self) -> u64;

    /// Whether the extent is empty (never, for a real export).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies every span of every key: `src` inside a pool attached to the
    /// copier that imported this, `dst` a byte offset into the imported
    /// extent. The copier checks each span against both (a span outside is
    /// an error, nothing copied). Returns only when no copy of this call can
    /// touch memory any more, whatever the outcome; an error fails every key.
    fn copy_into(&self, keys: &[&[CopySpan]]) -> Result<()>;

    /// Where bytes `offset .. offset + len` of the extent are in this
    /// process's device address space, for [`DeviceCopier::copy_to_imports`]
    /// (one pass over several imports); `None` outside the extent, or where
    /// the import cannot be addressed so (then [`DeviceImport::copy_into`]
    /// serves). Default: `None`.
    ///
    /// An import that can be addressed maps its whole extent in one piece:
    /// the runner asks once, for the whole extent (`resolve(0, len())`),
    /// and takes byte `offset` to be at that address plus `offset`.
    fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
        let _ = (offset, len);
        None
    }
}

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

    /// As [`DeviceCopier::copy`], calling `landed` once the first `lead`
    /// spans of every key are in place (while the rest may still be
    /// copying): a restore's first layer, which the engine may start on.
    /// At most once, and only if every lead span landed; never for `lead`
    /// 0. The default copies everything first, then calls it.
    fn copy_led(&self, keys: &[&[CopySpan]], lead: usize, landed: &mut dyn FnMut()) -> Result<()> {
        self.copy(keys)?;
        if lead > 0 {
            landed();
        }
        Ok(())
    }

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

    /// Names the device memory `[base, base + len)` (a registered device
    /// region) so that a same-host peer process may open it with
    /// [`DeviceCopier::import_device`]; at most [`MAX_DEVICE_EXPORT`] bytes.
    /// `Ok(None)`: this memory cannot be shared (the one-hop route is then
    /// not offered and peers write through KVCR DRAM). Default: `None`.
    fn export_device(&self, base: u64, len: u64) -> Result<Option<Vec<u8>>> {
        let _ = (base, len);
        Ok(None)
    }

    /// Opens a peer's [`DeviceCopier::export_device`] name of `len` bytes.
    /// An error (no GPU here, another GPU with no peer access, a refused
    /// handle, a driver error) means the route falls back to KVCR DRAM.
    /// Default: refused.
    fn import_device(&self, export: &[u8], len: u64) -> Result<Box<dyn DeviceImport>> {
        let _ = (export, len);
        Err(crate::error::Error::runner(
            kvcr_runner_core::RunnerReason::DeviceCopy(kvcr_contracts::error::Echo::new(
                "this copier cannot import device memory",
            )),
        ))
    }

    /// Copies every span of every key in one pass: `src` inside an attached
    /// pool, `dst` an address [`DeviceImport::resolve`] returned for an
    /// import this copier opened, which the caller holds open for the call.
    /// A one-hop write spans many imports (a K and a V region per layer);
    /// one pass batches them as [`DeviceCopier::copy`] batches a job. Same
    /// completion contract as `copy`. Default: refused (the caller then
    /// copies through each import).
    fn copy_to_imports(&self, keys: &[&[CopySpan]]) -> Result<()> {
        let _ = keys;
        Err(crate::error::Error::runner(
            kvcr_runner_core::RunnerReason::DeviceCopy(kvcr_contracts::error::Echo::new(
                "this copier cannot copy to several imports at once",
            )),
        ))
    }

    /// As [`DeviceCopier::copy_to_imports`], calling `landed` once the
    /// first `lead` spans of every key are in place (while the rest may
    /// still be copying): the one-hop route's first layer, which the
    /// target's engine may start on. `landed` is called at most once, and
    /// only if every lead span landed; `lead` 0 never calls it. The
    /// default copies everything first, then calls it.
    fn copy_to_imports_led(
        &self,
        keys: &[&[CopySpan]],
        lead: usize,
        landed: &mut dyn FnMut(),
    ) -> Result<()> {
        self.copy_to_imports(keys)?;
        if lead > 0 {
            landed();
        }
        Ok(())
    }

    /// The page digest (xxh3-64 in span order, `kvcr_sys::digest`) of each
    /// key's bytes in device memory, every span's `src` inside a registered
    /// device region; `Ok(None)` when this copier cannot hash on the device.
    /// Checks what a one-hop write landed. Default: `None`.
    fn digest_device(&self, keys: &[&[CopySpan]]) -> Result<Option<Vec<u64>>> {
        let _ = keys;
        Ok(None)
    }
}
