//! Every CUDA driver call kvcr makes, and nothing else: the driver FFI lives
//! here (the copier's job-issuing and the linker's region registrations are
//! the crate's other unsafe code). Each handle is an RAII type that undoes its driver call on
//! drop; each owns an `Arc` of the device, so the primary context outlives
//! every object made in it.
//!
//! The driver library is loaded at run time (cudarc's `dynamic-loading`):
//! [`Device::open`] checks that it exists before the first call, because a
//! missing library would otherwise abort the process inside cudarc.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_void};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::{self, CUresult};

use crate::error::{Error, Result};

mod digest;
mod ipc;
mod memory;
mod pointer;

pub use self::digest::{DIGEST_BLOCK_BYTES, DigestKernel};
pub use self::ipc::{DeviceUuid, IPC_HANDLE_BYTES, IpcMapping, device_uuids};
pub use self::memory::{DeviceBuffer, PinnedBuffer, PinnedRegistration};

fn check(call: &'static str, status: CUresult) -> Result<()> {
    if status == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString only writes a pointer to a static string (or
    // leaves it null for an unknown status).
    let named = unsafe { sys::cuGetErrorString(status, &raw mut text) };
    let status = if named == CUresult::CUDA_SUCCESS && !text.is_null() {
        // SAFETY: non-null and from the driver: a NUL-terminated static string.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{status:?}")
    };
    Err(Error::Cuda { call, status })
}

/// Whether the CUDA driver library can be loaded here (no driver call made).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library; calls nothing in it.
    unsafe { sys::is_culib_present() }
}

/// GPUs the driver reports (0 when there is no driver).
pub fn device_count() -> Result<u32> {
    if !driver_present() {
        return Ok(0);
    }
    // SAFETY: the library is present; cuInit(0) is idempotent.
    check("cuInit", unsafe { sys::cuInit(0) })?;
    let mut count = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&raw mut count)
    })?;
    Ok(u32::try_from(count).unwrap_or(0))
}

/// Most errors of `Drop` undo calls kept per device; the rest are counted.
const MAX_DROP_ERRORS: usize = 64;

/// Errors of undo calls made in `Drop`, which cannot return them.
#[derive(Debug, Default)]
struct DropErrors {
    kept: Vec<Error>,
    more: u64,
}

/// One GPU and its primary context, retained while this value lives.
#[derive(Debug)]
pub struct Device {
    ordinal: u32,
    device: sys::CUdevice,
    context: sys::CUcontext,
    name: String,
    drop_errors: Mutex<DropErrors>,
}

// SAFETY: a CUDA context handle may be made current on any thread; the driver
// synchronises its own use of it.
unsafe impl Send for Device {}
// SAFETY: as above; `&Device` only hands out the handle to driver calls.
unsafe impl Sync for Device {}

impl Device {
    /// Opens GPU `ordinal`: a typed error, never a panic, when the driver or
    /// the device is missing.
    pub fn open(ordinal: u32) -> Result<Arc<Self>> {
        if !driver_present() {
            return Err(Error::NoDriver);
        }
        // SAFETY: the library is present (checked above); cuInit(0) is the
        // documented first call and is idempotent.
        check("cuInit", unsafe { sys::cuInit(0) })?;
        let mut count = 0;
        // SAFETY: writes one int.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&raw mut count)
        })?;
        let count = u32::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let mut device = 0;
        // SAFETY: `ordinal < count`, so it names a device; writes one handle.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&raw mut device, ordinal as i32)
        })?;
        let mut name = [0 as std::ffi::c_char; 128];
        // SAFETY: the buffer holds 128 bytes and the driver writes at most
        // `len` including the NUL.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), 128, device)
        })?;
        // SAFETY: NUL-terminated by the driver within the buffer.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut context = std::ptr::null_mut();
        // SAFETY: `device` came from cuDeviceGet; released in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&raw mut context, device)
        })?;
        let opened = Arc::new(Self {
            ordinal,
            device,
            context,
            name,
            drop_errors: Mutex::new(DropErrors::default()),
        });
        opened.bind()?;
        Ok(opened)
    }

    /// Makes this device's context current on the calling thread (cheap;
    /// every entry point that may run on a new thread calls it first).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for as long as `self` lives.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.context)
        })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The driver's CUDA version, e.g. 13000 for 13.0.
    pub fn driver_version(&self) -> Result<u32> {
        let mut version = 0;
        // SAFETY: writes one int.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&raw mut version)
        })?;
        Ok(u32::try_from(version).unwrap_or(0))
    }

    /// Streaming multiprocessors on the device.
    pub fn multiprocessors(&self) -> Result<u32> {
        let mut count = 0;
        // SAFETY: writes one int for a device from cuDeviceGet.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &raw mut count,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                self.device,
            )
        })?;
        Ok(u32::try_from(count).unwrap_or(1).max(1))
    }

    /// The widest pitch a 2D copy may use on the device
    /// (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`), in bytes.
    pub fn max_pitch(&self) -> Result<u64> {
        let mut pitch = 0;
        // SAFETY: writes one int for a device from cuDeviceGet.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &raw mut pitch,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH,
                self.device,
            )
        })?;
        Ok(u64::try_from(pitch).unwrap_or(0))
    }

    /// The device's name, as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Errors of the undo calls (free, unregister, destroy, unload) that
    /// handles of this device made in `Drop` since the last call, oldest
    /// first, at most 64; and how many more there were.
    pub fn take_drop_errors(&self) -> (Vec<Error>, u64) {
        let mut errors = self
            .drop_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let taken = std::mem::take(&mut *errors);
        (taken.kept, taken.more)
    }

    /// Records the outcome of an undo call made in `Drop` (or of binding the
    /// context for it): `Drop` cannot return an error, and dropping it
    /// silently would hide a leak or a lost context.
    fn record_drop(&self, outcome: Result<()>) {
        let Err(error) = outcome else { return };
        let mut errors = self
            .drop_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if errors.kept.len() < MAX_DROP_ERRORS {
            errors.kept.push(error);
        } else {
            errors.more += 1;
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // The one undo call whose error has nowhere to go: the device that
        // would record it is the value being dropped.
        // SAFETY: balances the retain in `open`; every object made in the
        // context holds an Arc<Device>, so none outlives it.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// A non-blocking stream, destroyed on drop.
#[derive(Debug)]
pub struct Stream {
    device: Arc<Device>,
    raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread with the context current.
unsafe impl Send for Stream {}

impl Stream {
    /// Creates a stream that does not synchronise with the legacy default one.
    pub fn new(device: &Arc<Device>) -> Result<Self> {
        device.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one handle; destroyed in Drop.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &raw mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(Self {
            device: Arc::clone(device),
            raw,
        })
    }

    /// Waits until everything queued on the stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    /// Queues one copy between any two addresses of the unified address space
    /// (device memory or mapped pinned host memory).
    ///
    /// # Safety
    /// Both ranges must stay valid, and nothing else may write them, until the
    /// stream is synchronised.
    pub unsafe fn copy_async(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(dst, src, len as usize, self.raw)
        })
    }
}

impl Stream {
    /// Queues one 2D copy between addresses of the unified address space:
    /// `height` rows of `width` bytes, row `i` from `src + i × src_pitch` to
    /// `dst + i × dst_pitch` (`cuMemcpy2DAsync`, the copy engines).
    ///
    /// # Safety
    /// As [`Stream::copy_async`], for every row.
    pub unsafe fn copy_rows_async(
        &self,
        (dst, dst_pitch): (u64, u64),
        (src, src_pitch): (u64, u64),
        width: u64,
        height: u64,
    ) -> Result<()> {
        let size = |value: u64| {
            usize::try_from(value).map_err(|_| Error::Layout {
                field: "rows",
                why: "has a size past the address space",
            })
        };
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: size(src_pitch)?,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: size(dst_pitch)?,
            WidthInBytes: size(width)?,
            Height: size(height)?,
        };
        // SAFETY: the descriptor is read during the call only; the caller
        // guarantees every row's ranges.
        check("cuMemcpy2DAsync", unsafe {
            sys::cuMemcpy2DAsync_v2(&raw const copy, self.raw)
        })
    }

    /// Queues many copies in one driver call (`cuMemcpyBatchAsync`, CUDA
    /// 12.8+), stream-ordered; `host_to_device` tells the driver which side
    /// is host memory.
    ///
    /// # Safety
    /// As [`Stream::copy_async`], for every `(dst, src, size)`.
    pub unsafe fn copy_batch_async(
        &self,
        device: &Device,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        host_to_device: bool,
    ) -> Result<()> {
        if dsts.is_empty() || dsts.len() != srcs.len() || dsts.len() != sizes.len() {
            return Err(Error::Layout {
                field: "batch",
                why: "needs equally many destinations, sources and sizes",
            });
        }
        let host = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        };
        let gpu = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.ordinal as i32,
        };
        let (src_hint, dst_hint) = if host_to_device {
            (host, gpu)
        } else {
            (gpu, host)
        };
        let mut attributes = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: src_hint,
            dstLocHint: dst_hint,
            flags: 0,
        }];
        let mut attribute_index = [0usize];
        let mut failed_at = usize::MAX;
        // SAFETY: the three arrays hold `len` entries each (checked above) and
        // are read during the call only; one attribute applies from copy 0;
        // the caller guarantees the ranges.
        check("cuMemcpyBatchAsync", unsafe {
            sys::cuMemcpyBatchAsync(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                dsts.len(),
                attributes.as_mut_ptr(),
                attribute_index.as_mut_ptr(),
                1,
                &raw mut failed_at,
                self.raw,
            )
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.device.record_drop(self.device.bind());
        // SAFETY: created in `new`, destroyed once; pending work still
        // completes (the driver defers the release).
        let status = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        self.device.record_drop(check("cuStreamDestroy", status));
    }
}

/// A timing event, destroyed on drop.
#[derive(Debug)]
pub struct Event {
    device: Arc<Device>,
    raw: sys::CUevent,
}

// SAFETY: an event handle may be used from any thread with the context current.
unsafe impl Send for Event {}

impl Event {
    /// Creates an event that records time.
    pub fn new(device: &Arc<Device>) -> Result<Self> {
        Self::with_flags(device, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
    }

    /// Creates an event that records time and whose [`Event::synchronize`]
    /// sleeps in the driver rather than spinning, whatever the context's
    /// scheduling flags (the engine's primary context is not ours to change).
    pub fn blocking(device: &Arc<Device>) -> Result<Self> {
        Self::with_flags(device, sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32)
    }

    fn with_flags(device: &Arc<Device>, flags: u32) -> Result<Self> {
        device.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one handle; destroyed in Drop.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&raw mut raw, flags)
        })?;
        Ok(Self {
            device: Arc::clone(device),
            raw,
        })
    }

    /// Waits until the work recorded before this event has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the handle is live.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: both handles are live.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw)
        })
    }

    /// Milliseconds from `start` to this event (both recorded and complete).
    pub fn since(&self, start: &Event) -> Result<f32> {
        let mut ms = 0.0f32;
        // SAFETY: both handles are live; writes one float.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime(&raw mut ms, start.raw, self.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        self.device.record_drop(self.device.bind());
        // SAFETY: created in `new`, destroyed once.
        let status = unsafe { sys::cuEventDestroy_v2(self.raw) };
        self.device.record_drop(check("cuEventDestroy", status));
    }
}

/// Loads the PTX `image` (NUL-terminated) into `device`'s context and
/// finds its entry `name`; the module is unloaded again if that fails.
fn load_function(
    device: &Arc<Device>,
    image: &'static str,
    name: &CStr,
) -> Result<(sys::CUmodule, sys::CUfunction)> {
    device.bind()?;
    let mut module = std::ptr::null_mut();
    // SAFETY: `image` is a NUL-terminated PTX text that lives for the
    // program; writes one handle, which the caller unloads in its Drop.
    let status = unsafe { sys::cuModuleLoadData(&raw mut module, image.as_ptr().cast()) };
    check("cuModuleLoadData", status).map_err(|e| Error::Kernel(e.to_string()))?;
    let mut function = std::ptr::null_mut();
    // SAFETY: the module is loaded; the name is NUL-terminated.
    let status = unsafe { sys::cuModuleGetFunction(&raw mut function, module, name.as_ptr()) };
    if let Err(e) = check("cuModuleGetFunction", status) {
        // SAFETY: unloads the module loaded above.
        let undone = unsafe { sys::cuModuleUnload(module) };
        device.record_drop(check("cuModuleUnload", undone));
        return Err(Error::Kernel(e.to_string()));
    }
    Ok((module, function))
}

/// The span-copy kernel (`kernel.ptx`), loaded into the device's context.
#[derive(Debug)]
pub struct CopyKernel {
    device: Arc<Device>,
    module: sys::CUmodule,
    function: sys::CUfunction,
}

// SAFETY: module and function handles may be used from any thread with the
// context current.
unsafe impl Send for CopyKernel {}
// SAFETY: launching only reads the handles.
unsafe impl Sync for CopyKernel {}

/// Threads per block: 512 × 4 vectors × 16 bytes = 32 KiB per loop trip.
pub const KERNEL_THREADS: u32 = 512;

impl CopyKernel {
    /// JIT-loads the kernel for `device`.
    pub fn load(device: &Arc<Device>) -> Result<Self> {
        let image = concat!(include_str!("kernel.ptx"), "\0");
        let (module, function) = load_function(device, image, c"kvcr_copy_spans")?;
        Ok(Self {
            device: Arc::clone(device),
            module,
            function,
        })
    }

    /// Queues one launch over `count` descriptors at device address
    /// `descriptors` (24 bytes each: src, dst, len).
    ///
    /// # Safety
    /// The descriptors must stay unchanged, and every range they name valid
    /// (and written by nothing else), until the stream is synchronised; every
    /// src, dst and len must be a multiple of 16.
    pub unsafe fn launch(&self, stream: &Stream, descriptors: u64, count: u32) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut descriptors = descriptors;
        let mut count_arg = count;
        let mut params: [*mut c_void; 2] =
            [(&raw mut descriptors).cast(), (&raw mut count_arg).cast()];
        // SAFETY: the parameter array matches the kernel's signature (u64,
        // u32), both values live across the call (the driver copies them at
        // launch); the caller guarantees the memory the kernel touches.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.function,
                count,
                1,
                1,
                KERNEL_THREADS,
                1,
                1,
                0,
                stream.raw,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for CopyKernel {
    fn drop(&mut self) {
        self.device.record_drop(self.device.bind());
        // SAFETY: loaded in `load`, unloaded once; copiers synchronise their
        // streams before dropping the kernel.
        let status = unsafe { sys::cuModuleUnload(self.module) };
        self.device.record_drop(check("cuModuleUnload", status));
    }
}

/// Which way a contiguous anchor copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Pinned host memory to the device.
    HostToDevice,
    /// The device to pinned host memory.
    DeviceToHost,
}

/// The anchor the batched copies are measured against: one contiguous copy
/// of `bytes` between pinned host memory and the device, timed on the GPU;
/// returns the median GB/s over `repeats` (after one warm-up).
pub fn contiguous_bandwidth(
    device: &Arc<Device>,
    bytes: usize,
    direction: Direction,
    repeats: usize,
) -> Result<f64> {
    let host = PinnedBuffer::allocate(device, bytes)?;
    let dev = DeviceBuffer::allocate(device, bytes)?;
    let stream = Stream::new(device)?;
    let (start, end) = (Event::new(device)?, Event::new(device)?);
    let (src, dst) = match direction {
        Direction::HostToDevice => (host.mapped(), dev.address()),
        Direction::DeviceToHost => (dev.address(), host.mapped()),
    };
    let mut samples = Vec::with_capacity(repeats);
    for round in 0..=repeats {
        start.record(&stream)?;
        // SAFETY: both buffers are owned here, `bytes` long, and alive until
        // after the synchronisation below.
        unsafe { stream.copy_async(dst, src, bytes as u64)? };
        end.record(&stream)?;
        stream.synchronize()?;
        if round > 0 {
            let ms = f64::from(end.since(&start)?);
            samples.push(bytes as f64 / (ms / 1e3) / 1e9);
        }
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples.get(samples.len() / 2).copied().unwrap_or(0.0))
}
