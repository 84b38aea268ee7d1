//! Unit tests of the publisher core, wire encoder and replay buffer.

use bytes::Bytes;
use rstest::rstest;

use super::core::{BatchLimits, PublisherCore, Sequenced, TopicParts, Transmit};
use super::replay::{ReplayBuffer, ReplayRequest, parse_request};
use super::serve::{Admission, Outgoing, ReplayPeers, Sent};
use super::wire::{OwnershipWire, WireBatch, WireEvent, encode_batch_to_vec};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::key::{BlockKey, NamespaceId};
use kvcr_contracts::tier::{InventoryEvent, InventoryScope, Medium, Owner};

const PARTS: TopicParts = TopicParts {
    worker_id: 7,
    dp_rank: 1,
};
const BS: u32 = 2;

fn inc(n: u128) -> Incarnation {
    Incarnation::from_raw(n).unwrap()
}

fn scope(owner: Owner, ns: u64) -> InventoryScope {
    InventoryScope {
        owner,
        namespace: NamespaceId(ns),
        medium: Medium::CpuPinned,
    }
}

fn keys(ks: &[u64]) -> Vec<BlockKey> {
    ks.iter().copied().map(BlockKey::from_u64).collect()
}

fn tokens_for(ks: &[u64]) -> Vec<u32> {
    ks.iter()
        .flat_map(|&k| (0..BS).map(move |i| (k as u32) * 10 + i))
        .collect()
}

fn stored(owner: Owner, ns: u64, ks: &[u64], parent: Option<u64>) -> InventoryEvent {
    InventoryEvent::Stored {
        scope: scope(owner, ns),
        keys: keys(ks),
        parent: parent.map(BlockKey::from_u64),
        token_ids: tokens_for(ks),
        block_size: BS,
        lora_name: None,
        lora_id: None,
        cache_salt: None,
    }
}

fn removed(owner: Owner, ns: u64, ks: &[u64]) -> InventoryEvent {
    InventoryEvent::Removed {
        scope: scope(owner, ns),
        keys: keys(ks),
    }
}

fn core() -> PublisherCore {
    core_with(BatchLimits::default(), 1 << 20)
}

fn core_with(limits: BatchLimits, max_live: usize) -> PublisherCore {
    PublisherCore::new(PARTS, inc(0xabc), limits, max_live)
}

/// Everything pending, as a compact text: one line per batch.
fn drain(core: &mut PublisherCore) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(Sequenced { topic, seq, batch }) = core.poll_batch(1.5) {
        let events: Vec<String> = batch.events.iter().map(render).collect();
        let topic = String::from_utf8(topic.to_vec()).unwrap();
        let short = topic.rsplit('.').next().unwrap().trim_start_matches('0');
        out.push(format!("{seq} {short}: {}", events.join(" | ")));
    }
    out
}

fn render(e: &WireEvent) -> String {
    let own = |o: &Owner| match o {
        Owner::Framework => "fw",
        Owner::Kvcr => "kvcr",
    };
    match e {
        WireEvent::Stored {
            hashes,
            parent,
            token_ids,
            owner,
            ..
        } => {
            assert_eq!(token_ids.len(), hashes.len() * BS as usize);
            format!("S{}{hashes:?}<-{parent:?}", own(owner))
        }
        WireEvent::Removed { hashes, owner, .. } => format!("R{}{hashes:?}", own(owner)),
        WireEvent::Cleared { owner } => format!("C{}", own(owner)),
    }
}

#[test]
fn attach_barrier_is_sequence_zero() {
    let mut c = core();
    assert_eq!(drain(&mut c), ["0 abc: Ckvcr"]);
    assert_eq!(drain(&mut c), Vec::<String>::new());
}

#[test]
fn stores_merge_along_the_chain_and_removals_merge() {
    let mut c = core();
    c.handle(&stored(Owner::Kvcr, 1, &[1, 2], None));
    c.handle(&stored(Owner::Kvcr, 1, &[3], Some(2)));
    c.handle(&stored(Owner::Kvcr, 1, &[9], Some(42))); // not a continuation
    c.handle(&removed(Owner::Kvcr, 1, &[1]));
    c.handle(&removed(Owner::Kvcr, 1, &[2]));
    assert_eq!(
        drain(&mut c),
        ["0 abc: Ckvcr | Skvcr[1, 2, 3]<-None | Skvcr[9]<-Some(42) | Rkvcr[1, 2]"]
    );
}

#[test]
fn one_removed_per_stored() {
    let mut c = core();
    drain(&mut c);
    c.handle(&stored(Owner::Kvcr, 1, &[1, 2], None));
    c.handle(&stored(Owner::Kvcr, 1, &[1, 2, 3], None)); // 1, 2 are live: only 3
    c.handle(&removed(Owner::Kvcr, 1, &[2, 2, 5])); // second 2 and unknown 5 dropped
    c.handle(&removed(Owner::Kvcr, 2, &[1])); // another namespace: not live there
    c.handle(&removed(Owner::Kvcr, 1, &[2]));
    assert_eq!(drain(&mut c), ["1 abc: Skvcr[1, 2, 3]<-None | Rkvcr[2]"]);
    let s = c.stats();
    assert_eq!((s.stored_blocks, s.stored_repeats), (3, 2));
    assert_eq!((s.removed_blocks, s.removed_unknown), (1, 4));
    assert_eq!(c.live_blocks(), 2);
}

#[test]
fn a_repeat_in_the_middle_splits_the_chain_with_the_right_parents() {
    let mut c = core();
    drain(&mut c);
    c.handle(&stored(Owner::Kvcr, 1, &[2], Some(1)));
    c.handle(&stored(Owner::Kvcr, 1, &[1, 2, 3, 4], None));
    assert_eq!(
        drain(&mut c),
        ["1 abc: Skvcr[2]<-Some(1) | Skvcr[1]<-None | Skvcr[3, 4]<-Some(2)"]
    );
}

#[rstest]
#[case::repeat_in_keys(&[1, 2, 1], None, None, BS)]
#[case::parent_repeats(&[1, 2], Some(2), None, BS)]
#[case::empty(&[], None, None, BS)]
#[case::zero_block_size(&[1], None, None, 0)]
#[case::token_count(&[1, 2], None, Some(3), BS)]
#[case::block_larger_than_batch(&[1], None, None, 1 << 21)]
fn invalid_stores_are_not_sent(
    #[case] ks: &[u64],
    #[case] parent: Option<u64>,
    #[case] n_tokens: Option<usize>,
    #[case] block_size: u32,
) {
    let mut c = core();
    drain(&mut c);
    let token_ids = match n_tokens {
        Some(n) => vec![0; n],
        None => vec![0; ks.len() * block_size as usize],
    };
    c.handle(&InventoryEvent::Stored {
        scope: scope(Owner::Kvcr, 1),
        keys: keys(ks),
        parent: parent.map(BlockKey::from_u64),
        token_ids,
        block_size,
        lora_name: None,
        lora_id: None,
        cache_salt: None,
    });
    assert_eq!(drain(&mut c), Vec::<String>::new());
    assert_eq!(c.stats().stored_rejected, 1);
    assert_eq!(c.live_blocks(), 0);
}

#[test]
fn oversized_lora_name_is_rejected() {
    let mut c = core();
    drain(&mut c);
    c.handle(&InventoryEvent::Stored {
        scope: scope(Owner::Kvcr, 1),
        keys: keys(&[1]),
        parent: None,
        token_ids: tokens_for(&[1]),
        block_size: BS,
        lora_name: Some("x".repeat(super::core::MAX_LORA_NAME + 1)),
        lora_id: None,
        cache_salt: None,
    });
    assert_eq!(c.stats().stored_rejected, 1);
}

#[test]
fn owners_never_share_a_batch_and_each_opens_with_a_barrier() {
    let mut c = core();
    c.handle(&stored(Owner::Kvcr, 1, &[1], None));
    c.handle(&stored(Owner::Framework, 1, &[1], None));
    c.handle(&stored(Owner::Framework, 1, &[2], Some(1)));
    c.handle(&stored(Owner::Kvcr, 1, &[2], Some(1)));
    assert_eq!(
        drain(&mut c),
        [
            "0 abc: Ckvcr | Skvcr[1]<-None",
            "1 abc: Cfw | Sfw[1, 2]<-None",
            "2 abc: Skvcr[2]<-Some(1)",
        ]
    );
}

#[test]
fn namespaces_never_merge() {
    let mut c = core();
    drain(&mut c);
    c.handle(&stored(Owner::Kvcr, 1, &[1], None));
    c.handle(&stored(Owner::Kvcr, 2, &[2], Some(1)));
    c.handle(&removed(Owner::Kvcr, 1, &[1]));
    c.handle(&removed(Owner::Kvcr, 2, &[2]));
    assert_eq!(
        drain(&mut c),
        ["1 abc: Skvcr[1]<-None | Skvcr[2]<-Some(1) | Rkvcr[1] | Rkvcr[2]"]
    );
}

#[test]
fn a_new_incarnation_closes_the_old_one_under_its_own_topic() {
    let mut c = core();
    c.handle(&stored(Owner::Kvcr, 1, &[1], None));
    c.handle(&stored(Owner::Framework, 1, &[5], None));
    c.handle(&InventoryEvent::AllCleared {
        owner: Owner::Kvcr,
        incarnation: inc(0xdef),
    });
    c.handle(&removed(Owner::Kvcr, 1, &[1])); // forgotten by the reset
    c.handle(&stored(Owner::Kvcr, 1, &[1], None)); // fresh again
    assert_eq!(
        drain(&mut c),
        [
            "0 abc: Ckvcr | Skvcr[1]<-None",
            "1 abc: Cfw | Sfw[5]<-None | Cfw",
            "2 abc: Ckvcr",
            "3 def: Ckvcr | Skvcr[1]<-None",
        ]
    );
    assert_eq!(c.incarnation(), inc(0xdef));
}

#[test]
fn a_clear_in_the_same_incarnation_forgets_only_that_owner() {
    let mut c = core();
    c.handle(&stored(Owner::Kvcr, 1, &[1], None));
    c.handle(&stored(Owner::Framework, 1, &[1], None));
    c.handle(&InventoryEvent::AllCleared {
        owner: Owner::Kvcr,
        incarnation: inc(0xabc),
    });
    c.handle(&removed(Owner::Kvcr, 1, &[1]));
    c.handle(&removed(Owner::Framework, 1, &[1]));
    assert_eq!(
        drain(&mut c),
        [
            "0 abc: Ckvcr | Skvcr[1]<-None",
            "1 abc: Cfw | Sfw[1]<-None",
            "2 abc: Ckvcr",
            "3 abc: Rfw[1]",
        ]
    );
}

#[test]
fn lost_events_resync_with_a_barrier_and_close_clears_every_opened_owner() {
    let mut c = core();
    c.handle(&stored(Owner::Kvcr, 1, &[1], None));
    c.lost();
    c.handle(&removed(Owner::Kvcr, 1, &[1])); // forgotten: not sent
    c.handle(&stored(Owner::Framework, 1, &[3], None));
    c.close();
    c.handle(&stored(Owner::Kvcr, 1, &[4], None)); // after close: ignored
    assert_eq!(
        drain(&mut c),
        [
            "0 abc: Ckvcr | Skvcr[1]<-None | Ckvcr",
            "1 abc: Cfw | Sfw[3]<-None | Cfw",
            "2 abc: Ckvcr",
        ]
    );
    assert_eq!(c.stats().resyncs, 1);
    assert!(c.is_closed());
}

#[rstest]
#[case::blocks(
    BatchLimits { max_events: 128, max_blocks: 3, max_tokens: 1 << 20 },
    &[
        "1 abc: Skvcr[1, 2, 3]<-Some(100)",
        "2 abc: Skvcr[4, 5, 6]<-Some(3)",
        "3 abc: Skvcr[7]<-Some(6) | Rkvcr[1, 2]",
        "4 abc: Rkvcr[3, 4, 5]",
        "5 abc: Rkvcr[6, 7]",
    ],
)]
#[case::tokens(
    // Room for 3 blocks of tokens; removals carry no tokens.
    BatchLimits { max_events: 128, max_blocks: 8192, max_tokens: 3 * BS as usize + 1 },
    &[
        "1 abc: Skvcr[1, 2, 3]<-Some(100)",
        "2 abc: Skvcr[4, 5, 6]<-Some(3)",
        "3 abc: Skvcr[7]<-Some(6) | Rkvcr[1, 2, 3, 4, 5, 6, 7]",
    ],
)]
fn long_chains_split_across_batches_with_chained_parents(
    #[case] limits: BatchLimits,
    #[case] expect: &[&str],
) {
    let mut c = core_with(limits, 1 << 20);
    drain(&mut c);
    c.handle(&stored(Owner::Kvcr, 1, &[1, 2, 3, 4, 5, 6, 7], Some(100)));
    c.handle(&removed(Owner::Kvcr, 1, &[1, 2, 3, 4, 5, 6, 7]));
    assert_eq!(drain(&mut c), expect);
}

#[test]
fn events_per_batch_are_bounded() {
    let limits = BatchLimits {
        max_events: 2,
        ..BatchLimits::default()
    };
    let mut c = core_with(limits, 1 << 20);
    for k in 0..3 {
        c.handle(&stored(Owner::Kvcr, k, &[k + 1], None));
    }
    assert_eq!(
        drain(&mut c),
        [
            "0 abc: Ckvcr | Skvcr[1]<-None",
            "1 abc: Skvcr[2]<-None | Skvcr[3]<-None",
        ]
    );
}

#[test]
fn the_ledger_is_bounded_and_stops_the_chain_at_the_bound() {
    let mut c = core_with(BatchLimits::default(), 3);
    drain(&mut c);
    c.handle(&stored(Owner::Kvcr, 1, &[1, 2, 3, 4, 5], None));
    assert_eq!(drain(&mut c), ["1 abc: Skvcr[1, 2, 3]<-None"]);
    assert_eq!(c.stats().stored_over_capacity, 2);
    c.handle(&removed(Owner::Kvcr, 1, &[1]));
    c.handle(&stored(Owner::Kvcr, 1, &[6], None));
    assert_eq!(drain(&mut c), ["2 abc: Rkvcr[1] | Skvcr[6]<-None"]);
}

#[test]
fn topic_names_worker_dp_and_incarnation() {
    assert_eq!(
        PARTS.topic(inc(0xabc)),
        "kvcr.w7.dp1.00000000000000000000000000000abc"
    );
}

// ----- wire primitives (byte-exact against msgspec's choices) -----

fn removed_payload(hash: u64) -> Vec<u8> {
    encode_batch_to_vec(&WireBatch {
        ts: 2.0,
        events: vec![WireEvent::Removed {
            hashes: vec![hash],
            medium: Medium::Gpu,
            owner: Owner::Framework,
        }],
        dp_rank: None,
        ownership: OwnershipWire::Field,
    })
}

#[rstest]
#[case::fixint(0x7f, &[0x7f])]
#[case::uint8(0x80, &[0xcc, 0x80])]
#[case::uint8_max(0xff, &[0xcc, 0xff])]
#[case::uint16(0x100, &[0xcd, 0x01, 0x00])]
#[case::uint32(0x1_0000, &[0xce, 0, 1, 0, 0])]
#[case::uint64(1 << 32, &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0])]
#[case::u64_max(u64::MAX, &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff])]
fn hashes_use_the_smallest_unsigned_encoding(#[case] hash: u64, #[case] expect: &[u8]) {
    let p = removed_payload(hash);
    // [93 cb <8> 91 83 a4"type" ac"BlockRemoved" ac"block_hashes" 91 <hash> ...]
    let at = 1 + 9 + 1 + 1 + 5 + 13 + 13 + 1;
    assert_eq!(&p[at..at + expect.len()], expect);
}

#[test]
fn batch_envelope_bytes() {
    let p = encode_batch_to_vec(&WireBatch {
        ts: 1.5,
        events: vec![WireEvent::Cleared {
            owner: Owner::Framework,
        }],
        dp_rank: Some(300),
        ownership: OwnershipWire::Field,
    });
    let mut expect = vec![0x93, 0xcb];
    expect.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
    expect.extend_from_slice(&[0x91, 0x81, 0xa4]);
    expect.extend_from_slice(b"type");
    expect.push(0xb0);
    expect.extend_from_slice(b"AllBlocksCleared");
    expect.extend_from_slice(&[0xcd, 0x01, 0x2c]);
    assert_eq!(p, expect);
}

#[rstest]
#[case::fixarray(15, &[0x9f])]
#[case::array16(16, &[0xdc, 0x00, 0x10])]
#[case::array16_max(0xffff, &[0xdc, 0xff, 0xff])]
#[case::array32(0x1_0000, &[0xdd, 0x00, 0x01, 0x00, 0x00])]
fn array_headers(#[case] n: usize, #[case] expect: &[u8]) {
    let p = encode_batch_to_vec(&WireBatch {
        ts: 0.0,
        events: vec![WireEvent::Removed {
            hashes: vec![1; n],
            medium: Medium::Gpu,
            owner: Owner::Framework,
        }],
        dp_rank: None,
        ownership: OwnershipWire::Field,
    });
    let at = 1 + 9 + 1 + 1 + 5 + 13 + 13;
    assert_eq!(&p[at..at + expect.len()], expect);
}

#[rstest]
#[case::fixstr(31, &[0xbf])]
#[case::str8(32, &[0xd9, 32])]
#[case::str16(256, &[0xda, 0x01, 0x00])]
fn lora_name_string_headers(#[case] n: usize, #[case] expect: &[u8]) {
    let p = encode_batch_to_vec(&WireBatch {
        ts: 0.0,
        events: vec![WireEvent::Stored {
            hashes: vec![],
            parent: None,
            token_ids: vec![],
            block_size: 1,
            lora_name: Some("l".repeat(n)),
            lora_id: None,
            cache_salt: None,
            medium: Medium::Gpu,
            owner: Owner::Framework,
        }],
        dp_rank: None,
        ownership: OwnershipWire::Field,
    });
    let needle = b"\xa9lora_name";
    let at = p.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len();
    assert_eq!(&p[at..at + expect.len()], expect);
    assert_eq!(p.len(), at + expect.len() + n + 1); // then dp_rank nil
}

// ----- replay -----

fn t(seq: u64, len: usize) -> Transmit {
    Transmit {
        topic: Bytes::from_static(b"t"),
        seq,
        payload: Bytes::from(vec![0; len]),
    }
}

#[test]
fn replay_buffer_is_bounded_by_count_and_bytes() {
    let mut b = ReplayBuffer::new(3, 100);
    for s in 0..5 {
        b.push(t(s, 10));
    }
    assert_eq!(b.oldest(), Some(2));
    assert_eq!(b.len(), 3);
    let seqs: Vec<u64> = b.from_seq(3).map(|t| t.seq).collect();
    assert_eq!(seqs, [3, 4]);
    let seqs: Vec<u64> = b.from_seq(0).map(|t| t.seq).collect();
    assert_eq!(seqs, [2, 3, 4]);
    assert_eq!(b.from_seq(9).count(), 0);
    b.push(t(5, 95));
    assert_eq!((b.oldest(), b.bytes()), (Some(5), 95));
    b.push(t(6, 500)); // alone over the byte bound: still kept
    assert_eq!((b.oldest(), b.len()), (Some(6), 1));
    let mut none = ReplayBuffer::new(0, 100);
    none.push(t(0, 1));
    assert!(none.is_empty());
}

#[rstest]
#[case::ok(vec![b"id".to_vec(), vec![], 5u64.to_be_bytes().to_vec()], Some(5))]
#[case::max(vec![b"id".to_vec(), vec![], vec![0xff; 8]], Some(u64::MAX))]
#[case::two_frames(vec![vec![], 5u64.to_be_bytes().to_vec()], None)]
#[case::no_delimiter(vec![b"id".to_vec(), b"x".to_vec(), 5u64.to_be_bytes().to_vec()], None)]
#[case::short_seq(vec![b"id".to_vec(), vec![], vec![0; 4]], None)]
#[case::long_seq(vec![b"id".to_vec(), vec![], vec![0; 9]], None)]
#[case::four_frames(vec![b"id".to_vec(), vec![], vec![0; 8], vec![]], None)]
#[case::empty_identity(vec![vec![], vec![], vec![0; 8]], None)]
fn replay_requests(#[case] frames: Vec<Vec<u8>>, #[case] start: Option<u64>) {
    let got = parse_request(frames);
    assert_eq!(
        got,
        start.map(|start_seq| ReplayRequest {
            identity: b"id".to_vec(),
            start_seq
        })
    );
}

#[test]
fn stream_ownership_mode_omits_the_field_only() {
    let batch = |ownership| WireBatch {
        ts: 0.0,
        events: vec![
            WireEvent::Removed {
                hashes: vec![1],
                medium: Medium::CpuPinned,
                owner: Owner::Kvcr,
            },
            WireEvent::Cleared { owner: Owner::Kvcr },
        ],
        dp_rank: None,
        ownership,
    };
    let field = encode_batch_to_vec(&batch(OwnershipWire::Field));
    let stream = encode_batch_to_vec(&batch(OwnershipWire::Stream));
    let needle = b"\xa9ownership\xa4kvcr";
    let count = |p: &[u8]| p.windows(needle.len()).filter(|w| *w == needle).count();
    assert_eq!((count(&field), count(&stream)), (2, 0));
    assert_eq!(field.len() - stream.len(), 2 * needle.len());
}

// ----- heartbeat, salt and LoRA id -----

#[test]
fn a_heartbeat_is_an_empty_batch_on_a_quiet_stream_only() {
    let mut c = core();
    // Pending work (the attach barrier) goes first; no heartbeat beside it.
    c.heartbeat();
    assert_eq!(drain(&mut c), ["0 abc: Ckvcr"]);
    c.heartbeat();
    assert_eq!(drain(&mut c), ["1 abc: "]);
    c.handle(&stored(Owner::Kvcr, 1, &[1], None));
    c.heartbeat();
    assert_eq!(drain(&mut c), ["2 abc: Skvcr[1]<-None"]);
    assert_eq!(c.stats().heartbeats, 1);
    c.close();
    drain(&mut c);
    c.heartbeat();
    assert_eq!(drain(&mut c), Vec::<String>::new(), "closed: silent");
}

fn tagged(
    ks: &[u64],
    parent: Option<u64>,
    salt: Option<&str>,
    lora_id: Option<u64>,
) -> InventoryEvent {
    match stored(Owner::Kvcr, 1, ks, parent) {
        InventoryEvent::Stored {
            scope,
            keys,
            parent,
            token_ids,
            block_size,
            ..
        } => InventoryEvent::Stored {
            scope,
            keys,
            parent,
            token_ids,
            block_size,
            lora_name: lora_id.map(|id| format!("adapter-{id}")),
            lora_id,
            cache_salt: salt.map(str::to_owned),
        },
        other => other,
    }
}

#[test]
fn salts_and_lora_ids_never_merge_and_reach_the_wire() {
    let mut c = core();
    drain(&mut c);
    c.handle(&tagged(&[1], None, Some("tenant-a"), None));
    c.handle(&tagged(&[2], Some(1), Some("tenant-b"), None));
    c.handle(&tagged(&[3], Some(2), Some("tenant-b"), None));
    c.handle(&tagged(&[4], Some(3), None, Some(7)));
    let batch = c.poll_batch(0.0).unwrap().batch;
    let tags: Vec<_> = batch
        .events
        .iter()
        .map(|e| match e {
            WireEvent::Stored {
                hashes,
                cache_salt,
                lora_id,
                ..
            } => (hashes.clone(), cache_salt.clone(), *lora_id),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        tags,
        [
            (vec![1], Some("tenant-a".to_owned()), None),
            (vec![2, 3], Some("tenant-b".to_owned()), None),
            (vec![4], None, Some(7)),
        ]
    );
    // The bytes: `lora_id` in vLLM's slot, `cache_salt` appended after the
    // declared fields, and the map header counts it.
    let bytes = encode_batch_to_vec(&batch);
    let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let events = value.as_array().unwrap()[1].as_array().unwrap();
    let keys_of = |i: usize| -> Vec<(String, rmpv::Value)> {
        events[i]
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.clone()))
            .collect()
    };
    let salted = keys_of(0);
    let names: Vec<&str> = salted.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "ownership",
            "cache_salt"
        ]
    );
    assert_eq!(salted[9].1, rmpv::Value::from("tenant-a"));
    let adapter = keys_of(2);
    assert_eq!(adapter[5], ("lora_id".to_owned(), rmpv::Value::from(7u64)));
    assert_eq!(adapter[7].1, rmpv::Value::from("adapter-7"));
    assert!(adapter.iter().all(|(k, _)| k != "cache_salt"));
}

#[test]
fn an_oversized_cache_salt_is_rejected() {
    let mut c = core();
    drain(&mut c);
    c.handle(&tagged(
        &[1],
        None,
        Some(&"s".repeat(super::core::MAX_LORA_NAME + 1)),
        None,
    ));
    assert_eq!(drain(&mut c), Vec::<String>::new());
    assert_eq!(c.stats().stored_rejected, 1);
}

// ----- replay peers -----

/// A buffer of `n` batches (seq 0..n) of `len` payload bytes.
fn buffer(n: u64, len: usize) -> ReplayBuffer {
    let mut b = ReplayBuffer::new(1000, 1 << 30);
    for s in 0..n {
        b.push(t(s, len));
    }
    b
}

/// What one message to peer `id` weighs: identity, topic "t", seq, payload.
fn weight(id: &[u8], len: usize) -> usize {
    id.len() + 1 + 8 + len
}

#[derive(Default)]
struct Wire {
    /// (peer, seq or None for the end marker) in send order.
    sent: Vec<(Vec<u8>, Option<u64>)>,
    /// Peers that never read: they take this many messages, then are full.
    silent: Vec<(Vec<u8>, usize)>,
    gone: Vec<Vec<u8>>,
}

impl Wire {
    fn send(&mut self, id: &[u8], out: Outgoing<'_>) -> Sent {
        if self.gone.iter().any(|g| g == id) {
            return Sent::Gone;
        }
        if let Some((_, room)) = self.silent.iter_mut().find(|(s, _)| s == id) {
            if *room == 0 {
                return Sent::Full;
            }
            *room -= 1;
        }
        let seq = match out {
            Outgoing::Batch(t) => Some(t.seq),
            Outgoing::End => None,
        };
        self.sent.push((id.to_vec(), seq));
        Sent::Accepted
    }

    fn to(&self, id: &[u8]) -> Vec<Option<u64>> {
        self.sent
            .iter()
            .filter(|(p, _)| p == id)
            .map(|(_, s)| *s)
            .collect()
    }
}

#[test]
fn a_reading_peer_gets_the_whole_range_charged_for_two_messages() {
    let b = buffer(600, 100);
    let mut peers = ReplayPeers::new(4, 1 << 20);
    peers.connection(true);
    assert_eq!(peers.request(b"a".to_vec(), 5, &b), Admission::Answering);
    let mut wire = Wire::default();
    let mut rounds = 0;
    while peers.open_replies() > 0 {
        peers.pump(&b, |id, out| wire.send(id, out));
        rounds += 1;
        assert!(rounds < 10, "the reply makes progress every pump");
    }
    let mut want: Vec<Option<u64>> = (5..600).map(Some).collect();
    want.push(None);
    assert_eq!(wire.to(b"a"), want);
    // Answered: the last batch and the end marker stay charged until the
    // connection goes.
    assert_eq!(peers.queued_bytes(), weight(b"a", 100) + 1 + 8);
    assert_eq!(peers.peak_bytes(), 2 * weight(b"a", 100));
    peers.connection(false);
    peers.reclaim();
    assert_eq!(peers.queued_bytes(), 0);
}

#[test]
fn a_silent_peer_is_charged_two_messages_and_others_go_on() {
    let b = buffer(100, 1000);
    let mut peers = ReplayPeers::new(4, 1 << 20);
    let mut wire = Wire {
        silent: vec![(b"s".to_vec(), 2)],
        ..Wire::default()
    };
    for id in [b"s", b"h"] {
        peers.connection(true);
        peers.request(id.to_vec(), 0, &b);
    }
    for _ in 0..3 {
        peers.pump(&b, |id, out| wire.send(id, out));
    }
    assert_eq!(wire.to(b"s"), [Some(0), Some(1)]);
    assert_eq!(wire.to(b"h").len(), 101, "the honest peer got it all");
    assert_eq!(peers.open_replies(), 1);
    // Leaving mid-reply releases the charge.
    wire.gone.push(b"s".to_vec());
    let pumped = peers.pump(&b, |id, out| wire.send(id, out));
    assert_eq!(pumped.abandoned, 1);
    assert_eq!(peers.open_replies(), 0);
    assert_eq!(peers.queued_bytes(), weight(b"h", 1000) + 1 + 8);
}

#[test]
fn the_byte_cap_holds_and_waiting_replies_resume() {
    let b = buffer(50, 1000);
    let one = weight(b"x", 1000);
    // Room for four messages: a silent peer holds two, a reader streams
    // through the other two.
    let mut peers = ReplayPeers::new(8, 4 * one);
    let mut wire = Wire {
        silent: vec![(b"x".to_vec(), 2)],
        ..Wire::default()
    };
    peers.connection(true);
    peers.connection(true);
    peers.request(b"x".to_vec(), 0, &b);
    peers.request(b"y".to_vec(), 0, &b);
    for _ in 0..200 {
        peers.pump(&b, |id, out| wire.send(id, out));
        assert!(peers.queued_bytes() <= 4 * one, "{}", peers.queued_bytes());
    }
    assert_eq!(wire.to(b"y").len(), 51, "the reader got everything");
    assert_eq!(peers.peak_bytes(), 4 * one);
    // With room for three, a second reader gets one message, then waits for
    // the silent peer, and resumes when it leaves.
    let mut peers = ReplayPeers::new(8, 3 * one);
    let mut wire = Wire {
        silent: vec![(b"x".to_vec(), 2)],
        ..Wire::default()
    };
    peers.connection(true);
    peers.connection(true);
    peers.request(b"x".to_vec(), 0, &b);
    peers.request(b"y".to_vec(), 0, &b);
    for _ in 0..20 {
        peers.pump(&b, |id, out| wire.send(id, out));
    }
    assert_eq!(wire.to(b"y").len(), 1, "waiting under the cap");
    assert_eq!(peers.queued_bytes(), 3 * one);
    wire.gone.push(b"x".to_vec());
    for _ in 0..20 {
        peers.pump(&b, |id, out| wire.send(id, out));
    }
    assert_eq!(wire.to(b"y").len(), 51, "resumed");
    // A batch larger than the cap alone goes when nothing else is held.
    let big = buffer(3, 10 * one);
    let mut alone = ReplayPeers::new(1, one);
    alone.connection(true);
    alone.request(b"z".to_vec(), 0, &big);
    let mut wire = Wire::default();
    for _ in 0..10 {
        alone.pump(&big, |id, out| wire.send(id, out));
    }
    assert_eq!(wire.to(b"z").len(), 4);
}

#[test]
fn past_max_replies_the_longest_unread_reply_makes_room() {
    let b = buffer(10, 10);
    let mut peers = ReplayPeers::new(2, 1 << 20);
    let mut wire = Wire {
        silent: vec![(b"a".to_vec(), 1), (b"b".to_vec(), 2)],
        ..Wire::default()
    };
    for _ in 0..3 {
        peers.connection(true);
    }
    peers.request(b"a".to_vec(), 0, &b);
    peers.pump(&b, |id, out| wire.send(id, out));
    peers.request(b"b".to_vec(), 0, &b);
    peers.pump(&b, |id, out| wire.send(id, out));
    assert_eq!(peers.stalled_replies(), 2);
    // "a" last read in the first pump: it makes room, and is owed the end.
    assert_eq!(peers.request(b"c".to_vec(), 0, &b), Admission::Displaced);
    wire.silent.retain(|(id, _)| id != b"a");
    peers.pump(&b, |id, out| wire.send(id, out));
    assert_eq!(wire.to(b"a"), [Some(0), None]);
    assert_eq!(wire.to(b"c").len(), 11);
    assert_eq!(peers.open_replies(), 1);
}

#[test]
fn past_max_replies_a_request_is_refused_and_a_repeat_restarts() {
    let b = buffer(10, 10);
    let mut peers = ReplayPeers::new(2, 1 << 20);
    assert_eq!(peers.request(b"a".to_vec(), 0, &b), Admission::Answering);
    assert_eq!(peers.request(b"b".to_vec(), 0, &b), Admission::Answering);
    assert_eq!(peers.request(b"c".to_vec(), 0, &b), Admission::Refused);
    // A peer already answered restarts from its new start.
    assert_eq!(peers.request(b"a".to_vec(), 8, &b), Admission::Answering);
    let mut wire = Wire::default();
    peers.connection(true);
    peers.connection(true);
    peers.pump(&b, |id, out| wire.send(id, out));
    assert_eq!(wire.to(b"a"), [Some(8), Some(9), None]);
    assert_eq!(
        wire.to(b"c"),
        [None],
        "the refused peer gets the end marker"
    );
}

#[test]
fn reclaim_forgets_the_smallest_answered_charges_beyond_the_connections() {
    let small = buffer(1, 10);
    let large = buffer(1, 1000);
    let mut peers = ReplayPeers::new(8, 1 << 20);
    let mut wire = Wire::default();
    for _ in 0..3 {
        peers.connection(true);
    }
    peers.request(b"p".to_vec(), 0, &small);
    peers.request(b"q".to_vec(), 0, &large);
    peers.pump(&large, |id, out| wire.send(id, out));
    peers.request(b"r".to_vec(), 0, &large);
    peers.pump(&large, |id, out| wire.send(id, out));
    let full = peers.queued_bytes();
    // One connection closed: one of three answered peers is gone, which one
    // is unknown, so the smallest charge is forgotten.
    peers.connection(false);
    peers.reclaim();
    let smallest = full - peers.queued_bytes();
    assert!(smallest > 0 && smallest <= weight(b"q", 1000) + 1 + 8);
    peers.reclaim();
    assert_eq!(full - peers.queued_bytes(), smallest, "once");
}
