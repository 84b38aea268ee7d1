//! Requests and status pointers: what a `*_nbx` routine returns
//! (`UCS_PTR_IS_ERR`, `UCS_PTR_RAW_STATUS`), polling and freeing a request,
//! and UCX's own text for a status.

use std::ffi::c_void;

use crate::sys;

/// `UCS_PTR_IS_ERR`: a status pointer that encodes an error code.
#[inline]
pub(crate) fn ptr_is_err(p: sys::ucs_status_ptr_t) -> bool {
    (p as usize) >= (sys::UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_RAW_STATUS`: the code inside an error status pointer.
#[inline]
pub(crate) fn ptr_status(p: sys::ucs_status_ptr_t) -> i8 {
    // Error pointers hold a small negative integer; truncation is the macro's.
    (p as isize) as i8
}

/// `ucp_request_check_status`: the raw status of a request
/// (`UCS_INPROGRESS` while in flight).
///
/// # Safety
///
/// `request` is a live request returned by a `*_nbx` routine, not yet
/// freed, polled on its worker's thread.
#[inline]
pub(crate) unsafe fn check_status(request: *mut c_void) -> sys::ucs_status_t {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_request_check_status(request) }
}

/// `ucp_request_free`: gives a request back to UCX; a request still in
/// flight is finished by UCX without its caller.
///
/// # Safety
///
/// `request` is a live request returned by a `*_nbx` routine, freed exactly
/// once (for example from its own completion callback), on its worker's
/// thread, and not used afterwards.
#[inline]
pub(crate) unsafe fn free(request: *mut c_void) {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_request_free(request) };
}

/// `ucs_status_string`: UCX's own text for a status.
///
/// # Safety
///
/// For a code UCX 1.13 does not know, the text is formatted into a static
/// buffer: no other thread may call `ucs_status_string` with such a code
/// while the returned string is read.
#[cfg(test)]
#[inline]
pub(crate) unsafe fn status_string(raw: sys::ucs_status_t) -> &'static std::ffi::CStr {
    // SAFETY: UCX returns a NUL-terminated string it never frees (a literal,
    // or the static buffer the caller's contract guards).
    unsafe { std::ffi::CStr::from_ptr(sys::ucs_status_string(raw)) }
}
