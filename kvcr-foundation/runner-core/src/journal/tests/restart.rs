//! Restarts: resuming a recovered journal, a crash while formatting, and
//! every crash point of a scripted workload.

use super::*;

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
