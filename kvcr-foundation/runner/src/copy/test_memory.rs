//! Test support: buffers the tests copy between, registered in a
//! [`MemoryRegistry`] (as the runner's pools are), written and read through
//! it, as the runner's own copies are.

use std::sync::Arc;

use kvcr_sys::mapping::DramPool;
use kvcr_sys::{MemoryRegistry, RegisteredMemory};

/// One zeroed buffer, registered in a registry until dropped.
pub(crate) struct TestBuffer {
    registry: Arc<MemoryRegistry>,
    held: RegisteredMemory,
}

impl TestBuffer {
    /// `len` zeroed bytes registered in `registry`.
    pub(crate) fn new(registry: &Arc<MemoryRegistry>, len: usize) -> Self {
        let pool = DramPool::allocate(len as u64, false).expect("test memory");
        let held = registry.hold(Arc::new(pool)).expect("registered");
        Self {
            registry: Arc::clone(registry),
            held,
        }
    }

    /// `len` zeroed bytes holding `bytes` from its start.
    pub(crate) fn with(registry: &Arc<MemoryRegistry>, len: usize, bytes: &[u8]) -> Self {
        let buffer = Self::new(registry, len);
        buffer.write(0, bytes);
        buffer
    }

    /// Address of the first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.held.base()
    }

    /// Writes `bytes` at `offset`.
    pub(crate) fn write(&self, offset: usize, bytes: &[u8]) {
        self.registry
            .write(self.addr() + offset as u64, bytes)
            .expect("inside the buffer");
    }

    /// The first `len` bytes.
    pub(crate) fn read(&self, len: usize) -> Vec<u8> {
        self.registry
            .read(self.addr(), len as u64)
            .expect("inside the buffer")
    }
}
