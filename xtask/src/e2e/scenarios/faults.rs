//! Mid-transfer faults: a source killed or stopped while it writes into a
//! destination, hit during the write (retried on fresh processes when the
//! signal lands after it), and what the destination holds afterwards.

use super::*;

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
pub(in crate::e2e) fn warm_then_fault(
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

pub(in crate::e2e) fn source_sigkill(ctx: &Ctx) -> Result<Outcome> {
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

pub(in crate::e2e) fn source_sigstop(ctx: &Ctx) -> Result<Outcome> {
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
