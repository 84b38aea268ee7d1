//! The writer: records refused when they do not follow its state, regions
//! too small, compaction over many cycles, overflow and disabling.

use super::*;

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
