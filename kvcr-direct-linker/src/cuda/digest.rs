//! The page-digest kernel (`digest.ptx`): xxh3-64 of each page of a device
//! deposit, taken from the device's own bytes while the copy engines move
//! them, so the runner need not read the pages back from DRAM (see
//! `kvcr_sys::digest::device` for the walk and its constants).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{Device, Stream, check, load_function};
use crate::error::Result;

/// Bytes of a page's spans the kernel walks at a time: every span must be a
/// whole number of them.
pub const DIGEST_BLOCK_BYTES: u64 = kvcr_foundation::sys::digest::device::BLOCK_BYTES;

/// Pages per 128-thread block (a warp each).
const PAGES_PER_BLOCK: u32 = 4;

/// The digest kernel, loaded into the device's context.
#[derive(Debug)]
pub struct DigestKernel {
    device: Arc<Device>,
    module: sys::CUmodule,
    function: sys::CUfunction,
}

// SAFETY: module and function handles may be used from any thread with the
// context current.
unsafe impl Send for DigestKernel {}
// SAFETY: launching only reads the handles.
unsafe impl Sync for DigestKernel {}

/// The kernel's text (the PTX its constants table is checked in).
pub(crate) const DIGEST_PTX: &str = concat!(include_str!("../digest.ptx"), "\0");

impl DigestKernel {
    /// JIT-loads the kernel for `device`.
    pub fn load(device: &Arc<Device>) -> Result<Self> {
        let (module, function) = load_function(device, DIGEST_PTX, c"kvcr_digest_pages")?;
        Ok(Self {
            device: Arc::clone(device),
            module,
            function,
        })
    }

    /// Queues one launch over `count` pages whose descriptors (24 bytes
    /// each: the device address of its spans, `{address, length}` 16 bytes
    /// each; how many; their total length) start at device address `pages`,
    /// writing each page's digest to the word of `out` at its index.
    ///
    /// # Safety
    /// The descriptors and span lists must stay unchanged, every span they
    /// name readable device memory, 16-byte aligned and a whole number of
    /// [`DIGEST_BLOCK_BYTES`] long (a page at least one block), and `out`
    /// writable for `count` words, until the stream is synchronised.
    pub unsafe fn launch(&self, stream: &Stream, pages: u64, count: u32, out: u64) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let (mut pages, mut count_arg, mut out) = (pages, count, out);
        let mut params: [*mut c_void; 3] = [
            (&raw mut pages).cast(),
            (&raw mut count_arg).cast(),
            (&raw mut out).cast(),
        ];
        // SAFETY: the parameter array matches the kernel's signature (u64,
        // u32, u64), the values live across the call (the driver copies
        // them at launch); the caller guarantees the memory it touches.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.function,
                count.div_ceil(PAGES_PER_BLOCK),
                1,
                1,
                32 * PAGES_PER_BLOCK,
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

impl Drop for DigestKernel {
    fn drop(&mut self) {
        self.device.record_drop(self.device.bind());
        // SAFETY: loaded in `load`, unloaded once; the copier synchronises
        // its stream before dropping the kernel.
        let status = unsafe { sys::cuModuleUnload(self.module) };
        self.device.record_drop(check("cuModuleUnload", status));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table in the PTX is kvcr-sys's, word for word (the CPU test
    /// there holds the walk and the table to xxh3).
    #[test]
    fn the_kernels_table_is_the_device_key_table() {
        let start = DIGEST_PTX.find("kvcr_xxh3_keys[160] = {").unwrap();
        let body = &DIGEST_PTX[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find('}').unwrap()];
        let words: Vec<u64> = body
            .split(',')
            .map(|w| w.trim().trim_start_matches("0x").trim_end_matches('U'))
            .map(|w| u64::from_str_radix(w, 16).unwrap())
            .collect();
        let want = kvcr_foundation::sys::digest::device::device_key_table();
        assert_eq!(words, want.to_vec());
    }
}
