//! `publish_inventory`: the DP owner rank publishes the group's rank-agreed
//! KVCR inventory on a real ZMQ PUB socket, read back here by a real
//! subscriber, field by field.

use std::time::Duration;

use kvcr_foundation::BlockKey;
use kvcr_hicache_storage::{ExtraInfo, FaultKind, HostLayout, Method, PageTokens};
use rmpv::Value as Msgpack;
use serde_json::json;

use crate::fixture::{Engine, EngineSpec, keys, small_geometry};

/// A TP=2 engine whose owner rank publishes, on loopback, with a fast
/// heartbeat so a subscriber can tell when its subscription is live.
fn publishing_engine(kvcr_pages: u64) -> Engine {
    let mut spec = EngineSpec::local(2, HostLayout::PageFirst, kvcr_pages);
    let extra = &mut spec.extra;
    extra["publish_inventory"] = json!(true);
    extra["control_host"] = json!("127.0.0.1");
    extra["control_advertise_host"] = json!("127.0.0.1");
    extra["single_host"] = json!(true);
    extra["inventory_heartbeat_ms"] = json!(20);
    Engine::start(&spec)
}

/// How long one receive waits.
const RECV_TIMEOUT_MS: i32 = 100;

/// One decoded batch: its sequence number and its events as key → value maps.
struct Batch {
    seq: u64,
    events: Vec<Vec<(String, Msgpack)>>,
}

struct Subscriber {
    socket: zmq::Socket,
    _context: zmq::Context,
}

impl Subscriber {
    /// Subscribes to `endpoint` and returns once a batch arrived (the
    /// heartbeat proves the subscription is live: ZMQ joins lazily).
    fn live(endpoint: &str) -> Self {
        let context = zmq::Context::new();
        let socket = context.socket(zmq::SUB).unwrap();
        socket.set_subscribe(b"").unwrap();
        socket.set_rcvtimeo(RECV_TIMEOUT_MS).unwrap();
        socket.connect(endpoint).unwrap();
        let me = Self {
            socket,
            _context: context,
        };
        assert!(
            me.next(Duration::from_secs(20)).is_some(),
            "no heartbeat from {endpoint}"
        );
        me
    }

    /// The next batch, waiting up to `within` (in receive timeouts of
    /// [`RECV_TIMEOUT_MS`]).
    fn next(&self, within: Duration) -> Option<Batch> {
        let tries = within.as_millis() / u128::from(RECV_TIMEOUT_MS.unsigned_abs());
        for _ in 0..tries.max(1) {
            let Ok(frames) = self.socket.recv_multipart(0) else {
                continue;
            };
            assert_eq!(frames.len(), 3, "topic, seq, payload");
            let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
            let batch = rmpv::decode::read_value(&mut frames[2].as_slice()).unwrap();
            let events = batch.as_array().unwrap()[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    e.as_map()
                        .unwrap()
                        .iter()
                        .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.clone()))
                        .collect()
                })
                .collect();
            return Some(Batch { seq, events });
        }
        None
    }

    /// The next batch that carries events (heartbeats skipped).
    fn next_events(&self) -> Vec<Vec<(String, Msgpack)>> {
        // At most 20 s of heartbeats (20 ms apart) before the events.
        for _ in 0..1000 {
            match self.next(Duration::from_secs(20)) {
                Some(b) if !b.events.is_empty() => return b.events,
                Some(_) => {}
                None => break,
            }
        }
        panic!("no events within 20 s");
    }

    /// Asserts that only heartbeats arrive for a few of them.
    fn only_heartbeats(&self, n: usize) {
        for _ in 0..n {
            let b = self.next(Duration::from_secs(20)).expect("a heartbeat");
            assert!(
                b.events.is_empty(),
                "unexpected events at seq {}: {:?}",
                b.seq,
                b.events
            );
        }
    }
}

fn field<'a>(event: &'a [(String, Msgpack)], name: &str) -> Option<&'a Msgpack> {
    event.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

fn hashes(event: &[(String, Msgpack)]) -> Vec<u64> {
    field(event, "block_hashes")
        .and_then(Msgpack::as_array)
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect()
}

fn kind(event: &[(String, Msgpack)]) -> &str {
    field(event, "type").and_then(Msgpack::as_str).unwrap()
}

/// The page tokens of `n` pages, in a salted LoRA namespace.
fn tagged_tokens(n: usize) -> ExtraInfo {
    let page = small_geometry().page_size;
    ExtraInfo {
        pages: Some(PageTokens {
            parent: Some(BlockKey::from_u64(99)),
            token_ids: (0..n as u32 * page).collect(),
            lora_name: Some("adapter-x".to_owned()),
            lora_id: Some(7),
            cache_salt: Some("tenant-a".to_owned()),
        }),
        ..ExtraInfo::default()
    }
}

/// Only the DP owner publishes; a page goes on the wire once, when every
/// rank committed it, with its namespace (salt, adapter name and id) and the
/// medium KVCR DRAM is; when one rank evicts its shard the page is withdrawn
/// once, although the other rank still holds its own; a detach clears.
#[test]
fn the_owner_publishes_what_the_whole_group_can_restore() {
    let _serial = crate::serial();
    let engine = publishing_engine(4);
    let (owner, other) = (&engine.ranks[0].storage, &engine.ranks[1].storage);
    assert_eq!(other.kv_event_endpoints(), None, "one stream per DP group");
    let endpoints = owner.kv_event_endpoints().expect("the owner publishes");
    assert_eq!(endpoints.publish.host().to_string(), "127.0.0.1");
    assert_ne!(endpoints.publish, endpoints.replay);
    let sub = Subscriber::live(&endpoints.publish.to_string());

    // Stored once, when both ranks committed, with the namespace's tags.
    let stored = keys(&[1, 2, 3]);
    assert_eq!(
        engine.set(&stored, &[0, 1, 2], &tagged_tokens(3)),
        vec![vec![true; 3]; 2]
    );
    let events = sub.next_events();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!(kind(e), "BlockStored");
    assert_eq!(hashes(e), [1, 2, 3]);
    assert_eq!(field(e, "parent_block_hash"), Some(&Msgpack::from(99u64)));
    assert_eq!(field(e, "medium"), Some(&Msgpack::from("CPU")));
    assert_eq!(field(e, "cache_salt"), Some(&Msgpack::from("tenant-a")));
    assert_eq!(field(e, "lora_name"), Some(&Msgpack::from("adapter-x")));
    assert_eq!(field(e, "lora_id"), Some(&Msgpack::from(7u64)));
    assert_eq!(field(e, "ownership"), None, "the stream is kvcr's own");
    let page = small_geometry().page_size as usize;
    assert_eq!(
        field(e, "token_ids")
            .and_then(Msgpack::as_array)
            .map(Vec::len),
        Some(3 * page)
    );

    // Rank 0's copy fails, rank 1's lands and evicts its shard of 1..=3:
    // nothing new is stored, and the three pages are withdrawn by the time
    // the call returns, once, although rank 0 still holds its shards.
    engine.ranks[0]
        .storage
        .faults()
        .arm(Method::BatchSet, FaultKind::Error, 1);
    let fresh = keys(&[10, 11, 12, 13]);
    assert_eq!(
        engine.set(&fresh, &[3, 4, 5, 6], &tagged_tokens(4)),
        vec![vec![false; 4]; 2]
    );
    assert!(!owner.is_published(stored[0]) && !other.is_published(stored[0]));
    let events = sub.next_events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(kind(&events[0]), "BlockRemoved");
    let mut removed = hashes(&events[0]);
    removed.sort_unstable();
    assert_eq!(removed, [1, 2, 3]);
    let runner = owner.runner_stats().unwrap();
    assert!(runner.ready >= 3, "rank 0 kept its shards: {runner:?}");
    engine.all(|r| r.storage.sync_inventory());
    sub.only_heartbeats(3);

    // Detach: the closing barrier.
    let stats = owner.close_inventory().expect("the owner's publisher");
    assert_eq!(stats.core.stored_blocks, 3);
    assert_eq!(stats.core.removed_blocks, 3);
    let events = sub.next_events();
    assert_eq!(kind(&events[0]), "AllBlocksCleared");
    assert_eq!(owner.close_inventory(), None, "closed once");
    assert_eq!(other.close_inventory(), None);
}

/// The registration an engine forwards: on the owner, the KV-event endpoints
/// first, then every DP rank's control endpoint, the role, and `router_hint`
/// last; nothing on other ranks.
#[test]
fn registration_metadata_ends_with_the_hint_capability() {
    let _serial = crate::serial();
    let port = crate::peer::free_base_port(2);
    let mut spec = EngineSpec::local(2, HostLayout::PageFirst, 8);
    let extra = &mut spec.extra;
    for (k, v) in [
        ("enable_remote_hint", json!(true)),
        ("publish_inventory", json!(true)),
        ("control_host", json!("127.0.0.1")),
        ("control_port", json!(port)),
        ("control_advertise_host", json!("127.0.0.1")),
        ("single_host", json!(true)),
        ("ucx_tls", json!("posix,cma,self")),
        ("worker_type", json!("decode")),
    ] {
        extra[k] = v;
    }
    let engine = Engine::start(&spec);
    let owner = &engine.ranks[0].storage;
    let events = owner.kv_event_endpoints().unwrap();
    let metadata = owner.registration_metadata().unwrap();
    let want = [
        ("kv_events_endpoint", events.publish.to_string()),
        ("kv_events_replay_endpoint", events.replay.to_string()),
        (
            "router_hint_source_control_endpoints",
            format!("{{\"0\":\"{}\"}}", owner.endpoint().unwrap()),
        ),
        ("router_hint_worker_type", "decode".to_owned()),
        ("router_hint", "true".to_owned()),
    ]
    .map(|(k, v)| (k.to_owned(), v));
    assert_eq!(metadata, want);
    assert_eq!(
        owner.endpoint().unwrap().port(),
        port,
        "the map names the owner's DP group"
    );
    // With the owner's member key: a destination talks only to it there.
    assert!(owner.endpoint().unwrap().key().is_some());
    assert!(
        metadata[2]
            .1
            .starts_with(&format!("{{\"0\":\"tcp://127.0.0.1:{port}?key="))
    );
    assert_eq!(engine.ranks[1].storage.registration_metadata().unwrap(), []);
}

/// What an engine's `extra_info` gives `batch_set` to publish with: real
/// tokens, the parent from the last prefix key, the namespace's tags. A value
/// of the wrong shape leaves the pages unpublished, never mis-published.
#[rstest::rstest]
#[case::tokens_only(json!({"token_ids": [1, 2]}), Some((None, None, None)))]
#[case::everything(
    json!({"token_ids": [1, 2], "prefix_keys": ["a".repeat(64), format!("{}{}", "00000000000000ff", "0".repeat(48))],
           "cache_salt": "t", "lora_name": "l", "lora_id": 3}),
    Some((Some(0xff), Some("t"), Some(3)))
)]
#[case::empty_prefix(json!({"token_ids": [], "prefix_keys": []}), Some((None, None, None)))]
#[case::no_tokens(json!({"cache_salt": "t"}), None)]
#[case::negative_token(json!({"token_ids": [1, -2]}), None)]
#[case::token_over_u32(json!({"token_ids": [4294967296u64]}), None)]
#[case::bad_prefix_key(json!({"token_ids": [1], "prefix_keys": ["xyz"]}), None)]
#[case::salt_not_text(json!({"token_ids": [1], "cache_salt": 5}), None)]
#[case::lora_id_negative(json!({"token_ids": [1], "lora_id": -1}), None)]
fn engine_extra_info_for_publishing(
    #[case] extra: serde_json::Value,
    #[case] want: Option<(Option<u64>, Option<&str>, Option<u64>)>,
) {
    let pages = ExtraInfo::from_engine(&extra).pages;
    let got = pages.as_ref().map(|p| {
        (
            p.parent.map(BlockKey::as_u64),
            p.cache_salt.as_deref(),
            p.lora_id,
        )
    });
    assert_eq!(got, want, "{pages:?}");
}
