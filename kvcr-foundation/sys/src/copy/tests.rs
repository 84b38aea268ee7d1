//! The copy kernels' and the registry's tests.

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
            let span = ByteSpan {
                src: src.as_ptr() as u64 + src_off,
                dst: dst.as_mut_ptr() as u64 + dst_off,
                len: len as u64,
            };
            // SAFETY: both ranges lie inside the two distinct vectors.
            unsafe { copy_spans_streaming([span]) };
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

/// A registry over two vectors of `len` bytes: `(registry, src, dst)`.
fn registered(len: usize) -> (MemoryRegistry, Vec<u8>, Vec<u8>) {
    let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; len];
    let registry = MemoryRegistry::new();
    // SAFETY: (test) each test drops the registry before the vectors (it is
    // bound first) and reads them only between copies.
    unsafe {
        registry.insert(src.as_ptr() as u64, len as u64).unwrap();
        registry
            .insert(dst.as_mut_ptr() as u64, len as u64)
            .unwrap();
    }
    (registry, src, dst)
}

#[test]
fn registered_copies_land_and_others_are_refused_whole() {
    let (registry, src, dst) = registered(1 << 20);
    let (s, d) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    registry
        .copy([
            ByteSpan::new(s, d + 10, 100),
            ByteSpan::new(s + 500, d + 4096, 300 << 10),
        ])
        .unwrap();
    assert_eq!(dst[10..110], src[..100]);
    assert_eq!(dst[4096..4096 + (300 << 10)], src[500..500 + (300 << 10)]);
    // One span past the destination's end: nothing of the call is copied.
    let before = dst.clone();
    let past = ByteSpan::new(s, d + (1 << 20) - 8, 9);
    assert_eq!(
        registry.copy([ByteSpan::new(s, d, 8), past]),
        Err(SysError::Unregistered {
            addr: d + (1 << 20) - 8,
            len: 9
        })
    );
    assert_eq!(dst, before, "a refusal copies nothing");
    assert_eq!(
        registry.copy_streaming([ByteSpan::new(s, s + 8, 16)]),
        Err(SysError::Overlap)
    );
    assert!(registry.copy([ByteSpan::new(u64::MAX - 1, d, 4)]).is_err());
    assert_eq!(registry.read(s + 1, 3).unwrap(), src[1..4]);
    registry.write(d + 7, b"landed").unwrap();
    assert_eq!(&dst[7..13], b"landed");
    assert!(registry.write(d + (1 << 20) - 2, b"abc").is_err());
    assert!(registry.read(s, (1 << 20) + 1).is_err());
}

#[test]
fn ranges_never_overlap_and_go_when_removed() {
    let (registry, src, _dst) = registered(4096);
    let s = src.as_ptr() as u64;
    // SAFETY: (test) refused before anything is registered.
    let again = unsafe { registry.insert(s + 100, 10) };
    assert_eq!(
        again,
        Err(SysError::AlreadyRegistered {
            addr: s + 100,
            len: 10
        })
    );
    assert!(registry.contains(s, 4096));
    assert!(!registry.contains(s + 1, 4096));
    assert!(registry.remove(s));
    assert!(!registry.remove(s));
    assert!(!registry.contains(s, 1));
}

#[test]
fn owned_memory_is_registered_safely_and_kept_alive() {
    let (registry, src, _dst) = registered(16);
    let pool = Arc::new(crate::mapping::DramPool::allocate(8192, false).unwrap());
    let base = pool.base();
    registry.insert_owned(pool).unwrap();
    let s = src.as_ptr() as u64;
    registry
        .copy_streaming([ByteSpan::new(s, base + 4000, 16)])
        .unwrap();
    assert_eq!(registry.read(base + 4000, 16).unwrap(), src);
    assert!(registry.remove(base));
    assert!(registry.read(base + 4000, 16).is_err());
}
