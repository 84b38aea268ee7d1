//! The constants a device kernel needs to take a page's digest in 1 KiB
//! blocks (xxh3-64's long algorithm, one block per secret's worth of
//! stripes), laid out as one table of words, and the block walk it must
//! follow, written out here on the CPU so a test holds it to
//! [`super::digest_bytes`].
//!
//! The walk, for a page of `n` whole 1 KiB blocks (`n >= 1`): the lanes
//! start at [`START`]; every block but the last accumulates its 16 stripes
//! (stripe `s`, lane `i`: `v = word(s, i)`, `k = v ^ key(STRIPE + 8s + i)`,
//! `lane[i ^ 1] += v`, `lane[i] += (k mod 2^32) * (k >> 32)`), then
//! scrambles (`lane ^= lane >> 47`, `^= key(SCRAMBLE + i)`, `*= 0x9E3779B1`);
//! the last block accumulates stripes 0..15 the same way and its stripe 15
//! with the keys at [`LAST`], and is not scrambled; then pairs of lanes
//! merge with the keys at [`MERGE`] and the sum is mixed with the length.
//! Within a block the stripes' sums commute, so a device may add them in
//! any order.

use super::fused::{LANES_START, PRIME_MX1, PRIME64_1, SECRET};
use super::stripes::PRIME32_1;

/// Bytes per block of the device walk.
pub const BLOCK_BYTES: u64 = 1024;
/// Words in [`device_key_table`].
pub const KEY_WORDS: usize = 160;
/// Where the lanes' starting values are in the table (8 words).
pub const START: usize = 0;
/// Where the stripe keys are: stripe `s`, lane `i` at `STRIPE + 8s + i`.
pub const STRIPE: usize = 8;
/// Where the scramble keys are (8 words).
pub const SCRAMBLE: usize = 136;
/// Where the last stripe's keys are (8 words).
pub const LAST: usize = 144;
/// Where the merge keys are: pair `p` at `MERGE + 2p` and `MERGE + 2p + 1`.
pub const MERGE: usize = 152;

/// The secret's little-endian word at byte `at`.
fn secret_word(at: usize) -> u64 {
    let mut word = [0u8; 8];
    if let Some(bytes) = SECRET.get(at..at + 8) {
        word.copy_from_slice(bytes);
    }
    u64::from_le_bytes(word)
}

/// The table a device kernel reads its keys from (see the module docs for
/// the layout): every xxh3 constant the walk needs, the unaligned ones
/// included, so the kernel only ever loads aligned words.
pub fn device_key_table() -> [u64; KEY_WORDS] {
    let mut table = [0u64; KEY_WORDS];
    let starts = table.iter_mut().skip(START).take(8);
    for (slot, start) in starts.zip(LANES_START) {
        *slot = start;
    }
    for (i, slot) in table.iter_mut().enumerate() {
        *slot = match i {
            // Stripe `s` reads the secret from byte 8s on (it advances a
            // word per stripe), lane `i` its word `i`.
            STRIPE..SCRAMBLE => {
                let (s, lane) = ((i - STRIPE) / 8, (i - STRIPE) % 8);
                secret_word(8 * s + 8 * lane)
            }
            SCRAMBLE..LAST => secret_word(SECRET.len() - 64 + 8 * (i - SCRAMBLE)),
            LAST..MERGE => secret_word(SECRET.len() - 64 - 7 + 8 * (i - LAST)),
            MERGE..KEY_WORDS => secret_word(11 + 8 * (i - MERGE)),
            _ => *slot,
        };
    }
    table
}

/// The multipliers the walk uses: the scramble's, the merge's length
/// multiplier and the final mix's.
pub const MULTIPLIERS: [u64; 3] = [PRIME32_1, PRIME64_1, PRIME_MX1];

#[cfg(test)]
mod tests {
    use super::*;

    /// The walk of the module docs, on the CPU, from the table alone.
    fn walk(page: &[u8], table: &[u64; KEY_WORDS]) -> u64 {
        let word = |at: usize| u64::from_le_bytes(page[at..at + 8].try_into().unwrap());
        let mut lanes: [u64; 8] = table[START..START + 8].try_into().unwrap();
        let blocks = page.len() / BLOCK_BYTES as usize;
        for b in 0..blocks {
            let last = b + 1 == blocks;
            // As a device adds them: per lane, the sum over the block.
            let mut sums = [0u64; 8];
            for s in 0..16 {
                for (i, sum) in sums.iter_mut().enumerate() {
                    let at = b * 1024 + 64 * s;
                    let key = if last && s == 15 {
                        table[LAST + i]
                    } else {
                        table[STRIPE + 8 * s + i]
                    };
                    let k = word(at + 8 * i) ^ key;
                    let other = word(at + 8 * (i ^ 1));
                    *sum = sum
                        .wrapping_add((k & 0xFFFF_FFFF).wrapping_mul(k >> 32))
                        .wrapping_add(other);
                }
            }
            for (i, lane) in lanes.iter_mut().enumerate() {
                *lane = lane.wrapping_add(sums[i]);
                if !last {
                    *lane ^= *lane >> 47;
                    *lane ^= table[SCRAMBLE + i];
                    *lane = lane.wrapping_mul(MULTIPLIERS[0]);
                }
            }
        }
        let mut h = (page.len() as u64).wrapping_mul(MULTIPLIERS[1]);
        for p in 0..4 {
            let a = lanes[2 * p] ^ table[MERGE + 2 * p];
            let b = lanes[2 * p + 1] ^ table[MERGE + 2 * p + 1];
            let product = u128::from(a) * u128::from(b);
            h = h.wrapping_add((product as u64) ^ ((product >> 64) as u64));
        }
        h ^= h >> 37;
        h = h.wrapping_mul(MULTIPLIERS[2]);
        h ^ (h >> 32)
    }

    #[test]
    fn the_device_walk_is_xxh3() {
        let table = device_key_table();
        for blocks in [1usize, 2, 3, 16, 17, 256] {
            let page: Vec<u8> = (0..blocks * 1024)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect();
            let want = super::super::digest_bytes(&page);
            assert_eq!(walk(&page, &table), want, "{blocks} blocks");
            assert_eq!(want, xxhash_rust::xxh3::xxh3_64(&page));
        }
    }
}
