//! Unsafe, named (with `copy`, `placement`, `shared_memory`, `lanes` and the
//! peer driver's event-fd and timer-slack calls): the DRAM pools the runner
//! owns and raw copies (plain, or streamed for peers' pages) between byte
//! ranges the region table has already validated.
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

/// Spans at least this long are streamed (see [`copy_spans_streaming`]).
const STREAM_MIN: u64 = 256 << 10;

/// Like [`copy_spans`], but spans of [`STREAM_MIN`] or more are written with
/// non-temporal stores, ending with a store fence. Why: glibc's `memcpy`
/// streams only above a threshold derived from the cache size, so on a host
/// with a large L3 a 16 MiB page is copied with ordinary stores, which read
/// every destination line first: 5.0 GB/s on the H200 host against 8.2 for
/// one 1 GiB `memcpy` (measured, one thread). A peer's page is read next by
/// the destination's restore, not by this thread, so caching it here buys
/// nothing.
///
/// # Safety
/// As [`copy_spans`].
pub(crate) unsafe fn copy_spans_streaming(spans: &[CopySpan]) {
    #[cfg(target_arch = "x86_64")]
    {
        for span in spans {
            let (src, dst) = (span.src as usize as *const u8, span.dst as usize as *mut u8);
            let len = span.len as usize;
            if span.len >= STREAM_MIN {
                // SAFETY: this function's contract, per span.
                unsafe { stream_copy(dst, src, len) };
            } else {
                // SAFETY: this function's contract, per span.
                unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            }
        }
        // Non-temporal stores are weakly ordered: fence them before anyone
        // is told the bytes are there. SSE2 is baseline on x86_64.
        // SAFETY: a store fence has no operands.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: this function's contract.
    unsafe {
        copy_spans(spans)
    };
}

/// Copies `len` bytes with 16-byte non-temporal stores into 64-byte aligned
/// destination lines (the unaligned head and tail with `memcpy`). The caller
/// fences.
///
/// # Safety
/// `src..src+len` valid for reads, `dst..dst+len` valid for writes, not
/// overlapping, neither accessed by anyone else during the call.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(64).min(len);
    // SAFETY: the first `head <= len` bytes of both ranges (the contract).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut offset = head;
    while offset + 64 <= len {
        // SAFETY: `offset..offset+64` lies inside both ranges (loop bound);
        // `dst + offset` is 64-byte aligned (after the head), as the
        // streaming store requires 16; loads are unaligned. SSE2 is
        // baseline on x86_64.
        unsafe {
            let s = src.add(offset).cast::<__m128i>();
            let d = dst.add(offset).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        offset += 64;
    }
    // SAFETY: the last `len - offset < 64` bytes of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(offset), dst.add(offset), len - offset) };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Streamed copies move exactly the span's bytes at every alignment of
    /// source and destination and every length around the line and stream
    /// thresholds, and nothing next to them.
    #[test]
    fn streamed_copies_are_exact_at_every_alignment() {
        let lens = [
            0,
            1,
            63,
            64,
            65,
            4095,
            STREAM_MIN as usize - 1,
            STREAM_MIN as usize,
            (1 << 20) + 37,
        ];
        for len in lens {
            for (src_off, dst_off) in [(0, 0), (3, 0), (0, 5), (17, 61), (64, 1)] {
                let src: Vec<u8> = (0..len + 128).map(|i| (i * 7 + len) as u8).collect();
                let mut dst = vec![0xEEu8; len + 128];
                let span = CopySpan {
                    src: src.as_ptr() as u64 + src_off,
                    dst: dst.as_mut_ptr() as u64 + dst_off,
                    len: len as u64,
                };
                // SAFETY: both ranges lie inside the two distinct vectors.
                unsafe { copy_spans_streaming(&[span]) };
                let (s, d) = (src_off as usize, dst_off as usize);
                assert!(dst[d..d + len] == src[s..s + len], "len {len} at {s}/{d}");
                assert!(dst[..d].iter().all(|b| *b == 0xEE), "before: len {len}");
                assert!(
                    dst[d + len..].iter().all(|b| *b == 0xEE),
                    "after: len {len}"
                );
            }
        }
    }
}
