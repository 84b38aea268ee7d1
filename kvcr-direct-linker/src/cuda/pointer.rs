//! What the driver knows of an address a caller hands over: whether a byte
//! range is device memory of this device, inside one allocation. The Python
//! face asks this of every K/V buffer before registering it, so an address
//! that names no live allocation is refused instead of written through.

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

impl Device {
    /// Checks that `addr .. addr + len` is device memory on this device and
    /// lies inside one allocation (the driver's range of the allocation that
    /// holds `addr`). An address the driver does not know is refused as a
    /// layout error, never dereferenced.
    pub fn check_allocation(&self, addr: u64, len: u64) -> Result<()> {
        self.bind()?;
        let end = addr
            .checked_add(len)
            .ok_or_else(|| refused("buffer overflows the address space"))?;
        let mut memory_type: u32 = 0;
        // SAFETY: MEMORY_TYPE writes one unsigned int; the driver only looks
        // the address up in its tables, it never dereferences it.
        let status = unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut memory_type).cast::<c_void>(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if status == CUresult::CUDA_ERROR_INVALID_VALUE {
            return Err(refused("is not memory the CUDA driver knows"));
        }
        check("cuPointerGetAttribute", status)?;
        if memory_type != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(refused("is not device memory"));
        }
        let mut ordinal: i32 = -1;
        // SAFETY: DEVICE_ORDINAL writes one int; a lookup, as above.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut ordinal).cast::<c_void>(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        })?;
        if u32::try_from(ordinal).ok() != Some(self.ordinal) {
            return Err(refused("lives on another device than the linker's"));
        }
        let mut start: sys::CUdeviceptr = 0;
        // SAFETY: RANGE_START_ADDR writes one device pointer; a lookup.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut start).cast::<c_void>(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                addr,
            )
        })?;
        let mut size: usize = 0;
        // SAFETY: RANGE_SIZE writes one size_t; a lookup.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut size).cast::<c_void>(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                addr,
            )
        })?;
        let range_end = start.saturating_add(size as u64);
        if addr < start || end > range_end {
            return Err(refused("runs past the end of its device allocation"));
        }
        Ok(())
    }
}
