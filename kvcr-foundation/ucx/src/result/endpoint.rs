//! Endpoint routines: connecting and closing, unpacking and destroying a
//! peer's rkey, and the data path (`ucp_put_nbx`, `ucp_am_send_nbx`,
//! `ucp_ep_flush_nbx`).
//!
//! Endpoints belong to a single-thread worker: every routine here must run
//! on that worker's thread, as each `# Safety` section repeats. The `*_nbx`
//! routines return UCX's status pointer untouched (null: done; an error
//! pointer; or a request in flight, see [`super::request`]).

use std::ffi::c_void;
use std::ptr;

use super::check;
use crate::error::Result;
use crate::sys;

/// `ucp_ep_create`.
///
/// # Safety
///
/// `worker` is live and this is its thread; `params` is fully initialised,
/// its `field_mask` naming only fields it sets; the address it points at
/// is readable for as long as UCX parses it (UCX 1.13 reads it without a
/// length) and stays alive across the call; an error handler's `arg` stays
/// valid for as long as the endpoint can exist.
#[inline]
pub(crate) unsafe fn create(
    worker: sys::ucp_worker_h,
    params: &sys::ucp_ep_params_t,
) -> Result<sys::ucp_ep_h> {
    let mut handle: sys::ucp_ep_h = ptr::null_mut();
    // SAFETY: the caller's contract covers `worker` and `params`; `handle`
    // is a valid out-pointer.
    check("ucp_ep_create", unsafe {
        sys::ucp_ep_create(worker, params, &mut handle)
    })?;
    Ok(handle)
}

/// `ucp_ep_close_nbx`.
///
/// # Safety
///
/// `ep` is live, on its worker's thread, and closed exactly once (not used
/// afterwards), after every rkey unpacked on it was destroyed; `param` is
/// fully initialised, with any callback and user data valid until the close
/// completes.
#[inline]
pub(crate) unsafe fn close_nbx(
    ep: sys::ucp_ep_h,
    param: &sys::ucp_request_param_t,
) -> sys::ucs_status_ptr_t {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_ep_close_nbx(ep, param) }
}

/// `ucp_ep_rkey_unpack`: a peer's packed rkey made usable on `ep`.
///
/// # Safety
///
/// `ep` is live, on its worker's thread; `packed` points at a packed rkey
/// readable for as long as UCX parses it (UCX 1.13 reads it without a
/// length), alive across the call (UCX copies what it keeps). The returned
/// rkey is destroyed with [`rkey_destroy`] before `ep` is closed.
#[inline]
pub(crate) unsafe fn rkey_unpack(
    ep: sys::ucp_ep_h,
    packed: *const c_void,
) -> Result<sys::ucp_rkey_h> {
    let mut handle: sys::ucp_rkey_h = ptr::null_mut();
    // SAFETY: the caller's contract covers `ep` and `packed`; `handle` is a
    // valid out-pointer.
    check("ucp_ep_rkey_unpack", unsafe {
        sys::ucp_ep_rkey_unpack(ep, packed, &mut handle)
    })?;
    Ok(handle)
}

/// `ucp_rkey_destroy`.
///
/// # Safety
///
/// `rkey` came from [`rkey_unpack`] on an endpoint that is still open, is
/// destroyed exactly once, and no operation that used it is unflushed.
#[inline]
pub(crate) unsafe fn rkey_destroy(rkey: sys::ucp_rkey_h) {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_rkey_destroy(rkey) };
}

/// `ucp_put_nbx`: copies `len` bytes at `src` into the peer's memory at
/// `remote_addr`.
///
/// # Safety
///
/// `ep` is live, on its worker's thread; `rkey` was unpacked on `ep` and
/// stays alive until the put completes; `src..src+len` is readable and
/// stays so (inside a live registration, given as `param`'s `memh` when
/// set) until the put completes locally; `remote_addr..+len` lies inside
/// the registration `rkey` describes; `param` is fully initialised, its
/// callback and user data valid until UCX completes the request.
#[inline]
pub(crate) unsafe fn put_nbx(
    ep: sys::ucp_ep_h,
    src: *const c_void,
    len: usize,
    remote_addr: u64,
    rkey: sys::ucp_rkey_h,
    param: &sys::ucp_request_param_t,
) -> sys::ucs_status_ptr_t {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_put_nbx(ep, src, len, remote_addr, rkey, param) }
}

/// `ucp_am_send_nbx`: an active message with `id`, a header and data
/// (`buffer`/`count` as `param`'s datatype says: contiguous bytes, or an
/// iov array of `count` entries).
///
/// # Safety
///
/// `ep` is live, on its worker's thread; `header` is null with length 0 or
/// `header_len` readable bytes; `buffer` is null with count 0 or describes
/// readable memory as `param`'s datatype says; the header, `buffer`, and
/// (for an iov array) every range it names stay valid and unchanged until
/// the send completes locally; `param` is fully initialised, its callback
/// and user data valid until UCX completes the request; `header_len` is at
/// most the worker's `max_am_header` (UCX 1.13 does not check it).
#[inline]
pub(crate) unsafe fn am_send_nbx(
    ep: sys::ucp_ep_h,
    id: u32,
    header: *const c_void,
    header_len: usize,
    buffer: *const c_void,
    count: usize,
    param: &sys::ucp_request_param_t,
) -> sys::ucs_status_ptr_t {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_am_send_nbx(ep, id, header, header_len, buffer, count, param) }
}

/// `ucp_ep_flush_nbx`: when its request completes `Ok`, every put issued
/// on `ep` before it is visible at the peer.
///
/// # Safety
///
/// `ep` is live, on its worker's thread; `param` is fully initialised, its
/// callback and user data valid until UCX completes the request.
#[inline]
pub(crate) unsafe fn flush_nbx(
    ep: sys::ucp_ep_h,
    param: &sys::ucp_request_param_t,
) -> sys::ucs_status_ptr_t {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_ep_flush_nbx(ep, param) }
}
