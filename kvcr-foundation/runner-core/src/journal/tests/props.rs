//! Property tests: random workloads crashed at every byte against a model,
//! and random or mutated bytes that never make the reader panic.

use super::*;

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
