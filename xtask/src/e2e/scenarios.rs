//! The built-in scenarios. Each drives node processes, injects its fault
//! from outside, and records the invariant checks in an [`Outcome`].

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

// ------------------------------------------------------------------ demo

/// The demo workload (the same code as `cargo xtask demo`) on the default
/// transports (shared memory).
pub(super) fn demo(ctx: &Ctx) -> Result<Outcome> {
    demo_over(ctx, None, None, ctx.size(2, 4))
}

/// The demo workload with UCX over TCP.
pub(super) fn demo_tcp(ctx: &Ctx) -> Result<Outcome> {
    demo_over(ctx, Some(TCP), None, ctx.size(2, 4))
}

/// The demo workload with half the source's pages in a G3 file tier.
pub(super) fn demo_g3(ctx: &Ctx) -> Result<Outcome> {
    let dir = crate::workspace_root().join("target/e2e/demo-g3/files");
    let _ = std::fs::remove_dir_all(&dir);
    // Prompts of a quarter of the source's DRAM each: the three
    // destinations' writes of one prompt are prepared concurrently, and a
    // prompt as large as DRAM can leave each preparation holding part of it
    // while waiting for room the others hold (the keys left are reported
    // missing, never wrong).
    let o = demo_over(ctx, None, Some(dir.clone()), ctx.size(4, 8));
    let _ = std::fs::remove_dir_all(&dir);
    o
}

fn demo_over(
    ctx: &Ctx,
    tls: Option<&str>,
    g3: Option<std::path::PathBuf>,
    prompts: u64,
) -> Result<Outcome> {
    let options = crate::demo::Options {
        pages: ctx.size(8, 64),
        prompts,
        tls: tls.map(str::to_owned),
        seed: 7,
        router: crate::demo::RouterKind::BuiltIn,
        g3,
    };
    let outcome = crate::demo::play(&ctx.binary, &options)?;
    let mut o = Outcome::default();
    let mut restored = 0;
    for row in &outcome.rows {
        o.check(
            &format!("{}: every key restored, every byte equal", row.name),
            row.byte_exact(),
            format!(
                "{}/{} ok, {} mismatched, {} failed; statuses {:?}",
                row.ok, row.keys, row.mismatched, row.failed, row.statuses
            ),
        );
        restored += row.ok;
    }
    o.equal(
        "every destination rank answered every prompt",
        outcome
            .rows
            .iter()
            .map(|r| r.latencies_ms.len() as u64)
            .collect::<Vec<_>>(),
        vec![options.prompts; outcome.rows.len()],
    );
    o.number("keys offloaded", outcome.offloaded_keys);
    o.number("keys restored", restored);
    o.number(
        "min GB/s",
        format!(
            "{:.2}",
            outcome
                .rows
                .iter()
                .map(crate::demo::DestRow::gbps)
                .fold(f64::INFINITY, f64::min)
        ),
    );
    o.number("hashes from events", outcome.learned_from_events);
    // Requests a source took from its destinations' mailboxes in shared
    // memory: each handled once (its socket copy dropped), none forged here.
    let mailbox = outcome.mailbox;
    o.check(
        "every request the source took from a mailbox had its socket copy dropped",
        mailbox.taken == mailbox.copies_dropped && mailbox.refused == 0,
        format!(
            "{} taken, {} copies dropped, {} refused",
            mailbox.taken, mailbox.copies_dropped, mailbox.refused
        ),
    );
    o.number("requests taken from mailboxes", mailbox.taken);
    if options.g3.is_some() {
        let g3 = outcome.g3.unwrap_or_default();
        o.check(
            "the source moved pages to G3 and filled them back to serve its peers",
            g3.spills > 0 && g3.fills > 0 && g3.fills_failed == 0,
            format!(
                "{} spilled, {} filled, {} fills failed",
                g3.spills, g3.fills, g3.fills_failed
            ),
        );
        o.number("G3 spills", g3.spills);
        o.number("G3 fills", g3.fills);
    }
    Ok(o)
}

// ------------------------------------------------------- mid-transfer faults

/// A source hit by a signal while it wrote a destination's request.
struct MidTransfer {
    source: Node,
    dest: Node,
    /// The destination's `RESTORED` answer for the request that was hit.
    restored: Value,
    /// Pages of the hit request: `1..=pages` (page 0 warmed the route up).
    pages: u64,
    hashes: Vec<u64>,
}

/// Warms the route from `dest` to `source` up with page 0 of `hashes`,
/// asks for pages `1..` as `request`, and calls `fault(source)` once the
/// source is writing them: a READY page claimed for a put is not evictable.
/// Polled without pause (one command round trip per sample) until that is
/// seen or the destination has its answer already. Returns the answer and
/// whether the fault landed before it.
pub(super) fn warm_then_fault(
    source: &mut Node,
    dest: &mut Node,
    hashes: &[u64],
    seed: u64,
    request: &str,
    fault: &mut dyn FnMut(&mut Node) -> Result<()>,
) -> Result<(Value, bool)> {
    let warm = dest.call(
        &restore_cmd(
            &source.endpoint,
            "warm",
            hashes.get(..1).unwrap_or_default(),
            0,
            seed,
        ),
        "RESTORED",
    )?;
    anyhow::ensure!(num(&warm, "ok") == 1, "warm-up restore failed: {warm}");
    dest.send(&restore_cmd(
        &source.endpoint,
        request,
        hashes.get(1..).unwrap_or_default(),
        1,
        seed,
    ))?;
    let start = Instant::now();
    while start.elapsed() < POLL_BOUND {
        if let Some(answer) = dest.try_read("RESTORED")? {
            return Ok((answer, false));
        }
        let stats = source.stats()?;
        if num(&stats, "evictable_slots") < num(&stats, "ready") {
            fault(source)?;
            return Ok((dest.read("RESTORED")?, true));
        }
    }
    Ok((dest.read("RESTORED")?, false))
}

/// Starts a source holding `pages + 1` big pages and a destination, warms the
/// route up with page 0, asks for pages `1..=pages`, and delivers `signal` to
/// the source once it is writing them. `None`: the write finished before the
/// signal landed (retry).
fn hit_mid_transfer(
    ctx: &Ctx,
    signal: Signal,
    attempt: usize,
    spare: u64,
) -> Result<Option<MidTransfer>> {
    let pages = ctx.size(32, 64);
    let seed = 11;
    let source_spec = NodeSpec {
        tls: Some(TCP.into()),
        ..ctx.spec(&format!("source-{attempt}"), pages + 1, BIG_BLOCK)
    };
    let mut source = Node::spawn(&ctx.binary, "source", &source_spec)?;
    let offloaded = offload(&mut source, pages + 1, 1, seed, 500)?;
    let hashes = hashes(&offloaded);
    let dest_spec = NodeSpec {
        tls: Some(TCP.into()),
        timeout_ms: Some(OP_TIMEOUT_MS),
        abandon_ms: Some(ABANDON_MS),
        ..ctx.spec(&format!("dest-{attempt}"), pages + 1 + spare, BIG_BLOCK)
    };
    let mut dest = Node::spawn(&ctx.binary, "dest", &dest_spec)?;
    let (restored, landed) = warm_then_fault(
        &mut source,
        &mut dest,
        &hashes,
        seed,
        "hit",
        &mut |source| {
            if signal == Signal::SIGKILL {
                source.kill_and_reap().map(drop)
            } else {
                source.signal(signal)
            }
        },
    )?;
    if !landed || num(&restored, "ok") == pages {
        eprintln!(
            "e2e:   the write finished before the signal landed (signalled while it served: \
             {landed}; the request got {restored}); trying again"
        );
        return Ok(None);
    }
    Ok(Some(MidTransfer {
        source,
        dest,
        restored,
        pages,
        hashes,
    }))
}

fn mid_transfer(
    ctx: &Ctx,
    o: &mut Outcome,
    signal: Signal,
    spare: u64,
) -> Result<Option<MidTransfer>> {
    for attempt in 1..=FAULT_ATTEMPTS {
        if let Some(hit) = hit_mid_transfer(ctx, signal, attempt, spare)? {
            o.number("attempts", attempt);
            o.check(
                "the signal landed mid-transfer",
                true,
                format!("attempt {attempt}"),
            );
            return Ok(Some(hit));
        }
    }
    o.check(
        "the signal landed mid-transfer",
        false,
        format!("every write finished first in {FAULT_ATTEMPTS} attempts"),
    );
    Ok(None)
}

/// What follows a hit both for SIGKILL and SIGSTOP: the callers fail by the
/// deadline with no corrupted byte, an `Uncertain` notice per write that was
/// hit comes at the abandonment deadline and the granted slots stay held;
/// then a deposit that wants every slot gets only the free and evictable
/// ones. Returns the uncertain ops and the pressure pages that landed.
fn quarantine_holds(o: &mut Outcome, hit: &mut MidTransfer) -> Result<Option<(Vec<u64>, u64)>> {
    let failed = num(&hit.restored, "failed");
    no_corruption(o, "the hit request", &hit.restored);
    o.equal(
        "every key of the hit request has a result",
        num(&hit.restored, "ok") + failed,
        hit.pages,
    );
    o.number("keys failed", failed);
    o.number(
        "caller answered after s",
        format!("{:.1}", hit.restored["secs"].as_f64().unwrap_or(0.0)),
    );
    o.number(
        "failed as",
        hit.restored["statuses"].to_string().replace('"', ""),
    );
    // The request went out in writes of `write_batch_bytes`; they land in
    // order, so the failed keys are the last writes', each uncertain.
    let per_write = match hit.dest.write_batch_bytes / BIG_BLOCK {
        0 => hit.pages,
        n => n,
    };
    let hit_writes = usize::try_from(failed.div_ceil(per_write)).unwrap_or(usize::MAX);
    let Some(stats) = poll_stats(&mut hit.dest, |s| ops(s, "uncertain").len() >= hit_writes)?
    else {
        o.check(
            "an Uncertain notice per write hit, at the abandonment deadline",
            false,
            "not all came",
        );
        return Ok(None);
    };
    let uncertain = ops(&stats, "uncertain");
    o.equal(
        "one Uncertain notice per write hit",
        uncertain.len(),
        hit_writes,
    );
    o.equal(
        "the failed keys' slots are held (quarantined)",
        num(&stats, "discarding"),
        failed,
    );
    let room = num(&stats, "free_slots") + num(&stats, "evictable_slots");
    // A deposit that wants every slot: only free and evictable ones may go.
    let pressure = hit.dest.call(
        &json!({"cmd": "offload", "pages": room + failed, "shards": 1, "seed": PRESSURE_SEED, "hash_seed": PRESSURE_HASH_SEED}),
        "OFFLOADED",
    )?;
    let landed = num(&pressure, "keys");
    o.equal(
        "a deposit wanting every slot gets the free and evictable ones, no quarantined one",
        landed,
        room,
    );
    let after = hit.dest.stats()?;
    o.equal(
        "the quarantined slots are still held after the pressure",
        num(&after, "discarding"),
        failed,
    );
    o.number("held slots", failed);
    Ok(Some((uncertain, landed)))
}

const PRESSURE_SEED: u64 = 77;
const PRESSURE_HASH_SEED: u64 = 7700;

/// Verifies the pressure pages a destination took while it held a
/// quarantine.
fn verify_pressure(hit: &mut MidTransfer, landed: u64) -> Result<Value> {
    hit.dest.call(
        &verify_cmd(
            &(0..landed)
                .map(|p| page_hash(p, PRESSURE_HASH_SEED))
                .collect::<Vec<_>>(),
            0,
            PRESSURE_SEED,
        ),
        "VERIFIED",
    )
}

/// The node example's page hash (`page_hash` in `examples/node.rs`).
fn page_hash(page: u64, seed: u64) -> u64 {
    (page + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ seed
}

pub(super) fn source_sigkill(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let Some(mut hit) = mid_transfer(ctx, &mut o, Signal::SIGKILL, 8)? else {
        return Ok(o);
    };
    let Some((_, landed)) = quarantine_holds(&mut o, &mut hit)? else {
        return Ok(o);
    };
    let verified = verify_pressure(&mut hit, landed)?;
    no_corruption(&mut o, "pages deposited while quarantined", &verified);
    // A new process at the same address, with other bytes for the same keys
    // and more keys.
    let port = port_of(&hit.source.endpoint)?;
    let fresh = ctx.size(8, 16);
    let spec = NodeSpec {
        tls: Some(TCP.into()),
        port: Some(port),
        ..ctx.spec("source-restarted", hit.pages + 1 + fresh, BIG_BLOCK)
    };
    let mut restarted = Node::spawn(&ctx.binary, "source (restarted)", &spec)?;
    o.equal(
        "restarted at the same address",
        address_of(&restarted.endpoint).to_owned(),
        address_of(&hit.source.endpoint).to_owned(),
    );
    o.check(
        "the restart is a new incarnation",
        restarted.incarnation != hit.source.incarnation,
        &restarted.incarnation,
    );
    let all = hashes(&offload(&mut restarted, hit.pages + 1 + fresh, 1, 12, 500)?);
    let held = hit.dest.call(
        &restore_cmd(
            &restarted.endpoint,
            "held",
            hit.hashes.get(1..).unwrap_or_default(),
            1,
            12,
        ),
        "RESTORED",
    )?;
    no_corruption(&mut o, "quarantined keys asked again", &held);
    // The keys whose write landed before the kill (a whole write can end
    // first) are served: still resident, or filled again from the new
    // incarnation after the pressure evicted them. Only the quarantined
    // ones are refused.
    let landed_before = num(&hit.restored, "ok");
    o.equal(
        "keys whose slots are quarantined are not re-filled while held (the rest are served)",
        num(&held, "ok"),
        landed_before,
    );

    let first_fresh = hit.pages + 1;
    let mut restored = 0;
    for attempt in 0..3 {
        let answer = hit.dest.call(
            &restore_cmd(
                &restarted.endpoint,
                &format!("fresh-{attempt}"),
                all.get(first_fresh as usize..).unwrap_or_default(),
                first_fresh,
                12,
            ),
            "RESTORED",
        )?;
        no_corruption(&mut o, "fresh keys from the new incarnation", &answer);
        restored = num(&answer, "ok");
        if restored > 0 {
            break;
        }
    }
    o.check(
        "the new incarnation's bytes land (none stale)",
        restored > 0,
        format!("{restored} of {fresh} fresh keys"),
    );
    let stats = hit.dest.stats()?;
    o.equal(
        "the old operation's slots are still held (no proof from a dead process)",
        num(&stats, "discarding"),
        num(&hit.restored, "failed"),
    );
    o.equal(
        "nothing the new incarnation says frees the old operation",
        ops(&stats, "quiesced"),
        Vec::<u64>::new(),
    );
    core_invariants(&mut o, &mut hit.dest)?;
    o.number("fresh keys restored", restored);
    Ok(o)
}

pub(super) fn source_sigstop(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let Some(mut hit) = mid_transfer(ctx, &mut o, Signal::SIGSTOP, 8)? else {
        return Ok(o);
    };
    let Some((uncertain, landed)) = quarantine_holds(&mut o, &mut hit)? else {
        return Ok(o);
    };
    hit.source.signal(Signal::SIGCONT)?;
    let quiesced = poll_stats(&mut hit.dest, |s| {
        let quiesced = ops(s, "quiesced");
        uncertain.iter().all(|op| quiesced.contains(op))
    })?;
    o.check(
        "the resumed source's proof quiesces every uncertain write",
        quiesced.is_some(),
        format!("ops {uncertain:?}"),
    );
    if let Some(stats) = quiesced {
        o.equal(
            "the slots are freed after the proof",
            num(&stats, "discarding"),
            0,
        );
    }
    let verified = verify_pressure(&mut hit, landed)?;
    no_corruption(
        &mut o,
        "pages deposited while quarantined, after the source resumed",
        &verified,
    );
    o.equal(
        "every page deposited while quarantined is intact",
        num(&verified, "ok"),
        landed,
    );
    let queried = hit.dest.call(
        &json!({"cmd": "query", "hashes": hit.hashes.get(1..).unwrap_or_default(), "shards": [0]}),
        "QUERIED",
    )?;
    o.equal(
        "a late write never commits (no hit on the failed keys)",
        status(&queried, "Hit"),
        0,
    );
    core_invariants(&mut o, &mut hit.dest)?;
    o.number("pressure pages", landed);
    Ok(o)
}

// ------------------------------------------------------------- restart

pub(super) fn source_restart(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let pages = ctx.size(16, 64);
    let block = 1 << 20;
    let half = pages / 2;
    let spec = |name: &str, port: Option<u16>| NodeSpec {
        tls: Some(TCP.into()),
        port,
        ..ctx.spec(name, pages, block)
    };
    let mut old = Node::spawn(&ctx.binary, "source", &spec("source", None))?;
    let all = hashes(&offload(&mut old, pages, 1, 31, 900)?);
    let mut dest = Node::spawn(
        &ctx.binary,
        "dest",
        &NodeSpec {
            timeout_ms: Some(OP_TIMEOUT_MS),
            abandon_ms: Some(ABANDON_MS),
            ..spec("dest", None)
        },
    )?;
    let before = dest.call(
        &restore_cmd(
            &old.endpoint,
            "before",
            all.get(..half as usize).unwrap_or_default(),
            0,
            31,
        ),
        "RESTORED",
    )?;
    no_corruption(&mut o, "restore from the first incarnation", &before);
    o.equal("the first incarnation serves", num(&before, "ok"), half);
    old.kill_and_reap()?;
    let port = port_of(&old.endpoint)?;
    let mut new = Node::spawn(
        &ctx.binary,
        "source (restarted)",
        &spec("source-restarted", Some(port)),
    )?;
    o.equal(
        "restarted at the same address",
        address_of(&new.endpoint).to_owned(),
        address_of(&old.endpoint).to_owned(),
    );
    o.check(
        "the restart is a new incarnation",
        new.incarnation != old.incarnation,
        &new.incarnation,
    );
    // The same keys, other bytes: a stale byte cannot pass the check.
    offload(&mut new, pages, 1, 32, 900)?;
    // Two requests for keys the destination never had. The destination saw
    // its connection to the dead process close, so even the first names
    // whoever answers at the address now: both are served by the new
    // incarnation, and no slot is held for the dead one.
    let quarter = half + half / 2;
    for (i, range) in [(half, quarter), (quarter, pages)].into_iter().enumerate() {
        let answer = dest.call(
            &restore_cmd(
                &new.endpoint,
                &format!("after-{i}"),
                all.get(range.0 as usize..range.1 as usize)
                    .unwrap_or_default(),
                range.0,
                32,
            ),
            "RESTORED",
        )?;
        no_corruption(
            &mut o,
            &format!("restore {} after the restart", i + 1),
            &answer,
        );
        o.equal(
            &format!(
                "request {} after the restart is served by the new incarnation with its own bytes",
                i + 1
            ),
            num(&answer, "ok"),
            range.1 - range.0,
        );
        if i == 0 {
            o.number(
                "first request after restart",
                answer["statuses"].to_string().replace('"', ""),
            );
            o.number(
                "refused by new source",
                num(&new.stats()?["peer"], "refused"),
            );
        }
    }
    let kept = dest.call(
        &verify_cmd(all.get(..half as usize).unwrap_or_default(), 0, 31),
        "VERIFIED",
    )?;
    no_corruption(&mut o, "pages restored before the restart", &kept);
    o.equal(
        "pages restored before the restart are unchanged",
        num(&kept, "ok"),
        half,
    );
    let stats = dest.stats()?;
    o.equal(
        "no slot is held for the dead incarnation",
        num(&stats, "discarding"),
        0,
    );
    core_invariants(&mut o, &mut dest)?;
    o.number("keys", pages);
    Ok(o)
}

// ------------------------------------------------------- publisher

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

pub(super) fn subscriber_gone(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let slots = 32;
    let per_round = slots / 2;
    let rounds = ctx.size(8, 32);
    let (mut node, tap) = publishing(
        ctx,
        "publisher",
        NodeSpec {
            // A small high-water mark: a stalled subscriber fills it at once.
            pub_hwm: Some(16),
            ..ctx.spec("publisher", slots, 64 << 10)
        },
    )?;
    let events = node.events.clone().context("events")?;
    let replay = node.replay.clone().context("replay")?;
    // A subscriber process that dies mid-stream with unread batches (this
    // xtask binary, re-executed), and a subscriber that stops reading.
    let mut gone = Command::new(std::env::current_exe()?)
        .args(["e2e", "--subscriber-child", &events])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the subscriber process")?;
    let gone_lines = lines_of(gone.stdout.take().context("stdout")?);
    let stalled_context = zmq::Context::new();
    let stalled = stalled_context.socket(zmq::SUB)?;
    stalled.set_subscribe(b"")?;
    stalled.set_rcvhwm(1)?;
    stalled.connect(&events)?;
    let mut gone_first = None;
    let mut completed = 0;
    for round in 0..rounds {
        let answer = offload(&mut node, per_round, 1, round, 1000 + round)?;
        if answer["completed"].as_bool() == Some(true) && num(&answer, "keys") == per_round {
            completed += 1;
        }
        if round == 1 {
            // It has its first batch (or never got one); either way it dies now.
            gone_first = gone_lines.recv_timeout(Duration::from_secs(10)).ok();
            gone.kill()?;
            gone.wait()?;
        }
        if round == 2 {
            // A replay requester that disconnects without reading its reply.
            let dealer = stalled_context.socket(zmq::DEALER)?;
            dealer.set_linger(0)?;
            dealer.connect(&replay)?;
            dealer.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)?;
        }
    }
    o.equal(
        "every deposit completed while subscribers vanished or stalled",
        completed,
        rounds,
    );
    balanced(&mut o, &tap, &mut node, Advertised::All)?;
    let stats = node.stats()?;
    o.check(
        "evictions were published (removed events exercised)",
        num(&stats, "evictions") > 0,
        format!("{} evictions", num(&stats, "evictions")),
    );
    // A router joining now rebuilds the same view from replay alone.
    let late = EventTap::connect(&events, Some(&replay))?;
    let tally = late.settle(num(&stats["publisher"], "batches"))?;
    o.equal(
        "a late subscriber rebuilds the same view from replay",
        tally.live,
        i64::try_from(num(&stats, "ready")).unwrap_or(i64::MAX),
    );
    core_invariants(&mut o, &mut node)?;
    drop(stalled);
    o.number("rounds", rounds);
    o.number(
        "killed subscriber's first batch",
        gone_first.unwrap_or_else(|| "none".into()),
    );
    o.number("queue dropped", num(&stats["publisher"], "queue_dropped"));
    Ok(o)
}

// ------------------------------------------------------- capacity

pub(super) fn no_evict_capacity(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let slots = 16;
    let block = 256 << 10;
    let (mut dest, tap) = publishing(ctx, "dest", ctx.spec("dest", slots, block))?;
    let mut source = Node::spawn(&ctx.binary, "source", &ctx.spec("source", 8, block))?;
    let remote = hashes(&offload(&mut source, 8, 1, 41, 4100)?);
    let claimed = dest.call(
        &json!({"cmd": "offload", "pages": slots, "shards": 1, "seed": 31, "hash_seed": 3100, "no_evict": true}),
        "OFFLOADED",
    )?;
    o.equal(
        "the pool fills with no_evict pages",
        num(&claimed, "keys"),
        slots,
    );
    o.equal("each holds a claim", num(&claimed, "claims"), slots);
    let more = offload(&mut dest, 8, 1, 32, 3200)?;
    o.equal(
        "a deposit into a pool of claimed pages fails CapacityExhausted",
        status(&more, "Failed(CapacityExhausted)"),
        8,
    );
    o.check(
        "... and every caller completed",
        more["completed"].as_bool() == Some(true),
        more["statuses"].to_string(),
    );
    let required = dest.call(
        &json!({"cmd": "offload", "pages": 4, "shards": 1, "seed": 33, "hash_seed": 3300, "no_evict": true}),
        "OFFLOADED",
    )?;
    o.equal(
        "a no_evict deposit is never dropped: it fails CapacityExhausted",
        status(&required, "Failed(CapacityExhausted)"),
        4,
    );
    let restored = dest.call(
        &restore_cmd(&source.endpoint, "full", &remote, 0, 41),
        "RESTORED",
    )?;
    no_corruption(&mut o, "a peer restore into the full pool", &restored);
    o.equal(
        "a peer restore into the full pool fails CapacityExhausted",
        status(&restored, "Failed(CapacityExhausted)"),
        8,
    );
    let stats = dest.stats()?;
    o.equal("nothing was evicted", num(&stats, "evictions"), 0);
    let claimed_hashes = hashes(&claimed);
    let intact = dest.call(&verify_cmd(&claimed_hashes, 0, 31), "VERIFIED")?;
    no_corruption(&mut o, "the claimed pages", &intact);
    o.equal("every claimed page is intact", num(&intact, "ok"), slots);
    let released = dest.call(&json!({"cmd": "release"}), "RELEASED")?;
    o.equal("every claim released", num(&released, "released"), slots);
    let after = offload(&mut dest, 8, 1, 32, 3200)?;
    o.equal(
        "after the release a deposit lands by evicting",
        num(&after, "keys"),
        8,
    );
    balanced(&mut o, &tap, &mut dest, Advertised::All)?;
    let restored = dest.call(
        &restore_cmd(&source.endpoint, "after", &remote, 0, 41),
        "RESTORED",
    )?;
    no_corruption(&mut o, "a peer restore after the release", &restored);
    o.equal("... and so does a peer restore", num(&restored, "ok"), 8);
    let stats = dest.stats()?;
    o.equal("evictions after the release", num(&stats, "evictions"), 16);
    balanced(&mut o, &tap, &mut dest, Advertised::DepositedOnly)?;
    core_invariants(&mut o, &mut dest)?;
    o.number("slots", slots);
    o.number("evictions", num(&stats, "evictions"));
    Ok(o)
}

// ------------------------------------------------------- concurrency

pub(super) fn concurrent_requests(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let pages = ctx.size(32, 64);
    let block = ctx.size(128 << 10, 1 << 20);
    let requests = 64u64;
    let mut source = Node::spawn(&ctx.binary, "source", &ctx.spec("source", pages * 2, block))?;
    let all = hashes(&offload(&mut source, pages, 2, 51, 5100)?);
    let (mut dest, tap) = publishing(ctx, "dest", ctx.spec("dest", pages * 2, block))?;
    // Prefixes of every length, in a scrambled order: request i restores pages
    // 0..len(i), so every page is wanted by many requests at once.
    let ranges: Vec<[u64; 2]> = (0..requests)
        .map(|i| [0, 1 + (i * 37 + 11) % pages])
        .collect();
    let distinct = ranges.iter().map(|r| r[1]).max().unwrap_or(0) * 2;
    let wanted: u64 = ranges.iter().map(|r| r[1] * 2).sum();
    let answer = dest.call(
        &json!({
            "cmd": "restore_many", "source": source.endpoint, "hashes": all,
            "ranges": ranges, "shards": [0, 1], "seed": 51,
        }),
        "RESTORED_MANY",
    )?;
    o.equal(
        "every request completed",
        num(&answer, "completed"),
        requests,
    );
    no_corruption(&mut o, "64 concurrent requests", &answer);
    o.equal(
        "every key of every request restored",
        num(&answer, "ok"),
        wanted,
    );
    let stats = dest.stats()?;
    let received = num(&stats["peer"], "keys_received");
    o.check(
        "each page crosses the wire at most once",
        received <= distinct,
        format!("{received} keys received, {distinct} distinct"),
    );
    o.equal("no claim left behind", num(&stats, "public_claims"), 0);
    balanced(&mut o, &tap, &mut dest, Advertised::DepositedOnly)?;
    core_invariants(&mut o, &mut dest)?;
    o.number("requests", requests);
    o.number("keys restored", num(&answer, "ok"));
    o.number("distinct keys", distinct);
    o.number("keys over the wire", received);
    o.number(
        "s",
        format!("{:.2}", answer["secs"].as_f64().unwrap_or(0.0)),
    );
    Ok(o)
}
