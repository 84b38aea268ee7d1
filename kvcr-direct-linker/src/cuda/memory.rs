//! Memory the copier and its kernels use: device buffers (`cuMemAlloc`),
//! host memory pinned and mapped for the device (a registration of memory
//! someone else owns, or a buffer of its own), each undone on drop.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{Device, check};
use crate::error::{Error, Result};

/// Device memory from `cuMemAlloc`, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (uninitialised) on `device`.
    pub fn allocate(device: &Arc<Device>, len: usize) -> Result<Self> {
        device.bind()?;
        let mut ptr = 0;
        // SAFETY: writes one device pointer; freed in Drop.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&raw mut ptr, len)
        })?;
        Ok(Self {
            device: Arc::clone(device),
            ptr,
            len,
        })
    }

    /// The buffer's device address.
    pub fn address(&self) -> u64 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `bytes` to `offset` (synchronous).
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        self.in_range(offset, bytes.len())?;
        self.device.bind()?;
        // SAFETY: the destination range lies inside this allocation (checked
        // above) and `bytes` is a valid host slice for the call.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, bytes.as_ptr().cast(), bytes.len())
        })
    }

    /// Reads `len` bytes from `offset` (synchronous).
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        self.in_range(offset, len)?;
        self.device.bind()?;
        let mut out = vec![0u8; len];
        // SAFETY: the source range lies inside this allocation (checked above)
        // and `out` holds `len` writable bytes.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr + offset as u64, len)
        })?;
        Ok(out)
    }

    /// Sets every byte to `value`, and returns once they are set.
    ///
    /// `cuMemsetD8` on device memory returns before its bytes are written
    /// (it is asynchronous to the host, on the legacy default stream), and
    /// nothing orders it before a copy another process makes into this
    /// buffer on its own streams (the one-hop route): such a copy could
    /// land first and be overwritten. So the fill waits for that stream.
    pub fn fill(&self, value: u8) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the whole allocation, which this value owns.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, value, self.len)
        })?;
        // SAFETY: the null stream is the legacy default stream of the
        // context bound above, which the memset was issued to.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
        })
    }

    fn in_range(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_some_and(|end| end <= self.len) {
            Ok(())
        } else {
            Err(Error::Layout {
                field: "offset",
                why: "is outside the device buffer",
            })
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let bound = self.device.bind();
        if bound.is_ok() {
            // SAFETY: allocated by cuMemAlloc in `allocate`, freed once. Users
            // synchronise their streams before dropping buffers they launched on.
            let freed = unsafe { sys::cuMemFree_v2(self.ptr) };
            self.device.record_drop(check("cuMemFree", freed));
        } else {
            self.device.record_drop(bound);
        }
    }
}

/// Host memory page-locked and mapped for the device (`cuMemHostRegister`),
/// unregistered on drop. Does not own the memory: whoever registers it keeps
/// it allocated until this value is dropped.
#[derive(Debug)]
pub struct PinnedRegistration {
    device: Arc<Device>,
    host: u64,
    len: u64,
    mapped: u64,
}

// SAFETY: holds addresses only; registration state lives in the driver.
unsafe impl Send for PinnedRegistration {}
// SAFETY: as above.
unsafe impl Sync for PinnedRegistration {}

impl PinnedRegistration {
    /// Pins `host .. host + len` and maps it for `device`.
    ///
    /// # Safety
    /// The range must be allocated host memory that stays allocated (not
    /// unmapped or freed) until the returned value is dropped.
    pub unsafe fn register(device: &Arc<Device>, host: u64, len: u64) -> Result<Self> {
        device.bind()?;
        let bytes = usize::try_from(len).map_err(|_| Error::Layout {
            field: "pool",
            why: "is larger than the address space",
        })?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller guarantees the range is allocated for the
        // registration's lifetime; unregistered in Drop.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(host as usize as *mut c_void, bytes, flags)
        })?;
        let mut mapped = 0;
        // SAFETY: the range was registered with DEVICEMAP just above.
        let status = unsafe {
            sys::cuMemHostGetDevicePointer_v2(&raw mut mapped, host as usize as *mut c_void, 0)
        };
        if let Err(e) = check("cuMemHostGetDevicePointer", status) {
            // SAFETY: undoes the registration made above.
            let undone = unsafe { sys::cuMemHostUnregister(host as usize as *mut c_void) };
            device.record_drop(check("cuMemHostUnregister", undone));
            return Err(e);
        }
        Ok(Self {
            device: Arc::clone(device),
            host,
            len,
            mapped,
        })
    }

    /// Whether this registration starts at host address `base`.
    pub fn covers(&self, base: u64) -> bool {
        self.host == base
    }

    /// The device address of host address `addr`, if it lies in this range.
    pub fn translate(&self, addr: u64, len: u64) -> Option<u64> {
        let offset = addr.checked_sub(self.host)?;
        (offset.checked_add(len)? <= self.len).then(|| self.mapped + offset)
    }
}

impl Drop for PinnedRegistration {
    fn drop(&mut self) {
        self.device.record_drop(self.device.bind());
        // SAFETY: registered in `register`; the owner keeps the memory mapped
        // until after this drop (the runner detaches its copier before freeing
        // its pools).
        let status = unsafe { sys::cuMemHostUnregister(self.host as usize as *mut c_void) };
        self.device
            .record_drop(check("cuMemHostUnregister", status));
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, mapped for the device;
/// freed on drop. Holds the copy kernel's descriptors.
#[derive(Debug)]
pub struct PinnedBuffer {
    device: Arc<Device>,
    host: *mut u8,
    mapped: u64,
    len: usize,
}

// SAFETY: uniquely owned page-locked memory; no thread affinity.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes (at least 1).
    pub fn allocate(device: &Arc<Device>, len: usize) -> Result<Self> {
        device.bind()?;
        let len = len.max(1);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; freed in Drop.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&raw mut host, len, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        })?;
        let mut mapped = 0;
        // SAFETY: allocated with DEVICEMAP just above.
        let status = unsafe { sys::cuMemHostGetDevicePointer_v2(&raw mut mapped, host, 0) };
        if let Err(e) = check("cuMemHostGetDevicePointer", status) {
            // SAFETY: frees the allocation made above.
            let undone = unsafe { sys::cuMemFreeHost(host) };
            device.record_drop(check("cuMemFreeHost", undone));
            return Err(e);
        }
        Ok(Self {
            device: Arc::clone(device),
            host: host.cast(),
            mapped,
            len,
        })
    }

    /// Bytes it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: at least 1 byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of its first byte.
    pub fn mapped(&self) -> u64 {
        self.mapped
    }

    /// Reads `count` words from word `at` on (what a kernel wrote there,
    /// after the stream that ran it was synchronised).
    pub fn read_words(&self, at: usize, count: usize) -> Result<Vec<u64>> {
        let offset = at.saturating_mul(8);
        let bytes = count.saturating_mul(8);
        if offset.checked_add(bytes).is_none_or(|end| end > self.len) {
            return Err(Error::Layout {
                field: "descriptors",
                why: "exceed the descriptor buffer",
            });
        }
        let mut words = vec![0u64; count];
        // SAFETY: `offset + bytes <= len` (checked above); the buffer is
        // ours and u64-aligned at `offset`; the caller synchronised the
        // stream, so no kernel writes these words now.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.host.add(offset),
                words.as_mut_ptr().cast::<u8>(),
                bytes,
            );
        }
        Ok(words)
    }

    /// Writes `words` from word `at` on. The caller must not overwrite words
    /// a queued kernel may still read (the copier writes each group's
    /// descriptors to fresh words and synchronises before its next job).
    pub fn write_words(&mut self, at: usize, words: &[u64]) -> Result<()> {
        let bytes = std::mem::size_of_val(words);
        let offset = at.saturating_mul(8);
        if offset.checked_add(bytes).is_none_or(|end| end > self.len) {
            return Err(Error::Layout {
                field: "descriptors",
                why: "exceed the descriptor buffer",
            });
        }
        // SAFETY: `offset + bytes <= len` (checked above), the buffer is ours
        // (`&mut self`), page aligned plus a multiple of 8 (so u64-aligned),
        // and no queued kernel reads these words (see above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                words.as_ptr().cast::<u8>(),
                self.host.add(offset),
                bytes,
            );
        }
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        self.device.record_drop(self.device.bind());
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        let status = unsafe { sys::cuMemFreeHost(self.host.cast()) };
        self.device.record_drop(check("cuMemFreeHost", status));
    }
}
