//! xxh3's long-input inner loop, per instruction set: accumulating 64-byte
//! stripes into eight 64-bit lanes (each stripe optionally stored to a
//! destination from the same registers it was hashed from) and scrambling
//! the lanes after each block. Written from the xxh3 specification: lane
//! `i` adds the stripe's word `i ^ 1`, then the product of the low and high
//! halves of word `i` xor its secret word; a scramble xors each lane with
//! itself shifted right by 47 and with its secret word, then multiplies it
//! by the first 32-bit prime.

/// The 32-bit prime a scramble multiplies by.
pub(super) const PRIME32_1: u64 = 0x9E37_79B1;

/// What happens to a stripe's bytes besides being hashed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Store {
    /// Nothing: a digest only.
    Hash,
    /// Stored to the destination with ordinary stores.
    Copy,
    /// Stored to the destination with non-temporal stores (the caller
    /// fences); the destination must be 32-byte aligned.
    Stream,
}

/// An implementation of the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// Plain 64-bit arithmetic (any architecture).
    #[cfg_attr(
        all(target_arch = "x86_64", not(test)),
        expect(
            dead_code,
            reason = "x86_64 always has SSE2; tests check this kernel there too"
        )
    )]
    Scalar,
    /// 128-bit vectors (baseline on x86_64).
    #[cfg(target_arch = "x86_64")]
    Sse2,
    /// 256-bit vectors, where the CPU has them (detected at run time).
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub(crate) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                Self::Avx2
            } else {
                Self::Sse2
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self::Scalar
    }

    /// Every kernel this CPU runs (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let mut kernels = vec![Self::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            kernels.push(Self::Sse2);
            if std::arch::is_x86_feature_detected!("avx2") {
                kernels.push(Self::Avx2);
            }
        }
        kernels
    }

    /// Accumulates the `stripes` stripes at `src` into `acc`, stripe `k`
    /// keyed by the secret's bytes from `key + 8k`, storing each to `dst`
    /// (laid out as at `src`) as `store` says.
    ///
    /// # Safety
    /// `src..src + 64 * stripes` valid for reads; unless `store` is
    /// [`Store::Hash`], `dst..dst + 64 * stripes` valid for writes, not
    /// overlapping the source, and (for [`Store::Stream`]) 32-byte aligned;
    /// no one else writes either range during the call; `key + 8 * stripes
    /// + 56` lies inside the secret.
    pub(crate) unsafe fn accumulate(
        self,
        acc: &mut [u64; 8],
        src: *const u8,
        dst: *mut u8,
        stripes: usize,
        key: *const u8,
        store: Store,
    ) {
        // SAFETY: this function's contract, passed on; the vector kernels
        // run only where `best`/`available` found their instructions.
        unsafe {
            match (self, store) {
                (Self::Scalar, _) => scalar::accumulate(acc, src, dst, stripes, key, store),
                #[cfg(target_arch = "x86_64")]
                (Self::Sse2, Store::Hash) => sse2::accumulate::<0>(acc, src, dst, stripes, key),
                #[cfg(target_arch = "x86_64")]
                (Self::Sse2, Store::Copy) => sse2::accumulate::<1>(acc, src, dst, stripes, key),
                #[cfg(target_arch = "x86_64")]
                (Self::Sse2, Store::Stream) => sse2::accumulate::<2>(acc, src, dst, stripes, key),
                #[cfg(target_arch = "x86_64")]
                (Self::Avx2, Store::Hash) => avx2::accumulate::<0>(acc, src, dst, stripes, key),
                #[cfg(target_arch = "x86_64")]
                (Self::Avx2, Store::Copy) => avx2::accumulate::<1>(acc, src, dst, stripes, key),
                #[cfg(target_arch = "x86_64")]
                (Self::Avx2, Store::Stream) => avx2::accumulate::<2>(acc, src, dst, stripes, key),
            }
        }
    }
}

/// Reads the little-endian word at `at`.
///
/// # Safety
/// `at..at + 8` valid for reads.
pub(super) unsafe fn word(at: *const u8) -> u64 {
    // SAFETY: this function's contract; the read is unaligned.
    u64::from_le(unsafe { at.cast::<u64>().read_unaligned() })
}

/// The scramble after each block of stripes, keyed by the 64 secret bytes
/// at `key` (scalar: once per kilobyte, not worth vectors).
///
/// # Safety
/// `key..key + 64` valid for reads.
pub(super) unsafe fn scramble(acc: &mut [u64; 8], key: *const u8) {
    for (i, lane) in acc.iter_mut().enumerate() {
        // SAFETY: word `i < 8` of the 64 key bytes (the contract).
        let secret = unsafe { word(key.add(8 * i)) };
        let mixed = (*lane ^ (*lane >> 47)) ^ secret;
        *lane = mixed.wrapping_mul(PRIME32_1);
    }
}

mod scalar {
    use super::{Store, word};

    /// [`super::Kernel::accumulate`] in plain arithmetic.
    ///
    /// # Safety
    /// As [`super::Kernel::accumulate`].
    pub(super) unsafe fn accumulate(
        acc: &mut [u64; 8],
        src: *const u8,
        dst: *mut u8,
        stripes: usize,
        key: *const u8,
        store: Store,
    ) {
        if store != Store::Hash {
            // SAFETY: both ranges valid and apart (the contract).
            unsafe { std::ptr::copy_nonoverlapping(src, dst, 64 * stripes) };
        }
        for stripe in 0..stripes {
            // SAFETY: stripe `stripe` of the source and its key (the
            // contract).
            unsafe { one_stripe(acc, src.add(64 * stripe), key.add(8 * stripe)) };
        }
    }

    /// Accumulates the one stripe at `src`, keyed from `key`.
    ///
    /// # Safety
    /// `src..src + 64` and `key..key + 64` valid for reads.
    pub(in crate::digest) unsafe fn one_stripe(acc: &mut [u64; 8], src: *const u8, key: *const u8) {
        for (i, lane) in acc.iter_mut().enumerate() {
            // SAFETY: words `i` and `i ^ 1` (both < 8) of the stripe and
            // word `i` of the key (the contract).
            let (data, neighbour, secret) = unsafe {
                (
                    word(src.add(8 * i)),
                    word(src.add(8 * (i ^ 1))),
                    word(key.add(8 * i)),
                )
            };
            let keyed = data ^ secret;
            *lane = lane
                .wrapping_add(neighbour)
                .wrapping_add((keyed & 0xFFFF_FFFF).wrapping_mul(keyed >> 32));
        }
    }
}

pub(super) use scalar::one_stripe;

#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_add_epi64, _mm_loadu_si128, _mm_mul_epu32, _mm_shuffle_epi32,
        _mm_storeu_si128, _mm_stream_si128, _mm_xor_si128,
    };

    /// One 16-byte step: two lanes `acc`, data `data`, secret `key`.
    #[target_feature(enable = "sse2")]
    #[inline]
    fn step(acc: __m128i, data: __m128i, key: __m128i) -> __m128i {
        let keyed = _mm_xor_si128(data, key);
        // Each lane's high half moved to its low half, to multiply by.
        let high = _mm_shuffle_epi32::<0b00_11_00_01>(keyed);
        let product = _mm_mul_epu32(keyed, high);
        // The neighbouring lane's data (lanes 0 and 1 swapped).
        let swapped = _mm_shuffle_epi32::<0b01_00_11_10>(data);
        _mm_add_epi64(_mm_add_epi64(acc, swapped), product)
    }

    /// [`super::Kernel::accumulate`] with SSE2; `STORE`: 0 hash only,
    /// 1 ordinary stores, 2 non-temporal stores.
    ///
    /// # Safety
    /// As [`super::Kernel::accumulate`].
    #[target_feature(enable = "sse2")]
    pub(super) unsafe fn accumulate<const STORE: u8>(
        acc: &mut [u64; 8],
        src: *const u8,
        dst: *mut u8,
        stripes: usize,
        key: *const u8,
    ) {
        let lanes = acc.as_mut_ptr().cast::<__m128i>();
        let mut sums = [0usize, 1, 2, 3].map(|i| {
            // SAFETY: `acc` holds four 16-byte vectors; loads are unaligned.
            unsafe { _mm_loadu_si128(lanes.add(i)) }
        });
        for stripe in 0..stripes {
            // SAFETY: stripe `stripe` lies inside the source (and the
            // destination, when storing) and its key inside the secret (the
            // contract); loads and ordinary stores are unaligned, and a
            // streamed destination is 32-byte aligned, so each 16-byte
            // non-temporal store is aligned.
            unsafe {
                super::prefetch_ahead(src.add(64 * stripe));
                let from = src.add(64 * stripe).cast::<__m128i>();
                let to = dst.wrapping_add(64 * stripe).cast::<__m128i>();
                let secret = key.add(8 * stripe).cast::<__m128i>();
                for (i, sum) in sums.iter_mut().enumerate() {
                    let data = _mm_loadu_si128(from.add(i));
                    match STORE {
                        1 => _mm_storeu_si128(to.add(i), data),
                        2 => _mm_stream_si128(to.add(i), data),
                        _ => {}
                    }
                    *sum = step(*sum, data, _mm_loadu_si128(secret.add(i)));
                }
            }
        }
        for (i, sum) in sums.into_iter().enumerate() {
            // SAFETY: vector `i < 4` of `acc`; unaligned store.
            unsafe { _mm_storeu_si128(lanes.add(i), sum) };
        }
    }
}

/// How far ahead of the stripe being hashed the vector kernels ask for the
/// source's lines: the hash's arithmetic between loads otherwise leaves the
/// memory pipe idle (measured, `examples/digest_cost`: an ordinary-store
/// fused copy went from 0.87 to about 1.0 of `memcpy` alone).
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 512;

/// Asks for the source line `PREFETCH_AHEAD` bytes past `at`. A prefetch
/// never faults, so the address may lie past the source's end.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(at: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    // SAFETY: a prefetch is a hint: it reads nothing architecturally and
    // never faults, whatever the address (SSE is baseline on x86_64).
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_AHEAD).cast::<i8>()) };
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32, _mm256_shuffle_epi32,
        _mm256_storeu_si256, _mm256_stream_si256, _mm256_xor_si256,
    };

    /// One 32-byte step: four lanes `acc`, data `data`, secret `key`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn step(acc: __m256i, data: __m256i, key: __m256i) -> __m256i {
        let keyed = _mm256_xor_si256(data, key);
        // Each lane's high half moved to its low half, to multiply by.
        let high = _mm256_shuffle_epi32::<0b00_11_00_01>(keyed);
        let product = _mm256_mul_epu32(keyed, high);
        // The neighbouring lane's data (lanes swapped in pairs).
        let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
        _mm256_add_epi64(_mm256_add_epi64(acc, swapped), product)
    }

    /// [`super::Kernel::accumulate`] with AVX2; `STORE` as for SSE2.
    ///
    /// # Safety
    /// As [`super::Kernel::accumulate`], and the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn accumulate<const STORE: u8>(
        acc: &mut [u64; 8],
        src: *const u8,
        dst: *mut u8,
        stripes: usize,
        key: *const u8,
    ) {
        let lanes = acc.as_mut_ptr().cast::<__m256i>();
        // SAFETY: `acc` holds two 32-byte vectors; loads are unaligned.
        let mut sums = unsafe { [_mm256_loadu_si256(lanes), _mm256_loadu_si256(lanes.add(1))] };
        for stripe in 0..stripes {
            // SAFETY: as in the SSE2 kernel; a streamed destination is
            // 32-byte aligned, as each non-temporal store requires.
            unsafe {
                super::prefetch_ahead(src.add(64 * stripe));
                let from = src.add(64 * stripe).cast::<__m256i>();
                let to = dst.wrapping_add(64 * stripe).cast::<__m256i>();
                let secret = key.add(8 * stripe).cast::<__m256i>();
                for (i, sum) in sums.iter_mut().enumerate() {
                    let data = _mm256_loadu_si256(from.add(i));
                    match STORE {
                        1 => _mm256_storeu_si256(to.add(i), data),
                        2 => _mm256_stream_si256(to.add(i), data),
                        _ => {}
                    }
                    *sum = step(*sum, data, _mm256_loadu_si256(secret.add(i)));
                }
            }
        }
        let [low, high] = sums;
        // SAFETY: the two vectors of `acc`; unaligned stores.
        unsafe {
            _mm256_storeu_si256(lanes, low);
            _mm256_storeu_si256(lanes.add(1), high);
        }
    }
}
