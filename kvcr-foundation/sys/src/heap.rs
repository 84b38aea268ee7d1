//! A global allocator that counts live heap bytes, for benchmarks that
//! measure memory per item: install it with `#[global_allocator] static
//! ALLOC: CountingAllocator = CountingAllocator::new();` (no `unsafe` at the
//! use site) and read [`CountingAllocator::live_bytes`] before and after.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

/// The system allocator, counting the bytes allocated and not yet freed.
#[derive(Debug, Default)]
pub struct CountingAllocator {
    live: AtomicI64,
}

impl CountingAllocator {
    /// A counter at zero (const, for a `static`).
    pub const fn new() -> Self {
        Self {
            live: AtomicI64::new(0),
        }
    }

    /// Bytes allocated through this allocator and not freed (negative if
    /// memory allocated elsewhere was freed through it).
    pub fn live_bytes(&self) -> i64 {
        self.live.load(Ordering::Relaxed)
    }

    fn add(&self, bytes: i64) {
        self.live.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// A size as a signed count (a `Layout`'s size never exceeds `isize::MAX`).
fn signed(bytes: usize) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

// SAFETY: every call is forwarded unchanged to the system allocator, which
// upholds `GlobalAlloc`'s contract; the counting touches only an atomic
// and never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.add(signed(layout.size()));
        // SAFETY: forwarded with the caller's layout (non-zero size, the
        // caller's promise).
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        self.add(-signed(layout.size()));
        // SAFETY: forwarded with the caller's pointer and layout, which came
        // from this allocator, that is from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.add(signed(layout.size()));
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.add(signed(new_size) - signed(layout.size()));
        // SAFETY: forwarded unchanged; `ptr` came from `System` (as above).
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_is_live() {
        let heap = CountingAllocator::new();
        let layout = Layout::from_size_align(100, 8).unwrap();
        // SAFETY: a non-zero layout.
        let first = unsafe { heap.alloc(layout) };
        // SAFETY: as above.
        let second = unsafe { heap.alloc_zeroed(layout) };
        assert!(!first.is_null() && !second.is_null());
        assert_eq!(heap.live_bytes(), 200);
        // SAFETY: `first` came from `heap.alloc(layout)`; 300 is non-zero.
        let grown = unsafe { heap.realloc(first, layout, 300) };
        assert!(!grown.is_null());
        assert_eq!(heap.live_bytes(), 400);
        // SAFETY: each pointer with the layout it now has, freed once.
        unsafe {
            heap.dealloc(grown, Layout::from_size_align(300, 8).unwrap());
            heap.dealloc(second, layout);
        }
        assert_eq!(heap.live_bytes(), 0);
    }

    #[test]
    fn starts_at_zero() {
        static HEAP: CountingAllocator = CountingAllocator::new();
        assert_eq!(HEAP.live_bytes(), 0);
        assert_eq!(CountingAllocator::default().live_bytes(), 0);
    }
}
