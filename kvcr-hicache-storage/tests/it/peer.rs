//! Peer restore through the backend: real runners, real UCX (shared memory
//! on loopback), real TCP control channels; TP=2 ranks as threads.

use std::net::TcpListener;

use kvcr_hicache_storage::{ExtraInfo, FaultKind, HostLayout, Method};
use serde_json::{Value, json};

use crate::fixture::{Engine, EngineSpec, Events, keys, pattern, small_geometry, tokens};

/// A base port with `n` free consecutive ports after it (rank r binds base + r).
pub(crate) fn free_base_port(n: u16) -> u16 {
    for _ in 0..100 {
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = probe.local_addr().unwrap().port();
        if base > u16::MAX - n {
            continue;
        }
        drop(probe);
        let held: Vec<_> = (0..n)
            .map_while(|i| TcpListener::bind(("127.0.0.1", base + i)).ok())
            .collect();
        if held.len() == usize::from(n) {
            return base;
        }
    }
    panic!("no {n} consecutive free ports");
}

pub(crate) fn peer_spec(tp: u32, fill_seed: Option<u64>) -> (EngineSpec, u16) {
    let port = free_base_port(tp as u16);
    let mut spec = EngineSpec::local(tp, HostLayout::PageFirst, 32);
    spec.fill_seed = fill_seed;
    let extra = &mut spec.extra;
    extra["enable_remote_hint"] = json!(true);
    extra["control_host"] = json!("127.0.0.1");
    extra["control_port"] = json!(port);
    extra["control_advertise_host"] = json!("127.0.0.1");
    extra["single_host"] = json!(true);
    extra["ucx_tls"] = json!("posix,cma,self");
    (spec, port)
}

fn hint(port: u16, hashes: &[u64]) -> Value {
    hint_at(&format!("tcp://127.0.0.1:{port}"), hashes)
}

/// A hint naming `source` as written (a registered endpoint names its
/// member key, which the router passes on unchanged).
fn hint_at(source: &str, hashes: &[u64]) -> Value {
    json!({"protocol_version": "0.1", "message_id": "m", "actions": [{
        "action_id": "a", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": source, "block_hashes": hashes}}]})
}

/// TP=2 to TP=2: each destination rank dials its own shard of the source
/// (the router names only the source's DP endpoint), so rank 1 receives rank
/// 1's bytes (the wrong-shard dial cannot happen); the hint makes exists
/// optimistic, get reports what arrived, nothing is published on the
/// destination for restored pages, and the source published once.
#[test]
fn tp2_ranks_restore_their_own_shard() {
    let _serial = crate::serial();
    let (source_spec, source_port) = peer_spec(2, Some(7));
    let source = Engine::start(&source_spec);
    let (dest_spec, _) = peer_spec(2, None);
    let dest = Engine::start(&dest_spec);
    let source_events = Events::default();
    source.ranks[0]
        .storage
        .set_inventory_sink(Box::new(source_events.clone()));
    let page = small_geometry().page_size;
    let k = keys(&[101, 102, 103, 104]);
    assert_eq!(
        source.set(&k, &[0, 1, 2, 3], &tokens(4, page, None)),
        vec![vec![true; 4]; 2]
    );
    assert_eq!(source_events.stored_and_removed().0, k);
    // The shards differ: a wrong-shard dial would be visible in the bytes.
    assert_ne!(source.ranks[0].page_bytes(0), source.ranks[1].page_bytes(0));

    let extra = ExtraInfo::hinted("req-1", hint(source_port, &[101, 102, 103, 104, 105]));
    assert_eq!(
        dest.exists(&keys(&[101, 102, 103, 104, 105]), &extra),
        vec![5, 5]
    );
    let got = dest.get(
        &keys(&[101, 102, 103, 104, 105]),
        &[8, 9, 10, 11, 12],
        &extra,
    );
    assert_eq!(got, vec![vec![true, true, true, true, false]; 2]);
    for (r, rank) in dest.ranks.iter().enumerate() {
        for i in 0..4u64 {
            assert_eq!(
                rank.page_bytes(8 + i),
                source.ranks[r].page_bytes(i),
                "rank {r} page {i}"
            );
            assert_eq!(
                rank.page_bytes(8 + i),
                pattern(7, r as u32, i, rank.page_bytes(0).len()),
            );
        }
        let stats = rank.storage.stats();
        assert_eq!(stats.hinted_pages_requested, 5, "rank {r}");
        assert_eq!(stats.hinted_pages_loaded, 4, "rank {r}");
        let peer = rank.storage.peer_counters().unwrap();
        assert_eq!(peer.keys_received, 4, "rank {r}");
        let source_peer = source.ranks[r].storage.peer_counters().unwrap();
        assert_eq!(source_peer.keys_sent, 4, "source rank {r}");
        rank.storage.check_invariants().unwrap();
    }
    // Now resident on the destination: no hint needed.
    assert_eq!(dest.exists(&k, &ExtraInfo::default()), vec![4, 4]);
}

/// Several requests restore the same pages into different host pages in one
/// batch (and two requests at once on two threads): every destination page
/// receives the bytes.
#[test]
fn same_pages_into_different_destinations() {
    let _serial = crate::serial();
    let (source_spec, source_port) = peer_spec(1, Some(3));
    let source = Engine::start(&source_spec);
    let (dest_spec, _) = peer_spec(1, None);
    let dest = Engine::start(&dest_spec);
    let k = keys(&[1, 2, 3]);
    source.set(&k, &[0, 1, 2], &ExtraInfo::default());
    let extra = ExtraInfo::hinted("req-a", hint(source_port, &[1, 2, 3]));
    let twice = keys(&[1, 2, 1, 2, 3]);
    assert_eq!(
        dest.get(&twice, &[4, 5, 6, 7, 8], &extra),
        vec![vec![true; 5]]
    );
    let d = &dest.ranks[0];
    let s = &source.ranks[0];
    for (src, dst) in [(0, 4), (1, 5), (0, 6), (1, 7), (2, 8)] {
        assert_eq!(d.page_bytes(dst), s.page_bytes(src), "{src} -> {dst}");
    }
    // A second destination engine: two requests at once.
    let (dest2_spec, _) = peer_spec(1, None);
    let dest2 = Engine::start(&dest2_spec);
    let r = &dest2.ranks[0];
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(|| {
            r.storage.batch_get(
                &k,
                &[0, 1, 2],
                &ExtraInfo::hinted("req-x", hint(source_port, &[1, 2, 3])),
            )
        });
        let b = scope.spawn(|| {
            r.storage.batch_get(
                &k,
                &[10, 11, 12],
                &ExtraInfo::hinted("req-y", hint(source_port, &[1, 2, 3])),
            )
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!((a, b), (vec![true; 3], vec![true; 3]));
    for i in 0..3 {
        assert_eq!(r.page_bytes(i), s.page_bytes(i));
        assert_eq!(r.page_bytes(10 + i), s.page_bytes(i));
    }
}

/// A fault on either destination rank during a hinted restore is a miss on
/// both, counted on the faulty one; a retry restores everything. A source
/// rank without the pages makes the page a miss on both ranks.
#[test]
fn faults_on_each_rank_during_peer_restore() {
    let _serial = crate::serial();
    let (source_spec, source_port) = peer_spec(2, Some(5));
    let source = Engine::start(&source_spec);
    let (dest_spec, _) = peer_spec(2, None);
    let dest = Engine::start(&dest_spec);
    let k = keys(&[11, 12]);
    source.set(&k, &[0, 1], &ExtraInfo::default());
    for faulty in 0..2 {
        dest.ranks[faulty]
            .storage
            .faults()
            .arm(Method::BatchGet, FaultKind::Error, 1);
        let extra = ExtraInfo::hinted(&format!("f{faulty}"), hint(source_port, &[11, 12]));
        assert_eq!(dest.get(&k, &[0, 1], &extra), vec![vec![false; 2]; 2]);
        assert_eq!(dest.ranks[faulty].storage.stats().faults_batch_get, 1);
        dest.ranks[faulty].storage.faults().clear();
    }
    let extra = ExtraInfo::hinted("retry", hint(source_port, &[11, 12]));
    assert_eq!(dest.get(&k, &[0, 1], &extra), vec![vec![true; 2]; 2]);
    // Page 13 only on source rank 0: no rank of the destination uses it.
    source.ranks[1]
        .storage
        .faults()
        .arm(Method::BatchSet, FaultKind::Error, 1);
    source.set(&keys(&[13]), &[2], &ExtraInfo::default());
    let extra = ExtraInfo::hinted("partial", hint(source_port, &[13]));
    assert_eq!(dest.get(&keys(&[13]), &[2], &extra), vec![vec![false]; 2]);
    assert_eq!(
        dest.ranks[0].page_bytes(2),
        source.ranks[0].page_bytes(2),
        "rank 0's bytes did land, but the group does not use the page"
    );
}

/// A malformed hint is a counted rejection, never an error or a fetch.
#[test]
fn malformed_hints_are_rejected() {
    let _serial = crate::serial();
    let (spec, _) = peer_spec(2, None);
    let engine = Engine::start(&spec);
    for bad in [
        json!({"protocol_version": "0.2", "actions": []}),
        json!("not json"),
        json!({"source_control_endpoint": "tcp://0.0.0.0:1", "block_hashes": [1]}),
        // Rank 1 would dial port 65536.
        hint(65535, &[1]),
    ] {
        assert_eq!(
            engine.exists(&keys(&[1]), &ExtraInfo::hinted("r", bad)),
            vec![0, 0]
        );
    }
    assert_eq!(engine.ranks[0].storage.stats().hints_rejected, 3);
    assert_eq!(engine.ranks[1].storage.stats().hints_rejected, 4);
}

/// A hinted page whose source is dead counts optimistically in exists but is
/// never a hit in get: the operation fails at its deadline, the call returns
/// misses, and nothing stays claimed or in flight.
#[test]
fn a_dead_source_is_a_miss() {
    let _serial = crate::serial();
    let (mut spec, _) = peer_spec(1, None);
    spec.extra["operation_timeout_ms"] = json!(300);
    spec.extra["get_timeout_s"] = json!(2);
    let engine = Engine::start(&spec);
    let dead = free_base_port(1);
    let extra = ExtraInfo::hinted("r", hint(dead, &[1, 2]));
    assert_eq!(engine.exists(&keys(&[1, 2]), &extra), vec![2]);
    assert_eq!(
        engine.get(&keys(&[1, 2]), &[0, 1], &extra),
        vec![vec![false; 2]]
    );
    let s = &engine.ranks[0].storage;
    assert_eq!(s.stats().hinted_pages_loaded, 0);
    let runner = s.runner_stats().unwrap();
    assert_eq!((runner.public_claims, runner.ops_in_flight), (0, 0));
}

/// Case 10: a hint that covers none of the queried pages gives 0 pages.
#[test]
fn a_hint_covering_nothing_gives_zero() {
    let _serial = crate::serial();
    let (spec, _) = peer_spec(1, None);
    let engine = Engine::start(&spec);
    let dead = free_base_port(1);
    let extra = ExtraInfo::hinted("r", hint(dead, &[7, 8]));
    assert_eq!(engine.exists(&keys(&[1, 2]), &extra), vec![0]);
    assert_eq!(engine.exists(&keys(&[7, 8, 1]), &extra), vec![2]);
}

/// A request's hint covers its later calls (which may omit it) until the
/// request is discarded or pushed out by newer requests (bounded scopes).
#[test]
fn hint_scopes_are_request_scoped_and_bounded() {
    let _serial = crate::serial();
    let (mut spec, _) = peer_spec(1, None);
    spec.extra["max_hinted_requests"] = json!(2);
    let engine = Engine::start(&spec);
    let dead = free_base_port(1);
    let s = &engine.ranks[0].storage;
    let k = keys(&[1]);
    let bare = |r: &str| ExtraInfo {
        request_id: Some(kvcr_foundation::RequestId(r.into())),
        ..ExtraInfo::default()
    };
    for r in ["r1", "r2"] {
        assert_eq!(
            s.batch_exists(&k, &ExtraInfo::hinted(r, hint(dead, &[1]))),
            1
        );
    }
    assert_eq!(
        s.batch_exists(&k, &bare("r1")),
        1,
        "r1's hint is still live"
    );
    assert_eq!(
        s.batch_exists(&k, &ExtraInfo::hinted("r3", hint(dead, &[1]))),
        1
    );
    assert_eq!(s.batch_exists(&k, &bare("r1")), 0, "r1 was pushed out");
    assert_eq!(s.batch_exists(&k, &bare("r3")), 1);
    s.discard_request(&kvcr_foundation::RequestId("r3".into()));
    assert_eq!(s.batch_exists(&k, &bare("r3")), 0, "r3 was discarded");
    // Without a request id a hint lives for one call only.
    assert_eq!(
        s.batch_exists(
            &k,
            &ExtraInfo {
                router_hint: Some(hint(dead, &[1])),
                ..ExtraInfo::default()
            }
        ),
        1
    );
}

/// Every host layout restores from a peer, including a layer-first pool
/// whose pages are split into two segments (two namespaces per page).
#[rstest::rstest]
#[case::layer_first(HostLayout::LayerFirst, 2)]
#[case::layer_first_segmented(HostLayout::LayerFirst, kvcr_foundation::runner::MAX_SPANS_PER_KEY as u32 / 2 + 8)]
#[case::page_first(HostLayout::PageFirst, 2)]
#[case::page_first_direct(HostLayout::PageFirstDirect, 2)]
#[case::page_head(HostLayout::PageHead, 2)]
fn every_layout_restores_from_a_peer(#[case] layout: HostLayout, #[case] layers: u32) {
    let _serial = crate::serial();
    let specs = [Some(9), None].map(|seed| {
        let (mut spec, port) = peer_spec(1, seed);
        spec.layout = layout;
        spec.geometry.layers = layers;
        spec.extra["local_dram_bytes"] = json!(16 * spec.geometry.page_bytes());
        (spec, port)
    });
    let source = Engine::start(&specs[0].0);
    let dest = Engine::start(&specs[1].0);
    let k = keys(&[21, 22, 23]);
    assert_eq!(
        source.set(&k, &[0, 1, 2], &ExtraInfo::default()),
        vec![vec![true; 3]]
    );
    let extra = ExtraInfo::hinted("r", hint(specs[0].1, &[21, 22, 23]));
    assert_eq!(dest.get(&k, &[5, 6, 7], &extra), vec![vec![true; 3]]);
    for i in 0..3 {
        assert_eq!(
            dest.ranks[0].page_bytes(5 + i),
            source.ranks[0].page_bytes(i),
            "page {i}"
        );
    }
    let segments = dest.ranks[0].storage.span_plan().unwrap().segments.len() as u64;
    assert_eq!(segments, if layers > 2 { 2 } else { 1 });
    assert_eq!(
        dest.ranks[0].storage.peer_counters().unwrap().keys_received,
        3 * segments
    );
}

/// Case 48 in spirit: pages of another layout (another byte order) are
/// another namespace, so a hinted fetch across layouts is a miss, never bytes
/// in the wrong order.
#[test]
fn layouts_never_mix_across_peers() {
    let _serial = crate::serial();
    let (mut source_spec, source_port) = peer_spec(1, Some(4));
    source_spec.layout = HostLayout::PageHead;
    let source = Engine::start(&source_spec);
    let (dest_spec, _) = peer_spec(1, None);
    let dest = Engine::start(&dest_spec);
    let k = keys(&[31]);
    source.set(&k, &[0], &ExtraInfo::default());
    let extra = ExtraInfo::hinted("r", hint(source_port, &[31]));
    assert_eq!(dest.get(&k, &[1], &extra), vec![vec![false]]);
    assert!(dest.ranks[0].page_bytes(1).iter().all(|b| *b == 0));
}

/// With attention DP, a rank binds base + its global offset (DP=2, TP=2:
/// rank (dp 1, tp 1) binds base + 3), so DP groups never collide.
#[test]
fn ranks_bind_their_global_offset() {
    let _serial = crate::serial();
    let base = free_base_port(4);
    let (spec, _) = peer_spec(1, None);
    let mut extra = spec.extra.clone();
    extra["control_port"] = json!(base);
    let mut config = kvcr_hicache_storage::StorageConfig::single_rank("m", extra).with_tp(1, 2);
    config.dp_rank = 1;
    config.dp_size = 2;
    let group: std::sync::Arc<dyn kvcr_hicache_storage::RankGroup> = std::sync::Arc::new(
        kvcr_hicache_storage::LocalRankGroup::new(2, std::time::Duration::from_secs(1))
            .into_iter()
            .nth(1)
            .unwrap(),
    );
    let storage = kvcr_hicache_storage::KvcrHiCacheStorage::new(
        config,
        kvcr_hicache_storage::RankGroups::shared(group),
    )
    .unwrap();
    let geometry = spec.geometry;
    let mut host =
        vec![0u8; kvcr_hicache_storage::HostPoolDesc::required_len(&geometry, 2).unwrap() as usize];
    // SAFETY: (test) `host` outlives `storage` (dropped first below).
    unsafe {
        storage.register_host_pool(kvcr_hicache_storage::HostPoolDesc {
            layout: HostLayout::PageFirst,
            base: host.as_mut_ptr() as u64,
            len: host.len() as u64,
            pages: 2,
            geometry,
        })
    }
    .unwrap();
    assert_eq!(storage.endpoint().unwrap().port(), base + 3);
    drop(storage);
    drop(host);
}

/// The cluster secret reaches the runner's control channel: a destination
/// restores from a source holding the same secret (from the key on one side
/// and the secret file on the other), and from no source that holds another
/// secret or none (a miss at the operation deadline, never a fault, nothing
/// left claimed).
#[rstest::rstest]
#[case::same(Some("cluster-secret-one"), Some("cluster-secret-one"), true)]
#[case::neither(None, None, true)]
#[case::different(Some("cluster-secret-one"), Some("cluster-secret-two"), false)]
#[case::source_only(Some("cluster-secret-one"), None, false)]
#[case::destination_only(None, Some("cluster-secret-one"), false)]
fn the_cluster_secret_reaches_the_runner(
    #[case] source_secret: Option<&str>,
    #[case] dest_secret: Option<&str>,
    #[case] restores: bool,
) {
    let _serial = crate::serial();
    let (mut source_spec, source_port) = peer_spec(1, Some(5));
    if let Some(secret) = source_secret {
        source_spec.extra["cluster_secret"] = json!(secret);
    }
    let source = Engine::start(&source_spec);
    let (mut dest_spec, _) = peer_spec(1, None);
    if !restores {
        // A refused handshake is a miss at the operation deadline: keep that
        // wait short. A restore keeps the fixture's deadline: it is this
        // pair's first contact (session, metadata, copy), which on a loaded
        // machine can outlast half a second.
        dest_spec.extra["operation_timeout_ms"] = json!(500);
        dest_spec.extra["get_timeout_s"] = json!(3);
    }
    let secret_file = std::env::temp_dir().join(format!(
        "kvcr-hicache-peer-secret-{}-{source_port}",
        std::process::id()
    ));
    if let Some(secret) = dest_secret {
        std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
        dest_spec.extra["cluster_secret_file"] = json!(secret_file.to_str().unwrap());
    }
    let dest = Engine::start(&dest_spec);
    let _ = std::fs::remove_file(&secret_file);
    let k = keys(&[41, 42]);
    assert_eq!(
        source.set(&k, &[0, 1], &ExtraInfo::default()),
        vec![vec![true; 2]]
    );
    // As registered: the source's endpoint names its member key.
    let registered = source.ranks[0].storage.endpoint().unwrap().to_string();
    assert!(registered.contains("?key="));
    let extra = ExtraInfo::hinted("secret", hint_at(&registered, &[41, 42]));
    let got = dest.get(&k, &[4, 5], &extra);
    assert_eq!(got, vec![vec![restores; 2]]);
    let rank = &dest.ranks[0];
    if restores {
        assert_eq!(rank.page_bytes(4), source.ranks[0].page_bytes(0));
        assert_eq!(rank.page_bytes(5), source.ranks[0].page_bytes(1));
    } else {
        assert_ne!(rank.page_bytes(4), source.ranks[0].page_bytes(0));
    }
    let stats = rank.storage.stats();
    assert_eq!(
        stats.faults_batch_get, 0,
        "a refused peer is a miss, not a fault"
    );
    assert_eq!(stats.hinted_pages_loaded, if restores { 2 } else { 0 });
    let runner = rank.storage.runner_stats().unwrap();
    assert_eq!((runner.public_claims, runner.ops_in_flight), (0, 0));
}
