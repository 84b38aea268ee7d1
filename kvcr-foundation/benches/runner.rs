//! Runner benchmarks, each beside an anchor measured in the same run.
//!
//! `cargo bench -p kvcr-foundation --bench runner [-- --quick]` (or
//! `cargo xtask bench`) prints one line per figure:
//! `BENCH <name> value=<median> unit=<unit> [anchor=<median>] [ratio=<value/anchor>]`.

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(missing_docs)]

mod common;
use common::{at, bench, dist, median, sorted};

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvcr_foundation::protocol::{ElementRef, OpHandle};
use kvcr_foundation::publisher::{PubSocket, Publisher, PublisherConfig, TopicParts};
use kvcr_foundation::runner::{
    DeliverEntry, DepositEntry, PageInfo, QueryStatus, RegionDesc, Runner, RunnerConfig,
};
use kvcr_foundation::sys::heap::CountingAllocator;
use kvcr_foundation::{BlockKey, CompatDigest, Namespace, NamespaceId, ScopedKey};

/// Counts live heap bytes, to measure the index's memory per block.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

struct Setup {
    runner: Runner,
    ns: NamespaceId,
    src: Vec<u8>,
    dst: Vec<u8>,
    src_region: kvcr_foundation::protocol::RegionId,
    dst_region: kvcr_foundation::protocol::RegionId,
}

fn setup(block: usize, blocks: u32, host_pages: usize) -> Setup {
    let runner =
        Runner::start(RunnerConfig::single_pool("kv", block as u64, blocks), None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(1)));
    let mut src = vec![0u8; block * host_pages];
    let mut dst = vec![0u8; block * host_pages];
    for (i, b) in src.iter_mut().enumerate() {
        *b = ((i * 31) >> 3) as u8;
    }
    dst.fill(1); // fault the destination in, as an engine pool would be
    let register = |label: &str, buf: &mut Vec<u8>| {
        // SAFETY: the buffers live in `Setup` next to the runner and are only
        // touched between operations.
        unsafe {
            runner.register_region(RegionDesc {
                label: label.into(),
                base: buf.as_mut_ptr() as u64,
                size: block as u64,
                stride: 0,
                count: host_pages as u64,
            })
        }
        .unwrap()
    };
    let src_region = register("kv", &mut src);
    let dst_region = register("kv:dst", &mut dst);
    Setup {
        runner,
        ns,
        src,
        dst,
        src_region,
        dst_region,
    }
}

fn wait(runner: &mut Runner, op: OpHandle) {
    loop {
        if runner
            .wait_completed(Duration::from_secs(5))
            .iter()
            .any(|r| r.op == op)
        {
            return;
        }
    }
}

fn key(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

/// memcpy anchor: one thread, `total` bytes in `chunk`-sized copies, warm buffers.
fn memcpy_gbps(chunk: usize, count: usize, reps: usize) -> f64 {
    let src = vec![7u8; chunk * count];
    let mut dst = vec![0u8; chunk * count];
    dst.fill(1);
    let mut samples = Vec::new();
    for _ in 0..reps {
        let start = Instant::now();
        for i in 0..count {
            dst[i * chunk..(i + 1) * chunk].copy_from_slice(&src[i * chunk..(i + 1) * chunk]);
        }
        black_box(&dst);
        samples.push((chunk * count) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    median(samples)
}

fn throughput(quick: bool) {
    const BLOCK: usize = 256 << 10;
    const N: usize = 512;
    let reps = if quick { 7 } else { 21 };
    let mut s = setup(BLOCK, N as u32, N);
    let mut deposit = Vec::new();
    let mut deliver = Vec::new();
    for rep in 0..reps {
        let base = (rep * N) as u64;
        let entries: Vec<DepositEntry> = (0..N)
            .map(|p| DepositEntry {
                key: key(s.ns, base + p as u64),
                spans: vec![ElementRef {
                    region: s.src_region,
                    index: p as u64,
                }],
                page: None,
            })
            .collect();
        let start = Instant::now();
        let op = s.runner.deposit(entries, false).unwrap();
        wait(&mut s.runner, op);
        deposit.push((BLOCK * N) as f64 / start.elapsed().as_secs_f64() / 1e9);
        let entries: Vec<DeliverEntry> = (0..N)
            .map(|p| DeliverEntry {
                key: key(s.ns, base + p as u64),
                destinations: vec![ElementRef {
                    region: s.dst_region,
                    index: p as u64,
                }],
            })
            .collect();
        let start = Instant::now();
        let op = s.runner.deliver(entries).unwrap();
        wait(&mut s.runner, op);
        deliver.push((BLOCK * N) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    assert_eq!(s.src, s.dst, "delivered bytes differ");
    let anchor = memcpy_gbps(BLOCK, N, reps);
    bench("runner.deposit", median(deposit), "GB/s", Some(anchor));
    bench("runner.deliver", median(deliver), "GB/s", Some(anchor));
}

/// Deposit throughput with page digests (taken on the copy lanes, as by
/// default) over the same deposits without, alternately in one round:
/// `runner.deposit_digests`, target ratio ≥ 0.9.
fn deposit_digest_cost(quick: bool) {
    const BLOCK: usize = 256 << 10;
    const N: usize = 512;
    let reps = if quick { 7 } else { 21 };
    let mut s = setup(BLOCK, N as u32, N);
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for rep in 0..2 * reps {
        let digests = rep % 2 == 0;
        s.runner.set_page_digests(digests);
        let base = (rep * N) as u64;
        let entries: Vec<DepositEntry> = (0..N)
            .map(|p| DepositEntry {
                key: key(s.ns, base + p as u64),
                spans: vec![ElementRef {
                    region: s.src_region,
                    index: p as u64,
                }],
                page: None,
            })
            .collect();
        let start = Instant::now();
        let op = s.runner.deposit(entries, false).unwrap();
        wait(&mut s.runner, op);
        let gbps = (BLOCK * N) as f64 / start.elapsed().as_secs_f64() / 1e9;
        if digests {
            on.push(gbps)
        } else {
            off.push(gbps)
        }
    }
    bench(
        "runner.deposit_digests",
        median(on),
        "GB/s",
        Some(median(off)),
    );
}

/// Which page digest: GB/s per core of xxh3-64, crc32c (hardware) and
/// BLAKE3 over one page, 256 KiB to 8 MiB (`# digest` lines, no figure).
fn digest_choice(quick: bool) {
    let reps = if quick { 3 } else { 9 };
    for size in [256usize << 10, 1 << 20, 8 << 20] {
        let page: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        let rounds = ((512 << 20) / size).max(1);
        let rate = |f: &dyn Fn(&[u8]) -> u64| {
            let samples = (0..reps)
                .map(|_| {
                    let start = Instant::now();
                    for _ in 0..rounds {
                        black_box(f(black_box(&page)));
                    }
                    (size * rounds) as f64 / start.elapsed().as_secs_f64() / 1e9
                })
                .collect();
            median(samples)
        };
        let xxh3 = rate(&|b| kvcr_foundation::sys::digest::digest_bytes(b));
        let crc = rate(&|b| u64::from(crc32c::crc32c(b)));
        let blake = rate(&|b| u64::from(blake3::hash(b).as_bytes()[0]));
        println!(
            "# digest {} KiB: xxh3-64 {xxh3:.1} GB/s, crc32c {crc:.1} GB/s, BLAKE3 {blake:.1} GB/s",
            size >> 10
        );
    }
}

fn one_block_latency(quick: bool) {
    const BLOCK: usize = 256 << 10;
    let iters = if quick { 300 } else { 2000 };
    let mut s = setup(BLOCK, 64, 64);
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters {
        let entry = DepositEntry {
            key: key(s.ns, i as u64),
            spans: vec![ElementRef {
                region: s.src_region,
                index: (i % 64) as u64,
            }],
            page: None,
        };
        let start = Instant::now();
        let op = s.runner.deposit(vec![entry], false).unwrap();
        wait(&mut s.runner, op);
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    // Anchor: one 256 KiB memcpy on the caller's thread.
    let src = vec![3u8; BLOCK];
    let mut dst = vec![0u8; BLOCK];
    let mut anchor = Vec::new();
    for _ in 0..iters {
        let start = Instant::now();
        dst.copy_from_slice(&src);
        black_box(&dst);
        anchor.push(start.elapsed().as_secs_f64() * 1e6);
    }
    let samples = sorted(samples);
    let p99 = at(&samples, 0.99);
    dist("runner.one_block_deposit", &samples);
    bench(
        "runner.one_block_deposit_p50",
        median(samples),
        "us",
        Some(median(anchor)),
    );
    println!("# runner.one_block_deposit p99={p99:.1}us");
}

/// Builds a runner holding `n` tiny resident blocks; returns it with the heap
/// bytes the index and records took per block.
fn resident(n: usize) -> (Setup, f64) {
    const TINY: usize = 8;
    // Everything the runner allocates counts (index and records are sized at
    // startup), except the pool and the two engine buffers, which are payload.
    let before = ALLOC.live_bytes();
    let mut s = setup(TINY, n as u32, n);
    let payload = (s.runner.pools().bytes() + 2 * (TINY * n) as u64) as i64;
    const BATCH: usize = 8192;
    for start in (0..n).step_by(BATCH) {
        let entries: Vec<DepositEntry> = (start..(start + BATCH).min(n))
            .map(|p| DepositEntry {
                key: key(s.ns, p as u64 * 0x9e37_79b9 + 1),
                spans: vec![ElementRef {
                    region: s.src_region,
                    index: p as u64,
                }],
                page: None,
            })
            .collect();
        let op = s.runner.deposit(entries, false).unwrap();
        wait(&mut s.runner, op);
    }
    assert_eq!(s.runner.pools().resident_blocks(), n);
    let per_block = (ALLOC.live_bytes() - before - payload) as f64 / n as f64;
    (s, per_block)
}

/// One batch of random resident keys, like a request's prefix lookup.
fn batch_keys(s: &Setup, n: usize) -> Vec<ScopedKey> {
    let mut rng = 0x1234_5678_u64;
    (0..4096)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            key(s.ns, (rng % n as u64) * 0x9e37_79b9 + 1)
        })
        .collect()
}

fn query_ns_per_key(s: &Setup, n: usize, quick: bool) -> f64 {
    // Random hits across the whole resident set; each key is looked up once
    // per pass.
    let keys = batch_keys(s, n);
    let batch = keys.len();
    let mut out = vec![QueryStatus::Miss; batch];
    let passes = if quick { 200 } else { 1000 };
    let mut samples = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..passes {
            s.runner.query_into(black_box(&keys), &mut out);
        }
        samples.push(start.elapsed().as_secs_f64() * 1e9 / (passes * batch) as f64);
        assert!(out.iter().all(|q| *q == QueryStatus::Hit));
    }
    median(samples)
}

/// The naive anchor: the same keys looked up in a `std` `HashMap` holding
/// the same `n` keys (a slot number each), same batches and passes.
fn hashmap_ns_per_key(s: &Setup, n: usize, quick: bool) -> f64 {
    let map: std::collections::HashMap<ScopedKey, u64> = (0..n)
        .map(|p| (key(s.ns, p as u64 * 0x9e37_79b9 + 1), p as u64))
        .collect();
    let keys = batch_keys(s, n);
    let batch = keys.len();
    let mut out = vec![QueryStatus::Miss; batch];
    let passes = if quick { 200 } else { 1000 };
    let mut samples = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..passes {
            for (k, o) in black_box(&keys).iter().zip(out.iter_mut()) {
                *o = if map.contains_key(k) {
                    QueryStatus::Hit
                } else {
                    QueryStatus::Miss
                };
            }
            black_box(&out);
        }
        samples.push(start.elapsed().as_secs_f64() * 1e9 / (passes * batch) as f64);
        assert!(out.iter().all(|q| *q == QueryStatus::Hit));
    }
    median(samples)
}

fn queries(quick: bool) {
    let small = 1_000;
    let large = if quick { 1_000_000 } else { 10_000_000 };
    let (s_small, _) = resident(small);
    let at_small = query_ns_per_key(&s_small, small, quick);
    let naive_small = hashmap_ns_per_key(&s_small, small, quick);
    drop(s_small);
    let (s_large, per_block) = resident(large);
    let at_large = query_ns_per_key(&s_large, large, quick);
    let naive_large = hashmap_ns_per_key(&s_large, large, quick);
    bench(
        "runner.query_hits",
        1e3 / at_large,
        "Mkeys/s",
        Some(1e3 / naive_large),
    );
    bench("runner.bytes_per_block", per_block, "bytes", None);
    bench("runner.query_scale", at_large / at_small, "x", None);
    // Cost per key at each resident-set size, for the scaling plot.
    bench(
        &format!("runner.query_ns@{small}"),
        at_small,
        "ns/key",
        Some(naive_small),
    );
    bench(
        &format!("runner.query_ns@{large}"),
        at_large,
        "ns/key",
        Some(naive_large),
    );
    println!(
        "# runner.query ns/key: {at_small:.1} at {small} blocks, {at_large:.1} at {large} blocks"
    );
}

/// Deposit throughput (GB/s) of 512 × 256 KiB pages with real tokens, with
/// or without a publisher sink attached (PUB bound on loopback, no subscriber:
/// publishing must never slow the runner down).
fn deposit_rate(publish: bool, reps: usize) -> f64 {
    const BLOCK: usize = 256 << 10;
    const N: usize = 512;
    let mut s = setup(BLOCK, N as u32, N);
    let publisher = publish.then(|| {
        let config = PublisherConfig::new(
            TopicParts {
                worker_id: 1,
                dp_rank: 0,
            },
            s.runner.incarnation(),
            PubSocket::Bind(kvcr_foundation::BindAddress::parse("tcp://127.0.0.1:0").unwrap()),
        );
        let publisher = Publisher::start(config).unwrap();
        s.runner.set_inventory_sink(Box::new(publisher.sink()));
        publisher
    });
    let mut samples = Vec::new();
    for rep in 0..reps {
        let base = (rep * N) as u64;
        let entries: Vec<DepositEntry> = (0..N)
            .map(|p| DepositEntry {
                key: key(s.ns, base + p as u64),
                spans: vec![ElementRef {
                    region: s.src_region,
                    index: p as u64,
                }],
                page: Some(PageInfo {
                    parent: (p > 0).then(|| BlockKey::from_u64(base + p as u64 - 1)),
                    token_ids: (0..64).map(|t| (p * 64 + t) as u32).collect(),
                }),
            })
            .collect();
        let start = Instant::now();
        let op = s.runner.deposit(entries, false).unwrap();
        wait(&mut s.runner, op);
        samples.push((BLOCK * N) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    drop(publisher);
    median(samples)
}

fn publishing_overhead(quick: bool) {
    let reps = if quick { 9 } else { 25 };
    // Interleave to share the machine's noise between the two.
    let mut with = Vec::new();
    let mut without = Vec::new();
    for _ in 0..3 {
        without.push(deposit_rate(false, reps));
        with.push(deposit_rate(true, reps));
    }
    let (with, without) = (median(with), median(without));
    bench("publisher.deposit_overhead", with / without, "x", None);
    println!("# deposit with publishing {with:.2} GB/s, without {without:.2} GB/s");
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: build
    // check only, no timing in tests.
    if !std::env::args().any(|a| a == "--bench") {
        println!("runner bench: run with `cargo bench` or `cargo xtask bench`");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    // A name (`cargo bench --bench runner -- deposit_digests`) runs only
    // the groups whose name holds it.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    type Group = (&'static str, fn(bool));
    let groups: [Group; 6] = [
        ("throughput", throughput),
        ("deposit_digests", deposit_digest_cost),
        ("digest_choice", digest_choice),
        ("one_block_latency", one_block_latency),
        ("publishing_overhead", publishing_overhead),
        ("queries", queries),
    ];
    for (name, group) in groups {
        if only.is_empty() || only.iter().any(|o| name.contains(o.as_str())) {
            group(quick);
        }
    }
}
