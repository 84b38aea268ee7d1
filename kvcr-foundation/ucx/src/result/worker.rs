//! Worker routines: creation and destruction, progress and wakeup, its
//! address, its flush, and receiving active messages.
//!
//! Every routine here takes a worker created `UCS_THREAD_MODE_SINGLE`: the
//! caller must be the one thread that uses that worker, as each `# Safety`
//! section repeats.

use std::ffi::c_void;
use std::ptr;

use super::check;
use crate::error::{Error, Result};
use crate::status::UcsStatus;
use crate::sys;

/// `ucp_worker_create`.
///
/// # Safety
///
/// `context` is live; `params` is fully initialised, its `field_mask`
/// naming only fields it sets. The returned worker is destroyed with
/// [`destroy`] before the context is cleaned up.
#[inline]
pub(crate) unsafe fn create(
    context: sys::ucp_context_h,
    params: &sys::ucp_worker_params_t,
) -> Result<sys::ucp_worker_h> {
    let mut handle: sys::ucp_worker_h = ptr::null_mut();
    // SAFETY: the caller's contract covers `context` and `params`; `handle`
    // is a valid out-pointer.
    check("ucp_worker_create", unsafe {
        sys::ucp_worker_create(context, params, &mut handle)
    })?;
    Ok(handle)
}

/// `ucp_worker_destroy`.
///
/// # Safety
///
/// `worker` came from [`create`] and is destroyed exactly once, on its
/// thread, when no endpoint, request or held message buffer of it is left.
#[inline]
pub(crate) unsafe fn destroy(worker: sys::ucp_worker_h) {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_worker_destroy(worker) };
}

/// `ucp_worker_progress`: one round; how many events it handled. Completion,
/// error and receive callbacks run inside it.
///
/// # Safety
///
/// `worker` is live and this is its thread; the caller holds no borrow that
/// a callback of this worker may need (callbacks run inside the call).
#[inline]
pub(crate) unsafe fn progress(worker: sys::ucp_worker_h) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_worker_progress(worker) }
}

/// `ucp_worker_arm`: `Ok(true)` when armed (safe to sleep on the event fd),
/// `Ok(false)` when events are pending (`UCS_ERR_BUSY`: progress first).
///
/// # Safety
///
/// `worker` is live, this is its thread, and its context was created with
/// `UCP_FEATURE_WAKEUP`.
#[inline]
pub(crate) unsafe fn arm(worker: sys::ucp_worker_h) -> Result<bool> {
    // SAFETY: the caller's contract.
    match unsafe { sys::ucp_worker_arm(worker) } {
        sys::UCS_OK => Ok(true),
        sys::UCS_ERR_BUSY => Ok(false),
        other => Err(Error::Call {
            op: "ucp_worker_arm",
            status: UcsStatus::from_raw(other),
        }),
    }
}

/// `ucp_worker_get_efd`: the worker's event fd, owned by the worker (closed
/// by [`destroy`]).
///
/// # Safety
///
/// `worker` is live, this is its thread, and its context was created with
/// `UCP_FEATURE_WAKEUP`.
#[inline]
pub(crate) unsafe fn get_efd(worker: sys::ucp_worker_h) -> Result<libc::c_int> {
    let mut fd: libc::c_int = -1;
    // SAFETY: the caller's contract covers `worker`; `fd` is a valid
    // out-pointer.
    check("ucp_worker_get_efd", unsafe {
        sys::ucp_worker_get_efd(worker, &mut fd)
    })?;
    Ok(fd)
}

/// `ucp_worker_query`: fills the fields `attr.field_mask` asks for.
///
/// # Safety
///
/// `worker` is live and this is its thread; `attr` asks for nothing UCX
/// allocates (such as the address), which the caller would have to release.
#[inline]
pub(crate) unsafe fn query(
    worker: sys::ucp_worker_h,
    attr: &mut sys::ucp_worker_attr_t,
) -> Result<()> {
    // SAFETY: the caller's contract; `attr` is a valid, initialised struct.
    check("ucp_worker_query", unsafe {
        sys::ucp_worker_query(worker, attr)
    })
}

/// `ucp_worker_get_address`: the worker's packed address, as UCX's buffer
/// and its length. The buffer (when not null) is UCX's, released with
/// [`release_address`].
///
/// # Safety
///
/// `worker` is live and this is its thread.
#[inline]
pub(crate) unsafe fn get_address(
    worker: sys::ucp_worker_h,
) -> Result<(*mut sys::ucp_address_t, usize)> {
    let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
    let mut len: usize = 0;
    // SAFETY: the caller's contract covers `worker`; the out-pointers are
    // valid locals.
    check("ucp_worker_get_address", unsafe {
        sys::ucp_worker_get_address(worker, &mut addr, &mut len)
    })?;
    Ok((addr, len))
}

/// `ucp_worker_release_address`.
///
/// # Safety
///
/// `addr` is a non-null address from [`get_address`] on this `worker`
/// (live, on its thread), released exactly once and not read afterwards.
#[inline]
pub(crate) unsafe fn release_address(worker: sys::ucp_worker_h, addr: *mut sys::ucp_address_t) {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_worker_release_address(worker, addr) };
}

/// `ucp_worker_flush_nbx`: the status pointer as UCX returned it (null:
/// done; an error pointer; or a request in flight).
///
/// # Safety
///
/// `worker` is live and this is its thread; `param` is fully initialised,
/// and its callback and user data stay valid until UCX completes the
/// request (or the call returns without one).
#[inline]
pub(crate) unsafe fn flush_nbx(
    worker: sys::ucp_worker_h,
    param: &sys::ucp_request_param_t,
) -> sys::ucs_status_ptr_t {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_worker_flush_nbx(worker, param) }
}

/// `ucp_worker_set_am_recv_handler`: installs (or replaces) the receive
/// callback for one active-message id.
///
/// # Safety
///
/// `worker` is live and this is its thread; `params` is fully initialised,
/// its `field_mask` naming every field it sets; its `arg` stays valid for
/// the callback until the worker is destroyed (or the handler replaced).
#[inline]
pub(crate) unsafe fn set_am_recv_handler(
    worker: sys::ucp_worker_h,
    params: &sys::ucp_am_handler_param_t,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("ucp_worker_set_am_recv_handler", unsafe {
        sys::ucp_worker_set_am_recv_handler(worker, params)
    })
}

/// `ucp_am_data_release`: hands back a receive buffer a message callback
/// kept (by returning `UCS_INPROGRESS`).
///
/// # Safety
///
/// `data` is such a buffer of this `worker` (live, on its thread), not yet
/// released; it is released exactly once and not read afterwards.
#[inline]
pub(crate) unsafe fn am_data_release(worker: sys::ucp_worker_h, data: *mut c_void) {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_am_data_release(worker, data) };
}
