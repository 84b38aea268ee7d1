//! Where an engine hands the runner raw memory: the one `unsafe` contract of
//! the crate (`#![deny(unsafe_code)]` everywhere else).
//!
//! An engine's host region enters the runner's
//! [`MemoryRegistry`](kvcr_sys::MemoryRegistry) here, on the caller's
//! promise that it stays valid; every copy into or out of it afterwards is
//! checked against the registry, in safe code. A device region is only
//! recorded by the core: its bytes are moved by the engine's
//! [`DeviceCopier`](crate::DeviceCopier), never by the runner.

use kvcr_contracts::protocol::RegionId;
use kvcr_runner_core::{RegionDesc, RegionMemory};

use crate::Runner;
use crate::error::{Error, Result, RunnerReason};

impl Runner {
    /// Registers a framework region (`label` is `pool` or `pool:part`; its
    /// element size must equal the pool's block size).
    ///
    /// # Safety
    /// `desc.base .. desc.base + extent` must be valid for reads and writes until
    /// the runner is closed or dropped, and the caller must not access an
    /// element named by an operation until that operation has completed.
    pub unsafe fn register_region(&self, desc: RegionDesc) -> Result<RegionId> {
        let (base, stride, size, count) =
            (desc.base, desc.effective_stride(), desc.size, desc.count);
        let mut inner = self.shared.lock();
        let id = inner.core.register_region(desc).map_err(Error::from)?;
        // The core accepted the region, so its extent fits in 64 bits and
        // overlaps no pool and no other region.
        let extent = stride
            .saturating_mul(count.saturating_sub(1))
            .saturating_add(size);
        // SAFETY: the caller promised `base..base + extent` valid for reads
        // and writes until the runner is closed or dropped (this function's
        // contract), which is as long as the registry copies through it, and
        // no access to an element while an operation names it: the core
        // hands each element to one copy at a time.
        unsafe { self.shared.memory.insert(base, extent) }?;
        drop(inner);
        Ok(id)
    }

    /// Registers a framework region in device memory (a GPU address in the
    /// process's unified address space). Copies that touch it run on the
    /// device copier, which must be set first; one call of `deposit` or
    /// `deliver` names only host or only device elements.
    ///
    /// # Safety
    /// As [`Runner::register_region`], for device memory: the extent must stay
    /// allocated on the device until the runner is closed or dropped, and the
    /// caller must not touch an element named by an operation until that
    /// operation has completed.
    ///
    /// The region is exported once for the one-hop route
    /// ([`crate::DeviceCopier::export_device`] of its extent): where the
    /// copier names it, same-host sources may be offered it.
    pub unsafe fn register_device_region(&self, desc: RegionDesc) -> Result<RegionId> {
        let Some(copier) = self.device.get() else {
            return Err(Error::runner(RunnerReason::NoDeviceCopier));
        };
        let base = desc.base;
        let stride = if desc.stride == 0 {
            desc.size
        } else {
            desc.stride
        };
        let extent = desc
            .count
            .checked_sub(1)
            .and_then(|n| n.checked_mul(stride))
            .and_then(|n| n.checked_add(desc.size));
        let id = self
            .shared
            .lock()
            .core
            .register_region_in(desc, RegionMemory::Device)
            .map_err(Error::from)?;
        // Outside the core's lock: the copier may call into its driver.
        let export = extent.and_then(|len| copier.export_device(base, len).ok().flatten());
        if let Some(export) = export {
            // A name the wire cannot carry is not advertised (two hops).
            let _ = self.shared.lock().core.set_device_export(id, export);
        }
        Ok(id)
    }
}
