//! Page digests: xxh3-64 over a page's bytes, its spans taken in layout
//! order as one run of bytes, read through the [`MemoryRegistry`] (every
//! span checked against what was registered, as a copy's are).
//!
//! Why xxh3-64: on the hosts measured it hashes 24–29 GB/s per core on
//! 256 KiB–8 MiB pages, as fast as hardware crc32c (26–28 GB/s) with twice
//! the bits and no dependence on a CPU instruction, and four to five times
//! BLAKE3's 6–7 GB/s (see `benches/runner.rs`, `digest_choice`). It is a
//! check, not a MAC: it catches bytes changed between deposit and use (on
//! the wire, on disk, in memory) by anyone who does not aim at it; the
//! digest itself always travels sealed.

use crate::copy::{
    ByteSpan, MemoryRegistry, STREAM_MIN, bytes_at, copy_spans, copy_spans_streaming, holds,
};
use crate::error::{Result, SysError};

/// A page's digest: xxh3-64 of its bytes in layout order.
pub type PageDigest = u64;

/// The digest of one write's pages (in order), as a record carries it:
/// xxh3-64 of their digests, little-endian, end to end.
pub fn combine_digests(digests: &[PageDigest]) -> PageDigest {
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    for digest in digests {
        hasher.update(&digest.to_le_bytes());
    }
    hasher.digest()
}

/// The digest of `bytes` as one page.
pub fn digest_bytes(bytes: &[u8]) -> PageDigest {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// How much of a span is copied before its source bytes are hashed: small
/// enough to be still in this core's cache when the hash reads them, and
/// as large as a streamed copy's least span (so a chunk still streams).
const CHUNK: u64 = STREAM_MIN;

impl MemoryRegistry {
    /// Copies `spans` as [`MemoryRegistry::copy`] (or, with `stream`,
    /// [`MemoryRegistry::copy_streaming`]) does, and returns the digest of
    /// the bytes copied, in span order: each chunk's source is hashed right
    /// after it was copied, while its lines are still cached, so the digest
    /// costs no second trip to memory. A refusal copies nothing.
    pub fn copy_digested(&self, spans: &[ByteSpan], stream: bool) -> Result<PageDigest> {
        let ranges = self.checked(spans.iter().copied())?;
        let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
        for span in spans {
            let mut done = 0;
            while done < span.len {
                let len = CHUNK.min(span.len - done);
                let chunk = ByteSpan::new(span.src + done, span.dst + done, len);
                // SAFETY: as in `copy` (every span was checked just now
                // under the read lock held until the end); a chunk lies
                // inside its span.
                unsafe {
                    if stream {
                        copy_spans_streaming([chunk]);
                    } else {
                        copy_spans([chunk]);
                    }
                }
                // SAFETY: the chunk's source is registered (checked above);
                // nothing writes a copy's source during it (`copy`'s
                // contract).
                hasher.update(unsafe { bytes_at(chunk.src, len) });
                done += len;
            }
        }
        drop(ranges);
        Ok(hasher.digest())
    }

    /// The digest of the page whose spans (address, length; in layout
    /// order) are `spans`, each of which must be registered.
    pub fn digest(&self, spans: &[(u64, u64)]) -> Result<PageDigest> {
        let ranges = self.read_lock();
        if let Some(&(addr, len)) = spans.iter().find(|(a, l)| !holds(&ranges, *a, *l)) {
            return Err(SysError::Unregistered { addr, len });
        }
        let digest = match spans {
            // SAFETY: the span is registered (checked under the lock, held
            // until the hash is taken); writers of it are the caller's
            // protocol, as for `read`.
            [(addr, len)] => digest_bytes(unsafe { bytes_at(*addr, *len) }),
            _ => {
                let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
                for &(addr, len) in spans {
                    // SAFETY: as above, for each span.
                    hasher.update(unsafe { bytes_at(addr, len) });
                }
                hasher.digest()
            }
        };
        drop(ranges);
        Ok(digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A page cut into spans digests as its bytes laid end to end, whatever
    /// the cut; one changed byte changes it; an unregistered span is refused.
    #[test]
    fn a_page_in_spans_digests_as_its_bytes_end_to_end() {
        let registry = MemoryRegistry::new();
        let pool = Arc::new(crate::mapping::DramPool::allocate(8192, false).unwrap());
        let base = pool.base();
        registry.insert_owned(pool).unwrap();
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
        registry.write(base, &bytes).unwrap();
        let whole = registry.digest(&[(base, 4096)]).unwrap();
        assert_eq!(whole, digest_bytes(&bytes));
        let cut = registry
            .digest(&[(base, 1000), (base + 1000, 3000), (base + 4000, 96)])
            .unwrap();
        assert_eq!(cut, whole);
        registry.write(base + 77, &[bytes[77] ^ 1]).unwrap();
        assert_ne!(registry.digest(&[(base, 4096)]).unwrap(), whole);
        assert!(registry.digest(&[(base + 8000, 4096)]).is_err());
        assert_ne!(combine_digests(&[1, 2]), combine_digests(&[2, 1]));
    }

    /// A copy that digests lands the same bytes as a plain one, streamed or
    /// not, and its digest is the page's, taken over its destination.
    #[test]
    fn a_digested_copy_copies_and_digests_the_page() {
        let registry = MemoryRegistry::new();
        let len = 3 * CHUNK + 12_345;
        let pool = Arc::new(crate::mapping::DramPool::allocate(2 * len, false).unwrap());
        let base = pool.base();
        registry.insert_owned(pool).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        registry.write(base, &bytes).unwrap();
        for stream in [false, true] {
            let (dst, half) = (base + len, len / 2);
            let spans = [
                ByteSpan::new(base + half, dst + half, len - half),
                ByteSpan::new(base, dst, half),
            ];
            let digest = registry.copy_digested(&spans, stream).unwrap();
            assert_eq!(registry.read(dst, len).unwrap(), bytes);
            let expect = registry
                .digest(&[(dst + half, len - half), (dst, half)])
                .unwrap();
            assert_eq!(digest, expect);
            let outside = [ByteSpan::new(base, base + 4 * len, 16)];
            assert!(registry.copy_digested(&outside, stream).is_err());
        }
    }
}
