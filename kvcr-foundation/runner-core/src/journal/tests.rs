//! Tests of the residency journal: round trips, compaction, overflow, damage,
//! resume, a byte-level golden, and crash images cut at every byte (a
//! scripted workload exhaustively, random workloads against a model).

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::codec::*;
use super::crc::*;
use super::layout::*;
use super::writer::*;
use super::*;

// ---------------------------------------------------------------------------
// Harness

/// A region that keeps every write in order, so a crash can be cut after any
/// byte of them (program order is what a killed writer leaves behind).
struct Recording {
    bytes: Vec<u8>,
    log: Vec<(usize, Vec<u8>)>,
    fences: usize,
}

impl Recording {
    fn new(bytes: Vec<u8>) -> Self {
        Self {
            bytes,
            log: Vec::new(),
            fences: 0,
        }
    }

    /// Bytes written, in all.
    fn written(&self) -> usize {
        self.log.iter().map(|(_, b)| b.len()).sum()
    }

    /// `pre` with the first `cut` written bytes applied.
    fn crash_image(&self, pre: &[u8], cut: usize) -> Vec<u8> {
        let mut image = pre.to_vec();
        let mut left = cut;
        for (at, bytes) in &self.log {
            let n = left.min(bytes.len());
            image[*at..*at + n].copy_from_slice(&bytes[..n]);
            left -= n;
            if left == 0 {
                break;
            }
        }
        image
    }

    /// Every distinct crash image, in order: `(cut, image)` for the cut of
    /// no byte and after each written byte that changed the image.
    fn each_crash_image(&self, pre: &[u8], mut visit: impl FnMut(usize, &[u8])) {
        let mut image = pre.to_vec();
        visit(0, &image);
        let mut cut = 0;
        for (at, bytes) in &self.log {
            for (i, &b) in bytes.iter().enumerate() {
                cut += 1;
                if image[at + i] != b {
                    image[at + i] = b;
                    visit(cut, &image);
                }
            }
        }
    }
}

impl Region for Recording {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn put(&mut self, at: usize, bytes: &[u8]) -> Result<(), JournalError> {
        self.bytes.as_mut_slice().put(at, bytes)?;
        self.log.push((at, bytes.to_vec()));
        Ok(())
    }

    fn zero(&mut self, at: usize, len: usize) -> Result<(), JournalError> {
        self.put(at, &vec![0; len])
    }

    fn fence(&mut self) {
        self.fences += 1;
    }
}

/// The state a journal should hold: what `recover` must give back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Model {
    namespaces: Vec<RecoveredNamespace>,
    pages: Vec<RecoveredPage>,
    held: BTreeSet<u32>,
}

impl Model {
    fn of(r: &Recovered) -> Self {
        Self {
            namespaces: r.namespaces.clone(),
            pages: r.pages.clone(),
            held: r.held.iter().copied().collect(),
        }
    }

    /// Applies a record the writer accepted.
    fn apply(&mut self, record: &JournalRecord) {
        match record.clone() {
            JournalRecord::Namespace {
                id,
                compat,
                lora_name,
                cache_salt,
            } => {
                if !self.namespaces.iter().any(|n| n.id == id) {
                    self.namespaces.push(RecoveredNamespace {
                        id,
                        compat,
                        lora_name,
                        cache_salt,
                    });
                }
            }
            JournalRecord::Ready {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            } => self.pages.push(RecoveredPage {
                namespace,
                key,
                layout,
                slots,
                parent,
                token_ids,
            }),
            JournalRecord::Removed { namespace, key } => self
                .pages
                .retain(|p| (p.namespace, p.key) != (namespace, key)),
            JournalRecord::Held { slots } => self.held.extend(slots),
            JournalRecord::Freed { slots } => {
                for s in slots {
                    self.held.remove(&s);
                }
            }
        }
    }

    fn used(&self) -> BTreeSet<u32> {
        let mut used = self.held.clone();
        for p in &self.pages {
            used.extend(p.slots.iter().copied());
        }
        used
    }

    fn free(&self, universe: u32) -> Vec<u32> {
        let used = self.used();
        (0..universe).filter(|s| !used.contains(s)).collect()
    }
}

fn namespace(id: u64) -> JournalRecord {
    JournalRecord::Namespace {
        id,
        compat: id * 3,
        lora_name: None,
        cache_salt: None,
    }
}

fn ready(ns: u64, key: u64, slots: &[u32]) -> JournalRecord {
    JournalRecord::Ready {
        namespace: ns,
        key,
        layout: 1,
        slots: slots.to_vec(),
        parent: key.checked_sub(1),
        token_ids: (0..8).map(|t| key as u32 * 8 + t).collect(),
    }
}

fn removed(ns: u64, key: u64) -> JournalRecord {
    JournalRecord::Removed { namespace: ns, key }
}

fn held(slots: &[u32]) -> JournalRecord {
    JournalRecord::Held {
        slots: slots.to_vec(),
    }
}

fn freed(slots: &[u32]) -> JournalRecord {
    JournalRecord::Freed {
        slots: slots.to_vec(),
    }
}

/// A formatted region of `len` bytes with `records` appended; the model too.
fn journal(len: usize, records: &[JournalRecord]) -> (Vec<u8>, JournalWriter, Model) {
    let mut region = vec![0u8; len];
    let mut writer = JournalWriter::format(&mut region).unwrap();
    let mut model = Model::default();
    for r in records {
        writer.append(&mut region, r).unwrap();
        model.apply(r);
    }
    (region, writer, model)
}

#[track_caller]
fn check(region: &[u8], model: &Model) -> Recovered {
    let r = recover(region).unwrap();
    assert_eq!(Model::of(&r), *model);
    assert!(!r.torn_tail, "a complete journal reads as torn");
    r
}

/// The active half's frames: (offset in the region, frame length).
fn frames(region: &[u8]) -> Vec<(usize, usize)> {
    let head = read_header(region).unwrap();
    let base = half_start(head.active, head.half_len);
    let half = &region[base..base + head.half_len];
    let mut at = 0;
    let mut out = Vec::new();
    while let Some(f) = frame_at(half, at, head.epoch) {
        out.push((base + at, f.next - at));
        at = f.next;
    }
    out
}

/// What every recovered state must satisfy, whatever the bytes were.
fn consistent(r: &Recovered) -> bool {
    let mut seen = BTreeSet::new();
    let held_sorted = r.held.windows(2).all(|w| w[0] < w[1]);
    let mut ok = held_sorted && r.held.iter().all(|s| seen.insert(*s));
    for p in &r.pages {
        ok &= !p.slots.is_empty() && p.slots.iter().all(|s| seen.insert(*s));
        ok &= r.namespaces.iter().any(|n| n.id == p.namespace);
    }
    ok
}

// ---------------------------------------------------------------------------
// Unit tests

#[test]
fn crc32_is_ieee() {
    let mut crc = Crc32::new();
    crc.update(b"123456789");
    assert_eq!(crc.finish(), 0xCBF4_3926);
    let mut split = Crc32::new();
    split.update(b"1234");
    split.update(b"56789");
    assert_eq!(split.finish(), 0xCBF4_3926);
}

#[test]
fn every_record_kind_round_trips() {
    let records = [
        JournalRecord::Namespace {
            id: 7,
            compat: 0xfeed,
            lora_name: Some("adapter-α".into()),
            cache_salt: Some("tenant".into()),
        },
        namespace(8),
        ready(7, 100, &[3, 1, 2]),
        JournalRecord::Ready {
            namespace: 8,
            key: 100,
            layout: u16::MAX,
            slots: vec![u32::MAX],
            parent: None,
            token_ids: vec![],
        },
        held(&[10, 11, 12]),
        freed(&[11]),
        removed(7, 100),
        ready(7, 101, &[1]),
    ];
    let (region, writer, model) = journal(64 * 1024, &records);
    let r = check(&region, &model);
    assert!(!r.torn_tail);
    assert_eq!(r.records, 8);
    assert_eq!(r.held, vec![10, 12]);
    assert_eq!(r.pages.len(), 2);
    assert_eq!(r.pages[0].slots, vec![u32::MAX]);
    assert_eq!(writer.stats().records, 8);
    assert_eq!(writer.stats().live_pages, 2);
    assert_eq!(writer.stats().held_slots, 2);
    // Payload level: each encodes to its declared length and decodes back.
    for record in &records {
        let mut buf = Vec::new();
        record.view().encode(&mut buf);
        assert_eq!(buf.len(), record.view().payload_len());
        assert_eq!(decode(&buf), Ok(record.clone()));
    }
}

#[test]
fn records_at_their_caps_round_trip_and_over_them_are_refused() {
    let max = JournalRecord::Ready {
        namespace: 1,
        key: 1,
        layout: 0,
        slots: (0..MAX_SLOTS as u32).collect(),
        parent: Some(0),
        token_ids: (0..MAX_TOKEN_IDS as u32).collect(),
    };
    let mut buf = Vec::new();
    max.view().encode(&mut buf);
    assert_eq!(buf.len(), MAX_PAYLOAD);
    let long = "x".repeat(MAX_STRING);
    let ns = JournalRecord::Namespace {
        id: 1,
        compat: 1,
        lora_name: Some(long.clone()),
        cache_salt: Some(long.clone()),
    };
    let (mut region, mut writer, mut model) =
        journal(2 * (MAX_PAYLOAD + 16 * 1024) + HEADER_LEN, &[ns, max]);
    check(&region, &model);

    let over = [
        (
            JournalRecord::Ready {
                namespace: 1,
                key: 2,
                layout: 0,
                slots: vec![MAX_SLOTS as u32],
                parent: None,
                token_ids: vec![0; MAX_TOKEN_IDS + 1],
            },
            "token_ids",
        ),
        (
            held(&(10_000..10_001 + MAX_SLOTS as u32).collect::<Vec<_>>()),
            "slots",
        ),
        (
            JournalRecord::Namespace {
                id: 2,
                compat: 0,
                lora_name: None,
                cache_salt: Some(format!("{long}y")),
            },
            "cache_salt",
        ),
    ];
    for (record, what) in over {
        let before = region.clone();
        let err = writer.append(&mut region, &record).unwrap_err();
        assert!(
            matches!(err, JournalError::Refused(Refusal::TooLong { what: w, .. }) if w == what),
            "{err:?}"
        );
        assert_eq!(region, before);
    }
    // Still journaling.
    writer.append(&mut region, &removed(1, 1)).unwrap();
    model.apply(&removed(1, 1));
    check(&region, &model);
}

#[test]
fn the_writer_refuses_records_that_do_not_follow_its_state() {
    let setup = [
        namespace(1),
        ready(1, 10, &[0, 1]),
        held(&[5, 6]),
        JournalRecord::Namespace {
            id: 2,
            compat: 0,
            lora_name: Some("a".into()),
            cache_salt: None,
        },
    ];
    let cases = [
        (
            removed(1, 11),
            Refusal::PageNotLive {
                namespace: 1,
                key: 11,
            },
        ),
        (
            removed(3, 10),
            Refusal::PageNotLive {
                namespace: 3,
                key: 10,
            },
        ),
        (
            ready(1, 10, &[2]),
            Refusal::PageLive {
                namespace: 1,
                key: 10,
            },
        ),
        (ready(3, 11, &[2]), Refusal::UnknownNamespace(3)),
        (ready(1, 11, &[2, 1]), Refusal::SlotInUse(1)),
        (ready(1, 11, &[6]), Refusal::SlotInUse(6)),
        (ready(1, 11, &[2, 3, 2]), Refusal::DuplicateSlot(2)),
        (ready(1, 11, &[]), Refusal::NoSlots),
        (held(&[0]), Refusal::SlotInUse(0)),
        (held(&[5]), Refusal::SlotInUse(5)),
        (held(&[]), Refusal::NoSlots),
        (freed(&[5, 7]), Refusal::SlotNotHeld(7)),
        (freed(&[0]), Refusal::SlotNotHeld(0)),
        (freed(&[5, 5]), Refusal::DuplicateSlot(5)),
        (namespace(2), Refusal::NamespaceConflict(2)),
    ];
    for (record, refusal) in cases {
        let (mut region, mut writer, mut model) = journal(4096, &setup);
        let before = region.clone();
        assert_eq!(
            writer.append(&mut region, &record),
            Err(JournalError::Refused(refusal)),
            "{record:?}"
        );
        assert_eq!(region, before, "{record:?} changed the region");
        for ok in [freed(&[5]), ready(1, 11, &[5, 2])] {
            writer.append(&mut region, &ok).unwrap();
            model.apply(&ok);
        }
        check(&region, &model);
    }
    // The same namespace again is a no-op, not a record.
    let (mut region, mut writer, model) = journal(4096, &setup);
    let before = region.clone();
    writer.append(&mut region, &namespace(1)).unwrap();
    assert_eq!(region, before);
    assert_eq!(check(&region, &model).records, 4);
    // Another region length is refused.
    let mut other = vec![0u8; 8192];
    assert_eq!(
        writer.append(&mut other, &removed(1, 10)),
        Err(JournalError::RegionLength {
            got: 8192,
            expected: 4096
        })
    );
    assert!(other.iter().all(|&b| b == 0));
}

#[test]
fn a_region_too_small_is_refused() {
    let mut region = vec![0u8; MIN_REGION_LEN - 1];
    assert_eq!(
        JournalWriter::format(&mut region).unwrap_err(),
        JournalError::RegionTooSmall {
            len: MIN_REGION_LEN - 1,
            min: MIN_REGION_LEN
        }
    );
    assert!(matches!(
        recover(&region),
        Err(JournalError::Corrupt { .. })
    ));
    let mut region = vec![0u8; MIN_REGION_LEN];
    JournalWriter::format(&mut region).unwrap();
    assert_eq!(recover(&region).unwrap(), Recovered::default());
}

#[test]
fn compaction_keeps_the_state_through_many_cycles() {
    let mut region = vec![0u8; 2048];
    let mut writer = JournalWriter::format(&mut region).unwrap();
    let mut model = Model::default();
    let mut apply = |writer: &mut JournalWriter, region: &mut Vec<u8>, r: JournalRecord| {
        writer.append(region, &r).unwrap();
        model.apply(&r);
        check(region, &model);
    };
    apply(&mut writer, &mut region, namespace(1));
    apply(&mut writer, &mut region, held(&[100, 101]));
    for key in 0..300u64 {
        let slot = (key % 8) as u32 * 2;
        apply(&mut writer, &mut region, ready(1, key, &[slot, slot + 1]));
        if key >= 3 {
            apply(&mut writer, &mut region, removed(1, key - 3));
        }
        if key % 50 == 0 {
            apply(&mut writer, &mut region, freed(&[100]));
            apply(&mut writer, &mut region, held(&[100]));
        }
    }
    let stats = writer.stats();
    assert!(stats.compactions > 10, "{stats:?}");
    assert_eq!(stats.live_pages, 3);
    assert_eq!(stats.epoch, 1 + stats.compactions);
    let r = check(&region, &model);
    assert_eq!(r.records, stats.records);
    assert_eq!(
        r.pages.iter().map(|p| p.key).collect::<Vec<_>>(),
        vec![297, 298, 299]
    );
    // The old half's commit slot is gone, so only the active half can be read.
    let head = read_header(&region).unwrap();
    let old = head.active.other().slot_offset();
    assert!(region[old..old + SLOT_LEN].iter().all(|&b| b == 0));
}

#[test]
fn overflow_disables_the_journal() {
    let mut region = vec![0u8; MIN_REGION_LEN];
    let mut writer = JournalWriter::format(&mut region).unwrap();
    writer.append(&mut region, &namespace(1)).unwrap();
    let mut key = 0;
    let err = loop {
        match writer.append(&mut region, &ready(1, key, &[key as u32])) {
            Ok(()) => key += 1,
            Err(e) => break e,
        }
        assert!(key < 100, "never overflowed");
    };
    assert_eq!(err, JournalError::Disabled(DisabledReason::Overflow));
    assert!(writer.is_disabled());
    assert!(writer.stats().disabled);
    let before = region.clone();
    assert_eq!(
        writer.append(&mut region, &removed(1, 0)),
        Err(JournalError::Disabled(DisabledReason::Overflow))
    );
    assert_eq!(region, before);
    assert_eq!(
        recover(&region),
        Err(JournalError::Disabled(DisabledReason::Overflow))
    );
    // A fresh format is usable again.
    let mut writer = JournalWriter::format(&mut region).unwrap();
    writer.append(&mut region, &namespace(1)).unwrap();
    assert_eq!(recover(&region).unwrap().namespaces.len(), 1);
}

#[test]
fn disable_is_what_recover_reports() {
    let (mut region, mut writer, _) = journal(4096, &[namespace(1)]);
    writer.disable(&mut region, DisabledReason::Requested);
    writer.disable(&mut region, DisabledReason::Overflow);
    assert_eq!(
        recover(&region),
        Err(JournalError::Disabled(DisabledReason::Requested))
    );
    assert_eq!(
        writer.append(&mut region, &namespace(2)),
        Err(JournalError::Disabled(DisabledReason::Requested))
    );
    // A code this version does not know is still disabled.
    region[OFF_STATE..OFF_STATE + 4].copy_from_slice(&77u32.to_le_bytes());
    assert_eq!(
        recover(&region),
        Err(JournalError::Disabled(DisabledReason::Unknown(77)))
    );
}

fn five_records() -> (Vec<u8>, Model) {
    let (region, _, model) = journal(
        4096,
        &[
            namespace(1),
            ready(1, 1, &[1]),
            ready(1, 2, &[2]),
            removed(1, 1),
            ready(1, 3, &[1]),
        ],
    );
    (region, model)
}

#[test]
fn damage_in_the_middle_is_corrupt() {
    let (region, _) = five_records();
    let frames = frames(&region);
    assert_eq!(frames.len(), 5);
    // Every byte of every record but the last: the len, crc, seq or payload
    // of a record followed by complete ones.
    for &(at, len) in &frames[..4] {
        for i in 0..len {
            let mut bad = region.clone();
            bad[at + i] ^= 0x10;
            let got = recover(&bad);
            // Padding is not covered by the checksum.
            let padding = i >= FRAME_HEADER_LEN + read_u32(&region, at).unwrap() as usize;
            if padding {
                assert!(got.is_ok());
            } else {
                assert!(
                    matches!(got, Err(JournalError::Corrupt { .. })),
                    "byte {i} of the frame at {at}: {got:?}"
                );
            }
        }
    }
    // The header.
    for (at, why) in [
        (0, "bad magic"),
        (OFF_VERSION, "unsupported version"),
        (OFF_LENGTH, "the length differs from the region's"),
        (OFF_HALF, "the half length does not match the region"),
        (OFF_SLOTS[0] + 3, "no valid commit slot"),
    ] {
        let mut bad = region.clone();
        bad[at] ^= 1;
        assert_eq!(
            recover(&bad),
            Err(JournalError::Corrupt {
                offset: if at == OFF_SLOTS[0] + 3 {
                    OFF_SLOTS[0] as u64
                } else {
                    at as u64
                },
                why
            })
        );
    }
    // A stray frame after the end, in sequence: the end was damage.
    let (mut bad, _) = five_records();
    let (last, len) = *frames.last().unwrap();
    let copy = bad[last..last + len].to_vec();
    bad[last..last + len].fill(0);
    bad[last + len..last + 2 * len].copy_from_slice(&copy);
    assert!(matches!(recover(&bad), Err(JournalError::Corrupt { .. })));
    // Out of sequence: the frames swapped.
    let (mut bad, _) = five_records();
    let a = frames[1];
    let b = frames[2];
    assert_eq!(a.1, b.1);
    let first = bad[a.0..a.0 + a.1].to_vec();
    bad.copy_within(b.0..b.0 + b.1, a.0);
    bad[b.0..b.0 + b.1].copy_from_slice(&first);
    assert!(matches!(
        recover(&bad),
        Err(JournalError::Corrupt {
            why: "a record is out of sequence",
            ..
        })
    ));
}

/// Appends `payload` as a complete, in-sequence frame after the active
/// half's last record (what a writer bug or a foreign writer could leave).
fn append_raw(region: &mut [u8], payload: &[u8]) {
    let head = read_header(region).unwrap();
    let (at, seq) = match frames(region).last() {
        Some(&(at, len)) => (at + len, frames(region).len() as u64 + 1),
        None => (half_start(head.active, head.half_len), 1),
    };
    let len = payload.len() as u32;
    region[at..at + 4].copy_from_slice(&len.to_le_bytes());
    region[at + 4..at + 8].copy_from_slice(&frame_crc(head.epoch, len, seq, payload).to_le_bytes());
    region[at + 8..at + 16].copy_from_slice(&seq.to_le_bytes());
    region[at + 16..at + 16 + payload.len()].copy_from_slice(payload);
}

#[test]
fn complete_records_that_do_not_decode_or_do_not_follow_are_corrupt() {
    let mut removed_1_2 = vec![TAG_REMOVED];
    removed_1_2.extend(1u64.to_le_bytes());
    removed_1_2.extend(2u64.to_le_bytes());
    let mut trailing = removed_1_2.clone();
    trailing.push(0);
    let mut ns_bad_utf8 = vec![TAG_NAMESPACE];
    ns_bad_utf8.extend(5u64.to_le_bytes());
    ns_bad_utf8.extend(0u64.to_le_bytes());
    ns_bad_utf8.extend([1, 1, 0, 0, 0, 0xff, 0]);
    let mut bad_flag = ns_bad_utf8.clone();
    bad_flag[17] = 2;
    let mut ready_on_held = Vec::new();
    ready(1, 9, &[7]).view().encode(&mut ready_on_held);
    let cases: [(Vec<u8>, &str); 9] = [
        (vec![9], "unknown record tag"),
        (trailing, "a record's payload has trailing bytes"),
        (
            removed_1_2[..10].to_vec(),
            "a record's payload is truncated",
        ),
        // Counts are checked before anything is allocated.
        (
            [vec![TAG_HELD], u32::MAX.to_le_bytes().to_vec()].concat(),
            "a list is over its cap",
        ),
        (
            [vec![TAG_HELD], 4096u32.to_le_bytes().to_vec(), vec![0; 8]].concat(),
            "a record's payload is truncated",
        ),
        (ns_bad_utf8, "a string is not UTF-8"),
        (bad_flag, "an option flag is neither 0 nor 1"),
        (removed_1_2, "a Removed names a page that is not live"),
        (ready_on_held, "a slot is owned by a live page or held"),
    ];
    for (payload, why) in cases {
        let (mut region, _, _) = journal(4096, &[namespace(1), held(&[7]), ready(1, 1, &[1])]);
        let at = frames(&region).last().map(|&(a, l)| a + l).unwrap();
        append_raw(&mut region, &payload);
        assert_eq!(
            recover(&region),
            Err(JournalError::Corrupt {
                offset: at as u64,
                why
            }),
            "{payload:?}"
        );
    }
}

#[test]
fn a_torn_last_record_is_left_out() {
    let (region, model) = five_records();
    let frames = frames(&region);
    let (last, len) = *frames.last().unwrap();
    let mut before = model.clone();
    before.pages.retain(|p| p.key != 3);
    // Every prefix of the last frame's bytes that misses a nonzero one.
    let nonzero = region[last..last + len]
        .iter()
        .rposition(|&b| b != 0)
        .unwrap();
    for keep in 0..=nonzero {
        let mut torn = region.clone();
        torn[last + keep..last + len].fill(0);
        let r = recover(&torn).unwrap();
        assert_eq!(Model::of(&r), before, "kept {keep}");
        assert_eq!(r.records, 4);
        assert_eq!(r.torn_tail, keep > 0, "kept {keep}");
    }
    let mut torn = region.clone();
    torn[last + FRAME_HEADER_LEN + 2] ^= 0xff;
    let r = recover(&torn).unwrap();
    assert!(r.torn_tail);
    assert_eq!(Model::of(&r), before);
    // The record's header alone, payload still zero.
    let mut torn = region.clone();
    torn[last + FRAME_HEADER_LEN..last + len].fill(0);
    let r = recover(&torn).unwrap();
    assert!(r.torn_tail);
    assert_eq!(Model::of(&r), before);
}

#[test]
fn resume_continues_a_recovered_journal() {
    let (mut region, _, mut model) = journal(
        2048,
        &[
            namespace(1),
            namespace(2),
            ready(1, 1, &[1, 2]),
            held(&[7, 8]),
            ready(2, 1, &[3]),
            removed(1, 1),
            ready(1, 2, &[1]),
        ],
    );
    let recovered = check(&region, &model);
    let old = region.clone();
    let mut writer = JournalWriter::resume(&mut region, &recovered).unwrap();
    let stats = writer.stats();
    assert_eq!(stats.compactions, 1);
    assert_eq!(stats.records, 2 + 1 + 2);
    assert_eq!(check(&region, &model).records, 5);
    for r in [freed(&[7]), ready(1, 3, &[7, 2]), removed(2, 1)] {
        writer.append(&mut region, &r).unwrap();
        model.apply(&r);
    }
    for key in 10..60 {
        let r = ready(1, key, &[20 + key as u32 % 4]);
        writer.append(&mut region, &r).unwrap();
        model.apply(&r);
        let r = removed(1, key);
        writer.append(&mut region, &r).unwrap();
        model.apply(&r);
    }
    assert!(writer.stats().compactions > 1);
    check(&region, &model);

    // A crash anywhere in resume leaves the old journal or the new one.
    let mut rec = Recording::new(old.clone());
    JournalWriter::resume_in(&mut rec, &recovered).unwrap();
    assert!(rec.fences >= 2);
    let same = Model::of(&recovered);
    rec.each_crash_image(&old, |cut, image| {
        let got = recover(image).unwrap();
        assert_eq!(Model::of(&got), same, "cut {cut}");
    });

    // The runner may keep a subset: a dropped page's slots are free again.
    let mut kept = recovered.clone();
    kept.pages.retain(|p| p.namespace == 2);
    let mut region = old.clone();
    let mut writer = JournalWriter::resume(&mut region, &kept).unwrap();
    writer.append(&mut region, &ready(1, 9, &[1])).unwrap();
    let r = recover(&region).unwrap();
    assert_eq!(r.pages.len(), 2);

    // An inconsistent state is refused before any byte is written.
    let mut bad = recovered.clone();
    bad.held.push(3);
    let mut region = old.clone();
    assert_eq!(
        JournalWriter::resume(&mut region, &bad).unwrap_err(),
        JournalError::Refused(Refusal::SlotInUse(3))
    );
    assert_eq!(region, old);

    // A region holding no journal (or a disabled one) is formatted first.
    for mut region in [vec![0xa5u8; 2048], {
        let mut r = old.clone();
        r[OFF_STATE] = 1;
        r
    }] {
        let mut writer = JournalWriter::resume(&mut region, &recovered).unwrap();
        writer.append(&mut region, &freed(&[8])).unwrap();
        let mut m = Model::of(&recovered);
        m.apply(&freed(&[8]));
        check(&region, &m);
    }

    // A state that does not fit disables the journal.
    let mut big = Recovered::default();
    big.namespaces.push(RecoveredNamespace {
        id: 1,
        ..Default::default()
    });
    big.pages = (0..100)
        .map(|k| RecoveredPage {
            namespace: 1,
            key: k,
            slots: vec![k as u32],
            ..Default::default()
        })
        .collect();
    let mut region = old.clone();
    assert_eq!(
        JournalWriter::resume(&mut region, &big).unwrap_err(),
        JournalError::Disabled(DisabledReason::Overflow)
    );
    assert_eq!(
        recover(&region),
        Err(JournalError::Disabled(DisabledReason::Overflow))
    );
}

#[test]
fn a_crash_while_formatting_never_reads_as_a_journal_state() {
    let (old, model) = five_records();
    let mut rec = Recording::new(old.clone());
    JournalWriter::format_in(&mut rec).unwrap();
    for cut in (0..=rec.written()).step_by(7).chain([rec.written()]) {
        match recover(&rec.crash_image(&old, cut)) {
            Ok(r) => assert!(
                Model::of(&r) == model || Model::of(&r) == Model::default(),
                "cut {cut}: {r:?}"
            ),
            Err(JournalError::Corrupt { .. }) => {}
            Err(e) => panic!("cut {cut}: {e:?}"),
        }
    }
}

/// One small journal, byte for byte: the header fields at their offsets, the
/// commit slot, and two frames.
#[test]
fn golden_bytes() {
    let (region, _, _) = journal(
        MIN_REGION_LEN,
        &[
            JournalRecord::Namespace {
                id: 0x0102,
                compat: 7,
                lora_name: Some("ab".into()),
                cache_salt: None,
            },
            JournalRecord::Ready {
                namespace: 0x0102,
                key: 9,
                layout: 3,
                slots: vec![4],
                parent: None,
                token_ids: vec![1, 2],
            },
        ],
    );
    let le32 = |v: u32| v.to_le_bytes().to_vec();
    let le64 = |v: u64| v.to_le_bytes().to_vec();
    let mut header = b"KVCRJNL1".to_vec();
    header.extend(le32(1)); // version
    header.extend(le32(0)); // state: Ok
    header.extend(le64(MIN_REGION_LEN as u64)); // region length
    header.extend(le64(256)); // half length
    header.extend(le64(1)); // half 0: epoch 1
    header.extend(le32(0x1FC4_55AC)); //        its crc32 (zlib.crc32 agrees)
    header.extend(le32(0));
    header.extend([0u8; 16]); // half 1: never committed
    assert_eq!(hex(&region[..HEADER_LEN]), hex(&header));

    let mut half = Vec::new();
    // Namespace: 1 + 8 + 8 + (1 + 4 + 2) + 1 = 25 payload bytes.
    half.extend(le32(25));
    half.extend(le32(0x325F_3EE2));
    half.extend(le64(1));
    half.push(1);
    half.extend(le64(0x0102));
    half.extend(le64(7));
    half.extend([1, 2, 0, 0, 0, b'a', b'b', 0]);
    half.extend([0u8; 7]); // padding to 32
    // Ready: 1 + 8 + 8 + 2 + 1 + (4 + 4) + (4 + 8) = 40 payload bytes.
    half.extend(le32(40));
    half.extend(le32(0xB843_F3AF));
    half.extend(le64(2));
    half.push(2);
    half.extend(le64(0x0102));
    half.extend(le64(9));
    half.extend([3, 0]);
    half.push(0); // no parent
    half.extend(le32(1));
    half.extend(le32(4));
    half.extend(le32(2));
    half.extend(le32(1));
    half.extend(le32(2));
    half.resize(256, 0);
    assert_eq!(hex(&region[HEADER_LEN..HEADER_LEN + 256]), hex(&half));
    assert!(region[HEADER_LEN + 256..].iter().all(|&b| b == 0));
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .map(|line| line.iter().map(|b| format!("{b:02x}")).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

/// A scripted workload in a small region (compactions, the held set, many
/// Removed), cut after every byte of every append.
#[test]
fn every_crash_point_of_a_scripted_workload_recovers_before_or_after() {
    let mut script = vec![namespace(1), namespace(2), held(&[40, 41, 42])];
    for key in 0..40u64 {
        let slot = (key % 6) as u32 * 3;
        script.push(ready(1 + key % 2, key, &[slot, slot + 1, slot + 2]));
        if key >= 4 {
            script.push(removed(1 + (key - 4) % 2, key - 4));
        }
        if key % 9 == 0 {
            script.push(freed(&[41]));
            script.push(held(&[41]));
        }
    }
    let mut region = vec![0u8; 1536];
    let mut writer = JournalWriter::format(&mut region).unwrap();
    let mut model = Model::default();
    let mut compacting_cuts = 0;
    for record in &script {
        let pre = region.clone();
        let mut rec = Recording::new(region);
        let compactions = writer.stats().compactions;
        writer
            .append_in(&mut rec, std::borrow::Cow::Borrowed(record))
            .unwrap();
        let compacted = writer.stats().compactions > compactions;
        let mut after = model.clone();
        after.apply(record);
        rec.each_crash_image(&pre, |cut, image| {
            let got = Model::of(&recover(image).unwrap_or_else(|e| {
                panic!("{record:?} cut at {cut}: {e:?}");
            }));
            assert!(got == model || got == after, "{record:?} cut at {cut}");
            compacting_cuts += usize::from(compacted);
        });
        let complete = recover(&rec.bytes).unwrap();
        assert_eq!(Model::of(&complete), after);
        assert!(!complete.torn_tail);
        region = rec.bytes;
        model = after;
    }
    assert!(writer.stats().compactions >= 5, "{:?}", writer.stats());
    assert!(compacting_cuts > 1000);
}

// ---------------------------------------------------------------------------
// Property tests

const UNIVERSE: u32 = 32;

#[derive(Debug, Clone)]
enum Step {
    Namespace(u8),
    Ready {
        ns: u8,
        key: u8,
        slots: u8,
        tokens: u8,
        parent: bool,
        pick: u16,
    },
    Remove(u16),
    Hold {
        n: u8,
        pick: u16,
    },
    Free {
        n: u8,
        pick: u16,
    },
    Bad {
        kind: u8,
        pick: u16,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => (0u8..3).prop_map(Step::Namespace),
        6 => (any::<u8>(), 0u8..16, 1u8..=4, 0u8..=16, any::<bool>(), any::<u16>()).prop_map(
            |(ns, key, slots, tokens, parent, pick)| Step::Ready {
                ns,
                key,
                slots,
                tokens,
                parent,
                pick
            }
        ),
        4 => any::<u16>().prop_map(Step::Remove),
        2 => (1u8..=3, any::<u16>()).prop_map(|(n, pick)| Step::Hold { n, pick }),
        2 => (1u8..=3, any::<u16>()).prop_map(|(n, pick)| Step::Free { n, pick }),
        1 => (0u8..5, any::<u16>()).prop_map(|(kind, pick)| Step::Bad { kind, pick }),
    ]
}

/// `n` items of `from`, starting at `pick` and wrapping.
fn take(from: &[u32], n: usize, pick: u16) -> Option<Vec<u32>> {
    if from.len() < n || from.is_empty() {
        return None;
    }
    let start = usize::from(pick) % from.len();
    Some((0..n).map(|i| from[(start + i) % from.len()]).collect())
}

/// The record a step means in this state, and whether the writer must accept
/// it; `None` when it means nothing here.
fn resolve(step: &Step, model: &Model) -> Option<(JournalRecord, bool)> {
    let page = |pick: u16| {
        (!model.pages.is_empty()).then(|| &model.pages[usize::from(pick) % model.pages.len()])
    };
    Some(match *step {
        Step::Namespace(w) => (
            JournalRecord::Namespace {
                id: 0x100 + u64::from(w),
                compat: u64::from(w) * 7 + 1,
                lora_name: (w == 1).then(|| "lora-a".to_string()),
                cache_salt: (w == 2).then(|| "tenant-β".to_string()),
            },
            true,
        ),
        Step::Ready {
            ns,
            key,
            slots,
            tokens,
            parent,
            pick,
        } => {
            if model.namespaces.is_empty() {
                return None;
            }
            let ns = model.namespaces[usize::from(ns) % model.namespaces.len()].id;
            let key = u64::from(key);
            if model
                .pages
                .iter()
                .any(|p| (p.namespace, p.key) == (ns, key))
            {
                return None;
            }
            let slots = take(&model.free(UNIVERSE), usize::from(slots), pick)?;
            (
                JournalRecord::Ready {
                    namespace: ns,
                    key,
                    layout: (key % 3) as u16,
                    slots,
                    parent: parent.then_some(key + 1000),
                    token_ids: (0..u32::from(tokens))
                        .map(|t| key as u32 * 100 + t)
                        .collect(),
                },
                true,
            )
        }
        Step::Remove(pick) => {
            let p = page(pick)?;
            (removed(p.namespace, p.key), true)
        }
        Step::Hold { n, pick } => (
            held(&take(&model.free(UNIVERSE), usize::from(n), pick)?),
            true,
        ),
        Step::Free { n, pick } => {
            let held: Vec<u32> = model.held.iter().copied().collect();
            (freed(&take(&held, usize::from(n), pick)?), true)
        }
        Step::Bad { kind, pick } => (
            match kind {
                0 => removed(0xdead, 1),
                1 => ready(0xbeef, 1, &[999]),
                2 => {
                    let p = page(pick)?;
                    ready(p.namespace, 999, &[p.slots[0]])
                }
                3 => freed(&[999]),
                _ => {
                    let p = page(pick)?;
                    ready(p.namespace, p.key, &[999])
                }
            },
            false,
        ),
    })
}

fn run_with_crashes(size: usize, steps: &[(Step, u32)]) -> Result<(), TestCaseError> {
    let mut region = vec![0u8; size];
    let mut writer = JournalWriter::format(&mut region).unwrap();
    let mut model = Model::default();
    for (step, cut) in steps {
        let Some((record, valid)) = resolve(step, &model) else {
            continue;
        };
        let was_disabled = writer.is_disabled();
        let pre = region.clone();
        let mut rec = Recording::new(region);
        let res = writer.append_in(&mut rec, std::borrow::Cow::Borrowed(&record));
        let mut after = model.clone();
        match &res {
            Err(JournalError::Disabled(DisabledReason::Overflow)) if was_disabled || valid => {}
            Ok(()) if valid && !was_disabled => after.apply(&record),
            Err(JournalError::Refused(_)) if !valid && !was_disabled => {}
            other => prop_assert!(false, "{record:?} (valid {valid}): {other:?}"),
        }
        let newly_disabled = writer.is_disabled() && !was_disabled;
        if res.is_err() && !newly_disabled {
            prop_assert!(rec.log.is_empty(), "a refused append wrote");
        }
        let disabled = writer.is_disabled();
        let cut = *cut as usize % (rec.written() + 1);
        for (image, exact) in [
            (rec.crash_image(&pre, cut), false),
            (rec.bytes.clone(), true),
        ] {
            match recover(&image) {
                Ok(r) => {
                    let got = Model::of(&r);
                    prop_assert!(consistent(&r));
                    if exact {
                        prop_assert!(!disabled);
                        prop_assert!(!r.torn_tail);
                        prop_assert_eq!(&got, &after);
                    } else {
                        prop_assert!(
                            got == model || got == after,
                            "{:?} cut at {}/{}: {:?}\nbefore {:?}\nafter {:?}",
                            record,
                            cut,
                            rec.written(),
                            got,
                            model,
                            after
                        );
                    }
                }
                Err(JournalError::Disabled(DisabledReason::Overflow)) => prop_assert!(disabled),
                Err(e) => prop_assert!(false, "{record:?} cut at {cut}: {e:?}"),
            }
        }
        region = rec.bytes;
        model = after;
    }
    Ok(())
}

fn sample_journal() -> Vec<u8> {
    let mut records = vec![
        namespace(1),
        JournalRecord::Namespace {
            id: 2,
            compat: 9,
            lora_name: Some("l".into()),
            cache_salt: Some("s".into()),
        },
        held(&[30, 31]),
    ];
    for key in 0..12u64 {
        records.push(ready(
            1 + key % 2,
            key,
            &[key as u32 % 6 * 2, key as u32 % 6 * 2 + 1],
        ));
        if key >= 2 {
            records.push(removed(1 + (key - 2) % 2, key - 2));
        }
    }
    records.push(freed(&[30]));
    journal(1536, &records).0
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// Random workloads against a model, each append cut at a random byte:
    /// the image recovers exactly to the state before or after the append
    /// (mid-record, mid-snapshot, mid-flip), never `Corrupt`.
    #[test]
    fn crash_images_recover_to_the_state_before_or_after(
        size in prop_oneof![Just(1024usize), Just(2048), Just(4096)],
        steps in prop::collection::vec((step(), any::<u32>()), 1..80),
    ) {
        run_with_crashes(size, &steps)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..1200)) {
        let _ = recover(&bytes);
        let _ = decode(&bytes);
    }

    /// A valid header over random halves.
    #[test]
    fn random_halves_never_panic(body in prop::collection::vec(any::<u8>(), 960)) {
        let mut region = vec![0u8; 1024];
        JournalWriter::format(&mut region).unwrap();
        region[HEADER_LEN..].copy_from_slice(&body);
        if let Ok(r) = recover(&region) {
            prop_assert!(consistent(&r));
        }
    }

    /// Random payloads in well-formed frames (so the decoder and the state
    /// checks see them): never a panic, never an inconsistent state.
    #[test]
    fn random_framed_payloads_never_panic(
        payloads in prop::collection::vec(
            (0u8..7, prop::collection::vec(any::<u8>(), 0..48)),
            1..12,
        ),
    ) {
        let mut region = vec![0u8; 2048];
        JournalWriter::format(&mut region).unwrap();
        let mut at = HEADER_LEN;
        for (seq, (tag, rest)) in payloads.iter().enumerate() {
            let mut payload = vec![*tag];
            payload.extend(rest);
            let mut buf = Vec::new();
            let len = payload.len() as u32;
            let seq = seq as u64 + 1;
            buf.extend(len.to_le_bytes());
            buf.extend(frame_crc(1, len, seq, &payload).to_le_bytes());
            buf.extend(seq.to_le_bytes());
            buf.extend(&payload);
            region[at..at + buf.len()].copy_from_slice(&buf);
            at += frame_len(payload.len());
        }
        if let Ok(r) = recover(&region) {
            prop_assert!(consistent(&r));
        }
    }

    /// A valid journal with a few bytes changed: never a panic, never an
    /// inconsistent state.
    #[test]
    fn mutated_journals_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..5),
    ) {
        let mut region = sample_journal();
        for (i, b) in &edits {
            let at = i.index(region.len());
            region[at] = *b;
        }
        if let Ok(r) = recover(&region) {
            prop_assert!(consistent(&r));
        }
    }
}
