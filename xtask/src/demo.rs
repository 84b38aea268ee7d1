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

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Qwen3-0.6B: 28 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes = 114,688 B/token.
const BYTES_PER_TOKEN: u64 = 114_688;
const PAGE_TOKENS: u64 = 64;
const SHARDS: u64 = 2;

struct Proc {
    name: String,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    endpoint: String,
    events: Option<String>,
}

impl Proc {
    fn spawn(
        binary: &Path,
        name: &str,
        blocks: u64,
        block_bytes: u64,
        tls: Option<&str>,
        publish: bool,
    ) -> Result<Self> {
        let mut cmd = Command::new(binary);
        if publish {
            cmd.arg("--publish");
        }
        cmd.args([
            "--blocks",
            &blocks.to_string(),
            "--block-bytes",
            &block_bytes.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        if let Some(tls) = tls {
            cmd.args(["--tls", tls]);
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("stdout")?);
        let mut proc = Self {
            name: name.to_owned(),
            child,
            stdin,
            stdout,
            endpoint: String::new(),
            events: None,
        };
        let ready = proc.read("READY")?;
        proc.endpoint = ready["endpoint"].as_str().unwrap_or_default().to_owned();
        proc.events = ready["events"].as_str().map(str::to_owned);
        Ok(proc)
    }

    fn send(&mut self, value: &Value) -> Result<()> {
        writeln!(self.stdin, "{value}")?;
        self.stdin.flush()?;
        Ok(())
    }

    fn read(&mut self, word: &str) -> Result<Value> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("{} exited before answering {word}", self.name);
        }
        let (got, body) = line
            .trim_end()
            .split_once(' ')
            .unwrap_or((line.trim_end(), "{}"));
        if got != word {
            bail!("{}: expected {word}, got {line}", self.name);
        }
        Ok(serde_json::from_str(body)?)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.send(&json!({"cmd": "exit"}));
        let _ = self.child.wait();
    }
}

struct Options {
    pages: u64,
    prompts: u64,
    tls: Option<String>,
    seed: u64,
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

pub(crate) fn run(root: &Path, rest: &[String]) -> Result<()> {
    let o = parse(rest)?;
    crate::setup::ensure_system_packages()?;
    eprintln!("demo: building the runner node (release)…");
    crate::run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(root)
            .args([
                "build",
                "--release",
                "--locked",
                "--quiet",
                "-p",
                "kvcr-foundation",
                "--example",
                "node",
            ]),
    )?;
    let binary = root.join("target/release/examples/node");
    let page_bytes = PAGE_TOKENS * BYTES_PER_TOKEN;
    let shard_bytes = page_bytes / SHARDS;
    let tls = o.tls.as_deref();
    eprintln!(
        "demo: Qwen3-0.6B KV, {} prompts, {} pages of {} tokens ({} bytes each, head-split in 2 shards)",
        o.prompts, o.pages, PAGE_TOKENS, page_bytes
    );
    eprintln!(
        "demo: starting 4 runner processes on loopback (source TP=1, destination A TP=1, destination B TP=2)…"
    );
    let mut source = Proc::spawn(&binary, "source", o.pages * SHARDS, shard_bytes, tls, true)?;
    let mut dests = vec![
        (
            Proc::spawn(
                &binary,
                "dest-A tp0/1",
                o.pages * SHARDS,
                shard_bytes,
                tls,
                false,
            )?,
            vec![0u64, 1],
        ),
        (
            Proc::spawn(&binary, "dest-B tp0/2", o.pages, shard_bytes, tls, false)?,
            vec![0u64],
        ),
        (
            Proc::spawn(&binary, "dest-B tp1/2", o.pages, shard_bytes, tls, false)?,
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
    let hashes = if learned == offloaded_hashes {
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
    let mut stats: Vec<(usize, Vec<f64>, u64, u64, u64, u64)> =
        vec![(0, Vec::new(), 0, 0, 0, 0); dests.len()];
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
            let s = &mut stats[i];
            s.0 += r["ok"].as_u64().unwrap_or(0) as usize;
            s.1.push(r["secs"].as_f64().unwrap_or(0.0) * 1e3);
            s.2 += r["bytes"].as_u64().unwrap_or(0);
            s.3 += r["mismatched"].as_u64().unwrap_or(0);
            s.4 += r["failed"].as_u64().unwrap_or(0);
            s.5 += r["keys"].as_u64().unwrap_or(0);
        }
        eprint!("\rdemo: restored prompt {}/{}", prompt + 1, o.prompts);
    }
    eprintln!();
    println!();
    println!(
        "| process | keys restored | tokens | bytes | GB/s | request p50 ms | request p99 ms | byte check |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut all_ok = true;
    for ((dest, shards), (ok, mut lat, bytes, mismatched, failed, keys)) in dests.iter().zip(stats)
    {
        let secs: f64 = lat.iter().sum::<f64>() / 1e3;
        let tokens = ok as u64 / shards.len() as u64 * PAGE_TOKENS;
        let gbps = if secs > 0.0 {
            bytes as f64 / secs / 1e9
        } else {
            0.0
        };
        let check = if mismatched == 0 && failed == 0 && ok as u64 == keys {
            "all bytes equal".to_owned()
        } else {
            format!("{mismatched} mismatched, {failed} failed")
        };
        all_ok &= mismatched == 0 && failed == 0 && ok as u64 == keys;
        println!(
            "| {} | {ok}/{keys} | {tokens} | {bytes} | {gbps:.2} | {:.2} | {:.2} | {check} |",
            dest.name,
            percentile(&mut lat, 0.5),
            percentile(&mut lat, 0.99)
        );
    }
    drop(dests);
    drop(source);
    if !all_ok {
        bail!("some pages were not restored byte-exact");
    }
    println!("\ndemo: every restored byte equals the offloaded byte.");
    Ok(())
}
