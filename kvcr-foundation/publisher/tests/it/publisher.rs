//! The inventory publisher on the vLLM/Dynamo KV-event wire: encoded bytes
//! (insta snapshots, strict decode with an independent msgpack decoder), the
//! live PUB/replay sockets, bounds, leaks, and the real clients (vLLM's own
//! wire classes, Dynamo's standalone indexer) when installed.
//!
//! Real clients: `kvcr-foundation/publisher/tests/realclients/setup.sh` installs them
//! under `target/realclients`. `KVCR_TEST_DYNAMO=1` / `KVCR_TEST_VLLM_WIRE=1`
//! make a missing client a failure; unset, those tests skip with a reason.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::MutexGuard;
use std::time::Duration;

use kvcr_contracts::{
    BindAddress, BlockKey, Incarnation, InventoryEvent, InventoryScope, InventorySink, Medium,
    NamespaceId, Owner,
};
use kvcr_publisher::wire::{OwnershipWire, WireBatch, WireEvent, encode_batch_to_vec};
use kvcr_publisher::{
    BatchLimits, PubSocket, Publisher, PublisherConfig, PublisherCore, PublisherSink, TopicParts,
};
use rmpv::Value;

use self::support::{serial, wait_for, wait_until};

// The lock and the waits, one copy for the crate group's test binaries.
#[path = "../../../test-support/serial.rs"]
pub(super) mod support;

// ----- helpers -----

/// Socket tests share the process's file descriptors; the leak test counts
/// them, so socket tests run one at a time (with the other heavy tests).
pub(super) fn sockets_lock() -> MutexGuard<'static, ()> {
    serial()
}

fn inc(n: u128) -> Incarnation {
    Incarnation::from_raw(n).unwrap()
}

pub(super) fn scope(owner: Owner, ns: u64, medium: Medium) -> InventoryScope {
    InventoryScope {
        owner,
        namespace: NamespaceId(ns),
        medium,
    }
}

pub(super) fn stored(
    scope: InventoryScope,
    keys: &[u64],
    parent: Option<u64>,
    tokens: Vec<u32>,
    block_size: u32,
    lora: Option<&str>,
) -> InventoryEvent {
    InventoryEvent::Stored {
        scope,
        keys: keys.iter().copied().map(BlockKey::from_u64).collect(),
        parent: parent.map(BlockKey::from_u64),
        token_ids: tokens,
        block_size,
        lora_name: lora.map(str::to_owned),
        lora_id: None,
        cache_salt: None,
    }
}

fn removed(scope: InventoryScope, keys: &[u64]) -> InventoryEvent {
    InventoryEvent::Removed {
        scope,
        keys: keys.iter().copied().map(BlockKey::from_u64).collect(),
    }
}

fn loopback0() -> BindAddress {
    BindAddress::parse("tcp://127.0.0.1:0").unwrap()
}

pub(super) fn config(worker: u64) -> PublisherConfig {
    PublisherConfig::new(
        TopicParts {
            worker_id: worker,
            dp_rank: 0,
        },
        inc(0x1234_5678_9abc_def0_0fed_cba9_8765_4321),
        PubSocket::Bind(loopback0()),
    )
    .with_replay(loopback0())
}

pub(super) fn dial(addr: &BindAddress) -> String {
    addr.to_string()
}

/// A fixed scenario through the sans-I/O core: every event kind, both owners,
/// a LoRA adapter, an incarnation switch and the close barrier.
fn scenario_batches() -> Vec<(String, u64, Vec<u8>)> {
    let mut core = PublisherCore::new(
        TopicParts {
            worker_id: 3,
            dp_rank: 1,
        },
        inc(0xaa),
        BatchLimits::default(),
        1024,
    );
    let kv = scope(Owner::Kvcr, 1, Medium::CpuPinned);
    let lora = scope(Owner::Kvcr, 2, Medium::CpuPinned);
    let fw = scope(Owner::Framework, 1, Medium::Gpu);
    let mut out = Vec::new();
    let mut step = |core: &mut PublisherCore, events: &[InventoryEvent]| {
        for e in events {
            core.handle(e);
        }
        while let Some(t) = core.poll_transmit(1_700_000_000.25) {
            out.push((
                String::from_utf8(t.topic.to_vec()).unwrap(),
                t.seq,
                t.payload.to_vec(),
            ));
        }
    };
    step(&mut core, &[]);
    step(
        &mut core,
        &[
            stored(kv, &[0x1111, 0x2222], None, (1..=8).collect(), 4, None),
            stored(kv, &[0x3333], Some(0x2222), (9..=12).collect(), 4, None),
            stored(
                lora,
                &[u64::MAX - 1],
                None,
                (1..=4).collect(),
                4,
                Some("sql-lora"),
            ),
            // A salted tenant's page under an adapter with a numeric id.
            InventoryEvent::Stored {
                scope: scope(Owner::Kvcr, 3, Medium::Cpu),
                keys: vec![BlockKey::from_u64(0x4444)],
                parent: None,
                token_ids: (1..=4).collect(),
                block_size: 4,
                lora_name: Some("sql-lora".to_owned()),
                lora_id: Some(5),
                cache_salt: Some("tenant-a".to_owned()),
            },
        ],
    );
    step(
        &mut core,
        &[
            removed(kv, &[0x3333, 0x2222]),
            stored(fw, &[300], None, vec![70_000, 1, 2, 3], 4, None),
        ],
    );
    step(
        &mut core,
        &[InventoryEvent::AllCleared {
            owner: Owner::Kvcr,
            incarnation: inc(0xbb),
        }],
    );
    core.close();
    step(&mut core, &[]);
    out
}

fn hex_dump(bytes: &[u8]) -> String {
    bytes
        .chunks(32)
        .map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Strictly decodes a KVEventBatch with rmpv (independent of the encoder)
/// and renders it; panics on anything vLLM 0.33's decoder would refuse or
/// that Dynamo would drop (bytes hashes, wrong shapes, wrong key order).
fn strict_decode(payload: &[u8]) -> String {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).expect("msgpack");
    assert!(rd.is_empty(), "trailing bytes after the batch");
    let Value::Array(top) = v else {
        panic!("batch is not an array")
    };
    assert_eq!(top.len(), 3, "batch is [ts, events, dp_rank]");
    assert!(matches!(top[0], Value::F64(_)), "ts must be float64");
    let dp = match &top[2] {
        Value::Nil => "nil".to_owned(),
        Value::Integer(i) => i.as_u64().expect("dp rank is unsigned").to_string(),
        other => panic!("dp_rank {other:?}"),
    };
    let Value::Array(events) = &top[1] else {
        panic!("events is not an array")
    };
    let mut lines = vec![format!("ts={} dp={dp}", top[0])];
    for e in events {
        let Value::Map(fields) = e else {
            panic!("event is not a map")
        };
        let keys: Vec<&str> = fields
            .iter()
            .map(|(k, _)| k.as_str().expect("string keys"))
            .collect();
        let ty = fields[0].1.as_str().expect("type is a string");
        assert_eq!(keys[0], "type", "type comes first");
        let with_owner = |base: &[&'static str]| -> Vec<Vec<&'static str>> {
            let mut owned = base.to_vec();
            owned.push("ownership");
            vec![base.to_vec(), owned]
        };
        let allowed = match ty {
            // A salted tenant's page appends SGLang's `cache_salt` last.
            "BlockStored" => with_owner(&[
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
            ])
            .into_iter()
            .flat_map(|keys| {
                let mut salted = keys.clone();
                salted.push("cache_salt");
                [keys, salted]
            })
            .collect(),
            "BlockRemoved" => with_owner(&["type", "block_hashes", "medium"]),
            "AllBlocksCleared" => with_owner(&["type"]),
            other => panic!("unknown event type {other}"),
        };
        assert!(
            allowed.contains(&keys),
            "{ty} keys {keys:?} not in vLLM 0.33 order"
        );
        let mut parts = vec![ty.to_owned()];
        for (k, v) in &fields[1..] {
            let k = k.as_str().unwrap();
            match k {
                "block_hashes" | "token_ids" => {
                    let Value::Array(items) = v else {
                        panic!("{k} is not an array")
                    };
                    let ints: Vec<u64> = items
                        .iter()
                        .map(|i| {
                            i.as_u64()
                                .unwrap_or_else(|| panic!("{k}: {i:?} is not a u64"))
                        })
                        .collect();
                    parts.push(format!("{k}={ints:?}"));
                }
                "parent_block_hash" => {
                    assert!(v.is_nil() || v.as_u64().is_some(), "parent {v:?}");
                    parts.push(format!("{k}={v}"));
                }
                "block_size" => parts.push(format!("{k}={}", v.as_u64().unwrap())),
                "lora_id" => {
                    assert!(v.is_nil() || v.as_u64().is_some(), "lora_id {v:?}");
                    parts.push(format!("{k}={v}"));
                }
                "cache_salt" => parts.push(format!("{k}={}", v.as_str().unwrap())),
                "medium" | "ownership" => parts.push(format!("{k}={}", v.as_str().unwrap())),
                "lora_name" => {
                    assert!(v.is_nil() || v.is_str());
                    parts.push(format!("{k}={v}"));
                }
                other => panic!("unexpected key {other}"),
            }
        }
        lines.push(format!("  {}", parts.join(" ")));
    }
    lines.join("\n")
}

// ----- bytes: snapshots and strict decode -----

#[test]
fn encoded_batches_match_snapshots_and_decode_strictly() {
    let batches = scenario_batches();
    let seqs: Vec<u64> = batches.iter().map(|b| b.1).collect();
    assert_eq!(seqs, (0..batches.len() as u64).collect::<Vec<_>>());
    for (topic, seq, payload) in &batches {
        let text = format!(
            "topic: {topic}\nseq: {}\n\n{}\n\n{}\n",
            hex_dump(&seq.to_be_bytes()),
            strict_decode(payload),
            hex_dump(payload)
        );
        insta::assert_snapshot!(format!("publisher_batch_{seq}"), text);
    }
}

#[test]
fn wire_event_with_every_optional_field_decodes_strictly() {
    let p = encode_batch_to_vec(&WireBatch {
        ts: 0.5,
        events: vec![
            WireEvent::Stored {
                hashes: (0..20).map(|i| u64::MAX - i).collect(),
                parent: Some(u64::MAX),
                token_ids: (0..20 * 16).map(|i| i * 1000).collect(),
                block_size: 16,
                lora_name: Some("l".repeat(300)),
                lora_id: Some(u64::from(u32::MAX) + 1),
                cache_salt: Some("tenant-a".to_owned()),
                medium: Medium::External,
                owner: Owner::Kvcr,
            },
            WireEvent::Removed {
                hashes: vec![0, 1 << 40],
                medium: Medium::Disk,
                owner: Owner::Framework,
            },
        ],
        dp_rank: Some(70_000),
        ownership: OwnershipWire::Field,
    });
    let text = strict_decode(&p);
    assert!(text.starts_with("ts=0.5 dp=70000\n  BlockStored block_hashes=[18446744073709551615"));
    assert!(text.contains("parent_block_hash=18446744073709551615"));
    assert!(text.contains("lora_id=4294967296 medium=EXTERNAL"));
    assert!(text.contains("ownership=kvcr cache_salt=tenant-a\n"));
    assert!(text.ends_with("BlockRemoved block_hashes=[0, 1099511627776] medium=DISK"));
}

// ----- live sockets -----

pub(super) fn sub(ep: &str) -> (zmq::Context, zmq::Socket) {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::SUB).unwrap();
    s.set_subscribe(b"").unwrap();
    s.set_rcvtimeo(10).unwrap();
    s.connect(ep).unwrap();
    (ctx, s)
}

/// Publishes fresh single-block stores until the subscriber receives one
/// (the PUB/SUB slow-joiner handshake, waited on explicitly).
pub(super) fn until_received(
    sink: &mut PublisherSink,
    s: &zmq::Socket,
    next_key: &mut u64,
) -> Vec<Vec<u8>> {
    let mut got = None;
    wait_until("the first live batch", Duration::from_secs(10), || {
        *next_key += 1;
        sink.publish(&stored(
            scope(Owner::Kvcr, 1, Medium::CpuPinned),
            &[*next_key],
            None,
            vec![1, 2],
            2,
            None,
        ));
        got = s.recv_multipart(0).ok();
        got.is_some()
    });
    got.unwrap()
}

#[test]
fn pub_frames_are_topic_seq_payload_and_replay_serves_any_buffered_seq() {
    let _g = sockets_lock();
    let publisher = Publisher::start(config(9)).unwrap();
    let bound = publisher.bound().clone();
    let pub_ep = dial(bound.pub_bound.as_ref().unwrap());
    let replay_ep = dial(bound.replay_bound.as_ref().unwrap());
    assert!(pub_ep.starts_with("tcp://127.0.0.1:") && !pub_ep.ends_with(":0"));
    let (ctx, s) = sub(&pub_ep);
    let mut sink = publisher.sink();
    let mut key = 0;
    let first = until_received(&mut sink, &s, &mut key);
    assert_eq!(first.len(), 3);
    assert_eq!(first[1].len(), 8);
    let topic = format!(
        "kvcr.w9.dp0.{}",
        inc(0x1234_5678_9abc_def0_0fed_cba9_8765_4321)
    );
    assert_eq!(first[0], topic.as_bytes());
    let mut first = first;
    let mut first_seq = u64::from_be_bytes(first[1].as_slice().try_into().unwrap());
    if first_seq == 0 {
        // The subscription landed before the driver sent its attach barrier
        // (it usually lands after): seq 0 clears all, and every store
        // published while waiting for it (`key` of them) follows it, one
        // batch each, or several to a batch when the driver ran late. Take
        // them all, so the live exchange below runs in lockstep.
        let barrier = strict_decode(&first[2]);
        assert!(barrier.contains("AllBlocksCleared ownership=kvcr"));
        let mut stores = barrier.matches("BlockStored").count() as u64;
        while stores < key {
            let mut next = None;
            wait_until("a store after the barrier", Duration::from_secs(10), || {
                next = s.recv_multipart(0).ok();
                next.is_some()
            });
            first = next.unwrap();
            let seq = u64::from_be_bytes(first[1].as_slice().try_into().unwrap());
            assert_eq!(seq, first_seq + 1, "batches are numbered without gaps");
            first_seq = seq;
            stores += strict_decode(&first[2]).matches("BlockStored").count() as u64;
        }
        assert_eq!(stores, key, "every store published while waiting, once");
    }
    assert!(first_seq >= 1, "live batches come after the attach barrier");
    strict_decode(&first[2]);
    // Three more, strictly +1.
    let mut live = vec![(first_seq, first[2].clone())];
    for i in 0..3 {
        // Alternate removals (of the last stored block) and fresh stores.
        if i % 2 == 0 {
            sink.publish(&removed(scope(Owner::Kvcr, 1, Medium::CpuPinned), &[key]));
        } else {
            key += 1;
            sink.publish(&stored(
                scope(Owner::Kvcr, 1, Medium::CpuPinned),
                &[key],
                None,
                vec![3, 4],
                2,
                None,
            ));
        }
        let mut f = None;
        wait_until("a live batch", Duration::from_secs(10), || {
            f = s.recv_multipart(0).ok();
            f.is_some()
        });
        let f = f.unwrap();
        let seq = u64::from_be_bytes(f[1].as_slice().try_into().unwrap());
        assert_eq!(seq, live.last().unwrap().0 + 1);
        live.push((seq, f[2].clone()));
    }
    // Replay from 0 (the attach barrier is there), from the middle, and again.
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(10_000).unwrap();
    dealer.connect(&replay_ep).unwrap();
    for start in [0, live[2].0, 0] {
        dealer
            .send_multipart([&b""[..], &start.to_be_bytes()], 0)
            .unwrap();
        let mut seqs = Vec::new();
        loop {
            let f = dealer.recv_multipart(0).expect("replay reply");
            assert_eq!(f.len(), 4, "[\"\", topic, seq, payload]");
            assert!(f[0].is_empty());
            if f[2] == [0xff; 8] {
                assert!(f[1].is_empty() && f[3].is_empty(), "end marker");
                break;
            }
            assert_eq!(f[1], topic.as_bytes());
            let seq = u64::from_be_bytes(f[2].as_slice().try_into().unwrap());
            if let Some((_, p)) = live.iter().find(|(s, _)| *s == seq) {
                assert_eq!(&f[3], p, "replayed payload equals the live one");
            }
            if seq == 0 {
                assert!(strict_decode(&f[3]).contains("AllBlocksCleared ownership=kvcr"));
            }
            seqs.push(seq);
        }
        let last = live.last().unwrap().0;
        assert_eq!(seqs, (start..=last).collect::<Vec<_>>(), "from {start}");
    }
    // A malformed request is ignored and counted; the socket keeps serving.
    dealer.send_multipart([&b""[..], b"bad"], 0).unwrap();
    wait_until("the bad request counted", Duration::from_secs(10), || {
        publisher.stats().replay_bad_requests == 1
    });
    let stats = publisher.close().unwrap();
    assert_eq!(stats.replay_requests, 3);
    assert_eq!(stats.replay_aborted, 0);
    assert_eq!(stats.queue_dropped, 0);
}

#[test]
fn an_explicit_loopback_address_binds_and_a_connect_endpoint_connects() {
    let _g = sockets_lock();
    // Bind: a second bind of the same address fails (a connect would not).
    let a = Publisher::start(config(1)).unwrap();
    let taken = a.bound().pub_bound.clone().unwrap();
    let mut cfg = config(2);
    cfg.pub_socket = PubSocket::Bind(taken.clone());
    let err = Publisher::start(cfg).unwrap_err();
    assert!(
        matches!(
            err.publisher_reason(),
            Some(kvcr_publisher::PublisherReason::Endpoint { op: "bind", .. })
        ),
        "{err}"
    );
    a.close().unwrap();
    // An explicit loopback address (no port 0) binds too. Other tests in this
    // process take ephemeral ports concurrently, so a port found free may be
    // taken before we bind it: try a few.
    let b = (0..8)
        .find_map(|_| {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let explicit = BindAddress::parse(&format!("tcp://127.0.0.1:{port}")).unwrap();
            let mut cfg = config(3);
            cfg.pub_socket = PubSocket::Bind(explicit.clone());
            Publisher::start(cfg).ok().map(|p| (p, explicit))
        })
        .map(|(p, explicit)| {
            assert_eq!(p.bound().pub_bound.as_ref(), Some(&explicit));
            p
        })
        .expect("an explicit loopback address binds");
    let bound = b.bound().pub_bound.clone().unwrap();
    let (_ctx, s) = sub(&dial(&bound));
    let mut key = 0;
    let got = until_received(&mut b.sink(), &s, &mut key);
    assert_eq!(got.len(), 3);
    b.close().unwrap();

    // Connect: the consumer binds, the publisher dials it.
    let ctx = zmq::Context::new();
    let listener = ctx.socket(zmq::SUB).unwrap();
    listener.set_subscribe(b"").unwrap();
    listener.set_rcvtimeo(10).unwrap();
    listener.bind("tcp://127.0.0.1:*").unwrap();
    let ep = listener.get_last_endpoint().unwrap().unwrap();
    let mut cfg = config(4);
    cfg.pub_socket = PubSocket::Connect(ep.parse().unwrap());
    let c = Publisher::start(cfg).unwrap();
    assert_eq!(c.bound().pub_bound, None);
    let got = until_received(&mut c.sink(), &listener, &mut key);
    assert_eq!(got.len(), 3);
    c.close().unwrap();
}

#[test]
fn a_stalled_subscriber_never_blocks_the_runner() {
    let _g = sockets_lock();
    let mut cfg = config(5);
    cfg.pub_hwm = 4;
    cfg.replay_batches = 16;
    let publisher = Publisher::start(cfg).unwrap();
    // A subscriber that never reads, with a tiny receive buffer.
    let ctx = zmq::Context::new();
    let stalled = ctx.socket(zmq::SUB).unwrap();
    stalled.set_rcvhwm(1).unwrap();
    stalled.set_rcvbuf(4096).unwrap();
    stalled.set_subscribe(b"").unwrap();
    stalled
        .connect(&dial(publisher.bound().pub_bound.as_ref().unwrap()))
        .unwrap();
    let mut sink = publisher.sink();
    let n = 50_000u64;
    for k in 1..=n {
        sink.publish(&stored(
            scope(Owner::Kvcr, 1, Medium::CpuPinned),
            &[k],
            None,
            vec![7; 64],
            64,
            None,
        ));
    }
    // Every event was either handled or dropped-and-counted; none blocked.
    wait_until(
        "the driver to account for every event",
        Duration::from_secs(30),
        || {
            let s = publisher.stats();
            s.core.events_in + s.queue_dropped == n
        },
    );
    let s = publisher.close().unwrap();
    assert_eq!(s.core.events_in + s.queue_dropped, n);
    assert!(
        s.core.batches > 4,
        "the driver kept publishing past the HWM"
    );
    drop(stalled);
}

#[test]
fn a_full_queue_drops_counts_and_resyncs_consumers_with_a_barrier() {
    let _g = sockets_lock();
    let mut cfg = config(6);
    cfg.queue_capacity = 1;
    let publisher = Publisher::start(cfg).unwrap();
    let sink = publisher.sink();
    let sc = scope(Owner::Kvcr, 1, Medium::CpuPinned);
    let mut k = 0u64;
    // Publish until the 1-slot queue overflows once (bounded attempts).
    let mut overflowed = false;
    while !overflowed && k < 10_000_000 {
        k += 1;
        overflowed = !sink.try_publish(stored(sc, &[k], None, vec![0; 4], 4, None));
    }
    assert!(overflowed, "a 1-slot queue never overflowed");
    wait_until("the resync barrier", Duration::from_secs(10), || {
        publisher.stats().core.resyncs >= 1
    });
    let s = publisher.close().unwrap();
    assert!(s.queue_dropped >= 1);
    assert_eq!(s.core.events_in + s.queue_dropped, k);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn repeated_attach_and_detach_leaks_no_socket_or_thread() {
    // Counting the process's fds and threads only means something when no
    // other test runs beside it: run this test alone, in a child process.
    const ALONE: &str = "KVCR_TEST_ALONE";
    if std::env::var(ALONE).is_err() {
        let name = "publisher::repeated_attach_and_detach_leaks_no_socket_or_thread";
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads=1", "--nocapture"])
            .env(ALONE, "1")
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "isolated run failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let _g = sockets_lock();
    // One warm-up cycle (lazily initialised process state is not a leak).
    let warm = Publisher::start(config(8)).unwrap();
    warm.close().unwrap();
    let (fds, tasks) = (open_fds(), threads());
    for round in 0..20u64 {
        let publisher = Publisher::start(config(8)).unwrap();
        let pub_ep = dial(publisher.bound().pub_bound.as_ref().unwrap());
        let replay_ep = dial(publisher.bound().replay_bound.as_ref().unwrap());
        // Peers attached while it runs.
        let ctx = zmq::Context::new();
        let s = ctx.socket(zmq::SUB).unwrap();
        s.set_subscribe(b"").unwrap();
        s.connect(&pub_ep).unwrap();
        let d = ctx.socket(zmq::DEALER).unwrap();
        d.set_rcvtimeo(10_000).unwrap();
        d.connect(&replay_ep).unwrap();
        d.send_multipart([&b""[..], &0u64.to_be_bytes()], 0)
            .unwrap();
        let reply = d.recv_multipart(0).unwrap();
        assert_eq!(reply.len(), 4, "round {round}");
        let mut sink = publisher.sink();
        sink.publish(&stored(
            scope(Owner::Kvcr, 1, Medium::CpuPinned),
            &[round + 1],
            None,
            vec![1],
            1,
            None,
        ));
        publisher.close().unwrap();
        // The sink outlives the publisher: publishing is a no-op, not a panic.
        sink.publish(&removed(scope(Owner::Kvcr, 1, Medium::CpuPinned), &[1]));
        drop((s, d, ctx));
    }
    assert!(open_fds() <= fds, "fds {fds} -> {}", open_fds());
    assert!(threads() <= tasks, "threads {tasks} -> {}", threads());
}

#[test]
fn out_of_range_configuration_is_a_typed_error() {
    let mut cfg = config(1);
    cfg.queue_capacity = 0;
    let err = Publisher::start(cfg).unwrap_err();
    assert!(matches!(
        err.publisher_reason(),
        Some(kvcr_publisher::PublisherReason::Config {
            field: "queue_capacity",
            ..
        })
    ));
    let mut cfg = config(1);
    let same = BindAddress::parse("tcp://127.0.0.1:5999").unwrap();
    cfg.pub_socket = PubSocket::Bind(same.clone());
    cfg.replay = Some(same);
    let err = Publisher::start(cfg).unwrap_err();
    assert!(matches!(
        err.publisher_reason(),
        Some(kvcr_publisher::PublisherReason::SameEndpoint(_))
    ));
}

// ----- real clients -----

fn realclients_dir() -> PathBuf {
    std::env::var_os("KVCR_REALCLIENTS_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/realclients"),
        PathBuf::from,
    )
}

fn scripts_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/realclients")
}

/// The venv's python when the real clients import; otherwise fails when
/// `flag` is set and returns `None` (skip, with the reason printed) when not.
pub(super) fn real_client(flag: &str, check: &str) -> Option<PathBuf> {
    let required = std::env::var(flag).is_ok_and(|v| v == "1");
    let py = realclients_dir().join("venv/bin/python");
    let ok = Command::new(&py)
        .args(["-c", check])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Some(py);
    }
    let reason = format!(
        "{} cannot run `{check}`: run kvcr-foundation/publisher/tests/realclients/setup.sh",
        py.display()
    );
    assert!(!required, "{flag}=1 but {reason}");
    println!("SKIP ({flag} unset): {reason}");
    None
}

/// Our bytes equal vLLM 0.33's own encoder's for the same events, and vLLM's
/// strict typed decoder accepts every batch; then vLLM's wire checker reads our
/// live PUB stream and replays it.
#[test]
fn vllm_own_classes_accept_our_bytes_and_live_stream() {
    let _serial = sockets_lock();
    let kv_events = realclients_dir().join("vllm/kv_events.py");
    let check = format!(
        "import msgspec, zmq; open({:?}).close()",
        kv_events.display().to_string()
    );
    let Some(py) = real_client("KVCR_TEST_VLLM_WIRE", &check) else {
        return;
    };
    // 1. Byte-exact comparison and strict decode of the snapshot scenario.
    let dir = realclients_dir().join("tmp");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("batches-{}.hex", std::process::id()));
    let hexes: Vec<String> = scenario_batches()
        .iter()
        .map(|(_, _, p)| p.iter().map(|b| format!("{b:02x}")).collect())
        .collect();
    std::fs::write(&file, hexes.join("\n")).unwrap();
    let out = Command::new(&py)
        .arg(scripts_dir().join("vllm_bytes_check.py"))
        .arg(&file)
        .env("VLLM_KV_EVENTS_PY", &kv_events)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "vllm_bytes_check failed:\n{text}");
    assert!(
        text.contains(&format!("{} batches decoded", hexes.len())),
        "{text}"
    );

    // 2. vLLM's own conformance checker against the live sockets.
    // (The serial lock taken at the top covers the live sockets.)
    let publisher = Publisher::start(config(11)).unwrap();
    let pub_ep = dial(publisher.bound().pub_bound.as_ref().unwrap());
    let replay_ep = dial(publisher.bound().replay_bound.as_ref().unwrap());
    let mut checker = Command::new(&py)
        .arg(scripts_dir().join("vllm_wire_check.py"))
        .args([&pub_ep, &replay_ep, "5"])
        .env("VLLM_KV_EVENTS_PY", &kv_events)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut sink = publisher.sink();
    let mut k = 0u64;
    let mut status = None;
    wait_until("vllm_wire_check to finish", Duration::from_secs(60), || {
        k += 1;
        sink.publish(&stored(
            scope(Owner::Kvcr, 1, Medium::CpuPinned),
            &[k],
            (k > 1).then_some(k - 1),
            vec![k as u32; 4],
            4,
            Some("lora-a").filter(|_| k.is_multiple_of(2)),
        ));
        if k.is_multiple_of(3) {
            sink.publish(&removed(scope(Owner::Kvcr, 1, Medium::CpuPinned), &[k - 1]));
        }
        // Pace the publishing on the checker's progress, not on a sleep.
        status = checker.try_wait().unwrap();
        status.is_some() || {
            std::thread::yield_now();
            false
        }
    });
    let mut out = String::new();
    checker
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    checker
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.unwrap().success(), "vllm_wire_check failed:\n{out}");
    assert!(out.contains("ok replay"), "{out}");
    publisher.close().unwrap();
}

// ----- Dynamo's standalone indexer, in a private network namespace -----

pub(super) struct Indexer {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Indexer {
    pub(super) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Indexer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http(port: u16, method: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = if method == "GET" {
        String::new()
    } else {
        body.to_string()
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    let json = serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body));
    (status, json)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

const MODEL: &str = "kvcr-test";
pub(super) const BS: u32 = 4;

pub(super) fn query(ix: &Indexer, tokens: &[u32], lora: Option<&str>) -> serde_json::Value {
    let mut body = serde_json::json!({"token_ids": tokens, "model_name": MODEL});
    if let Some(l) = lora {
        body["lora_name"] = l.into();
    }
    let (status, v) = http(ix.port, "POST", "/query", &body);
    assert_eq!(status, 200, "{v}");
    v["instances"].clone()
}

pub(super) fn register(ix: &Indexer, worker: u64, p: &Publisher) {
    let body = serde_json::json!({
        "instance_id": worker,
        "endpoint": dial(p.bound().pub_bound.as_ref().unwrap()),
        "replay_endpoint": dial(p.bound().replay_bound.as_ref().unwrap()),
        "model_name": MODEL,
        "block_size": BS,
        "dp_rank": 0,
    });
    let (status, v) = http(ix.port, "POST", "/register", &body);
    assert!(status == 200 || status == 201, "register: {status} {v}");
}

fn unregister(ix: &Indexer, worker: u64) {
    let body = serde_json::json!({"instance_id": worker, "model_name": MODEL, "dp_rank": 0});
    let (status, v) = http(ix.port, "POST", "/unregister", &body);
    assert!((200..300).contains(&status), "unregister: {status} {v}");
}

/// Waits until `/query` for `tokens` answers `expect` (the `instances` map).
fn expect_query(ix: &Indexer, tokens: &[u32], lora: Option<&str>, expect: serde_json::Value) {
    let mut last = serde_json::Value::Null;
    let ok = wait_for(Duration::from_secs(20), || {
        last = query(ix, tokens, lora);
        last == expect
    });
    assert!(
        ok,
        "query {tokens:?} lora={lora:?}: got {last}, want {expect}\nindexer log:\n{}",
        ix.log_tail()
    );
}

pub(super) fn tier(matched: u64, cpu: u64, disk: u64) -> serde_json::Value {
    // `dp` is the device-tier score per DP rank: kvcr pages are never there.
    serde_json::json!({"longest_matched": matched, "gpu": 0, "dp": {"0": 0}, "cpu": cpu, "disk": disk})
}

/// Starts Dynamo's standalone indexer (`py`) on `port`, logging to
/// `realclients/tmp/<name>-<pid>.log`, and waits for its `/health`.
pub(super) fn start_indexer(py: &std::path::Path, port: u16, name: &str) -> Indexer {
    let dir = realclients_dir().join("tmp");
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join(format!("{name}-{}.log", std::process::id()));
    let out = std::fs::File::create(&log).unwrap();
    let ix = Indexer {
        child: Command::new(py)
            .args(["-m", "dynamo.indexer", "--block-size", &BS.to_string()])
            .args(["--port", &port.to_string(), "--threads", "1"])
            .env("RUST_LOG", "info")
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap(),
        port,
        log,
    };
    wait_until("the indexer's /health", Duration::from_secs(60), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            && http(port, "GET", "/health", &serde_json::Value::Null).0 == 200
    });
    ix
}

/// Enters a private network namespace with only loopback, on this thread
/// (children and the publisher's threads started from it inherit it).
pub(super) fn private_netns(required: bool) -> bool {
    if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
        assert!(
            !required,
            "KVCR_TEST_DYNAMO=1 but unshare(CLONE_NEWNET) failed: {e}"
        );
        println!("SKIP: cannot create a network namespace ({e})");
        return false;
    }
    let up = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status();
    assert!(up.is_ok_and(|s| s.success()), "ip link set lo up");
    true
}

#[test]
fn dynamo_indexer_answers_exactly_what_kvcr_published() {
    let _serial = sockets_lock();
    let Some(py) = real_client("KVCR_TEST_DYNAMO", "import dynamo.llm") else {
        return;
    };
    if !private_netns(std::env::var("KVCR_TEST_DYNAMO").is_ok_and(|v| v == "1")) {
        return;
    }
    let ix = start_indexer(&py, 18090, "indexer");

    let a: Vec<u32> = (1..=16).collect(); // 4 blocks
    let cpu = scope(Owner::Kvcr, 1, Medium::CpuPinned);
    let disk = scope(Owner::Kvcr, 1, Medium::Disk);
    // Dynamo 1.6.1's standalone indexer knows only the worker residency
    // domain: it indexes kvcr's streams published without the `ownership`
    // field, and silently ignores events tagged `ownership: "kvcr"` (the
    // CacheOwner domain), checked with worker 3.
    let stream_mode = |w| {
        let mut c = config(w);
        c.ownership = OwnershipWire::Stream;
        c
    };
    let p1 = Publisher::start(stream_mode(1)).unwrap();
    let p2 = Publisher::start(stream_mode(2)).unwrap();
    let p3 = Publisher::start(config(3)).unwrap();
    let (mut s1, mut s2, mut s3) = (p1.sink(), p2.sink(), p3.sink());
    // Events handed to worker 1's sink (the probe loop below sends a number
    // that depends on how fast the indexer answers).
    let mut s1_events = 0u64;
    s3.publish(&stored(
        cpu,
        &[501, 502, 503, 504],
        None,
        a.clone(),
        BS,
        None,
    ));
    // Worker 1 publishes before it is registered: the indexer's first seq is
    // past 0, a gap it must fill by replay (the attach barrier and this store).
    s1_events += 1;
    s1.publish(&stored(
        cpu,
        &[101, 102, 103, 104],
        None,
        a.clone(),
        BS,
        None,
    ));
    s2.publish(&stored(disk, &[201, 202], None, a[..8].to_vec(), BS, None));
    wait_until("both stores sequenced", Duration::from_secs(10), || {
        p1.stats().core.batches >= 2 && p2.stats().core.batches >= 2
    });
    register(&ix, 1, &p1);
    register(&ix, 2, &p2);
    register(&ix, 3, &p3);
    // Live traffic after registration reveals the gap; replay fills it.
    let mut probe = 1000u64;
    let mut both = serde_json::Value::Null;
    let want = serde_json::json!({"1": tier(16, 16, 16), "2": tier(8, 0, 8)});
    let ok = wait_for(Duration::from_secs(30), || {
        probe += 1;
        let t = vec![probe as u32; BS as usize];
        s1_events += 1;
        s1.publish(&stored(cpu, &[probe], None, t.clone(), BS, Some("probe")));
        s2.publish(&stored(disk, &[probe], None, t.clone(), BS, Some("probe")));
        s3.publish(&stored(cpu, &[probe], None, t, BS, Some("probe")));
        both = query(&ix, &a, None);
        both == want && p3.stats().replay_requests >= 1
    });
    assert!(
        ok,
        "replayed history: got {both}, want {want}\nindexer log:\n{}",
        ix.log_tail()
    );

    // Removals: worker 1 drops its last two blocks.
    s1_events += 1;
    s1.publish(&removed(cpu, &[103, 104]));
    expect_query(
        &ix,
        &a,
        None,
        serde_json::json!({"1": tier(8, 8, 8), "2": tier(8, 0, 8)}),
    );

    // Two LoRA adapters over the same tokens are different pages.
    let la = scope(Owner::Kvcr, 2, Medium::CpuPinned);
    let lb = scope(Owner::Kvcr, 3, Medium::CpuPinned);
    s1_events += 1;
    s1.publish(&stored(
        la,
        &[301, 302, 303, 304],
        None,
        a.clone(),
        BS,
        Some("lora-a"),
    ));
    s1_events += 1;
    s1.publish(&stored(
        lb,
        &[401, 402, 403],
        None,
        a[..12].to_vec(),
        BS,
        Some("lora-b"),
    ));
    expect_query(
        &ix,
        &a,
        Some("lora-a"),
        serde_json::json!({"1": tier(16, 16, 16)}),
    );
    expect_query(
        &ix,
        &a,
        Some("lora-b"),
        serde_json::json!({"1": tier(12, 12, 12)}),
    );
    s1_events += 1;
    s1.publish(&removed(lb, &[402, 403]));
    expect_query(
        &ix,
        &a,
        Some("lora-b"),
        serde_json::json!({"1": tier(4, 4, 4)}),
    );
    expect_query(
        &ix,
        &a,
        Some("lora-a"),
        serde_json::json!({"1": tier(16, 16, 16)}),
    );
    expect_query(
        &ix,
        &a,
        None,
        serde_json::json!({"1": tier(8, 8, 8), "2": tier(8, 0, 8)}),
    );

    // A clear (reset barrier) wipes worker 1's kvcr inventory, not worker 2's.
    s1_events += 1;
    s1.publish(&InventoryEvent::AllCleared {
        owner: Owner::Kvcr,
        incarnation: inc(0x1234_5678_9abc_def0_0fed_cba9_8765_4321),
    });
    expect_query(&ix, &a, None, serde_json::json!({"2": tier(8, 0, 8)}));
    expect_query(&ix, &a, Some("lora-a"), serde_json::json!({}));

    // Resynchronisation from the buffer: the indexer forgets worker 1, we keep
    // publishing, and a fresh registration replays the whole buffered history.
    unregister(&ix, 1);
    s1_events += 1;
    s1.publish(&stored(
        cpu,
        &[111, 112, 113],
        None,
        a[..12].to_vec(),
        BS,
        None,
    ));
    wait_until("the store sequenced", Duration::from_secs(10), || {
        p1.stats().core.events_in >= s1_events
    });
    register(&ix, 1, &p1);
    wait_until(
        "the buffered history replayed",
        Duration::from_secs(30),
        || {
            probe += 1;
            let t = vec![probe as u32; BS as usize];
            s1_events += 1;
            s1.publish(&stored(cpu, &[probe], None, t, BS, Some("probe")));
            query(&ix, &a, None) == serde_json::json!({"1": tier(12, 12, 12), "2": tier(8, 0, 8)})
        },
    );

    // Detach: the closing barrier removes everything the worker published.
    let st1 = p1.close().unwrap();
    expect_query(&ix, &a, None, serde_json::json!({"2": tier(8, 0, 8)}));
    let st2 = p2.close().unwrap();
    let st3 = p3.close().unwrap();
    assert!(
        st3.core.stored_blocks >= 4 && st3.replay_batches >= 2,
        "{st3:?}"
    );
    expect_query(&ix, &a, None, serde_json::json!({}));
    assert_eq!(st1.queue_dropped + st2.queue_dropped, 0);
    assert_eq!(st1.replay_aborted + st2.replay_aborted, 0);
    assert!(st1.replay_requests >= 2, "{st1:?}");
    let _ = std::fs::remove_file(&ix.log);
}

/// `/query` with an optional cache salt.
fn query_salted(ix: &Indexer, tokens: &[u32], salt: Option<&str>) -> serde_json::Value {
    let mut body = serde_json::json!({"token_ids": tokens, "model_name": MODEL});
    if let Some(s) = salt {
        body["cache_salt"] = s.into();
    }
    let (status, v) = http(ix.port, "POST", "/query", &body);
    assert_eq!(status, 200, "{v}");
    v["instances"].clone()
}

/// Dynamo's indexer keeps a salted tenant's pages apart (a `cache_salt` on
/// the wire), reads the `CPU` medium as host memory, and an indexer that
/// registers a worker after its stream went quiet converges without any new
/// page: the heartbeat shows it the gap and replay fills it.
#[test]
fn dynamo_indexer_keeps_salts_apart_and_a_late_registration_converges_by_heartbeat() {
    let _serial = sockets_lock();
    let Some(py) = real_client("KVCR_TEST_DYNAMO", "import dynamo.llm") else {
        return;
    };
    if !private_netns(std::env::var("KVCR_TEST_DYNAMO").is_ok_and(|v| v == "1")) {
        return;
    }
    let ix = start_indexer(&py, 18091, "indexer-late");
    let mut c = config(4);
    c.ownership = OwnershipWire::Stream;
    c.heartbeat = Some(Duration::from_millis(100));
    let p = Publisher::start(c).unwrap();
    let mut sink = p.sink();
    let base: Vec<u32> = (1..=16).collect();
    let other: Vec<u32> = (101..=116).collect();
    let cpu = scope(Owner::Kvcr, 1, Medium::Cpu);
    let salted = scope(Owner::Kvcr, 2, Medium::Cpu);
    sink.publish(&stored(cpu, &[1, 2, 3, 4], None, base.clone(), BS, None));
    sink.publish(&InventoryEvent::Stored {
        scope: salted,
        keys: [11, 12, 13, 14].map(BlockKey::from_u64).to_vec(),
        parent: None,
        token_ids: other.clone(),
        block_size: BS,
        lora_name: None,
        lora_id: None,
        cache_salt: Some("tenant-a".to_owned()),
    });
    // Quiet: everything sequenced, then heartbeats only.
    wait_until("the stream went quiet", Duration::from_secs(20), || {
        p.stats().core.heartbeats >= 3
    });
    register(&ix, 4, &p);
    let want = serde_json::json!({"4": tier(16, 16, 16)});
    let mut last = serde_json::Value::Null;
    let converged = wait_for(Duration::from_secs(30), || {
        last = query_salted(&ix, &base, None);
        last == want
    });
    assert!(
        converged,
        "late registration: got {last}, want {want}\nindexer log:\n{}",
        ix.log_tail()
    );
    // The driver publishes its counters after the round that served the
    // replay: the indexer may answer before they are out.
    wait_until(
        "the replay request counted",
        Duration::from_secs(10),
        || p.stats().replay_requests >= 1,
    );
    // The replayed batches are applied one by one: wait for the tenant's.
    let mut salted = serde_json::Value::Null;
    let tenant_seen = wait_for(Duration::from_secs(10), || {
        salted = query_salted(&ix, &other, Some("tenant-a"));
        salted == want
    });
    assert!(tenant_seen, "the tenant's pages: got {salted}, want {want}");
    assert_eq!(
        query_salted(&ix, &other, None),
        serde_json::json!({}),
        "unsalted never matches salted"
    );
    assert_eq!(
        query_salted(&ix, &base, Some("tenant-a")),
        serde_json::json!({}),
        "salted never matches unsalted"
    );
    assert_eq!(
        query_salted(&ix, &other, Some("tenant-b")),
        serde_json::json!({}),
        "salts never cross"
    );
    let stats = p.close().unwrap();
    assert_eq!(stats.queue_dropped, 0);
}
