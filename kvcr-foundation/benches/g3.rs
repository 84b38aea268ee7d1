//! G3 file tier benchmarks, each beside an anchor measured in the same round
//! on the same files.
//!
//! `cargo bench -p kvcr-foundation --bench g3 [-- --quick]` (or
//! `cargo xtask bench`) prints:
//! - `BENCH g3.spill`: slots written from a DRAM buffer (page-aligned,
//!   pre-faulted, 1 GiB: not a small buffer reused from cache) through
//!   `G3Store::run_batch`, striped over 3 files; anchor: the same bytes
//!   written to the same files `O_DIRECT`, one thread per file, sequential
//!   4 MiB `pwrite`s (like `dd oflag=direct bs=4M`).
//! - `BENCH g3.fill`: the slots read back into DRAM; anchor: the files read
//!   `O_DIRECT`, one thread per file, sequential 4 MiB `pread`s. Every fill
//!   is byte-checked.
//! - `BENCH g3.one_block_fill_p50`: one slot read with `G3Store::read_slot`;
//!   anchor: one `O_DIRECT` `pread` of a slot's size at the same 4 KiB-aligned
//!   offset of the same file.
//!
//! The slot is a realistic page: one Qwen3-0.6B 64-token page shard per
//! tensor-parallel rank at TP=2 (28 layers × K and V × 8 KV heads × 128 ×
//! 2 bytes × 64 tokens / 2 = 3,670,016 bytes, 3.5 MiB).
//!
//! Files live in `target/g3-bench` (or `$KVCR_G3_BENCH_DIR`), written once
//! before measuring (so every measured write overwrites allocated blocks, the
//! anchor's as the store's) and removed at the end.
//! - `BENCH g3.deposit_with_spills`: a runner whose 64-page DRAM pool is
//!   full deposits 16 fresh 1 MiB pages per call, its G3 spilling behind:
//!   between calls the spills ahead (copies of the pages next in line for
//!   eviction) finish, and only the deposit calls are timed; anchor: the
//!   same deposits into the same pool without G3 (the victims are dropped),
//!   in the same round. The spilled pages are read back and byte-checked.
//!
//! `KVCR_G3_BENCH_WORKERS=a,b,…` adds one `g3.spill_w<N>`/`g3.fill_w<N>`
//! pair per worker count (to choose the default).

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(missing_docs)]

mod common;
use common::{bench, gbps, median};

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvcr_foundation::runner::g3::{DirectBuf, G3Options, G3SliceIo, G3Store, G3Tuning};

/// One Qwen3-0.6B 64-token page shard at TP=2.
const SLOT: u64 = 3_670_016;
const FILES: usize = 3;
/// 98 per file: 294 × 3.5 MiB = 1.005 GiB.
const SLOTS_PER_FILE: u64 = 98;
const SLOTS: u64 = SLOTS_PER_FILE * FILES as u64;
const TOTAL: u64 = SLOTS * SLOT;
/// The anchor's request size (`dd bs=4M`).
const CHUNK: u64 = 4 << 20;

/// The bench's directory, removed on drop (also when a check panics).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random bytes (xorshift64*), fast enough for 1 GiB.
fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_exact_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        chunk.copy_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
}

/// Who wrote the files last: their layout differs.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// Slot `i` holds `src[i × SLOT..]` (the store's striping).
    Store,
    /// File `f` holds `src[f × share..]` contiguously (the anchor's).
    Anchor,
}

/// Where slot `slot`'s bytes came from in `src`, by layout.
fn source_offset(slot: u64, layout: Layout) -> u64 {
    match layout {
        Layout::Store => slot * SLOT,
        Layout::Anchor => {
            let (file, row) = (slot % FILES as u64, slot / FILES as u64);
            file * SLOTS_PER_FILE * SLOT + row * SLOT
        }
    }
}

fn open_direct(path: &PathBuf) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap()
}

/// The anchor's direction: a buffer written to the files, or one read into.
enum Anchor<'a> {
    Write(&'a DirectBuf),
    Read(&'a mut DirectBuf),
}

/// The anchor: one thread per file moving its share sequentially in 4 MiB
/// requests, `O_DIRECT`.
fn anchor(files: &[File], buf: Anchor<'_>) -> Duration {
    let share = (SLOTS_PER_FILE * SLOT) as usize;
    let start = Instant::now();
    std::thread::scope(|s| match buf {
        Anchor::Write(buf) => {
            for (file, part) in files.iter().zip(buf.chunks(share)) {
                s.spawn(move || {
                    for (i, chunk) in part.chunks(CHUNK as usize).enumerate() {
                        file.write_all_at(chunk, i as u64 * CHUNK).unwrap();
                    }
                });
            }
        }
        Anchor::Read(buf) => {
            for (file, part) in files.iter().zip(buf.chunks_mut(share)) {
                s.spawn(move || {
                    for (i, chunk) in part.chunks_mut(CHUNK as usize).enumerate() {
                        file.read_exact_at(chunk, i as u64 * CHUNK).unwrap();
                    }
                });
            }
        }
    });
    start.elapsed()
}

/// Which way [`through_store`] moves a buffer.
enum Through<'a> {
    /// Buffer → slots.
    Spill(&'a DirectBuf),
    /// Slots → buffer.
    Fill(&'a mut DirectBuf),
}

/// Every slot through the store, one batch (the buffer lent to the store
/// for the call: its registry checks every item's memory).
fn through_store(store: &G3Store, buf: Through<'_>) -> Duration {
    let slot_of = |slot: usize| slot as u64;
    let mut items: Vec<G3SliceIo<'_>> = match buf {
        Through::Spill(src) => src
            .chunks(SLOT as usize)
            .take(SLOTS as usize)
            .enumerate()
            .map(|(slot, src)| G3SliceIo::Write {
                slot: slot_of(slot),
                src,
            })
            .collect(),
        Through::Fill(dst) => dst
            .chunks_mut(SLOT as usize)
            .take(SLOTS as usize)
            .enumerate()
            .map(|(slot, dst)| G3SliceIo::Read {
                slot: slot_of(slot),
                dst,
            })
            .collect(),
    };
    let start = Instant::now();
    let outcomes = store.run_batch_slices(&mut items);
    let elapsed = start.elapsed();
    for (slot, outcome) in outcomes.iter().enumerate() {
        if let Err(e) = outcome {
            panic!("slot {slot}: {e}");
        }
    }
    elapsed
}

fn check_fill(src: &DirectBuf, dst: &DirectBuf, layout: Layout) {
    for slot in 0..SLOTS {
        let from = source_offset(slot, layout) as usize;
        let at = (slot * SLOT) as usize;
        let len = SLOT as usize;
        assert!(
            dst[at..at + len] == src[from..from + len],
            "slot {slot}: the bytes read back differ"
        );
    }
}

struct Round {
    spill: f64,
    spill_anchor: f64,
    fill: f64,
    fill_anchor: f64,
}

/// One round: anchor write and spill (in alternating order), anchor read and
/// fill (the fill byte-checked against whoever wrote last).
fn round(
    store: &G3Store,
    files: &[File],
    src: &DirectBuf,
    dst: &mut DirectBuf,
    store_first: bool,
) -> Round {
    let (spill, spill_anchor, layout) = if store_first {
        let s = through_store(store, Through::Spill(src));
        let a = anchor(files, Anchor::Write(src));
        (s, a, Layout::Anchor)
    } else {
        let a = anchor(files, Anchor::Write(src));
        let s = through_store(store, Through::Spill(src));
        (s, a, Layout::Store)
    };
    let fill_store = |dst: &mut DirectBuf| {
        dst.fill(0);
        let d = through_store(store, Through::Fill(dst));
        check_fill(src, dst, layout);
        d
    };
    let (fill, fill_anchor) = if store_first {
        let f = fill_store(dst);
        (f, anchor(files, Anchor::Read(dst)))
    } else {
        let a = anchor(files, Anchor::Read(dst));
        (fill_store(dst), a)
    };
    Round {
        spill: gbps(TOTAL, spill),
        spill_anchor: gbps(TOTAL, spill_anchor),
        fill: gbps(TOTAL, fill),
        fill_anchor: gbps(TOTAL, fill_anchor),
    }
}

fn throughput(
    paths: &[PathBuf],
    src: &DirectBuf,
    dst: &mut DirectBuf,
    tuning: G3Tuning,
    rounds: usize,
    suffix: &str,
) {
    let options = G3Options {
        paths: paths.to_vec(),
        capacity_bytes_per_file: SLOTS_PER_FILE * SLOT,
    };
    let store = G3Store::open_with(&options, SLOT, tuning).unwrap();
    let files: Vec<File> = paths.iter().map(open_direct).collect();
    let results: Vec<Round> = (0..rounds)
        .map(|r| round(&store, &files, src, dst, r % 2 == 1))
        .collect();
    let pick = |f: fn(&Round) -> f64| median(results.iter().map(f).collect());
    bench(
        &format!("g3.spill{suffix}"),
        pick(|r| r.spill),
        "GB/s",
        Some(pick(|r| r.spill_anchor)),
    );
    bench(
        &format!("g3.fill{suffix}"),
        pick(|r| r.fill),
        "GB/s",
        Some(pick(|r| r.fill_anchor)),
    );
    if suffix.is_empty() {
        println!(
            "# g3: {} workers, {FILES} files, {SLOTS} slots of {SLOT} B (1.005 GiB); \
             alignment: memory {} B, offset {} B",
            store.workers(),
            store.alignment(),
            store.offset_alignment()
        );
    }
}

/// One slot read on the caller's thread vs one `O_DIRECT` `pread` of the
/// same bytes, interleaved, over slots spread across the files.
fn one_block(paths: &[PathBuf], dst: &mut DirectBuf, samples: usize) {
    let options = G3Options {
        paths: paths.to_vec(),
        capacity_bytes_per_file: SLOTS_PER_FILE * SLOT,
    };
    let store = G3Store::open(&options, SLOT).unwrap();
    let files: Vec<File> = paths.iter().map(open_direct).collect();
    let mut ours = Vec::with_capacity(samples);
    let mut theirs = Vec::with_capacity(samples);
    let page = &mut dst[..SLOT as usize];
    for i in 0..samples as u64 {
        // A stride coprime with the slot count: every sample another slot.
        let slot = (i * 97) % SLOTS;
        let (file, offset) = store.location(slot).unwrap();
        let start = Instant::now();
        files[file].read_exact_at(page, offset).unwrap();
        theirs.push(start.elapsed().as_secs_f64() * 1e6);
        let slot = (slot + 1) % SLOTS;
        let start = Instant::now();
        store.read_slot_into(slot, page).unwrap();
        ours.push(start.elapsed().as_secs_f64() * 1e6);
    }
    bench(
        "g3.one_block_fill_p50",
        median(ours),
        "us",
        Some(median(theirs)),
    );
}

/// Deposit GB/s of `calls` calls of 16 fresh pages into a full 64-page pool
/// (after filling it), with G3 under it (`g3_dir`) or without.
fn deposit_rate(g3_dir: Option<&std::path::Path>, src: &DirectBuf, calls: usize) -> f64 {
    use kvcr_foundation::protocol::{ElementRef, OpHandle};
    use kvcr_foundation::runner::{DeliverEntry, DepositEntry, RegionDesc, Runner, RunnerConfig};
    use kvcr_foundation::{BlockKey, CompatDigest, Namespace, ScopedKey};
    const PAGE: usize = 1 << 20;
    const POOL: u64 = 64;
    const BATCH: u64 = 16;
    let config = RunnerConfig {
        g3: g3_dir.map(|dir| G3Options {
            paths: vec![dir.join("deposit-0"), dir.join("deposit-1")],
            capacity_bytes_per_file: (POOL + BATCH * calls as u64) * PAGE as u64,
        }),
        ..RunnerConfig::single_pool("kv", PAGE as u64, POOL as u32)
    };
    let mut runner = Runner::start(config, None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(5)));
    let host_pages = (src.len() / PAGE) as u64;
    // SAFETY: `src` outlives the runner (dropped at the end of this function)
    // and is only read by it.
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: src.addr(),
            size: PAGE as u64,
            stride: 0,
            count: host_pages,
        })
    }
    .unwrap();
    let mut dst = DirectBuf::new(BATCH as usize * PAGE, 4096).unwrap();
    // SAFETY: as above; `dst` is written by the runner's deliver only.
    let dst_region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv:dst".into(),
            base: dst.addr(),
            size: PAGE as u64,
            stride: 0,
            count: BATCH,
        })
    }
    .unwrap();
    let key = |k: u64| ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    };
    let wait = |runner: &mut Runner, op: OpHandle| loop {
        if let Some(r) = runner
            .wait_completed(Duration::from_secs(30))
            .into_iter()
            .find(|r| r.op == op)
        {
            assert!(r.entries.iter().all(|(_, e)| e.is_success()), "{r:?}");
            return;
        }
    };
    let deposit = |runner: &mut Runner, first: u64, n: u64| {
        let entries = (first..first + n)
            .map(|k| DepositEntry {
                key: key(k),
                spans: vec![ElementRef {
                    region,
                    index: k % host_pages,
                }],
                page: None,
            })
            .collect();
        let op = runner.deposit(entries, false).unwrap();
        wait(runner, op);
    };
    for first in (0..POOL).step_by(BATCH as usize) {
        deposit(&mut runner, first, BATCH);
    }
    // The engine offloads in bursts with time between them (a request's
    // pages, then decoding): between two timed deposits the spills ahead
    // finish, as they do whenever the disk keeps up on average.
    let settle = |runner: &Runner| {
        while runner.pools().g3_stats().is_some_and(|g| {
            g.counters.spills > g.counters.spills_committed + g.counters.spills_failed
        }) {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let mut busy = Duration::ZERO;
    for call in 0..calls as u64 {
        settle(&runner);
        let start = Instant::now();
        deposit(&mut runner, POOL + call * BATCH, BATCH);
        busy += start.elapsed();
    }
    let rate = gbps(BATCH * calls as u64 * PAGE as u64, busy);
    if g3_dir.is_some() {
        // Byte check: the first pages, moved to G3, read straight back.
        let entries = (0..BATCH)
            .map(|k| DeliverEntry {
                key: key(k),
                destinations: vec![ElementRef {
                    region: dst_region,
                    index: k,
                }],
            })
            .collect();
        let op = runner.deliver(entries).unwrap();
        wait(&mut runner, op);
        for k in 0..BATCH as usize {
            let page = k % host_pages as usize;
            assert!(
                dst[k * PAGE..(k + 1) * PAGE] == src[page * PAGE..(page + 1) * PAGE],
                "page {k} read back from G3 differs"
            );
        }
        assert_eq!(runner.pools().g3_stats().unwrap().failed_transfers, 0);
    }
    dst.fill(0);
    drop(runner);
    rate
}

/// `g3.deposit_with_spills` against the same deposits without G3.
fn deposit_with_spills(dir: &std::path::Path, rounds: usize) {
    // 256 MiB of source pages: not a buffer that sits in the cache.
    let mut src = DirectBuf::new(256 << 20, 4096).unwrap();
    fill_random(&mut src, 0x5eed);
    let calls = 16;
    let mut with = Vec::new();
    let mut without = Vec::new();
    for _ in 0..rounds {
        without.push(deposit_rate(None, &src, calls));
        with.push(deposit_rate(Some(dir), &src, calls));
    }
    bench(
        "g3.deposit_with_spills",
        median(with),
        "GB/s",
        Some(median(without)),
    );
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: build
    // check only, no timing in tests.
    if !std::env::args().any(|a| a == "--bench") {
        println!("g3 bench: run with `cargo bench` or `cargo xtask bench`");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var("KVCR_BENCH_QUICK").as_deref() == Ok("1");
    let dir = std::env::var_os("KVCR_G3_BENCH_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/g3-bench"),
        PathBuf::from,
    );
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let scratch = Scratch(dir);
    let paths: Vec<PathBuf> = (0..FILES)
        .map(|i| scratch.0.join(format!("g3-{i}")))
        .collect();

    let mut src = DirectBuf::new(TOTAL as usize, 4096).unwrap();
    let mut dst = DirectBuf::new(TOTAL as usize, 4096).unwrap();
    fill_random(&mut src, 0x9e37_79b9_7f4a_7c15);
    // Create and allocate the files once: every measured write overwrites.
    // Owner-only, as G3 refuses a file of its own that others may read.
    for p in &paths {
        std::os::unix::fs::OpenOptionsExt::mode(
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true),
            0o600,
        )
        .open(p)
        .unwrap();
    }
    let files: Vec<File> = paths.iter().map(open_direct).collect();
    anchor(&files, Anchor::Write(&src));
    drop(files);

    let rounds = if quick { 3 } else { 5 };
    throughput(&paths, &src, &mut dst, G3Tuning::default(), rounds, "");
    deposit_with_spills(&scratch.0, rounds);
    one_block(&paths, &mut dst, if quick { 40 } else { 200 });
    if let Ok(list) = std::env::var("KVCR_G3_BENCH_WORKERS") {
        for workers in list.split(',').filter_map(|w| w.trim().parse().ok()) {
            let tuning = G3Tuning {
                workers,
                ..G3Tuning::default()
            };
            throughput(
                &paths,
                &src,
                &mut dst,
                tuning,
                rounds,
                &format!("_w{workers}"),
            );
        }
    }
    drop(scratch);
}
