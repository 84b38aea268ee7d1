//! One rank-local runner as a process, driven by line commands on stdin
//! (`cargo xtask demo`, `cargo xtask e2e` and the multi-process tests start
//! several).
//!
//! Every command is one JSON line; every answer is one line `<WORD> <json>`:
//!
//! * start: prints `READY {"endpoint": .., "events": .., "replay": ..,
//!   "incarnation": .., "pid": .., "write_batch_bytes": ..}` (`events`: the
//!   KV-event PUB endpoint with `--publish`, else null; `replay`: its replay
//!   ROUTER with `--replay`; `write_batch_bytes`: how many bytes of pages it
//!   asks a source for per write).
//! * `{"cmd":"offload","pages":N,"page_bytes":B,"shards":S,"seed":X}`: fills
//!   host memory with deterministic bytes and deposits every (page, shard) as
//!   its own key (namespace per head shard, as a `page_head` layout splits
//!   heads); answers `OFFLOADED {"hashes": [..], "keys": .., "statuses": {..},
//!   "bytes": .., "secs": ..}`. Optional: `"first_page"` (default 0),
//!   `"hash_seed"` (the keys' seed, default `seed`: a restarted source can hold
//!   the same keys with other bytes), `"no_evict"` (hold a claim on every
//!   stored key until `release`). Each offload keeps its own host buffer until
//!   the runner is closed.
//! * `{"cmd":"restore","request":R,"source":E,"hashes":[..],"first_page":F,
//!   "shards":[..],"page_bytes":B,"seed":X}`: submits the router hint, fetches
//!   the keys from the peer into KVCR DRAM, checks every byte against the
//!   generator, answers `RESTORED {"keys": .., "ok": .., "mismatched": ..,
//!   "failed": .., "statuses": {..}, "completed": .., "bytes": .., "secs": ..}`.
//! * `{"cmd":"restore_many","source":E,"hashes":[..],"ranges":[[first,count],..],
//!   "shards":[..],"seed":X}`: one request per range (pages `first..first+count`
//!   of `hashes`), all submitted before any is waited for; answers
//!   `RESTORED_MANY` with the totals of `RESTORED` plus `"requests"`.
//! * `{"cmd":"verify","hashes":[..],"first_page":F,"shards":[..],"seed":X}`:
//!   a local fetch (no peer) of the keys, byte-checked and released; answers
//!   `VERIFIED` with the fields of `RESTORED`.
//! * `{"cmd":"query","hashes":[..],"shards":[..]}`: answers `QUERIED
//!   {"statuses": {..}}` (how many keys are `Hit`, `Miss`, ..).
//! * `{"cmd":"release"}`: releases the claims `no_evict` offloads hold;
//!   answers `RELEASED {"released": ..}`.
//! * `{"cmd":"stats"}`: answers `STATS` with the runner's counts and counters,
//!   its peer counters, every peer notice so far (`uncertain`/`quiesced` op
//!   handles), the publisher's counters and the core's invariant check.
//! * `{"cmd":"exit"}`: closes the runner and exits.
//!
//! Options: `--blocks N` (pool slots), `--block-bytes B`, `--tls T` (UCX
//! transports), `--timeout-ms MS`, `--abandon-ms MS` (the peer abandonment
//! budget), `--port P` (the control port: a restarted source comes back at
//! the same address), `--host IP` (listen on and advertise this address, for
//! peers on other hosts, and never map a peer's memory: bytes cross the
//! network; needs the cluster secret), `--g3 DIR` (a G3 file tier under
//! the pool: two files in `DIR`, each `--g3-bytes N` long, default the
//! pool's size; evicted pages move there), `--guard SOCKET` (the pool, its
//! residency journal and the control listener belong to the `kvcr-guard`
//! at `SOCKET`, group `--guard-group N` (default 0), journal
//! `--guard-journal-bytes B`: a node restarted on the same group takes its
//! pages back warm; `READY` then carries `warm_start`), `--publish`, `--replay` (with `--publish`: a replay
//! ROUTER), `--pub-hwm N`, `--ownership stream` (with `--publish`: kvcr's
//! events without the `ownership` field, for consumers that only know the
//! worker domain, such as Dynamo 1.6.1's standalone indexer).
//!
//! The cluster secret comes from the environment variable
//! `KVCR_CLUSTER_SECRET` or from `--secret-file PATH` (its trimmed contents);
//! the orchestrators generate one per run and hand it to every node. Without
//! one the node serves loopback only, as every runner does.

#![allow(clippy::disallowed_methods)] // a driver program reads the clock
#![allow(missing_docs)]
// A test driver program: its indices come from its own loops and a bad
// command line aborts it, which the orchestrator reports.
#![allow(clippy::indexing_slicing)]

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use kvcr_foundation::hint::FetchMode;
use kvcr_foundation::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_foundation::publisher::{
    OwnershipWire, PubSocket, Publisher, PublisherConfig, TopicParts,
};
use kvcr_foundation::runner::{
    DepositEntry, EntryResult, G3Options, GuardOptions, OpResult, PageInfo, PeerNotice,
    PeerOptions, PeerStats, RegionDesc, ReleaseHandle, Runner, RunnerConfig, WarmStart,
};
use kvcr_foundation::{
    BlockKey, CompatDigest, FetchHint, Namespace, NamespaceId, RequestId, ScopedKey,
};
use serde_json::{Value, json};

/// How long the node waits for one operation before reporting it incomplete
/// (far beyond any operation deadline it is started with).
const WAIT_BOUND: Duration = Duration::from_secs(120);

/// The bytes of (page, shard) for a seed: a cheap, position-dependent pattern.
fn fill(buf: &mut [u8], page: u64, shard: u64, seed: u64) {
    let mut x = (seed ^ page.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (shard << 56)) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// The router-visible hash of a page (the same for every shard).
fn page_hash(page: u64, seed: u64) -> u64 {
    (page + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ seed
}

struct Node {
    runner: Runner,
    shards: Vec<NamespaceId>,
    /// One host buffer per offload, registered as its own region: kept until
    /// the runner is closed (the registration's contract).
    hosts: Vec<Vec<u8>>,
    block: usize,
    /// Claims held by `no_evict` offloads, until `release`.
    claims: Vec<ReleaseHandle>,
    /// Every peer notice so far.
    uncertain: Vec<u64>,
    quiesced: Vec<u64>,
}

impl Node {
    fn take_notices(&mut self) {
        for notice in self.runner.peers().take_notices() {
            match notice {
                PeerNotice::Uncertain { op } => self.uncertain.push(op.0),
                PeerNotice::Quiesced { op } => self.quiesced.push(op.0),
            }
        }
    }

    /// `(page, shard, key)` for pages `first_page..` named by `hashes`.
    fn keys(&self, hashes: &[u64], first_page: u64, shards: &[u64]) -> Vec<(u64, u64, ScopedKey)> {
        hashes
            .iter()
            .enumerate()
            .flat_map(|(i, h)| shards.iter().map(move |s| (first_page + i as u64, *s, *h)))
            .filter_map(|(page, shard, h)| {
                self.shards.get(shard as usize).map(|ns| {
                    (
                        page,
                        shard,
                        ScopedKey {
                            namespace: *ns,
                            key: BlockKey::from_u64(h),
                        },
                    )
                })
            })
            .collect()
    }
}

/// What one batch of results came to, after byte checks.
#[derive(Default)]
struct Checked {
    keys: usize,
    ok: usize,
    mismatched: usize,
    failed: usize,
    statuses: BTreeMap<String, usize>,
}

impl Checked {
    /// Checks every successful entry's bytes against the generator and
    /// releases its claim; an entry with no result counts as failed.
    fn add(
        &mut self,
        node: &mut Node,
        keys: &[(u64, u64, ScopedKey)],
        entries: &[(ScopedKey, EntryResult)],
        seed: u64,
    ) {
        let mut expected = vec![0u8; node.block];
        let mut releases = Vec::new();
        self.keys += keys.len();
        for (i, (page, shard, _)) in keys.iter().enumerate() {
            let Some((_, entry)) = entries.get(i) else {
                self.failed += 1;
                *self.statuses.entry("NoResult".into()).or_default() += 1;
                continue;
            };
            *self
                .statuses
                .entry(format!("{:?}", entry.status))
                .or_default() += 1;
            let Some(release) = entry.release.filter(|_| entry.is_success()) else {
                self.failed += 1;
                continue;
            };
            releases.push(release);
            fill(&mut expected, *page, *shard, seed);
            match node.runner.read_claimed(release, 0) {
                Ok(bytes) if bytes == expected => self.ok += 1,
                _ => self.mismatched += 1,
            }
        }
        node.runner.release(&releases);
    }

    fn json(&self, block: usize) -> Value {
        json!({
            "keys": self.keys, "ok": self.ok, "mismatched": self.mismatched,
            "failed": self.failed, "statuses": self.statuses, "bytes": self.ok * block,
        })
    }
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

fn answer(word: &str, value: &Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{word} {value}");
    let _ = out.flush();
}

fn u64s(value: &Value) -> Option<Vec<u64>> {
    value
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
}

/// Waits for every op in `ops`; returns the results found within the bound.
fn wait_all(runner: &mut Runner, ops: &[OpHandle]) -> HashMap<OpHandle, OpResult> {
    let deadline = Instant::now() + WAIT_BOUND;
    let mut done = HashMap::new();
    while done.len() < ops.len() && Instant::now() < deadline {
        for r in runner.wait_completed(Duration::from_millis(100)) {
            if ops.contains(&r.op) {
                done.insert(r.op, r);
            }
        }
    }
    done
}

fn wait(runner: &mut Runner, op: OpHandle) -> Option<OpResult> {
    wait_all(runner, &[op]).remove(&op)
}

/// How the node started under its guard, for `READY`.
fn warm_start_json(w: &WarmStart) -> Value {
    let report = w.recovery.clone().unwrap_or_default();
    json!({
        "group": w.group, "warm": w.warm,
        "previous_incarnation": w.previous_incarnation.map(|i| format!("{i:032x}")),
        "dead_incarnations": w.dead_incarnations.iter().map(|i| format!("{i:032x}")).collect::<Vec<_>>(),
        "recovered": w.recovery.is_some(), "seated": report.seated, "skipped": report.skipped,
        "held_slots": report.held_slots, "bytes": report.bytes, "disabled": w.disabled,
    })
}

fn main() {
    let blocks: u32 = arg("--blocks").and_then(|v| v.parse().ok()).unwrap_or(256);
    let block: usize = arg("--block-bytes")
        .and_then(|v| v.parse().ok())
        .unwrap_or(3_670_016);
    let timeout = Duration::from_millis(
        arg("--timeout-ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000),
    );
    let mut options = PeerOptions::loopback();
    options.ucx_tls = arg("--tls");
    options.abandon_timeout = arg("--abandon-ms")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis);
    if let Some(port) = arg("--port").and_then(|v| v.parse().ok()) {
        options.bind.port = port;
    }
    // Another "host" (a network namespace of `cargo xtask e2e`'s link
    // harness): listen and advertise there; peers are across a network.
    if let Some(host) = arg("--host").and_then(|v| v.parse::<std::net::IpAddr>().ok()) {
        options.bind.host = Some(host);
        options.advertise_host = kvcr_foundation::endpoint::Host::Ip(host);
        options.advertise_policy = kvcr_foundation::endpoint::AdvertisePolicy::CrossHost;
        // Namespaces of one kernel could still map each other's pools: two
        // hosts could not, so every byte crosses the network.
        options.same_host_mapping = false;
    }
    options.secret = match arg("--secret-file") {
        Some(path) => match std::fs::read_to_string(&path) {
            Ok(text) => Some(text.trim().as_bytes().to_vec()),
            Err(e) => {
                answer(
                    "ERROR",
                    &json!({ "error": format!("--secret-file {path}: {e}") }),
                );
                std::process::exit(2);
            }
        },
        None => std::env::var("KVCR_CLUSTER_SECRET")
            .ok()
            .map(String::into_bytes),
    };
    // A G3 file tier under the pool: two files in `--g3 DIR`, each
    // `--g3-bytes` long (default: the pool's size).
    let g3 = arg("--g3").map(|dir| {
        let dir = std::path::PathBuf::from(dir);
        G3Options {
            paths: vec![dir.join("node-g3-0.bin"), dir.join("node-g3-1.bin")],
            capacity_bytes_per_file: arg("--g3-bytes")
                .and_then(|v| v.parse().ok())
                .unwrap_or(u64::from(blocks) * block as u64),
        }
    });
    // `--guard SOCKET`: the pool, its journal and the control listener are
    // a `kvcr-guard`'s (group `--guard-group`, default 0): they outlive this
    // process, and a node restarted on the same group takes them back warm.
    options.guard = arg("--guard").map(|socket| {
        let mut guard = GuardOptions::new(
            socket,
            arg("--guard-group")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            0x5157_454e,
        );
        if let Some(bytes) = arg("--guard-journal-bytes").and_then(|v| v.parse().ok()) {
            guard.journal_bytes = bytes;
        }
        guard
    });
    let config = RunnerConfig {
        operation_timeout: timeout,
        g3,
        ..RunnerConfig::single_pool("kv", block as u64, blocks)
    };
    let write_batch_bytes = options.write_batch_bytes;
    let runner = match Runner::start_with_peers(config, None, &options) {
        Ok(r) => r,
        Err(e) => {
            answer("ERROR", &json!({ "error": e.to_string() }));
            std::process::exit(2);
        }
    };
    // Two head shards (TP=2 splits the KV heads); TP=1 consumers take both.
    let shards = (0..2u64)
        .map(|s| {
            runner.register_namespace(Namespace {
                compat: CompatDigest(0x5157_454e_0000 | s),
                lora_name: None,
                cache_salt: None,
            })
        })
        .collect();
    let endpoint = runner
        .peers()
        .endpoint()
        .map(ToString::to_string)
        .unwrap_or_default();
    // `--publish`: the runner's inventory goes out on the KV-event wire (a PUB
    // socket bound on loopback), where a router can learn what it holds.
    let publisher = if flag("--publish") {
        let started = kvcr_foundation::BindAddress::parse("tcp://127.0.0.1:0")
            .map_err(kvcr_foundation::publisher::Error::from)
            .and_then(|bind| {
                let mut config = PublisherConfig::new(
                    TopicParts {
                        worker_id: u64::from(std::process::id()),
                        dp_rank: 0,
                    },
                    runner.incarnation(),
                    PubSocket::Bind(bind.clone()),
                );
                if flag("--replay") {
                    config = config.with_replay(bind);
                }
                if let Some(hwm) = arg("--pub-hwm").and_then(|v| v.parse().ok()) {
                    config.pub_hwm = hwm;
                }
                if arg("--ownership").as_deref() == Some("stream") {
                    config.ownership = OwnershipWire::Stream;
                }
                Publisher::start(config)
            });
        match started {
            Ok(publisher) => {
                runner.set_inventory_sink(Box::new(publisher.sink()));
                Some(publisher)
            }
            Err(e) => {
                answer("ERROR", &json!({ "error": e.to_string() }));
                std::process::exit(2);
            }
        }
    } else {
        None
    };
    let bound = publisher.as_ref().map(|p| p.bound().clone());
    let events = bound
        .as_ref()
        .and_then(|b| b.pub_bound.as_ref())
        .map(ToString::to_string);
    let replay = bound
        .as_ref()
        .and_then(|b| b.replay_bound.as_ref())
        .map(ToString::to_string);
    let incarnation = runner.incarnation().to_string();
    let warm_start = runner.recovery().warm_start().map(warm_start_json);
    let mut node = Node {
        runner,
        shards,
        hosts: Vec::new(),
        block,
        claims: Vec::new(),
        uncertain: Vec::new(),
        quiesced: Vec::new(),
    };
    answer(
        "READY",
        &json!({
            "endpoint": endpoint, "events": events, "replay": replay,
            "incarnation": incarnation, "pid": std::process::id(),
            "write_batch_bytes": write_batch_bytes, "warm_start": warm_start,
        }),
    );
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let Ok(cmd) = serde_json::from_str::<Value>(&line) else {
            answer("ERROR", &json!({ "error": "not JSON" }));
            continue;
        };
        match cmd["cmd"].as_str() {
            Some("offload") => offload(&mut node, &cmd),
            Some("restore") => restore(&mut node, &cmd),
            Some("restore_many") => restore_many(&mut node, &cmd),
            Some("verify") => verify(&mut node, &cmd),
            Some("query") => query(&node, &cmd),
            Some("release") => {
                let claims = std::mem::take(&mut node.claims);
                let released = node.runner.release(&claims).iter().filter(|r| **r).count();
                answer("RELEASED", &json!({ "released": released }));
            }
            Some("stats") => stats(&mut node, publisher.as_ref()),
            Some("exit") | None => break,
            Some(other) => answer(
                "ERROR",
                &json!({ "error": format!("unknown command {other}") }),
            ),
        }
    }
    let Node {
        runner,
        hosts,
        claims,
        ..
    } = node;
    runner.release(&claims);
    drop(publisher);
    if let Err((runner, e)) = runner.close() {
        answer("ERROR", &json!({ "error": e.to_string() }));
        drop(runner);
    }
    drop(hosts);
}

fn offload(node: &mut Node, cmd: &Value) {
    let pages = cmd["pages"].as_u64().unwrap_or(0);
    let first = cmd["first_page"].as_u64().unwrap_or(0);
    let seed = cmd["seed"].as_u64().unwrap_or(0);
    let hash_seed = cmd["hash_seed"].as_u64().unwrap_or(seed);
    let no_evict = cmd["no_evict"].as_bool().unwrap_or(false);
    let shards = cmd["shards"].as_u64().unwrap_or(2).clamp(1, 2);
    let count = (pages * shards) as usize;
    if count == 0 {
        return answer("ERROR", &json!({ "error": "nothing to offload" }));
    }
    let mut host = vec![0u8; count * node.block];
    for page in 0..pages {
        for shard in 0..shards {
            let i = (page * shards + shard) as usize;
            fill(
                &mut host[i * node.block..(i + 1) * node.block],
                first + page,
                shard,
                seed,
            );
        }
    }
    // SAFETY: the buffer is moved into `node.hosts` below (moving a Vec does
    // not move its heap allocation) and stays there, untouched, until the
    // runner is closed.
    let region = unsafe {
        node.runner.register_region(RegionDesc {
            label: format!("kv:host{}", node.hosts.len()),
            base: host.as_mut_ptr() as u64,
            size: node.block as u64,
            stride: 0,
            count: count as u64,
        })
    };
    node.hosts.push(host);
    let region: RegionId = match region {
        Ok(r) => r,
        Err(e) => return answer("ERROR", &json!({ "error": e.to_string() })),
    };
    let entries = (0..pages)
        .flat_map(|page| (0..shards).map(move |shard| (page, shard)))
        .map(|(page, shard)| DepositEntry {
            key: ScopedKey {
                namespace: node.shards[shard as usize],
                key: BlockKey::from_u64(page_hash(first + page, hash_seed)),
            },
            spans: vec![ElementRef {
                region,
                index: page * shards + shard,
            }],
            // The page's tokens (synthetic but consistent): KV events carry
            // real token ids, so a router can match prompts to pages.
            page: Some(PageInfo {
                parent: (first + page)
                    .checked_sub(1)
                    .map(|p| BlockKey::from_u64(page_hash(p, hash_seed))),
                token_ids: (0..64).map(|t| ((first + page) * 64 + t) as u32).collect(),
            }),
        })
        .collect();
    let start = Instant::now();
    let op = match node.runner.deposit(entries, no_evict) {
        Ok(op) => op,
        Err(e) => return answer("ERROR", &json!({ "error": e.to_string() })),
    };
    let result = wait(&mut node.runner, op);
    let completed = result.is_some();
    let entries = result.map(|r| r.entries).unwrap_or_default();
    let ok = entries.iter().filter(|(_, e)| e.is_success()).count();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for (_, e) in &entries {
        *statuses.entry(format!("{:?}", e.status)).or_default() += 1;
        if let Some(release) = e.release {
            node.claims.push(release);
        }
    }
    answer(
        "OFFLOADED",
        &json!({
            "hashes": (first..first + pages).map(|p| page_hash(p, hash_seed)).collect::<Vec<_>>(),
            "keys": ok,
            "statuses": statuses,
            "completed": completed,
            "claims": node.claims.len(),
            "bytes": ok * node.block,
            "secs": start.elapsed().as_secs_f64(),
        }),
    );
}

fn shards_of(cmd: &Value) -> Vec<u64> {
    u64s(&cmd["shards"]).unwrap_or_else(|| vec![0, 1])
}

fn restore(node: &mut Node, cmd: &Value) {
    let seed = cmd["seed"].as_u64().unwrap_or(0);
    let request = RequestId(cmd["request"].as_str().unwrap_or("r").to_owned());
    let Some(source) = cmd["source"].as_str().and_then(|s| s.parse().ok()) else {
        return answer("ERROR", &json!({ "error": "bad source endpoint" }));
    };
    let hashes = u64s(&cmd["hashes"]).unwrap_or_default();
    let first_page = cmd["first_page"].as_u64().unwrap_or(0);
    let keys = node.keys(&hashes, first_page, &shards_of(cmd));
    let hint = FetchHint {
        source,
        block_hashes: hashes.iter().copied().map(BlockKey::from_u64).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    let start = Instant::now();
    node.runner.hints().submit(request.clone(), &hint);
    let Some(pool) = node.runner.pool("kv") else {
        return answer("ERROR", &json!({ "error": "no pool" }));
    };
    let scoped: Vec<ScopedKey> = keys.iter().map(|(_, _, k)| *k).collect();
    let op = match node.runner.hints().fetch(&request, &scoped, &[pool]) {
        Ok(op) => op,
        Err(e) => return answer("ERROR", &json!({ "error": e.to_string() })),
    };
    let result = wait(&mut node.runner, op);
    let secs = start.elapsed().as_secs_f64();
    node.runner.hints().discard(&request);
    let completed = result.is_some();
    let mut checked = Checked::default();
    let entries = result.map(|r| r.entries).unwrap_or_default();
    checked.add(node, &keys, &entries, seed);
    let mut out = checked.json(node.block);
    out["completed"] = json!(completed);
    out["secs"] = json!(secs);
    answer("RESTORED", &out);
}

fn restore_many(node: &mut Node, cmd: &Value) {
    let seed = cmd["seed"].as_u64().unwrap_or(0);
    let Some(source) = cmd["source"]
        .as_str()
        .and_then(|s| s.parse::<kvcr_foundation::ControlEndpoint>().ok())
    else {
        return answer("ERROR", &json!({ "error": "bad source endpoint" }));
    };
    let hashes = u64s(&cmd["hashes"]).unwrap_or_default();
    let shards = shards_of(cmd);
    let Some(pool) = node.runner.pool("kv") else {
        return answer("ERROR", &json!({ "error": "no pool" }));
    };
    let ranges: Vec<(u64, u64)> = cmd["ranges"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| Some((r[0].as_u64()?, r[1].as_u64()?)))
                .collect()
        })
        .unwrap_or_default();
    let start = Instant::now();
    let mut pending = Vec::new();
    for (i, (first, count)) in ranges.iter().enumerate() {
        let range = *first as usize..(*first + *count) as usize;
        let Some(slice) = hashes.get(range) else {
            return answer("ERROR", &json!({ "error": "range outside hashes" }));
        };
        let request = RequestId(format!("many-{i}"));
        let hint = FetchHint {
            source: source.clone(),
            block_hashes: slice.iter().copied().map(BlockKey::from_u64).collect(),
            mode: FetchMode::Copy,
            action_id: None,
        };
        node.runner.hints().submit(request.clone(), &hint);
        let keys = node.keys(slice, *first, &shards);
        let scoped: Vec<ScopedKey> = keys.iter().map(|(_, _, k)| *k).collect();
        match node.runner.hints().fetch(&request, &scoped, &[pool]) {
            Ok(op) => pending.push((request, op, keys)),
            Err(e) => return answer("ERROR", &json!({ "error": e.to_string() })),
        }
    }
    let ops: Vec<OpHandle> = pending.iter().map(|(_, op, _)| *op).collect();
    let mut results = wait_all(&mut node.runner, &ops);
    let secs = start.elapsed().as_secs_f64();
    let mut checked = Checked::default();
    let mut completed = 0;
    for (request, op, keys) in &pending {
        node.runner.hints().discard(request);
        let entries = results.remove(op).map(|r| r.entries);
        completed += usize::from(entries.is_some());
        checked.add(node, keys, &entries.unwrap_or_default(), seed);
    }
    let mut out = checked.json(node.block);
    out["requests"] = json!(pending.len());
    out["completed"] = json!(completed);
    out["secs"] = json!(secs);
    answer("RESTORED_MANY", &out);
}

fn verify(node: &mut Node, cmd: &Value) {
    let seed = cmd["seed"].as_u64().unwrap_or(0);
    let hashes = u64s(&cmd["hashes"]).unwrap_or_default();
    let first_page = cmd["first_page"].as_u64().unwrap_or(0);
    let keys = node.keys(&hashes, first_page, &shards_of(cmd));
    let Some(pool) = node.runner.pool("kv") else {
        return answer("ERROR", &json!({ "error": "no pool" }));
    };
    let scoped: Vec<ScopedKey> = keys.iter().map(|(_, _, k)| *k).collect();
    let op = match node.runner.fetch(&scoped, &[pool]) {
        Ok(op) => op,
        Err(e) => return answer("ERROR", &json!({ "error": e.to_string() })),
    };
    let result = wait(&mut node.runner, op);
    let completed = result.is_some();
    let mut checked = Checked::default();
    checked.add(
        node,
        &keys,
        &result.map(|r| r.entries).unwrap_or_default(),
        seed,
    );
    let mut out = checked.json(node.block);
    out["completed"] = json!(completed);
    answer("VERIFIED", &out);
}

fn query(node: &Node, cmd: &Value) {
    let hashes = u64s(&cmd["hashes"]).unwrap_or_default();
    let keys = node.keys(&hashes, 0, &shards_of(cmd));
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for (_, _, key) in &keys {
        *statuses
            .entry(format!("{:?}", node.runner.query(key)))
            .or_default() += 1;
    }
    answer("QUERIED", &json!({ "statuses": statuses }));
}

fn stats(node: &mut Node, publisher: Option<&Publisher>) {
    node.take_notices();
    let s = node.runner.stats();
    let PeerStats {
        counters: peer,
        open_sockets: sockets,
        stalled,
    } = node.runner.peers().stats();
    let control = node.runner.peers().control_stats();
    let pool = s.pools.first();
    let publisher = publisher.map(|p| {
        let p = p.stats();
        json!({
            "stored_blocks": p.core.stored_blocks, "removed_blocks": p.core.removed_blocks,
            "clears": p.core.clears, "batches": p.core.batches, "resyncs": p.core.resyncs,
            "stored_rejected": p.core.stored_rejected, "removed_unknown": p.core.removed_unknown,
            "queue_dropped": p.queue_dropped, "pub_send_errors": p.pub_send_errors,
            "replay_requests": p.replay_requests, "replay_aborted": p.replay_aborted,
            "replay_refused": p.replay_refused, "replay_displaced": p.replay_displaced,
            "replay_open": p.replay_open, "replay_queued_bytes": p.replay_queued_bytes,
            "replay_queued_peak": p.replay_queued_peak,
        })
    });
    answer(
        "STATS",
        &json!({
            "ready": s.ready, "filling": s.filling, "discarding": s.discarding,
            "public_claims": s.public_claims, "ops_in_flight": s.ops_in_flight,
            "copies_in_flight": s.copies_in_flight,
            "total_slots": pool.map_or(0, |p| p.total_slots),
            "free_slots": pool.map_or(0, |p| p.free_slots),
            "evictable_slots": pool.map_or(0, |p| p.evictable_slots),
            "evictions": s.counters.evictions, "dropped": s.counters.dropped,
            "committed": s.counters.committed, "bytes_deposited": s.counters.bytes_deposited,
            "peer": {
                "writes_requested": peer.writes_requested, "keys_received": peer.keys_received,
                "keys_sent": peer.keys_sent, "bytes_sent": peer.bytes_sent,
                "refused": peer.refused, "quarantined": peer.quarantined, "sockets": sockets,
                "dead_reported": peer.dead_reported, "dead_freed": peer.dead_freed,
                "stalls": peer.stalls, "stalled": stalled,
            },
            "streams": {
                "opened": control.streams_opened, "refused": control.streams_refused,
                "writes_sent": control.stream_writes_sent,
                "writes_taken": control.stream_writes_taken,
                "writes_refused": control.stream_writes_refused,
                "records_refused": control.stream_records_refused,
            },
            "mailbox": {
                "posted": control.mailbox_requests_posted,
                "taken": control.mailbox_requests_taken,
                "refused": control.mailbox_requests_refused,
                "copies_dropped": control.early_copies_dropped,
            },
            "uncertain": node.uncertain, "quiesced": node.quiesced,
            "invariants": node.runner.check_invariants().err(),
            "publisher": publisher,
            "journal": node.runner.recovery().journal_stats().map(|j| json!({
                "appended": j.appended, "compactions": j.compactions,
                "live_pages": j.live_pages, "held_slots": j.held_slots, "disabled": j.disabled,
            })),
            "g3": node.runner.pools().g3_stats().map(|g| json!({
                "spills": g.counters.spills_committed, "spills_failed": g.counters.spills_failed,
                "fills": g.counters.fills, "fills_failed": g.counters.fills_failed,
                "evictions": g.counters.evictions, "resident": g.counters.resident,
                "failed_transfers": g.failed_transfers,
                "last_error": g.last_error.map(|e| e.to_string()),
            })),
        }),
    );
}
