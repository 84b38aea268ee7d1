//! Runners under a guard, each figure beside an anchor measured in the same
//! round.
//!
//! `cargo bench -p kvcr-foundation --bench guard [-- --quick]` (or
//! `cargo xtask bench`) prints:
//! - `BENCH guard.warm_restart_ms`: a runner under an in-process guard holds
//!   1 GiB of pages (1,024 × 1 MiB) and is closed; the next runner on the
//!   same group is started: the time from its start (the claim) to serving
//!   (every page READY, its journal resumed). Anchor: a cold start of the
//!   same runner without a guard (its pools made and prefaulted), same
//!   round. Every recovered page is then read back and byte-checked.
//! - `BENCH guard.journal_overhead`: deposit GB/s of a runner under a guard
//!   (every READY and removal journaled) over the same deposits into the
//!   same kind of pools without one (anchor), taking turns call by call: 1
//!   GiB of 1 MiB pages per round in calls of 16 into a full pool (so each
//!   call also evicts, and journals the removals).

#![allow(clippy::disallowed_methods)] // a benchmark reads the clock
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
#![allow(missing_docs)]

mod common;
use common::{bench, median};

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvcr_foundation::guard::GuardService;
use kvcr_foundation::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_foundation::runner::{
    DepositEntry, GuardOptions, PeerOptions, RegionDesc, Runner, RunnerConfig,
};
use kvcr_foundation::{BlockKey, CompatDigest, Namespace, NamespaceId, ScopedKey};

const PAGE: usize = 1 << 20;
/// 1 GiB of pages.
const PAGES: u64 = 1024;
const BATCH: u64 = 16;

/// Deterministic page bytes, distinct per page.
fn host_pages() -> Vec<u8> {
    let mut host = vec![0u8; PAGES as usize * PAGE];
    for (i, chunk) in host.chunks_mut(8).enumerate() {
        let v = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    host
}

struct Node {
    runner: Runner,
    ns: NamespaceId,
    region: RegionId,
}

fn start(guard: Option<&GuardOptions>, host: &mut [u8]) -> Node {
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some("sm,self".into());
    options.guard = guard.cloned();
    let config = RunnerConfig {
        operation_timeout: Duration::from_secs(30),
        ..RunnerConfig::single_pool("kv", PAGE as u64, PAGES as u32)
    };
    let runner = Runner::start_with_peers(config, None, &options).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(77)));
    // SAFETY: `host` outlives the runner (the caller drops the node first)
    // and is only read by it.
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: host.as_mut_ptr() as u64,
            size: PAGE as u64,
            stride: 0,
            count: PAGES,
        })
    }
    .unwrap();
    Node { runner, ns, region }
}

fn key(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

fn wait(runner: &mut Runner, op: OpHandle) {
    loop {
        if let Some(r) = runner
            .wait_completed(Duration::from_secs(30))
            .into_iter()
            .find(|r| r.op == op)
        {
            assert!(r.entries.iter().all(|(_, e)| e.is_success()), "{r:?}");
            return;
        }
    }
}

/// Deposits keys `call..call + BATCH` (host page `k % PAGES`); returns the
/// time it took.
fn deposit_call(node: &mut Node, call: u64) -> Duration {
    let start = Instant::now();
    let entries = (call..call + BATCH)
        .map(|k| DepositEntry {
            key: key(node.ns, k),
            spans: vec![ElementRef {
                region: node.region,
                index: k % PAGES,
            }],
            page: None,
        })
        .collect();
    let op = node.runner.deposit(entries, false).unwrap();
    wait(&mut node.runner, op);
    start.elapsed()
}

/// Deposits keys `first..first + PAGES` in calls of [`BATCH`]; returns the
/// busy time.
fn deposit_all(node: &mut Node, first: u64) -> Duration {
    (first..first + PAGES)
        .step_by(BATCH as usize)
        .map(|call| deposit_call(node, call))
        .sum()
}

/// Reads every page back (a local fetch) and compares it with `host`.
fn check_bytes(node: &mut Node, host: &[u8], first: u64) {
    let pool = node.runner.pool("kv").unwrap();
    for k in first..first + PAGES {
        let op = node.runner.fetch(&[key(node.ns, k)], &[pool]).unwrap();
        let result = loop {
            if let Some(r) = node
                .runner
                .wait_completed(Duration::from_secs(30))
                .into_iter()
                .find(|r| r.op == op)
            {
                break r;
            }
        };
        let (_, entry) = &result.entries[0];
        assert!(entry.is_success(), "page {k}: {entry:?}");
        let release = entry.release.unwrap();
        let bytes = node.runner.read_claimed(release, 0).unwrap();
        let page = (k % PAGES) as usize;
        assert!(
            bytes == host[page * PAGE..(page + 1) * PAGE],
            "page {k} differs after the warm restart"
        );
        node.runner.release(&[release]);
    }
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvcr-guard-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: build
    // check only, no timing in tests.
    if !std::env::args().any(|a| a == "--bench") {
        println!("guard bench: run with `cargo bench` or `cargo xtask bench`");
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var("KVCR_BENCH_QUICK").as_deref() == Ok("1");
    // A restart pair costs seconds, a deposit pair a fraction of one: one
    // restart pair when quick (`cargo xtask bench --quick` runs the binary
    // once), five otherwise (and the full bench repeats the binary).
    let rounds = if quick { 1 } else { 5 };
    let deposit_rounds: u64 = if quick { 5 } else { 9 };
    let dir = scratch();
    let socket = dir.join("guard.sock");
    let service = GuardService::start(&socket).unwrap();
    let mut host = host_pages();

    // Warm restart, against a cold start of the same runner.
    let guard = GuardOptions::new(&socket, 0, 77);
    let mut first = start(Some(&guard), &mut host);
    deposit_all(&mut first, 0);
    drop(first);
    let (mut warm, mut cold) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let t = Instant::now();
        let mut node = start(Some(&guard), &mut host);
        warm.push(t.elapsed().as_secs_f64() * 1e3);
        let seated = node
            .runner
            .recovery()
            .warm_start()
            .and_then(|w| w.recovery.clone())
            .map_or(0, |r| r.seated);
        assert_eq!(seated, PAGES, "round {round}: pages recovered");
        if round == 0 {
            check_bytes(&mut node, &host, 0);
        }
        drop(node);
        let t = Instant::now();
        let node = start(None, &mut host);
        cold.push(t.elapsed().as_secs_f64() * 1e3);
        drop(node);
    }
    bench(
        "guard.warm_restart_ms",
        median(warm),
        "ms",
        Some(median(cold)),
    );

    // Journal overhead: the same deposits with and without a journal (each
    // runner's pool full after its first round).
    let journaled = GuardOptions::new(&socket, 1, 77);
    let mut with = start(Some(&journaled), &mut host);
    let mut without = start(None, &mut host);
    deposit_all(&mut with, 0);
    deposit_all(&mut without, 0);
    let (mut rate_with, mut rate_without) = (Vec::new(), Vec::new());
    let bytes = (PAGES as usize * PAGE) as f64;
    // The two runners take turns call by call (which goes first alternates),
    // so the machine's drift over a round falls on both alike.
    for round in 1..=deposit_rounds {
        let first = round * PAGES;
        let (mut busy_with, mut busy_without) = (Duration::ZERO, Duration::ZERO);
        for (i, call) in (first..first + PAGES).step_by(BATCH as usize).enumerate() {
            if i % 2 == 0 {
                busy_with += deposit_call(&mut with, call);
                busy_without += deposit_call(&mut without, call);
            } else {
                busy_without += deposit_call(&mut without, call);
                busy_with += deposit_call(&mut with, call);
            }
        }
        rate_with.push(bytes / busy_with.as_secs_f64() / 1e9);
        rate_without.push(bytes / busy_without.as_secs_f64() / 1e9);
    }
    let journal = with
        .runner
        .recovery()
        .journal_stats()
        .expect("the journal keeps running");
    assert_eq!(journal.live_pages, PAGES, "{journal:?}");
    check_bytes(&mut with, &host, deposit_rounds * PAGES);
    bench(
        "guard.journal_overhead",
        median(rate_with),
        "GB/s",
        Some(median(rate_without)),
    );
    drop(with);
    drop(without);
    drop(service);
    let _ = std::fs::remove_dir_all(&dir);
}
