//! Memory this process owns for its pools: [`DramPool`] (page-aligned heap
//! memory, or a placed [`AnonMapping`]), and the NUMA queries an audit asks
//! about where pages went.
//!
//! Unsafe, named: `alloc_zeroed`/`dealloc`, `mmap`/`munmap`/`madvise`, the raw
//! `mbind`, `get_mempolicy` and `move_pages` syscalls (the crates.io NUMA
//! bindings do not build on current Rust; see ARCHITECTURE.md), and the
//! pre-faulting volatile writes.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{PoolMemoryReason, Result, SysError};
use crate::placement::{
    AnonymousMemory, HUGE_PAGE, HugePages, MASK_WORDS, NumaMode, PlacementDowngrade,
    PlacementOutcome, PoolMemory, nodemask, online_nodes, transparent_huge_page_mode,
};

const PAGE: usize = 4096;

/// Bytes of pool memory currently allocated by all runners in this process
/// (lets tests prove that failed startups and closes release everything).
static LIVE_POOL_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes of KVCR DRAM currently allocated in this process.
pub fn live_pool_bytes() -> u64 {
    LIVE_POOL_BYTES.load(Ordering::Relaxed)
}

/// Pools are page aligned so that DMA engines and huge pages can use them.
const POOL_ALIGN: usize = 4096;

/// A block of host DRAM owned by the runner, zeroed and (optionally) pre-faulted.
#[derive(Debug)]
pub struct DramPool {
    ptr: NonNull<u8>,
    layout: Layout,
    /// `Some`: the memory is this placed anonymous mapping (freed by its own
    /// drop), not a heap allocation.
    mapping: Option<AnonMapping>,
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
    pub fn allocate(bytes: u64, prefault: bool) -> Result<Self> {
        let failed = || SysError::Allocation { bytes };
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
    pub fn allocate_with(
        bytes: u64,
        prefault: bool,
        memory: &PoolMemory,
    ) -> Result<(Self, Option<PlacementOutcome>)> {
        let anon = match memory {
            PoolMemory::Default => {
                return Self::allocate(bytes, prefault).map(|p| (p, None));
            }
            PoolMemory::Anonymous(anon) => anon,
        };
        let (mapping, outcome) = AnonMapping::new(bytes, anon, prefault)?;
        let failed = || SysError::Allocation { bytes };
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
    pub fn base(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// Length in bytes (never 0: an empty pool is refused).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u64 {
        self.layout.size() as u64
    }
}

// SAFETY: a `DramPool` owns `base()..base() + len()`, valid and writable
// until it is dropped; moving the struct does not move the memory.
unsafe impl kvcr_ucx::OwnedMemory for DramPool {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn byte_len(&self) -> usize {
        self.layout.size()
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

/// A private anonymous mapping owned by this process (unmapped on drop).
#[derive(Debug)]
pub struct AnonMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is uniquely owned plain memory with no thread affinity.
unsafe impl Send for AnonMapping {}

// SAFETY: `&self` gives only the mapping's address and length; its bytes are
// touched only through raw copies whose callers arrange who writes what (a
// registry's, or UCX's), so sharing the handle between threads is sound.
unsafe impl Sync for AnonMapping {}

impl AnonMapping {
    /// Maps `bytes` (rounded up to a page), applies `memory`'s placement,
    /// then (with `prefault`) touches every page once.
    pub fn new(
        bytes: u64,
        memory: &AnonymousMemory,
        prefault: bool,
    ) -> Result<(Self, PlacementOutcome)> {
        let failed = || SysError::Allocation { bytes };
        let len = usize::try_from(bytes)
            .ok()
            .and_then(|b| b.checked_next_multiple_of(PAGE))
            .filter(|&b| b > 0)
            .ok_or_else(failed)?;
        let mut outcome = PlacementOutcome::default();
        // Validate the NUMA binding before mapping anything.
        let mask = match &memory.numa {
            Some(binding) => Some(nodemask(binding, &online_nodes())?),
            None => None,
        };
        let want_huge = memory.huge_pages != HugePages::Off;
        let mapping = Self::map(len, want_huge && len >= HUGE_PAGE)?;
        if want_huge {
            match mapping.advise_huge() {
                Ok(()) => outcome.huge_pages_advised = true,
                Err(why) if memory.huge_pages == HugePages::Require => {
                    return Err(PoolMemoryReason::HugePagesUnavailable(why).into());
                }
                Err(why) => outcome.downgrades.push(PlacementDowngrade::HugePages(why)),
            }
        }
        if let (Some(binding), Some(mask)) = (&memory.numa, mask) {
            mapping.bind(binding.mode, &mask)?;
            outcome.numa = Some(binding.clone());
        }
        if prefault {
            mapping.prefault();
        }
        Ok((mapping, outcome))
    }

    /// `mmap`s `len` bytes; `align_huge` aligns the start to a huge page (by
    /// mapping one huge page more and trimming), so THP can back all of it.
    fn map(len: usize, align_huge: bool) -> Result<Self> {
        let os = SysError::os;
        let extra = if align_huge { HUGE_PAGE } else { 0 };
        let total = len.checked_add(extra).ok_or(os("mmap"))?;
        // SAFETY: a fresh private anonymous mapping at an address the kernel
        // picks; no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os("mmap"));
        }
        let start = raw as usize;
        let aligned = if align_huge {
            start.next_multiple_of(HUGE_PAGE)
        } else {
            start
        };
        let head = aligned - start;
        let tail = extra - head;
        // SAFETY: both trims lie inside the mapping just made (head + len +
        // tail = total) and nothing references them.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + len) as *mut c_void, tail);
            }
        }
        let ptr = NonNull::new(aligned as *mut u8).ok_or(os("mmap"))?;
        Ok(Self { ptr, len })
    }

    fn advise_huge(&self) -> std::result::Result<(), &'static str> {
        match transparent_huge_page_mode().as_deref() {
            None => return Err("the kernel has no transparent huge pages"),
            Some("never") => return Err("transparent huge pages are disabled (never)"),
            Some(_) => {}
        }
        if self.len < HUGE_PAGE {
            return Err("the pool is smaller than one huge page");
        }
        // SAFETY: advice on exactly the mapping this struct owns.
        let rc = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_HUGEPAGE) };
        if rc == 0 {
            Ok(())
        } else {
            Err("madvise(MADV_HUGEPAGE) was refused")
        }
    }

    fn bind(&self, mode: NumaMode, mask: &[u64; MASK_WORDS]) -> Result<()> {
        // `maxnode` counts bits; the kernel reads one fewer than it is told.
        let maxnode = (MASK_WORDS * 64 + 1) as libc::c_ulong;
        // SAFETY: `mbind` on exactly the mapping this struct owns (no page is
        // touched yet), with a nodemask of `MASK_WORDS` words that outlives
        // the call; no flags, so nothing is moved.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.ptr.as_ptr(),
                self.len as libc::c_ulong,
                mode.mpol() as libc::c_ulong,
                mask.as_ptr(),
                maxnode,
                0 as libc::c_uint,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(SysError::os("mbind"))
        }
    }

    fn prefault(&self) {
        let mut offset = 0;
        while offset < self.len {
            // SAFETY: `offset < len`: inside the mapping, which nothing else
            // references yet; writing the zero already there faults the page
            // in (under the policy set above) without changing data.
            unsafe { self.ptr.as_ptr().add(offset).write_volatile(0) };
            offset += PAGE;
        }
    }

    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes (never 0: an empty mapping is refused).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for AnonMapping {
    fn drop(&mut self) {
        // SAFETY: exactly the (trimmed) mapping made in `map`, unmapped once.
        // Owners drop it only when no copy or transfer can touch it (the
        // runner's drop order; a UCX registration unmaps from UCX first).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

// SAFETY: `AnonMapping` owns `ptr..ptr+len`, valid and writable until it is
// dropped, and moving the struct does not move the mapping.
unsafe impl kvcr_ucx::OwnedMemory for AnonMapping {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.as_ptr()
    }

    fn byte_len(&self) -> usize {
        self.len
    }
}

/// `get_mempolicy` flag: `addr` names a mapping whose policy is wanted.
const MPOL_F_ADDR: libc::c_ulong = 2;

/// The kernel's NUMA policy for the mapping at `addr`: its `MPOL_*` mode and
/// the nodes of its nodemask. Read-only: no policy changes.
pub fn mempolicy_at(addr: u64) -> Result<(i32, Vec<u16>)> {
    let mut mode: libc::c_int = 0;
    let mut mask = [0u64; MASK_WORDS];
    // SAFETY: `mode` and `mask` are valid out-pointers for one int and
    // `MASK_WORDS` words (maxnode = their bit count); `addr` is only looked
    // up (MPOL_F_ADDR), never dereferenced by the kernel on our behalf.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            (MASK_WORDS * 64) as libc::c_ulong,
            addr as usize as *mut c_void,
            MPOL_F_ADDR,
        )
    };
    if rc != 0 {
        return Err(SysError::os("get_mempolicy"));
    }
    let nodes = (0..MASK_WORDS * 64)
        .filter(|&bit| {
            mask.get(bit / 64)
                .is_some_and(|w| w & (1 << (bit % 64)) != 0)
        })
        .filter_map(|bit| u16::try_from(bit).ok())
        .collect();
    Ok((mode, nodes))
}

/// Which node each of `pages` is on (`Err(errno)`: not present, etc.), by
/// `move_pages` in query mode: no page moves.
pub fn page_nodes(pages: &[u64]) -> Result<Vec<std::result::Result<u16, i32>>> {
    let ptrs: Vec<*mut c_void> = pages.iter().map(|&p| p as usize as *mut c_void).collect();
    let mut status = vec![0 as libc::c_int; ptrs.len()];
    // SAFETY: query mode (`nodes` is null): the kernel only reads `ptrs`
    // (`count` entries) and writes `status` (`count` ints); no page moves.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_int,
            ptrs.len() as libc::c_ulong,
            ptrs.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if rc < 0 {
        return Err(SysError::os("move_pages"));
    }
    Ok(status
        .into_iter()
        .map(|s| u16::try_from(s).map_err(|_| -s))
        .collect())
}

/// Advises the kernel not to back `memory` with transparent huge pages
/// (`madvise(MADV_NOHUGEPAGE)`), before its first touch: a buffer then
/// takes 4 KiB pages, as shared memory does. Safe: the advice changes no
/// byte (of `memory` or of the rest of its pages). The kernel refuses a
/// start that is not page-aligned (`EINVAL`).
pub fn advise_no_huge_pages(memory: &mut [MaybeUninit<u8>]) -> Result<()> {
    // SAFETY: advice on memory borrowed exclusively; NOHUGEPAGE changes
    // only how pages are backed, never their contents.
    let rc = unsafe {
        libc::madvise(
            memory.as_mut_ptr().cast(),
            memory.len(),
            libc::MADV_NOHUGEPAGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(SysError::os("madvise"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::MAX_NUMA_NODE;

    #[test]
    fn a_policy_the_kernel_refuses_is_a_typed_error() {
        // Bypass the online check: the kernel itself refuses a node it does
        // not have (EINVAL), and that surfaces as `Os { call: "mbind" }`.
        let missing = MAX_NUMA_NODE;
        assert!(!online_nodes().contains(&missing));
        let mapping = AnonMapping::map(1 << 20, false).unwrap();
        let mut mask = [0u64; MASK_WORDS];
        mask[usize::from(missing) / 64] = 1 << (missing % 64);
        let err = mapping.bind(NumaMode::Bind, &mask).unwrap_err();
        assert_eq!(
            err,
            SysError::PoolMemory(PoolMemoryReason::Os {
                call: "mbind",
                errno: libc::EINVAL
            })
        );
    }

    /// A pool is zeroed, page aligned and counted while it lives.
    #[test]
    fn a_pool_is_counted_while_it_lives() {
        let before = live_pool_bytes();
        let pool = DramPool::allocate(5000, true).unwrap();
        assert_eq!(pool.base() % 4096, 0);
        assert!(live_pool_bytes() >= before + pool.len());
        assert!(DramPool::allocate(0, false).is_err());
    }

    /// The policy of a fresh mapping is readable, and a mapped page is on a
    /// node the audit can name.
    #[test]
    fn numa_queries_answer_for_our_own_memory() {
        let pool = DramPool::allocate(1 << 20, true).unwrap();
        assert!(mempolicy_at(pool.base()).is_ok());
        let nodes = page_nodes(&[pool.base()]).unwrap();
        assert_eq!(nodes.len(), 1);
    }

    /// The advice takes a page-aligned range of a fresh buffer and refuses
    /// an unaligned start, leaving the bytes as they were.
    #[test]
    fn no_huge_page_advice() {
        let mut buf: Vec<u8> = Vec::with_capacity(4 * PAGE);
        let spare = buf.spare_capacity_mut();
        let skip = spare.as_ptr().align_offset(PAGE);
        let aligned = &mut spare[skip..skip + PAGE];
        assert_eq!(advise_no_huge_pages(aligned), Ok(()));
        let unaligned = &mut spare[skip + 1..skip + PAGE];
        assert_eq!(
            advise_no_huge_pages(unaligned),
            Err(SysError::PoolMemory(PoolMemoryReason::Os {
                call: "madvise",
                errno: libc::EINVAL
            }))
        );
        buf.resize(4 * PAGE, 7);
        assert!(buf.iter().all(|b| *b == 7));
    }
}
