//! The runner's device-copier seam ([`DeviceCopier`]) over a
//! [`CudaCopier`]: each call goes to the copier's core, its errors become
//! the runner's.

use kvcr_foundation::runner::{CopySpan, DeviceCopier, DeviceImport, PoolRange};

use super::{CudaCopier, lock};
use crate::cuda::PinnedRegistration;

impl DeviceCopier for CudaCopier {
    fn attach(&self, pools: &[PoolRange]) -> kvcr_foundation::runner::Result<()> {
        let mut pinned = lock(&self.core.pinned);
        let mut fresh = Vec::with_capacity(pools.len());
        for pool in pools {
            let device = &self.core.device;
            // SAFETY: the runner keeps its pools allocated until it calls
            // `detach`, which drops these registrations first.
            fresh.push(unsafe { PinnedRegistration::register(device, pool.base, pool.len) }?);
        }
        pinned.extend(fresh);
        Ok(())
    }

    fn copy(&self, keys: &[&[CopySpan]]) -> kvcr_foundation::runner::Result<()> {
        // The stream is synchronised or the context is lost either way; the
        // runner fails the keys.
        self.core
            .run(keys, false)
            .map(drop)
            .map_err(kvcr_foundation::runner::Error::from)
    }

    fn copy_led(
        &self,
        keys: &[&[CopySpan]],
        lead: usize,
        landed: &mut dyn FnMut(),
    ) -> kvcr_foundation::runner::Result<()> {
        self.core
            .run_led(keys, false, Some((lead, landed)))
            .map(drop)
            .map_err(kvcr_foundation::runner::Error::from)
    }

    fn copy_digested(
        &self,
        keys: &[&[CopySpan]],
    ) -> kvcr_foundation::runner::Result<Vec<Option<u64>>> {
        self.core
            .run(keys, true)
            .map_err(kvcr_foundation::runner::Error::from)
    }

    fn digests_on_device(&self) -> bool {
        self.core.digest_kernel.is_some()
    }

    fn detach(&self, pools: &[PoolRange]) {
        lock(&self.core.pinned).retain(|p| !pools.iter().any(|pool| p.covers(pool.base)));
    }

    fn export_device(
        &self,
        base: u64,
        len: u64,
    ) -> kvcr_foundation::runner::Result<Option<Vec<u8>>> {
        self.export(base, len)
            .map_err(kvcr_foundation::runner::Error::from)
    }

    fn import_device(
        &self,
        export: &[u8],
        len: u64,
    ) -> kvcr_foundation::runner::Result<Box<dyn DeviceImport>> {
        let import = self.import(export, len)?;
        Ok(Box::new(import))
    }

    fn copy_to_imports(&self, keys: &[&[CopySpan]]) -> kvcr_foundation::runner::Result<()> {
        self.copy_to_imports(keys)
            .map_err(kvcr_foundation::runner::Error::from)
    }

    fn copy_to_imports_led(
        &self,
        keys: &[&[CopySpan]],
        lead: usize,
        landed: &mut dyn FnMut(),
    ) -> kvcr_foundation::runner::Result<()> {
        self.copy_to_imports_led(keys, lead, landed)
            .map_err(kvcr_foundation::runner::Error::from)
    }

    fn digest_device(
        &self,
        keys: &[&[CopySpan]],
    ) -> kvcr_foundation::runner::Result<Option<Vec<u64>>> {
        self.core
            .digest_device(keys)
            .map_err(kvcr_foundation::runner::Error::from)
    }
}
