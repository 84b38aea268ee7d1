//! GPU restore/offload benchmark of the direct linker, Qwen3-32B geometry
//! (64 layers, 8 KV heads, head dim 128, bf16, 64-token pages: 128 spans of
//! 128 KiB per 16 MiB page), each figure beside an anchor measured in the
//! same run:
//!
//! * `direct.restore_32b`: KVCR DRAM → layer-first GPU pool, GB/s, anchor =
//!   one contiguous 1 GiB pinned host→device copy;
//! * `direct.offload_32b`: GPU pool → KVCR DRAM, anchor = contiguous
//!   device→host;
//! * `direct.naive_speedup`: batched kernels ÷ one driver copy per span, on
//!   the same pages;
//! * `direct.first_layer_ms`: until layer 0 (K and V of every page) landed,
//!   anchor = the whole restore.
//!
//! `--tp2 PAGES` and `--seed [PAGES]` run the peer restores (`peer.rs`, a
//! pipelined destination's restore in `pipelined.rs`;
//! for sweeps: `KVCR_BENCH_PART_PAGES` the restore's part size,
//! `KVCR_BENCH_WARM=1` an untimed restore in each destination first,
//! `KVCR_TP2_LANES`, `KVCR_TP2_BATCH_MIB` and `KVCR_ONE_HOP_BATCH_MIB`);
//! `--one-hop-raw [PAGES]` the one-hop route's CUDA copy between two
//! processes (`one_hop.rs`; `--compare none` skips its comparison modes).
//!
//! Restore and offload are timed from the linker call to its landing event
//! (wall clock: descriptor building, kernels, completion), medians of
//! `--repeats` runs. `--pages N` (default 1812, the 116K-token prompt; 128
//! with `--quick`). Without a CUDA driver it says so and exits 0.

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvcr_direct_linker::cuda::{Device, DeviceBuffer, Direction, contiguous_bandwidth};
use kvcr_direct_linker::{
    CopyMode, CudaCopier, DirectLinker, DirectLinkerConfig, KvLayout, KvMemory,
};
use kvcr_foundation::{AttemptLedger, BlockKey, Incarnation, NamespaceId, RequestId};
use kvcr_linker_contracts::{
    DeviceSlot, Linker, LinkerEvent, OffloadBatch, OffloadOutcome, PrefixQuery, RequestContext,
    RequestHooks,
};

// A bench target's root resolves modules beside it: its own go in `direct/`.
#[path = "direct/one_hop.rs"]
mod one_hop;
#[path = "direct/peer.rs"]
mod peer;
#[path = "direct/pipelined.rs"]
mod pipelined;

use self::peer::{tp2_dest, tp2_peer_restore, tp2_source};

const NAMESPACE: NamespaceId = NamespaceId(0x32b);
const SETTLE: Duration = Duration::from_secs(600);

pub(crate) fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pattern(buffer: usize, slot: u32, len: usize) -> Vec<u8> {
    let mut state = (buffer as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(slot);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("direct bench: run with `cargo bench` or `cargo xtask bench` (on a GPU machine)");
        return;
    }
    if let Some(pages) = arg("--one-hop-source") {
        let args: Vec<String> = std::env::args().collect();
        let at = args.iter().position(|a| a == "--one-hop-source").unwrap();
        one_hop::source(pages.parse().unwrap(), &args[at + 2]);
        return;
    }
    if let Some(rank) = arg("--tp2-source") {
        let args: Vec<String> = std::env::args().collect();
        let at = args.iter().position(|a| a == "--tp2-source").unwrap();
        let tp = args.get(at + 3).map_or(2, |t| t.parse().unwrap());
        tp2_source(rank.parse().unwrap(), args[at + 2].parse().unwrap(), tp);
        return;
    }
    if let Some(rank) = arg("--tp2-dest") {
        let args: Vec<String> = std::env::args().collect();
        let at = args.iter().position(|a| a == "--tp2-dest").unwrap();
        tp2_dest(
            rank.parse().unwrap(),
            args[at + 2].parse().unwrap(),
            &args[at + 3],
            &args[at + 4],
            args.get(at + 5).map_or(2, |t| t.parse().unwrap()),
        );
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let pages: u32 = arg("--pages")
        .map(|p| p.parse().unwrap())
        .unwrap_or(if quick { 128 } else { 1812 });
    let repeats: usize = arg("--repeats")
        .map(|p| p.parse().unwrap())
        .unwrap_or(if quick { 3 } else { 5 });
    let device = match Device::open(0) {
        Ok(device) => device,
        Err(e) => {
            println!(
                "# direct: skipped, no GPU here ({e}); build with `cargo xtask gpu-build` and run on a GPU machine"
            );
            return;
        }
    };
    println!(
        "# direct: {} , {pages} pages of Qwen3-32B KV",
        device.name()
    );

    let h2d = contiguous_bandwidth(&device, 1 << 30, Direction::HostToDevice, 5).unwrap();
    let d2h = contiguous_bandwidth(&device, 1 << 30, Direction::DeviceToHost, 5).unwrap();
    println!(
        "# direct: contiguous pinned 1 GiB host->device {h2d:.1} GB/s, device->host {d2h:.1} GB/s"
    );
    if let Some(tp2_pages) = arg("--tp2") {
        let mut gpus = vec![(Arc::clone(&device), h2d)];
        let count = kvcr_direct_linker::cuda::device_count().unwrap();
        if count > 1 {
            let second = Device::open(1).unwrap();
            let anchor =
                contiguous_bandwidth(&second, 1 << 30, Direction::HostToDevice, 5).unwrap();
            println!("# tp2: GPU 1 contiguous pinned host->device {anchor:.1} GB/s");
            gpus.push((second, anchor));
        }
        tp2_peer_restore(&gpus, tp2_pages.parse().unwrap(), 2);
        return;
    }
    if std::env::args().any(|a| a == "--one-hop-raw") {
        let pages = arg("--one-hop-raw")
            .and_then(|p| p.parse().ok())
            .unwrap_or(1812);
        one_hop::run(&device, h2d, pages);
        return;
    }
    // `--seed [PAGES]`: the seeds' headline restore, TP=1, Qwen3-32B, 1812
    // pages of 64 tokens (115,968 tokens, 30.4 GB), the source a second
    // process on this host.
    if std::env::args().any(|a| a == "--seed") {
        let pages = arg("--seed").and_then(|p| p.parse().ok()).unwrap_or(1812);
        tp2_peer_restore(&[(Arc::clone(&device), h2d)], pages, 1);
        return;
    }

    let mut layout = KvLayout {
        layers: 64,
        page_tokens: 64,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        device_pages: pages,
        tp_rank: 0,
        tp_size: 1,
        k_bases: Vec::new(),
        v_bases: Vec::new(),
    };
    let span = layout.span_bytes() as usize;
    let t = Instant::now();
    let buffers: Vec<DeviceBuffer> = (0..layout.spans_per_page())
        .map(|i| {
            let b = DeviceBuffer::allocate(&device, span * pages as usize).unwrap();
            b.fill((i * 7 + 1) as u8).unwrap();
            b
        })
        .collect();
    // A few pages get random bytes in every span, checked after each restore.
    let sampled: Vec<u32> = [0, pages / 3, pages / 2, pages - 1].to_vec();
    for (i, b) in buffers.iter().enumerate() {
        for slot in &sampled {
            b.write(*slot as usize * span, &pattern(i, *slot, span))
                .unwrap();
        }
    }
    let bases: Vec<u64> = buffers.iter().map(DeviceBuffer::address).collect();
    layout.k_bases = bases.iter().step_by(2).copied().collect();
    layout.v_bases = bases.iter().skip(1).step_by(2).copied().collect();
    let copier =
        Arc::new(CudaCopier::new(&device, CopyMode::best_for(&device).unwrap(), 2).unwrap());
    let config = DirectLinkerConfig {
        layout: layout.clone(),
        store_pages: pages,
        operation_timeout: Duration::from_secs(300),
        incarnation: Incarnation::from_raw(1).unwrap(),
        peer: None,
        prefault: true,
    };
    // SAFETY: the device buffers outlive the linker (dropped at the end of
    // main, after it) and are touched only between landed transfers.
    let mut linker =
        unsafe { DirectLinker::new(config, KvMemory::Cuda(Arc::clone(&copier))) }.unwrap();
    println!(
        "# direct: setup (device pool, {:.1} GB KVCR DRAM pinned) {:.1} s",
        linker.runner().pools().bytes() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let bytes = layout.page_bytes() * u64::from(pages);

    // Offload: each round offloads the pool under fresh keys, so the store
    // evicts the previous round's pages (the steady state of a full store).
    let round_keys = |round: u64| -> Vec<BlockKey> {
        (0..u64::from(pages))
            .map(|p| BlockKey::from_u64((round << 32) | (0x5000 + p)))
            .collect()
    };
    let mut offload_gbps: Vec<(CopyMode, Vec<f64>)> = Vec::new();
    let mut round = 0u64;
    let mut keys = Vec::new();
    for mode in [CopyMode::DriverBatch, CopyMode::Batched] {
        copier.set_mode(mode).unwrap();
        let mut samples = Vec::new();
        for _ in 0..repeats {
            round += 1;
            keys = round_keys(round);
            let batch = OffloadBatch {
                namespace: NAMESPACE,
                pages: keys
                    .iter()
                    .enumerate()
                    .map(|(s, k)| (*k, DeviceSlot(s as u32)))
                    .collect(),
            };
            let t = Instant::now();
            let OffloadOutcome::Queued(ticket) = linker.offload(batch).unwrap() else {
                panic!("offload declined");
            };
            let events = linker.settle(SETTLE);
            let secs = t.elapsed().as_secs_f64();
            assert!(
                events.contains(&LinkerEvent::OffloadDone {
                    ticket,
                    success: true
                }),
                "{events:?}"
            );
            samples.push(bytes as f64 / secs / 1e9);
            let p = copier.last_profile();
            println!(
                "# direct: offload {mode:?}: linker {:.1} ms, copier {:.1} ms (GPU {:.1} ms = {:.1} GB/s, descriptors {:.1} ms)",
                secs * 1e3,
                p.wall_ms,
                p.total_ms,
                bytes as f64 / f64::from(p.total_ms) / 1e6,
                p.host_ms
            );
        }
        offload_gbps.push((mode, samples));
    }

    // Restore: wipe the device copy, prepare, load, check sampled pages.
    let mut ledger = AttemptLedger::new();
    let mut restore = |mode: CopyMode, round: usize| -> (f64, f32) {
        copier.set_mode(mode).unwrap();
        for b in &buffers {
            b.fill(0).unwrap();
        }
        let query = PrefixQuery {
            namespace: NAMESPACE,
            device_prefix_pages: 0,
            tail: keys.clone(),
        };
        let (context, _) = RequestContext::begin(
            &mut ledger,
            RequestId(format!("r{round}-{mode:?}")),
            Vec::new(),
            query,
        );
        linker.request_started(&context).unwrap();
        let attempt = context.attempt().clone();
        let _ = linker.settle(SETTLE);
        assert_eq!(linker.lookup(&attempt, 0, &keys).unwrap().longest(), pages);
        let slots: Vec<DeviceSlot> = (0..pages).map(DeviceSlot).collect();
        let t = Instant::now();
        let ticket = linker.load(&attempt, &slots).unwrap();
        let events = linker.settle(SETTLE);
        let secs = t.elapsed().as_secs_f64();
        assert!(
            events.iter().any(|e| matches!(e, LinkerEvent::LoadDone { ticket: t, success: true, .. } if *t == ticket)),
            "{events:?}"
        );
        let p = copier.last_profile();
        println!(
            "# direct: restore {mode:?}: linker {:.1} ms, copier {:.1} ms (GPU {:.1} ms = {:.1} GB/s, descriptors {:.1} ms), first layer {:.2} ms",
            secs * 1e3,
            p.wall_ms,
            p.total_ms,
            bytes as f64 / f64::from(p.total_ms) / 1e6,
            p.host_ms,
            p.first_group_ms
        );
        linker.request_finished(&attempt).unwrap();
        for (i, b) in buffers.iter().enumerate() {
            for slot in &sampled {
                assert_eq!(
                    b.read(*slot as usize * span, span).unwrap(),
                    pattern(i, *slot, span),
                    "restored span {i} of page {slot} differs"
                );
            }
            let other = (pages / 4) as usize * span;
            let byte = b.read(other, 16).unwrap();
            if !sampled.contains(&(pages / 4)) {
                assert!(
                    byte.iter().all(|v| *v == (i * 7 + 1) as u8),
                    "span {i} differs"
                );
            }
        }
        (bytes as f64 / secs / 1e9, p.first_group_ms)
    };
    let mut restores: Vec<(CopyMode, Vec<f64>, Vec<f64>)> = Vec::new();
    for mode in [CopyMode::DriverBatch, CopyMode::Batched, CopyMode::PerSpan] {
        let rounds = if mode == CopyMode::PerSpan {
            repeats.min(3)
        } else {
            repeats
        };
        let (mut gbps, mut first) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let (g, f) = restore(mode, round);
            gbps.push(g);
            first.push(f64::from(f));
        }
        restores.push((mode, gbps, first));
    }
    let pick = |mode: CopyMode| {
        restores
            .iter()
            .find(|(m, ..)| *m == mode)
            .map(|(_, g, f)| (median(g.clone()), median(f.clone())))
            .unwrap()
    };
    let default_mode = CopyMode::best_for(&device).unwrap();
    let (restore_gbps, first) = pick(default_mode);
    let (driver_gbps, _) = pick(CopyMode::DriverBatch);
    let (kernel_gbps, _) = pick(CopyMode::Batched);
    let (naive_gbps, _) = pick(CopyMode::PerSpan);
    let offload_of = |mode: CopyMode| {
        offload_gbps
            .iter()
            .find(|(m, _)| *m == mode)
            .map(|(_, g)| median(g.clone()))
            .unwrap()
    };
    let offload = offload_of(default_mode);
    println!(
        "# direct: restore GB/s by mode: kernel {kernel_gbps:.2}, driver batch {driver_gbps:.2}, per span {naive_gbps:.2}; offload: kernel {:.2}, driver batch {:.2}; default {default_mode:?}",
        offload_of(CopyMode::Batched),
        offload_of(CopyMode::DriverBatch)
    );
    println!(
        "BENCH direct.restore_32b value={restore_gbps:.2} unit=GB/s anchor={h2d:.2} ratio={:.3}",
        restore_gbps / h2d
    );
    println!(
        "BENCH direct.offload_32b value={offload:.2} unit=GB/s anchor={d2h:.2} ratio={:.3}",
        offload / d2h
    );
    println!(
        "BENCH direct.naive_speedup value={:.2} unit=x anchor={naive_gbps:.2} ratio={:.2}",
        restore_gbps / naive_gbps,
        restore_gbps / naive_gbps
    );
    let total = bytes as f64 / restore_gbps / 1e6;
    println!(
        "BENCH direct.first_layer_ms value={first:.2} unit=ms anchor={total:.1} ratio={:.4}",
        first / total
    );
    drop(linker);
    drop(buffers);
}
