//! `g3_paths` / `g3_capacity_bytes`: a small KVCR DRAM with a G3 file tier
//! under it. Pages the engine backs up past DRAM's capacity move to G3 (per
//! rank files, K and V spans each in a G3 slot), stay visible to
//! `batch_exists`, and come back byte-exact through `batch_get`.

use kvcr_hicache_storage::{ExtraInfo, HostLayout, KvGeometry};
use serde_json::json;

use crate::fixture::{Engine, EngineSpec, keys};

/// Spans of one 4 KiB direct-I/O block: 2 layers × 1 head × 64 dims × 2 bytes
/// × 16 tokens.
fn aligned_geometry() -> KvGeometry {
    KvGeometry {
        layers: 2,
        kv_heads: 1,
        head_dim: 64,
        dtype_bytes: 2,
        page_size: 16,
    }
}

#[test]
fn pages_past_dram_move_to_g3_and_restore_byte_exact() {
    let _serial = crate::serial();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hicache-g3-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("a")).unwrap();
    std::fs::create_dir_all(dir.join("b")).unwrap();
    let geometry = aligned_geometry();
    let page = geometry.page_bytes();
    let spec = EngineSpec {
        tp: 2,
        layout: HostLayout::PageFirst,
        geometry,
        host_pages: 32,
        extra: json!({
            "local_dram_bytes": 2 * page,
            "operation_timeout_ms": 10000,
            "get_timeout_s": 20,
            "prefault": false,
            "g3_paths": [dir.join("a"), dir.join("b")],
            "g3_capacity_bytes": 16 * page,
        }),
        fill_seed: Some(9),
    };
    let engine = Engine::start(&spec);
    // Each rank has its own files, one per directory.
    for (rank, file) in [(0, "a/kvcr-g3-r0.bin"), (1, "b/kvcr-g3-r1.bin")] {
        assert!(dir.join(file).exists(), "rank {rank}: {file}");
    }
    // Backups of two pages (what DRAM holds: one call's pages are all in
    // DRAM at once); each later one moves earlier pages to G3.
    let k = keys(&(1..=8).collect::<Vec<_>>());
    for batch in 0..4 {
        let pages = [2 * batch, 2 * batch + 1];
        let stored = engine.set(&k[2 * batch as usize..][..2], &pages, &ExtraInfo::default());
        assert_eq!(stored, vec![vec![true; 2]; 2], "batch {batch}");
    }
    for rank in &engine.ranks {
        let g3 = rank.storage.runner_g3_stats().unwrap();
        assert!(g3.counters.spills_committed >= 6, "{g3:?}");
    }
    assert_eq!(engine.exists(&k, &ExtraInfo::default()), vec![8, 8]);
    let restored = engine.get(&k, &(16..24).collect::<Vec<_>>(), &ExtraInfo::default());
    assert_eq!(restored, vec![vec![true; 8]; 2]);
    for rank in &engine.ranks {
        for p in 0..8 {
            assert_eq!(rank.page_bytes(16 + p), rank.page_bytes(p), "page {p}");
        }
        rank.storage.check_invariants().unwrap();
    }
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}
