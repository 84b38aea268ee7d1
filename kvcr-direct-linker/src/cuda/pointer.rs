//! What the driver knows of an address a caller hands over: whether a byte
//! range is device memory of this device, mapped throughout. The Python face
//! asks this of every K/V buffer before registering it, so an address that
//! names no live allocation is refused instead of written through.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUmemorytype, CUpointer_attribute, CUresult};

use super::{Device, check};
use crate::error::{Error, Result};

fn refused(why: &'static str) -> Error {
    Error::Layout {
        field: "k_bases/v_bases",
        why,
    }
}

/// One pointer attribute of `addr`; `None` when the driver does not know
/// the address (it is no allocation of this process).
///
/// # Safety
/// `T` must be the type the driver writes for `attribute`.
unsafe fn attribute<T: Default>(attribute: CUpointer_attribute, addr: u64) -> Result<Option<T>> {
    let mut value = T::default();
    // SAFETY: the caller names the type the driver writes for `attribute`;
    // the driver looks the address up in its tables, never dereferences it.
    let status =
        unsafe { sys::cuPointerGetAttribute((&raw mut value).cast::<c_void>(), attribute, addr) };
    if status == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(None);
    }
    check("cuPointerGetAttribute", status)?;
    Ok(Some(value))
}

impl Device {
    /// Checks that `addr .. addr + len` is device memory on this device,
    /// mapped throughout: walked one allocation range at a time (a buffer
    /// may span several mappings of one virtual range, as with PyTorch's
    /// expandable segments), each range device memory of this device, with
    /// no gap. An address the driver does not know is refused as a layout
    /// error, never dereferenced.
    pub fn check_allocation(&self, addr: u64, len: u64) -> Result<()> {
        self.bind()?;
        let end = addr
            .checked_add(len)
            .ok_or_else(|| refused("buffer overflows the address space"))?;
        let unknown = || refused("is not memory the CUDA driver knows throughout");
        let mut cursor = addr;
        while cursor < end {
            use CUpointer_attribute as A;
            // SAFETY: MEMORY_TYPE writes an unsigned int.
            let memory = unsafe { attribute::<u32>(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, cursor) };
            if memory?.ok_or_else(unknown)? != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
                return Err(refused("is not device memory"));
            }
            // SAFETY: DEVICE_ORDINAL writes an int.
            let ordinal =
                unsafe { attribute::<i32>(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cursor) };
            if u32::try_from(ordinal?.ok_or_else(unknown)?).ok() != Some(self.ordinal) {
                return Err(refused("lives on another device than the linker's"));
            }
            // SAFETY: RANGE_START_ADDR writes a device pointer.
            let start = unsafe {
                attribute::<sys::CUdeviceptr>(A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, cursor)
            };
            let start = start?.ok_or_else(unknown)?;
            // SAFETY: RANGE_SIZE writes a size_t.
            let size = unsafe { attribute::<usize>(A::CU_POINTER_ATTRIBUTE_RANGE_SIZE, cursor) };
            let size = size?.ok_or_else(unknown)?;
            let next = start.saturating_add(size as u64);
            if start > cursor || next <= cursor {
                return Err(unknown());
            }
            cursor = next;
        }
        Ok(())
    }
}
