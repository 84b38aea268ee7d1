//! `cargo xtask demo`: the main job. Several rank-local runners as separate
//! processes on loopback; a source engine offloads prompts of Qwen3-0.6B KV
//! (64-token pages, 7,340,032 bytes each, stored head-split in two shards)
//! and publishes them on the vLLM/Dynamo KV-event wire; a built-in minimal
//! router learns the page hashes from those `BlockStored` events and sends
//! each destination rank a `kv.fetch` hint;
//! the destinations restore from the source's KVCR DRAM over UCX and check
//! every byte; a table shows what happened.

// `serde_json::Value` indexing returns `Null` for a missing key; it never panics.
#![allow(clippy::indexing_slicing)]

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::node::{Node, NodeSpec};

/// Qwen3-0.6B: 28 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes = 114,688 B/token.
const BYTES_PER_TOKEN: u64 = 114_688;
const PAGE_TOKENS: u64 = 64;
const SHARDS: u64 = 2;

pub(crate) struct Options {
    pub(crate) pages: u64,
    pub(crate) prompts: u64,
    pub(crate) tls: Option<String>,
    pub(crate) seed: u64,
}

fn parse(rest: &[String]) -> Result<Options> {
    let mut o = Options {
        pages: 64,
        prompts: 4,
        tls: None,
        seed: 7,
    };
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--pages" => o.pages = value.parse()?,
            "--prompts" => o.prompts = value.parse()?,
            "--tls" => o.tls = Some(value.clone()),
            "--seed" => o.seed = value.parse()?,
            other => bail!("unknown demo option {other} (use --pages, --prompts, --tls, --seed)"),
        }
    }
    if o.prompts == 0 || o.pages < o.prompts {
        bail!("need at least one page per prompt");
    }
    Ok(o)
}

/// Reads `BlockStored` events off the KV-event stream until `pages` distinct
/// hashes are seen (or the stream goes quiet), in first-seen order.
fn stored_hashes(subscriber: &zmq::Socket, pages: usize) -> Vec<u64> {
    let mut seen = Vec::new();
    while seen.len() < pages {
        let Ok(frames) = subscriber.recv_multipart(0) else {
            break; // quiet for the receive timeout
        };
        let Some(payload) = frames.get(2) else {
            continue;
        };
        let Ok(batch) = rmpv::decode::read_value(&mut payload.as_slice()) else {
            continue;
        };
        let events = batch
            .as_array()
            .and_then(|b| b.get(1))
            .and_then(rmpv::Value::as_array);
        for event in events.into_iter().flatten() {
            let Some(map) = event.as_map() else { continue };
            let field = |name: &str| {
                map.iter()
                    .find(|(k, _)| k.as_str() == Some(name))
                    .map(|(_, v)| v)
            };
            if field("type").and_then(rmpv::Value::as_str) != Some("BlockStored") {
                continue;
            }
            for hash in field("block_hashes")
                .and_then(rmpv::Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(h) = hash.as_u64().filter(|h| !seen.contains(h)) {
                    seen.push(h);
                }
            }
        }
    }
    seen
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values
        .get(((values.len().saturating_sub(1)) as f64 * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

/// What one destination process restored over the whole demo.
#[derive(Debug, Clone, Default)]
pub(crate) struct DestRow {
    pub(crate) name: String,
    /// Head shards the process holds (its slice of the KV heads).
    pub(crate) shards: u64,
    pub(crate) keys: u64,
    pub(crate) ok: u64,
    pub(crate) mismatched: u64,
    pub(crate) failed: u64,
    pub(crate) bytes: u64,
    /// Per-request latency, in milliseconds.
    pub(crate) latencies_ms: Vec<f64>,
}

impl DestRow {
    /// Every key restored and every byte equal.
    pub(crate) fn byte_exact(&self) -> bool {
        self.mismatched == 0 && self.failed == 0 && self.ok == self.keys
    }

    pub(crate) fn gbps(&self) -> f64 {
        let secs: f64 = self.latencies_ms.iter().sum::<f64>() / 1e3;
        if secs > 0.0 {
            self.bytes as f64 / secs / 1e9
        } else {
            0.0
        }
    }
}

/// What the demo workload came to.
#[derive(Debug, Clone, Default)]
pub(crate) struct DemoOutcome {
    pub(crate) rows: Vec<DestRow>,
    /// Whether the router learned every page hash from the KV-event stream.
    pub(crate) learned_from_events: bool,
    /// Keys the source offloaded.
    pub(crate) offloaded_keys: u64,
}

pub(crate) fn run(root: &Path, rest: &[String]) -> Result<()> {
    let o = parse(rest)?;
    crate::setup::ensure_system_packages()?;
    eprintln!("demo: building the runner node (release)…");
    let binary = crate::node::build(root, true)?;
    let outcome = play(&binary, &o)?;
    println!();
    println!(
        "| process | keys restored | tokens | bytes | GB/s | request p50 ms | request p99 ms | byte check |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for row in &outcome.rows {
        let tokens = row.ok / row.shards.max(1) * PAGE_TOKENS;
        let check = if row.byte_exact() {
            "all bytes equal".to_owned()
        } else {
            format!("{} mismatched, {} failed", row.mismatched, row.failed)
        };
        let mut lat = row.latencies_ms.clone();
        println!(
            "| {} | {}/{} | {tokens} | {} | {:.2} | {:.2} | {:.2} | {check} |",
            row.name,
            row.ok,
            row.keys,
            row.bytes,
            row.gbps(),
            percentile(&mut lat, 0.5),
            percentile(&mut lat, 0.99)
        );
    }
    if !outcome.rows.iter().all(DestRow::byte_exact) {
        bail!("some pages were not restored byte-exact");
    }
    println!("\ndemo: every restored byte equals the offloaded byte.");
    Ok(())
}

/// The demo workload on an already built node binary: starts the four
/// processes, offloads, routes, restores, and reports per destination.
pub(crate) fn play(binary: &Path, o: &Options) -> Result<DemoOutcome> {
    let page_bytes = PAGE_TOKENS * BYTES_PER_TOKEN;
    let shard_bytes = page_bytes / SHARDS;
    let spec = |blocks: u64, publish: bool| NodeSpec {
        tls: o.tls.clone(),
        publish,
        ..NodeSpec::new(blocks, shard_bytes)
    };
    eprintln!(
        "demo: Qwen3-0.6B KV, {} prompts, {} pages of {} tokens ({} bytes each, head-split in 2 shards)",
        o.prompts, o.pages, PAGE_TOKENS, page_bytes
    );
    eprintln!(
        "demo: starting 4 runner processes on loopback (source TP=1, destination A TP=1, destination B TP=2)…"
    );
    let mut source = Node::spawn(binary, "source", &spec(o.pages * SHARDS, true))?;
    let mut dests = vec![
        (
            Node::spawn(binary, "dest-A tp0/1", &spec(o.pages * SHARDS, false))?,
            vec![0u64, 1],
        ),
        (
            Node::spawn(binary, "dest-B tp0/2", &spec(o.pages, false))?,
            vec![0u64],
        ),
        (
            Node::spawn(binary, "dest-B tp1/2", &spec(o.pages, false))?,
            vec![1u64],
        ),
    ];
    // The router subscribes to the source's KV events (vLLM/Dynamo wire)
    // before the offload, and learns from them which pages the source holds.
    let events = source
        .events
        .clone()
        .context("the source publishes no KV events")?;
    let zmq_ctx = zmq::Context::new();
    let subscriber = zmq_ctx.socket(zmq::SUB)?;
    subscriber.set_subscribe(b"")?;
    subscriber.set_rcvtimeo(2000)?;
    subscriber.connect(&events)?;
    // A subscription takes effect asynchronously (ZMQ's slow joiner); give it
    // a moment before anything is published.
    std::thread::sleep(std::time::Duration::from_millis(300));
    source.send(&json!({"cmd": "offload", "pages": o.pages, "page_bytes": page_bytes, "shards": SHARDS, "seed": o.seed}))?;
    let offloaded = source.read("OFFLOADED")?;
    let offloaded_hashes: Vec<u64> = offloaded["hashes"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let learned = stored_hashes(&subscriber, offloaded_hashes.len());
    let learned_from_events = learned == offloaded_hashes;
    let hashes = if learned_from_events {
        eprintln!(
            "demo: the router learned all {} page hashes from the source's BlockStored events",
            learned.len()
        );
        learned
    } else {
        eprintln!(
            "demo: the router saw {} of {} page hashes on the KV-event stream; using the source's own list",
            learned.len(),
            offloaded_hashes.len()
        );
        offloaded_hashes
    };
    eprintln!(
        "demo: source offloaded {} keys ({:.0} MiB) in {:.2} s into KVCR DRAM at {}",
        offloaded["keys"],
        offloaded["bytes"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64,
        offloaded["secs"].as_f64().unwrap_or(0.0),
        source.endpoint
    );
    // The minimal router: one prompt per request, hinting each destination
    // rank at the source that holds the prompt's pages (the shard a rank
    // needs is its own head slice).
    let per_prompt = o.pages / o.prompts;
    let mut rows: Vec<DestRow> = dests
        .iter()
        .map(|(dest, shards)| DestRow {
            name: dest.name.clone(),
            shards: shards.len() as u64,
            ..DestRow::default()
        })
        .collect();
    for prompt in 0..o.prompts {
        let first = prompt * per_prompt;
        let range = first as usize..(first + per_prompt) as usize;
        for (i, (dest, shards)) in dests.iter_mut().enumerate() {
            dest.send(&json!({
                "cmd": "restore", "request": format!("prompt-{prompt}-{i}"), "source": source.endpoint,
                "hashes": hashes.get(range.clone()).unwrap_or_default(), "first_page": first,
                "shards": shards, "page_bytes": page_bytes, "seed": o.seed,
            }))?;
        }
        for (i, (dest, _)) in dests.iter_mut().enumerate() {
            let r = dest.read("RESTORED")?;
            let Some(row) = rows.get_mut(i) else { continue };
            row.ok += r["ok"].as_u64().unwrap_or(0);
            row.latencies_ms
                .push(r["secs"].as_f64().unwrap_or(0.0) * 1e3);
            row.bytes += r["bytes"].as_u64().unwrap_or(0);
            row.mismatched += r["mismatched"].as_u64().unwrap_or(0);
            row.failed += r["failed"].as_u64().unwrap_or(0);
            row.keys += r["keys"].as_u64().unwrap_or(0);
        }
        eprint!("\rdemo: restored prompt {}/{}", prompt + 1, o.prompts);
    }
    eprintln!();
    drop(dests);
    drop(source);
    Ok(DemoOutcome {
        rows,
        learned_from_events,
        offloaded_keys: offloaded["keys"].as_u64().unwrap_or(0),
    })
}
