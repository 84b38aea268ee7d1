//! Processes that go away and come back: a source restarted under the same
//! name, and a KV-event subscriber that leaves.

use super::*;

pub(in crate::e2e) fn source_restart(ctx: &Ctx) -> Result<Outcome> {
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

pub(in crate::e2e) fn subscriber_gone(ctx: &Ctx) -> Result<Outcome> {
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
