//! The byte format: the CRC, every record kind round-tripping, the caps, and
//! a byte-level golden of a small journal.

use super::*;

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
