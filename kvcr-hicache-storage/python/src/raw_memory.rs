//! Unsafe, named: memory the extension owns (the legacy staging pool) and
//! byte copies between it and flat pages Python hands over by address.
//!
//! A flat page is a torch tensor; its address and length are read from the
//! tensor itself and checked against the tensor's storage (`args`), never
//! taken from the caller as integers, so a page range cannot run past the
//! tensor. What stays the caller's contract, stated on the Python calls and
//! relied on here: the tensor is kept alive, not resized and not freed until
//! the call returns (the call's own argument list holds a reference to it),
//! and nothing else reads or writes it meanwhile.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Alignment of owned buffers (a page of the MMU, so spans never straddle
/// more pages than they must).
const ALIGN: usize = 4096;

/// A zeroed, page-aligned allocation the extension owns.
#[derive(Debug)]
pub(crate) struct OwnedBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain bytes owned by this value; it is only ever
// accessed through raw copies whose callers serialise access to a given range
// (see `Staging`), so moving the owner between threads is sound.
unsafe impl Send for OwnedBuffer {}
// SAFETY: as above; `&OwnedBuffer` exposes only the address and length.
unsafe impl Sync for OwnedBuffer {}

impl OwnedBuffer {
    /// Allocates `len` zeroed bytes.
    pub(crate) fn zeroed(len: u64) -> Result<Self> {
        let size = usize::try_from(len).map_err(|_| Error::Allocation(len))?;
        if size == 0 {
            return Err(Error::Allocation(len));
        }
        let layout = Layout::from_size_align(size, ALIGN).map_err(|_| Error::Allocation(len))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(Error::Allocation(len))?;
        Ok(Self { ptr, layout })
    }

    /// The address of the first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.layout.size() as u64
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The memory of one flat page tensor: its address and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FlatPage {
    /// Address of the first byte (`tensor.data_ptr()`).
    pub(crate) addr: u64,
    /// `numel() * element_size()`, inside the tensor's storage.
    pub(crate) len: u64,
}

/// Copies the spans of one staged page into a flat page, in span order.
///
/// `spans` are `(offset, len)` pairs inside `buffer`, checked here; the flat
/// page must be at least their total length (checked here).
///
/// # Safety
/// `page.addr .. page.addr + page.len` must be writable memory that nothing
/// else reads or writes during the call (the contract in the module docs), and
/// no other thread may write the spans of `buffer` during the call.
pub(crate) unsafe fn gather_into(
    buffer: &OwnedBuffer,
    spans: &[(u64, u64)],
    page: FlatPage,
) -> Result<()> {
    let mut at = 0u64;
    for &(offset, len) in spans {
        check_span(buffer, offset, len)?;
        check_flat(page, at, len)?;
        // SAFETY: the source span lies inside `buffer` and the destination
        // range inside the flat page (both checked just above); the two never
        // overlap (one is ours, the other the caller's); the caller
        // guarantees exclusive access to both for the duration.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (buffer.addr() + offset) as *const u8,
                (page.addr + at) as *mut u8,
                len as usize,
            );
        }
        at += len;
    }
    Ok(())
}

/// Copies a flat page into the spans of one staged page, in span order.
///
/// # Safety
/// `page.addr .. page.addr + page.len` must be readable memory that nothing
/// writes during the call, and no other thread may read or write the spans of
/// `buffer` during the call.
pub(crate) unsafe fn scatter_from(
    buffer: &OwnedBuffer,
    spans: &[(u64, u64)],
    page: FlatPage,
) -> Result<()> {
    let mut at = 0u64;
    for &(offset, len) in spans {
        check_span(buffer, offset, len)?;
        check_flat(page, at, len)?;
        // SAFETY: as in `gather_into`, with the roles of the ranges swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (page.addr + at) as *const u8,
                (buffer.addr() + offset) as *mut u8,
                len as usize,
            );
        }
        at += len;
    }
    Ok(())
}

fn check_span(buffer: &OwnedBuffer, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= buffer.len() => Ok(()),
        _ => Err(Error::Argument(format!(
            "span {offset}+{len} outside the staging buffer of {} bytes",
            buffer.len()
        ))),
    }
}

fn check_flat(page: FlatPage, at: u64, len: u64) -> Result<()> {
    let fits = at.checked_add(len).is_some_and(|end| end <= page.len);
    if page.addr == 0 || !fits || page.addr.checked_add(page.len).is_none() {
        return Err(Error::Argument(format!(
            "flat page of {} bytes at {:#x} is too small or invalid",
            page.len, page.addr
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_then_gather_round_trips_and_bounds_are_checked() {
        let buffer = OwnedBuffer::zeroed(64).unwrap();
        let spans = [(32, 8), (0, 8)];
        let src: Vec<u8> = (1..=16).collect();
        let mut dst = vec![0u8; 16];
        let src_page = FlatPage {
            addr: src.as_ptr() as u64,
            len: 16,
        };
        let dst_page = FlatPage {
            addr: dst.as_mut_ptr() as u64,
            len: 16,
        };
        // SAFETY: both vectors live across the calls and nothing else touches them.
        unsafe {
            scatter_from(&buffer, &spans, src_page).unwrap();
            gather_into(&buffer, &spans, dst_page).unwrap();
        }
        assert_eq!(src, dst);
        let short = FlatPage {
            addr: dst.as_mut_ptr() as u64,
            len: 15,
        };
        // SAFETY: as above; the call must refuse before copying.
        assert!(unsafe { gather_into(&buffer, &spans, short) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { gather_into(&buffer, &[(60, 8)], dst_page) }.is_err());
    }
}
