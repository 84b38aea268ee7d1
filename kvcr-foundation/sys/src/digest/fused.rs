//! One pass over a page given as spans: each 64-byte stripe is loaded once,
//! stored to its destination (when copying) and fed to xxh3-64's lanes from
//! the same registers, so a deposit's digest costs no second read of the
//! page. The result is exactly `xxhash_rust::xxh3::xxh3_64` of the bytes
//! (default secret, seed 0), whatever the cut into spans.
//!
//! xxh3 over more than 240 bytes, as its specification lays it out: the
//! input is taken in stripes of 64 bytes, blocks of 16 stripes; every
//! stripe but the last (the one holding the last byte, or ending on it) is
//! accumulated with the secret at 8 bytes per stripe into the block, the
//! lanes scrambled after each whole block; then the last 64 bytes of the
//! input are accumulated once more with the secret at 121, and the lanes
//! merged with the secret at 11 and the input's length. Knowing the length
//! up front (the spans' sum), the walk knows which stripes are ordinary.
//! A stripe cut by a span boundary is gathered into a buffer and hashed
//! from there (its bytes copied plainly); inputs of 240 bytes or fewer go
//! to `xxhash_rust`.

use super::stripes::{Kernel, PRIME32_1, Store, one_stripe, scramble, word};
use crate::copy::{ByteSpan, STREAM_MIN};

/// Bytes per stripe.
const STRIPE: usize = 64;
/// Stripes per block (the secret's 192 bytes less a stripe, 8 per stripe).
const BLOCK_STRIPES: u64 = 16;
/// Inputs longer than this take the long algorithm.
pub(crate) const SHORT_MAX: u64 = 240;
/// xxh3's default secret.
pub(super) const SECRET: [u8; 192] = xxhash_rust::const_xxh3::const_custom_default_secret(0);
/// The secret's offset for the scramble (its last 64 bytes).
const SCRAMBLE_KEY: usize = SECRET.len() - STRIPE;
/// The secret's offset for the input's last stripe.
const LAST_STRIPE_KEY: usize = SECRET.len() - STRIPE - 7;
/// The secret's offset for the merge.
const MERGE_KEY: usize = 11;
/// The lanes' starting values.
pub(super) const LANES_START: [u64; 8] = [
    0xC2B2_AE3D,
    0x9E37_79B1_85EB_CA87,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x85EB_CA77_C2B2_AE63,
    0x85EB_CA77,
    0x27D4_EB2F_1656_67C5,
    PRIME32_1,
];
/// The merge's length multiplier (xxh3's first 64-bit prime).
pub(super) const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
/// The final avalanche's multiplier.
pub(super) const PRIME_MX1: u64 = 0x1656_6791_9E37_79F9;

/// The digest of the bytes of `spans`' sources laid end to end, each span's
/// bytes also stored to its destination as `store` says (with
/// [`Store::Stream`], spans shorter than [`STREAM_MIN`] or whose stripes
/// would not land 32-byte aligned are copied with ordinary stores; every
/// non-temporal store is fenced before this returns).
///
/// # Safety
/// Every span's source valid for reads; unless `store` is [`Store::Hash`],
/// every destination valid for writes and apart from every source; no one
/// else writes a source, or touches a destination, during the call.
pub(crate) unsafe fn digest_spans(kernel: Kernel, spans: &[ByteSpan], store: Store) -> u64 {
    // Saturating: no real page comes near; a wrong total only misplaces
    // the stripes' roles (every access follows the spans' own lengths).
    let total = spans.iter().fold(0u64, |sum, s| sum.saturating_add(s.len));
    let digest = if total <= SHORT_MAX {
        // SAFETY: this function's contract.
        unsafe { short(spans, store) }
    } else {
        let mut walk = Walk::new(kernel, total);
        for span in spans {
            // SAFETY: this function's contract, per span.
            unsafe { walk.span(span, store) };
        }
        // SAFETY: this function's contract (the sources).
        unsafe { walk.finish(spans) }
    };
    #[cfg(target_arch = "x86_64")]
    if store == Store::Stream {
        // Non-temporal stores are weakly ordered: fence them before anyone
        // is told the bytes are there.
        // SAFETY: a store fence has no operands (SSE2 is baseline).
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    digest
}

/// A short input: copied plainly, hashed by `xxhash_rust`.
///
/// # Safety
/// As [`digest_spans`].
unsafe fn short(spans: &[ByteSpan], store: Store) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    for span in spans {
        // SAFETY: the span's source is valid for reads and unwritten
        // (the contract).
        let bytes = unsafe { crate::copy::bytes_at(span.src, span.len) };
        if store != Store::Hash {
            // SAFETY: the destination is valid for writes and apart from
            // the source (the contract).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    span.dst as usize as *mut u8,
                    bytes.len(),
                )
            };
        }
        hasher.update(bytes);
    }
    hasher.digest()
}

/// The state of a walk over a long input.
struct Walk {
    kernel: Kernel,
    lanes: [u64; 8],
    /// The input's length.
    total: u64,
    /// How many stripes are ordinary: all but the one holding the last byte.
    ordinary: u64,
    /// Ordinary stripes accumulated so far.
    done: u64,
    /// A stripe cut by a span boundary, gathered so far.
    straddling: [u8; STRIPE],
    /// Bytes of it gathered.
    gathered: usize,
}

impl Walk {
    fn new(kernel: Kernel, total: u64) -> Self {
        Self {
            kernel,
            lanes: LANES_START,
            total,
            ordinary: (total - 1) / STRIPE as u64,
            done: 0,
            straddling: [0; STRIPE],
            gathered: 0,
        }
    }

    /// Takes the next span of the input.
    ///
    /// # Safety
    /// As [`digest_spans`], for `span`.
    unsafe fn span(&mut self, span: &ByteSpan, store: Store) {
        let (src, dst) = (span.src as usize as *const u8, span.dst as usize as *mut u8);
        let len = span.len as usize;
        let storing = store != Store::Hash;
        let mut at = 0;
        if self.gathered > 0 {
            at = (STRIPE - self.gathered).min(len);
            let into = self.straddling.as_mut_ptr().wrapping_add(self.gathered);
            // SAFETY: the span's first `at` bytes (valid, the contract) into
            // the buffer's free `STRIPE - gathered >= at` bytes; the
            // destination's first `at` bytes when copying.
            unsafe {
                std::ptr::copy_nonoverlapping(src, into, at);
                if storing {
                    std::ptr::copy_nonoverlapping(src, dst, at);
                }
            }
            self.gathered += at;
            if self.gathered == STRIPE {
                // An ordinary stripe: one gathered only while one is due,
                // and an ordinary stripe always ends before the input does.
                let stripe = self.straddling.as_ptr();
                // SAFETY: the buffer holds a whole stripe; nothing stored.
                unsafe { self.run(stripe, std::ptr::null_mut(), 1, Store::Hash) };
                self.gathered = 0;
            }
        }
        let whole = ((len - at) / STRIPE) as u64;
        let stripes = whole.min(self.ordinary - self.done) as usize;
        if stripes > 0 {
            let to = dst.wrapping_add(at);
            let store = match store {
                Store::Stream if span.len < STREAM_MIN || !(to as usize).is_multiple_of(32) => {
                    Store::Copy
                }
                other => other,
            };
            // SAFETY: `at + 64 * stripes <= len` bytes of the span, valid
            // (the contract); a streamed destination is 32-byte aligned
            // (checked just now).
            unsafe { self.run(src.add(at), to, stripes, store) };
            at += STRIPE * stripes;
        }
        let rest = len - at;
        if rest > 0 {
            // SAFETY: the span's last `rest` bytes, valid (the contract).
            unsafe {
                if storing {
                    std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), rest);
                }
                if self.done < self.ordinary {
                    // Fewer than a stripe (the whole ones were taken): the
                    // start of one that the next span ends.
                    let into = self.straddling.as_mut_ptr();
                    std::ptr::copy_nonoverlapping(src.add(at), into, rest);
                    self.gathered = rest;
                }
            }
        }
    }

    /// Accumulates `stripes` ordinary stripes at `src` (stored to `dst` as
    /// `store` says), scrambling after each whole block.
    ///
    /// # Safety
    /// As [`Kernel::accumulate`], less the key; `self.done + stripes <=
    /// self.ordinary`.
    unsafe fn run(&mut self, src: *const u8, dst: *mut u8, stripes: usize, store: Store) {
        let mut at = 0;
        while at < stripes {
            let in_block = self.done % BLOCK_STRIPES;
            let take = ((BLOCK_STRIPES - in_block) as usize).min(stripes - at);
            let key = SECRET.as_ptr().wrapping_add(8 * in_block as usize);
            // SAFETY: stripes `at..at + take` of the run (the contract); the
            // keys of stripes `in_block..in_block + take <= 16` lie inside
            // the secret (their last ends at 8 * 15 + 64 = 184 <= 192).
            unsafe {
                self.kernel.accumulate(
                    &mut self.lanes,
                    src.add(STRIPE * at),
                    dst.wrapping_add(STRIPE * at),
                    take,
                    key,
                    store,
                )
            };
            at += take;
            self.done += take as u64;
            if self.done.is_multiple_of(BLOCK_STRIPES) {
                // SAFETY: the secret's last 64 bytes.
                unsafe { scramble(&mut self.lanes, SECRET.as_ptr().add(SCRAMBLE_KEY)) };
            }
        }
    }

    /// The digest, once every span was taken: the input's last 64 bytes
    /// (gathered again from `spans`' sources, from the end), then the merge.
    ///
    /// # Safety
    /// `spans`' sources valid for reads (and those the walk took).
    unsafe fn finish(mut self, spans: &[ByteSpan]) -> u64 {
        let mut last = [0u8; STRIPE];
        let mut missing = STRIPE;
        for span in spans.iter().rev() {
            if missing == 0 {
                break;
            }
            let take = (span.len as usize).min(missing);
            missing -= take;
            let from = (span.src as usize as *const u8).wrapping_add(span.len as usize - take);
            // SAFETY: the span's last `take` bytes (valid) into
            // `last[missing..missing + take]`.
            unsafe { std::ptr::copy_nonoverlapping(from, last.as_mut_ptr().add(missing), take) };
        }
        let key = SECRET.as_ptr().wrapping_add(LAST_STRIPE_KEY);
        // SAFETY: a whole stripe; the key's 64 bytes end at 185 <= 192.
        unsafe { one_stripe(&mut self.lanes, last.as_ptr(), key) };
        let mut merged = self.total.wrapping_mul(PRIME64_1);
        for (pair, lanes) in self.lanes.chunks_exact(2).enumerate() {
            let key = SECRET.as_ptr().wrapping_add(MERGE_KEY + 16 * pair);
            // SAFETY: two words of the secret, the last ending at
            // 11 + 48 + 16 = 75 <= 192.
            let (low, high) = unsafe { (word(key), word(key.add(8))) };
            if let [a, b] = lanes {
                merged = merged.wrapping_add(fold(a ^ low, b ^ high));
            }
        }
        avalanche(merged)
    }
}

/// The 128-bit product of `a` and `b`, its halves xored.
fn fold(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

/// xxh3's final mix.
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(PRIME_MX1);
    h ^ (h >> 32)
}
