//! `cargo xtask demo`: the main job. Several rank-local runners as separate
//! processes on loopback; a source engine offloads prompts of Qwen3-0.6B KV
//! (64-token pages, 7,340,032 bytes each, stored head-split in two shards)
//! and publishes them on the vLLM/Dynamo KV-event wire; a built-in minimal
//! router learns the page hashes from those `BlockStored` events and sends
//! each destination rank a `kv.fetch` hint (with `--router dynamo`, Dynamo's
//! standalone KV indexer is the inventory authority instead);
//! the destinations restore from the source's KVCR DRAM over UCX and check
//! every byte; a table shows what happened.

// `serde_json::Value` indexing returns `Null` for a missing key; it never panics.
#![allow(clippy::indexing_slicing)]

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use kvcr_publisher::decode::{EventKind, decode_batch};

use crate::node::{Node, NodeSpec, Ownership};

/// Qwen3-0.6B: 28 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes = 114,688 B/token.
const BYTES_PER_TOKEN: u64 = 114_688;
const PAGE_TOKENS: u64 = 64;
const SHARDS: u64 = 2;

/// The inventory authority the hints are built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RouterKind {
    /// The demo's own minimal router, learning from `BlockStored` events.
    BuiltIn,
    /// Dynamo's standalone KV indexer (`python -m dynamo.indexer`).
    Dynamo,
}

pub(crate) struct Options {
    pub(crate) pages: u64,
    pub(crate) prompts: u64,
    pub(crate) tls: Option<String>,
    pub(crate) seed: u64,
    pub(crate) router: RouterKind,
    /// A G3 file tier under the source's KVCR DRAM (`--g3 DIR`): the source's
    /// pool then holds half the pages, the rest move to files in `DIR` and
    /// are served from there (filled back into DRAM for each peer write).
    pub(crate) g3: Option<std::path::PathBuf>,
}

fn parse(rest: &[String]) -> Result<Options> {
    let mut o = Options {
        pages: 64,
        prompts: 4,
        tls: None,
        seed: 7,
        router: RouterKind::BuiltIn,
        g3: None,
    };
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--pages" => o.pages = value.parse()?,
            "--prompts" => o.prompts = value.parse()?,
            "--tls" => o.tls = Some(value.clone()),
            "--seed" => o.seed = value.parse()?,
            "--g3" => o.g3 = Some(value.into()),
            "--router" => {
                o.router = match value.as_str() {
                    "builtin" => RouterKind::BuiltIn,
                    "dynamo" => RouterKind::Dynamo,
                    other => bail!("unknown router {other:?} (use builtin or dynamo)"),
                }
            }
            other => bail!(
                "unknown demo option {other} (use --pages, --prompts, --tls, --seed, --router, --g3)"
            ),
        }
    }
    if o.prompts == 0 || o.pages < o.prompts {
        bail!("need at least one page per prompt");
    }
    if o.g3.is_some() && o.pages < 2 * (o.pages / o.prompts) {
        // The source's DRAM holds half the pages and serves a prompt's pages
        // from DRAM together (filled from G3): a prompt must fit in it.
        bail!("with --g3 a prompt's pages must fit in half the pages (use more prompts)");
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
        let Ok(events) = decode_batch(payload) else {
            continue;
        };
        for event in events.into_iter().filter(|e| e.kind == EventKind::Stored) {
            for h in event.block_hashes {
                if !seen.contains(&h) {
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

/// Set in the demo re-executed inside its own network namespace.
const IN_NETNS: &str = "KVCR_DEMO_IN_NETNS";
/// The indexer's HTTP port, inside the demo's private network namespace.
const INDEXER_PORT: u16 = 18_090;
const MODEL: &str = "qwen3-0.6b";

/// Dynamo's standalone KV indexer as a child process (killed on drop, by its
/// own handle).
struct Indexer {
    child: Child,
    log: std::path::PathBuf,
}

impl Indexer {
    fn start(root: &Path) -> Result<Self> {
        let python = root.join("target/realclients/venv/bin/python");
        let dir = root.join("target/demo");
        std::fs::create_dir_all(&dir)?;
        let log = dir.join("dynamo-indexer.log");
        let out = std::fs::File::create(&log)?;
        let child = Command::new(&python)
            .args(["-m", "dynamo.indexer", "--block-size"])
            .arg(PAGE_TOKENS.to_string())
            .args(["--port", &INDEXER_PORT.to_string(), "--threads", "1"])
            .env("RUST_LOG", "info")
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {} -m dynamo.indexer", python.display()))?;
        let indexer = Self { child, log };
        let started = std::time::Instant::now();
        while !http("GET", "/health", &Value::Null).is_ok_and(|r| r.0 == 200) {
            if started.elapsed() > std::time::Duration::from_secs(60) {
                bail!(
                    "Dynamo's indexer did not answer /health in 60 s\n{}",
                    indexer.log_tail()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        Ok(indexer)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines
            .get(lines.len().saturating_sub(20)..)
            .unwrap_or_default()
            .join("\n")
    }

    /// Registers a publishing runner as a worker (instance id = its pid).
    fn register(&self, node: &Node) -> Result<()> {
        let body = json!({
            "instance_id": node.pid,
            "endpoint": node.events.as_deref().context("the runner publishes no events")?,
            "replay_endpoint": node.replay,
            "model_name": MODEL,
            "block_size": PAGE_TOKENS,
            "dp_rank": 0,
        });
        let (status, answer) = http("POST", "/register", &body)?;
        if !(200..300).contains(&status) {
            bail!("indexer /register: {status} {answer}");
        }
        Ok(())
    }

    /// `/query` for a token sequence: the `instances` map (worker id →
    /// `longest_matched` tokens and per-tier counts).
    fn query(&self, tokens: &[u32]) -> Result<serde_json::Map<String, Value>> {
        let (status, answer) = http(
            "POST",
            "/query",
            &json!({"token_ids": tokens, "model_name": MODEL}),
        )?;
        if status != 200 {
            bail!("indexer /query: {status} {answer}");
        }
        Ok(answer["instances"].as_object().cloned().unwrap_or_default())
    }
}

impl Drop for Indexer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request to the indexer on 127.0.0.1; returns the status and
/// the JSON body (a string value when it is not JSON).
fn http(method: &str, path: &str, body: &Value) -> std::io::Result<(u16, Value)> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", INDEXER_PORT))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let body = if method == "GET" {
        String::new()
    } else {
        body.to_string()
    };
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    let json = serde_json::from_str(&body).unwrap_or(Value::String(body));
    Ok((status, json))
}

/// Joins the chunks of a chunked HTTP body.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((len, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        let Some(chunk) = after.get(..n).filter(|_| n > 0) else {
            break;
        };
        out.push_str(chunk);
        rest = after
            .get(n..)
            .unwrap_or_default()
            .trim_start_matches("\r\n");
    }
    out
}

/// The tokens of pages `0..pages` (the node's synthetic prompt: page `p`
/// holds tokens `64p .. 64p + 63`).
fn prefix_tokens(pages: u64) -> Vec<u32> {
    (0..pages * PAGE_TOKENS)
        .map(|t| u32::try_from(t).unwrap_or(u32::MAX))
        .collect()
}

/// The worker with the longest matched prefix in a `/query` answer, and that
/// length in pages.
fn best_instance(instances: &serde_json::Map<String, Value>) -> Option<(u64, u64)> {
    instances
        .iter()
        .filter_map(|(id, v)| Some((id.parse().ok()?, v["longest_matched"].as_u64()?)))
        .max_by_key(|(_, tokens)| *tokens)
        .map(|(id, tokens)| (id, tokens / PAGE_TOKENS))
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
    /// How the keys ended, by status name, summed over the requests.
    pub(crate) statuses: std::collections::BTreeMap<String, u64>,
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
    /// Whether the router learned every page hash from the KV-event stream
    /// (the built-in router; with Dynamo's indexer, the hashes are the
    /// source's own and this is false).
    pub(crate) learned_from_events: bool,
    /// Keys the source offloaded.
    pub(crate) offloaded_keys: u64,
    /// Pages of the prompts that the router's answers left unhinted.
    pub(crate) unhinted_pages: u64,
    /// The source's G3 counters at the end, with `--g3`.
    pub(crate) g3: Option<G3Counts>,
    /// The source's mailbox counters at the end.
    pub(crate) mailbox: MailboxCounts,
}

pub(crate) fn run(root: &Path, rest: &[String]) -> Result<()> {
    let o = parse(rest)?;
    let binary = if std::env::var_os(IN_NETNS).is_none() {
        crate::setup::ensure_system_packages()?;
        eprintln!("demo: building the runner node (release)…");
        let binary = crate::node::build(root, true)?;
        if o.router == RouterKind::Dynamo {
            crate::setup::ensure_real_clients(root)?;
            // The indexer's HTTP server binds every interface and has no host
            // flag: run the whole demo where only loopback exists.
            eprintln!("demo: entering a new network namespace that holds only loopback…");
            return crate::run(
                Command::new("unshare")
                    .args([
                        "--net",
                        "--",
                        "sh",
                        "-c",
                        "ip link set lo up && exec \"$@\"",
                        "sh",
                    ])
                    .arg(std::env::current_exe()?)
                    .arg("demo")
                    .args(rest)
                    .env(IN_NETNS, "1"),
            )
            .context("the Dynamo demo needs root (or CAP_SYS_ADMIN) for its network namespace");
        }
        binary
    } else {
        // Re-executed inside the namespace: the outer run built the node.
        crate::node::example_path(root, true, "node")
    };
    let outcome = play(&binary, &o)?;
    println!();
    println!(
        "router: {}",
        match o.router {
            RouterKind::Dynamo =>
                "Dynamo's standalone KV indexer (ai-dynamo-runtime 1.6.1): hints built from its /query answers",
            RouterKind::BuiltIn =>
                "the demo's built-in router, learning from the source's BlockStored events",
        }
    );
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
    if let Some(g3) = &outcome.g3 {
        println!(
            "\nG3: {} keys moved from the source's KVCR DRAM to files, {} filled back to serve peers ({} failed)",
            g3.spills, g3.fills, g3.fills_failed
        );
    }
    if outcome.unhinted_pages > 0 {
        bail!(
            "the router's answers left {} of {} pages unhinted",
            outcome.unhinted_pages,
            o.pages
        );
    }
    if !outcome.rows.iter().all(DestRow::byte_exact) {
        bail!("some pages were not restored byte-exact");
    }
    println!("\ndemo: every restored byte equals the offloaded byte.");
    Ok(())
}

/// The demo workload on an already built node binary: starts the four
/// processes (and, with `RouterKind::Dynamo`, Dynamo's indexer, which binds
/// every interface: the caller runs this inside a loopback-only network
/// namespace), offloads, routes, restores, and reports per destination.
pub(crate) fn play(binary: &Path, o: &Options) -> Result<DemoOutcome> {
    let page_bytes = PAGE_TOKENS * BYTES_PER_TOKEN;
    let shard_bytes = page_bytes / SHARDS;
    let dynamo = o.router == RouterKind::Dynamo;
    let spec = |blocks: u64| NodeSpec {
        tls: o.tls.clone(),
        ..NodeSpec::new(blocks, shard_bytes)
    };
    eprintln!(
        "demo: Qwen3-0.6B KV, {} prompts, {} pages of {} tokens ({} bytes each, head-split in 2 shards)",
        o.prompts, o.pages, PAGE_TOKENS, page_bytes
    );
    let indexer = if dynamo {
        eprintln!(
            "demo: starting Dynamo's standalone KV indexer (ai-dynamo-runtime 1.6.1) on 127.0.0.1:{INDEXER_PORT}…"
        );
        Some(Indexer::start(&crate::workspace_root())?)
    } else {
        None
    };
    eprintln!(
        "demo: starting 4 runner processes on loopback (source TP=1, destination A TP=1, destination B TP=2)…"
    );
    // The source publishes its inventory; for Dynamo's indexer with
    // ownership left to the stream and a replay endpoint it can repair gaps
    // from.
    let source_spec = NodeSpec {
        publish: true,
        replay: dynamo,
        ownership: if dynamo {
            Ownership::Stream
        } else {
            Ownership::Field
        },
        ..spec(o.pages * SHARDS)
    };
    let source_spec = match &o.g3 {
        // Half the keys in DRAM; two G3 files of the pool's size hold them all.
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the G3 folder {}", dir.display()))?;
            let slots = o.pages * SHARDS / 2;
            eprintln!(
                "demo: the source's KVCR DRAM holds {slots} of {} keys; a G3 file tier in {} holds the rest",
                o.pages * SHARDS,
                dir.display()
            );
            NodeSpec {
                blocks: slots,
                g3: Some((dir.clone(), slots * shard_bytes)),
                ..source_spec
            }
        }
        None => source_spec,
    };
    let mut source = Node::spawn(binary, "source", &source_spec)?;
    let mut dests = vec![
        (
            Node::spawn(binary, "dest-A tp0/1", &spec(o.pages * SHARDS))?,
            vec![0u64, 1],
        ),
        (
            Node::spawn(binary, "dest-B tp0/2", &spec(o.pages))?,
            vec![0u64],
        ),
        (
            Node::spawn(binary, "dest-B tp1/2", &spec(o.pages))?,
            vec![1u64],
        ),
    ];
    // Who holds what, by worker id: the router maps an indexer's answer back
    // to a runner's control endpoint.
    let workers = [(source.pid, source.endpoint.clone())];
    // The built-in router subscribes to the source's KV events (vLLM/Dynamo
    // wire) before the offload, and learns from them which pages the source
    // holds; Dynamo's indexer is registered with the source's PUB and replay
    // endpoints and subscribes itself.
    let events = source
        .events
        .clone()
        .context("the source publishes no KV events")?;
    let zmq_ctx = zmq::Context::new();
    let subscriber = zmq_ctx.socket(zmq::SUB)?;
    if let Some(ix) = &indexer {
        ix.register(&source)?;
        eprintln!(
            "demo: registered the source with the indexer as worker {} ({events})",
            source.pid
        );
    } else {
        subscriber.set_subscribe(b"")?;
        subscriber.set_rcvtimeo(2000)?;
        subscriber.connect(&events)?;
    }
    // A subscription takes effect asynchronously (ZMQ's slow joiner); give it
    // a moment before anything is published (the indexer also replays gaps).
    std::thread::sleep(std::time::Duration::from_millis(300));
    let offloaded = offload(&mut source, o, page_bytes)?;
    let offloaded_hashes = offloaded.hashes.clone();
    let mut learned_from_events = false;
    let hashes = if let Some(ix) = &indexer {
        // The indexer answers in tokens per worker, not in hashes: the hint's
        // page hashes are the source's own (the pages of the matched prefix).
        let all = prefix_tokens(o.pages);
        let started = std::time::Instant::now();
        loop {
            let instances = ix.query(&all)?;
            if best_instance(&instances) == Some((source.pid, o.pages)) {
                eprintln!(
                    "demo: the Dynamo indexer's /query says worker {} holds the whole {}-token prefix ({} pages): {}",
                    source.pid,
                    all.len(),
                    o.pages,
                    Value::Object(instances)
                );
                break;
            }
            if started.elapsed() > std::time::Duration::from_secs(60) {
                bail!(
                    "the indexer never reported the source's {} pages (last answer {}):\n{}",
                    o.pages,
                    Value::Object(instances),
                    ix.log_tail()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        offloaded_hashes
    } else {
        let learned = stored_hashes(&subscriber, offloaded_hashes.len());
        learned_from_events = learned == offloaded_hashes;
        if learned_from_events {
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
        }
    };
    eprintln!(
        "demo: source offloaded {} keys ({:.0} MiB) in {:.2} s into KVCR DRAM at {}",
        offloaded.keys,
        offloaded.bytes as f64 / (1u64 << 20) as f64,
        offloaded.secs,
        source.endpoint
    );
    let g3_before =
        o.g3.as_ref()
            .map(|_| G3Counts::of(&mut source))
            .transpose()?;
    if let Some(g3) = &g3_before {
        eprintln!(
            "demo: {} keys moved to G3 for room, {} still in KVCR DRAM",
            g3.spills,
            offloaded.keys.saturating_sub(g3.spills)
        );
    }
    // One prompt per request; each destination rank is hinted at the source
    // that holds the prompt's pages (the shard a rank needs is its own head
    // slice). With Dynamo, the source and the hinted pages come from the
    // indexer's `/query` answer for the prompt's whole token prefix.
    let per_prompt = o.pages / o.prompts;
    let mut unhinted_pages = 0u64;
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
        let end = first + per_prompt;
        let (endpoint, hinted_end) = match &indexer {
            Some(ix) => {
                let instances = ix.query(&prefix_tokens(end))?;
                let (worker, matched) = best_instance(&instances)
                    .with_context(|| format!("the indexer knows no worker for prompt {prompt}"))?;
                let endpoint = workers
                    .iter()
                    .find(|(pid, _)| *pid == worker)
                    .map(|(_, e)| e.clone())
                    .with_context(|| format!("the indexer names unknown worker {worker}"))?;
                eprintln!(
                    "demo: prompt {prompt}: /query over its {}-token prefix: worker {worker} matches {matched} pages; hinting pages {first}..{}",
                    end * PAGE_TOKENS,
                    matched.min(end)
                );
                (endpoint, matched.min(end))
            }
            None => (source.endpoint.clone(), end),
        };
        unhinted_pages += end - hinted_end.max(first);
        let range = first as usize..hinted_end.max(first) as usize;
        for (i, (dest, shards)) in dests.iter_mut().enumerate() {
            dest.send(&json!({
                "cmd": "restore", "request": format!("prompt-{prompt}-{i}"), "source": endpoint,
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
            for (status, n) in r["statuses"].as_object().into_iter().flatten() {
                *row.statuses.entry(status.clone()).or_default() += n.as_u64().unwrap_or(0);
            }
        }
        if dynamo {
            eprintln!("demo: restored prompt {}/{}", prompt + 1, o.prompts);
        } else {
            eprint!("\rdemo: restored prompt {}/{}", prompt + 1, o.prompts);
        }
    }
    if !dynamo {
        eprintln!();
    }
    let g3 = match g3_before {
        Some(before) => {
            let after = G3Counts::of(&mut source)?;
            eprintln!(
                "demo: the source filled {} keys back from G3 to serve the destinations ({} failed)",
                after.fills - before.fills,
                after.fills_failed
            );
            Some(after)
        }
        None => None,
    };
    let mailbox = MailboxCounts::settled(&mut source)?;
    eprintln!(
        "demo: the source took {} requests from its destinations' mailboxes \
         ({} socket copies dropped, {} records refused)",
        mailbox.taken, mailbox.copies_dropped, mailbox.refused
    );
    drop(dests);
    drop(source);
    drop(indexer);
    Ok(DemoOutcome {
        rows,
        learned_from_events,
        offloaded_keys: offloaded.keys,
        unhinted_pages,
        g3,
        mailbox,
    })
}

/// What the source's offloads stored, summed over its calls.
struct Offloaded {
    hashes: Vec<u64>,
    keys: u64,
    bytes: u64,
    secs: f64,
}

/// Offloads every page into the source. With G3 one call per prompt: a
/// call's pages sit in DRAM together until stored, so each call must fit in
/// the pool (older pages move to G3 to make room).
fn offload(source: &mut Node, o: &Options, page_bytes: u64) -> Result<Offloaded> {
    let chunk = match o.g3 {
        Some(_) => o.pages / o.prompts,
        None => o.pages,
    };
    let mut total = Offloaded {
        hashes: Vec::new(),
        keys: 0,
        bytes: 0,
        secs: 0.0,
    };
    for first in (0..o.pages).step_by(chunk.max(1) as usize) {
        let pages = chunk.min(o.pages - first);
        let answer = source.call(
            &json!({"cmd": "offload", "pages": pages, "first_page": first, "page_bytes": page_bytes, "shards": SHARDS, "seed": o.seed}),
            "OFFLOADED",
        )?;
        let stored = answer["keys"].as_u64().unwrap_or(0);
        if stored != pages * SHARDS {
            bail!(
                "the source stored {stored} of {} keys of pages {first}..{}: {}",
                pages * SHARDS,
                first + pages,
                answer["statuses"]
            );
        }
        total.hashes.extend(
            answer["hashes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64),
        );
        total.keys += stored;
        total.bytes += answer["bytes"].as_u64().unwrap_or(0);
        total.secs += answer["secs"].as_f64().unwrap_or(0.0);
    }
    Ok(total)
}

/// The source's G3 counters (node `stats`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct G3Counts {
    pub(crate) spills: u64,
    pub(crate) fills: u64,
    pub(crate) fills_failed: u64,
}

/// A source's requests taken from its destinations' mailboxes (see
/// `kvcr_foundation::runner`'s `request_mailbox`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct MailboxCounts {
    pub(crate) taken: u64,
    pub(crate) copies_dropped: u64,
    pub(crate) refused: u64,
}

impl MailboxCounts {
    fn of(node: &mut Node) -> Result<Self> {
        let stats = node.stats()?;
        let count = |key: &str| stats["mailbox"][key].as_u64().unwrap_or(0);
        Ok(Self {
            taken: count("taken"),
            copies_dropped: count("copies_dropped"),
            refused: count("refused"),
        })
    }

    /// The counters once every request taken early has had its socket copy
    /// come and be dropped (a restore can finish before its request's copy
    /// is read), or as they are after a bounded wait.
    fn settled(node: &mut Node) -> Result<Self> {
        let start = std::time::Instant::now();
        loop {
            let counts = Self::of(node)?;
            if counts.taken == counts.copies_dropped
                || start.elapsed() > std::time::Duration::from_secs(5)
            {
                return Ok(counts);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl G3Counts {
    fn of(node: &mut Node) -> Result<Self> {
        let stats = node.stats()?;
        let g3 = &stats["g3"];
        if g3.is_null() {
            bail!("the source reports no G3 tier");
        }
        let count = |key: &str| g3[key].as_u64().unwrap_or(0);
        Ok(Self {
            spills: count("spills"),
            fills: count("fills"),
            fills_failed: count("fills_failed"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_instance_takes_the_longest_match_in_pages() {
        let answer = json!({
            "11": {"longest_matched": 128, "cpu": 128},
            "22": {"longest_matched": 4096, "cpu": 4096},
            "not-a-number": {"longest_matched": 9999},
            "33": {"cpu": 64},
        });
        let instances = answer.as_object().cloned().unwrap_or_default();
        assert_eq!(best_instance(&instances), Some((22, 64)));
        assert_eq!(best_instance(&serde_json::Map::new()), None);
    }

    #[test]
    fn dechunk_joins_chunks_and_stops_at_a_bad_length() {
        assert_eq!(dechunk("4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n"), "{\"a\":1}");
        // A length past the end of the body ends the body; nothing panics.
        assert_eq!(dechunk("2\r\nok\r\nff\r\nshort"), "ok");
    }

    #[test]
    fn prefix_tokens_match_the_nodes_pages() {
        let tokens = prefix_tokens(2);
        assert_eq!(tokens.len(), 128);
        assert_eq!(tokens.first(), Some(&0));
        assert_eq!(tokens.last(), Some(&127));
    }
}
