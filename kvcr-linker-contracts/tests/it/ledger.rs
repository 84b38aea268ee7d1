//! The owned-inventory ledger: rank agreement, ownership, removal identity,
//! namespaces and typed refusals.

use std::num::NonZeroU32;

use kvcr_contracts::{InventoryEvent, Owner, Tier};
use kvcr_linker_contracts::{Error, FrameworkChange, InventoryLedger, OwnershipPolicy};
use rstest::rstest;

use crate::{
    agreed, base, dram_opted_in, incarnation, key, ledger, lora, offload, render_all, scoped,
};

fn stored_keys(events: &[InventoryEvent]) -> Vec<u64> {
    events
        .iter()
        .flat_map(|e| match e {
            InventoryEvent::Stored { keys, .. } => keys.iter().map(|k| k.as_u64()).collect(),
            _ => Vec::new(),
        })
        .collect()
}

fn removed_keys(events: &[InventoryEvent]) -> Vec<u64> {
    events
        .iter()
        .flat_map(|e| match e {
            InventoryEvent::Removed { keys, .. } => keys.iter().map(|k| k.as_u64()).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// Case 47 / §1.6: `Stored` only after every rank reported success, whatever
/// the order; one failure anywhere publishes nothing.
#[rstest]
#[case::all_succeed_in_order(&[(0, true), (1, true), (2, true)], true)]
#[case::all_succeed_reversed(&[(2, true), (1, true), (0, true)], true)]
#[case::last_rank_fails(&[(0, true), (1, true), (2, false)], false)]
#[case::first_rank_fails(&[(0, false), (1, true), (2, true)], false)]
fn stored_only_after_every_rank_succeeds(#[case] reports: &[(u32, bool)], #[case] stored: bool) {
    let mut ledger = ledger(3);
    let id = ledger
        .begin_offload(offload(&base(), Tier::KvcrDram, &[1, 2], None))
        .unwrap();
    let (last, earlier) = reports.split_last().unwrap();
    for &(rank, ok) in earlier {
        assert!(
            ledger.rank_result(id, rank, ok).unwrap().is_empty(),
            "published before every rank reported"
        );
    }
    let events = ledger.rank_result(id, last.0, last.1).unwrap();
    assert_eq!(
        stored_keys(&events),
        if stored { vec![1, 2] } else { vec![] }
    );
    assert_eq!(ledger.pending(), 0, "a decided offload is forgotten");
    assert_eq!(
        ledger.is_resident(Tier::KvcrDram, scoped(&base(), 1)),
        stored
    );
}

#[derive(Debug, Clone, Copy)]
enum BadReport {
    RankOutOfRange,
    ReportedTwice,
    UnknownOffload,
}

/// Bad rank reports are typed errors and change nothing.
#[rstest]
#[case::rank_out_of_range(BadReport::RankOutOfRange)]
#[case::reported_twice(BadReport::ReportedTwice)]
#[case::unknown_offload(BadReport::UnknownOffload)]
fn bad_rank_reports_are_typed_errors(#[case] bad: BadReport) {
    let mut ledger = ledger(2);
    let id = ledger
        .begin_offload(offload(&base(), Tier::KvcrDram, &[1], None))
        .unwrap();
    ledger.rank_result(id, 0, true).unwrap();
    let result = match bad {
        BadReport::RankOutOfRange => ledger.rank_result(id, 2, true),
        BadReport::ReportedTwice => ledger.rank_result(id, 0, false),
        BadReport::UnknownOffload => {
            let other = ledger
                .begin_offload(offload(&base(), Tier::KvcrDram, &[9], None))
                .unwrap();
            ledger.rank_result(other, 0, false).unwrap();
            ledger.rank_result(other, 1, false).unwrap();
            ledger.rank_result(other, 1, true)
        }
    };
    match (bad, result) {
        (BadReport::RankOutOfRange, Err(Error::RankOutOfRange { rank: 2, ranks: 2 }))
        | (BadReport::ReportedTwice, Err(Error::RankReportedTwice { rank: 0, .. }))
        | (BadReport::UnknownOffload, Err(Error::UnknownOffload { .. })) => {}
        (bad, other) => panic!("{bad:?}: unexpected {other:?}"),
    }
    // The first offload is still pending and still publishes on agreement.
    assert_eq!(
        stored_keys(&ledger.rank_result(id, 1, true).unwrap()),
        vec![1]
    );
}

/// Offloads the ledger cannot publish are refused with the reason.
#[rstest]
#[case::gpu_is_framework_owned(Tier::Gpu, 4, &[4, 4])]
#[case::host_pool_is_framework_owned(Tier::HostPinned, 4, &[4])]
#[case::zero_block_size(Tier::KvcrDram, 0, &[0])]
#[case::short_page(Tier::KvcrDram, 4, &[4, 3])]
#[case::no_pages(Tier::KvcrDram, 4, &[])]
fn malformed_offloads_are_refused(
    #[case] tier: Tier,
    #[case] block_size: u32,
    #[case] token_counts: &[usize],
) {
    let mut ledger = ledger(1);
    let mut request = offload(&base(), tier, &[], None);
    request.block_size = block_size;
    request.pages = token_counts
        .iter()
        .enumerate()
        .map(|(i, &n)| kvcr_linker_contracts::OffloadPage {
            key: key(i as u64 + 1),
            token_ids: vec![0; n],
        })
        .collect();
    let error = ledger.begin_offload(request).unwrap_err();
    let expected = match (tier, block_size, token_counts) {
        (Tier::Gpu | Tier::HostPinned, ..) => {
            matches!(error, Error::EngineTier { tier: t } if t == tier)
        }
        (_, 0, _) => matches!(error, Error::ZeroBlockSize),
        (_, _, []) => matches!(error, Error::EmptyOffload),
        _ => matches!(
            error,
            Error::TokenCount {
                page: 1,
                expected: 4,
                got: 3
            }
        ),
    };
    assert!(expected, "unexpected {error:?}");
    assert_eq!(ledger.pending(), 0);
}

/// GPU and the engine's host pool can never be opted in; lower tiers are
/// framework-owned until opted in, and the owner reaches the wire field.
#[rstest]
#[case::gpu(Tier::Gpu, None)]
#[case::host_pool(Tier::HostPinned, None)]
#[case::kvcr_dram(Tier::KvcrDram, Some(Owner::Kvcr))]
#[case::disk(Tier::Disk, Some(Owner::Framework))]
#[case::external(Tier::External, Some(Owner::Framework))]
fn only_opted_in_lower_tiers_are_kvcr_owned(#[case] tier: Tier, #[case] owner: Option<Owner>) {
    let policy = dram_opted_in();
    match owner {
        Some(owner) => assert_eq!(policy.owner_of(tier).unwrap(), owner),
        None => {
            assert!(matches!(
                policy.owner_of(tier),
                Err(Error::EngineTier { .. })
            ));
            assert!(matches!(
                OwnershipPolicy::framework_owned().opt_in(tier),
                Err(Error::EngineTier { .. })
            ));
        }
    }
    assert_eq!(
        OwnershipPolicy::framework_owned()
            .owner_of(Tier::KvcrDram)
            .unwrap(),
        Owner::Framework,
        "nothing is KVCR-owned without opting in"
    );
}

/// GPU eviction and engine clears are framework-owned: the ledger emits
/// nothing for them, and the removal identity survives them, so the store's
/// eviction still sends the one matching removal (namespace and LoRA intact).
#[test]
fn removal_identity_survives_device_eviction_and_engine_clear() {
    let mut ledger = ledger(2);
    let adapter = lora("a");
    agreed(
        &mut ledger,
        offload(&adapter, Tier::KvcrDram, &[1, 2], None),
    );
    let before: Vec<_> = ledger.residencies().collect();
    ledger.framework_changed(&FrameworkChange::DeviceEvicted(vec![
        scoped(&adapter, 1),
        scoped(&adapter, 2),
    ]));
    ledger.framework_changed(&FrameworkChange::EngineCleared);
    assert_eq!(ledger.residencies().collect::<Vec<_>>(), before);
    assert_eq!(before[0].namespace.lora_name.as_deref(), Some("a"));
    assert_eq!(before[0].incarnation, incarnation(1));
    let events = ledger
        .store_evicted(
            incarnation(1),
            Tier::KvcrDram,
            &[scoped(&adapter, 1), scoped(&adapter, 2)],
        )
        .unwrap();
    assert_eq!(
        render_all(&events),
        ["removed   ownership=kvcr ns=lora-a medium=CPU_PINNED keys=[1,2]"]
    );
    let again = ledger
        .store_evicted(incarnation(1), Tier::KvcrDram, &[scoped(&adapter, 1)])
        .unwrap();
    assert!(again.is_empty(), "a removal goes out once");
}

/// Reset removes every residency exactly once; late evictions from the old
/// incarnation are ignored, and the new incarnation opens with a barrier.
#[test]
fn reset_removes_each_residency_once() {
    let mut ledger = ledger(1);
    agreed(&mut ledger, offload(&base(), Tier::KvcrDram, &[1, 2], None));
    agreed(&mut ledger, offload(&base(), Tier::External, &[1], None));
    let events = ledger.reset(incarnation(2)).unwrap();
    let mut removed = removed_keys(&events);
    removed.sort_unstable();
    assert_eq!(removed, vec![1, 1, 2], "one removal per (tier, key)");
    assert!(ledger.residencies().next().is_none());
    let late = ledger
        .store_evicted(incarnation(1), Tier::KvcrDram, &[scoped(&base(), 1)])
        .unwrap();
    assert!(late.is_empty(), "the reset already removed it");
    let reoffload = agreed(&mut ledger, offload(&base(), Tier::KvcrDram, &[1], None));
    assert!(matches!(
        reoffload.first(),
        Some(InventoryEvent::AllCleared { owner: Owner::Kvcr, incarnation: i }) if *i == incarnation(2)
    ));
    assert!(matches!(
        ledger.reset(incarnation(2)),
        Err(Error::SameIncarnation { .. })
    ));
    assert!(
        ledger.is_resident(Tier::KvcrDram, scoped(&base(), 1)),
        "a refused reset changes nothing"
    );
}

/// The same keys on a KVCR-owned and a framework-owned tier are two
/// residencies with two owners; no event ever mixes them, and the framework
/// never gets an `AllCleared` from kvcr.
#[test]
fn owners_are_never_coalesced() {
    let mut ledger = ledger(1);
    let mut events = agreed(&mut ledger, offload(&base(), Tier::KvcrDram, &[1, 2], None));
    events.extend(agreed(
        &mut ledger,
        offload(&base(), Tier::External, &[1, 2], None),
    ));
    events.extend(
        ledger
            .store_evicted(incarnation(1), Tier::KvcrDram, &[scoped(&base(), 1)])
            .unwrap(),
    );
    events.extend(ledger.reset(incarnation(2)).unwrap());
    for event in &events {
        if let InventoryEvent::AllCleared { owner, .. } = event {
            assert_eq!(*owner, Owner::Kvcr);
        }
    }
    for pair in events.windows(2) {
        if let (
            InventoryEvent::Removed { scope: a, .. } | InventoryEvent::Stored { scope: a, .. },
            InventoryEvent::Removed { scope: b, .. } | InventoryEvent::Stored { scope: b, .. },
        ) = (&pair[0], &pair[1])
        {
            assert!(!pair[0].can_merge(&pair[1]) || a == b);
        }
    }
    insta::assert_snapshot!("owners_never_coalesced", render_all(&events).join("\n"));
}

/// Case 58: two adapters over the same tokens are two namespaces: separate
/// residencies, `Stored` carries each adapter's name, removals stay apart.
#[test]
fn lora_adapters_keep_their_namespace() {
    let mut ledger = ledger(1);
    let a = agreed(&mut ledger, offload(&lora("a"), Tier::KvcrDram, &[1], None));
    let b = agreed(&mut ledger, offload(&lora("b"), Tier::KvcrDram, &[1], None));
    assert_eq!(
        stored_keys(&b),
        vec![1],
        "adapter b's page is not a duplicate of a's"
    );
    for (events, name) in [(&a, "a"), (&b, "b")] {
        assert!(events.iter().any(|e| matches!(
            e,
            InventoryEvent::Stored { lora_name: Some(n), scope, .. } if n == name && scope.namespace == lora(name).id()
        )));
    }
    let removed = ledger
        .store_evicted(incarnation(1), Tier::KvcrDram, &[scoped(&lora("a"), 1)])
        .unwrap();
    assert_eq!(removed_keys(&removed), vec![1]);
    assert!(ledger.is_resident(Tier::KvcrDram, scoped(&lora("b"), 1)));
}

/// A page evicted while its offload waits for agreement is never published,
/// nor is the chain after it (its parent would be missing).
#[test]
fn eviction_while_pending_truncates_the_stored_chain() {
    let mut ledger = ledger(1);
    let id = ledger
        .begin_offload(offload(&base(), Tier::KvcrDram, &[1, 2, 3], None))
        .unwrap();
    let early = ledger
        .store_evicted(incarnation(1), Tier::KvcrDram, &[scoped(&base(), 2)])
        .unwrap();
    assert!(early.is_empty(), "nothing was published yet");
    let events = ledger.rank_result(id, 0, true).unwrap();
    assert_eq!(stored_keys(&events), vec![1]);
}

/// At most one residency per (tier, namespace, key): re-offloading resident
/// pages publishes only the new ones, each run parented by the page before it.
#[test]
fn reoffload_publishes_only_new_pages() {
    let mut ledger = ledger(1);
    agreed(&mut ledger, offload(&base(), Tier::KvcrDram, &[2], Some(1)));
    let events = agreed(
        &mut ledger,
        offload(&base(), Tier::KvcrDram, &[1, 2, 3], None),
    );
    assert_eq!(
        render_all(&events),
        [
            "stored    ownership=kvcr ns=base medium=CPU_PINNED lora=- parent=- keys=[1] tokens=[10, 11, 12, 13] block_size=4",
            "stored    ownership=kvcr ns=base medium=CPU_PINNED lora=- parent=2 keys=[3] tokens=[30, 31, 32, 33] block_size=4",
        ]
    );
}

/// Each incarnation's first KVCR-owned `Stored` follows an `AllCleared`
/// barrier for kvcr; framework-owned stores never bring one.
#[test]
fn kvcr_barrier_opens_each_incarnation() {
    let mut ledger =
        InventoryLedger::new(dram_opted_in(), NonZeroU32::new(1).unwrap(), incarnation(1));
    let framework = agreed(&mut ledger, offload(&base(), Tier::External, &[1], None));
    assert!(
        !framework
            .iter()
            .any(|e| matches!(e, InventoryEvent::AllCleared { .. }))
    );
    let first = agreed(&mut ledger, offload(&base(), Tier::KvcrDram, &[1], None));
    let second = agreed(&mut ledger, offload(&base(), Tier::KvcrDram, &[2], Some(1)));
    assert!(matches!(
        first[0],
        InventoryEvent::AllCleared {
            owner: Owner::Kvcr,
            ..
        }
    ));
    assert_eq!(first.len(), 2);
    assert_eq!(second.len(), 1, "one barrier per incarnation");
}
