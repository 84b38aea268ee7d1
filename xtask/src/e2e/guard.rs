//! Engines under a `kvcr-guard`: a source node SIGKILLed mid-serve comes
//! back on the same group and takes its pages back warm; a journal that
//! overflowed or was corrupted disables warm recovery and nothing else.

// `serde_json::Value` indexing returns `Null` for a missing key; it never panics.
#![allow(clippy::indexing_slicing)]

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::events::EventTap;
use super::scenarios::{
    ABANDON_MS, BIG_BLOCK, FAULT_ATTEMPTS, OP_TIMEOUT_MS, TCP, core_invariants, hashes,
    no_corruption, num, offload, poll_stats, restore_cmd, status, verify_cmd, warm_then_fault,
};
use super::{Ctx, Outcome};
use crate::node::{Node, NodeSpec};

/// A `kvcr-guard` process, killed on drop.
struct GuardProcess {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl GuardProcess {
    fn start(ctx: &Ctx, dir: &Path) -> Result<Self> {
        let binary = crate::node::guard_path(&ctx.binary).context("the guard binary's path")?;
        let socket = dir.join("guard.sock");
        let log = dir.join("guard.log");
        // It serves an orphaned group's pages as the nodes do: same cluster
        // secret, UCX over tcp.
        let child = Command::new(&binary)
            .env("KVCR_CLUSTER_SECRET", crate::node::cluster_secret())
            .arg("--socket")
            .arg(&socket)
            .args(["--ucx-tls", TCP])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let guard = Self { child, socket, log };
        let start = Instant::now();
        while !guard.socket.exists() {
            if start.elapsed() > Duration::from_secs(30) {
                bail!("the guard never made its socket:\n{}", guard.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(guard)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log's last line (what a failed check shows).
    fn last_log_line(&self) -> String {
        self.log_text()
            .lines()
            .last()
            .unwrap_or_default()
            .to_owned()
    }

    /// Waits until the guard's log has a line containing `text`.
    fn wait_for_log(&self, text: &str) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if self.log_text().contains(text) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for GuardProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn scratch(name: &str) -> Result<PathBuf> {
    let dir = crate::workspace_root().join("target/e2e").join(name);
    std::fs::create_dir_all(&dir)?;
    let _ = std::fs::remove_file(dir.join("guard.sock"));
    Ok(dir)
}

fn guarded(
    ctx: &Ctx,
    name: &str,
    guard: &GuardProcess,
    blocks: u64,
    journal: Option<u64>,
) -> NodeSpec {
    NodeSpec {
        tls: Some(TCP.into()),
        publish: true,
        replay: true,
        guard: Some((guard.socket.clone(), journal)),
        ..ctx.spec(name, blocks, BIG_BLOCK)
    }
}

fn verify(node: &mut Node, hashes: &[u64], seed: u64) -> Result<Value> {
    node.call(&verify_cmd(hashes, 0, seed), "VERIFIED")
}

/// `engine-crash`: a source engine's pages live in its guard's memory; the
/// source is SIGKILLed while it serves a destination, restarts on the same
/// group and takes every page back warm. The kill must land mid-write (the
/// scenario's premise): when the write finished first, the attempt is
/// dropped and the scenario runs again on fresh processes.
pub(super) fn engine_crash(ctx: &Ctx) -> Result<Outcome> {
    for attempt in 1..=FAULT_ATTEMPTS {
        if let Some(mut o) = engine_crash_attempt(ctx)? {
            o.number("attempts", attempt);
            return Ok(o);
        }
        eprintln!("e2e:   the write finished before the kill landed; trying again");
    }
    let mut o = Outcome::default();
    o.check(
        "the kill landed mid-write",
        false,
        format!("every write finished first in {FAULT_ATTEMPTS} attempts"),
    );
    Ok(o)
}

/// One run of `engine-crash` on fresh processes; `None` when the kill came
/// after the write finished (the premise did not hold).
fn engine_crash_attempt(ctx: &Ctx) -> Result<Option<Outcome>> {
    let mut o = Outcome::default();
    let dir = scratch("engine-crash")?;
    let guard = GuardProcess::start(ctx, &dir)?;
    // As many pages in quick runs as in full ones: at 12 a fast machine's
    // write (48 MiB over loopback tcp) ended before the kill in every try.
    let pages = 32;
    let (seed, hash_seed) = (21, 2100);
    let spec = guarded(ctx, "source", &guard, pages + 4, None);
    let mut source = Node::spawn(&ctx.binary, "source", &spec)?;
    o.equal(
        "the first claim is fresh",
        source.warm_start["warm"].as_bool(),
        Some(false),
    );
    let all = hashes(&offload(&mut source, pages, 1, seed, hash_seed)?);
    let dest_spec = NodeSpec {
        tls: Some(TCP.into()),
        timeout_ms: Some(OP_TIMEOUT_MS),
        abandon_ms: Some(ABANDON_MS),
        ..ctx.spec("dest", 2 * pages, BIG_BLOCK)
    };
    let mut dest = Node::spawn(&ctx.binary, "dest", &dest_spec)?;
    let (hit, landed) =
        warm_then_fault(&mut source, &mut dest, &all, seed, "hit", &mut |source| {
            source.kill_and_reap().map(drop)
        })?;
    // The kill must land mid-write: with the source's pages claimed, and
    // before every key of the request came through (a write whose last
    // bytes and completion were out before the kill ended well, and leaves
    // the death report nothing to free). Otherwise the processes go with
    // this attempt.
    if !landed || num(&hit, "ok") == pages - 1 {
        // What the request got, so a run that never lands the kill says why.
        eprintln!("e2e:   kill landed while the source served: {landed}; the request got {hit}");
        return Ok(None);
    }
    o.number("killed while writing", landed);
    no_corruption(&mut o, "the request the crash hit", &hit);
    // The deadline that failed the callers also sent probe #1 to the
    // source's address, where the guard's backup already serves: its death
    // report can end the write before this read (60-230 ms after the answer
    // on a loaded machine, sooner on a quiet one). Past its deadline a write
    // keeps its slots until the source's proof or a death report ends it,
    // and a dead source proves nothing: so either the slots are still held,
    // or the report ended the write holding them (counted as dead_freed).
    // (`source-sigkill`, with no guard to report, holds them past the
    // deadline for as long as it watches.)
    let after_deadline = dest.stats()?;
    let held = num(&after_deadline, "discarding");
    let freed_by_report = num(&after_deadline["peer"], "dead_freed");
    o.check(
        "the destination holds the slots of the write the crash hit (until a death report)",
        held > 0 || freed_by_report > 0,
        format!(
            "{held} slots awaiting proof, {freed_by_report} writes already ended by a death report"
        ),
    );
    o.check(
        "the guard saw the source die",
        guard.wait_for_log("died"),
        guard.last_log_line(),
    );

    // While the source is dead its guard serves the recovered pages on the
    // same address, reporting the dead incarnation.
    o.check(
        "the guard serves the dead source's pages",
        guard.wait_for_log(&format!("serves {pages} recovered pages")),
        guard.last_log_line(),
    );
    // The destination the crash hit holds the granted slots (nothing proved
    // the dead process stopped); the guard's death report frees them, not a
    // restart of the destination: the answer to the deadline's probe, or to
    // the abandonment's or a fresh ack's when the backup was not serving yet.
    let again = dest.call(
        &restore_cmd(&source.endpoint, "again", &all, 0, seed),
        "RESTORED",
    )?;
    no_corruption(&mut o, "the hit destination asking again", &again);
    let freed = poll_stats(&mut dest, |s| {
        num(s, "discarding") == 0 && num(&s["peer"], "dead_freed") > 0
    })?;
    o.check(
        "the guard's death report frees them (no slot held, the destination not restarted)",
        freed.is_some(),
        freed.map_or_else(
            || "still held".to_owned(),
            |s| {
                format!(
                    "{} writes ended by a death report",
                    num(&s["peer"], "dead_freed")
                )
            },
        ),
    );
    let last = dest.call(
        &restore_cmd(&source.endpoint, "last", &all, 0, seed),
        "RESTORED",
    )?;
    no_corruption(&mut o, "the hit destination, its slots freed", &last);
    o.equal(
        "it then restores every page byte-exact from the guard",
        num(&last, "ok"),
        pages,
    );
    core_invariants(&mut o, &mut dest)?;
    let mut from_guard = Node::spawn(&ctx.binary, "dest 3", &{
        let mut spec = dest_spec.clone();
        spec.log = Some(dir.join("dest-3.log"));
        spec
    })?;
    let served = from_guard.call(
        &restore_cmd(&source.endpoint, "from-guard", &all, 0, seed),
        "RESTORED",
    )?;
    no_corruption(&mut o, "a new request while the source is dead", &served);
    o.equal(
        "the guard serves a new request byte-exact",
        num(&served, "ok"),
        pages,
    );
    drop(from_guard);

    let mut restarted = Node::spawn(&ctx.binary, "source (restarted)", &{
        let mut spec = guarded(ctx, "source-restarted", &guard, pages + 4, None);
        spec.log = Some(dir.join("source-restarted.log"));
        spec
    })?;
    let warm = restarted.warm_start.clone();
    o.equal(
        "the restart takes the group warm",
        warm["warm"].as_bool(),
        Some(true),
    );
    o.equal(
        "every page recovered, none skipped",
        (num(&warm, "seated"), num(&warm, "skipped")),
        (pages, 0),
    );
    o.equal(
        "the dead incarnation is named",
        warm["previous_incarnation"].as_str(),
        Some(source.incarnation.as_str()),
    );
    o.check(
        "the guard reports it dead",
        warm["dead_incarnations"].as_array().is_some_and(|d| {
            d.iter()
                .any(|i| i.as_str() == Some(source.incarnation.as_str()))
        }),
        &warm["dead_incarnations"],
    );
    o.equal(
        "restarted at the same control address",
        restarted.endpoint.clone(),
        source.endpoint.clone(),
    );
    // The inventory: the barrier, then every recovered page.
    let events = restarted.events.clone().context("the source publishes")?;
    let tap = EventTap::connect(&events, restarted.replay.as_deref())?;
    // The publisher batches on its own thread: wait until it has counted
    // every recovered page before settling on its batch count (it read 0
    // batches once, in a CI run).
    let published = poll_stats(&mut restarted, |s| {
        num(&s["publisher"], "stored_blocks") >= pages
    })?;
    let stats = match published {
        Some(stats) => stats,
        None => restarted.stats()?,
    };
    let tally = tap.settle(num(&stats["publisher"], "batches"))?;
    // The publisher opens its stream with a barrier of its own; the
    // recovery's barrier follows, then the pages.
    o.check(
        "the router sees Cleared, then the recovered pages",
        tally.clears >= 1 && tally.stored == pages && tally.live == pages as i64,
        format!(
            "{} barriers, {} stored, {} live after the last barrier",
            tally.clears, tally.stored, tally.live
        ),
    );
    o.equal("0 bytes copied in again", num(&stats, "bytes_deposited"), 0);
    let verified = verify(&mut restarted, &all, seed)?;
    no_corruption(&mut o, "every recovered page, read locally", &verified);
    o.equal(
        "every recovered page byte-exact",
        num(&verified, "ok"),
        pages,
    );
    // A fresh destination restores everything from the restarted source.
    let mut fresh = Node::spawn(&ctx.binary, "dest 2", &{
        let mut spec = dest_spec.clone();
        spec.log = Some(dir.join("dest-2.log"));
        spec
    })?;
    let restored = fresh.call(
        &restore_cmd(&restarted.endpoint, "after", &all, 0, seed),
        "RESTORED",
    )?;
    no_corruption(
        &mut o,
        "a peer restoring from the restarted source",
        &restored,
    );
    o.equal(
        "a peer restores every page byte-exact",
        num(&restored, "ok"),
        pages,
    );
    core_invariants(&mut o, &mut restarted)?;
    o.number("pages recovered", num(&warm, "seated"));
    o.number("bytes recovered", num(&warm, "bytes"));
    Ok(Some(o))
}

/// A guard and a source node under it, holding `pages` pages: what the
/// journal scenarios share.
struct Guarded {
    guard: GuardProcess,
    dir: PathBuf,
    source: Node,
    hashes: Vec<u64>,
    pages: u64,
    /// The group's journal bytes (`None`: the node's default).
    journal: Option<u64>,
}

impl Guarded {
    fn start(ctx: &Ctx, name: &str, pages: u64, journal: Option<u64>, seed: u64) -> Result<Self> {
        let dir = scratch(name)?;
        let guard = GuardProcess::start(ctx, &dir)?;
        let spec = guarded(ctx, "source", &guard, pages, journal);
        let mut source = Node::spawn(&ctx.binary, "source", &spec)?;
        let hashes = hashes(&offload(&mut source, pages, 1, seed, seed * 100)?);
        Ok(Self {
            guard,
            dir,
            source,
            hashes,
            pages,
            journal,
        })
    }

    /// SIGKILLs the source; the guard must see it die.
    fn kill(&mut self, o: &mut Outcome) -> Result<()> {
        self.source.kill_and_reap()?;
        o.check(
            "the guard saw it die",
            self.guard.wait_for_log("died"),
            self.guard.last_log_line(),
        );
        Ok(())
    }

    /// The restart after a disabled or corrupt journal: recovery off (the
    /// reason names `why`), no old page resident, fresh pages byte-exact.
    fn restart_disabled(&self, ctx: &Ctx, o: &mut Outcome, why: &str) -> Result<()> {
        let mut spec = guarded(ctx, "restarted", &self.guard, self.pages, self.journal);
        spec.log = Some(self.dir.join("restarted.log"));
        let mut restarted = Node::spawn(&ctx.binary, "source (restarted)", &spec)?;
        let warm = restarted.warm_start.clone();
        o.equal("the grant is warm", warm["warm"].as_bool(), Some(true));
        let reason = warm["disabled"].as_str().unwrap_or_default().to_owned();
        o.check(
            &format!("warm recovery disabled, saying why ({why})"),
            reason.contains(why),
            &reason,
        );
        o.equal("nothing seated", num(&warm, "seated"), 0);
        let queried = restarted.call(
            &json!({"cmd": "query", "hashes": self.hashes, "shards": [0]}),
            "QUERIED",
        )?;
        o.equal(
            "no old page is resident",
            status(&queried, "Miss"),
            self.hashes.len() as u64,
        );
        let fresh = hashes(&offload(&mut restarted, self.pages, 1, 7, 9100)?);
        let verified = verify(&mut restarted, &fresh, 7)?;
        no_corruption(o, "fresh pages after the disabled recovery", &verified);
        o.equal(
            "the node serves fresh pages",
            num(&verified, "ok"),
            self.pages,
        );
        core_invariants(o, &mut restarted)
    }
}

/// `journal-overflow`: a journal too small for the pages stops (the node
/// keeps serving); the next incarnation says recovery is disabled, seats
/// nothing and serves fresh pages.
pub(super) fn journal_overflow(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let seed = 31;
    let mut g = Guarded::start(ctx, "journal-overflow", ctx.size(24, 48), Some(4096), seed)?;
    let stats = g.source.stats()?;
    o.check(
        "the journal stopped when it overflowed",
        stats["journal"].is_null(),
        &stats["journal"],
    );
    let verified = verify(&mut g.source, &g.hashes, seed)?;
    o.equal("the node kept serving", num(&verified, "ok"), g.pages);
    g.kill(&mut o)?;
    o.check(
        "the guard does not serve pages its journal cannot vouch for",
        g.guard.wait_for_log("not serving the dead primary's pages"),
        g.guard.last_log_line(),
    );
    g.restart_disabled(ctx, &mut o, "overflow")?;
    Ok(o)
}

/// `journal-corrupt`: the journal is corrupted in the guard's memory while
/// its engine is dead; the next incarnation refuses it, seats nothing and
/// serves fresh pages (no wrong byte is ever served).
pub(super) fn journal_corrupt(ctx: &Ctx) -> Result<Outcome> {
    let mut o = Outcome::default();
    let mut g = Guarded::start(ctx, "journal-corrupt", ctx.size(8, 16), None, 41)?;
    g.kill(&mut o)?;
    let flipped = corrupt_journal(g.guard.pid())?;
    o.number("journal byte flipped at", flipped);
    g.restart_disabled(ctx, &mut o, "unreadable")?;
    Ok(o)
}

/// Flips one byte of the first record of the journal the guard holds (its
/// memfd, reached through `/proc/<guard>/fd`); returns the offset.
fn corrupt_journal(guard_pid: u32) -> Result<u64> {
    let fds = std::fs::read_dir(format!("/proc/{guard_pid}/fd"))?;
    for entry in fds {
        let path = entry?.path();
        let Ok(target) = std::fs::read_link(&path) else {
            continue;
        };
        if !target.to_string_lossy().contains("kvcr-journal") {
            continue;
        }
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)?;
        // The header (64 bytes), then the first frame's 16-byte header:
        // byte 80 is the first record's payload, followed by more records.
        let offset = 80u64;
        let mut byte = [0u8; 1];
        file.seek(SeekFrom::Start(offset))?;
        file.read_exact(&mut byte)?;
        byte[0] ^= 0x5a;
        file.seek(SeekFrom::Start(offset))?;
        file.write_all(&byte)?;
        return Ok(offset);
    }
    bail!("the guard (pid {guard_pid}) holds no journal memfd")
}
