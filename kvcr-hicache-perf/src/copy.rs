//! The fast path's copies: a plan's transfers as raw memory copies between
//! addresses the caller has resolved and bounds-checked.
//!
//! Unsafe, named: the only place this crate writes memory.

/// One resolved copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawCopy {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u64,
}

/// Performs the copies in order.
///
/// # Safety
/// Every `src..src+len` must be valid for reads and every `dst..dst+len`
/// valid for writes for the whole call; no other thread may write a source
/// or access a destination during the call; no source overlaps a
/// destination.
pub(crate) unsafe fn copy_all(copies: &[RawCopy]) {
    for c in copies {
        // SAFETY: this function's contract.
        unsafe {
            std::ptr::copy_nonoverlapping(
                c.src as usize as *const u8,
                c.dst as usize as *mut u8,
                c.len as usize,
            );
        }
    }
}
