//! The G3 file tier under a runner node: a small KVCR DRAM pool filled far
//! past its capacity moves its victims to G3 files, everything comes back
//! byte-exact, and files removed underneath never make a wrong byte served.

// `serde_json::Value` indexing returns `Null` for a missing key; it never panics.
#![allow(clippy::indexing_slicing)]

use anyhow::{Context, Result};
use serde_json::{Value, json};

use super::scenarios::{core_invariants, hashes, no_corruption, num, status, verify_cmd};
use super::{Ctx, Outcome};
use crate::node::Node;

/// Pages per offload and per verify: what the pool holds at once (one call's
/// pages are all in DRAM together).
const CHUNK: u64 = 4;

fn g3_of(stats: &Value, key: &str) -> u64 {
    stats["g3"][key].as_u64().unwrap_or(0)
}

/// `g3-spill`: DRAM holds 16 pages, G3 128; 64 pages are offloaded.
pub(super) fn spill(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let pages = ctx.size(64, 256);
    let (slots, block) = (16u64, 64u64 << 10);
    let dir = crate::workspace_root().join("target/e2e/g3-spill/files");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let g3_bytes = pages * block; // two files: room for twice the pages
    let spec = crate::node::NodeSpec {
        g3: Some((dir.clone(), g3_bytes)),
        ..ctx.spec("node", slots, block)
    };
    let mut node = Node::spawn(&ctx.binary, "node", &spec)?;
    let mut all = Vec::new();
    for first in (0..pages).step_by(CHUNK as usize) {
        let offloaded = node.call(
            &json!({"cmd": "offload", "pages": CHUNK, "first_page": first, "shards": 1, "seed": 7, "hash_seed": 700}),
            "OFFLOADED",
        )?;
        if !o.equal(
            &format!(
                "pages {first}..{}: offloaded (older pages move to G3 for room)",
                first + CHUNK
            ),
            num(&offloaded, "keys"),
            CHUNK,
        ) {
            return Ok(o);
        }
        all.extend(hashes(&offloaded));
    }
    let queried = node.call(
        &json!({"cmd": "query", "hashes": all, "shards": [0]}),
        "QUERIED",
    )?;
    o.equal("DRAM holds what fits", status(&queried, "Hit"), slots);
    o.equal(
        "every other page is fetchable from G3",
        status(&queried, "Fetchable(Disk)"),
        pages - slots,
    );
    let stats = node.stats()?;
    // Every moved page was written (spills ahead may also have copied pages
    // DRAM still holds).
    o.check(
        "spills committed: at least every page moved",
        g3_of(&stats, "spills") >= pages - slots,
        format!(
            "{} spills for {} moved pages",
            g3_of(&stats, "spills"),
            pages - slots
        ),
    );
    o.equal(
        "no G3 transfer failed",
        g3_of(&stats, "failed_transfers"),
        0,
    );
    let verified = verify_all(&mut node, &all, 7)?;
    no_corruption(&mut o, "every page, from DRAM or G3", &verified);
    o.equal(
        "every page restored byte-exact",
        num(&verified, "ok"),
        pages,
    );
    core_invariants(&mut o, &mut node)?;

    // The files vanish underneath: an open file outlives its name on Linux,
    // so what is read is still the page's bytes; nothing else is ever served.
    for entry in std::fs::read_dir(&dir)? {
        std::fs::remove_file(entry?.path())?;
    }
    let after = verify_all(&mut node, &all, 7)?;
    no_corruption(&mut o, "after the G3 files were removed", &after);
    o.check(
        "after the G3 files were removed: every page is served right or not at all",
        num(&after, "ok") + num(&after, "failed") == pages,
        after["statuses"].to_string(),
    );
    core_invariants(&mut o, &mut node)?;
    let stats = node.stats()?;

    // Killed mid-spill and restarted on the same files: the tier is the
    // process's own, so the new node starts with G3 empty (the files' old
    // bytes are never served), takes the locks again, and works.
    node.send(&json!({"cmd": "offload", "pages": CHUNK, "first_page": pages, "shards": 1, "seed": 7, "hash_seed": 700}))?;
    node.kill_and_reap()?;
    drop(node);
    let mut node = Node::spawn(&ctx.binary, "node-restarted", &spec)?;
    let queried = node.call(
        &json!({"cmd": "query", "hashes": all, "shards": [0]}),
        "QUERIED",
    )?;
    o.equal(
        "after a kill mid-spill and a restart: nothing of the old G3 is claimed",
        status(&queried, "Miss"),
        pages,
    );
    let mut again = Vec::new();
    for first in (0..pages).step_by(CHUNK as usize) {
        let offloaded = node.call(
            &json!({"cmd": "offload", "pages": CHUNK, "first_page": first, "shards": 1, "seed": 8, "hash_seed": 700}),
            "OFFLOADED",
        )?;
        again.extend(hashes(&offloaded));
    }
    let mut fresh = Vec::new();
    for (i, chunk) in again.chunks(CHUNK as usize).enumerate() {
        let v = node.call(&verify_cmd(chunk, i as u64 * CHUNK, 8), "VERIFIED")?;
        fresh.push(v);
    }
    let (ok, bad): (u64, u64) = fresh.iter().fold((0, 0), |(ok, bad), v| {
        (ok + num(v, "ok"), bad + num(v, "mismatched"))
    });
    o.equal(
        "after the restart: the same keys with new bytes, no old byte served",
        bad,
        0,
    );
    o.equal("after the restart: every page restored", ok, pages);
    core_invariants(&mut o, &mut node)?;
    o.number("pages", pages);
    o.number("dram_slots", slots);
    o.number("spills", g3_of(&stats, "spills"));
    o.number("fills", g3_of(&stats, "fills"));
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(o)
}

/// Verifies `hashes` (pages `0..`, filled with `seed`) chunk by chunk;
/// returns the totals.
fn verify_all(node: &mut Node, all: &[u64], seed: u64) -> Result<Value> {
    let mut totals =
        json!({"ok": 0, "mismatched": 0, "failed": 0, "completed": true, "statuses": {}});
    for (i, chunk) in all.chunks(CHUNK as usize).enumerate() {
        let first = i as u64 * CHUNK;
        let v = node.call(&verify_cmd(chunk, first, seed), "VERIFIED")?;
        for key in ["ok", "mismatched", "failed"] {
            totals[key] = json!(num(&totals, key) + num(&v, key));
        }
        if v["completed"].as_bool() != Some(true) {
            totals["completed"] = json!(false);
        }
        if let Some(statuses) = v["statuses"].as_object() {
            for (k, n) in statuses {
                let before = totals["statuses"][k].as_u64().unwrap_or(0);
                totals["statuses"][k] = json!(before + n.as_u64().unwrap_or(0));
            }
        }
    }
    Ok(totals)
}

/// A 16 MiB ext4, loop-mounted, unmounted on drop.
struct LoopMount {
    mnt: std::path::PathBuf,
}

impl LoopMount {
    fn new(dir: &std::path::Path, mib: u64) -> Result<Self> {
        let image = dir.join("ext4.img");
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt)?;
        std::fs::File::create(&image)?.set_len(mib << 20)?;
        crate::run(
            std::process::Command::new("mkfs.ext4")
                .args(["-q", "-F"])
                .arg(&image),
        )?;
        crate::run(
            std::process::Command::new("mount")
                .args(["-o", "loop"])
                .arg(&image)
                .arg(&mnt),
        )
        .context("a full-disk scenario loop-mounts an ext4 image: it needs root")?;
        Ok(Self { mnt })
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.mnt).status();
    }
}

/// `g3-full-disk`: the G3 files sit on a 16 MiB filesystem while the node
/// moves 8 MiB pages' worth of victims at a time: once the disk is full,
/// spills fail with ENOSPC (typed, counted), the DRAM copies they would have
/// replaced are kept (or dropped, never half-moved), every deposit still
/// lands, and every page is restored byte-exact or reported missing.
pub(super) fn full_disk(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let (slots, block) = (16u64, 256u64 << 10);
    let pages = 96;
    let dir = crate::workspace_root().join("target/e2e/g3-full-disk/fs");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let mount = LoopMount::new(&dir, 16)?;
    // Files allowed far more than the filesystem holds.
    let spec = crate::node::NodeSpec {
        g3: Some((mount.mnt.clone(), 64 << 20)),
        ..ctx.spec("node", slots, block)
    };
    let mut node = Node::spawn(&ctx.binary, "node", &spec)?;
    let mut all = Vec::new();
    let mut landed = 0;
    for first in (0..pages).step_by(CHUNK as usize) {
        let offloaded = node.call(
            &json!({"cmd": "offload", "pages": CHUNK, "first_page": first, "shards": 1, "seed": 9, "hash_seed": 900}),
            "OFFLOADED",
        )?;
        landed += num(&offloaded, "keys");
        all.extend(hashes(&offloaded));
    }
    o.equal("every deposit lands, full disk or not", landed, pages);
    let stats = node.stats()?;
    let error = stats["g3"]["last_error"].as_str().unwrap_or("");
    o.check(
        "spills past the full disk fail, typed and counted",
        g3_of(&stats, "spills_failed") > 0 && g3_of(&stats, "failed_transfers") > 0,
        format!(
            "{} failed spills, {} failed transfers, last error: {error}",
            g3_of(&stats, "spills_failed"),
            g3_of(&stats, "failed_transfers")
        ),
    );
    o.check(
        "the error names the full disk",
        error.contains("no space") || error.contains("ENOSPC") || error.contains("28"),
        error,
    );
    let verified = verify_all(&mut node, &all, 9)?;
    no_corruption(&mut o, "every page after the disk filled", &verified);
    o.check(
        "every page is restored or missing, none wrong",
        num(&verified, "ok") + num(&verified, "failed") == pages,
        verified["statuses"].to_string(),
    );
    o.check(
        "what G3 took before the disk filled comes back",
        num(&verified, "ok") > slots,
        format!("{} of {pages} restored", num(&verified, "ok")),
    );
    core_invariants(&mut o, &mut node)?;
    o.number("pages", pages);
    o.number("restored", num(&verified, "ok"));
    o.number("spills_failed", g3_of(&stats, "spills_failed"));
    drop(node);
    drop(mount);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(o)
}
