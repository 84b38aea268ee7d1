//! Memory registration (`ucp_mem_map`, `ucp_mem_unmap`) and packing an
//! rkey for a peer (`ucp_rkey_pack`).

use std::ffi::c_void;
use std::ptr;

use super::check;
use crate::error::Result;
use crate::sys;

/// `ucp_mem_map`: registers the region `params` describes; returns its
/// `memh`.
///
/// # Safety
///
/// `context` is live; `params` is fully initialised, its `field_mask`
/// naming only fields it sets, and names a host region that stays valid
/// (allocated, not freed or unmapped) until [`mem_unmap`] of the returned
/// handle.
#[inline]
pub(crate) unsafe fn mem_map(
    context: sys::ucp_context_h,
    params: &sys::ucp_mem_map_params_t,
) -> Result<sys::ucp_mem_h> {
    let mut memh: sys::ucp_mem_h = ptr::null_mut();
    // SAFETY: the caller's contract covers `context` and `params`; `memh` is
    // a valid out-pointer.
    check("ucp_mem_map", unsafe {
        sys::ucp_mem_map(context, params, &mut memh)
    })?;
    Ok(memh)
}

/// `ucp_mem_unmap`.
///
/// # Safety
///
/// `memh` came from [`mem_map`] on `context` (still live) and is unmapped
/// exactly once, when no operation from or into the region is in flight.
#[inline]
pub(crate) unsafe fn mem_unmap(context: sys::ucp_context_h, memh: sys::ucp_mem_h) -> Result<()> {
    // SAFETY: the caller's contract.
    check("ucp_mem_unmap", unsafe {
        sys::ucp_mem_unmap(context, memh)
    })
}

/// `ucp_rkey_pack`: the packed rkey of a registration, as UCX's buffer and
/// its length. The buffer (when not null) is UCX's, released with
/// [`rkey_buffer_release`].
///
/// # Safety
///
/// `context` is live and `memh` is a live registration of it (not unmapped).
#[inline]
pub(crate) unsafe fn rkey_pack(
    context: sys::ucp_context_h,
    memh: sys::ucp_mem_h,
) -> Result<(*mut c_void, usize)> {
    let mut buf: *mut c_void = ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the caller's contract covers `context` and `memh`; the
    // out-pointers are valid locals.
    check("ucp_rkey_pack", unsafe {
        sys::ucp_rkey_pack(context, memh, &mut buf, &mut size)
    })?;
    Ok((buf, size))
}

/// `ucp_rkey_buffer_release`.
///
/// # Safety
///
/// `buf` is a non-null buffer from [`rkey_pack`], released exactly once and
/// not read afterwards.
#[inline]
pub(crate) unsafe fn rkey_buffer_release(buf: *mut c_void) {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_rkey_buffer_release(buf) };
}
