//! Scripted restores: fault-free requests restore the hinted keys (from DRAM
//! or G3), and a stall or an expiry ends the way the protocol says.

use super::*;

/// Target `t` fetches (or delivers) `keys` at the current time, under a
/// router hint naming source `s`.
pub(super) fn hinted_request(
    sim: &mut Sim,
    t: usize,
    s: usize,
    keys: std::ops::Range<u64>,
    deliver: bool,
) {
    let now = sim.now;
    let keys: Vec<ScopedKey> = keys.map(|k| sim.key(k)).collect();
    let name = RequestId(format!("{t}-{s}-{deliver}-{now}"));
    let hint = FetchHint {
        source: sim.sources[s].endpoint.clone(),
        block_hashes: keys.iter().map(|k| k.key).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    let target = &mut sim.targets[t];
    target.core.submit_hint(now, name.clone(), &hint);
    assert_eq!(
        target.core.query_request(&keys[0], Some(&name)),
        QueryStatus::Fetchable(kvcr_contracts::tier::Tier::External)
    );
    if deliver {
        let entries = keys
            .iter()
            .map(|key| {
                let element = target.next_element;
                target.next_element += 1;
                target.deliveries.insert(element, (key.key.as_u64(), false));
                DeliverEntry {
                    key: *key,
                    destinations: vec![ElementRef {
                        region: target.framework,
                        index: element,
                    }],
                }
            })
            .collect();
        let op = target.core.deliver(now, entries, Some(&name)).unwrap();
        for (i, key) in keys.iter().enumerate() {
            let element = target.next_element - keys.len() as u64 + i as u64;
            target
                .deliver_elements
                .insert((op, key.key.as_u64()), element);
        }
    } else {
        target
            .core
            .fetch(now, &keys, &[PoolId(0)], Some(&name))
            .unwrap();
    }
}

/// Without faults, hinted fetches and delivers restore every key their
/// source holds: both targets pull from source 0 at once, target 1 also
/// from source 1, with each target's batching and each source's lanes.
/// Target 0 fetches `keys` at `now` under a hint (request `name`) naming
/// source 0, and the first messages are sent (nothing is delivered yet).
pub(super) fn start_hinted_fetch(sim: &mut Sim, keys: &[ScopedKey], now: u64, name: &str) {
    let request = RequestId(name.into());
    let hint = FetchHint {
        source: endpoint(2),
        block_hashes: keys.iter().map(|k| k.key).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    sim.targets[0].core.submit_hint(now, request.clone(), &hint);
    sim.targets[0]
        .core
        .fetch(now, keys, &[PoolId(0)], Some(&request))
        .unwrap();
    sim.flush();
}

#[test]
fn fault_free_requests_restore_the_hinted_keys() {
    for seed in [7, 8, 9, 10] {
        let mut sim = Sim::new(seed);
        sim.quiet();
        hinted_request(&mut sim, 0, 0, 0..4, false);
        hinted_request(&mut sim, 1, 0, 4..8, false);
        hinted_request(&mut sim, 1, 1, 8..12, true);
        sim.flush();
        // Deliver everything without loss; every piece lands.
        for _ in 0..100 {
            sim.deliver_for(TIMEOUT / 100);
            sim.check().unwrap();
        }
        let seen = sim.coverage();
        let counters = |core: &Core| core.peer_counters();
        assert_eq!(
            (seen.successes, seen.delivered, seen.committed),
            ([4, 8], 4, [4, 8]),
            "seed {seed}: {seen:?}"
        );
        assert_eq!(counters(&sim.targets[0].core).keys_received, 4);
        assert_eq!(counters(&sim.targets[1].core).keys_received, 8);
        assert_eq!(counters(&sim.sources[0].core).keys_sent, 8);
        assert_eq!(counters(&sim.sources[1].core).keys_sent, 4);
        assert!(sim.targets.iter().all(|t| t.core.ops_in_flight() == 0));
        // Nothing waits any more: no node tells an idle caller to wait.
        let cores = sim.targets.iter().map(|t| &t.core);
        for core in cores.chain(sim.sources.iter().map(|s| &s.core)) {
            assert_eq!(core.next_peer_deadline(), None, "seed {seed}");
        }
    }
}

/// Without faults, keys a source holds only in G3 are restored too: it
/// fills them back into its pool before serving each `start_write`
/// (`SourcePrepare`), moving the pages it had there to G3 to make room,
/// and the next request, for those pages, is served the same way. (G3 has
/// room for every key here: a victim G3 has no slot for is dropped.)
#[test]
fn fault_free_requests_restore_keys_only_g3_holds() {
    for (seed, slots, spill_ahead) in [(7, 4, false), (8, 4, true), (9, 5, false), (10, 5, true)] {
        let mut sim = Sim::build(seed, 100);
        sim.quiet();
        let tiers = Tiers::with_g3(slots, SOURCE_KEYS as u32, spill_ahead);
        sim.sources[0] = Source::new(0, seed, 0, 2, 0, sim.ns, tiers, HashMap::new());
        let first = SOURCE_FIRST_KEY[0];
        let g3_only = (first..first + SOURCE_KEYS)
            .filter(|k| sim.sources[0].core.query(&sim.key(*k)) != QueryStatus::Hit)
            .count() as u64;
        assert_eq!(g3_only, SOURCE_KEYS - u64::from(slots), "seed {seed}");
        // The oldest keys went to G3: 0..4 are there only (but 3, with a
        // pool of 5); 4..8 are in the pool until the first request's fills
        // move them.
        hinted_request(&mut sim, 0, 0, 0..4, false);
        sim.flush();
        sim.settle().unwrap();
        hinted_request(&mut sim, 1, 0, 4..8, true);
        sim.flush();
        sim.settle().unwrap();
        let seen = sim.coverage();
        assert_eq!(
            (seen.successes, seen.delivered),
            ([4, 4], 4),
            "seed {seed}: {seen:?}"
        );
        assert_eq!(sim.sources[0].core.peer_counters().keys_sent, 8);
        assert!(seen.source_fills > g3_only, "seed {seed}: {seen:?}");
        assert_eq!(
            seen.served_from_g3, seen.source_fills,
            "seed {seed}: {seen:?}"
        );
        assert_eq!((seen.failed_fills, seen.failed_spills), (0, 0));
    }
}

/// A `start_write` that waited in the source's socket while the source was
/// stopped is refused, even when the first turn after the stop handles the
/// message before its tick: a stalled source never serves a queued request
/// with a fresh deadline. Once its driver ended the stall it serves again,
/// but a late copy of the refused request is still refused.
#[test]
fn a_request_queued_during_a_stall_is_refused() {
    let mut sim = Sim::new(11);
    sim.quiet();
    let keys: Vec<ScopedKey> = (0..2).map(|k| sim.key(k)).collect();
    start_hinted_fetch(&mut sim, &keys, 0, "r");
    // Metadata and its ack go round at time 0, the source ticking on each
    // turn, until the start_write is on its way.
    let mut stale = None;
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if to == endpoint(1) {
            sim.targets[0].core.handle_message(0, message);
        } else if matches!(message.body, Body::StartWrite { .. }) {
            stale = Some(message);
            break;
        } else {
            sim.sources[0].core.handle_tick(0);
            sim.sources[0].core.handle_message(0, message);
        }
        sim.flush();
    }
    let stale = stale.expect("the target sent its start_write");
    let refused = sim.sources[0].core.peer_counters().refused;
    // The process was stopped for a whole operation timeout; the message is
    // handled before the first tick after it.
    sim.sources[0].core.handle_message(TIMEOUT, stale.clone());
    assert_eq!(sim.sources[0].core.peer_counters().refused, refused + 1);
    assert!(
        refused_terminally(&mut sim),
        "the refusal is a terminal failure"
    );
    // The driver takes the stall, waits out the drain, closes the sessions
    // opened before it, and the source serves again.
    let source = &mut sim.sources[0].core;
    assert_eq!(source.peer_counters().stalls, 1);
    assert_eq!(source.take_peer_stall(), Some(TIMEOUT));
    assert!(!source.peer_stall_drained(TIMEOUT + TIMEOUT / 4 - 1));
    assert!(source.peer_stall_drained(TIMEOUT + TIMEOUT / 4));
    source.end_peer_stall();
    assert!(!source.peer_stalled());
    // A copy of the refused request arriving after that (its refusal freed
    // the target's slots) is refused again, never written.
    source.handle_message(TIMEOUT + TIMEOUT / 2, stale);
    assert!(refused_terminally(&mut sim), "a late copy is refused too");
}

/// Whether source 0's pending actions answer with a terminal failure (and
/// write nothing).
fn refused_terminally(sim: &mut Sim) -> bool {
    let mut replied = false;
    while let Some(action) = sim.sources[0].core.poll_action() {
        match action {
            Action::Put { .. } => panic!("a request queued during a stall was written"),
            Action::Send { message, .. } => {
                replied |= matches!(
                    message.body,
                    Body::WriteDone {
                        outcome: WriteOutcome::Failed { terminal: true },
                        ..
                    }
                );
            }
            _ => {}
        }
    }
    replied
}

/// After an operation expires (the source may have died), the next write
/// waits for a fresh metadata ack instead of naming the cached incarnation:
/// a process restarted at the same address is asked by its own incarnation,
/// and the old one never receives it.
#[test]
fn a_write_after_an_expiry_waits_for_a_fresh_ack() {
    let mut sim = Sim::new(13);
    sim.quiet();
    let old = Incarnation::from_raw(sim.sources[0].incarnation).unwrap();
    // Metadata, ack and a start_write naming the old incarnation.
    let k0 = sim.key(0);
    start_hinted_fetch(&mut sim, &[k0], 0, "a");
    let mut named = Vec::new();
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if let Body::StartWrite {
            source_incarnation, ..
        } = &message.body
        {
            named.push(*source_incarnation);
            continue; // the source dies before it reads it
        }
        sim.handle(&to, 0, message);
        sim.flush();
    }
    named.dedup();
    assert_eq!(named, vec![Some(old)]);
    // The op expires; a new process takes the address.
    sim.targets[0].core.handle_tick(TIMEOUT);
    sim.targets[0].core.handle_timeout(TIMEOUT);
    sim.network.clear();
    sim.now = TIMEOUT; // the new process starts then
    sim.restart_source(0);
    let new = Incarnation::from_raw(sim.sources[0].incarnation).unwrap();
    let k1 = sim.key(1);
    start_hinted_fetch(&mut sim, &[k1], TIMEOUT + 1, "b");
    let mut named = Vec::new();
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if let Body::StartWrite {
            source_incarnation, ..
        } = &message.body
        {
            named.push(*source_incarnation);
        }
        sim.handle(&to, TIMEOUT + 1, message);
        sim.flush();
    }
    named.dedup(); // the simulated network may duplicate a message
    assert_eq!(named, vec![Some(new)], "only the new incarnation is asked");
    assert_eq!(sim.sources[0].core.peer_counters().refused, 0);
}

/// A hinted deliver naming one missing key twice (two destinations) asks
/// its source for the key once and copies it to both: no second FILLING
/// record for the same key, no slot lost, both destinations written.
#[test]
fn a_deliver_naming_one_missing_key_twice_fills_it_once() {
    let mut sim = Sim::new(7);
    sim.quiet();
    let now = sim.now;
    let key = sim.key(1);
    let request = RequestId("twice".into());
    let hint = FetchHint {
        source: sim.sources[0].endpoint.clone(),
        block_hashes: vec![key.key],
        mode: FetchMode::Copy,
        action_id: None,
    };
    let target = &mut sim.targets[0];
    target.core.submit_hint(now, request.clone(), &hint);
    let mut entries = Vec::new();
    for _ in 0..2 {
        let element = target.next_element;
        target.next_element += 1;
        target.deliveries.insert(element, (key.key.as_u64(), false));
        entries.push(DeliverEntry {
            key,
            destinations: vec![ElementRef {
                region: target.framework,
                index: element,
            }],
        });
    }
    let op = target.core.deliver(now, entries, Some(&request)).unwrap();
    let first = target.next_element - 2;
    target
        .deliver_elements
        .insert((op, key.key.as_u64()), first);
    sim.flush();
    for _ in 0..100 {
        sim.deliver_for(TIMEOUT / 100);
        sim.targets[0].core.check_invariants().unwrap();
    }
    assert_eq!(sim.targets[0].core.peer_counters().writes_requested, 1);
    assert_eq!(sim.targets[0].core.peer_counters().keys_received, 1);
    let mut done = Vec::new();
    sim.targets[0].core.drain_completed(&mut done);
    let result = done.iter().find(|r| r.op == op).expect("the deliver ended");
    assert!(
        result.entries.iter().all(|(_, e)| e.is_success()),
        "{result:?}"
    );
}

/// Polling for timeouts before a write's deadline does nothing, however
/// often (each poll is a comparison with the floor, no scan); the write is
/// given up on at its deadline exactly (its abandon deadline is then the
/// next), and quarantined at that one exactly (held until proof, no timer:
/// no peer deadline is left).
#[test]
fn a_write_is_given_up_on_at_its_deadline_not_before() {
    let mut sim = Sim::new(17);
    sim.quiet();
    let k0 = sim.key(0);
    start_hinted_fetch(&mut sim, &[k0], 0, "a");
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if matches!(message.body, Body::StartWrite { .. }) {
            continue; // the source never reads it
        }
        sim.handle(&to, 0, message);
        sim.flush();
    }
    let target = &mut sim.targets[0].core;
    assert_eq!(target.next_peer_deadline(), Some(TIMEOUT));
    for now in [1, TIMEOUT / 2, TIMEOUT - 1] {
        target.handle_timeout(now);
        assert_eq!(target.peer_counters().quarantined, 0, "at {now}");
    }
    target.handle_timeout(TIMEOUT);
    assert_eq!(target.next_peer_deadline(), Some(3 * TIMEOUT), "abandon");
    for now in [TIMEOUT + 1, 3 * TIMEOUT - 1] {
        target.handle_timeout(now);
        assert_eq!(target.peer_counters().quarantined, 0, "at {now}");
    }
    target.handle_timeout(3 * TIMEOUT);
    assert_eq!(target.peer_counters().quarantined, 1);
    assert_eq!(target.next_peer_deadline(), None);
}
