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
//!
//! The hash is this crate's own kernel (`stripes`, `fused`): a deposit's
//! copy and digest are one pass over the page (each 64-byte stripe loaded
//! once, stored, and hashed from the same registers), and every digest runs
//! on AVX2 where the CPU has it (detected at run time; `xxhash_rust` uses
//! AVX2 only when built for it). It equals `xxhash_rust::xxh3::xxh3_64` of
//! the bytes, so either may check the other's digests (`props` tests it).

use std::sync::Arc;

use crate::copy::{ByteSpan, MemoryRegistry, holds};
use crate::error::{Result, SysError};
use crate::segment::PeerSegment;

pub mod device;
mod fused;
mod stripes;

use self::stripes::{Kernel, Store};

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

/// The digest of `bytes` as one page (equal to `xxhash_rust::xxh3::xxh3_64`;
/// with AVX2 where the CPU has it, which that crate uses only when built
/// for it).
pub fn digest_bytes(bytes: &[u8]) -> PageDigest {
    let span = ByteSpan::new(bytes.as_ptr() as u64, 0, bytes.len() as u64);
    // SAFETY: the span is the borrowed slice, valid for reads and not
    // written while borrowed; nothing is stored.
    unsafe { fused::digest_spans(Kernel::best(), &[span], Store::Hash) }
}

impl MemoryRegistry {
    /// Copies `spans` as [`MemoryRegistry::copy`] (or, with `stream`,
    /// [`MemoryRegistry::copy_streaming`]) does, and returns the digest of
    /// the bytes copied, in span order, taken in the same pass: each
    /// 64-byte stripe is loaded once, stored, and hashed from the same
    /// registers, so the digest costs no second trip through the page. A
    /// refusal copies nothing.
    pub fn copy_digested(&self, spans: &[ByteSpan], stream: bool) -> Result<PageDigest> {
        let ranges = self.checked(spans.iter().copied())?;
        let store = if stream { Store::Stream } else { Store::Copy };
        // SAFETY: as in `copy`: every span was checked just now (source
        // registered, destination registered writable, the two apart)
        // under the read lock held until the end; concurrent access is the
        // inserting caller's protocol.
        let digest = unsafe { fused::digest_spans(Kernel::best(), spans, store) };
        drop(ranges);
        Ok(digest)
    }

    /// As [`Self::copy_digested`] with non-temporal stores, where a
    /// destination may also lie inside one of `segments` (a same-host
    /// peer's pools, mapped here, as [`Self::copy_streaming_into`] allows):
    /// the digest of what a peer write stores, taken as it stores it.
    pub fn copy_digested_into(
        &self,
        spans: &[ByteSpan],
        segments: &[Arc<PeerSegment>],
    ) -> Result<PageDigest> {
        let in_segment = |dst: u64, len: u64| segments.iter().any(|s| s.holds(dst, len));
        let ranges = self.checked_into(spans.iter().copied(), in_segment)?;
        // SAFETY: as in `copy_digested`; a destination inside a segment is
        // inside a live shared mapping (borrowed for the call), writable,
        // and granted to this copy alone by the write's target (the
        // caller's protocol, as for `copy_streaming_into`).
        let digest = unsafe { fused::digest_spans(Kernel::best(), spans, Store::Stream) };
        drop(ranges);
        Ok(digest)
    }

    /// The digest of the page whose spans (address, length; in layout
    /// order) are `spans`, each of which must be registered.
    pub fn digest(&self, spans: &[(u64, u64)]) -> Result<PageDigest> {
        let ranges = self.read_lock();
        if let Some(&(addr, len)) = spans.iter().find(|(a, l)| !holds(&ranges, *a, *l)) {
            return Err(SysError::Unregistered { addr, len });
        }
        let spans: Vec<ByteSpan> = spans
            .iter()
            .map(|&(addr, len)| ByteSpan::new(addr, 0, len))
            .collect();
        // SAFETY: every span is registered (checked under the lock, held
        // until the hash is taken); writers of it are the caller's
        // protocol, as for `read`; nothing is stored.
        let digest = unsafe { fused::digest_spans(Kernel::best(), &spans, Store::Hash) };
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
        let len = 3 * crate::copy::STREAM_MIN + 12_345;
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
            assert!(registry.copy_digested_into(&outside, &[]).is_err());
        }
        // Into registered memory, with no segment beside it, as a streamed
        // digested copy.
        let dst = base + len;
        registry.write(dst, &vec![0; len as usize]).unwrap();
        let into = registry
            .copy_digested_into(&[ByteSpan::new(base, dst, len)], &[])
            .unwrap();
        assert_eq!(registry.read(dst, len).unwrap(), bytes);
        assert_eq!(into, digest_bytes(&bytes));
    }
}

#[cfg(test)]
mod props;
