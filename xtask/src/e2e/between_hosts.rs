//! Scenarios between two simulated hosts: a source node in namespace A and a
//! destination in namespace B, UCX over tcp across a shaped veth link
//! ([`crate::link`]). Each checks the usual invariants (every restored byte
//! equal, no slot reused before it is quiesced, every caller answered, the
//! cores' own invariants) and reports the link's measured round trip.

// `serde_json::Value` indexing returns `Null` for a missing key, and a side
// is taken modulo the two namespaces: neither panics.
#![allow(clippy::indexing_slicing)]

use std::time::Duration;

use anyhow::{Result, bail};
use serde_json::Value;

use super::scenarios::{
    ABANDON_MS, BIG_BLOCK, OP_TIMEOUT_MS, TCP, core_invariants, hashes, no_corruption, num,
    offload, ops, poll_stats, restore_cmd, warm_then_fault,
};
use super::{Ctx, Outcome};
use crate::link::{Link, Shape, percentile};
use crate::node::{Node, NodeSpec};

/// A link of 1 Gbit/s each way with a 200 µs round trip: a rack's worth.
const RACK: Shape = Shape {
    rate_mbit: Some(1_000),
    delay_us: 100,
    jitter_us: 0,
    reorder: false,
    loss_ppm: 0,
};

/// A link between two namespaces, or the reason there cannot be one here
/// (not root, a tool missing): the scenario then fails saying so.
fn link(o: &mut Outcome, tag: &str, shape: Shape) -> Result<Option<Link>> {
    let features = crate::link::features()?;
    let missing = features.missing();
    if !missing.is_empty() {
        o.check(
            "this kernel can shape the link",
            false,
            format!("cannot shape: {}", missing.join(", ")),
        );
        return Ok(None);
    }
    let mut link = Link::up(tag)?;
    link.shape(shape)?;
    let rtt = link.measure_rtt(100)?;
    o.number(
        "link RTT asked/measured p50 (p95) us",
        format!(
            "{}/{:.0} ({:.0})",
            2 * shape.delay_us,
            percentile(&rtt, 0.5),
            percentile(&rtt, 0.95)
        ),
    );
    Ok(Some(link))
}

/// A node on side `side` of `link`.
fn node_on(
    ctx: &Ctx,
    link: &Link,
    side: usize,
    name: &str,
    blocks: u64,
    block: u64,
) -> Result<Node> {
    let spec = NodeSpec {
        tls: Some(TCP.into()),
        timeout_ms: Some(OP_TIMEOUT_MS),
        abandon_ms: Some(ABANDON_MS),
        netns: Some((link.ns[side % 2].clone(), link.address(side))),
        ..ctx.spec(name, blocks, block)
    };
    Node::spawn(&ctx.binary, name, &spec)
}

/// Restores `pages` pages of 1 MiB across a link shaped `shape`: every byte
/// intact, every page restored, both cores' invariants hold.
fn restore_across(ctx: &Ctx, tag: &str, shape: Shape, pages: u64, seed: u64) -> Result<Outcome> {
    let mut o = Outcome::default();
    let Some(link) = link(&mut o, tag, shape)? else {
        return Ok(o);
    };
    let block = 1 << 20;
    let mut source = node_on(ctx, &link, 0, "source", pages, block)?;
    let all = hashes(&offload(&mut source, pages, 1, seed, seed * 100)?);
    let mut dest = node_on(ctx, &link, 1, "dest", pages, block)?;
    let restored = dest.call(
        &restore_cmd(&source.endpoint, tag, &all, 0, seed),
        "RESTORED",
    )?;
    no_corruption(&mut o, &format!("across the {tag} link"), &restored);
    o.equal("every page restored", num(&restored, "ok"), pages);
    o.number(
        "MB/s",
        format!(
            "{:.0}",
            num(&restored, "bytes") as f64 / restored["secs"].as_f64().unwrap_or(f64::NAN) / 1e6
        ),
    );
    core_invariants(&mut o, &mut dest)?;
    core_invariants(&mut o, &mut source)?;
    Ok(o)
}

/// A restore across a 200 µs ± 50 µs link with 0.1 % loss (and a rate cap):
/// every byte arrives intact and every caller is answered.
pub(super) fn lossy(ctx: &Ctx) -> Result<Outcome> {
    let shape = Shape {
        jitter_us: 25,
        loss_ppm: 1_000,
        ..RACK
    };
    restore_across(ctx, "lossy", shape, ctx.size(24, 96), 41)
}

/// Packets reordered by jitter (100 ± 50 µs one way, each packet on its
/// own): every byte arrives intact.
pub(super) fn reordered(ctx: &Ctx) -> Result<Outcome> {
    let shape = Shape {
        jitter_us: 50,
        reorder: true,
        ..RACK
    };
    restore_across(ctx, "reordered", shape, ctx.size(16, 64), 61)
}

/// Starts a restore of big pages across `link`, and calls `fault` once the
/// source is writing them. Returns the nodes, the keys and the answer.
struct Faulted {
    source: Node,
    dest: Node,
    hashes: Vec<u64>,
    restored: Value,
    pages: u64,
}

/// Asks the faulted request's pages again, as `request`.
fn restore_again(hit: &mut Faulted, request: &str) -> Result<Value> {
    hit.dest.call(
        &restore_cmd(
            &hit.source.endpoint,
            request,
            hit.hashes.get(1..).unwrap_or_default(),
            1,
            FAULT_SEED,
        ),
        "RESTORED",
    )
}

/// The byte seed of the faulted scenarios' pages.
const FAULT_SEED: u64 = 51;

fn fault_mid_transfer(
    ctx: &Ctx,
    link: &mut Link,
    fault: &mut dyn FnMut(&mut Link) -> Result<()>,
) -> Result<Faulted> {
    // 128 MiB: over a second at 1 Gbit/s, so a fault lands mid-transfer,
    // and well inside the 3 s deadline, so the clean retry can finish.
    let pages = 32;
    let seed = FAULT_SEED;
    let mut source = node_on(ctx, link, 0, "source", pages + 1, BIG_BLOCK)?;
    let hashes = hashes(&offload(&mut source, pages + 1, 1, seed, 5100)?);
    let mut dest = node_on(ctx, link, 1, "dest", pages + 1, BIG_BLOCK)?;
    let (restored, faulted) = warm_then_fault(
        &mut source,
        &mut dest,
        &hashes,
        seed,
        "faulted",
        &mut |_| fault(link),
    )?;
    if !faulted {
        bail!("the transfer finished before the fault landed");
    }
    Ok(Faulted {
        source,
        dest,
        hashes,
        restored,
        pages,
    })
}

/// A caller is answered by its operation deadline, whatever the link does.
/// The grace covers the node's own bookkeeping on a loaded machine; a caller
/// left waiting on a dead link would wait for minutes.
fn answered_by_deadline(o: &mut Outcome, answer: &Value) {
    let secs = answer["secs"].as_f64().unwrap_or(f64::INFINITY);
    let bound = OP_TIMEOUT_MS as f64 / 1e3 + DEADLINE_GRACE_S;
    o.check(
        "the caller was answered by its deadline (no caller hung)",
        secs <= bound,
        format!(
            "{secs:.2} s, deadline {:.1} s + {DEADLINE_GRACE_S} s grace",
            OP_TIMEOUT_MS as f64 / 1e3
        ),
    );
}

/// Slack on "answered by the deadline" (seconds).
const DEADLINE_GRACE_S: f64 = 2.0;

/// Whether the source sent the faulted writes on the data stream its
/// destination dialed after the warm-up (UCX over tcp alone: `DataStream`
/// is on), so a fault hits kvcr's own connection.
fn on_the_data_stream(o: &mut Outcome, hit: &mut Faulted) -> Result<()> {
    let streams = hit.source.stats()?["streams"].clone();
    o.check(
        "the faulted writes went on the data stream",
        num(&streams, "opened") >= 1 && num(&streams, "writes_sent") >= 1,
        format!("{streams}"),
    );
    Ok(())
}

/// After a fault that outlived the deadline: the callers failed (no
/// corrupted byte), each hit write is uncertain and its slots are held;
/// once the link is back (`heal`), the source's answer quiesces every one of
/// them, the slots are free, and a clean retry restores every page.
fn held_then_quiesced(
    o: &mut Outcome,
    hit: &mut Faulted,
    link: &mut Link,
    heal: &mut dyn FnMut(&mut Link) -> Result<()>,
) -> Result<()> {
    on_the_data_stream(o, hit)?;
    let failed = num(&hit.restored, "failed");
    no_corruption(o, "the faulted request", &hit.restored);
    o.equal(
        "every key of the faulted request has a result",
        num(&hit.restored, "ok") + failed,
        hit.pages,
    );
    o.number("keys failed", failed);
    o.number(
        "caller answered after s",
        format!("{:.1}", hit.restored["secs"].as_f64().unwrap_or(f64::NAN)),
    );
    answered_by_deadline(o, &hit.restored);
    o.check(
        "the fault outlived the deadline: some keys failed",
        failed > 0,
        hit.restored["statuses"].to_string(),
    );
    let Some(stats) = poll_stats(&mut hit.dest, |s| !ops(s, "uncertain").is_empty())? else {
        o.check(
            "Uncertain notices at the abandonment deadline",
            false,
            "none came",
        );
        return Ok(());
    };
    o.equal(
        "the failed keys' slots are held while the link is down",
        num(&stats, "discarding"),
        failed,
    );
    heal(link)?;
    let uncertain = ops(&stats, "uncertain");
    let quiesced = poll_stats(&mut hit.dest, |s| {
        let q = ops(s, "quiesced");
        ops(s, "uncertain").iter().all(|op| q.contains(op)) && num(s, "discarding") == 0
    })?;
    o.check(
        "once the link is back, the source's answer quiesces every uncertain write and frees its slots",
        quiesced.is_some(),
        format!("uncertain ops {uncertain:?}"),
    );
    let retry = restore_again(hit, "retry")?;
    no_corruption(o, "the clean retry", &retry);
    o.check(
        "the clean retry restores every page",
        num(&retry, "ok") == hit.pages,
        format!(
            "{} of {}: {}",
            num(&retry, "ok"),
            hit.pages,
            retry["statuses"]
        ),
    );
    core_invariants(o, &mut hit.dest)?;
    core_invariants(o, &mut hit.source)?;
    Ok(())
}

/// A partition mid-transfer that heals after the deadline and the
/// abandonment: quarantine, then the source's proof, then a clean retry.
pub(super) fn partition_late(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let Some(mut link) = link(&mut o, "plate", RACK)? else {
        return Ok(o);
    };
    let mut hit = fault_mid_transfer(ctx, &mut link, &mut |l| l.partition(true))?;
    held_then_quiesced(&mut o, &mut hit, &mut link, &mut |l| l.partition(false))?;
    Ok(o)
}

/// A partition mid-transfer that heals well before the deadline: TCP
/// retransmits, and the transfer completes byte-exact with nothing held.
pub(super) fn partition_early(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let Some(mut link) = link(&mut o, "pearly", RACK)? else {
        return Ok(o);
    };
    let mut hit = fault_mid_transfer(ctx, &mut link, &mut |l| {
        l.partition(true)?;
        std::thread::sleep(Duration::from_millis(300));
        l.partition(false)
    })?;
    on_the_data_stream(&mut o, &mut hit)?;
    no_corruption(&mut o, "across the brief partition", &hit.restored);
    answered_by_deadline(&mut o, &hit.restored);
    let failed = num(&hit.restored, "failed");
    o.number("keys failed", failed);
    o.number(
        "caller answered after s",
        format!("{:.1}", hit.restored["secs"].as_f64().unwrap_or(f64::NAN)),
    );
    // Whether TCP's retransmission came in time is the network's business;
    // what kvcr owes is that whatever failed is held until proven, and that
    // nothing stays held once the source could answer.
    let settled = poll_stats(&mut hit.dest, |s| num(s, "discarding") == 0)?;
    o.check(
        "nothing stays held once the link is back",
        settled.is_some(),
        format!("{failed} keys failed"),
    );
    let verify = restore_again(&mut hit, "after")?;
    no_corruption(&mut o, "every page afterwards", &verify);
    o.equal(
        "every page restorable afterwards",
        num(&verify, "ok"),
        hit.pages,
    );
    core_invariants(&mut o, &mut hit.dest)?;
    Ok(o)
}

/// The link drops to 1 % of its rate mid-transfer: the callers fail by the
/// deadline, the writes stay held until the source can say how they ended,
/// and once the rate is back a clean retry restores every page.
pub(super) fn throttled(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let Some(mut link) = link(&mut o, "slow", RACK)? else {
        return Ok(o);
    };
    let rate = RACK.rate_mbit;
    let mut hit = fault_mid_transfer(ctx, &mut link, &mut |l| {
        l.set_rate(rate.map(|r| (r / 100).max(1)))
    })?;
    held_then_quiesced(&mut o, &mut hit, &mut link, &mut |l| l.set_rate(rate))?;
    Ok(o)
}
