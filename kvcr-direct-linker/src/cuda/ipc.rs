//! Legacy CUDA IPC, the driver half of the one-hop route: what a target
//! process needs to hand a same-host source its device memory
//! (the allocation around an address, an IPC handle on it, the device's
//! UUID) and what the source needs to open it ([`IpcMapping`], closed on
//! drop). The name that carries a handle between processes, and every check
//! of it, is `crate::one_hop`'s.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUpointer_attribute, CUresult};

use super::{Device, check};
use crate::error::{Error, Result};

/// Bytes of a legacy IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A device's UUID, as the driver reports it.
pub type DeviceUuid = [u8; 16];

fn uuid_of(device: sys::CUdevice) -> Result<DeviceUuid> {
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: writes one 16-byte UUID for a device handle from cuDeviceGet.
    check("cuDeviceGetUuid", unsafe {
        sys::cuDeviceGetUuid_v2(&raw mut uuid, device)
    })?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// The UUIDs of every device the driver reports, in ordinal order.
pub fn device_uuids() -> Result<Vec<DeviceUuid>> {
    let count = super::device_count()?;
    let mut uuids = Vec::with_capacity(count as usize);
    for ordinal in 0..count {
        let mut device = 0;
        // SAFETY: `ordinal < count` names a device; writes one handle.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&raw mut device, ordinal as i32)
        })?;
        uuids.push(uuid_of(device)?);
    }
    Ok(uuids)
}

impl Device {
    /// This device's UUID (what a peer's export names its memory by).
    pub fn uuid(&self) -> Result<DeviceUuid> {
        uuid_of(self.device)
    }

    /// The allocation holding device address `addr`: `(base, bytes)`;
    /// `None` when the driver knows no allocation there (looked up, never
    /// dereferenced).
    pub fn allocation_of(&self, addr: u64) -> Result<Option<(u64, u64)>> {
        self.bind()?;
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: writes one pointer and one size; the driver looks the
        // address up in its tables.
        let status = unsafe { sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, addr) };
        if matches!(
            status,
            CUresult::CUDA_ERROR_NOT_FOUND | CUresult::CUDA_ERROR_INVALID_VALUE
        ) {
            return Ok(None);
        }
        check("cuMemGetAddressRange", status)?;
        Ok(Some((base, size as u64)))
    }

    /// A legacy IPC handle on the allocation that starts at `base`; `None`
    /// when the driver will not share it that way (a VMM allocation, as
    /// PyTorch's expandable segments make, or a driver that refuses IPC).
    pub fn ipc_handle(&self, base: u64) -> Result<Option<[u8; IPC_HANDLE_BYTES]>> {
        self.bind()?;
        let mut capable = 0i32;
        // SAFETY: IS_LEGACY_CUDA_IPC_CAPABLE writes one int; the driver looks
        // the address up, never dereferences it.
        let asked = unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut capable).cast::<c_void>(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                base,
            )
        };
        // An old driver that does not know the attribute: let the call
        // below decide.
        if asked == CUresult::CUDA_SUCCESS && capable == 0 {
            return Ok(None);
        }
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: writes one 64-byte handle for a live allocation's base.
        let status = unsafe { sys::cuIpcGetMemHandle(&raw mut handle, base) };
        if refused(status) {
            return Ok(None);
        }
        check("cuIpcGetMemHandle", status)?;
        Ok(Some(handle.reserved.map(|b| b as u8)))
    }
}

/// Statuses that mean "IPC is not possible here", not "the driver failed".
fn refused(status: CUresult) -> bool {
    matches!(
        status,
        CUresult::CUDA_ERROR_INVALID_VALUE
            | CUresult::CUDA_ERROR_NOT_SUPPORTED
            | CUresult::CUDA_ERROR_NOT_PERMITTED
            | CUresult::CUDA_ERROR_INVALID_HANDLE
    )
}

/// Another process's device allocation, opened in this process's context
/// of `device` (`cuIpcOpenMemHandle`, peer access enabled lazily when it
/// lives on another GPU); closed on drop.
#[derive(Debug)]
pub struct IpcMapping {
    device: Arc<Device>,
    base: u64,
    len: u64,
}

// SAFETY: holds addresses only; the mapping's state lives in the driver.
unsafe impl Send for IpcMapping {}
// SAFETY: as above.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens `handle` and looks up how long the opened allocation is. A
    /// handle of this very process is refused by the driver; callers check
    /// that first (`crate::one_hop`), as the driver's answer is not a
    /// typed one.
    pub fn open(device: &Arc<Device>, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<Self> {
        device.bind()?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: writes one device pointer; the driver validates the
        // handle's bytes (they come from a peer); closed in Drop.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(&raw mut ptr, raw, flags)
        })?;
        // From here on Drop closes it, whatever the lookup says.
        let mut mapping = Self {
            device: Arc::clone(device),
            base: ptr,
            len: 0,
        };
        let (base, len) = device.allocation_of(ptr)?.ok_or(Error::Cuda {
            call: "cuMemGetAddressRange",
            status: "the opened IPC mapping is unknown to the driver".to_owned(),
        })?;
        if base != ptr {
            return Err(Error::Cuda {
                call: "cuMemGetAddressRange",
                status: "the opened IPC mapping does not start its allocation".to_owned(),
            });
        }
        mapping.len = len;
        Ok(mapping)
    }

    /// The device address of the opened allocation's first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes of the opened allocation.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty (never, for an opened allocation).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        self.device.record_drop(self.device.bind());
        // SAFETY: opened in `open`, closed once; its owner has synchronised
        // every copy through it before dropping it (the runner drops an
        // import only with no copy in flight).
        let status = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        self.device
            .record_drop(check("cuIpcCloseMemHandle", status));
    }
}
