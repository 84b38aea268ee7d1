//! End-to-end scenario of mode A: two simulated SGLang engines (TP=2, ranks
//! as threads, Qwen3-0.6B geometry, 64-token pages, `page_first` host pools),
//! each rank with its own `KvcrHiCacheStorage` over its own rank-local runner,
//! real UCX (shared memory on loopback) and real TCP control channels between
//! the runners, and a minimal KV-aware router fed by the backends' inventory.
//!
//! 1. The source engine serves prompt Q, offloads it (write-through to its
//!    KVCR tier, published `BlockStored`, owner kvcr), then serves prompt P,
//!    whose offload evicts Q from its KVCR tier (`BlockRemoved`); its GPU tier
//!    keeps both.
//! 2. The destination engine serves P: its own tiers lack the prefix, the
//!    router hints the source, and the backend restores the prefix from the
//!    source's KVCR DRAM, each rank dialling its own shard.
//! 3. The destination serves Q: only the source's GPU tier holds it, which is
//!    not fetchable, so no hint, no transfer, zero reuse.
//!
//! The engines follow SGLang's prefix rules: only full pages are cached, and
//! a request always recomputes at least its last token (a 256-token prompt
//! reuses at most 192 tokens). Exits non-zero if any check fails.
//!
//! `cargo run -p kvcr-hicache-storage --example hicache_e2e --release`
//! (`-- --tls tcp,self` to use TCP instead of shared memory).

#![allow(clippy::disallowed_methods)] // a driver program reads the clock
#![allow(missing_docs)]
// A driver program: its indices come from its own loops; a failed setup step
// aborts it with a message, which is the scenario failing.
#![allow(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::collections::{HashMap, HashSet};
use std::net::TcpListener;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvcr_foundation::hint::{SourceCandidate, WorkerType, choose_source};
use kvcr_foundation::{
    BlockKey, CompatDigest, ControlEndpoint, InventoryEvent, InventorySink, Namespace, Owner,
    PageDigest, PageHashChain,
};
use kvcr_hicache_storage::{
    ExtraInfo, HostLayout, HostPoolDesc, KvGeometry, KvcrHiCacheStorage, LocalRankGroup,
    PageTokens, RankGroups, StorageConfig,
};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const TP: u32 = 2;
const PAGE_TOKENS: usize = 64;
const PROMPT_TOKENS: usize = 256;
const MODEL: &str = "Qwen/Qwen3-0.6B";

/// A free base port with `n` free ports after it.
fn free_base_port(n: u16) -> u16 {
    for _ in 0..100 {
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = probe.local_addr().unwrap().port();
        drop(probe);
        if base > u16::MAX - n {
            continue;
        }
        let held: Vec<_> = (0..n)
            .map_while(|i| TcpListener::bind(("127.0.0.1", base + i)).ok())
            .collect();
        if held.len() == usize::from(n) {
            return base;
        }
    }
    panic!("no {n} consecutive free ports on loopback");
}

/// The KV bytes rank `rank` computes for a page (what prefill would write):
/// a function of the page's position-aware digest, so equal prefixes give
/// equal bytes on every engine.
fn compute_kv(digest: &PageDigest, rank: u32, out: &mut [u8]) {
    let mut seed = [0u8; 8];
    seed.copy_from_slice(&digest.0[..8]);
    let mut x = (u64::from_le_bytes(seed) ^ (u64::from(rank) << 56)) | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// Inventory of one worker, sent to the router.
struct RouterSink {
    worker: u64,
    tx: Sender<(u64, InventoryEvent)>,
}

impl InventorySink for RouterSink {
    fn publish(&mut self, event: &InventoryEvent) {
        let _ = self.tx.send((self.worker, event.clone()));
    }
}

/// A minimal KV-aware router: indexes every worker's inventory per owner and
/// hints only from KVCR-owned pages (the only ones a peer can fetch).
struct Router {
    rx: Receiver<(u64, InventoryEvent)>,
    kvcr: HashMap<u64, HashSet<BlockKey>>,
    framework: HashMap<u64, HashSet<BlockKey>>,
    endpoints: HashMap<u64, ControlEndpoint>,
}

impl Router {
    fn drain(&mut self) {
        while let Ok((worker, event)) = self.rx.try_recv() {
            match event {
                InventoryEvent::Stored { scope, keys, .. } => {
                    let index = match scope.owner {
                        Owner::Kvcr => &mut self.kvcr,
                        Owner::Framework => &mut self.framework,
                    };
                    index.entry(worker).or_default().extend(keys);
                }
                InventoryEvent::Removed { scope, keys } => {
                    let index = match scope.owner {
                        Owner::Kvcr => &mut self.kvcr,
                        Owner::Framework => &mut self.framework,
                    };
                    if let Some(set) = index.get_mut(&worker) {
                        for k in keys {
                            set.remove(&k);
                        }
                    }
                }
                InventoryEvent::AllCleared { .. } => {}
            }
        }
    }

    fn leading(set: Option<&HashSet<BlockKey>>, hashes: &[BlockKey]) -> usize {
        set.map_or(0, |s| hashes.iter().take_while(|h| s.contains(h)).count())
    }

    /// The `kv.fetch@1.0` hint for a request routed to `target`, if any source
    /// holds more of its prefix in KVCR DRAM than the target has anywhere.
    fn hint_for(&mut self, target: u64, hashes: &[BlockKey]) -> Option<Value> {
        self.drain();
        let target_cached = Self::leading(self.kvcr.get(&target), hashes)
            .max(Self::leading(self.framework.get(&target), hashes));
        let candidates: Vec<SourceCandidate> = self
            .endpoints
            .iter()
            .map(|(worker, endpoint)| SourceCandidate {
                worker_id: *worker,
                worker_type: WorkerType::Aggregated,
                endpoint: Some(endpoint.clone()),
                prefix_blocks: Self::leading(self.kvcr.get(worker), hashes),
            })
            .collect();
        let source = choose_source(
            target,
            WorkerType::Aggregated,
            target_cached,
            hashes.len(),
            &candidates,
        )?;
        Some(json!({
            "protocol_version": "0.1",
            "message_id": format!("route-{target}"),
            "actions": [{
                "action_id": "fetch-0",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {
                    "source_control_endpoint": source.endpoint.as_ref()?.to_string(),
                    "block_hashes": hashes.iter().map(|h| h.as_u64()).collect::<Vec<_>>(),
                }
            }]
        }))
    }
}

struct Rank {
    storage: KvcrHiCacheStorage,
    host: Mutex<Vec<u8>>,
}

/// A simulated SGLang engine: a GPU radix tier (framework-owned), its own host
/// page pool (L2, the registered memory) and kvcr as L3 behind it.
struct Engine {
    name: &'static str,
    worker: u64,
    geometry: KvGeometry,
    ranks: Vec<Rank>,
    gpu: HashSet<BlockKey>,
    host_index: HashMap<BlockKey, u64>,
    next_host_page: u64,
    host_pages: u64,
    events: Sender<(u64, InventoryEvent)>,
    namespace: Namespace,
}

struct Outcome {
    restored_pages: usize,
    hinted: bool,
    digest_ok: Option<bool>,
}

impl Engine {
    #[allow(clippy::too_many_arguments)]
    fn start(
        name: &'static str,
        worker: u64,
        host_pages: u64,
        kvcr_pages: u64,
        tls: &str,
        events: Sender<(u64, InventoryEvent)>,
    ) -> Self {
        let geometry = KvGeometry::qwen3_0_6b(TP);
        let port = free_base_port(TP as u16);
        let extra = json!({
            "local_dram_bytes": kvcr_pages * geometry.page_bytes(),
            "operation_timeout_ms": 10_000,
            "get_timeout_s": 20,
            "enable_remote_hint": true,
            "control_host": "127.0.0.1",
            "control_port": port,
            "control_advertise_host": "127.0.0.1",
            "single_host": true,
            "ucx_tls": tls,
            "medium": "EXTERNAL",
        });
        let prefetch = LocalRankGroup::new(TP, Duration::from_secs(60));
        let backup = LocalRankGroup::new(TP, Duration::from_secs(60));
        let mut ranks = Vec::new();
        for (r, (p, b)) in prefetch.into_iter().zip(backup).enumerate() {
            let config = StorageConfig::single_rank(MODEL, extra.clone()).with_tp(r as u32, TP);
            let storage = KvcrHiCacheStorage::new(
                config,
                RankGroups {
                    prefetch: Arc::new(p),
                    backup: Arc::new(b),
                },
            )
            .unwrap_or_else(|e| panic!("{name} rank {r}: {e}"));
            let len = HostPoolDesc::required_len(&geometry, host_pages).unwrap();
            let mut host = vec![0u8; len as usize];
            let desc = HostPoolDesc {
                layout: HostLayout::PageFirst,
                base: host.as_mut_ptr() as u64,
                len,
                pages: host_pages,
                geometry,
            };
            // SAFETY: the host pool lives in the same `Rank` as the backend,
            // declared after it (dropped after it), never reallocated, and the
            // engine touches a page only between the calls that name it.
            unsafe { storage.register_host_pool(desc) }
                .unwrap_or_else(|e| panic!("{name} rank {r}: {e}"));
            if r == 0 {
                // Rank 0 publishes the group's (rank-agreed) inventory.
                storage.set_inventory_sink(Box::new(RouterSink {
                    worker,
                    tx: events.clone(),
                }));
            }
            ranks.push(Rank {
                storage,
                host: Mutex::new(host),
            });
        }
        Self {
            name,
            worker,
            geometry,
            ranks,
            gpu: HashSet::new(),
            host_index: HashMap::new(),
            next_host_page: 0,
            host_pages,
            events,
            namespace: Namespace::base(CompatDigest(0x5157_454e_3036)),
        }
    }

    /// The group's endpoint as the router resolves it (rank 0's).
    fn endpoint(&self) -> ControlEndpoint {
        self.ranks[0].storage.endpoint().expect("peer mode")
    }

    fn all<T: Send>(&self, f: impl Fn(u32, &Rank) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .enumerate()
                .map(|(r, rank)| {
                    let f = &f;
                    s.spawn(move || f(r as u32, rank))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn allocate_host_page(&mut self) -> u64 {
        let page = self.next_host_page % self.host_pages;
        self.next_host_page += 1;
        self.host_index.retain(|_, p| *p != page);
        page
    }

    fn page_span_bytes(&self, rank: &Rank, page: u64) -> Vec<u8> {
        let plan = rank.storage.span_plan().unwrap();
        let host = rank.host.lock().unwrap();
        plan.page_spans(page)
            .into_iter()
            .flat_map(|(off, len)| host[off as usize..(off + len) as usize].to_vec())
            .collect()
    }

    /// Serves one request under SGLang's prefix rules; returns what was reused.
    fn serve(&mut self, request: &str, tokens: &[u32], hint: Option<Value>) -> Outcome {
        let digests = PageHashChain::new(&self.namespace).pages(tokens, PAGE_TOKENS);
        let keys: Vec<BlockKey> = digests.iter().map(PageDigest::block_key).collect();
        // At least the last token is recomputed: the reusable prefix is the
        // full pages of the first len - 1 tokens.
        let usable = (tokens.len().saturating_sub(1) / PAGE_TOKENS).min(keys.len());
        let on_gpu = keys[..usable]
            .iter()
            .take_while(|k| self.gpu.contains(k))
            .count();
        let in_host = keys[on_gpu..usable]
            .iter()
            .take_while(|k| self.host_index.contains_key(k))
            .count();
        let local = on_gpu + in_host;
        let hinted = hint.is_some();
        let extra = ExtraInfo {
            request_id: Some(kvcr_foundation::RequestId(request.to_owned())),
            router_hint: hint,
            pages: None,
        };
        // L3: the leading pages every rank can serve, then restore them.
        let wanted = &keys[local..usable];
        let hits = self.all(|_, rank| rank.storage.batch_exists(wanted, &extra));
        let hit = hits.iter().copied().min().unwrap_or(0);
        let mut restored = 0;
        let mut digest_ok = None;
        if hit > 0 {
            let pages: Vec<u64> = (0..hit).map(|_| self.allocate_host_page()).collect();
            let got = self.all(|_, rank| rank.storage.batch_get(&wanted[..hit], &pages, &extra));
            restored = got[0].iter().take_while(|b| **b).count();
            // Every restored byte equals what the source computed.
            let mut ok = true;
            let mut expected = vec![0u8; (self.geometry.page_bytes()) as usize];
            for (r, rank) in self.ranks.iter().enumerate() {
                for (i, page) in pages.iter().enumerate().take(restored) {
                    compute_kv(&digests[local + i], r as u32, &mut expected);
                    let got = Sha256::digest(self.page_span_bytes(rank, *page));
                    ok &= got == Sha256::digest(&expected);
                }
            }
            digest_ok = Some(ok);
            for (i, page) in pages.iter().enumerate().take(restored) {
                self.host_index.insert(wanted[i], *page);
            }
        }
        self.all(|_, rank| {
            rank.storage
                .discard_request(&kvcr_foundation::RequestId(request.to_owned()))
        });
        // Prefill computes every page not reused; full pages are cached (GPU)
        // and backed up through the host pool to kvcr (write-through).
        let computed_from = local + restored;
        let mut new_keys = Vec::new();
        let mut new_pages = Vec::new();
        for i in computed_from..keys.len() {
            if self.host_index.contains_key(&keys[i]) {
                continue;
            }
            let page = self.allocate_host_page();
            let plan = self.ranks[0].storage.span_plan().unwrap().clone();
            for (r, rank) in self.ranks.iter().enumerate() {
                let mut bytes = vec![0u8; self.geometry.page_bytes() as usize];
                compute_kv(&digests[i], r as u32, &mut bytes);
                let mut host = rank.host.lock().unwrap();
                let mut at = 0;
                for (off, len) in plan.page_spans(page) {
                    host[off as usize..(off + len) as usize]
                        .copy_from_slice(&bytes[at..at + len as usize]);
                    at += len as usize;
                }
            }
            self.host_index.insert(keys[i], page);
            new_keys.push(keys[i]);
            new_pages.push(page);
        }
        if !new_keys.is_empty() {
            let first = keys.iter().position(|k| *k == new_keys[0]).unwrap_or(0);
            let backup = ExtraInfo {
                pages: Some(PageTokens {
                    parent: first.checked_sub(1).map(|p| keys[p]),
                    token_ids: tokens[first * PAGE_TOKENS..(first + new_keys.len()) * PAGE_TOKENS]
                        .to_vec(),
                }),
                ..ExtraInfo::default()
            };
            let stored = self.all(|_, rank| rank.storage.batch_set(&new_keys, &new_pages, &backup));
            assert!(
                stored.iter().all(|s| s.iter().all(|b| *b)),
                "{}: write-through failed: {stored:?}",
                self.name
            );
        }
        // The GPU tier keeps every full page (framework-owned inventory).
        let gpu_new: Vec<BlockKey> = keys
            .iter()
            .copied()
            .filter(|k| self.gpu.insert(*k))
            .collect();
        if !gpu_new.is_empty() {
            let _ = self.events.send((
                self.worker,
                InventoryEvent::Stored {
                    scope: kvcr_foundation::InventoryScope {
                        owner: Owner::Framework,
                        namespace: self.namespace.id(),
                        medium: kvcr_foundation::Medium::Gpu,
                    },
                    keys: gpu_new,
                    parent: None,
                    token_ids: Vec::new(),
                    block_size: PAGE_TOKENS as u32,
                    lora_name: None,
                },
            ));
        }
        Outcome {
            restored_pages: restored,
            hinted,
            digest_ok,
        }
    }

    /// (blocks received, spans received) per TP shard, and bytes sent by all
    /// shards.
    fn transfer_counters(&self) -> (Vec<(u64, u64)>, u64) {
        let spans = self.ranks[0].storage.span_plan().unwrap().spans_per_page() as u64;
        let per_shard = self
            .ranks
            .iter()
            .map(|r| {
                let c = r.storage.peer_counters().unwrap();
                (c.keys_received, c.keys_received * spans)
            })
            .collect();
        let sent = self
            .ranks
            .iter()
            .map(|r| r.storage.peer_counters().unwrap().bytes_sent)
            .sum();
        (per_shard, sent)
    }

    fn sync_inventory(&self) {
        self.all(|_, rank| rank.storage.sync_inventory());
    }
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS as u32)
        .map(|i| seed.wrapping_mul(100_003).wrapping_add(i * 7919) % 151_643)
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tls = args
        .iter()
        .position(|a| a == "--tls")
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| "posix,cma,self".to_owned());
    let started = Instant::now();
    let (tx, rx) = channel();
    let mut failures: Vec<String> = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            failures.push(what);
        }
    };

    // The source's KVCR tier holds exactly one prompt (4 pages per rank).
    let mut source = Engine::start("source", 1, 16, 4, &tls, tx.clone());
    let mut dest = Engine::start("destination", 2, 16, 16, &tls, tx.clone());
    let mut router = Router {
        rx,
        kvcr: HashMap::new(),
        framework: HashMap::new(),
        endpoints: HashMap::new(),
    };
    router.endpoints.insert(source.worker, source.endpoint());
    router.endpoints.insert(dest.worker, dest.endpoint());
    let geometry = source.geometry;
    println!(
        "hicache e2e: {MODEL}, TP={TP}, {PAGE_TOKENS}-token pages of {} bytes per shard ({} per page), page_first host pools, UCX_TLS={tls}",
        geometry.page_bytes(),
        geometry.page_bytes() * u64::from(TP),
    );
    println!(
        "source {} (ranks at {} and +1), destination {}",
        source.endpoint(),
        source.endpoint(),
        dest.endpoint()
    );

    let p = prompt(1);
    let q = prompt(2);
    let hashes = |tokens: &[u32]| -> Vec<BlockKey> {
        PageHashChain::new(&source.namespace)
            .pages(tokens, PAGE_TOKENS)
            .iter()
            .map(PageDigest::block_key)
            .collect()
    };
    let (p_keys, q_keys) = (hashes(&p), hashes(&q));

    // 1. The source serves Q, then P; P's offload evicts Q from its KVCR tier.
    let served_q = source.serve("src-q", &q, None);
    let served_p = source.serve("src-p", &p, None);
    source.sync_inventory();
    check(
        served_q.restored_pages == 0 && served_p.restored_pages == 0,
        "the source had nothing to reuse".into(),
    );
    router.drain();
    let src_kvcr = router.kvcr.get(&source.worker).cloned().unwrap_or_default();
    let src_gpu = router
        .framework
        .get(&source.worker)
        .cloned()
        .unwrap_or_default();
    check(
        p_keys.iter().all(|k| src_kvcr.contains(k)),
        "router: P is in the source's KVCR inventory".into(),
    );
    check(
        q_keys.iter().all(|k| !src_kvcr.contains(k)),
        "router: Q was removed from the source's KVCR inventory".into(),
    );
    check(
        q_keys.iter().chain(&p_keys).all(|k| src_gpu.contains(k)),
        "router: the source's GPU tier keeps P and Q".into(),
    );
    let source_stats = source.ranks[0].storage.stats();
    println!(
        "source: offloaded 8 pages (published {}, removed {} on eviction); KVCR tier now holds P only",
        source_stats.pages_published, source_stats.pages_removed
    );
    check(
        source_stats.pages_published == 8 && source_stats.pages_removed == 4,
        format!(
            "source published 8 stored / 4 removed pages (got {} / {})",
            source_stats.pages_published, source_stats.pages_removed
        ),
    );

    println!();
    println!(
        "{:<8} {:<6} {:>15} {:<6} {:>22} {:>22} {:>18} {:<10}",
        "request",
        "prompt",
        "restored/prompt",
        "hint",
        "shard0 blocks/spans",
        "shard1 blocks/spans",
        "source-send bytes",
        "digest"
    );
    let mut rows = Vec::new();
    for (name, tokens, keys, expect_pages) in [("P", &p, &p_keys, 3usize), ("Q", &q, &q_keys, 0)] {
        let (before_shards, before_sent) = dest.transfer_counters();
        let (_, before_source_sent) = source.transfer_counters();
        let _ = before_sent;
        let hint = router.hint_for(dest.worker, keys);
        let t = Instant::now();
        let outcome = dest.serve(&format!("dst-{name}"), tokens, hint);
        let secs = t.elapsed().as_secs_f64();
        let (after_shards, _) = dest.transfer_counters();
        let (_, after_source_sent) = source.transfer_counters();
        let shards: Vec<(u64, u64)> = after_shards
            .iter()
            .zip(&before_shards)
            .map(|(a, b)| (a.0 - b.0, a.1 - b.1))
            .collect();
        let sent = after_source_sent - before_source_sent;
        let restored_tokens = outcome.restored_pages * PAGE_TOKENS;
        let digest = match outcome.digest_ok {
            Some(true) => "match",
            Some(false) => "MISMATCH",
            None => "n/a",
        };
        println!(
            "{:<8} {:<6} {:>15} {:<6} {:>22} {:>22} {:>18} {:<10} ({secs:.3} s)",
            name,
            tokens.len(),
            format!("{restored_tokens}/{}", tokens.len()),
            if outcome.hinted { "yes" } else { "none" },
            format!("{}/{}", shards[0].0, shards[0].1),
            format!("{}/{}", shards[1].0, shards[1].1),
            sent,
            digest,
        );
        let spans = dest.ranks[0].storage.span_plan().unwrap().spans_per_page() as u64;
        let expect = expect_pages as u64;
        check(
            outcome.restored_pages == expect_pages,
            format!(
                "{name}: restored {} pages, expected {expect_pages}",
                outcome.restored_pages
            ),
        );
        check(
            outcome.hinted == (expect_pages > 0),
            format!("{name}: hint produced = {}", outcome.hinted),
        );
        check(
            shards.iter().all(|s| *s == (expect, expect * spans)),
            format!(
                "{name}: per-shard blocks/spans {shards:?}, expected {expect}/{}",
                expect * spans
            ),
        );
        check(
            sent == expect * geometry.page_bytes() * u64::from(TP),
            format!("{name}: source sent {sent} bytes"),
        );
        check(
            outcome.digest_ok != Some(false),
            format!("{name}: restored bytes differ from the source's"),
        );
        rows.push((name, outcome));
    }
    let dest_stats: Vec<_> = dest.ranks.iter().map(|r| r.storage.stats()).collect();
    println!();
    for (r, s) in dest_stats.iter().enumerate() {
        println!(
            "destination rank {r}: hinted pages requested {} loaded {}, faults {}/{}/{}",
            s.hinted_pages_requested,
            s.hinted_pages_loaded,
            s.faults_batch_exists,
            s.faults_batch_get,
            s.faults_batch_set
        );
        check(
            s.hinted_pages_requested == 3 && s.hinted_pages_loaded == 3,
            format!(
                "destination rank {r}: hinted pages {}/{}",
                s.hinted_pages_loaded, s.hinted_pages_requested
            ),
        );
        check(
            s.faults_batch_exists + s.faults_batch_get + s.faults_batch_set + s.faults_collective
                == 0,
            format!("destination rank {r}: faults {s:?}"),
        );
    }
    for engine in [&source, &dest] {
        for (r, rank) in engine.ranks.iter().enumerate() {
            if let Err(e) = rank.storage.check_invariants() {
                check(false, format!("{} rank {r}: {e}", engine.name));
            }
        }
    }
    drop(rows);
    println!("done in {:.2} s", started.elapsed().as_secs_f64());
    if failures.is_empty() {
        println!("hicache e2e: all checks passed");
    } else {
        for f in &failures {
            eprintln!("CHECK FAILED: {f}");
        }
        std::process::exit(1);
    }
}
