//! The peer control frame codec: snapshots of every frame, a table of malformed
//! frames and their errors, and property tests (round trip, no panics).

use bytes::BytesMut;
use kvcr_contracts::error::FrameReason;
use kvcr_contracts::protocol::codec::{
    FrameCodec, MAX_DEVICE_EXPORT, MAX_DEVICE_REGIONS, MAX_ELEMENTS_PER_WRITE, MAX_KEYS_PER_WRITE,
    MAX_SPANS_PER_KEY,
};
use kvcr_contracts::protocol::{
    Body, CompletedIndices, DeviceRegionAdvert, DoorbellAdvert, ElementRef, ElementRun, Header,
    Message, OpHandle, RegionAdvert, RegionId, RouteGeneration, SegmentAdvert, SharedMemoryAdvert,
    WriteOutcome,
};
use kvcr_contracts::{BlockKey, ControlEndpoint, Incarnation, NamespaceId};
use proptest::prelude::*;
use rstest::rstest;

fn inc(raw: u128) -> Incarnation {
    Incarnation::from_raw(raw).unwrap()
}

fn header() -> Header {
    Header {
        sender: inc(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff),
        route_generation: RouteGeneration(3),
        sender_endpoint: ControlEndpoint::parse("tcp://[fd00::7]:25001").unwrap(),
    }
}

fn region(id: u32) -> RegionAdvert {
    RegionAdvert {
        id: RegionId(id),
        label: format!("kvcr-dram/{id}"),
        base: 0x7f00_0000_0000,
        element_size: 262_144,
        stride: 262_144,
        count: 4096,
        rkey: vec![0xab, 0xcd, 0xef],
    }
}

fn device_region(id: u32) -> DeviceRegionAdvert {
    DeviceRegionAdvert {
        id: RegionId(id),
        base: 0x7e00_0000_0000 + u64::from(id) * 0x1000_0000,
        element_size: 65_536,
        stride: 131_072,
        count: 512,
        export: vec![id as u8; 64],
    }
}

fn shared_memory(regions: &[u32]) -> SharedMemoryAdvert {
    SharedMemoryAdvert {
        boot_id: [0x5a; 16],
        pid_namespace: 4_026_531_836,
        pid: 4242,
        segments: regions
            .iter()
            .map(|&id| SegmentAdvert {
                region: RegionId(id),
                fd: 17 + id,
                token: [id as u8; 16],
            })
            .collect(),
    }
}

/// One fixed example of every message kind (and every outcome).
fn examples() -> Vec<(&'static str, Body)> {
    vec![
        (
            "target_metadata",
            Body::TargetMetadata {
                worker_address: vec![1, 2, 3, 4],
                regions: vec![region(0), region(1)],
                shared_memory: None,
                doorbell: None,
                device_regions: vec![],
            },
        ),
        (
            "target_metadata_shared_memory",
            Body::TargetMetadata {
                worker_address: vec![1, 2, 3, 4],
                regions: vec![region(0), region(1)],
                shared_memory: Some(shared_memory(&[1])),
                doorbell: None,
                device_regions: vec![],
            },
        ),
        (
            "target_metadata_doorbell",
            Body::TargetMetadata {
                worker_address: vec![1, 2, 3, 4],
                regions: vec![region(0), region(1)],
                shared_memory: Some(shared_memory(&[0, 1])),
                doorbell: Some(DoorbellAdvert {
                    region: RegionId(1),
                    key: [0xd0; 32],
                }),
                device_regions: vec![],
            },
        ),
        (
            "target_metadata_device",
            Body::TargetMetadata {
                worker_address: vec![1, 2, 3, 4],
                regions: vec![region(0)],
                shared_memory: Some(shared_memory(&[0])),
                doorbell: None,
                device_regions: vec![device_region(1), device_region(2)],
            },
        ),
        (
            "target_metadata_ack_none",
            Body::TargetMetadataAck {
                op_handle: None,
                one_copy: false,
                device: false,
            },
        ),
        (
            "target_metadata_ack_op",
            Body::TargetMetadataAck {
                op_handle: Some(OpHandle(42)),
                one_copy: true,
                device: false,
            },
        ),
        (
            "target_metadata_ack_device",
            Body::TargetMetadataAck {
                op_handle: None,
                one_copy: true,
                device: true,
            },
        ),
        (
            "start_write",
            Body::StartWrite {
                op_handle: OpHandle(42),
                remaining_timeout_ms: 1000,
                source_incarnation: Some(inc(5)),
                namespace: NamespaceId(0x0102_0304_0506_0708),
                keys: vec![
                    BlockKey::from_u64(10),
                    BlockKey::from_i64(-1),
                    BlockKey::from_u64(12),
                ],
                destinations: vec![
                    vec![ElementRef {
                        region: RegionId(0),
                        index: 7,
                    }]
                    .into(),
                    // One run: regions 0 and 1 at index 8.
                    vec![
                        ElementRef {
                            region: RegionId(0),
                            index: 8,
                        },
                        ElementRef {
                            region: RegionId(1),
                            index: 8,
                        },
                    ]
                    .into(),
                    // Two runs: a region skipped ends the first.
                    vec![
                        ElementRef {
                            region: RegionId(5),
                            index: 3,
                        },
                        ElementRef {
                            region: RegionId(6),
                            index: 3,
                        },
                        ElementRef {
                            region: RegionId(9),
                            index: 3,
                        },
                    ]
                    .into(),
                ],
                lead_elements: 1,
            },
        ),
        (
            "write_refused",
            Body::WriteRefused {
                op_handle: OpHandle(42),
            },
        ),
        (
            "write_done_completed",
            Body::WriteDone {
                op_handle: OpHandle(42),
                outcome: WriteOutcome::Completed(CompletedIndices::new(vec![0, 1, 3])),
            },
        ),
        (
            "write_done_completed_digests",
            Body::WriteDone {
                op_handle: OpHandle(42),
                outcome: WriteOutcome::Completed(CompletedIndices::with_digests(vec![
                    (3, 0x0102_0304_0506_0708),
                    (0, 7),
                ])),
            },
        ),
        (
            "write_done_completed_checked_in_copy",
            Body::WriteDone {
                op_handle: OpHandle(42),
                outcome: WriteOutcome::Completed(
                    CompletedIndices::with_digests(vec![(0, 7), (1, 9)]).checked_in_copy(),
                ),
            },
        ),
        (
            "write_done_failed_terminal",
            Body::WriteDone {
                op_handle: OpHandle(42),
                outcome: WriteOutcome::Failed { terminal: true },
            },
        ),
        (
            "write_done_failed_nonterminal",
            Body::WriteDone {
                op_handle: OpHandle(42),
                outcome: WriteOutcome::Failed { terminal: false },
            },
        ),
        (
            "write_probe",
            Body::WriteProbe {
                op_handle: OpHandle(42),
                source_incarnation: None,
            },
        ),
        (
            "write_probe_ack",
            Body::WriteProbeAck {
                op_handle: OpHandle(42),
                terminal: true,
                dead_incarnation: Some(inc(9)),
            },
        ),
        (
            "route_proof",
            Body::RouteProof {
                nonce: std::array::from_fn(|i| i as u8),
            },
        ),
        (
            "write_lead_landed",
            Body::WriteLeadLanded {
                op_handle: OpHandle(42),
                elements: 2,
            },
        ),
    ]
}

fn hex_dump(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .enumerate()
        .map(|(i, row)| {
            let hex: Vec<String> = row.iter().map(|b| format!("{b:02x}")).collect();
            format!("{:04x}: {}", i * 16, hex.join(" "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn encode(body: Body) -> Vec<u8> {
    FrameCodec::default()
        .encode_to_vec(&Message {
            header: header(),
            body,
        })
        .unwrap()
}

/// Every frame's exact bytes are pinned, so format drift fails a test.
#[test]
fn frame_snapshots() {
    let codec = FrameCodec::default();
    for (name, body) in examples() {
        let message = Message {
            header: header(),
            body,
        };
        let bytes = codec.encode_to_vec(&message).unwrap();
        assert_eq!(codec.decode_frame(&bytes).unwrap(), message, "{name}");
        insta::assert_snapshot!(format!("frame_{name}"), hex_dump(&bytes));
    }
}

/// The frame fuzzer's seeds are these examples, byte for byte: when the
/// codec changes they must be written again (they had stayed at version 1
/// through version 2, so every seed was refused at its version byte and
/// the fuzzer mutated from nothing valid). `KVCR_WRITE_FUZZ_SEEDS=1`
/// writes them from the examples instead (after a deliberate codec change).
#[test]
fn fuzz_seeds_are_the_current_examples() {
    let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/frame_decode");
    let codec = FrameCodec::default();
    let write = std::env::var("KVCR_WRITE_FUZZ_SEEDS").is_ok_and(|v| v == "1");
    for (name, body) in examples() {
        let message = Message {
            header: header(),
            body,
        };
        if write {
            std::fs::write(seeds.join(name), codec.encode_to_vec(&message).unwrap()).unwrap();
        }
        let seed = std::fs::read(seeds.join(name)).unwrap_or_else(|e| {
            panic!("seed {name}: {e}; write it from the snapshot (fuzz/seeds/frame_decode/{name})")
        });
        assert_eq!(
            seed,
            codec.encode_to_vec(&message).unwrap(),
            "seed {name} is stale"
        );
    }
}

#[test]
fn every_kind_has_an_example() {
    let kinds: std::collections::BTreeSet<_> =
        examples().iter().map(|(_, b)| b.kind_name()).collect();
    assert_eq!(kinds.len(), 9);
}

// ------------------------------------------------------------ malformed table

/// Offsets in a frame: 4 length, 2 magic, 1 version, 1 kind, 16 incarnation,
/// 8 route generation, then the endpoint's length byte.
const VERSION_AT: usize = 6;
const KIND_AT: usize = 7;
const INCARNATION_AT: usize = 8;
const ENDPOINT_LEN_AT: usize = 32;
const ENDPOINT_AT: usize = 33;

fn write_refused() -> Vec<u8> {
    encode(Body::WriteRefused {
        op_handle: OpHandle(1),
    })
}

fn body_start(frame: &[u8]) -> usize {
    ENDPOINT_AT + usize::from(frame[ENDPOINT_LEN_AT])
}

fn fix_len(mut frame: Vec<u8>) -> Vec<u8> {
    let len = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&len.to_be_bytes());
    frame
}

fn mutate(mut frame: Vec<u8>, at: usize, value: u8) -> Vec<u8> {
    frame[at] = value;
    frame
}

fn set_endpoint(endpoint: &[u8]) -> Vec<u8> {
    let frame = write_refused();
    let start = body_start(&frame);
    let mut out = frame[..ENDPOINT_LEN_AT].to_vec();
    out.push(endpoint.len() as u8);
    out.extend_from_slice(endpoint);
    out.extend_from_slice(&frame[start..]);
    fix_len(out)
}

fn probe_ack_with(terminal: u8, dead_tag: u8) -> Vec<u8> {
    let frame = encode(Body::WriteProbeAck {
        op_handle: OpHandle(1),
        terminal: false,
        dead_incarnation: None,
    });
    let at = body_start(&frame) + 8;
    mutate(mutate(frame, at, terminal), at + 1, dead_tag)
}

fn write_done_with_indices(indices: &[u32]) -> Vec<u8> {
    let frame = encode(Body::WriteDone {
        op_handle: OpHandle(1),
        outcome: WriteOutcome::Completed(CompletedIndices::new(vec![])),
    });
    // Without digests the frame ends in two empty counts: indices, digests.
    let mut out = frame[..frame.len() - 8].to_vec();
    out.extend_from_slice(&(indices.len() as u32).to_be_bytes());
    for i in indices {
        out.extend_from_slice(&i.to_be_bytes());
    }
    out.extend_from_slice(&0u32.to_be_bytes());
    fix_len(out)
}

/// A `write_done` of indices 0..`indices` carrying `digests` page digests.
fn write_done_with_digests(indices: u32, digests: u32) -> Vec<u8> {
    write_done_outcome_with_digests(0, indices, digests)
}

/// A `write_done` with outcome byte `outcome` (a completed one), `indices`
/// indices and `digests` digests.
fn write_done_outcome_with_digests(outcome: u8, indices: u32, digests: u32) -> Vec<u8> {
    let frame = encode(Body::WriteDone {
        op_handle: OpHandle(1),
        outcome: WriteOutcome::Completed(CompletedIndices::new(vec![])),
    });
    let mut out = frame[..frame.len() - 9].to_vec();
    out.push(outcome);
    out.extend_from_slice(&indices.to_be_bytes());
    for i in 0..indices {
        out.extend_from_slice(&i.to_be_bytes());
    }
    out.extend_from_slice(&digests.to_be_bytes());
    for d in 0..digests {
        out.extend_from_slice(&u64::from(d).to_be_bytes());
    }
    fix_len(out)
}

/// A layer-first page's elements decode as the one run the wire carries,
/// not as one entry per element, and name the same elements.
#[test]
fn a_layer_first_key_decodes_as_one_run() {
    let elements: Vec<ElementRef> = (0..128)
        .map(|region| ElementRef {
            region: RegionId(region),
            index: 42,
        })
        .collect();
    let frame = encode(Body::StartWrite {
        op_handle: OpHandle(1),
        remaining_timeout_ms: 5,
        source_incarnation: None,
        namespace: NamespaceId(0),
        keys: vec![BlockKey::from_u64(1)],
        destinations: vec![elements.clone().into()],
        lead_elements: 2,
    });
    let body = FrameCodec::default().decode_frame(&frame).unwrap().body;
    let Body::StartWrite { destinations, .. } = body else {
        panic!("not a start_write: {body:?}");
    };
    assert_eq!(
        destinations[0].runs(),
        [ElementRun::new(RegionId(0), 128, 42).unwrap()]
    );
    assert_eq!(destinations[0].to_vec(), elements);
}

fn start_write_bytes(edit: impl FnOnce(&mut Vec<u8>, usize)) -> Vec<u8> {
    let mut frame = encode(Body::StartWrite {
        op_handle: OpHandle(1),
        remaining_timeout_ms: 5,
        source_incarnation: None,
        namespace: NamespaceId(0),
        keys: vec![BlockKey::from_u64(1)],
        destinations: vec![
            vec![ElementRef {
                region: RegionId(0),
                index: 0,
            }]
            .into(),
        ],
        lead_elements: 0,
    });
    let at = body_start(&frame);
    edit(&mut frame, at);
    fix_len(frame)
}

fn metadata_with(edit: impl FnOnce(&mut RegionAdvert)) -> Vec<u8> {
    // Encode a valid region, then patch the bytes so the encoder's own checks
    // are bypassed and only the decoder judges.
    let mut r = region(0);
    let valid = encode(Body::TargetMetadata {
        worker_address: vec![1],
        regions: vec![r.clone()],
        shared_memory: None,
        doorbell: None,
        device_regions: vec![],
    });
    edit(&mut r);
    let at = body_start(&valid) + 2 + 1 + 2; // address len, address, region count
    let mut out = valid[..at].to_vec();
    out.extend_from_slice(&r.id.0.to_be_bytes());
    out.push(r.label.len() as u8);
    out.extend_from_slice(r.label.as_bytes());
    for v in [r.base, r.element_size, r.stride, r.count] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    out.extend_from_slice(&(r.rkey.len() as u16).to_be_bytes());
    out.extend_from_slice(&r.rkey);
    fix_len(out)
}

/// A valid metadata frame with one region (id 0) and one device region,
/// whose bytes are then rewritten from `edit`'s device region (the
/// encoder's own checks bypassed, so only the decoder judges).
fn device_metadata_with(edit: impl FnOnce(&mut DeviceRegionAdvert)) -> Vec<u8> {
    let mut device = device_region(1);
    let valid = encode(Body::TargetMetadata {
        worker_address: vec![1],
        regions: vec![region(0)],
        shared_memory: None,
        doorbell: None,
        device_regions: vec![device.clone()],
    });
    edit(&mut device);
    let at = valid.len() - (4 + 8 * 4 + 2 + 64);
    let mut out = valid[..at].to_vec();
    out.extend_from_slice(&device.id.0.to_be_bytes());
    for v in [
        device.base,
        device.element_size,
        device.stride,
        device.count,
    ] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    out.extend_from_slice(&(device.export.len() as u16).to_be_bytes());
    out.extend_from_slice(&device.export);
    fix_len(out)
}

/// A metadata frame claiming `count` device regions after a valid prefix.
fn device_count_lies(count: u16) -> Vec<u8> {
    let valid = device_metadata_with(|_| {});
    let at = valid.len() - (4 + 8 * 4 + 2 + 64) - 2;
    let mut out = valid;
    out[at..at + 2].copy_from_slice(&count.to_be_bytes());
    out
}

/// Device regions are validated like regions: ids, extents, the export's
/// size, their count; each table row is a frame a hostile target could send.
#[rstest]
#[case::shares_region_id(device_metadata_with(|d| d.id = RegionId(0)), FrameReason::DuplicateRegion(0))]
#[case::zero_size(device_metadata_with(|d| d.element_size = 0), FrameReason::Zero("device element_size"))]
#[case::zero_count(device_metadata_with(|d| d.count = 0), FrameReason::Zero("device count"))]
#[case::overlap(device_metadata_with(|d| d.stride = 1), FrameReason::DeviceRegionExtent(1))]
#[case::overflow(device_metadata_with(|d| d.base = u64::MAX - 10), FrameReason::DeviceRegionExtent(1))]
#[case::empty_export(device_metadata_with(|d| d.export.clear()), FrameReason::Empty("device export"))]
#[case::huge_export(device_metadata_with(|d| d.export = vec![1; MAX_DEVICE_EXPORT + 1]), FrameReason::Bound { field: "device export", count: MAX_DEVICE_EXPORT + 1, max: MAX_DEVICE_EXPORT })]
#[case::too_many(device_count_lies(MAX_DEVICE_REGIONS as u16 + 1), FrameReason::Bound { field: "device regions", count: MAX_DEVICE_REGIONS + 1, max: MAX_DEVICE_REGIONS })]
#[case::count_lies(device_count_lies(3), FrameReason::Truncated { needed: 12 })]
fn malformed_device_regions(#[case] bytes: Vec<u8>, #[case] expected: FrameReason) {
    let err = FrameCodec::default().decode_frame(&bytes).unwrap_err();
    assert_eq!(err.frame_reason(), Some(&expected), "{err}");
}

/// The encoder refuses a device region the decoder would refuse.
#[test]
fn encoder_refuses_device_region_sharing_an_id() {
    let body = Body::TargetMetadata {
        worker_address: vec![1],
        regions: vec![region(4)],
        shared_memory: None,
        doorbell: None,
        device_regions: vec![device_region(4)],
    };
    let err = FrameCodec::default()
        .encode_to_vec(&Message {
            header: header(),
            body,
        })
        .unwrap_err();
    assert_eq!(err.frame_reason(), Some(&FrameReason::DuplicateRegion(4)));
}

/// The table of malformed frames and the typed error each gives.
#[rstest]
#[case::empty(vec![], FrameReason::Truncated { needed: 4 })]
#[case::length_only(vec![0, 0, 0, 40], FrameReason::Truncated { needed: 40 })]
#[case::too_large(vec![0xff, 0xff, 0xff, 0xff], FrameReason::TooLarge { len: u32::MAX as usize, max: 16 << 20 })]
#[case::too_short(vec![0, 0, 0, 2, 0x4b, 0x56], FrameReason::TooShort { len: 2, min: 4 })]
#[case::magic(mutate(write_refused(), 4, 0), FrameReason::Magic(0x0056))]
#[case::version(mutate(write_refused(), VERSION_AT, 1), FrameReason::Version(1))]
#[case::kind_zero(mutate(write_refused(), KIND_AT, 0), FrameReason::Kind(0))]
#[case::kind_unknown(mutate(write_refused(), KIND_AT, 10), FrameReason::Kind(10))]
#[case::zero_incarnation({let mut f = write_refused(); f[INCARNATION_AT..INCARNATION_AT + 16].fill(0); f}, FrameReason::Zero("sender incarnation"))]
#[case::endpoint_utf8(set_endpoint(&[0xff, 0xfe]), FrameReason::Utf8("sender_endpoint"))]
#[case::trailing(fix_len([write_refused(), vec![0]].concat()), FrameReason::Trailing(1))]
#[case::truncated_body(fix_len(write_refused()[..write_refused().len() - 1].to_vec()), FrameReason::Truncated { needed: 1 })]
#[case::bool_byte(probe_ack_with(2, 0), FrameReason::Bool { field: "terminal", value: 2 })]
#[case::option_tag(probe_ack_with(0, 7), FrameReason::OptionTag { field: "dead_incarnation", value: 7 })]
#[case::zero_dead_incarnation(fix_len([probe_ack_with(0, 1), vec![0; 16]].concat()), FrameReason::Zero("dead_incarnation"))]
#[case::indices_repeat(write_done_with_indices(&[1, 1]), FrameReason::IndicesOrder)]
#[case::indices_descending(write_done_with_indices(&[3, 2]), FrameReason::IndicesOrder)]
#[case::digests_fewer(write_done_with_digests(3, 2), FrameReason::DigestCount)]
#[case::digests_more(write_done_with_digests(1, 2), FrameReason::DigestCount)]
#[case::checked_in_copy_without_digests(
    write_done_outcome_with_digests(3, 2, 0),
    FrameReason::DigestCount
)]
#[case::indices_count_lies({let mut f = write_done_with_indices(&[1]); let n = f.len(); f[n - 12..n - 8].copy_from_slice(&1000u32.to_be_bytes()); f}, FrameReason::Truncated { needed: 3992 })]
#[case::outcome_byte({let f = encode(Body::WriteDone { op_handle: OpHandle(1), outcome: WriteOutcome::Failed { terminal: true } }); let n = f.len(); mutate(f, n - 1, 9)}, FrameReason::OptionTag { field: "write outcome", value: 9 })]
#[case::zero_timeout(start_write_bytes(|f, at| f[at + 8..at + 12].fill(0)), FrameReason::Zero("remaining_timeout_ms"))]
#[case::no_keys(start_write_bytes(|f, at| { f.truncate(at + 12 + 1 + 8 + 2); f.extend_from_slice(&0u32.to_be_bytes()); }), FrameReason::Empty("keys"))]
#[case::too_many_keys(start_write_bytes(|f, at| f[at + 23..at + 27].copy_from_slice(&(MAX_KEYS_PER_WRITE as u32 + 1).to_be_bytes())), FrameReason::Bound { field: "keys", count: MAX_KEYS_PER_WRITE + 1, max: MAX_KEYS_PER_WRITE })]
#[case::key_count_lies(start_write_bytes(|f, at| f[at + 23..at + 27].copy_from_slice(&1000u32.to_be_bytes())), FrameReason::Truncated { needed: 23976 })]
#[case::no_destinations(start_write_bytes(|f, at| { f.truncate(at + 35); f.extend_from_slice(&0u16.to_be_bytes()); f.extend_from_slice(&[0; 14]); }), FrameReason::Empty("destinations of a key"))]
#[case::run_of_no_regions(start_write_bytes(|f, at| f[at + 41..at + 43].fill(0)), FrameReason::Zero("regions of a run"))]
#[case::run_past_the_last_region(start_write_bytes(|f, at| { f[at + 37..at + 41].fill(0xff); f[at + 41..at + 43].copy_from_slice(&2u16.to_be_bytes()); }), FrameReason::RegionRun { first: u32::MAX, regions: 2 })]
#[case::run_longer_than_a_key(start_write_bytes(|f, at| f[at + 41..at + 43].copy_from_slice(&(MAX_SPANS_PER_KEY as u16 + 1).to_be_bytes())), FrameReason::Bound { field: "destinations of a key", count: MAX_SPANS_PER_KEY + 1, max: MAX_SPANS_PER_KEY })]
#[case::runs_longer_than_a_write(start_write_bytes(|f, at| {
    // 257 keys of one full-length run each: 16 bytes of frame per 4096
    // elements, one key past what a write may name.
    let keys = MAX_ELEMENTS_PER_WRITE / MAX_SPANS_PER_KEY + 1;
    f[at + 23..at + 27].copy_from_slice(&(keys as u32).to_be_bytes());
    f[at + 41..at + 43].copy_from_slice(&(MAX_SPANS_PER_KEY as u16).to_be_bytes());
    let entry = f[at + 27..at + 51].to_vec();
    for _ in 1..keys { f.extend_from_slice(&entry); }
}), FrameReason::Bound { field: "destinations of a write", count: MAX_ELEMENTS_PER_WRITE + MAX_SPANS_PER_KEY, max: MAX_ELEMENTS_PER_WRITE })]
#[case::too_many_spans(start_write_bytes(|f, at| f[at + 35..at + 37].copy_from_slice(&(MAX_SPANS_PER_KEY as u16 + 1).to_be_bytes())), FrameReason::Bound { field: "destinations of a key", count: MAX_SPANS_PER_KEY + 1, max: MAX_SPANS_PER_KEY })]
#[case::lead_past_a_key(start_write_bytes(|f, at| f[at + 21..at + 23].copy_from_slice(&2u16.to_be_bytes())), FrameReason::Bound { field: "lead elements", count: 2, max: 1 })]
#[case::lead_landed_zero({let f = encode(Body::WriteLeadLanded { op_handle: OpHandle(1), elements: 2 }); let n = f.len(); mutate(f, n - 1, 0)}, FrameReason::Zero("lead elements"))]
#[case::region_label_empty(metadata_with(|r| r.label.clear()), FrameReason::Label(kvcr_contracts::error::Echo::new("")))]
#[case::region_label_chars(metadata_with(|r| r.label = "a b".into()), FrameReason::Label(kvcr_contracts::error::Echo::new("a b")))]
#[case::region_zero_size(metadata_with(|r| r.element_size = 0), FrameReason::Zero("region element_size"))]
#[case::region_zero_count(metadata_with(|r| r.count = 0), FrameReason::Zero("region count"))]
#[case::region_overlap(metadata_with(|r| r.stride = 1), FrameReason::RegionExtent(kvcr_contracts::error::Echo::new("kvcr-dram/0")))]
#[case::region_overflow(metadata_with(|r| r.base = u64::MAX - 10), FrameReason::RegionExtent(kvcr_contracts::error::Echo::new("kvcr-dram/0")))]
#[case::region_empty_rkey(metadata_with(|r| r.rkey.clear()), FrameReason::Empty("rkey"))]
#[case::region_huge_rkey(metadata_with(|r| r.rkey = vec![1; 5000]), FrameReason::Bound { field: "rkey", count: 5000, max: 4096 })]
fn malformed_frames(#[case] bytes: Vec<u8>, #[case] expected: FrameReason) {
    let err = FrameCodec::default().decode_frame(&bytes).unwrap_err();
    assert_eq!(err.frame_reason(), Some(&expected), "{err}");
}

#[rstest]
#[case::wildcard(b"tcp://0.0.0.0:1".as_slice())]
#[case::no_scheme(b"10.0.0.1:1".as_slice())]
#[case::port_zero(b"tcp://10.0.0.1:0".as_slice())]
fn bad_sender_endpoint(#[case] endpoint: &[u8]) {
    let err = FrameCodec::default()
        .decode_frame(&set_endpoint(endpoint))
        .unwrap_err();
    assert!(
        matches!(
            err.frame_reason(),
            Some(FrameReason::Endpoint {
                field: "sender_endpoint",
                ..
            })
        ),
        "{err}"
    );
}

#[test]
fn duplicate_region_ids_refused_both_ways() {
    let body = Body::TargetMetadata {
        worker_address: vec![1],
        regions: vec![region(3), region(3)],
        shared_memory: None,
        doorbell: None,
        device_regions: vec![],
    };
    let err = FrameCodec::default()
        .encode_to_vec(&Message {
            header: header(),
            body,
        })
        .unwrap_err();
    assert_eq!(err.frame_reason(), Some(&FrameReason::DuplicateRegion(3)));
}

/// The encoder refuses what the decoder would refuse, and writes nothing.
#[rstest]
#[case::mismatch(Body::StartWrite { op_handle: OpHandle(1), remaining_timeout_ms: 1, source_incarnation: None, namespace: NamespaceId(0), keys: vec![BlockKey::from_u64(1)], destinations: vec![], lead_elements: 0 }, FrameReason::LengthMismatch { keys: 1, destinations: 0 })]
#[case::zero_timeout(Body::StartWrite { op_handle: OpHandle(1), remaining_timeout_ms: 0, source_incarnation: None, namespace: NamespaceId(0), keys: vec![BlockKey::from_u64(1)], destinations: vec![vec![].into()], lead_elements: 0 }, FrameReason::Zero("remaining_timeout_ms"))]
#[case::empty_dest(Body::StartWrite { op_handle: OpHandle(1), remaining_timeout_ms: 1, source_incarnation: None, namespace: NamespaceId(0), keys: vec![BlockKey::from_u64(1)], destinations: vec![vec![].into()], lead_elements: 0 }, FrameReason::Empty("destinations of a key"))]
#[case::lead_past_a_key(Body::StartWrite { op_handle: OpHandle(1), remaining_timeout_ms: 1, source_incarnation: None, namespace: NamespaceId(0), keys: vec![BlockKey::from_u64(1)], destinations: vec![vec![ElementRef { region: RegionId(0), index: 0 }].into()], lead_elements: 2 }, FrameReason::Bound { field: "lead elements", count: 2, max: 1 })]
#[case::lead_landed_zero(Body::WriteLeadLanded { op_handle: OpHandle(1), elements: 0 }, FrameReason::Zero("lead elements"))]
#[case::elements_past_a_write(Body::StartWrite { op_handle: OpHandle(1), remaining_timeout_ms: 1, source_incarnation: None, namespace: NamespaceId(0), keys: (0..257).map(BlockKey::from_u64).collect(), destinations: vec![(0..4096).map(|r| ElementRef { region: RegionId(r), index: 0 }).collect(); 257], lead_elements: 0 }, FrameReason::Bound { field: "destinations of a write", count: MAX_ELEMENTS_PER_WRITE + MAX_SPANS_PER_KEY, max: MAX_ELEMENTS_PER_WRITE })]
#[case::empty_address(Body::TargetMetadata { worker_address: vec![], regions: vec![], shared_memory: None, doorbell: None, device_regions: vec![] }, FrameReason::Empty("worker_address"))]
#[case::stray_segment(Body::TargetMetadata { worker_address: vec![1], regions: vec![region(0)], shared_memory: Some(shared_memory(&[0, 5])), doorbell: None, device_regions: vec![] }, FrameReason::Bound { field: "segments", count: 2, max: 1 })]
#[case::unknown_segment(Body::TargetMetadata { worker_address: vec![1], regions: vec![region(0)], shared_memory: Some(shared_memory(&[5])), doorbell: None, device_regions: vec![] }, FrameReason::UnknownSegmentRegion(5))]
#[case::unknown_doorbell(Body::TargetMetadata { worker_address: vec![1], regions: vec![region(0)], shared_memory: None, doorbell: Some(DoorbellAdvert { region: RegionId(7), key: [5; 32] }), device_regions: vec![] }, FrameReason::UnknownDoorbellRegion(7))]
#[case::duplicate_segment(Body::TargetMetadata { worker_address: vec![1], regions: vec![region(0), region(1)], shared_memory: Some(shared_memory(&[1, 1])), doorbell: None, device_regions: vec![] }, FrameReason::DuplicateRegion(1))]
fn encoder_refuses(#[case] body: Body, #[case] expected: FrameReason) {
    let mut buf = BytesMut::new();
    let err = FrameCodec::default()
        .encode(
            &Message {
                header: header(),
                body,
            },
            &mut buf,
        )
        .unwrap_err();
    assert_eq!(err.frame_reason(), Some(&expected));
    assert!(buf.is_empty());
}

#[test]
fn encoder_respects_frame_bound() {
    let codec = FrameCodec::new(64);
    let body = Body::TargetMetadata {
        worker_address: vec![0; 100],
        regions: vec![],
        shared_memory: None,
        doorbell: None,
        device_regions: vec![],
    };
    let err = codec
        .encode_to_vec(&Message {
            header: header(),
            body,
        })
        .unwrap_err();
    assert!(matches!(
        err.frame_reason(),
        Some(FrameReason::TooLarge { max: 64, .. })
    ));
}

/// Streaming: frames split at every byte boundary decode the same, and a bad
/// frame in the middle is consumed so the next one still decodes.
#[test]
fn streaming_decode() {
    let codec = FrameCodec::default();
    let mut stream = Vec::new();
    let messages: Vec<Message> = examples()
        .into_iter()
        .map(|(_, body)| Message {
            header: header(),
            body,
        })
        .collect();
    for m in &messages {
        stream.extend(codec.encode_to_vec(m).unwrap());
    }
    for split in 0..stream.len().min(200) {
        let mut buf = BytesMut::from(&stream[..split]);
        let mut out = Vec::new();
        while let Some(m) = codec.decode(&mut buf).unwrap() {
            out.push(m);
        }
        buf.extend_from_slice(&stream[split..]);
        while let Some(m) = codec.decode(&mut buf).unwrap() {
            out.push(m);
        }
        assert_eq!(out, messages, "split at {split}");
        assert!(buf.is_empty());
    }
    let bad = mutate(write_refused(), VERSION_AT, 9);
    let good = write_refused();
    let mut buf = BytesMut::from(&[bad, good.clone()].concat()[..]);
    assert!(codec.decode(&mut buf).is_err());
    assert_eq!(
        codec.decode(&mut buf).unwrap(),
        Some(codec.decode_frame(&good).unwrap())
    );
}

// ------------------------------------------------------------ property tests

fn arb_incarnation() -> impl Strategy<Value = Incarnation> {
    (1u128..=u128::MAX).prop_map(inc)
}

fn arb_endpoint() -> impl Strategy<Value = ControlEndpoint> {
    let host = prop_oneof![
        any::<[u8; 4]>().prop_filter_map("unspecified", |o| {
            let ip = std::net::Ipv4Addr::from(o);
            (!ip.is_unspecified()).then(|| ip.to_string())
        }),
        any::<[u16; 8]>().prop_filter_map("unspecified", |s| {
            let ip = std::net::Ipv6Addr::from(s);
            (!ip.is_unspecified()).then(|| format!("[{ip}]"))
        }),
        "[a-z]([a-z0-9-]{0,18}[a-z0-9])?(\\.[a-z][a-z0-9]{0,10}){0,3}",
    ];
    (host, 1u16..=u16::MAX)
        .prop_map(|(h, p)| ControlEndpoint::parse(&format!("tcp://{h}:{p}")).unwrap())
}

fn arb_region(id: u32) -> impl Strategy<Value = RegionAdvert> {
    (
        "[A-Za-z0-9_./-]{1,64}",
        0u64..1 << 47,
        1u64..1 << 24,
        0u64..1 << 20,
        1u64..1 << 16,
        proptest::collection::vec(any::<u8>(), 1..64),
    )
        .prop_map(
            move |(label, base, size, extra, count, rkey)| RegionAdvert {
                id: RegionId(id),
                label,
                base,
                element_size: size,
                stride: size + extra,
                count,
                rkey,
            },
        )
}

/// A device region whose id stays clear of `arb_region`'s (`0..4`).
fn arb_device(n: u32) -> impl Strategy<Value = DeviceRegionAdvert> {
    (
        0u64..1 << 47,
        1u64..1 << 24,
        0u64..1 << 20,
        1u64..1 << 16,
        proptest::collection::vec(any::<u8>(), 1..=MAX_DEVICE_EXPORT),
    )
        .prop_map(
            move |(base, size, extra, count, export)| DeviceRegionAdvert {
                id: RegionId(100 + n),
                base,
                element_size: size,
                stride: size + extra,
                count,
                export,
            },
        )
}

fn arb_body() -> impl Strategy<Value = Body> {
    let op = any::<u64>().prop_map(OpHandle);
    prop_oneof![
        (
            proptest::collection::vec(any::<u8>(), 1..256),
            (0usize..4).prop_flat_map(|n| (0..n as u32).map(arb_region).collect::<Vec<_>>()),
            any::<bool>(),
            proptest::option::of(any::<[u8; 32]>()),
            (0usize..3).prop_flat_map(|n| (0..n as u32).map(arb_device).collect::<Vec<_>>()),
        )
            .prop_map(|(worker_address, regions, shared, key, device_regions)| {
                let ids: Vec<u32> = regions.iter().map(|r| r.id.0).collect();
                // The doorbell names the last region, when there is one.
                let doorbell = key.zip(ids.last()).map(|(key, id)| DoorbellAdvert {
                    region: RegionId(*id),
                    key,
                });
                Body::TargetMetadata {
                    worker_address,
                    regions,
                    shared_memory: shared.then(|| shared_memory(&ids)),
                    doorbell,
                    device_regions,
                }
            }),
        (
            proptest::option::of(op.clone()),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(op_handle, one_copy, device)| Body::TargetMetadataAck {
                op_handle,
                one_copy,
                device,
            }),
        (
            op.clone(),
            1u32..,
            proptest::option::of(arb_incarnation()),
            any::<u64>(),
            proptest::collection::vec(
                (
                    any::<u64>(),
                    prop_oneof![
                        proptest::collection::vec((any::<u32>(), any::<u64>()), 1..4),
                        // Layer-first: one slot across consecutive regions
                        // (one run on the wire), ending anywhere up to the
                        // last region id.
                        (any::<u32>(), 1u32..6, any::<u64>()).prop_map(|(end, n, i)| {
                            (end.saturating_sub(n - 1)..=end).map(|r| (r, i)).collect()
                        }),
                    ]
                ),
                1..16
            ),
            0u16..2,
        )
            .prop_map(|(op_handle, ms, src, ns, entries, lead)| Body::StartWrite {
                op_handle,
                remaining_timeout_ms: ms,
                source_incarnation: src,
                namespace: NamespaceId(ns),
                keys: entries
                    .iter()
                    .map(|(k, _)| BlockKey::from_u64(*k))
                    .collect(),
                destinations: entries
                    .iter()
                    .map(|(_, d)| d
                        .iter()
                        .map(|(r, i)| ElementRef {
                            region: RegionId(*r),
                            index: *i
                        })
                        .collect())
                    .collect(),
                lead_elements: lead,
            }),
        op.clone()
            .prop_map(|op_handle| Body::WriteRefused { op_handle }),
        (op.clone(), 1u16..).prop_map(|(op_handle, elements)| Body::WriteLeadLanded {
            op_handle,
            elements
        }),
        (
            op.clone(),
            prop_oneof![
                proptest::collection::vec(any::<u32>(), 0..64)
                    .prop_map(|v| WriteOutcome::Completed(CompletedIndices::new(v))),
                any::<bool>().prop_map(|terminal| WriteOutcome::Failed { terminal }),
            ]
        )
            .prop_map(|(op_handle, outcome)| Body::WriteDone { op_handle, outcome }),
        (op.clone(), proptest::option::of(arb_incarnation())).prop_map(
            |(op_handle, source_incarnation)| Body::WriteProbe {
                op_handle,
                source_incarnation
            }
        ),
        (op, any::<bool>(), proptest::option::of(arb_incarnation())).prop_map(
            |(op_handle, terminal, dead_incarnation)| Body::WriteProbeAck {
                op_handle,
                terminal,
                dead_incarnation
            }
        ),
        any::<[u8; 32]>().prop_map(|nonce| Body::RouteProof { nonce }),
    ]
}

fn arb_message() -> impl Strategy<Value = Message> {
    (arb_incarnation(), any::<u64>(), arb_endpoint(), arb_body()).prop_map(
        |(sender, generation, endpoint, body)| Message {
            header: Header {
                sender,
                route_generation: RouteGeneration(generation),
                sender_endpoint: endpoint,
            },
            body,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decode_encode_round_trip(message in arb_message()) {
        let codec = FrameCodec::default();
        let bytes = codec.encode_to_vec(&message).unwrap();
        prop_assert_eq!(codec.decode_frame(&bytes).unwrap(), message.clone());
        let mut buf = BytesMut::from(&bytes[..]);
        prop_assert_eq!(codec.decode(&mut buf).unwrap(), Some(message));
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let codec = FrameCodec::default();
        let _ = codec.decode_frame(&bytes);
        let mut buf = BytesMut::from(&bytes[..]);
        while let Ok(Some(_)) = codec.decode(&mut buf) {}
    }

    /// Flipping any byte of a valid frame gives an error or another valid
    /// message, never a panic; whatever decodes re-encodes to a frame that
    /// decodes to the same message (hosts are normalised, e.g. lowercased).
    #[test]
    fn mutated_frames_never_panic(message in arb_message(), at in any::<prop::sample::Index>(), value: u8) {
        let codec = FrameCodec::default();
        let mut bytes = codec.encode_to_vec(&message).unwrap();
        let i = at.index(bytes.len());
        bytes[i] = value;
        if let Ok(decoded) = codec.decode_frame(&bytes) {
            let again = codec.encode_to_vec(&decoded).unwrap();
            prop_assert_eq!(codec.decode_frame(&again).unwrap(), decoded);
        }
    }
}
