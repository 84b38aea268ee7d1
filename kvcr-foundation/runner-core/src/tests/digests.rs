//! Page digests in the index: taken with a deposit's copy, kept while the
//! page is READY (and gone with it), carried into G3 by a spill and checked
//! by its fill, and off when the runner turns them off.

use super::*;

/// The copy actions the core asks for next: job, keys, whether digested.
fn next_copy(core: &mut Core) -> Option<(JobId, usize, bool)> {
    match core.poll_action()? {
        Action::Copy {
            job, keys, digest, ..
        } => Some((job, keys.len(), digest)),
        other => panic!("expected a copy, got {other:?}"),
    }
}

fn deposit(core: &mut Core, now: u64, k: ScopedKey, region: RegionId, index: u64) -> OpHandle {
    let entry = DepositEntry {
        key: k,
        spans: vec![ElementRef { region, index }],
        page: None,
    };
    core.deposit(now, vec![entry], false).unwrap()
}

proptest! {
    /// Whatever deposits run and however their copies end, a key's digest
    /// is the one its committing copy reported, exactly while it is READY.
    #[test]
    fn the_index_keeps_each_pages_deposit_digest(
        steps in proptest::collection::vec((0u8..6, any::<u64>(), 0u8..3), 1..40),
    ) {
        let (mut core, ns, region) = core(16, true, 1_000_000);
        let mut model: HashMap<u8, u64> = HashMap::new();
        for (now, (k, digest, outcome)) in steps.into_iter().enumerate() {
            let now = now as u64 * 10;
            let op = deposit(&mut core, now, key(ns, k), region, u64::from(k));
            if let Some((job, n, digested)) = next_copy(&mut core) {
                prop_assert!(digested, "a deposit's copy is digested");
                prop_assert_eq!(n, 1);
                let outcome = match outcome {
                    0 => CopyOutcome::Copied,
                    1 => CopyOutcome::Cancelled,
                    _ => CopyOutcome::Failed,
                };
                core.handle_copy_done_digested(now + 1, job, &[outcome], &[Some(digest)]);
                if outcome == CopyOutcome::Copied {
                    model.insert(k, digest);
                }
            }
            let mut done = Vec::new();
            core.drain_completed(&mut done);
            prop_assert!(done.iter().any(|r| r.op == op));
            for k in 0..6 {
                let ready = core.query(&key(ns, k)) == QueryStatus::Hit;
                let expected = model.get(&k).copied().filter(|_| ready);
                prop_assert_eq!(core.page_digest(&key(ns, k)), expected, "key {}", k);
            }
            core.check_invariants().unwrap();
        }
    }
}

/// With digests off, a deposit's copy is not digested and its page has none.
#[test]
fn digests_off_take_none() {
    let (mut core, ns, region) = core(4, true, 1_000_000);
    core.set_page_digests(false);
    deposit(&mut core, 0, key(ns, 1), region, 1);
    let (job, _, digested) = next_copy(&mut core).unwrap();
    assert!(!digested);
    core.handle_copy_done(1, job, &[CopyOutcome::Copied]);
    assert_eq!(core.query(&key(ns, 1)), QueryStatus::Hit);
    assert_eq!(core.page_digest(&key(ns, 1)), None);
}

/// Fills `k1` (spilled with digest 11) back from G3 with outcome `outcome`;
/// returns the fetch's result and the digest the fill was asked to find.
fn spill_then_fill(outcome: CopyOutcome) -> (Core, ScopedKey, OpResult, Option<u64>) {
    let (mut core, ns, region) = core_with_g3(2, true, 1_000_000, Some(4));
    let (k1, k2, k3) = (key(ns, 1), key(ns, 2), key(ns, 3));
    for (now, (k, digest)) in [(k1, 11), (k2, 22)].into_iter().enumerate() {
        deposit(&mut core, now as u64 * 2, k, region, now as u64 + 1);
        let (job, _, _) = next_copy(&mut core).unwrap();
        core.handle_copy_done_digested(
            now as u64 * 2 + 1,
            job,
            &[CopyOutcome::Copied],
            &[Some(digest)],
        );
    }
    // DRAM is full: k3 waits while k1 is spilled, with its digest.
    deposit(&mut core, 4, k3, region, 3);
    let Some(Action::G3 { job, digests, .. }) = core.poll_action() else {
        panic!("expected the spill");
    };
    assert_eq!(digests, [None], "a store checks nothing");
    core.handle_copy_done(5, job, &[CopyOutcome::Copied]);
    let (job, _, _) = next_copy(&mut core).unwrap();
    core.handle_copy_done_digested(6, job, &[CopyOutcome::Copied], &[Some(33)]);
    assert_eq!(core.query(&k1), QueryStatus::Fetchable(Tier::Disk));
    let mut done = Vec::new();
    core.drain_completed(&mut done);
    // Fetching k1 spills k2, then reads k1 back, expecting its digest.
    let fetch = core.fetch(7, &[k1], &[PoolId(0)], None).unwrap();
    let Some(Action::G3 { job, .. }) = core.poll_action() else {
        panic!("expected k2's spill");
    };
    core.handle_copy_done(8, job, &[CopyOutcome::Copied]);
    let Some(Action::G3 { job, digests, .. }) = core.poll_action() else {
        panic!("expected k1's fill");
    };
    core.handle_copy_done(9, job, &[outcome]);
    let mut done = Vec::new();
    core.drain_completed(&mut done);
    let result = done.into_iter().find(|r| r.op == fetch).unwrap();
    (core, k1, result, digests.first().copied().flatten())
}

/// A page spilled to G3 keeps its deposit digest: the fill is asked to find
/// it, and the page filled back carries it again.
#[test]
fn a_spilled_page_is_filled_back_with_its_digest() {
    let (core, k1, result, expected) = spill_then_fill(CopyOutcome::Copied);
    assert_eq!(expected, Some(11));
    assert!(result.entries[0].1.is_success());
    assert_eq!(core.page_digest(&k1), Some(11));
    core.check_invariants().unwrap();
}

/// A fill whose bytes did not match the digest fails typed, is counted, and
/// the G3 copy is dropped: the page is served from nowhere.
#[test]
fn an_altered_fill_fails_and_drops_the_g3_copy() {
    let (core, k1, result, _) = spill_then_fill(CopyOutcome::Altered);
    let status = result.entries[0].1.status;
    assert_eq!(status, EntryStatus::Failed(FailReason::DigestMismatch));
    assert_eq!(core.query(&k1), QueryStatus::Miss);
    let counters = core.g3_counters().unwrap();
    assert_eq!((counters.digest_mismatches, counters.fills_failed), (1, 1));
    core.check_invariants().unwrap();
}
