//! `guard_socket`: each rank's KVCR DRAM lives in a `kvcr-guard` (here its
//! service in this process), so an engine that restarts on the same ranks
//! takes its backed-up pages back warm: `batch_exists` sees them before
//! anything is backed up again, and `batch_get` restores them byte-exact.

use kvcr_foundation::guard::GuardService;
use kvcr_hicache_storage::ExtraInfo;
use serde_json::json;

use crate::fixture::{Engine, keys};
use crate::peer::peer_spec;

#[test]
fn a_restarted_engine_takes_its_pages_back_warm() {
    let _serial = crate::serial();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hicache-guard-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("guard.sock");
    let _guard = GuardService::start(&socket).unwrap();
    let (mut spec, _port) = peer_spec(2, Some(5));
    spec.extra["guard_socket"] = json!(socket);
    spec.extra["guard_journal_bytes"] = json!(1 << 20);

    let first = Engine::start(&spec);
    let k = keys(&[11, 12, 13, 14]);
    let stored = first.set(&k, &[0, 1, 2, 3], &ExtraInfo::default());
    assert_eq!(stored, vec![vec![true; 4]; 2]);
    let backed_up: Vec<Vec<Vec<u8>>> = first
        .ranks
        .iter()
        .map(|r| (0..4).map(|p| r.page_bytes(p)).collect())
        .collect();
    drop(first);

    // The same ranks again, their host pools zeroed: nothing is backed up.
    spec.fill_seed = None;
    let second = Engine::start(&spec);
    assert_eq!(second.exists(&k, &ExtraInfo::default()), vec![4, 4]);
    let restored = second.get(&k, &[8, 9, 10, 11], &ExtraInfo::default());
    assert_eq!(restored, vec![vec![true; 4]; 2]);
    for (rank, pages) in second.ranks.iter().zip(&backed_up) {
        for (p, bytes) in pages.iter().enumerate() {
            assert_eq!(&rank.page_bytes(8 + p as u64), bytes, "page {p}");
        }
        rank.storage.check_invariants().unwrap();
    }
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
}
