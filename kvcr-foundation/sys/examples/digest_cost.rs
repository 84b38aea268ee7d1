//! What a deposit's page digest costs, per core: a copy alone, the copy
//! then a hash of each 256 KiB chunk's source (`xxhash_rust`, the way
//! `copy_digested` worked before the fused kernel), and the fused
//! `MemoryRegistry::copy_digested`; plus hashing alone, `xxhash_rust`'s
//! `xxh3_64` against `digest::digest_bytes` (the runtime-dispatched
//! kernel). Pages of 256 KiB to 8 MiB cycled through 256 MiB (so each
//! comes from memory, as a deposit's does), streamed and not; the methods
//! interleaved in each round, medians of the rounds.
//!
//! `cargo run --release -p kvcr-sys --example digest_cost [rounds]`

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock

use std::sync::Arc;
use std::time::Instant;

use kvcr_sys::copy::{ByteSpan, MemoryRegistry, STREAM_MIN, bytes_at};
use kvcr_sys::mapping::DramPool;

/// The bytes pages are cycled through, on each side.
const AREA: u64 = 256 << 20;

fn main() -> Result<(), kvcr_sys::SysError> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(9);
    let registry = MemoryRegistry::new();
    let pool = Arc::new(DramPool::allocate(2 * AREA, true)?);
    let (src, dst) = (pool.base(), pool.base() + AREA);
    registry.insert_owned(pool)?;
    let fill: Vec<u8> = (0..AREA)
        .map(|i| ((i * 2_654_435_761) >> 13) as u8)
        .collect();
    registry.write(src, &fill)?;
    println!("page KiB, stream: GB/s copy | copy+hash (old) | fused; old/copy fused/copy");
    for page in [256u64 << 10, 1 << 20, 4 << 20, 8 << 20] {
        let pages = AREA / page;
        let span = |p: u64| ByteSpan::new(src + p * page, dst + p * page, page);
        for stream in [true, false] {
            let mut rates: [Vec<f64>; 3] = Default::default();
            for _ in 0..rounds {
                for (method, rate) in rates.iter_mut().enumerate() {
                    let start = Instant::now();
                    let mut sink = 0u64;
                    for p in 0..pages {
                        sink ^= match method {
                            0 => copy(&registry, span(p), stream).map(|()| 0)?,
                            1 => copy_then_hash(&registry, span(p), stream)?,
                            _ => registry.copy_digested(&[span(p)], stream)?,
                        };
                    }
                    std::hint::black_box(sink);
                    rate.push(AREA as f64 / start.elapsed().as_secs_f64() / 1e9);
                }
            }
            let [copy, old, fused] = rates.map(median);
            println!(
                "{:>5} {:>5}: {copy:5.1} | {old:5.1} | {fused:5.1}; {:.2} {:.2}",
                page >> 10,
                stream,
                old / copy,
                fused / copy
            );
        }
        for cached in [false, true] {
            let mut hashes: [Vec<f64>; 2] = Default::default();
            for _ in 0..rounds {
                for (method, rate) in hashes.iter_mut().enumerate() {
                    let start = Instant::now();
                    let mut sink = 0u64;
                    for p in 0..pages {
                        // Cached: the first page again and again.
                        let at = if cached { src } else { src + p * page };
                        // SAFETY: each page lies inside the registered
                        // source area, which nothing writes meanwhile.
                        let bytes = unsafe { bytes_at(at, page) };
                        sink ^= if method == 0 {
                            xxhash_rust::xxh3::xxh3_64(bytes)
                        } else {
                            kvcr_sys::digest::digest_bytes(bytes)
                        };
                    }
                    std::hint::black_box(sink);
                    rate.push(AREA as f64 / start.elapsed().as_secs_f64() / 1e9);
                }
            }
            let [crate_rate, ours] = hashes.map(median);
            println!(
                "{:>5} hash only{}: xxhash-rust {crate_rate:5.1} | dispatched {ours:5.1}; {:.2}",
                page >> 10,
                if cached { " (cached)" } else { "" },
                ours / crate_rate
            );
        }
    }
    Ok(())
}

/// The copy alone.
fn copy(registry: &MemoryRegistry, span: ByteSpan, stream: bool) -> kvcr_sys::Result<()> {
    if stream {
        registry.copy_streaming([span])
    } else {
        registry.copy([span])
    }
}

/// The copy, then each chunk's source hashed after it was copied (the way
/// digests were taken before the fused kernel).
fn copy_then_hash(
    registry: &MemoryRegistry,
    span: ByteSpan,
    stream: bool,
) -> kvcr_sys::Result<u64> {
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    let mut done = 0;
    while done < span.len {
        let len = STREAM_MIN.min(span.len - done);
        let chunk = ByteSpan::new(span.src + done, span.dst + done, len);
        copy(registry, chunk, stream)?;
        // SAFETY: the chunk's source is registered and nothing writes it.
        hasher.update(unsafe { bytes_at(chunk.src, len) });
        done += len;
    }
    Ok(hasher.digest())
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}
