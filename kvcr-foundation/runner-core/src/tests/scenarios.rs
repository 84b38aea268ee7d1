//! Hand-written cases of shared work: a shared fill outliving a timed-out
//! waiter, an abort cancelling only unshared work, a pinned record kept from
//! eviction.

use super::*;

/// A waiter that times out on a shared fill detaches; the fill still commits
/// for the deposit that owns it, and the late commit does not revive the
/// timed-out fetch.
#[test]
fn shared_fill_survives_a_waiter_timeout() {
    let (mut core, ns, region) = core(4, true, 1_000);
    let k = key(ns, 3);
    let deposit = core
        .deposit(
            0,
            vec![DepositEntry {
                key: k,
                spans: vec![ElementRef { region, index: 3 }],
                page: None,
            }],
            false,
        )
        .unwrap();
    let fetch = core.fetch(10, &[k], &[PoolId(0)], None).unwrap();
    let Some(Action::Copy { job, .. }) = core.poll_action() else {
        panic!("no copy")
    };
    core.handle_timeout(1_011); // the fetch's deadline passed; the deposit's too
    let mut done = Vec::new();
    core.drain_completed(&mut done);
    assert_eq!(
        done.len(),
        1,
        "only the fetch completes: the deposit's copy is in flight"
    );
    assert_eq!(done[0].op, fetch);
    assert_eq!(
        done[0].entries[0].1.status,
        EntryStatus::Failed(FailReason::Timeout)
    );
    core.handle_copy_done(1_500, job, &[CopyOutcome::Copied]);
    core.drain_completed(&mut done);
    assert_eq!(done[1].op, deposit);
    assert!(
        done[1].entries[0].1.is_success(),
        "a started copy completes the deposit"
    );
    assert_eq!(core.query(&k), QueryStatus::Hit);
    assert_eq!(
        core.public_claims(),
        0,
        "the timed-out fetch holds no claim"
    );
    core.check_invariants().unwrap();
}

/// Aborting the only waiter of a fill cancels its copy; aborting one of two
/// waiters leaves the copy running for the other.
#[test]
fn abort_cancels_only_unshared_work() {
    let (mut core, ns, region) = core(4, true, 1_000_000);
    let (a, b) = (key(ns, 1), key(ns, 2));
    let entries = |ks: &[ScopedKey]| {
        ks.iter()
            .map(|k| DepositEntry {
                key: *k,
                spans: vec![ElementRef {
                    region,
                    index: k.key.as_u64(),
                }],
                page: None,
            })
            .collect::<Vec<_>>()
    };
    let first = core.deposit(0, entries(&[a, b]), false).unwrap();
    let second = core.deposit(0, entries(&[b]), false).unwrap();
    let Some(Action::Copy { job, .. }) = core.poll_action() else {
        panic!("no copy")
    };
    assert!(core.abort(first, None));
    let cancels: Vec<Action> = std::iter::from_fn(|| core.poll_action()).collect();
    assert_eq!(
        cancels,
        vec![Action::Cancel { job, key: 0 }],
        "only key a (no other waiter) is cancelled"
    );
    core.handle_copy_done(5, job, &[CopyOutcome::Cancelled, CopyOutcome::Copied]);
    let mut done = Vec::new();
    core.drain_completed(&mut done);
    let by_op: BTreeMap<OpHandle, Vec<EntryStatus>> = done
        .iter()
        .map(|r| (r.op, r.entries.iter().map(|e| e.1.status).collect()))
        .collect();
    assert_eq!(
        by_op[&first],
        vec![EntryStatus::Failed(FailReason::Aborted); 2]
    );
    assert_eq!(by_op[&second], vec![EntryStatus::Success]);
    assert_eq!(core.query(&a), QueryStatus::Miss);
    assert_eq!(core.query(&b), QueryStatus::Hit);
    core.check_invariants().unwrap();
}

/// A record pinned for a copy out of it (`pin_claimed_copy`) survives the
/// release of its public claim and any pressure until it is unpinned; a
/// refused plan pins nothing.
#[test]
fn a_pinned_record_is_not_evicted_until_unpinned() {
    let (mut core, ns, region) = core(1, true, 1_000_000);
    let deposit = |core: &mut Core, k: u8, at: u64| {
        let op = core
            .deposit(
                at,
                vec![DepositEntry {
                    key: key(ns, k),
                    spans: vec![ElementRef { region, index: 0 }],
                    page: None,
                }],
                false,
            )
            .unwrap();
        if let Some(Action::Copy { job, .. }) = core.poll_action() {
            core.handle_copy_done(at, job, &[CopyOutcome::Copied]);
        }
        let mut done = Vec::new();
        core.drain_completed(&mut done);
        done.into_iter().find(|r| r.op == op).unwrap()
    };
    deposit(&mut core, 1, 0);
    let pool = core.pool_id("kv").unwrap();
    let fetch = core.fetch(1, &[key(ns, 1)], &[pool], None).unwrap();
    let mut done = Vec::new();
    core.drain_completed(&mut done);
    let fetched = done.into_iter().find(|r| r.op == fetch).unwrap();
    let entry = &fetched.entries[0].1;
    let handle = entry.release.unwrap();
    let copy = ClaimedCopy {
        src: entry.slots[0],
        dst: ElementRef { region, index: 1 },
        len: BLOCK,
    };
    // Refused (an empty run next to a good one): nothing pinned.
    let empty = ClaimedCopy { len: 0, ..copy };
    assert!(core.pin_claimed_copy(&[handle], &[copy, empty]).is_err());
    let (spans, pinned) = core.pin_claimed_copy(&[handle], &[copy]).unwrap();
    assert_eq!(spans.len(), 1);
    assert_eq!(spans[0].len, BLOCK);
    assert_eq!(spans[0].dst, FRAMEWORK_BASE + BLOCK);
    assert_eq!(core.release(&[handle]), vec![true]);
    // The only slot is pinned: a new page cannot evict it.
    let second = deposit(&mut core, 2, 2);
    assert_eq!(
        second.entries[0].1.status,
        EntryStatus::Failed(FailReason::CapacityExhausted)
    );
    assert_eq!(core.query(&key(ns, 1)), QueryStatus::Hit);
    core.check_invariants().unwrap();
    core.unpin(&pinned);
    // Unpinned, it is evictable again.
    let third = deposit(&mut core, 3, 3);
    assert!(third.entries[0].1.is_success(), "{third:?}");
    assert_eq!(core.query(&key(ns, 1)), QueryStatus::Miss);
    core.check_invariants().unwrap();
}

/// A deliver copies into exactly the elements it names, whether they form
/// a run (consecutive regions at one index, kept as that run) or not (kept
/// span by span): each copy's destination is its element's address, in
/// the order named, from the stored page's slots in layout order.
#[rstest::rstest]
#[case::a_run(&[(0, 5), (1, 5), (2, 5)])]
#[case::regions_out_of_order(&[(2, 5), (0, 5), (1, 5)])]
#[case::indices_differ(&[(0, 5), (1, 6), (2, 7)])]
fn a_deliver_copies_into_the_elements_it_names(#[case] named: &[(u32, u64)]) {
    let (mut core, ns, first) = core(8, true, 1_000_000);
    let mut regions = vec![first];
    for (label, base) in [("kv:b", 0x3000_0000u64), ("kv:c", 0x4000_0000)] {
        let desc = RegionDesc {
            label: label.into(),
            base,
            size: BLOCK,
            stride: 0,
            count: 64,
        };
        regions.push(core.register_region(desc).unwrap());
    }
    let element = |(r, index): (u32, u64)| ElementRef {
        region: regions[r as usize],
        index,
    };
    let k = key(ns, 9);
    let spans = (0..3).map(|r| element((r, 0))).collect();
    core.deposit(
        0,
        vec![DepositEntry {
            key: k,
            spans,
            page: None,
        }],
        false,
    )
    .unwrap();
    let Some(Action::Copy { job, .. }) = core.poll_action() else {
        panic!("no deposit copy")
    };
    core.handle_copy_done(1, job, &[CopyOutcome::Copied]);
    let destinations: Vec<ElementRef> = named.iter().copied().map(element).collect();
    core.deliver(
        2,
        vec![DeliverEntry {
            key: k,
            destinations: destinations.clone(),
        }],
        None,
    )
    .unwrap();
    let Some(Action::Copy { keys, .. }) = core.poll_action() else {
        panic!("no deliver copy")
    };
    let bases = [FRAMEWORK_BASE, 0x3000_0000, 0x4000_0000];
    let expected: Vec<(u64, u64)> = named
        .iter()
        .map(|&(r, index)| (bases[r as usize] + index * BLOCK, BLOCK))
        .collect();
    let copied: Vec<(u64, u64)> = keys[0].iter().map(|c| (c.dst, c.len)).collect();
    assert_eq!(copied, expected, "named {destinations:?}");
    core.check_invariants().unwrap();
}
