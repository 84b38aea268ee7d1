//! Runners under a guard, in one process with the guard's service: a
//! runner closed cleanly leaves its pages to the next one on the same group,
//! which takes them back warm (no byte copied again, every byte equal, the
//! inventory republished behind a barrier), and peers keep the address.
//! A runner killed mid-serve is `cargo xtask e2e --only engine-crash`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvcr_contracts::tier::{InventoryEvent, InventorySink};
use kvcr_guard::GuardService;
use kvcr_runner::{GuardOptions, PeerOptions, QueryStatus};

use crate::nodes::{BLOCK, Node, key, node_with, restore_all, stock, wait};

/// A unique scratch folder for the guard's socket.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvcr-guard-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn guarded(socket: &std::path::Path, journal_bytes: u64) -> PeerOptions {
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some("sm,self".into());
    let mut guard = GuardOptions::new(socket, 3, 0xfeed);
    guard.journal_bytes = journal_bytes;
    options.guard = Some(guard);
    options
}

#[derive(Clone, Default)]
struct Recorded(Arc<Mutex<Vec<InventoryEvent>>>);

impl InventorySink for Recorded {
    fn publish(&mut self, event: &InventoryEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

/// Bytes of page `k` as the runner holds it (a local fetch, then a read).
fn read_page(node: &mut Node, k: u64) -> Vec<u8> {
    let pool = node.runner.pool("kv").unwrap();
    let op = node.runner.fetch(&[key(node.ns, k)], &[pool]).unwrap();
    let result = wait(&mut node.runner, op);
    let (_, entry) = &result.entries[0];
    assert!(entry.is_success(), "page {k}: {entry:?}");
    let bytes = node.runner.read_claimed(entry.release.unwrap(), 0).unwrap();
    node.runner.release(&[entry.release.unwrap()]);
    bytes
}

#[test]
fn a_restarted_runner_takes_its_pages_back_warm() {
    let _serial = crate::serial();
    let dir = scratch("warm");
    let socket = dir.join("guard.sock");
    let _guard = GuardService::start(&socket).unwrap();
    let options = guarded(&socket, 1 << 20);
    let timeout = Duration::from_secs(10);

    let mut first = node_with(&options, 16, timeout);
    let start = first.runner.recovery().warm_start().unwrap().clone();
    assert!(!start.warm, "{start:?}");
    assert_eq!(start.recovery, None);
    let endpoint = first.runner.peers().endpoint().unwrap().clone();
    stock(&mut first, &[0, 1, 2, 3, 4, 5, 6, 7]);
    let before: Vec<Vec<u8>> = (0..8).map(|k| read_page(&mut first, k)).collect();
    for (k, bytes) in before.iter().enumerate() {
        assert_eq!(
            bytes[..],
            first.host[k * BLOCK..(k + 1) * BLOCK],
            "page {k}"
        );
    }
    let journal = first.runner.recovery().journal_stats().unwrap();
    assert_eq!(journal.live_pages, 8, "{journal:?}");
    drop(first);

    // The next incarnation on the same group: same address, same pages.
    let mut second = node_with(&options, 16, timeout);
    let start = second.runner.recovery().warm_start().unwrap().clone();
    assert!(start.warm, "{start:?}");
    assert_eq!(start.disabled, None);
    let report = start.recovery.clone().unwrap();
    assert_eq!(report.seated, 8, "{report:?}");
    assert_eq!(report.skipped, 0);
    assert_eq!(report.bytes, 8 * BLOCK as u64);
    assert_eq!(second.runner.peers().endpoint().unwrap(), &endpoint);
    assert_ne!(
        start.previous_incarnation,
        Some(second.runner.incarnation().raw())
    );
    // The inventory: the barrier, then the recovered pages.
    let sink = Recorded::default();
    second.runner.set_inventory_sink(Box::new(sink.clone()));
    let events = sink.0.lock().unwrap().clone();
    assert!(
        matches!(events.first(), Some(InventoryEvent::AllCleared { incarnation, .. }) if *incarnation == second.runner.incarnation()),
        "{events:?}"
    );
    let stored: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            InventoryEvent::Stored { keys, .. } => Some(keys.iter().map(|k| k.as_u64())),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(stored, (0..8).collect::<Vec<_>>());
    // Nothing was copied in again, and every byte is the first one's.
    assert_eq!(second.runner.stats().counters.bytes_deposited, 0);
    for (k, bytes) in before.iter().enumerate() {
        let key = key(second.ns, k as u64);
        assert_eq!(second.runner.query(&key), QueryStatus::Hit, "page {k}");
        assert_eq!(&read_page(&mut second, k as u64), bytes, "page {k}");
    }
    second.runner.check_invariants().unwrap();

    // A peer restores from it as from any runner.
    let mut target = node_with(&PeerOptions::loopback(), 16, timeout);
    let restored = restore_all(&mut target, "warm", &endpoint, &[0, 1, 2, 3]);
    assert_eq!(
        restored,
        before[..4],
        "a peer's copy of the recovered pages"
    );
    drop(target);
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A journal too small for the pages overflows: the runner keeps serving,
/// and the next incarnation says recovery is disabled and starts on memory
/// of its own, seating nothing (never a page the journal cannot vouch for).
#[test]
fn an_overflowed_journal_disables_recovery_and_nothing_else() {
    let _serial = crate::serial();
    let dir = scratch("overflow");
    let socket = dir.join("guard.sock");
    let _guard = GuardService::start(&socket).unwrap();
    let options = guarded(&socket, 1024);
    let timeout = Duration::from_secs(10);
    let mut first = node_with(&options, 16, timeout);
    stock(&mut first, &(0..16).collect::<Vec<_>>());
    assert_eq!(
        first.runner.recovery().journal_stats(),
        None,
        "the journal stopped"
    );
    // Still serving.
    assert_eq!(
        read_page(&mut first, 3)[..],
        first.host[3 * BLOCK..4 * BLOCK]
    );
    drop(first);

    let mut second = node_with(&options, 16, timeout);
    let start = second.runner.recovery().warm_start().unwrap().clone();
    assert!(start.warm);
    assert_eq!(start.recovery, None);
    let why = start.disabled.unwrap();
    assert!(
        why.contains("overflow") || why.contains("disabled"),
        "{why}"
    );
    assert_eq!(second.runner.query(&key(second.ns, 3)), QueryStatus::Miss);
    stock(&mut second, &[3]);
    assert_eq!(
        read_page(&mut second, 3)[..],
        second.host[3 * BLOCK..4 * BLOCK]
    );
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A start that fails after its claim (here: a G3 path that is a folder)
/// gives the group back, so the same process can claim it again.
#[test]
fn a_failed_start_gives_the_group_back() {
    use kvcr_runner::{G3Options, Runner, RunnerConfig};
    let _serial = crate::serial();
    let dir = scratch("failed-start");
    let socket = dir.join("guard.sock");
    let _guard = GuardService::start(&socket).unwrap();
    let options = guarded(&socket, 1 << 20);
    let config = RunnerConfig {
        g3: Some(G3Options {
            paths: vec![dir.clone()],
            capacity_bytes_per_file: 4 * BLOCK as u64,
        }),
        ..RunnerConfig::single_pool("kv", BLOCK as u64, 16)
    };
    let e = Runner::start_with_peers(config, None, &options).unwrap_err();
    assert!(e.to_string().contains("open G3"), "{e}");
    // Claimed again at once: no "held by pid" refusal, nothing retained.
    let node = node_with(&options, 16, Duration::from_secs(10));
    assert!(node.runner.recovery().warm_start().is_some_and(|w| w.warm));
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
}
