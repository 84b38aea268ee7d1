//! Damage: in the middle of a half it is corrupt, complete records that do
//! not decode or follow are corrupt, and a torn last record is left out.

use super::*;

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
