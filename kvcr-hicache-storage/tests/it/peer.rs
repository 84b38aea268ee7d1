//! Peer restore through the backend: real runners, real UCX (shared memory
//! on loopback), real TCP control channels; TP=2 ranks as threads.

use std::net::TcpListener;

use kvcr_hicache_storage::{ExtraInfo, FaultKind, HostLayout, Method};
use serde_json::{Value, json};

use crate::fixture::{Engine, EngineSpec, Events, keys, pattern, small_geometry, tokens};

/// A base port with `n` free consecutive ports after it (rank r binds base + r).
fn free_base_port(n: u16) -> u16 {
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

fn peer_spec(tp: u32, fill_seed: Option<u64>) -> (EngineSpec, u16) {
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
    json!({"protocol_version": "0.1", "message_id": "m", "actions": [{
        "action_id": "a", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": format!("tcp://127.0.0.1:{port}"),
                    "block_hashes": hashes}}]})
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
