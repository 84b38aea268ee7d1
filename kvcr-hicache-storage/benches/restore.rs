//! HiCache restore benchmark: `batch_get` of 64-token Qwen3-32B pages
//! (16 MiB each at TP=1, two 8 MiB spans in a `page_first` host pool) from
//! local KVCR DRAM into the engine's host pool, beside a memcpy of the same
//! pages measured in the same run (interleaved, so both see the same noise).
//!
//! `cargo bench -p kvcr-hicache-storage --bench restore [-- --quick]` (or
//! `cargo xtask bench`) prints
//! `BENCH hicache.restore_page_first value=<GB/s> unit=GB/s anchor=<memcpy GB/s> ratio=<value/anchor>`.

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Instant;

use kvcr_foundation::BlockKey;
use kvcr_hicache_storage::{
    ExtraInfo, HostLayout, HostPoolDesc, KvGeometry, KvcrHiCacheStorage, RankGroups, StorageConfig,
};
use serde_json::json;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: build
    // check only, no timing in tests.
    if !std::env::args().any(|a| a == "--bench") {
        println!("hicache restore bench: run with `cargo bench` or `cargo xtask bench`");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let (pages, reps) = if quick { (8u64, 21) } else { (16u64, 41) };
    let geometry = KvGeometry::qwen3_32b(1);
    let page = geometry.page_bytes() as usize;
    assert_eq!(page, 16 << 20);
    let storage = KvcrHiCacheStorage::new(
        StorageConfig::single_rank(
            "Qwen/Qwen3-32B",
            json!({"local_dram_bytes": pages * geometry.page_bytes()}),
        ),
        RankGroups::solo(),
    )
    .unwrap();
    // Pages 0..n hold the offloaded KV; restores land in n..2n.
    let host_pages = 2 * pages;
    let len = HostPoolDesc::required_len(&geometry, host_pages).unwrap();
    let mut host = vec![0u8; len as usize];
    for (i, b) in host.iter_mut().enumerate() {
        *b = ((i * 131) >> 7) as u8;
    }
    // SAFETY: `host` outlives `storage` (dropped explicitly below, in that
    // order) and is read only between calls.
    unsafe {
        storage.register_host_pool(HostPoolDesc {
            layout: HostLayout::PageFirst,
            base: host.as_mut_ptr() as u64,
            len,
            pages: host_pages,
            geometry,
        })
    }
    .unwrap();
    let keys: Vec<BlockKey> = (0..pages).map(|p| BlockKey::from_u64(p + 1)).collect();
    let sources: Vec<u64> = (0..pages).collect();
    let targets: Vec<u64> = (pages..host_pages).collect();
    let none = ExtraInfo::default();
    assert!(storage.batch_set(&keys, &sources, &none).iter().all(|b| *b));

    // The anchor copies the same pages, one 16 MiB copy each, between two
    // warm buffers of the same size.
    let src = vec![7u8; page * pages as usize];
    let mut dst = vec![1u8; page * pages as usize];
    let bytes = (page as u64 * pages) as f64;
    let mut restore = Vec::new();
    let mut memcpy = Vec::new();
    for _ in 0..reps {
        let start = Instant::now();
        let got = storage.batch_get(&keys, &targets, &none);
        restore.push(bytes / start.elapsed().as_secs_f64() / 1e9);
        assert!(
            got.iter().all(|b| *b),
            "restore failed: {:?}",
            storage.stats()
        );
        let start = Instant::now();
        for (d, s) in dst.chunks_mut(page).zip(src.chunks(page)) {
            d.copy_from_slice(s);
        }
        black_box(&dst);
        memcpy.push(bytes / start.elapsed().as_secs_f64() / 1e9);
    }
    let plan = storage.span_plan().unwrap().clone();
    for p in 0..pages {
        for (off, span) in plan.page_spans(p) {
            let (a, b) = (off as usize, (off + span) as usize);
            let moved = (off + pages * plan.page_stride) as usize;
            assert_eq!(host[a..b], host[moved..moved + (b - a)], "page {p} differs");
        }
    }
    let (value, anchor) = (median(restore), median(memcpy));
    println!(
        "BENCH hicache.restore_page_first value={value:.3} unit=GB/s anchor={anchor:.3} ratio={:.3}",
        value / anchor
    );
    println!(
        "# hicache.restore_page_first: {pages} pages of 16 MiB (Qwen3-32B, TP=1, page_first), batch_get from KVCR DRAM vs one-thread memcpy"
    );
    drop(storage);
    drop(host);
}
