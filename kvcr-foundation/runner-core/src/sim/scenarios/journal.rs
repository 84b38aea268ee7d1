//! The journal under the protocol: slots granted to a source's write are
//! journaled held, and stay out of use after the target crashes.

use super::*;

/// A target's journal names the slots it granted to a source's write
/// (`Held`) before the grant goes out; a target that dies then and is
/// recovered keeps those slots out of use (the source may still write
/// them), and a write that ends frees them (`Freed`) before its page is
/// journaled READY.
#[test]
fn granted_slots_are_journaled_held_and_kept_out_of_use_after_a_crash() {
    use crate::journal::{JournalWriter, recover};
    let mut sim = Sim::new(17);
    sim.quiet();
    sim.targets[0].core.enable_journal();
    let mut region = vec![0u8; 64 << 10];
    let mut writer = JournalWriter::format(&mut region).unwrap();
    let mut journal = |core: &mut Core, region: &mut Vec<u8>| {
        let records = core.take_journal();
        for record in &records {
            writer.append(region, record).unwrap();
        }
        records
    };
    let keys = vec![sim.key(0), sim.key(1)];
    let request = RequestId("held".into());
    let hint = FetchHint {
        source: endpoint(SOURCE_PORTS[0]),
        block_hashes: keys.iter().map(|k| k.key).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    sim.targets[0].core.submit_hint(0, request.clone(), &hint);
    sim.targets[0]
        .core
        .fetch(0, &keys, &[PoolId(0)], Some(&request))
        .unwrap();
    journal(&mut sim.targets[0].core, &mut region);
    sim.flush();
    // Deliver until the start_write is on the wire (the source never reads it).
    let mut granted = false;
    for _ in 0..32 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if matches!(message.body, Body::StartWrite { .. }) {
            granted = true;
            break;
        }
        sim.handle(&to, 0, message);
        // The pump journals before it sends anything.
        journal(&mut sim.targets[0].core, &mut region);
        sim.flush();
    }
    assert!(granted, "the target asked the source to write");
    let recovered = recover(&region).unwrap();
    assert_eq!(recovered.held.len(), 2, "{recovered:?}");
    assert!(recovered.pages.is_empty());

    // The target dies; a fresh one takes the journal.
    let (mut fresh, _) = new_core(TARGET_POOL, TARGET_PORTS[0], 0xdead);
    let (report, _) = fresh.recover(0, &recovered);
    assert_eq!(report.held_slots, 2);
    assert_eq!(fresh.recovered_held_slots(), 2);
    fresh.check_invariants().unwrap();
    // Every slot but the held ones can be filled; the held ones never are.
    let free = u64::from(SLOTS) - 2;
    let region = fresh
        .register_region(RegionDesc {
            label: "kv".into(),
            base: SOURCE_HOST,
            size: BLOCK,
            stride: 0,
            count: u64::from(SLOTS),
        })
        .unwrap();
    let entries = (0..u64::from(SLOTS))
        .map(|k| DepositEntry {
            key: ScopedKey {
                namespace: keys[0].namespace,
                key: BlockKey::from_u64(100 + k),
            },
            spans: vec![ElementRef { region, index: k }],
            page: None,
        })
        .collect();
    fresh.deposit(0, entries, true).unwrap();
    while let Some(action) = fresh.poll_action() {
        if let Action::Copy { job, keys, .. } = action {
            fresh.handle_copy_done(0, job, &vec![CopyOutcome::Copied; keys.len()]);
        }
    }
    let used: HashSet<u32> = fresh.ready_pages().into_values().flatten().collect();
    assert_eq!(used.len() as u64, free, "every free slot, no held one");
    assert!(recovered.held.iter().all(|s| !used.contains(s)));
    fresh.check_invariants().unwrap();
}
