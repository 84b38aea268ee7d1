//! Library-level routines: the runtime version, the configuration a context
//! is read with, and the context itself (`ucp_init_version`, `ucp_cleanup`).

use std::ffi::CStr;
use std::ptr;

use super::check;
use crate::error::{Error, Result};
use crate::status::UcsStatus;
use crate::sys;

/// `ucp_get_version`: the runtime libucp version `(major, minor, release)`.
#[inline]
pub(crate) fn get_version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0u32, 0u32, 0u32);
    // SAFETY: `ucp_get_version` only writes three `unsigned` values through
    // the pointers, which point at live locals.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}

/// `ucp_config_read` with the default `UCX_` prefix and no file: the
/// configuration the process environment describes. The caller releases it
/// with [`config_release`] (a config never released only leaks).
#[inline]
pub(crate) fn config_read() -> Result<*mut sys::ucp_config_t> {
    let mut config: *mut sys::ucp_config_t = ptr::null_mut();
    // SAFETY: null prefix/file mean "UCX_ prefix, no file"; `config` is a
    // valid out-pointer.
    check("ucp_config_read", unsafe {
        sys::ucp_config_read(ptr::null(), ptr::null(), &mut config)
    })?;
    Ok(config)
}

/// `ucp_config_modify`: sets `name` (without the `UCX_` prefix) to `value`.
///
/// # Safety
///
/// `config` is a live configuration from [`config_read`], not yet released.
#[inline]
pub(crate) unsafe fn config_modify(
    config: *mut sys::ucp_config_t,
    name: &CStr,
    value: &CStr,
) -> Result<()> {
    // SAFETY: the caller passes a live config; both strings are
    // NUL-terminated and outlive the call (UCX copies them).
    check("ucp_config_modify", unsafe {
        sys::ucp_config_modify(config, name.as_ptr(), value.as_ptr())
    })
}

/// `ucp_config_release`.
///
/// # Safety
///
/// `config` came from [`config_read`] and is released exactly once; it is
/// not used afterwards.
#[inline]
pub(crate) unsafe fn config_release(config: *mut sys::ucp_config_t) {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_config_release(config) };
}

/// `ucp_init_version` against the API version of the bindings: a new
/// context, or an error named `ucp_init` (also when UCX reports success but
/// hands back no context).
///
/// # Safety
///
/// `params` is fully initialised, its `field_mask` naming only fields it
/// sets; `config` is a live configuration from [`config_read`]. UCX copies
/// what it needs, so the configuration may be released right after.
#[inline]
pub(crate) unsafe fn init(
    params: &sys::ucp_params_t,
    config: *mut sys::ucp_config_t,
) -> Result<sys::ucp_context_h> {
    let mut handle: sys::ucp_context_h = ptr::null_mut();
    // SAFETY: the caller's contract covers `params` and `config`; `handle`
    // is a valid out-pointer.
    check("ucp_init", unsafe {
        sys::ucp_init_version(
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR,
            params,
            config,
            &mut handle,
        )
    })?;
    if handle.is_null() {
        return Err(Error::Call {
            op: "ucp_init",
            status: UcsStatus::NoResource,
        });
    }
    Ok(handle)
}

/// `ucp_cleanup`.
///
/// # Safety
///
/// `context` came from [`init`] and is cleaned up exactly once, after every
/// worker, endpoint, rkey and registration made from it is gone.
#[inline]
pub(crate) unsafe fn cleanup(context: sys::ucp_context_h) {
    // SAFETY: the caller's contract.
    unsafe { sys::ucp_cleanup(context) };
}
