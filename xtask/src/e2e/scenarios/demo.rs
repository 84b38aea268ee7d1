//! The demo workload as scenarios: shared memory, UCX over TCP, and with a
//! G3 tier underneath.

use super::*;

/// The demo workload (the same code as `cargo xtask demo`) on the default
/// transports (shared memory).
pub(in crate::e2e) fn demo(ctx: &Ctx) -> Result<Outcome> {
    demo_over(ctx, None, None, ctx.size(2, 4))
}

/// The demo workload with UCX over TCP.
pub(in crate::e2e) fn demo_tcp(ctx: &Ctx) -> Result<Outcome> {
    demo_over(ctx, Some(TCP), None, ctx.size(2, 4))
}

/// The demo workload with half the source's pages in a G3 file tier.
pub(in crate::e2e) fn demo_g3(ctx: &Ctx) -> Result<Outcome> {
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
