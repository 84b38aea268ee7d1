//! Memory registered for copies without `unsafe`: [`RegisteredMemory`], a
//! registry entry of owned memory that lasts as long as its handle;
//! [`SharedMemory`], one allocation owned together by the registry and a
//! UCX registration; and [`MemoryRegistry::lend`], borrowed buffers
//! registered for the length of a call.
//!
//! Why: the runner's pools are both copied through the
//! [`MemoryRegistry`] and (in peer mode)
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

impl MemoryRegistry {
    /// Registers borrowed buffers while `f` runs: `writable` ones for
    /// copies to write and read, `readable` ones for copies to read only
    /// (readable buffers may overlap each other; the same one twice is
    /// fine). Every range is removed again before this returns, or unwinds,
    /// once no copy through the registry is in flight, so no copy outlives
    /// the borrows. Refused (nothing registered, `f` not run) when a buffer
    /// overlaps a registered range.
    pub fn lend<R>(
        &self,
        writable: &mut [&mut [u8]],
        readable: &[&[u8]],
        f: impl FnOnce() -> R,
    ) -> Result<R> {
        let mut shared: Vec<(u64, u64)> = readable
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| {
                (
                    b.as_ptr() as usize as u64,
                    b.as_ptr() as usize as u64 + b.len() as u64,
                )
            })
            .collect();
        shared.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(shared.len());
        for (start, end) in shared {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        let mut lent = Lent {
            registry: self,
            bases: Vec::with_capacity(writable.len() + merged.len()),
        };
        for buffer in writable.iter_mut().filter(|b| !b.is_empty()) {
            let base = buffer.as_mut_ptr() as usize as u64;
            self.insert_range(base, buffer.len() as u64, None, true)?;
            lent.bases.push(base);
        }
        for (start, end) in merged {
            self.insert_range(start, end - start, None, false)?;
            lent.bases.push(start);
        }
        let out = f();
        drop(lent);
        Ok(out)
    }
}

/// Ranges lent by [`MemoryRegistry::lend`], removed when dropped.
struct Lent<'a> {
    registry: &'a MemoryRegistry,
    bases: Vec<u64>,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        for base in &self.bases {
            self.registry.remove(*base);
        }
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

    #[test]
    fn lent_buffers_are_registered_for_the_call_only() {
        let registry = MemoryRegistry::new();
        let mut into = vec![0u8; 64];
        let from = vec![7u8; 64];
        let (to, at) = (into.as_ptr() as u64, from.as_ptr() as u64);
        let copied = registry.lend(&mut [&mut into], &[&from, &from[8..16]], || {
            registry.copy([crate::ByteSpan::new(at, to, 64)]).unwrap();
            // A readable buffer is never written.
            assert!(registry.copy([crate::ByteSpan::new(to, at, 8)]).is_err());
            assert!(registry.write(at, &[1]).is_err());
        });
        assert!(copied.is_ok());
        assert_eq!(into, from);
        assert!(!registry.contains(to, 1) && !registry.contains(at, 1));
    }
}
