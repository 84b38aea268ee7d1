//! Load: a destination whose pool is full of pages it may not evict, and
//! many requests at once.

use super::*;

pub(in crate::e2e) fn no_evict_capacity(ctx: &Ctx) -> Result<Outcome> {
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

pub(in crate::e2e) fn concurrent_requests(ctx: &Ctx) -> Result<Outcome> {
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
