//! Memory this process owns, registered for copies: [`RegisteredMemory`],
//! a registry entry that lasts as long as its handle, and [`SharedMemory`],
//! one allocation owned together by the registry and a UCX registration.
//!
//! Why: the runner's pools are both copied through the
//! [`MemoryRegistry`](crate::copy::MemoryRegistry) and (in peer mode)
//! registered with UCX, and each must keep the bytes alive for as long as
//! it may touch them. With both holding one `Arc`, the memory is freed
//! after the last of them lets go, and forgetting either (a runner that
//! keeps its pools mapped until exit) keeps it forever. No `unsafe` is
//! needed to register it: [`kvcr_ucx::OwnedMemory`]'s contract is that the
//! bytes stay valid while the value lives.

use std::sync::Arc;

use kvcr_ucx::OwnedMemory;

use crate::copy::MemoryRegistry;
use crate::error::Result;

/// Owned memory, shared between owners that each keep it alive.
pub type SharedOwner = Arc<dyn OwnedMemory + Send + Sync>;

/// A range of owned memory registered in a registry: dropping the handle
/// removes the range (once no copy through the registry is in flight) and
/// releases the registry's hold on the memory.
#[derive(Debug)]
pub struct RegisteredMemory {
    registry: Arc<MemoryRegistry>,
    base: u64,
    len: u64,
}

impl RegisteredMemory {
    /// Address of the first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Length in bytes (never 0).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for RegisteredMemory {
    fn drop(&mut self) {
        self.registry.remove(self.base);
    }
}

impl MemoryRegistry {
    /// Registers `memory` ([`MemoryRegistry::insert_owned`]) until the
    /// returned handle is dropped.
    pub fn hold(self: &Arc<Self>, memory: SharedOwner) -> Result<RegisteredMemory> {
        let base = memory.as_mut_ptr() as usize as u64;
        let len = memory.byte_len() as u64;
        self.insert_owned(memory)?;
        Ok(RegisteredMemory {
            registry: Arc::clone(self),
            base,
            len,
        })
    }
}

/// One owner's share of memory whose other owners may live elsewhere (a
/// registry entry): hand it to [`kvcr_ucx::Context::register_owned`] and
/// the registration keeps the memory alive as long as it needs it.
pub struct SharedMemory(SharedOwner);

impl SharedMemory {
    /// A share of `memory`.
    pub fn new(memory: SharedOwner) -> Self {
        Self(memory)
    }
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("base", &self.0.as_mut_ptr())
            .field("len", &self.0.byte_len())
            .finish()
    }
}

// SAFETY: the `Arc` keeps the shared value alive while this share lives, and
// that value is `OwnedMemory` itself: the same valid, writable bytes on
// every call, not moved when the `Arc` (or this share) is moved.
unsafe impl OwnedMemory for SharedMemory {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.0.as_mut_ptr()
    }

    fn byte_len(&self) -> usize {
        self.0.byte_len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::DramPool;

    #[test]
    fn a_held_range_is_registered_until_its_handle_drops() {
        let registry = Arc::new(MemoryRegistry::new());
        let pool: SharedOwner = Arc::new(DramPool::allocate(8192, false).unwrap());
        let held = registry.hold(Arc::clone(&pool)).unwrap();
        assert!(registry.contains(held.base(), held.len()));
        let share = SharedMemory::new(pool);
        assert_eq!(share.as_mut_ptr() as u64, held.base());
        let base = held.base();
        drop(held);
        assert!(!registry.contains(base, 1));
        // The share still owns the bytes: they can be held again.
        let again = registry.hold(share.0).unwrap();
        assert_eq!(again.base(), base);
    }
}
