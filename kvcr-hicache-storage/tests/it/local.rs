//! The storage contract over real runners and real memory, without peers:
//! contract cases 1, 5, 6, 9, 10, 12, 45, 47, 49, rank agreement and
//! concurrency.

use std::sync::Arc;
use std::time::Duration;

use kvcr_foundation::{BlockKey, InventoryEvent, Medium, Owner};
use kvcr_hicache_storage::{
    Error, ExtraInfo, FaultKind, HostLayout, HostPoolDesc, KvGeometry, LocalRankGroup, Method,
    RankGroup, agree_min,
};
use rstest::rstest;
use serde_json::json;

use crate::fixture::{Engine, EngineSpec, Events, keys, small_geometry, tokens};

/// Every layout round-trips: set pages, get them into other host pages, the
/// bytes equal, on every rank of TP=2 (each rank its own shard).
#[rstest]
fn set_then_get_round_trips(
    #[values(
        HostLayout::LayerFirst,
        HostLayout::PageFirst,
        HostLayout::PageFirstDirect,
        HostLayout::PageHead
    )]
    layout: HostLayout,
) {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(2, layout, 16));
    let k = keys(&[11, 12, 13]);
    assert_eq!(
        engine.set(&k, &[0, 1, 2], &ExtraInfo::default()),
        vec![vec![true; 3]; 2]
    );
    assert_eq!(engine.exists(&k, &ExtraInfo::default()), vec![3, 3]);
    assert_eq!(
        engine.get(&k, &[10, 11, 12], &ExtraInfo::default()),
        vec![vec![true; 3]; 2]
    );
    for rank in &engine.ranks {
        for (src, dst) in [(0, 10), (1, 11), (2, 12)] {
            assert_eq!(
                rank.page_bytes(dst),
                rank.page_bytes(src),
                "{layout} page {src}"
            );
        }
        assert_eq!(rank.storage.stats().pages_restored, 3);
        rank.storage.check_invariants().unwrap();
    }
    // Different ranks hold different shards of the same page.
    assert_ne!(
        engine.ranks[0].page_bytes(10),
        engine.ranks[1].page_bytes(10)
    );
}

/// A layer-first page with more spans than one key carries is stored as two
/// segments and still round-trips.
#[test]
fn segmented_pages_round_trip() {
    let _serial = crate::serial();
    let mut spec = EngineSpec::local(1, HostLayout::LayerFirst, 8);
    spec.geometry = KvGeometry {
        layers: kvcr_foundation::runner::MAX_SPANS_PER_KEY as u32 / 2 + 8,
        ..small_geometry()
    };
    spec.extra["local_dram_bytes"] = json!(8 * spec.geometry.page_bytes());
    let engine = Engine::start(&spec);
    let rank = &engine.ranks[0];
    assert_eq!(rank.storage.span_plan().unwrap().segments.len(), 2);
    let k = keys(&[1, 2]);
    assert_eq!(
        rank.storage.batch_set(&k, &[3, 4], &ExtraInfo::default()),
        vec![true, true]
    );
    assert_eq!(
        rank.storage.batch_get(&k, &[8, 9], &ExtraInfo::default()),
        vec![true, true]
    );
    assert_eq!(rank.page_bytes(8), rank.page_bytes(3));
    assert_eq!(rank.page_bytes(9), rank.page_bytes(4));
}

/// Case 1: the leading run of hits.
#[rstest]
#[case::hit_miss_hit(vec![1, 99, 2], 1)]
#[case::all_hits(vec![1, 2, 3], 3)]
#[case::first_miss(vec![99, 1, 2], 0)]
#[case::empty(vec![], 0)]
fn exists_counts_the_leading_run(#[case] query: Vec<u64>, #[case] expected: usize) {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(1, HostLayout::PageFirst, 8));
    engine.set(&keys(&[1, 2, 3]), &[0, 1, 2], &ExtraInfo::default());
    assert_eq!(
        engine.exists(&keys(&query), &ExtraInfo::default()),
        vec![expected]
    );
}

/// Case 5: rank 0 holds 5 pages, rank 1 holds 3 → both use 3.
#[test]
fn hit_counts_are_min_reduced() {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(2, HostLayout::PageFirst, 16));
    let k = keys(&[1, 2, 3, 4, 5]);
    engine.set(&k[..3], &[0, 1, 2], &ExtraInfo::default());
    // Rank 1 fails to store pages 4 and 5; rank 0 keeps them locally.
    engine.ranks[1]
        .storage
        .faults()
        .arm(Method::BatchSet, FaultKind::Error, 1);
    assert_eq!(
        engine.set(&k[3..], &[3, 4], &ExtraInfo::default()),
        vec![vec![false; 2]; 2]
    );
    assert_eq!(engine.ranks[0].storage.runner_stats().unwrap().ready, 5);
    assert_eq!(engine.exists(&k, &ExtraInfo::default()), vec![3, 3]);
    // And a get of all five is agreed page by page.
    assert_eq!(
        engine.get(&k, &[10, 11, 12, 13, 14], &ExtraInfo::default()),
        vec![vec![true, true, true, false, false]; 2]
    );
}

/// Case 5 (second half) and case 9: a fault on one rank gives every rank the
/// same shape of answer (all misses), counts the fault where it happened, and
/// the next call is served normally (nothing is latched).
#[rstest]
#[case::exists_error(Method::BatchExists, FaultKind::Error, 0)]
#[case::exists_panic(Method::BatchExists, FaultKind::Panic, 1)]
#[case::get_error(Method::BatchGet, FaultKind::Error, 1)]
#[case::get_panic(Method::BatchGet, FaultKind::Panic, 0)]
#[case::set_error(Method::BatchSet, FaultKind::Error, 0)]
#[case::set_panic(Method::BatchSet, FaultKind::Panic, 1)]
fn a_fault_on_one_rank_is_a_miss_everywhere(
    #[case] method: Method,
    #[case] kind: FaultKind,
    #[case] faulty: usize,
) {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(2, HostLayout::PageFirst, 16));
    let k = keys(&[1, 2]);
    let none = ExtraInfo::default();
    if method != Method::BatchSet {
        engine.set(&k, &[0, 1], &none);
    }
    engine.ranks[faulty].storage.faults().arm(method, kind, 1);
    let call = |engine: &Engine| -> Vec<Vec<bool>> {
        match method {
            Method::BatchExists => engine
                .exists(&k, &none)
                .into_iter()
                .map(|n| (0..2).map(|i| i < n).collect())
                .collect(),
            Method::BatchGet => engine.get(&k, &[5, 6], &none),
            Method::BatchSet => engine.set(&k, &[0, 1], &none),
        }
    };
    assert_eq!(call(&engine), vec![vec![false, false]; 2], "faulty call");
    for (r, rank) in engine.ranks.iter().enumerate() {
        let stats = rank.storage.stats();
        let faults = match method {
            Method::BatchExists => stats.faults_batch_exists,
            Method::BatchGet => stats.faults_batch_get,
            Method::BatchSet => stats.faults_batch_set,
        };
        assert_eq!(faults, u64::from(r == faulty), "rank {r}");
        assert_eq!(rank.storage.runner_stats().unwrap().public_claims, 0);
        assert_eq!(rank.storage.runner_stats().unwrap().ops_in_flight, 0);
    }
    assert_eq!(call(&engine), vec![vec![true, true]; 2], "the next call");
}

/// Case 9: internal errors (not injected) are misses of the right shape too.
#[test]
fn bad_batches_are_misses_of_the_right_shape() {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(1, HostLayout::PageFirst, 8));
    let storage = &engine.ranks[0].storage;
    let none = ExtraInfo::default();
    assert_eq!(
        storage.batch_set(&keys(&[1, 2]), &[0], &none),
        vec![false, false]
    );
    assert_eq!(storage.batch_get(&keys(&[1]), &[999], &none), vec![false]);
    let stats = storage.stats();
    assert_eq!((stats.faults_batch_set, stats.faults_batch_get), (1, 1));
    assert!(stats.last_error.unwrap().contains("host page 999"));
}

/// Calls before the host pool is registered are counted misses.
#[test]
fn calls_before_registration_are_misses() {
    let storage = kvcr_hicache_storage::KvcrHiCacheStorage::new(
        kvcr_hicache_storage::StorageConfig::single_rank("m", json!({"local_dram_bytes": 4096})),
        kvcr_hicache_storage::RankGroups::solo(),
    )
    .unwrap();
    let none = ExtraInfo::default();
    assert_eq!(storage.batch_exists(&keys(&[1]), &none), 0);
    assert_eq!(storage.batch_get(&keys(&[1]), &[0], &none), vec![false]);
    assert_eq!(storage.batch_set(&keys(&[1]), &[0], &none), vec![false]);
    let stats = storage.stats();
    assert_eq!(
        (
            stats.faults_batch_exists,
            stats.faults_batch_get,
            stats.faults_batch_set
        ),
        (1, 1, 1)
    );
}

/// Case 12: registering the identical pool again is a no-op; another is refused.
#[test]
fn host_pool_registration_is_once() {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(1, HostLayout::PageFirst, 8));
    let rank = &engine.ranks[0];
    let same = HostPoolDesc {
        layout: rank.layout,
        base: rank.host.as_ptr() as u64,
        len: rank.host.len() as u64,
        pages: rank.pages,
        geometry: rank.geometry,
    };
    // SAFETY: (test) the identical, already registered pool.
    unsafe { rank.storage.register_host_pool(same) }.unwrap();
    let other = HostPoolDesc {
        layout: HostLayout::PageHead,
        ..same
    };
    // SAFETY: (test) refused before anything is registered.
    let refused = unsafe { rank.storage.register_host_pool(other) };
    assert_eq!(refused, Err(Error::HostPoolReplaced));
}

/// A pool too small for one page is refused, naming the key.
#[test]
fn kvcr_dram_must_hold_a_page() {
    let _serial = crate::serial();
    let mut spec = EngineSpec::local(1, HostLayout::PageFirst, 1);
    spec.extra["local_dram_bytes"] = json!(small_geometry().page_bytes() - 1);
    match Engine::try_start(&spec) {
        Err(Error::Config { key, .. }) => assert_eq!(key, "local_dram_bytes"),
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("accepted"),
    }
}

/// Case 6: write-through acks are MIN-reduced (2 and 1 → both commit 1).
#[test]
fn finished_acks_are_min_reduced() {
    let groups = LocalRankGroup::new(2, Duration::from_secs(10));
    let agreed: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .iter()
            .map(|g| s.spawn(move || agree_min(g, if g.rank() == 0 { 2 } else { 1 }).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(agreed, vec![1, 1]);
}

/// Cases 6 and 47: `BlockStored` only for pages every rank committed, with
/// real tokens, owner kvcr, the configured medium; a failed offload on one
/// rank publishes nothing.
#[rstest]
#[case::external("EXTERNAL", Medium::External)]
#[case::cpu_pinned("CPU_PINNED", Medium::CpuPinned)]
fn stored_only_after_every_rank_committed(#[case] medium_name: &str, #[case] medium: Medium) {
    let _serial = crate::serial();
    let mut spec = EngineSpec::local(2, HostLayout::PageFirst, 16);
    spec.extra["medium"] = json!(medium_name);
    let engine = Engine::start(&spec);
    let events = Events::default();
    engine.ranks[0]
        .storage
        .set_inventory_sink(Box::new(events.clone()));
    let k = keys(&[1, 2, 3]);
    let page = small_geometry().page_size;
    engine.ranks[1]
        .storage
        .faults()
        .arm(Method::BatchSet, FaultKind::Error, 1);
    assert_eq!(
        engine.set(&k, &[0, 1, 2], &tokens(3, page, None)),
        vec![vec![false; 3]; 2]
    );
    assert!(
        events.take().is_empty(),
        "a failed offload published something"
    );
    assert_eq!(
        engine.set(&k, &[0, 1, 2], &tokens(3, page, None)),
        vec![vec![true; 3]; 2]
    );
    let published = events.take();
    assert_eq!(published.len(), 1, "{published:?}");
    match &published[0] {
        InventoryEvent::Stored {
            scope,
            keys: stored,
            parent,
            token_ids,
            block_size,
            ..
        } => {
            assert_eq!(scope.owner, Owner::Kvcr);
            assert_eq!(scope.medium, medium);
            assert_eq!(stored, &k);
            assert_eq!(*parent, None);
            assert_eq!(token_ids.len(), 3 * page as usize);
            assert_eq!(*block_size, page);
        }
        other => panic!("{other:?}"),
    }
    // Storing again publishes nothing new.
    engine.set(&k, &[0, 1, 2], &tokens(3, page, None));
    assert!(events.take().is_empty());
    // Both ranks' ledgers agree.
    for rank in &engine.ranks {
        assert_eq!(rank.storage.published_pages(), 3);
    }
}

/// Case 45: evictions publish exactly one `BlockRemoved` per page (the union
/// of every rank's evictions, once), and the engine-side drain empties.
#[test]
fn eviction_publishes_one_removed_per_page() {
    let _serial = crate::serial();
    // Room for 4 pages per rank.
    let engine = Engine::start(&EngineSpec::local(2, HostLayout::PageFirst, 4));
    let events = Events::default();
    engine.ranks[0]
        .storage
        .set_inventory_sink(Box::new(events.clone()));
    let page = small_geometry().page_size;
    let a = keys(&[1, 2, 3, 4]);
    let b = keys(&[5, 6]);
    assert_eq!(
        engine.set(&a, &[0, 1, 2, 3], &tokens(4, page, None)),
        vec![vec![true; 4]; 2]
    );
    // Two more pages: each rank evicts two of the first four (LRU: 1 and 2).
    assert_eq!(
        engine.set(&b, &[4, 5], &tokens(2, page, Some(a[3]))),
        vec![vec![true; 2]; 2]
    );
    // The evictions are exchanged at the next backup-group call.
    engine.all(|r| r.storage.sync_inventory());
    let (stored, removed) = events.stored_and_removed();
    assert_eq!(stored, keys(&[1, 2, 3, 4, 5, 6]));
    assert_eq!(removed, keys(&[1, 2]));
    // Again: nothing more.
    engine.all(|r| r.storage.sync_inventory());
    assert_eq!(events.stored_and_removed().1.len(), 2);
    for rank in &engine.ranks {
        assert_eq!(rank.storage.take_removed_page_hashes(), keys(&[1, 2]));
        assert!(rank.storage.take_removed_page_hashes().is_empty());
    }
    // A removed page stored again is published again, and removed again once.
    assert_eq!(engine.exists(&a, &ExtraInfo::default()), vec![0, 0]);
    engine.set(&a[..1], &[0], &tokens(1, page, None));
    let (stored, _) = events.stored_and_removed();
    assert_eq!(stored.last(), Some(&a[0]));
}

/// An eviction on only one rank still retires the page for the group.
#[test]
fn an_eviction_on_one_rank_removes_the_page_for_the_group() {
    let _serial = crate::serial();
    let mut spec = EngineSpec::local(2, HostLayout::PageFirst, 2);
    spec.extra["local_dram_bytes"] = json!(2 * small_geometry().page_bytes());
    let engine = Engine::start(&spec);
    let events = Events::default();
    engine.ranks[0]
        .storage
        .set_inventory_sink(Box::new(events.clone()));
    let page = small_geometry().page_size;
    engine.set(&keys(&[1, 2]), &[0, 1], &tokens(2, page, None));
    // Rank 0 alone stores page 3 (rank 1 faults): rank 0 evicts page 1.
    engine.ranks[1]
        .storage
        .faults()
        .arm(Method::BatchSet, FaultKind::Error, 1);
    engine.set(&keys(&[3]), &[2], &tokens(1, page, None));
    engine.all(|r| r.storage.sync_inventory());
    assert_eq!(events.stored_and_removed(), (keys(&[1, 2]), keys(&[1])));
    for rank in &engine.ranks {
        assert!(!rank.storage.is_published(BlockKey::from_u64(1)));
        assert!(rank.storage.is_published(BlockKey::from_u64(2)));
    }
}

/// Case 49: FIFO and LRU evict different pages in the same scenario.
#[rstest]
#[case::lru("lru", [true, false])]
#[case::fifo("fifo", [false, true])]
fn policies_pick_different_victims(#[case] policy: &str, #[case] alive_after: [bool; 2]) {
    let _serial = crate::serial();
    let mut spec = EngineSpec::local(1, HostLayout::PageFirst, 2);
    spec.extra["local_dram_bytes"] = json!(2 * small_geometry().page_bytes());
    spec.extra["policy"] = json!(policy);
    let engine = Engine::start(&spec);
    let s = &engine.ranks[0].storage;
    let none = ExtraInfo::default();
    s.batch_set(&keys(&[1, 2]), &[0, 1], &none);
    // Page 1 is read (LRU: recently used), then page 3 needs a slot.
    assert_eq!(s.batch_get(&keys(&[1]), &[8], &none), vec![true]);
    s.batch_set(&keys(&[3]), &[2], &none);
    let alive = [
        s.batch_exists(&keys(&[1]), &none) == 1,
        s.batch_exists(&keys(&[2]), &none) == 1,
    ];
    // LRU keeps the page just read (1) and evicts 2; FIFO evicts the oldest (1).
    assert_eq!(alive, alive_after);
}

/// Case 10: a hint that covers none of the queried pages gives 0 (and a
/// backend with remote hints off ignores hints, counted).
#[test]
fn hints_without_remote_mode_are_ignored() {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(1, HostLayout::PageFirst, 8));
    let s = &engine.ranks[0].storage;
    let hint = json!({"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch",
        "action_version": "1.0", "payload": {"source_control_endpoint": "tcp://10.0.0.9:25000",
        "block_hashes": [7, 8]}}]});
    assert_eq!(
        s.batch_exists(&keys(&[7, 8]), &ExtraInfo::hinted("r", hint)),
        0
    );
    assert_eq!(s.stats().hints_ignored, 1);
}

/// Two threads of one rank restore the same pages into different host pages
/// at once, and one call names a page twice: every destination gets the bytes.
#[test]
fn concurrent_restores_of_the_same_pages() {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(1, HostLayout::PageFirst, 8));
    let rank = &engine.ranks[0];
    let s = &rank.storage;
    let none = ExtraInfo::default();
    let k = keys(&[1, 2]);
    s.batch_set(&k, &[0, 1], &none);
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(|| s.batch_get(&k, &[4, 5], &none));
        let b = scope.spawn(|| s.batch_get(&k, &[6, 7], &none));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!((a, b), (vec![true; 2], vec![true; 2]));
    let twice = keys(&[1, 1, 2]);
    assert_eq!(s.batch_get(&twice, &[8, 9, 10], &none), vec![true; 3]);
    for (src, dsts) in [(0, vec![4, 6, 8, 9]), (1, vec![5, 7, 10])] {
        for dst in dsts {
            assert_eq!(rank.page_bytes(dst), rank.page_bytes(src), "{src} -> {dst}");
        }
    }
}

/// The collective's failure (a rank that never joins) is a miss, counted,
/// never a hang.
#[test]
fn a_silent_rank_is_a_miss_not_a_hang() {
    let _serial = crate::serial();
    let spec = EngineSpec::local(2, HostLayout::PageFirst, 8);
    // Build the engine with a short collective timeout by hand.
    let groups = LocalRankGroup::new(2, Duration::from_millis(200));
    let mut groups = groups.into_iter();
    let g0: Arc<dyn RankGroup> = Arc::new(groups.next().unwrap());
    let storage = kvcr_hicache_storage::KvcrHiCacheStorage::new(
        kvcr_hicache_storage::StorageConfig::single_rank("m", spec.extra.clone()).with_tp(0, 2),
        kvcr_hicache_storage::RankGroups::shared(g0),
    )
    .unwrap();
    let mut host = vec![0u8; HostPoolDesc::required_len(&spec.geometry, 4).unwrap() as usize];
    // SAFETY: (test) `host` outlives `storage` (dropped first below).
    unsafe {
        storage.register_host_pool(HostPoolDesc {
            layout: HostLayout::PageFirst,
            base: host.as_mut_ptr() as u64,
            len: host.len() as u64,
            pages: 4,
            geometry: spec.geometry,
        })
    }
    .unwrap();
    assert_eq!(
        storage.batch_set(&keys(&[1]), &[0], &ExtraInfo::default()),
        vec![false]
    );
    assert!(storage.stats().faults_collective >= 1);
    drop(storage);
    drop(host);
}

/// The engine's extra-info dict: the hint under either key, the request id.
#[test]
fn extra_info_from_the_engine() {
    let hint = json!({"source_control_endpoint": "tcp://10.0.0.1:5", "block_hashes": [1]});
    let e = ExtraInfo::from_engine(&json!({"kvcr_router_hint": hint, "request_id": "rid-1"}));
    assert_eq!(e.router_hint, Some(hint.clone()));
    assert_eq!(
        e.request_id,
        Some(kvcr_foundation::RequestId("rid-1".into()))
    );
    let e = ExtraInfo::from_engine(&json!({"kvcc_router_hint": hint, "rid": "rid-2"}));
    assert_eq!(e.router_hint, Some(hint));
    assert_eq!(
        e.request_id,
        Some(kvcr_foundation::RequestId("rid-2".into()))
    );
    let e = ExtraInfo::from_engine(&json!({"kvcr_router_hint": null}));
    assert_eq!(e, ExtraInfo::default());
}

/// The backend is shared by the engine's prefetch and backup threads.
#[test]
fn storage_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<kvcr_hicache_storage::KvcrHiCacheStorage>();
    check::<LocalRankGroup>();
}

/// The engine's prefetch and backup threads call one backend at once; their
/// collectives run on separate groups and never mix: TP=2, each rank with a
/// backup thread storing pages while a prefetch thread restores earlier ones.
#[test]
fn prefetch_and_backup_threads_run_at_once() {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(2, HostLayout::PageFirst, 32));
    let none = ExtraInfo::default();
    let first = keys(&[1, 2, 3, 4]);
    assert_eq!(
        engine.set(&first, &[0, 1, 2, 3], &none),
        vec![vec![true; 4]; 2]
    );
    let results = engine.all(|rank| {
        std::thread::scope(|s| {
            let backup = s.spawn(|| {
                (0..8u64)
                    .map(|i| {
                        let k = keys(&[100 + i]);
                        rank.storage.batch_set(&k, &[4 + i], &none)
                    })
                    .collect::<Vec<_>>()
            });
            let prefetch = s.spawn(|| {
                (0..8u64)
                    .map(|i| {
                        let hits = rank.storage.batch_exists(&first, &none);
                        let got = rank.storage.batch_get(
                            &first[..2],
                            &[12 + (i % 2) * 2, 13 + (i % 2) * 2],
                            &none,
                        );
                        (hits, got)
                    })
                    .collect::<Vec<_>>()
            });
            (backup.join().unwrap(), prefetch.join().unwrap())
        })
    });
    for (backup, prefetch) in results {
        assert!(backup.iter().all(|r| r == &vec![true]), "{backup:?}");
        assert!(
            prefetch
                .iter()
                .all(|(h, g)| *h == 4 && g == &vec![true, true]),
            "{prefetch:?}"
        );
    }
    for rank in &engine.ranks {
        assert_eq!(rank.page_bytes(12), rank.page_bytes(0));
        assert_eq!(rank.page_bytes(15), rank.page_bytes(1));
        assert_eq!(rank.storage.stats().faults_collective, 0);
    }
}

/// A host page named twice in one call is refused before anything is copied
/// (two copies into one page would keep one and report both): the set path
/// stores nothing, the get path writes nothing; every entry a miss, the typed
/// error in `last_error`, counted; the next call is served.
#[rstest]
#[case::set_two_keys_one_page(true, &[1, 2], &[3, 3])]
#[case::set_same_key_same_page(true, &[1, 1], &[3, 3])]
#[case::set_among_others(true, &[1, 2, 3], &[4, 5, 4])]
#[case::get_two_keys_one_page(false, &[1, 2], &[9, 9])]
#[case::get_same_key_same_page(false, &[1, 1], &[9, 9])]
#[case::get_among_others(false, &[1, 2, 1], &[9, 10, 9])]
fn a_host_page_named_twice_is_refused(
    #[case] set: bool,
    #[case] raw_keys: &[u64],
    #[case] pages: &[u64],
) {
    let _serial = crate::serial();
    let engine = Engine::start(&EngineSpec::local(1, HostLayout::PageFirst, 8));
    let rank = &engine.ranks[0];
    let s = &rank.storage;
    let none = ExtraInfo::default();
    // Keys 1 and 2 are stored from pages 0 and 1 for the get cases.
    assert_eq!(s.batch_set(&keys(&[1, 2]), &[0, 1], &none), vec![true; 2]);
    let before: Vec<Vec<u8>> = pages.iter().map(|p| rank.page_bytes(*p)).collect();
    let got = if set {
        let fresh: Vec<u64> = raw_keys.iter().map(|k| k + 10).collect();
        s.batch_set(&keys(&fresh), pages, &none)
    } else {
        s.batch_get(&keys(raw_keys), pages, &none)
    };
    assert_eq!(got, vec![false; raw_keys.len()]);
    let stats = s.stats();
    assert_eq!(
        (stats.faults_batch_set, stats.faults_batch_get),
        if set { (1, 0) } else { (0, 1) }
    );
    let error = stats.last_error.unwrap();
    let twice = pages
        .iter()
        .find(|p| pages.iter().filter(|q| q == p).count() > 1);
    assert!(
        error.contains(&Error::DuplicateHostPage(*twice.unwrap()).to_string()),
        "{error}"
    );
    let after: Vec<Vec<u8>> = pages.iter().map(|p| rank.page_bytes(*p)).collect();
    assert_eq!(before, after, "no host byte was written");
    assert_eq!(s.batch_exists(&keys(&[11]), &none), 0, "nothing was stored");
    let runner = s.runner_stats().unwrap();
    assert_eq!((runner.public_claims, runner.ops_in_flight), (0, 0));
    // Distinct pages in the next call are served.
    assert_eq!(s.batch_get(&keys(&[1, 2]), &[9, 10], &none), vec![true; 2]);
}

/// Read-only memory for a registration that must be refused (it is never
/// written: the refusal comes before the runner starts).
static READ_ONLY: [u8; 8192] = [1; 8192];

/// A host pool whose description is implausible or whose memory is not
/// mapped readable and writable is refused at registration, before the runner
/// starts; calls stay counted misses (never a fault in the process), and a
/// good pool can still be registered afterwards.
#[rstest]
#[case::null_base(|_: u64| (0, None), "base address is null")]
#[case::zero_size(|_: u64| (0x10_0000, Some(0)), "pool size is zero")]
#[case::size_mismatch(|len: u64| (0x10_0000, Some(len - 1)), "need")]
#[case::wraps(|len: u64| (u64::MAX - len + 2, None), "wraps the address space")]
#[case::kernel_half(|_: u64| (0xffff_8000_0000_0000, None), "is not mapped")]
#[case::low_unmapped(|_: u64| (0x1000, None), "is not mapped")]
#[case::read_only(|_: u64| (READ_ONLY.as_ptr() as u64, None), "without read and write")]
fn implausible_or_unmapped_pools_are_refused(
    #[case] describe: fn(u64) -> (u64, Option<u64>),
    #[case] why: &str,
) {
    let _serial = crate::serial();
    let geometry = small_geometry();
    let pages = READ_ONLY.len() as u64 / geometry.page_bytes();
    let len = HostPoolDesc::required_len(&geometry, pages).unwrap();
    let (base, claimed) = describe(len);
    let storage = kvcr_hicache_storage::KvcrHiCacheStorage::new(
        kvcr_hicache_storage::StorageConfig::single_rank(
            "m",
            json!({"local_dram_bytes": 8 * geometry.page_bytes(), "prefault": false}),
        ),
        kvcr_hicache_storage::RankGroups::solo(),
    )
    .unwrap();
    let desc = HostPoolDesc {
        layout: HostLayout::PageFirst,
        base,
        len: claimed.unwrap_or(len),
        pages,
        geometry,
    };
    // SAFETY: (test) refused before the runner starts or touches memory.
    match unsafe { storage.register_host_pool(desc) } {
        Err(e @ Error::HostPool(_)) => assert!(e.to_string().contains(why), "{e}"),
        other => panic!("{other:?}"),
    }
    assert!(storage.runner_stats().is_none(), "no runner started");
    let none = ExtraInfo::default();
    assert_eq!(storage.batch_set(&keys(&[1]), &[0], &none), vec![false]);
    assert_eq!(storage.batch_get(&keys(&[1]), &[0], &none), vec![false]);
    assert_eq!(
        storage.stats().last_error.unwrap(),
        "batch_get: no host pool registered yet"
    );
    // The refusal latched nothing: a real pool registers and serves.
    let mut host = vec![0u8; len as usize];
    // SAFETY: (test) `host` outlives `storage` (dropped first below).
    unsafe {
        storage.register_host_pool(HostPoolDesc {
            base: host.as_mut_ptr() as u64,
            len,
            ..desc
        })
    }
    .unwrap();
    assert_eq!(storage.batch_set(&keys(&[1]), &[0], &none), vec![true]);
    drop(storage);
    drop(host);
}
