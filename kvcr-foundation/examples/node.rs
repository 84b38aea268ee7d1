//! One rank-local runner as a process, driven by line commands on stdin
//! (`cargo xtask demo` and the multi-process tests start several).
//!
//! Every command is one JSON line; every answer is one line `<WORD> <json>`:
//!
//! * start: prints `READY {"endpoint": .., "events": .., "replay": .., "pid": ..}`
//!   (`events` and `replay`: the KV-event PUB and replay ROUTER endpoints with
//!   `--publish`, else null).
//! * `{"cmd":"offload","pages":N,"page_bytes":B,"shards":S,"seed":X}`: fills
//!   host memory with deterministic bytes and deposits every (page, shard) as
//!   its own key (namespace per head shard, as a `page_head` layout splits
//!   heads); answers `OFFLOADED {"hashes": [..], "bytes": .., "secs": ..}`.
//! * `{"cmd":"restore","request":R,"source":E,"hashes":[..],"shards":[..],
//!   "page_bytes":B,"seed":X}`: submits the router hint, fetches the keys from
//!   the peer into KVCR DRAM, checks every byte against the generator, answers
//!   `RESTORED {"keys": .., "ok": .., "mismatched": .., "failed": .., "bytes": .., "secs": ..}`.
//! * `{"cmd":"exit"}`: closes the runner and exits.
//!
//! Options: `--blocks N` (pool slots), `--block-bytes B`, `--tls T` (UCX
//! transports), `--timeout-ms MS`, `--ownership stream` (publish kvcr's events
//! without the `ownership` field, for consumers that only know the worker
//! domain, such as Dynamo 1.6.1's standalone indexer).

#![allow(clippy::disallowed_methods)] // a driver program reads the clock
#![allow(missing_docs)]
// A test driver program: its indices come from its own loops and a bad
// command line aborts it, which the orchestrator reports.
#![allow(clippy::indexing_slicing)]

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use kvcr_foundation::hint::FetchMode;
use kvcr_foundation::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_foundation::publisher::{
    OwnershipWire, PubSocket, Publisher, PublisherConfig, TopicParts,
};
use kvcr_foundation::runner::{
    DepositEntry, OpResult, PageInfo, PeerOptions, RegionDesc, Runner, RunnerConfig,
};
use kvcr_foundation::{
    BlockKey, CompatDigest, FetchHint, Namespace, NamespaceId, RequestId, ScopedKey,
};
use serde_json::{Value, json};

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
    host: Vec<u8>,
    host_region: Option<RegionId>,
    block: usize,
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn answer(word: &str, value: &Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{word} {value}");
    let _ = out.flush();
}

fn wait(runner: &mut Runner, op: OpHandle) -> Option<OpResult> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if let Some(r) = runner
            .wait_completed(Duration::from_millis(100))
            .into_iter()
            .find(|r| r.op == op)
        {
            return Some(r);
        }
    }
    None
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
    let config = RunnerConfig {
        operation_timeout: timeout,
        ..RunnerConfig::single_pool("kv", block as u64, blocks)
    };
    let mut runner = match Runner::start_with_peers(config, None, &options) {
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
        .endpoint()
        .map(ToString::to_string)
        .unwrap_or_default();
    // `--publish`: the runner's inventory goes out on the KV-event wire (a PUB
    // socket bound on loopback), where a router can learn what it holds.
    let publisher = if std::env::args().any(|a| a == "--publish") {
        let bind = || kvcr_foundation::BindAddress::parse("tcp://127.0.0.1:0");
        let started = bind().and_then(|pub_bind| {
            let mut config = PublisherConfig::new(
                TopicParts {
                    worker_id: u64::from(std::process::id()),
                    dp_rank: 0,
                },
                runner.incarnation(),
                PubSocket::Bind(pub_bind),
            )
            .with_replay(bind()?);
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
    let events = publisher
        .as_ref()
        .and_then(|p| p.bound().pub_bound.as_ref())
        .map(ToString::to_string);
    let replay = publisher
        .as_ref()
        .and_then(|p| p.bound().replay_bound.as_ref())
        .map(ToString::to_string);
    let mut node = Node {
        runner,
        shards,
        host: Vec::new(),
        host_region: None,
        block,
    };
    answer(
        "READY",
        &json!({ "endpoint": endpoint, "events": events, "replay": replay, "pid": std::process::id() }),
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
            Some("exit") | None => break,
            Some(other) => answer(
                "ERROR",
                &json!({ "error": format!("unknown command {other}") }),
            ),
        }
    }
    let Node { runner, host, .. } = node;
    drop(publisher);
    if let Err((runner, e)) = runner.close() {
        answer("ERROR", &json!({ "error": e.to_string() }));
        drop(runner);
    }
    drop(host);
}

fn offload(node: &mut Node, cmd: &Value) {
    let pages = cmd["pages"].as_u64().unwrap_or(0);
    let seed = cmd["seed"].as_u64().unwrap_or(0);
    let shards = cmd["shards"].as_u64().unwrap_or(2).clamp(1, 2);
    let count = (pages * shards) as usize;
    node.host = vec![0u8; count * node.block];
    for page in 0..pages {
        for shard in 0..shards {
            let i = (page * shards + shard) as usize;
            fill(
                &mut node.host[i * node.block..(i + 1) * node.block],
                page,
                shard,
                seed,
            );
        }
    }
    // SAFETY: the host buffer stays untouched in `node` until the runner is
    // closed (a new offload is refused below once one happened).
    let region = unsafe {
        node.runner.register_region(RegionDesc {
            label: "kv:host".into(),
            base: node.host.as_mut_ptr() as u64,
            size: node.block as u64,
            stride: 0,
            count: count as u64,
        })
    };
    let region = match region {
        Ok(r) => r,
        Err(e) => return answer("ERROR", &json!({ "error": e.to_string() })),
    };
    node.host_region = Some(region);
    let entries = (0..pages)
        .flat_map(|page| (0..shards).map(move |shard| (page, shard)))
        .map(|(page, shard)| DepositEntry {
            key: ScopedKey {
                namespace: node.shards[shard as usize],
                key: BlockKey::from_u64(page_hash(page, seed)),
            },
            spans: vec![ElementRef {
                region,
                index: page * shards + shard,
            }],
            // The page's tokens (synthetic but consistent): KV events carry
            // real token ids, so a router can match prompts to pages.
            page: Some(PageInfo {
                parent: page
                    .checked_sub(1)
                    .map(|p| BlockKey::from_u64(page_hash(p, seed))),
                token_ids: (0..64).map(|t| (page * 64 + t) as u32).collect(),
            }),
        })
        .collect();
    let start = Instant::now();
    let op = match node.runner.deposit(entries, false) {
        Ok(op) => op,
        Err(e) => return answer("ERROR", &json!({ "error": e.to_string() })),
    };
    let result = wait(&mut node.runner, op);
    let ok = result.map_or(0, |r| {
        r.entries.iter().filter(|(_, e)| e.is_success()).count()
    });
    answer(
        "OFFLOADED",
        &json!({
            "hashes": (0..pages).map(|p| page_hash(p, seed)).collect::<Vec<_>>(),
            "keys": ok,
            "bytes": ok * node.block,
            "secs": start.elapsed().as_secs_f64(),
        }),
    );
}

fn restore(node: &mut Node, cmd: &Value) {
    let seed = cmd["seed"].as_u64().unwrap_or(0);
    let request = RequestId(cmd["request"].as_str().unwrap_or("r").to_owned());
    let Some(source) = cmd["source"].as_str().and_then(|s| s.parse().ok()) else {
        return answer("ERROR", &json!({ "error": "bad source endpoint" }));
    };
    let hashes: Vec<u64> = cmd["hashes"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let first_page = cmd["first_page"].as_u64().unwrap_or(0);
    let shards: Vec<u64> = cmd["shards"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_else(|| vec![0, 1]);
    let hint = FetchHint {
        source,
        block_hashes: hashes.iter().copied().map(BlockKey::from_u64).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    let start = Instant::now();
    node.runner.submit_hint(request.clone(), &hint);
    let keys: Vec<(u64, u64, ScopedKey)> = hashes
        .iter()
        .enumerate()
        .flat_map(|(i, h)| shards.iter().map(move |s| (first_page + i as u64, *s, *h)))
        .filter_map(|(page, shard, h)| {
            node.shards.get(shard as usize).map(|ns| {
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
        .collect();
    let Some(pool) = node.runner.pool("kv") else {
        return;
    };
    let scoped: Vec<ScopedKey> = keys.iter().map(|(_, _, k)| *k).collect();
    let op = match node.runner.fetch_hinted(&request, &scoped, &[pool]) {
        Ok(op) => op,
        Err(e) => return answer("ERROR", &json!({ "error": e.to_string() })),
    };
    let result = wait(&mut node.runner, op);
    let secs = start.elapsed().as_secs_f64();
    node.runner.discard_hint(&request);
    let mut ok = 0;
    let mut mismatched = 0;
    let mut failed = 0;
    let mut expected = vec![0u8; node.block];
    let mut releases = Vec::new();
    for ((page, shard, _), (_, entry)) in keys
        .iter()
        .zip(result.map(|r| r.entries).unwrap_or_default())
    {
        let Some(release) = entry.release.filter(|_| entry.is_success()) else {
            failed += 1;
            continue;
        };
        releases.push(release);
        fill(&mut expected, *page, *shard, seed);
        match node.runner.read_claimed(release, 0) {
            Ok(bytes) if bytes == expected => ok += 1,
            _ => mismatched += 1,
        }
    }
    node.runner.release(&releases);
    answer(
        "RESTORED",
        &json!({ "keys": keys.len(), "ok": ok, "mismatched": mismatched, "failed": failed, "bytes": ok * node.block, "secs": secs }),
    );
}
