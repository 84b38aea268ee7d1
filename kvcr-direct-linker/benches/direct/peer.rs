//! The peer restore benches: issue 11's TP=2 run (`--tp2 PAGES`) and the
//! seed's headline workload at TP=1 (`--seed [PAGES]`), each rank and each
//! source its own process (`--tp2-source`, `--tp2-dest`): the two hops in
//! turn (peer KVCR DRAM -> this rank's KVCR DRAM -> GPU), pipelined
//! `restore_hinted` (the one-hop route: the source's KVCR DRAM straight into
//! this GPU), and pipelined with the one-hop route off (two hops, forced).

use kvcr_foundation::runner::timeline;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvcr_direct_linker::cuda::{Device, DeviceBuffer};
use kvcr_direct_linker::{
    CopyMode, CudaCopier, DirectLinker, DirectLinkerConfig, KvLayout, KvMemory,
};
use kvcr_foundation::RequestId;
use kvcr_foundation::{AttemptLedger, BlockKey, Incarnation};
use kvcr_linker_contracts::{
    DeviceSlot, Linker, LinkerEvent, OffloadBatch, OffloadOutcome, PrefixQuery, RequestContext,
    RequestHooks,
};

use super::pipelined::pipelined_restore;
use super::{NAMESPACE, SETTLE, pattern};

/// One rank of a TP=`tp` engine on `device`: its share of the Qwen3-32B
/// geometry's 8 KV heads, its own pool, a peer-enabled runner. Returns the
/// linker and the device buffers it registered (drop the linker first).
fn tp2_rank(
    device: &Arc<Device>,
    rank: u32,
    tp: u32,
    pages: u32,
    one_hop: bool,
) -> (DirectLinker, Vec<DeviceBuffer>) {
    let mut layout = KvLayout {
        layers: 64,
        page_tokens: 64,
        kv_heads: 8 / tp,
        head_dim: 128,
        dtype_bytes: 2,
        device_pages: pages,
        tp_rank: rank,
        tp_size: tp,
        k_bases: Vec::new(),
        v_bases: Vec::new(),
    };
    let span = layout.span_bytes() as usize;
    let buffers: Vec<DeviceBuffer> = (0..layout.spans_per_page())
        .map(|i| {
            let b = DeviceBuffer::allocate(device, span * pages as usize).unwrap();
            b.fill((i * 7 + 1 + rank as usize * 3) as u8).unwrap();
            b
        })
        .collect();
    let bases: Vec<u64> = buffers.iter().map(DeviceBuffer::address).collect();
    layout.k_bases = bases.iter().step_by(2).copied().collect();
    layout.v_bases = bases.iter().skip(1).step_by(2).copied().collect();
    let copier = Arc::new(CudaCopier::new(device, CopyMode::best_for(device).unwrap(), 2).unwrap());
    let config = DirectLinkerConfig {
        layout,
        store_pages: pages,
        operation_timeout: Duration::from_secs(300),
        incarnation: Incarnation::from_raw(u128::from(rank) + 10).unwrap(),
        peer: Some(kvcr_foundation::runner::PeerOptions {
            one_hop,
            ..tp2_peer_options()
        }),
        prefault: true,
    };
    // SAFETY: the buffers are returned with the linker and dropped after it.
    let linker = unsafe { DirectLinker::new(config, KvMemory::Cuda(copier)) }.unwrap();
    (linker, buffers)
}

/// Peer options of a TP=2 runner: the defaults, or `KVCR_TP2_LANES` lanes,
/// `KVCR_TP2_BATCH_MIB` MiB per write and `KVCR_ONE_HOP_BATCH_MIB` MiB per
/// one-hop write when set (inherited by the children, for sweeps).
fn tp2_peer_options() -> kvcr_foundation::runner::PeerOptions {
    let mut options = kvcr_foundation::runner::PeerOptions::loopback();
    if let Some(lanes) = std::env::var("KVCR_TP2_LANES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        options.lanes = lanes;
    }
    if let Some(mib) = std::env::var("KVCR_TP2_BATCH_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        options.write_batch_bytes = mib << 20;
    }
    if let Some(mib) = std::env::var("KVCR_ONE_HOP_BATCH_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        options.one_hop_write_batch_bytes = Some(mib << 20);
    }
    options
}

/// The keys of the TP=2 prompt.
fn tp2_keys(pages: u32) -> Vec<BlockKey> {
    (0..u64::from(pages))
        .map(|p| BlockKey::from_u64(0x7000 + p))
        .collect()
}

/// The pages whose every span is written with a pattern and checked.
fn tp2_checked(pages: u32) -> [u32; 2] {
    [0, pages - 1]
}

/// `--tp2-source RANK PAGES TP`: one source rank as its own process on GPU
/// `RANK % GPUs`: offloads the prompt, prints `ENDPOINT <endpoint>`, and
/// serves until stdin closes.
pub(crate) fn tp2_source(rank: u32, pages: u32, tp: u32) {
    let count = kvcr_direct_linker::cuda::device_count().unwrap();
    let device = Device::open(rank % count.max(1)).unwrap();
    let began = Instant::now();
    let (mut linker, buffers) = tp2_rank(&device, rank, tp, pages, true);
    progress(&format!("source {rank}: pools up"), began);
    let span = linker.layout().span_bytes() as usize;
    for (i, b) in buffers.iter().enumerate() {
        for slot in tp2_checked(pages) {
            let bytes = pattern(i + 1000 * rank as usize, slot, span);
            b.write(slot as usize * span, &bytes).unwrap();
        }
    }
    let batch = OffloadBatch {
        namespace: NAMESPACE,
        pages: tp2_keys(pages)
            .iter()
            .enumerate()
            .map(|(s, k)| (*k, DeviceSlot(s as u32)))
            .collect(),
    };
    let OffloadOutcome::Queued(ticket) = linker.offload(batch).unwrap() else {
        panic!("offload declined");
    };
    let events = linker.settle(SETTLE);
    assert!(events.contains(&LinkerEvent::OffloadDone {
        ticket,
        success: true
    }));
    progress(&format!("source {rank}: offloaded {pages} pages"), began);
    println!("ENDPOINT {}", linker.runner().peers().endpoint().unwrap());
    // `CPU`: this process's CPU seconds so far (the parent takes the
    // difference across a round: what serving a restore cost the source).
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        if line.trim() == "CPU" {
            // How many passes the one-hop writes took so far: the writes a
            // pass takes together land their first layer together.
            // And the time inside them: set against a round's wall time,
            // what went between passes.
            let stats = linker.runner().peers().control_stats();
            println!(
                "# source {rank}: {} one-hop copy passes so far, {:.1} ms inside them",
                stats.one_hop_passes,
                stats.one_hop_copy_ns as f64 / 1e6
            );
            println!(
                "# source {rank}: {} minor page faults so far",
                super::one_hop::minor_faults()
            );
            println!("CPU {}", super::one_hop::cpu_seconds());
            // With `KVCR_TIMELINE`: this round's marks, beside the
            // destination's.
            timeline::write().unwrap();
        } else if line.trim() == "IMPORTS" {
            let open = linker.runner().peers().control_stats().device_imports_open;
            println!("IMPORTS {open}");
        }
        line.clear();
    }
    drop(linker);
    drop(buffers);
}

/// `--tp2-dest RANK PAGES ENDPOINT MODE TP`: one destination rank as its own
/// process: restores its shard from the source rank at `ENDPOINT` on a hint
/// (peer KVCR DRAM → local KVCR DRAM → GPU), checks the patterned pages,
/// prints `RESULT <peer seconds> <total seconds> <pages landed in one hop>`.
/// MODE `seq` runs the two hops one after the other (prepare, lookup, load:
/// the peer seconds are the first hop); `pipe` is one pipelined
/// `restore_hinted` (peer seconds 0), which takes the one-hop route where
/// the source offers it; `pipe2` is the same with the one-hop route off.
pub(crate) fn tp2_dest(rank: u32, pages: u32, endpoint: &str, mode: &str, tp: u32) {
    let count = kvcr_direct_linker::cuda::device_count().unwrap();
    let device = Device::open(rank % count.max(1)).unwrap();
    let began = Instant::now();
    let (mut linker, buffers) = tp2_rank(&device, rank, tp, pages, mode != "pipe2");
    // `KVCR_BENCH_PART_PAGES`: the restore's part size, for comparison
    // (the linker's default otherwise).
    if let Some(part) = std::env::var("KVCR_BENCH_PART_PAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .and_then(std::num::NonZeroUsize::new)
    {
        linker.set_restore_part_pages(part);
    }
    progress(&format!("dest {rank} {mode}: pools up"), began);
    let span = linker.layout().span_bytes() as usize;
    let keys = tp2_keys(pages);
    let hint = kvcr_foundation::FetchHint {
        source: endpoint.parse().unwrap(),
        block_hashes: keys.clone(),
        mode: kvcr_foundation::hint::FetchMode::Copy,
        action_id: None,
    };
    // A route's handshake (the metadata, and the source opening our device
    // regions for the one-hop route) happens once per source, on its first
    // hint; an engine's routes to its peers are warm. Warm this one outside
    // the clock: a prepare for a key the source lacks.
    let mut ledger = AttemptLedger::new();
    warm_route(&mut linker, &mut ledger, endpoint);
    progress(&format!("dest {rank} {mode}: route warm"), began);
    // Ready (below): the parent starts both ranks' clocks together.
    if mode.starts_with("pipe") {
        // The timed restore's own counts (a warm-up's come before them).
        let counts = |linker: &DirectLinker| {
            let c = linker.runner().peers().stats().counters;
            let launches = linker
                .runner()
                .peers()
                .control_stats()
                .device_check_launches;
            [
                c.one_hop_writes,
                c.one_hop_pages,
                launches,
                c.one_hop_fallbacks,
            ]
        };
        // `KVCR_BENCH_WARM`: one untimed restore of the same pages first,
        // in this process, as a long-running engine has done before: its
        // heap has grown (a fresh process's first restore takes thousands
        // of first-touch faults). The pool is patterned over again after
        // it, so the timed restore's check sees only its own bytes.
        if mode == "pipe" && std::env::var_os("KVCR_BENCH_WARM").is_some() {
            let warm = pipelined_restore(
                &mut linker,
                &mut ledger,
                rank,
                pages,
                &hint,
                &keys,
                "warm-up",
            );
            warm.say(rank, "warm-up");
            for (i, b) in buffers.iter().enumerate() {
                b.fill((i * 7 + 1 + rank as usize * 3) as u8).unwrap();
            }
        }
        let before = counts(&linker);
        println!("READY");
        let mut go = String::new();
        let _ = std::io::stdin().read_line(&mut go);
        let restore = pipelined_restore(&mut linker, &mut ledger, rank, pages, &hint, &keys, mode);
        restore.say(rank, mode);
        check_shard(rank, pages, span, &buffers);
        let after = counts(&linker);
        let [writes, pages_one_hop, launches, fallbacks] =
            std::array::from_fn(|i| after[i] - before[i]);
        println!(
            "# rank {rank} {mode}: {writes} one-hop writes, {pages_one_hop} pages in one hop (checked on the GPU in {launches} launches), {fallbacks} sent through KVCR DRAM"
        );
        println!(
            "RESULT 0 {} {pages_one_hop} {}",
            restore.total, restore.first_layer
        );
        drop(linker);
        drop(buffers);
        return;
    }
    println!("READY");
    let mut go = String::new();
    let _ = std::io::stdin().read_line(&mut go);
    let query = PrefixQuery {
        namespace: NAMESPACE,
        device_prefix_pages: 0,
        tail: keys.clone(),
    };
    let t = Instant::now();
    let (context, _) = RequestContext::begin(
        &mut ledger,
        RequestId(format!("tp{rank}")),
        vec![hint],
        query,
    );
    linker.request_started(&context).unwrap();
    let attempt = context.attempt().clone();
    let _ = linker.settle(SETTLE);
    assert_eq!(
        linker.lookup(&attempt, 0, &keys).unwrap().longest(),
        pages,
        "rank {rank}"
    );
    let fetched = t.elapsed().as_secs_f64();
    progress(&format!("dest {rank} {mode}: fetched"), began);
    let slots: Vec<DeviceSlot> = (0..pages).map(DeviceSlot).collect();
    let ticket = linker.load(&attempt, &slots).unwrap();
    let events = linker.settle(SETTLE);
    assert!(events.iter().any(|e| matches!(
        e,
        LinkerEvent::LoadDone { ticket: t, success: true, .. } if *t == ticket
    )));
    let total = t.elapsed().as_secs_f64();
    linker.request_finished(&attempt).unwrap();
    check_shard(rank, pages, span, &buffers);
    println!("RESULT {fetched} {total} 0 0");
    drop(linker);
    drop(buffers);
}

/// Says on stderr (unbuffered, so a run cut off still shows how far each
/// process got) what a child has done, and when.
pub(crate) fn progress(what: &str, began: Instant) {
    eprintln!("# {what} at {:.1} s", began.elapsed().as_secs_f64());
}

/// Proves the route to the source at `endpoint`: a prepare, on a hint, of
/// a key the source does not hold (nothing lands; the handshake completes).
fn warm_route(linker: &mut DirectLinker, ledger: &mut AttemptLedger, endpoint: &str) {
    let absent = BlockKey::from_u64(0x0dea_d000);
    let hint = kvcr_foundation::FetchHint {
        source: endpoint.parse().unwrap(),
        block_hashes: vec![absent],
        mode: kvcr_foundation::hint::FetchMode::Copy,
        action_id: None,
    };
    let query = PrefixQuery {
        namespace: NAMESPACE,
        device_prefix_pages: 0,
        tail: vec![absent],
    };
    let (context, _) = RequestContext::begin(ledger, RequestId("warm".into()), vec![hint], query);
    linker.request_started(&context).unwrap();
    let _ = linker.settle(Duration::from_secs(5));
    linker.request_finished(context.attempt()).unwrap();
}

/// Asserts the patterned pages of `rank`'s shard landed on its GPU.
fn check_shard(rank: u32, pages: u32, span: usize, buffers: &[DeviceBuffer]) {
    for (i, b) in buffers.iter().enumerate() {
        for slot in tp2_checked(pages) {
            assert_eq!(
                b.read(slot as usize * span, span).unwrap(),
                pattern(i + 1000 * rank as usize, slot, span),
                "rank {rank} span {i} page {slot}: not its own shard's bytes"
            );
        }
    }
}

/// A child process of this benchmark, read line by line.
pub(crate) struct Child {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Child {
    pub(crate) fn spawn(args: &[String]) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .arg("--bench")
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// The next line starting with `word`, without it; the child's `#`
    /// lines before it are passed on (progress survives a cut-off run).
    pub(crate) fn expect(&mut self, word: &str) -> String {
        for line in self.lines.by_ref() {
            let line = line.unwrap();
            if let Some(rest) = line.strip_prefix(word) {
                return rest.trim().to_owned();
            }
            if line.starts_with('#') {
                println!("{line}");
            }
        }
        panic!("child exited before {word}");
    }

    pub(crate) fn say(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

/// What one round of [`tp2_peer_restore`] measured.
struct Round {
    /// Per rank, (seconds until fetched into KVCR DRAM, seconds in all).
    timings: Vec<(f64, f64)>,
    /// Seconds until every rank had its shard.
    wall: f64,
    /// Per rank, (pages that came in one hop, seconds to the first layer's
    /// report; 0 without one).
    one_hop: Vec<(u64, f64)>,
    /// CPU seconds the source processes spent in the round.
    source_cpu: f64,
}

/// Issue 11's run: engine A and engine B at TP=2 (or the seed's at TP=1,
/// `--seed`), each rank its own process on GPU `rank` (all on GPU 0 when
/// only one is lent). A's ranks offload;
/// each rank of B restores its own shard from A's same rank on a router hint
/// (A's KVCR DRAM → B's → B's GPU), both ranks at once, and checks the
/// patterned pages byte for byte. Two rounds, each with fresh destination
/// processes: the hops one after the other (which measures each hop), then
/// pipelined (`restore_hinted`), whose figure is against the slower hop of
/// the same rank measured in the first round.
pub(crate) fn tp2_peer_restore(gpus: &[(Arc<Device>, f64)], pages: u32, tp: u32) {
    let gpu = |rank: usize| &gpus[rank % gpus.len()];
    let name = format!("tp{tp}");
    for rank in 0..tp as usize {
        println!(
            "# {name}: {pages} pages per rank, {} runner processes per round; rank {rank} on GPU {} ({})",
            2 * tp,
            gpu(rank).0.ordinal(),
            gpu(rank).0.name(),
        );
    }
    let shard_bytes = (64 * 2 * 64 * u64::from(8 / tp) * 128 * 2 * u64::from(pages)) as f64;
    let mut sources: Vec<Child> = (0..tp)
        .map(|r| {
            let args = [r.to_string(), pages.to_string(), tp.to_string()];
            Child::spawn(&[["--tp2-source".to_owned()].as_slice(), &args].concat())
        })
        .collect();
    let endpoints: Vec<String> = sources.iter_mut().map(|s| s.expect("ENDPOINT")).collect();
    let mut round = |mode: &str| -> Round {
        let mut dests: Vec<Child> = endpoints
            .iter()
            .enumerate()
            .map(|(r, ep)| {
                Child::spawn(&[
                    "--tp2-dest".into(),
                    r.to_string(),
                    pages.to_string(),
                    ep.clone(),
                    mode.into(),
                    tp.to_string(),
                ])
            })
            .collect();
        for d in &mut dests {
            let _ = d.expect("READY");
        }
        let mut source_cpu = || -> f64 {
            sources
                .iter_mut()
                .map(|s| {
                    s.say("CPU");
                    s.expect("CPU").parse::<f64>().unwrap()
                })
                .sum()
        };
        let cpu_before = source_cpu();
        let wall = Instant::now();
        for d in &mut dests {
            d.say("GO");
        }
        let mut one_hop = Vec::new();
        let timings = dests
            .iter_mut()
            .map(|d| {
                let result = d.expect("RESULT");
                let mut it = result.split_whitespace().map(|v| v.parse::<f64>().unwrap());
                let timing = (it.next().unwrap(), it.next().unwrap());
                one_hop.push((it.next().unwrap() as u64, it.next().unwrap()));
                timing
            })
            .collect();
        let wall = wall.elapsed().as_secs_f64();
        let cpu = source_cpu() - cpu_before;
        // The destinations exit (reaped here), and each source closes its
        // imports of their GPU pools when it hears their sessions end: the
        // pools are freed only then, and the next round's destinations
        // need the room (two copies of the shard do not fit an 80 GB card
        // beside the source's own).
        drop(dests);
        let closing = Instant::now();
        for (rank, s) in sources.iter_mut().enumerate() {
            loop {
                s.say("IMPORTS");
                let open = s.expect("IMPORTS");
                if open == "0" {
                    break;
                }
                assert!(
                    closing.elapsed() < Duration::from_secs(60),
                    "{name}: source {rank} still holds {open} imports of a departed destination's GPU"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        println!(
            "# {name}: round {mode}: the sources closed every import {:.0} ms after the destinations exited",
            closing.elapsed().as_secs_f64() * 1e3
        );
        println!(
            "# {name}: round {mode} done: {wall:.3} s for every rank, per rank (fetched s, total s) {timings:?}, sources' CPU {cpu:.3} s"
        );
        Round {
            timings,
            wall,
            one_hop,
            source_cpu: cpu,
        }
    };
    let hops = round("seq").timings;
    let Round {
        timings: pipelined,
        wall: aggregate,
        one_hop: one_hop_ranks,
        source_cpu,
    } = round("pipe");
    let Round {
        timings: forced,
        wall: forced_aggregate,
        one_hop: forced_one_hop,
        ..
    } = round("pipe2");
    let one_hop_pages: Vec<u64> = one_hop_ranks.iter().map(|r| r.0).collect();
    let one_hop = one_hop_pages.iter().all(|p| *p == u64::from(pages));
    assert!(
        forced_one_hop.iter().all(|p| p.0 == 0),
        "{name}: the forced round took the one-hop route"
    );
    println!(
        "# {name}: pipelined round: {} ({one_hop_pages:?} pages in one hop per rank); the sources spent {source_cpu:.3} CPU s",
        if one_hop {
            "one hop"
        } else {
            "NOT one hop throughout"
        },
    );
    for rank in 0..tp as usize {
        let (fetched, total) = hops[rank];
        let peer_hop = shard_bytes / fetched / 1e9;
        let gpu_hop = shard_bytes / (total - fetched) / 1e9;
        let sequential = shard_bytes / total / 1e9;
        let h2d = gpu(rank).1;
        let restore = shard_bytes / pipelined[rank].1 / 1e9;
        let two_hop = shard_bytes / forced[rank].1 / 1e9;
        let slower = peer_hop.min(gpu_hop);
        println!(
            "# {name}: rank {rank}: hops in turn: peer DRAM->DRAM {:.0} ms ({peer_hop:.1} GB/s), DRAM->GPU {:.0} ms ({gpu_hop:.1} GB/s), {sequential:.2} GB/s end to end; pipelined {:.0} ms; its shard's bytes checked in both",
            fetched * 1e3,
            (total - fetched) * 1e3,
            pipelined[rank].1 * 1e3,
        );
        println!(
            "BENCH {name}.restore_rank{rank} value={restore:.2} unit=GB/s anchor={slower:.2} ratio={:.3}",
            restore / slower
        );
        println!(
            "BENCH {name}.restore_vs_h2d_rank{rank} value={restore:.2} unit=GB/s anchor={h2d:.2} ratio={:.3}",
            restore / h2d
        );
        println!(
            "BENCH {name}.two_hop_forced_rank{rank} value={two_hop:.2} unit=GB/s anchor={slower:.2} ratio={:.3}",
            two_hop / slower
        );
        println!(
            "BENCH {name}.peer_hop_rank{rank} value={peer_hop:.2} unit=GB/s anchor={h2d:.2} ratio={:.3}",
            peer_hop / h2d
        );
        println!(
            "BENCH {name}.gpu_hop_rank{rank} value={gpu_hop:.2} unit=GB/s anchor={h2d:.2} ratio={:.3}",
            gpu_hop / h2d
        );
    }
    // Aggregate (pipelined) against the sum of the distinct GPUs' anchors.
    let h2d: f64 = gpus.iter().map(|g| g.1).sum();
    let gbps = f64::from(tp) * shard_bytes / aggregate / 1e9;
    println!(
        "BENCH {name}.restore_aggregate value={gbps:.2} unit=GB/s anchor={h2d:.2} ratio={:.3}",
        gbps / h2d
    );
    let forced_gbps = f64::from(tp) * shard_bytes / forced_aggregate / 1e9;
    println!(
        "BENCH {name}.restore_aggregate_two_hop_forced value={forced_gbps:.2} unit=GB/s anchor={h2d:.2} ratio={:.3}",
        forced_gbps / h2d
    );
    let total_gb = f64::from(tp) * shard_bytes / 1e9;
    println!(
        "BENCH direct.peer_restore_source_cpu value={:.4} unit=s/GB",
        source_cpu / total_gb
    );
    if tp == 1 {
        // The first layer as the engine sees it (`FirstLayerLanded`, from
        // the `restore_hinted` call), against one layer's bytes (K and V
        // of every page) at this run's H2D rate.
        let first_ms = one_hop_ranks[0].1 * 1e3;
        let layer_ms = shard_bytes / 64.0 / h2d / 1e6;
        if first_ms > 0.0 {
            println!(
                "BENCH direct.peer_first_layer_ms value={first_ms:.2} unit=ms anchor={layer_ms:.2} ratio={:.3}",
                first_ms / layer_ms
            );
        } else {
            println!("# {name}: no first-layer report (the restore did not go in one hop)");
        }
        // The seed's headline workload (the seed: 1.24-1.27 s on B200s), in
        // one hop (pipelined `restore_hinted`) and in two (forced), each
        // against pinned H2D of the same bytes measured in this run.
        let anchor_s = shard_bytes / h2d / 1e9;
        for (figure, seconds) in [
            ("direct.peer_restore_32b", pipelined[0].1),
            ("direct.peer_restore_32b_two_hop", forced[0].1),
        ] {
            let gbps = shard_bytes / seconds / 1e9;
            println!(
                "BENCH {figure} value={gbps:.2} unit=GB/s anchor={h2d:.2} ratio={:.3}",
                gbps / h2d
            );
            println!(
                "BENCH {figure}_s value={seconds:.3} unit=s anchor={anchor_s:.3} ratio={:.3}",
                seconds / anchor_s
            );
        }
    }
    drop(sources);
}
