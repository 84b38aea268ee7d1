//! The G3 tier step by step: spills and fills back, failed transfers, and a
//! second reader sharing a waiting G3 fill.

use super::*;

/// The next action, which must be a single-key G3 transfer: its job, slot and direction.
fn next_g3(core: &mut Core) -> (JobId, u32, crate::machine::G3Direction) {
    match core.poll_action() {
        Some(Action::G3 { job, transfers, .. }) => {
            assert_eq!(transfers.len(), 1, "{transfers:?}");
            (job, transfers[0][0].slot, transfers[0][0].direction)
        }
        other => panic!("expected a G3 transfer, got {other:?}"),
    }
}

fn next_copy(core: &mut Core) -> (JobId, usize) {
    match core.poll_action() {
        Some(Action::Copy { job, keys, .. }) => (job, keys.len()),
        other => panic!("expected a copy, got {other:?}"),
    }
}

fn deposit_one(core: &mut Core, now: u64, k: ScopedKey, region: RegionId, index: u64) -> OpHandle {
    core.deposit(
        now,
        vec![DepositEntry {
            key: k,
            spans: vec![ElementRef { region, index }],
            page: Some(PageInfo {
                parent: None,
                token_ids: vec![index as u32; 4],
            }),
        }],
        false,
    )
    .unwrap()
}

fn completed(core: &mut Core) -> Vec<OpResult> {
    let mut out = Vec::new();
    core.drain_completed(&mut out);
    out
}

fn events(core: &mut Core) -> Vec<(Medium, &'static str, u64)> {
    core.drain_events()
        .flat_map(|e| match e {
            InventoryEvent::Stored { scope, keys, .. } => keys
                .into_iter()
                .map(|k| (scope.medium, "stored", k.as_u64()))
                .collect::<Vec<_>>(),
            InventoryEvent::Removed { scope, keys } => keys
                .into_iter()
                .map(|k| (scope.medium, "removed", k.as_u64()))
                .collect(),
            InventoryEvent::AllCleared { .. } => Vec::new(),
        })
        .collect()
}

/// A move to G3, step by step: the deposit that needs room waits while the
/// victim is spilled (still readable in DRAM), the victim leaves DRAM only
/// once G3 holds it, and it is then fetchable from G3 and filled back.
#[test]
fn a_victim_moves_to_g3_and_fills_back() {
    use crate::machine::G3Direction::{Load, Store};
    let (mut core, ns, region) = core_with_g3(2, true, 1_000_000, Some(2));
    let (k1, k2, k3) = (key(ns, 1), key(ns, 2), key(ns, 3));
    deposit_one(&mut core, 0, k1, region, 1);
    let (job, n) = next_copy(&mut core);
    core.handle_copy_done(1, job, &vec![CopyOutcome::Copied; n]);
    deposit_one(&mut core, 2, k2, region, 2);
    let (job, n) = next_copy(&mut core);
    core.handle_copy_done(3, job, &vec![CopyOutcome::Copied; n]);
    assert_eq!(events(&mut core).len(), 2);
    assert_eq!(completed(&mut core).len(), 2);

    // DRAM is full: k3 waits while k1 (least recently used) is spilled.
    let waiting = deposit_one(&mut core, 4, k3, region, 3);
    let (spill, _, direction) = next_g3(&mut core);
    assert_eq!(direction, Store);
    assert_eq!(
        core.query(&k1),
        QueryStatus::Hit,
        "readable in DRAM while spilling"
    );
    assert!(
        !core.g3_ready(&k1),
        "not READY in G3 before the write completed"
    );
    assert!(completed(&mut core).is_empty());
    core.check_invariants().unwrap();

    core.handle_copy_done(5, spill, &[CopyOutcome::Copied]);
    assert_eq!(
        events(&mut core),
        [
            (Medium::Disk, "stored", 1),
            (Medium::CpuPinned, "removed", 1)
        ]
    );
    assert_eq!(core.query(&k1), QueryStatus::Fetchable(Tier::Disk));
    let (job, n) = next_copy(&mut core);
    core.handle_copy_done(6, job, &vec![CopyOutcome::Copied; n]);
    let done = completed(&mut core);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].op, waiting);
    assert!(done[0].entries[0].1.is_success());
    core.check_invariants().unwrap();

    // Fetching k1 spills k2 to make room, then reads k1 back from G3.
    let fetch = core.fetch(7, &[k1], &[PoolId(0)], None).unwrap();
    let (spill, _, direction) = next_g3(&mut core);
    assert_eq!(direction, Store);
    core.handle_copy_done(8, spill, &[CopyOutcome::Copied]);
    let (fill, _, direction) = next_g3(&mut core);
    assert_eq!(direction, Load);
    assert_eq!(core.query(&k1), QueryStatus::Fetching);
    core.handle_copy_done(9, fill, &[CopyOutcome::Copied]);
    let done = completed(&mut core);
    assert_eq!(done[0].op, fetch);
    assert!(
        done[0].entries[0].1.release.is_some(),
        "fetched and claimed"
    );
    assert_eq!(core.query(&k1), QueryStatus::Hit);
    assert!(core.g3_ready(&k1), "both tiers hold it now");
    let c = core.g3_counters().unwrap();
    assert_eq!(
        (c.spills_committed, c.fills, c.capacity_waits),
        (2, 1, 2),
        "{c:?}"
    );
    core.check_invariants().unwrap();
}

/// A failed spill keeps the DRAM copy (serving) and frees the G3 slot; a
/// failed read drops the G3 copy and fails the reader, never serving it.
#[test]
fn failed_g3_transfers_lose_nothing_and_serve_nothing_wrong() {
    let (mut core, ns, region) = core_with_g3(1, true, 1_000_000, Some(1));
    let (k1, k2) = (key(ns, 1), key(ns, 2));
    deposit_one(&mut core, 0, k1, region, 1);
    let (job, n) = next_copy(&mut core);
    core.handle_copy_done(1, job, &vec![CopyOutcome::Copied; n]);
    events(&mut core);
    completed(&mut core);

    // The spill of k1 fails (a full disk): k1 stays in DRAM, G3 is empty,
    // and the waiting deposit of k2 then evicts k1 (dropped, not moved again).
    let deposit = deposit_one(&mut core, 2, k2, region, 2);
    let (spill, _, _) = next_g3(&mut core);
    core.handle_copy_done(3, spill, &[CopyOutcome::Failed]);
    assert!(!core.g3_ready(&k1));
    assert_eq!(core.g3_counters().unwrap().free_slots, 1);
    assert_eq!(events(&mut core), [(Medium::CpuPinned, "removed", 1)]);
    let (job, n) = next_copy(&mut core);
    core.handle_copy_done(4, job, &vec![CopyOutcome::Copied; n]);
    assert_eq!(completed(&mut core)[0].op, deposit);
    core.check_invariants().unwrap();

    // k2 moves to G3 for k1's deposit; then a read of k2 fails: the fetch
    // fails and G3 forgets k2.
    deposit_one(&mut core, 5, k1, region, 1);
    let (spill, _, _) = next_g3(&mut core);
    core.handle_copy_done(6, spill, &[CopyOutcome::Copied]);
    let (job, n) = next_copy(&mut core);
    core.handle_copy_done(7, job, &vec![CopyOutcome::Copied; n]);
    completed(&mut core);
    assert_eq!(core.query(&k2), QueryStatus::Fetchable(Tier::Disk));
    events(&mut core);
    let fetch = core.fetch(8, &[k2], &[PoolId(0)], None).unwrap();
    // Room for k2 first: G3's one slot holds k2, claimed by the fill about
    // to read it, so k1 cannot move there and is dropped instead.
    loop {
        match core.poll_action() {
            Some(Action::G3 { job, transfers, .. }) => {
                let load = transfers[0][0].direction == crate::machine::G3Direction::Load;
                let outcome = if load {
                    CopyOutcome::Failed
                } else {
                    CopyOutcome::Copied
                };
                core.handle_copy_done(9, job, &[outcome]);
            }
            Some(Action::Copy { job, keys, .. }) => {
                core.handle_copy_done(9, job, &vec![CopyOutcome::Copied; keys.len()]);
            }
            Some(other) => panic!("{other:?}"),
            None => break,
        }
    }
    let done = completed(&mut core);
    let result = &done.iter().find(|r| r.op == fetch).unwrap().entries[0].1;
    assert_eq!(result.status, EntryStatus::Failed(FailReason::CopyFailed));
    assert!(!core.g3_ready(&k2));
    assert_eq!(core.query(&k2), QueryStatus::Miss);
    assert!(events(&mut core).contains(&(Medium::Disk, "removed", 2)));
    core.check_invariants().unwrap();
}

/// Two readers of one G3 page while DRAM room is still being made: the
/// second queues behind the first's fill and shares it, instead of asking
/// for room that is all spoken for (it failed `CapacityExhausted` before).
#[test]
fn a_second_reader_of_a_waiting_g3_fill_shares_it() {
    use crate::machine::G3Direction::{Load, Store};
    let (mut core, ns, region) = core_with_g3(1, true, 1_000_000, Some(2));
    let (k1, k2) = (key(ns, 1), key(ns, 2));
    deposit_one(&mut core, 0, k1, region, 1);
    let (job, n) = next_copy(&mut core);
    core.handle_copy_done(1, job, &vec![CopyOutcome::Copied; n]);
    // k2 needs the one slot: k1 moves to G3.
    deposit_one(&mut core, 2, k2, region, 2);
    let (spill, _, direction) = next_g3(&mut core);
    assert_eq!(direction, Store);
    core.handle_copy_done(3, spill, &[CopyOutcome::Copied]);
    let (job, n) = next_copy(&mut core);
    core.handle_copy_done(4, job, &vec![CopyOutcome::Copied; n]);
    assert_eq!(completed(&mut core).len(), 2);
    assert_eq!(core.query(&k1), QueryStatus::Fetchable(Tier::Disk));

    // Two fetches of k1: the room is k2's slot, which a spill makes.
    let first = core.fetch(5, &[k1], &[PoolId(0)], None).unwrap();
    let second = core.fetch(5, &[k1], &[PoolId(0)], None).unwrap();
    assert!(completed(&mut core).is_empty(), "both wait for room");
    let (spill, _, direction) = next_g3(&mut core);
    assert_eq!(direction, Store, "k2 is spilled for the room");
    core.handle_copy_done(6, spill, &[CopyOutcome::Copied]);
    let (fill, _, direction) = next_g3(&mut core);
    assert_eq!(direction, Load, "one fill of k1");
    assert!(core.poll_action().is_none(), "not two");
    core.handle_copy_done(7, fill, &[CopyOutcome::Copied]);
    let done = completed(&mut core);
    for op in [first, second] {
        let result = done.iter().find(|r| r.op == op).unwrap();
        assert!(result.entries[0].1.is_success(), "{result:?}");
    }
    core.check_invariants().unwrap();
}
