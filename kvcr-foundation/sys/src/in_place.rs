//! Registered memory lent to a caller's function for the length of one
//! call: read into a buffer of the caller's, or changed in place. A data
//! stream's records use it: a source copies a record's plaintext out of its
//! pool into the buffer it seals, and a target opens a record in the
//! granted slots its ciphertext was read into (one pass over bytes that
//! are still cached, no copy).

use crate::copy::{MemoryRegistry, bytes_at, holds, holds_writable};
use crate::error::{Result, SysError};

impl MemoryRegistry {
    /// Copies the registered `into.len()` bytes at `addr` into `into`.
    pub fn read_into(&self, addr: u64, into: &mut [u8]) -> Result<()> {
        let len = into.len() as u64;
        let ranges = self.read_lock();
        if !holds(&ranges, addr, len) {
            return Err(SysError::Unregistered { addr, len });
        }
        // SAFETY: the range is registered (checked under the lock, held
        // until the copy is made), so valid for reads; writers of it are the
        // caller's protocol; `into` is a borrowed slice, which registered
        // memory never backs, so they do not overlap.
        into.copy_from_slice(unsafe { bytes_at(addr, len) });
        drop(ranges);
        Ok(())
    }

    /// Calls `change` with the registered, writable `len` bytes at `addr`
    /// as a slice, for the length of the call, and returns what it
    /// returns. The caller's protocol must give it those bytes alone for
    /// the call (as for a copy into them).
    pub fn with_writable<R>(
        &self,
        addr: u64,
        len: u64,
        change: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        let ranges = self.read_lock();
        if !holds_writable(&ranges, addr, len) {
            return Err(SysError::Unregistered { addr, len });
        }
        // SAFETY: the range is registered writable (checked under the lock,
        // held until `change` returns, so it is not removed meanwhile) and
        // so valid for reads and writes of `len` bytes; nothing else touches
        // it during the call (the caller's protocol, as for any copy into
        // registered memory); the slice lives only for the call (`change`
        // cannot keep it: it is lent for the call's duration alone).
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, len as usize) };
        let changed = change(bytes);
        drop(ranges);
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use crate::MemoryRegistry;
    use crate::SysError;

    /// A registered buffer of `len` bytes, each its index modulo 251.
    fn registered(memory: &MemoryRegistry, len: usize) -> Vec<u8> {
        let mut buffer: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        // SAFETY: the vector outlives every use in the test (each test drops
        // the registry first), and is touched only through the registry.
        unsafe { memory.insert(buffer.as_mut_ptr() as u64, len as u64) }.unwrap();
        buffer
    }

    /// Registered bytes are read and changed in place; bytes outside every
    /// registered range are refused with nothing read or changed.
    #[test]
    fn registered_bytes_are_read_and_changed_and_nothing_else() {
        let memory = MemoryRegistry::new();
        let mut buffer = registered(&memory, 4096);
        let base = buffer.as_mut_ptr() as u64;
        let mut into = [0u8; 8];
        memory.read_into(base + 100, &mut into).unwrap();
        assert_eq!(into, [100, 101, 102, 103, 104, 105, 106, 107]);
        let summed = memory
            .with_writable(base + 10, 4, |bytes| {
                bytes.iter_mut().for_each(|b| *b = b.wrapping_add(1));
                bytes.iter().map(|b| u32::from(*b)).sum::<u32>()
            })
            .unwrap();
        assert_eq!(summed, 11 + 12 + 13 + 14);
        memory.read_into(base + 8, &mut into).unwrap();
        assert_eq!(into, [8, 9, 11, 12, 13, 14, 14, 15]);
        let past = Err(SysError::Unregistered {
            addr: base + 4090,
            len: 8,
        });
        assert_eq!(memory.read_into(base + 4090, &mut into), past);
        assert_eq!(memory.with_writable(base + 4090, 8, |_| ()), past);
        drop(memory);
    }
}
