//! Property tests of the fused kernel: for every kernel this CPU runs,
//! every store mode, random lengths (weighted to xxh3's edges: 240, stripes,
//! 1 KiB blocks, the streaming threshold), random cuts into spans and
//! random alignments, the digest is `xxhash_rust::xxh3::xxh3_64` of the
//! bytes and the destination holds exactly the source's bytes.

use proptest::prelude::*;

use super::fused::{SHORT_MAX, digest_spans};
use super::stripes::{Kernel, Store};
use crate::copy::{ByteSpan, STREAM_MIN};

/// The most bytes a case digests.
const MAX_LEN: usize = 3 << 20;

/// Lengths: anywhere up to 3 MiB, or within a few bytes of an edge.
fn length() -> impl Strategy<Value = usize> {
    let edge = prop_oneof![
        Just(SHORT_MAX as usize),
        (1usize..48).prop_map(|n| 64 * n),
        (1usize..3072).prop_map(|n| 1024 * n),
        Just(STREAM_MIN as usize),
    ];
    prop_oneof![
        0..=MAX_LEN,
        0usize..4096,
        (edge, -3i64..=3).prop_map(|(at, by)| (at as i64 + by).clamp(0, MAX_LEN as i64) as usize),
    ]
}

/// Deterministic bytes from `seed` (a cheap generator: megabytes per case).
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// The span boundaries: `cuts` (fractions of the length) sorted, plus
/// some cut within a stripe of each other (and empty spans).
fn boundaries(len: usize, cuts: &[u32], near: &[u8]) -> Vec<usize> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| ((*c as u64 * len as u64) >> 32) as usize)
        .collect();
    let jitter: Vec<usize> = at
        .iter()
        .zip(near)
        .map(|(a, n)| (a + *n as usize).min(len))
        .collect();
    at.extend(jitter);
    at.push(0);
    at.push(len);
    at.sort_unstable();
    at
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn fused_digest_is_xxh3_and_the_copy_exact(
        len in length(),
        seed in any::<u64>(),
        cuts in prop::collection::vec(any::<u32>(), 0..6),
        near in prop::collection::vec(0u8..80, 0..6),
        src_offset in 0usize..64,
        dst_offset in 0usize..64,
    ) {
        let source = bytes(seed, len + src_offset);
        let bytes = &source[src_offset..];
        let expected = xxhash_rust::xxh3::xxh3_64(bytes);
        let at = boundaries(len, &cuts, &near);
        let base = bytes.as_ptr() as u64;
        let mut landed = vec![0u8; len + dst_offset + 64];
        let dst = landed.as_mut_ptr() as u64 + dst_offset as u64;
        let spans: Vec<ByteSpan> = at
            .windows(2)
            .filter_map(|w| match w {
                [from, to] => Some(ByteSpan::new(base + *from as u64, dst + *from as u64,
                    (*to - *from) as u64)),
                _ => None,
            })
            .collect();
        for kernel in Kernel::available() {
            for store in [Store::Hash, Store::Copy, Store::Stream] {
                landed.fill(0xA5);
                // SAFETY: every span lies inside `source` (read) and
                // `landed` (written), two distinct vectors.
                let digest = unsafe { digest_spans(kernel, &spans, store) };
                prop_assert_eq!(digest, expected, "{:?} {:?} len {}", kernel, store, len);
                let (before, rest) = landed.split_at(dst_offset);
                let (copied, after) = rest.split_at(len);
                prop_assert!(before.iter().chain(after).all(|b| *b == 0xA5));
                if store == Store::Hash {
                    prop_assert!(copied.iter().all(|b| *b == 0xA5));
                } else {
                    prop_assert!(copied == bytes, "{:?} {:?} len {}", kernel, store, len);
                }
            }
        }
    }
}

/// Every length from 0 to 2,200 bytes (all of xxh3's short forms, the
/// switch to the long one, the first blocks and the last-stripe rule at
/// every offset), cut at the middle, with every kernel.
#[test]
fn every_small_length_digests_as_xxh3() {
    let source = bytes(7, 2200);
    for len in 0..=source.len() {
        let Some(page) = source.get(..len) else {
            continue;
        };
        let base = page.as_ptr() as u64;
        let half = (len / 2) as u64;
        let spans = [
            ByteSpan::new(base, 0, half),
            ByteSpan::new(base + half, 0, len as u64 - half),
        ];
        for kernel in Kernel::available() {
            // SAFETY: both spans lie inside `source`; nothing is stored.
            let digest = unsafe { digest_spans(kernel, &spans, Store::Hash) };
            assert_eq!(
                digest,
                xxhash_rust::xxh3::xxh3_64(page),
                "{kernel:?} len {len}"
            );
        }
    }
}
