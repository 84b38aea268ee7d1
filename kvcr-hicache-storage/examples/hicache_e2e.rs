//! End-to-end scenario of mode A, as separate processes on loopback.
//!
//! Two simulated SGLang engines run as child processes of this program (TP=2,
//! ranks as threads, Qwen3-0.6B geometry, 64-token pages, `page_first` host
//! pools). Each rank has its own `KvcrHiCacheStorage` over its own rank-local
//! runner; runners talk over real UCX (shared memory by default) and real TCP
//! control channels. Each engine publishes its inventory on the vLLM/Dynamo
//! KV-event wire (ZMQ PUB, with a replay socket): the backend's rank-agreed
//! KVCR pages (`ownership: "kvcr"`, medium `EXTERNAL`) and the engine's own GPU
//! tier (framework-owned). This program is the router: it subscribes to both
//! streams (catching up through replay when it misses a batch), indexes them
//! per owner, and hints only from KVCR-owned pages, the only ones a peer can
//! fetch.
//!
//! 1. The source engine serves prompts Q, P and R and offloads them
//!    (write-through); R's offload evicts Q from its KVCR tier
//!    (`BlockRemoved`), while its GPU tier keeps all three.
//! 2. The destination engine serves P: its own tiers lack the prefix, the
//!    router hints the source, and the backend restores the prefix from the
//!    source's KVCR DRAM, each rank dialling its own shard.
//! 3. The destination serves Q: only the source's GPU tier holds it, which is
//!    not fetchable: no hint, no transfer, zero reuse.
//! 4. The source process is killed; the router, not told, still hints R from
//!    it: the restore is a miss (at the operation deadline), not an error or a
//!    hang, and the destination's tier keeps serving.
//!
//! The engines follow SGLang's prefix rules: only full pages are cached, and
//! a request always recomputes at least its last token (a 256-token prompt
//! reuses at most 192 tokens). Every restored byte is checked against what the
//! source computed. Exits non-zero if any check fails.
//!
//! `cargo run -p kvcr-hicache-storage --example hicache_e2e --release`
//! (`-- --tls tcp,self` moves the pages over TCP instead of shared memory).

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
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvcr_foundation::hint::{SourceCandidate, WorkerType, choose_source};
use kvcr_foundation::publisher::{
    PubSocket, Publisher, PublisherConfig, PublisherSink, TopicParts,
};
use kvcr_foundation::{
    BindAddress, BlockKey, CompatDigest, ControlEndpoint, Incarnation, InventoryEvent,
    InventoryScope, InventorySink, Medium, Namespace, Owner, PageDigest, PageHashChain, RequestId,
};
use kvcr_hicache_storage::{
    ExtraInfo, HostLayout, HostPoolDesc, KvGeometry, KvcrHiCacheStorage, LocalRankGroup,
    PageTokens, RankGroups, StorageConfig,
};
use kvcr_publisher::decode::{EventKind, decode_batch};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const TP: u32 = 2;
const PAGE_TOKENS: usize = 64;
const PROMPT_TOKENS: usize = 256;
const MODEL: &str = "Qwen/Qwen3-0.6B";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let tls = arg("--tls").unwrap_or_else(|| "posix,cma,self".to_owned());
    if arg("--role").as_deref() == Some("engine") {
        engine_process(
            arg("--worker").and_then(|v| v.parse().ok()).unwrap_or(1),
            arg("--host-pages")
                .and_then(|v| v.parse().ok())
                .unwrap_or(16),
            arg("--kvcr-pages")
                .and_then(|v| v.parse().ok())
                .unwrap_or(16),
            &tls,
        );
    } else {
        std::process::exit(orchestrate(&tls));
    }
}

// ---------------------------------------------------------------------------
// The engine process.

/// The KV bytes rank `rank` computes for a page (what prefill would write): a
/// function of the page's position-aware digest, so equal prefixes give equal
/// bytes on every engine.
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

/// A free base port with `n` free ports after it (rank r binds base + r).
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

/// The publisher's sink, counting what it queued (for the per-command barrier).
#[derive(Clone)]
struct CountingSink {
    sink: PublisherSink,
    queued: Arc<AtomicU64>,
}

impl InventorySink for CountingSink {
    fn publish(&mut self, event: &InventoryEvent) {
        if self.sink.try_publish(event.clone()) {
            self.queued.fetch_add(1, Ordering::AcqRel);
        }
    }
}

struct Rank {
    storage: KvcrHiCacheStorage,
    host: Mutex<Vec<u8>>,
}

/// A simulated SGLang engine: a GPU radix tier (framework-owned), its own host
/// page pool (L2, the registered memory) and kvcr as L3 behind it.
struct Engine {
    geometry: KvGeometry,
    ranks: Vec<Rank>,
    gpu: HashSet<BlockKey>,
    host_index: HashMap<BlockKey, u64>,
    next_host_page: u64,
    host_pages: u64,
    events: CountingSink,
    namespace: Namespace,
}

impl Engine {
    fn start(host_pages: u64, kvcr_pages: u64, tls: &str, events: CountingSink) -> Self {
        let geometry = KvGeometry::qwen3_0_6b(TP);
        let port = free_base_port(TP as u16);
        let extra = json!({
            "local_dram_bytes": kvcr_pages * geometry.page_bytes(),
            "operation_timeout_ms": 3_000,
            "get_timeout_s": 6,
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
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
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
            // declared after it (so dropped after it), is never reallocated,
            // and the engine touches a page only between the calls naming it.
            unsafe { storage.register_host_pool(desc) }.unwrap_or_else(|e| panic!("rank {r}: {e}"));
            if r == 0 {
                // Rank 0 publishes the group's (rank-agreed) inventory.
                storage.set_inventory_sink(Box::new(events.clone()));
            }
            ranks.push(Rank {
                storage,
                host: Mutex::new(host),
            });
        }
        Self {
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

    fn all<T: Send>(&self, f: impl Fn(&Rank) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .map(|rank| {
                    let f = &f;
                    s.spawn(move || f(rank))
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

    fn page_digest(&self, rank: &Rank, page: u64) -> Vec<u8> {
        let plan = rank.storage.span_plan().unwrap();
        let host = rank.host.lock().unwrap();
        let mut h = Sha256::new();
        for (off, len) in plan.page_spans(page) {
            h.update(&host[off as usize..(off + len) as usize]);
        }
        h.finalize().to_vec()
    }

    /// Serves one request under SGLang's prefix rules.
    fn serve(&mut self, request: &str, tokens: &[u32], hint: Option<Value>) -> Value {
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
        let request_id = RequestId(request.to_owned());
        let extra = ExtraInfo {
            request_id: Some(request_id.clone()),
            router_hint: hint,
            pages: None,
        };
        // L3: the leading pages every rank can serve, then restore them.
        let wanted = &keys[local..usable];
        let hit = self
            .all(|rank| rank.storage.batch_exists(wanted, &extra))
            .into_iter()
            .min()
            .unwrap_or(0);
        let mut restored = 0;
        let mut digest_ok = Value::Null;
        if hit > 0 {
            let pages: Vec<u64> = (0..hit).map(|_| self.allocate_host_page()).collect();
            let got = self.all(|rank| rank.storage.batch_get(&wanted[..hit], &pages, &extra));
            restored = got[0].iter().take_while(|b| **b).count();
            // Every restored byte equals what the source computed.
            let mut ok = true;
            let mut expected = vec![0u8; self.geometry.page_bytes() as usize];
            for (r, rank) in self.ranks.iter().enumerate() {
                for (i, page) in pages.iter().enumerate().take(restored) {
                    compute_kv(&digests[local + i], r as u32, &mut expected);
                    ok &= self.page_digest(rank, *page) == Sha256::digest(&expected).to_vec();
                }
            }
            digest_ok = json!(ok);
            for (i, page) in pages.iter().enumerate().take(restored) {
                self.host_index.insert(wanted[i], *page);
            }
        }
        self.all(|rank| rank.storage.discard_request(&request_id));
        // Prefill computes every page not reused; full pages stay in the GPU
        // tier and are backed up through the host pool to kvcr.
        let plan = self.ranks[0].storage.span_plan().unwrap().clone();
        let mut new_keys = Vec::new();
        let mut new_pages = Vec::new();
        for i in local + restored..keys.len() {
            if self.host_index.contains_key(&keys[i]) {
                continue;
            }
            let page = self.allocate_host_page();
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
        let mut backed_up = true;
        let mut backed_up_pages = 0;
        if let Some(first) = new_keys
            .first()
            .and_then(|k| keys.iter().position(|x| x == k))
        {
            let backup = ExtraInfo {
                pages: Some(PageTokens {
                    parent: first.checked_sub(1).map(|p| keys[p]),
                    token_ids: tokens[first * PAGE_TOKENS..(first + new_keys.len()) * PAGE_TOKENS]
                        .to_vec(),
                    ..PageTokens::default()
                }),
                ..ExtraInfo::default()
            };
            let stored = self.all(|rank| rank.storage.batch_set(&new_keys, &new_pages, &backup));
            backed_up = stored.iter().all(|s| s.iter().all(|b| *b));
            backed_up_pages = stored[0].iter().filter(|b| **b).count();
        }
        // The GPU tier keeps every full page (framework-owned inventory).
        let start = keys.iter().position(|k| !self.gpu.contains(k));
        if let Some(start) = start {
            let gpu_new = keys[start..].to_vec();
            self.gpu.extend(gpu_new.iter().copied());
            self.events.publish(&InventoryEvent::Stored {
                scope: InventoryScope {
                    owner: Owner::Framework,
                    namespace: self.namespace.id(),
                    medium: Medium::Gpu,
                },
                parent: start.checked_sub(1).map(|p| keys[p]),
                token_ids: tokens[start * PAGE_TOKENS..keys.len() * PAGE_TOKENS].to_vec(),
                keys: gpu_new,
                block_size: PAGE_TOKENS as u32,
                lora_name: None,
                lora_id: None,
                cache_salt: None,
            });
        }
        json!({
            "restored_pages": restored,
            "hinted": hinted,
            "digest_ok": digest_ok,
            "backed_up": backed_up,
            "backed_up_pages": backed_up_pages,
            "keys": keys.iter().map(|k| k.as_u64()).collect::<Vec<_>>(),
        })
    }

    fn report(&self) -> Value {
        let spans = self.ranks[0].storage.span_plan().unwrap().spans_per_page() as u64;
        let ranks: Vec<Value> = self
            .ranks
            .iter()
            .map(|rank| {
                let s = rank.storage.stats();
                let peer = rank.storage.peer_counters().unwrap_or_default();
                json!({
                    "blocks_received": peer.keys_received,
                    "spans_received": peer.keys_received * spans,
                    "bytes_sent": peer.bytes_sent,
                    "hinted_pages_requested": s.hinted_pages_requested,
                    "hinted_pages_loaded": s.hinted_pages_loaded,
                    "pages_published": s.pages_published,
                    "pages_removed": s.pages_removed,
                    "faults": s.faults_batch_exists + s.faults_batch_get + s.faults_batch_set + s.faults_collective,
                    "invariants": rank.storage.check_invariants().err(),
                })
            })
            .collect();
        json!({ "ranks": ranks })
    }
}

fn answer(word: &str, value: &Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{word} {value}");
    let _ = out.flush();
}

fn engine_process(worker: u64, host_pages: u64, kvcr_pages: u64, tls: &str) {
    let loopback = || BindAddress::parse("tcp://127.0.0.1:0").unwrap();
    let publisher = Publisher::start(
        PublisherConfig::new(
            TopicParts {
                worker_id: worker,
                dp_rank: 0,
            },
            Incarnation::generate(),
            PubSocket::Bind(loopback()),
        )
        .with_replay(loopback()),
    )
    .unwrap_or_else(|e| panic!("publisher: {e}"));
    let sink = CountingSink {
        sink: publisher.sink(),
        queued: Arc::new(AtomicU64::new(0)),
    };
    let mut engine = Engine::start(host_pages, kvcr_pages, tls, sink.clone());
    let bound = publisher.bound().clone();
    answer(
        "READY",
        &json!({
            "endpoint": engine.ranks[0].storage.endpoint().map(|e| e.to_string()),
            "events": bound.pub_bound.map(|b| b.to_string()),
            "replay": bound.replay_bound.map(|b| b.to_string()),
        }),
    );
    // Waits until the publisher has sequenced everything queued so far and
    // returns the number of batches (the router catches up to it).
    let barrier = || -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stats = publisher.stats();
            if stats.core.events_in >= sink.queued.load(Ordering::Acquire)
                || Instant::now() > deadline
            {
                return stats.core.batches;
            }
            std::thread::yield_now();
        }
    };
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let Ok(cmd) = serde_json::from_str::<Value>(&line) else {
            answer("ERROR", &json!({"error": "not JSON"}));
            continue;
        };
        match cmd["cmd"].as_str() {
            Some("serve") => {
                let tokens: Vec<u32> = cmd["tokens"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|t| t.as_u64())
                            .map(|t| t as u32)
                            .collect()
                    })
                    .unwrap_or_default();
                let hint = Some(cmd["hint"].clone()).filter(|h| !h.is_null());
                let mut out = engine.serve(cmd["request"].as_str().unwrap_or("r"), &tokens, hint);
                out["batches"] = json!(barrier());
                answer("SERVED", &out);
            }
            Some("sync") => {
                engine.all(|rank| rank.storage.sync_inventory());
                answer("SYNCED", &json!({"batches": barrier()}));
            }
            Some("report") => answer("REPORT", &engine.report()),
            Some("exit") | None => break,
            Some(other) => answer(
                "ERROR",
                &json!({"error": format!("unknown command {other}")}),
            ),
        }
    }
    drop(engine);
    drop(publisher);
}

// ---------------------------------------------------------------------------
// The orchestrator and its router.

struct Proc {
    name: &'static str,
    worker: u64,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    endpoint: ControlEndpoint,
    replay: String,
}

impl Proc {
    fn spawn(
        name: &'static str,
        worker: u64,
        kvcr_pages: u64,
        tls: &str,
        sub: &zmq::Socket,
    ) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args(["--role", "engine", "--worker", &worker.to_string()])
            .args([
                "--host-pages",
                "16",
                "--kvcr-pages",
                &kvcr_pages.to_string(),
                "--tls",
                tls,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut proc = Self {
            name,
            worker,
            child,
            stdin,
            stdout,
            endpoint: ControlEndpoint::parse("tcp://127.0.0.1:1").unwrap(),
            replay: String::new(),
        };
        let ready = proc.read("READY");
        proc.endpoint = ControlEndpoint::parse(ready["endpoint"].as_str().unwrap()).unwrap();
        proc.replay = ready["replay"].as_str().unwrap().to_owned();
        sub.connect(ready["events"].as_str().unwrap()).unwrap();
        proc
    }

    fn call(&mut self, cmd: Value, word: &str) -> Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.read(word)
    }

    fn read(&mut self, word: &str) -> Value {
        let mut line = String::new();
        if self.stdout.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("{} exited before answering {word}", self.name);
        }
        let (got, body) = line
            .trim_end()
            .split_once(' ')
            .unwrap_or((line.trim_end(), "{}"));
        assert_eq!(got, word, "{}: {line}", self.name);
        serde_json::from_str(body).unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "exit"}));
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// A minimal KV-aware router over the KV-event wire: per worker, the next
/// sequence number it expects and an index per owner.
struct Router {
    ctx: zmq::Context,
    sub: zmq::Socket,
    next_seq: HashMap<u64, u64>,
    kvcr: HashMap<u64, HashSet<BlockKey>>,
    framework: HashMap<u64, HashSet<BlockKey>>,
    endpoints: HashMap<u64, ControlEndpoint>,
    replayed: u64,
}

fn worker_of(topic: &[u8]) -> Option<u64> {
    let topic = std::str::from_utf8(topic).ok()?;
    topic
        .strip_prefix("kvcr.w")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

impl Router {
    fn new() -> Self {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(200).unwrap();
        Self {
            ctx,
            sub,
            next_seq: HashMap::new(),
            kvcr: HashMap::new(),
            framework: HashMap::new(),
            endpoints: HashMap::new(),
            replayed: 0,
        }
    }

    /// Applies batch `seq` of `worker` if it is the next one.
    fn apply(&mut self, worker: u64, seq: u64, payload: &[u8]) {
        let next = self.next_seq.entry(worker).or_insert(0);
        if seq != *next {
            return;
        }
        *next += 1;
        let Ok(events) = decode_batch(payload) else {
            return;
        };
        for event in events {
            let index = if event.kvcr_owned {
                &mut self.kvcr
            } else {
                &mut self.framework
            };
            let set = index.entry(worker).or_default();
            let hashes = event.block_hashes.into_iter().map(BlockKey::from_u64);
            match event.kind {
                EventKind::Stored => set.extend(hashes),
                EventKind::Removed => hashes.for_each(|h| {
                    set.remove(&h);
                }),
                EventKind::AllCleared => set.clear(),
                EventKind::Unknown(_) => {}
            }
        }
    }

    /// Receives (and replays what it missed) until every batch of `worker`
    /// below `batches` is applied.
    fn catch_up(&mut self, worker: u64, replay: &str, batches: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.next_seq.get(&worker).copied().unwrap_or(0) < batches {
            assert!(
                Instant::now() < deadline,
                "router: worker {worker} stream stalled"
            );
            match self.sub.recv_multipart(0) {
                Ok(frames) if frames.len() == 3 && frames[1].len() == 8 => {
                    let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
                    if let Some(w) = worker_of(&frames[0]) {
                        let expected = self.next_seq.get(&w).copied().unwrap_or(0);
                        if seq > expected {
                            // A gap (or joining late): replay from the first
                            // missing batch, then take this one.
                            let replay_of = if w == worker {
                                replay.to_owned()
                            } else {
                                continue;
                            };
                            self.replay(w, &replay_of);
                        }
                        self.apply(w, seq, &frames[2]);
                    }
                }
                Ok(_) => {}
                Err(_) => self.replay(worker, replay),
            }
        }
    }

    fn replay(&mut self, worker: u64, endpoint: &str) {
        self.replayed += 1;
        let start = self.next_seq.get(&worker).copied().unwrap_or(0);
        let dealer = self.ctx.socket(zmq::DEALER).unwrap();
        dealer.set_rcvtimeo(5_000).unwrap();
        dealer.set_linger(0).unwrap();
        dealer.connect(endpoint).unwrap();
        dealer
            .send_multipart([&b""[..], &start.to_be_bytes()], 0)
            .unwrap();
        while let Ok(f) = dealer.recv_multipart(0) {
            if f.len() != 4 || f[2] == [0xff; 8] {
                break;
            }
            let seq = u64::from_be_bytes(f[2].as_slice().try_into().unwrap());
            self.apply(worker, seq, &f[3]);
        }
    }

    fn leading(set: Option<&HashSet<BlockKey>>, hashes: &[BlockKey]) -> usize {
        set.map_or(0, |s| hashes.iter().take_while(|h| s.contains(h)).count())
    }

    /// The `kv.fetch@1.0` hint for a request routed to `target`, if a source
    /// holds more of its prefix in KVCR DRAM than the target holds anywhere.
    fn hint_for(&self, target: u64, hashes: &[BlockKey]) -> Option<Value> {
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

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS as u32)
        .map(|i| seed.wrapping_mul(100_003).wrapping_add(i * 7919) % 151_643)
        .collect()
}

fn orchestrate(tls: &str) -> i32 {
    let started = Instant::now();
    let mut failures: Vec<String> = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            failures.push(what);
        }
    };
    let mut router = Router::new();
    // The source's KVCR tier holds two prompts (8 pages per rank).
    let mut source = Proc::spawn("source", 1, 8, tls, &router.sub);
    let mut dest = Proc::spawn("destination", 2, 16, tls, &router.sub);
    router
        .endpoints
        .insert(source.worker, source.endpoint.clone());
    router.endpoints.insert(dest.worker, dest.endpoint.clone());
    let geometry = KvGeometry::qwen3_0_6b(TP);
    println!(
        "hicache e2e: {MODEL}, TP={TP}, {PAGE_TOKENS}-token pages ({} bytes per shard, {} per page), page_first host pools, UCX_TLS={tls}",
        geometry.page_bytes(),
        geometry.page_bytes() * u64::from(TP),
    );
    println!(
        "processes: source (pid {}, ranks at {} and +1), destination (pid {}, {}); router on both KV-event streams",
        source.child.id(),
        source.endpoint,
        dest.child.id(),
        dest.endpoint
    );
    let (p, q, r) = (prompt(1), prompt(2), prompt(3));

    // 1. The source serves Q, P and R; R's offload evicts Q (the least
    //    recently used) from its KVCR tier.
    let mut keys_of = HashMap::new();
    for (name, tokens) in [("Q", &q), ("P", &p), ("R", &r)] {
        let served = source.call(
            json!({"cmd": "serve", "request": format!("src-{name}"), "tokens": tokens}),
            "SERVED",
        );
        check(
            served["restored_pages"] == 0 && served["backed_up"] == true,
            format!("source {name}: {served}"),
        );
        let keys: Vec<BlockKey> = served["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| BlockKey::from_u64(k.as_u64().unwrap()))
            .collect();
        keys_of.insert(name, keys);
    }
    let synced = source.call(json!({"cmd": "sync"}), "SYNCED");
    let replay = source.replay.clone();
    router.catch_up(source.worker, &replay, synced["batches"].as_u64().unwrap());
    let (p_keys, q_keys, r_keys) = (
        keys_of["P"].clone(),
        keys_of["Q"].clone(),
        keys_of["R"].clone(),
    );
    let src_kvcr = router.kvcr.get(&source.worker).cloned().unwrap_or_default();
    let src_gpu = router
        .framework
        .get(&source.worker)
        .cloned()
        .unwrap_or_default();
    check(
        p_keys.iter().chain(&r_keys).all(|k| src_kvcr.contains(k)),
        "router: P and R are in the source's KVCR inventory".into(),
    );
    check(
        q_keys.iter().all(|k| !src_kvcr.contains(k)),
        "router: Q left the source's KVCR inventory".into(),
    );
    check(
        q_keys
            .iter()
            .chain(&p_keys)
            .chain(&r_keys)
            .all(|k| src_gpu.contains(k)),
        "router: the source's GPU tier keeps P, Q and R".into(),
    );
    let report = source.call(json!({"cmd": "report"}), "REPORT");
    let (published, removed) = (
        report["ranks"][0]["pages_published"].as_u64().unwrap_or(0),
        report["ranks"][0]["pages_removed"].as_u64().unwrap_or(0),
    );
    println!(
        "source: served Q, P and R, offloaded 12 pages (KV events: {published} stored, {removed} removed on eviction); the router's KVCR index for it holds {} pages, its GPU index {}",
        src_kvcr.len(),
        src_gpu.len()
    );
    check(
        published == 12 && removed == 4,
        format!("source published {published} stored / {removed} removed"),
    );

    println!();
    println!(
        "{:<8} {:>6} {:>16} {:<5} {:>20} {:>20} {:>18} {:<8} {:>8}",
        "request",
        "prompt",
        "restored/prompt",
        "hint",
        "shard0 blocks/spans",
        "shard1 blocks/spans",
        "source-send bytes",
        "digest",
        "seconds"
    );
    let counters = |proc: &mut Proc| -> (Vec<(u64, u64)>, u64) {
        let r = proc.call(json!({"cmd": "report"}), "REPORT");
        let ranks = r["ranks"].as_array().unwrap().clone();
        (
            ranks
                .iter()
                .map(|x| {
                    (
                        x["blocks_received"].as_u64().unwrap(),
                        x["spans_received"].as_u64().unwrap(),
                    )
                })
                .collect(),
            ranks
                .iter()
                .map(|x| x["bytes_sent"].as_u64().unwrap())
                .sum(),
        )
    };
    for (name, tokens, keys, expect) in [("P", &p, &p_keys, 3u64), ("Q", &q, &q_keys, 0)] {
        let (before, _) = counters(&mut dest);
        let (_, sent_before) = counters(&mut source);
        let hint = router.hint_for(dest.worker, keys);
        let hinted = hint.is_some();
        let t = Instant::now();
        let served = dest.call(
            json!({"cmd": "serve", "request": format!("dst-{name}"), "tokens": tokens, "hint": hint}),
            "SERVED",
        );
        let secs = t.elapsed().as_secs_f64();
        let batches = served["batches"].as_u64().unwrap();
        let replay = dest.replay.clone();
        router.catch_up(dest.worker, &replay, batches);
        let (after, _) = counters(&mut dest);
        let (_, sent_after) = counters(&mut source);
        let shards: Vec<(u64, u64)> = after
            .iter()
            .zip(&before)
            .map(|(a, b)| (a.0 - b.0, a.1 - b.1))
            .collect();
        let sent = sent_after - sent_before;
        let restored = served["restored_pages"].as_u64().unwrap();
        let digest = match served["digest_ok"].as_bool() {
            Some(true) => "match",
            Some(false) => "MISMATCH",
            None => "n/a",
        };
        println!(
            "{:<8} {:>6} {:>16} {:<5} {:>20} {:>20} {:>18} {:<8} {:>8.3}",
            name,
            tokens.len(),
            format!("{}/{}", restored * PAGE_TOKENS as u64, tokens.len()),
            if hinted { "yes" } else { "none" },
            format!("{}/{}", shards[0].0, shards[0].1),
            format!("{}/{}", shards[1].0, shards[1].1),
            sent,
            digest,
            secs,
        );
        check(
            restored == expect,
            format!("{name}: restored {restored} pages, expected {expect}"),
        );
        check(
            hinted == (expect > 0),
            format!("{name}: hint produced = {hinted}"),
        );
        check(
            shards.iter().all(|s| *s == (expect, 2 * expect)),
            format!("{name}: per-shard blocks/spans {shards:?}"),
        );
        check(
            sent == expect * geometry.page_bytes() * u64::from(TP),
            format!("{name}: the source sent {sent} bytes"),
        );
        check(
            served["digest_ok"] != false,
            format!("{name}: restored bytes differ from the source's"),
        );
        check(
            served["backed_up"] == true,
            format!("{name}: write-through failed"),
        );
    }
    // 3. The source dies (SIGKILL) without retracting anything; the router
    //    still hints R from it. The restore is a miss (the operation fails at
    //    its deadline), never an error or a hang, and the tier keeps serving:
    //    the request is recomputed and backed up through it.
    let (before, _) = counters(&mut dest);
    source.child.kill().unwrap();
    source.child.wait().unwrap();
    let hint = router.hint_for(dest.worker, &r_keys);
    let hinted = hint.is_some();
    let t = Instant::now();
    let served = dest.call(
        json!({"cmd": "serve", "request": "dst-R", "tokens": r, "hint": hint}),
        "SERVED",
    );
    let secs = t.elapsed().as_secs_f64();
    let (after, _) = counters(&mut dest);
    let shards: Vec<(u64, u64)> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| (a.0 - b.0, a.1 - b.1))
        .collect();
    let restored = served["restored_pages"].as_u64().unwrap();
    println!(
        "{:<8} {:>6} {:>16} {:<5} {:>20} {:>20} {:>18} {:<8} {:>8.3}  (source killed)",
        "R",
        r.len(),
        format!("{}/{}", restored * PAGE_TOKENS as u64, r.len()),
        if hinted { "yes" } else { "none" },
        format!("{}/{}", shards[0].0, shards[0].1),
        format!("{}/{}", shards[1].0, shards[1].1),
        "-",
        "n/a",
        secs,
    );
    check(hinted, "R: the router still hints the dead source".into());
    check(
        restored == 0,
        format!("R: restored {restored} pages from a dead source"),
    );
    check(
        shards.iter().all(|s| *s == (0, 0)),
        format!("R: per-shard blocks/spans {shards:?}"),
    );
    // Two outcomes are right, depending on whether the destination saw its
    // control connection to the dead source close before R's write request
    // went out. If it did, the request waits for a handshake nobody answers:
    // nothing was ever asked of the dead process, so at the deadline the
    // fills are simply freed and all 4 pages are backed up. If the request
    // went out first, the 3 pages whose fill the dead source was asked to
    // write are quarantined (a put might still land) and cannot be stored
    // again until that resolves; the remaining page is backed up.
    let r_backed_up = served["backed_up_pages"].as_u64().unwrap_or(u64::MAX);
    println!(
        "R: recomputed; {r_backed_up} of its 4 pages backed up ({})",
        if r_backed_up == 4 {
            "the closed connection was seen first: nothing was asked of the dead source"
        } else {
            "the 3 whose fill was asked of the dead source stay quarantined until it resolves"
        }
    );
    check(
        r_backed_up == 1 || r_backed_up == 4,
        format!("R: backed up {r_backed_up} pages"),
    );
    // The tier keeps serving: a new request is computed and backed up whole.
    let s_tokens = prompt(4);
    let served = dest.call(
        json!({"cmd": "serve", "request": "dst-S", "tokens": s_tokens}),
        "SERVED",
    );
    println!(
        "S: a new prompt after the failure: {} of 4 pages backed up",
        served["backed_up_pages"]
    );
    check(
        served["backed_up"] == true && served["backed_up_pages"] == 4,
        "S: the tier keeps serving after the dead-source miss".into(),
    );
    let replay = dest.replay.clone();
    router.catch_up(dest.worker, &replay, served["batches"].as_u64().unwrap());

    let report = dest.call(json!({"cmd": "report"}), "REPORT");
    println!();
    for (r, rank) in report["ranks"].as_array().unwrap().iter().enumerate() {
        println!(
            "destination rank {r}: hinted pages requested {} loaded {}, faults {}",
            rank["hinted_pages_requested"], rank["hinted_pages_loaded"], rank["faults"]
        );
        check(
            rank["hinted_pages_requested"] == 6 && rank["hinted_pages_loaded"] == 3,
            format!("destination rank {r}: {rank}"),
        );
        check(
            rank["faults"] == 0,
            format!("destination rank {r}: faults {}", rank["faults"]),
        );
        check(
            rank["invariants"].is_null(),
            format!("destination rank {r}: {}", rank["invariants"]),
        );
    }
    let dest_kvcr = router.kvcr.get(&dest.worker).map_or(0, HashSet::len);
    check(
        dest_kvcr as u64 == 9 + r_backed_up,
        format!("router: destination KVCR pages {dest_kvcr}"),
    );
    println!(
        "router: the destination publishes {dest_kvcr} KVCR pages (its own offloads: P 1, Q 4, R {r_backed_up}, S 4); {} replay request(s) to catch up",
        router.replayed
    );
    drop(source);
    // The destination keeps the KVCR pools the dead source was granted
    // mapped until it exits (a late put must never land in reused memory);
    // its runners say so when they are dropped.
    drop(dest);
    println!("done in {:.2} s", started.elapsed().as_secs_f64());
    if failures.is_empty() {
        println!("hicache e2e: all checks passed");
        0
    } else {
        for f in &failures {
            eprintln!("CHECK FAILED: {f}");
        }
        1
    }
}
