//! The `result` rung of the ladder: every call this crate makes into libucp
//! goes through here, one thin function per UCX routine.
//!
//! Each wrapper takes the routine's raw arguments (handles, parameter
//! structs, pointers), makes exactly one call, and turns a returned
//! `ucs_status_t` into the crate's [`Result`]: `UCS_OK` is `Ok` (with what
//! the routine wrote through its out-pointers), anything else an
//! [`Error::Call`] naming the routine. Non-blocking `*_nbx` routines return
//! their status pointer as UCX gave it: whether it is an immediate outcome or
//! a request in flight is decided by the operation layer
//! ([`request::ptr_is_err`], `crate::request::submit`), which owns the
//! request's callback and user data.
//!
//! A wrapper is `unsafe` when UCX's contract puts obligations on the caller
//! (live handles, the thread that owns a worker, memory that outlives the
//! call or the operation); its `# Safety` section says which. The safe
//! modules keep a `// SAFETY:` comment at each call, saying why they hold.
//! Nothing here allocates, and every wrapper is `#[inline]`: the data path
//! (put, flush, progress) costs what the bare call did.
//!
//! Grouped by the UCX object the routine acts on, as cudarc's
//! `driver/result.rs` groups its CUDA calls.

pub(crate) mod context;
pub(crate) mod endpoint;
pub(crate) mod memory;
pub(crate) mod request;
pub(crate) mod worker;

use crate::error::{Error, Result};
use crate::status::UcsStatus;
use crate::sys;

/// Maps a returned `ucs_status_t`: `UCS_OK` is `Ok`, anything else an
/// [`Error::Call`] naming `op`.
#[inline]
pub(crate) fn check(op: &'static str, raw: sys::ucs_status_t) -> Result<()> {
    if raw == sys::UCS_OK {
        Ok(())
    } else {
        Err(Error::Call {
            op,
            status: UcsStatus::from_raw(raw),
        })
    }
}
