//! Compat shim: removed once the split lands. The runner's DRAM pools and
//! copy kernels live in `kvcr_sys` ([`kvcr_sys::mapping`],
//! [`kvcr_sys::copy`]); this module keeps the crate-internal paths the
//! driver modules use (`memory::DramPool`, `memory::copy_spans`, ...) and
//! turns `kvcr_sys` errors into the runner's.
//!
//! The copy wrappers stay `unsafe fn` until their callers switch to
//! [`kvcr_sys::MemoryRegistry`]'s checked copies.

use kvcr_runner_core::CopySpan;
pub(crate) use kvcr_sys::copy::bytes_at;
use kvcr_sys::{ByteSpan, SysError};

use crate::error::{Error, PoolMemoryReason, Result, RunnerReason};
use crate::placement::{PlacementOutcome, PoolMemory};

impl From<SysError> for Error {
    fn from(error: SysError) -> Self {
        let pool_memory = |reason| Error::runner(RunnerReason::PoolMemory(reason));
        match error {
            SysError::Allocation { bytes } => Error::runner(RunnerReason::Allocation { bytes }),
            SysError::NoNodes => pool_memory(PoolMemoryReason::NoNodes),
            SysError::PreferredNeedsOneNode => pool_memory(PoolMemoryReason::PreferredNeedsOneNode),
            SysError::NoSuchNode { node, online } => {
                pool_memory(PoolMemoryReason::NoSuchNode { node, online })
            }
            SysError::HugePagesUnavailable(why) => {
                pool_memory(PoolMemoryReason::HugePagesUnavailable(why))
            }
            SysError::Os { call, errno } => pool_memory(PoolMemoryReason::Os { call, errno }),
            SysError::Grant { why } => Error::runner(RunnerReason::Config {
                field: "guard grant",
                why,
            }),
            SysError::Unregistered { .. } => Error::runner(RunnerReason::ClaimedCopy(
                "a span lies outside registered memory",
            )),
            SysError::Overlap => Error::runner(RunnerReason::ClaimedCopy(
                "a span's source and destination overlap",
            )),
            // `AlreadyRegistered`, and whatever a later kvcr-sys adds.
            _ => Error::runner(RunnerReason::Config {
                field: "memory registry",
                why: "a range overlaps a registered one",
            }),
        }
    }
}

/// Bytes of KVCR DRAM currently allocated in this process.
pub(crate) fn live_pool_bytes() -> u64 {
    kvcr_sys::mapping::live_pool_bytes()
}

/// A block of host DRAM owned by the runner ([`kvcr_sys::mapping::DramPool`]
/// with the runner's errors).
#[derive(Debug)]
pub(crate) struct DramPool(kvcr_sys::mapping::DramPool);

impl DramPool {
    /// Allocates `bytes`, backed as `memory` says.
    pub(crate) fn allocate_with(
        bytes: u64,
        prefault: bool,
        memory: &PoolMemory,
    ) -> Result<(Self, Option<PlacementOutcome>)> {
        let (pool, outcome) = kvcr_sys::mapping::DramPool::allocate_with(bytes, prefault, memory)?;
        Ok((Self(pool), outcome))
    }

    /// Address of the first byte.
    pub(crate) fn base(&self) -> u64 {
        self.0.base()
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.0.len()
    }
}

fn byte_span(span: &CopySpan) -> ByteSpan {
    ByteSpan::new(span.src, span.dst, span.len)
}

/// Performs the copies ([`kvcr_sys::copy::copy_spans`]).
///
/// # Safety
/// As [`kvcr_sys::copy::copy_spans`]: every range valid for the call,
/// nothing else touching a destination or writing a source, no span's
/// source overlapping its destination.
pub(crate) unsafe fn copy_spans(spans: &[CopySpan]) {
    // SAFETY: this function's contract is the kernel's.
    unsafe { kvcr_sys::copy::copy_spans(spans.iter().map(byte_span)) }
}

/// Large spans streamed ([`kvcr_sys::copy::copy_spans_streaming`]).
///
/// # Safety
/// As [`copy_spans`].
pub(crate) unsafe fn copy_spans_streaming(spans: &[CopySpan]) {
    // SAFETY: this function's contract is the kernel's.
    unsafe { kvcr_sys::copy::copy_spans_streaming(spans.iter().map(byte_span)) }
}
