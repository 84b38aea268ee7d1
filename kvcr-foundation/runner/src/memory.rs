//! Unsafe, named (with `copy`, `placement` and the peer driver's event-fd
//! and timer-slack calls): the DRAM pools the runner owns and raw copies
//! between byte ranges the region table has already validated.
//!
//! Everything above this module works with plain addresses (`u64`) that the
//! pure `RegionTable` of `kvcr-runner-core` bounds-checks against registrations;
//! this module turns validated addresses into memory accesses.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use kvcr_runner_core::CopySpan;

use crate::error::{Error, Result, RunnerReason};

/// Bytes of pool memory currently allocated by all runners in this process
/// (lets tests prove that failed startups and closes release everything).
static LIVE_POOL_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes of KVCR DRAM currently allocated in this process.
pub(crate) fn live_pool_bytes() -> u64 {
    LIVE_POOL_BYTES.load(Ordering::Relaxed)
}

/// Pools are page aligned so that DMA engines and huge pages can use them.
const POOL_ALIGN: usize = 4096;

/// A block of host DRAM owned by the runner, zeroed and (optionally) pre-faulted.
#[derive(Debug)]
pub(crate) struct DramPool {
    ptr: NonNull<u8>,
    layout: Layout,
    /// `Some`: the memory is this placed anonymous mapping (freed by its own
    /// drop), not a heap allocation.
    mapping: Option<super::placement::AnonMapping>,
}

// SAFETY: a DramPool is a uniquely owned heap allocation with no thread
// affinity; moving it between threads moves ownership of plain bytes.
unsafe impl Send for DramPool {}
// SAFETY: a shared `&DramPool` exposes only `base()` and `len()`, plain
// integers; the bytes behind the pointer are touched only by copies of spans
// the core validated (never through a reference to the pool), and the memory
// is freed only by `Drop`, which takes `&mut self`. So `Runner` can be shared
// by the engine's threads (`&self` API) without a second lock.
unsafe impl Sync for DramPool {}

impl DramPool {
    /// Allocates `bytes` (rounded up to a page) of zeroed memory; with
    /// `prefault`, touches every page once so the first copy into the pool
    /// does not pay the page-fault cost (~1.4 GB/s here, against ~11 GB/s warm).
    pub(crate) fn allocate(bytes: u64, prefault: bool) -> Result<Self> {
        let failed = || Error::runner(RunnerReason::Allocation { bytes });
        let size = usize::try_from(bytes).map_err(|_| failed())?;
        if size == 0 {
            return Err(failed());
        }
        let layout = Layout::from_size_align(size, POOL_ALIGN).map_err(|_| failed())?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(failed)?;
        let pool = Self {
            ptr,
            layout,
            mapping: None,
        };
        LIVE_POOL_BYTES.fetch_add(pool.len(), Ordering::Relaxed);
        if prefault {
            pool.prefault();
        }
        Ok(pool)
    }

    /// Like [`Self::allocate`], backed as `memory` says.
    pub(crate) fn allocate_with(
        bytes: u64,
        prefault: bool,
        memory: &super::placement::PoolMemory,
    ) -> Result<(Self, Option<super::placement::PlacementOutcome>)> {
        let anon = match memory {
            super::placement::PoolMemory::Default => {
                return Self::allocate(bytes, prefault).map(|p| (p, None));
            }
            super::placement::PoolMemory::Anonymous(anon) => anon,
        };
        let (mapping, outcome) = super::placement::AnonMapping::new(bytes, anon, prefault)?;
        let failed = || Error::runner(RunnerReason::Allocation { bytes });
        let layout = Layout::from_size_align(mapping.len(), POOL_ALIGN).map_err(|_| failed())?;
        let ptr = NonNull::new(mapping.as_ptr()).ok_or_else(failed)?;
        let pool = Self {
            ptr,
            layout,
            mapping: Some(mapping),
        };
        LIVE_POOL_BYTES.fetch_add(pool.len(), Ordering::Relaxed);
        Ok((pool, Some(outcome)))
    }

    fn prefault(&self) {
        let mut offset = 0;
        while offset < self.layout.size() {
            // SAFETY: `offset < size`, so the byte is inside our allocation,
            // which nothing else references yet. A volatile write of the value
            // already there (zero) forces the page in without changing data.
            unsafe { self.ptr.as_ptr().add(offset).write_volatile(0) };
            offset += POOL_ALIGN;
        }
    }

    /// Address of the first byte.
    pub(crate) fn base(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.layout.size() as u64
    }
}

impl Drop for DramPool {
    fn drop(&mut self) {
        if self.mapping.is_none() {
            // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed
            // once. The runner drops pools only after its copy engine has
            // stopped, so no copy can still touch this memory (see `Runner`'s
            // field order). A mapping is unmapped by its own drop, after this.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
        }
        LIVE_POOL_BYTES.fetch_sub(self.len(), Ordering::Relaxed);
    }
}

/// Performs the copies.
///
/// # Safety
/// 1. Every `src..src+len` range must be valid for reads and every
///    `dst..dst+len` range valid for writes for the duration of the call.
/// 2. No other thread may access a destination range, or write a source range,
///    during the call.
/// 3. A span's source and destination ranges must not overlap.
pub(crate) unsafe fn copy_spans(spans: &[CopySpan]) {
    for span in spans {
        let len = span.len as usize;
        // SAFETY: guaranteed by this function's contract (1)-(3): both ranges
        // are valid, not concurrently accessed, and do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                span.src as usize as *const u8,
                span.dst as usize as *mut u8,
                len,
            );
        }
    }
}

/// Borrows `len` bytes at `addr`.
///
/// # Safety
/// `addr..addr+len` must be valid for reads for `'a`, and nothing may write it
/// during `'a`.
pub(crate) unsafe fn bytes_at<'a>(addr: u64, len: u64) -> &'a [u8] {
    // SAFETY: guaranteed by this function's contract.
    unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) }
}
