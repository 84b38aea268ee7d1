//! The built-in scenarios. Each drives node processes, injects its fault
//! from outside, and records the invariant checks in an [`Outcome`]. This
//! file holds what they share (node commands, checks); the scenarios live in
//! `demo`, `faults`, `restart` and `load`.

// `serde_json::Value` indexing returns `Null` for a missing key; it never panics.
#![allow(clippy::indexing_slicing)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

use super::events::EventTap;
use super::{Ctx, Outcome};
use crate::node::{Node, NodeSpec};

mod demo;
mod faults;
mod load;
mod restart;

pub(super) use demo::{demo, demo_g3, demo_tcp};
pub(super) use faults::{source_sigkill, source_sigstop, warm_then_fault};
pub(super) use load::{concurrent_requests, no_evict_capacity};
pub(super) use restart::{source_restart, subscriber_gone};

/// UCX over TCP: the network transport, with UCX's peer failure handling.
pub(super) const TCP: &str = "tcp,self";
/// Large pages for the mid-transfer faults, so a write is in flight long
/// enough to be hit.
pub(super) const BIG_BLOCK: u64 = 4 << 20;
/// Operation deadline and abandonment budget of fault-scenario destinations:
/// generous on a loaded machine; they bound how long a fault takes, and no
/// check depends on them.
pub(super) const OP_TIMEOUT_MS: u64 = 3_000;
pub(super) const ABANDON_MS: u64 = 6_000;
/// The longest a scenario polls a node for something to happen (a notice,
/// a write in flight) before it reports that it did not.
const POLL_BOUND: Duration = Duration::from_secs(120);
/// How many times a mid-transfer fault is tried when the signal lands after
/// the write already finished (the scenario's premise, not its invariant).
pub(super) const FAULT_ATTEMPTS: usize = 5;

pub(super) fn num(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or(0)
}

pub(super) fn status(v: &Value, name: &str) -> u64 {
    v["statuses"][name].as_u64().unwrap_or(0)
}

pub(super) fn hashes(offloaded: &Value) -> Vec<u64> {
    offloaded["hashes"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

pub(super) fn ops(stats: &Value, key: &str) -> Vec<u64> {
    stats[key]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// `tcp://host:port` of `tcp://host:port[?key=…]`: a process restarted
/// there without a key of the operator's is a new member (a new key).
fn address_of(endpoint: &str) -> &str {
    endpoint
        .split_once('?')
        .map_or(endpoint, |(address, _)| address)
}

/// The port of `tcp://host:port[?key=…]`.
fn port_of(endpoint: &str) -> Result<u16> {
    address_of(endpoint)
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in {endpoint}"))
}

/// The lines a child writes, on a channel (read on their own thread).
fn lines_of(out: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Polls a node's stats until `ready` says so; `None` after [`POLL_BOUND`].
pub(super) fn poll_stats(
    node: &mut Node,
    mut ready: impl FnMut(&Value) -> bool,
) -> Result<Option<Value>> {
    let start = Instant::now();
    while start.elapsed() < POLL_BOUND {
        let stats = node.stats()?;
        if ready(&stats) {
            return Ok(Some(stats));
        }
        // Notices and counters have no event to wait on.
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(None)
}

pub(super) fn offload(
    node: &mut Node,
    pages: u64,
    shards: u64,
    seed: u64,
    hash_seed: u64,
) -> Result<Value> {
    node.call(
        &json!({"cmd": "offload", "pages": pages, "shards": shards, "seed": seed, "hash_seed": hash_seed}),
        "OFFLOADED",
    )
}

pub(super) fn restore_cmd(
    source: &str,
    request: &str,
    hashes: &[u64],
    first: u64,
    seed: u64,
) -> Value {
    json!({
        "cmd": "restore", "request": request, "source": source,
        "hashes": hashes, "first_page": first, "shards": [0], "seed": seed,
    })
}

/// A node command checking pages `first..` named by `hashes` (shard 0)
/// against the bytes seeded with `seed`.
pub(super) fn verify_cmd(hashes: &[u64], first: u64, seed: u64) -> Value {
    json!({
        "cmd": "verify", "hashes": hashes, "first_page": first, "shards": [0], "seed": seed,
    })
}

/// The core's own invariant check, as the node reports it.
pub(super) fn core_invariants(o: &mut Outcome, node: &mut Node) -> Result<()> {
    let stats = node.stats()?;
    o.check(
        &format!("{}: core invariants hold", node.name),
        stats["invariants"].is_null(),
        stats["invariants"].as_str().unwrap_or("ok"),
    );
    Ok(())
}

/// Restored or verified answer checks shared by every scenario.
pub(super) fn no_corruption(o: &mut Outcome, what: &str, answer: &Value) {
    o.equal(
        &format!("{what}: no corrupted byte delivered"),
        num(answer, "mismatched"),
        0,
    );
    o.check(
        &format!("{what}: every caller completed"),
        answer["completed"].as_bool() == Some(true)
            || num(answer, "completed") == num(answer, "requests").max(1),
        answer["statuses"].to_string(),
    );
}

/// Which resident pages a node's stream must show.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Advertised {
    /// Every resident page was deposited by the node itself (with its tokens):
    /// the stream shows exactly what the runner holds.
    All,
    /// Some resident pages came from a peer: a remote fill carries no token
    /// ids, which a `BlockStored` event needs, so those pages are held but
    /// not advertised (the stream may show fewer, never more).
    DepositedOnly,
}

/// Waits until the node's publisher is idle (the same counts in two samples
/// and no operation in flight) and the tap has every batch, then checks the
/// stream against the publisher's ledger (one removed per stored) and
/// against what the runner holds.
fn balanced(o: &mut Outcome, tap: &EventTap, node: &mut Node, shown: Advertised) -> Result<()> {
    let mut last = None;
    let stats = poll_stats(node, |s| {
        let now = (
            s["publisher"]["batches"].as_u64(),
            s["publisher"]["stored_blocks"].as_u64(),
            s["publisher"]["removed_blocks"].as_u64(),
        );
        let idle = num(s, "ops_in_flight") == 0 && last == Some(now);
        last = Some(now);
        if !idle {
            // Let the publisher's driver take a round.
            std::thread::sleep(Duration::from_millis(200));
        }
        idle
    })?
    .context("the publisher never went idle")?;
    let publisher = &stats["publisher"];
    let tally = tap.settle(num(publisher, "batches"))?;
    let ready = i64::try_from(num(&stats, "ready")).unwrap_or(i64::MAX);
    let name = node.name.clone();
    o.equal(
        &format!("{name}: the stream carries every stored and removed block"),
        (tally.stored, tally.removed),
        (
            num(publisher, "stored_blocks"),
            num(publisher, "removed_blocks"),
        ),
    );
    o.equal(
        &format!("{name}: every removed matches a stored (no removal of an unknown block)"),
        num(publisher, "removed_unknown"),
        0,
    );
    match shown {
        Advertised::All => {
            o.equal(
                &format!("{name}: stored - removed on the stream = pages the runner holds"),
                tally.live,
                ready,
            );
        }
        Advertised::DepositedOnly => {
            o.check(
                &format!("{name}: stored - removed on the stream <= pages the runner holds"),
                tally.live <= ready,
                format!("{} shown, {ready} held", tally.live),
            );
        }
    }
    o.number("events stored", tally.stored);
    o.number("removed", tally.removed);
    o.number("shown/held", format!("{}/{ready}", tally.live));
    o.number("stores without tokens", num(publisher, "stored_rejected"));
    o.number("batches", tally.batches);
    o.number("repaired by replay", tally.repaired);
    Ok(())
}

/// A node that publishes with replay, and a live tap on it.
fn publishing(ctx: &Ctx, name: &str, spec: NodeSpec) -> Result<(Node, EventTap)> {
    let spec = NodeSpec {
        publish: true,
        replay: true,
        ..spec
    };
    let node = Node::spawn(&ctx.binary, name, &spec)?;
    let events = node.events.clone().context("the node publishes nothing")?;
    let tap = EventTap::connect(&events, node.replay.as_deref())?;
    Ok((node, tap))
}
