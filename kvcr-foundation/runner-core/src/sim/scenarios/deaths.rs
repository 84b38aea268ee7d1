//! Guard-confirmed death reports: quarantined operations probed again, freed
//! only by a death report of their own incarnation from their own source,
//! reprobes capped, and restarts the guard did or did not confirm.

use super::*;

/// The source's incarnations in the death-report tests (a target's are 1
/// and 2, and the hostile member's 0xbad).
const OLD: u128 = 0x50;
const NEW: u128 = 0x51;

fn ack() -> Body {
    Body::TargetMetadataAck {
        op_handle: None,
        one_copy: false,
        device: false,
    }
}

fn probe_ack(op: OpHandle, dead: Option<u128>) -> Body {
    Body::WriteProbeAck {
        op_handle: op,
        terminal: true,
        dead_incarnation: dead.map(|i| Incarnation::from_raw(i).unwrap()),
    }
}

/// Target `core` fetches `key` from the source at port 2 under a fresh
/// hinted request. Returns the `start_write`s it sent: op, the incarnation
/// named, the slot granted.
fn fetch_from_port_2(
    core: &mut Core,
    ns: NamespaceId,
    now: u64,
    key: u64,
) -> Vec<(OpHandle, Option<Incarnation>, u64)> {
    let request = RequestId(format!("k{key}@{now}"));
    let hint = FetchHint {
        source: endpoint(2),
        block_hashes: vec![BlockKey::from_u64(key)],
        mode: FetchMode::Copy,
        action_id: None,
    };
    core.submit_hint(now, request.clone(), &hint);
    core.fetch(now, &[scoped(ns, key)], &[PoolId(0)], Some(&request))
        .unwrap();
    starts(&sent(core))
}

fn starts(sent: &[(ControlEndpoint, Body)]) -> Vec<(OpHandle, Option<Incarnation>, u64)> {
    sent.iter()
        .filter_map(|(_, body)| match body {
            Body::StartWrite {
                op_handle,
                source_incarnation,
                destinations,
                ..
            } => Some((
                *op_handle,
                *source_incarnation,
                destinations[0].first().unwrap().index,
            )),
            _ => None,
        })
        .collect()
}

/// The probes in `sent`: op and the incarnation each names.
fn probes(sent: &[(ControlEndpoint, Body)]) -> Vec<(OpHandle, Option<Incarnation>)> {
    sent.iter()
        .filter_map(|(_, body)| match body {
            Body::WriteProbe {
                op_handle,
                source_incarnation,
            } => Some((*op_handle, *source_incarnation)),
            _ => None,
        })
        .collect()
}

fn turn(core: &mut Core, now: u64) -> Vec<(ControlEndpoint, Body)> {
    core.handle_tick(now);
    core.handle_timeout(now);
    sent(core)
}

/// A target (port 1) holding, for the source at port 2: ops `a` and `b`
/// sent to incarnation `OLD` and quarantined (no answer by the abandonment
/// deadline), op `c` sent to `OLD` later and past its deadline (probed,
/// waiting for proof), and op `d` sent to `NEW`, which took the address
/// and acknowledged the metadata afresh. Returns the core, the four ops
/// with their slots, and what the target sent on `NEW`'s ack.
#[allow(clippy::type_complexity)]
fn target_with_old_ops() -> (Core, [(OpHandle, u64); 4], Vec<(ControlEndpoint, Body)>) {
    let (mut target, ns) = new_core(TARGET_POOL, 1, 1);
    let old = Some(Incarnation::from_raw(OLD).unwrap());
    target.handle_tick(0);
    // The first write waits for the ack.
    assert!(fetch_from_port_2(&mut target, ns, 0, 2).is_empty());
    target.handle_message(0, from(2, OLD, ack()));
    let [(a, _, slot_a)] = starts(&sent(&mut target))[..] else {
        panic!("one start_write")
    };
    let [(b, _, slot_b)] = fetch_from_port_2(&mut target, ns, 0, 3)[..] else {
        panic!("one start_write")
    };
    // Probe #1 at the op deadline, probe #2 and quarantine at abandonment.
    let quarter = TIMEOUT / 4;
    for step in 1..=12 {
        turn(&mut target, step * quarter);
    }
    let now = 3 * TIMEOUT;
    assert_eq!(
        target.take_notices(),
        vec![
            crate::PeerNotice::Uncertain { op: a },
            crate::PeerNotice::Uncertain { op: b }
        ]
    );
    // `OLD` again (the expiry invalidated the ack): c goes out to it.
    fetch_from_port_2(&mut target, ns, now, 4);
    target.handle_message(now, from(2, OLD, ack()));
    let [(c, named, slot_c)] = starts(&sent(&mut target))[..] else {
        panic!("one start_write")
    };
    assert_eq!(named, old);
    for step in 1..=5 {
        turn(&mut target, now + step * quarter);
    }
    let now = now + 5 * quarter;
    // `NEW` takes the address; the target's session to it broke.
    target.peer_connection_lost(&endpoint(2));
    fetch_from_port_2(&mut target, ns, now, 5);
    target.handle_message(now, from(2, NEW, ack()));
    let on_ack = sent(&mut target);
    let [(d, named, slot_d)] = starts(&on_ack)[..] else {
        panic!("one start_write")
    };
    assert_eq!(named, Some(Incarnation::from_raw(NEW).unwrap()));
    for slot in [slot_a, slot_b, slot_c, slot_d] {
        assert!(!target.slot_is_free(PoolId(0), slot as u32));
    }
    assert_eq!(target.peer_busy().0, 4);
    (
        target,
        [(a, slot_a), (b, slot_b), (c, slot_c), (d, slot_d)],
        on_ack,
    )
}

/// A fresh ack from the process now at the endpoint probes the quarantined
/// ops again, each naming the incarnation it was sent to; a duplicate of
/// that ack does not.
#[test]
fn a_fresh_ack_probes_the_quarantined_ops_again() {
    let (mut target, [(a, _), (b, _), ..], on_ack) = target_with_old_ops();
    let old = Some(Incarnation::from_raw(OLD).unwrap());
    assert_eq!(probes(&on_ack), vec![(a, old), (b, old)]);
    target.handle_message(0, from(2, NEW, ack()));
    assert!(probes(&sent(&mut target)).is_empty(), "a duplicate ack");
    assert_eq!(
        target.peer_counters().reprobes,
        2 + 2,
        "on OLD's ack, NEW's"
    );
}

/// A death report for one op, from the op's own endpoint, naming the
/// incarnation it was sent to, frees that op and every other op sent to
/// that incarnation (quarantined ones with their quiesced notice); an op of
/// another incarnation is untouched.
#[test]
fn a_death_report_frees_every_op_of_that_incarnation() {
    let (mut target, [(a, slot_a), (b, slot_b), (c, slot_c), (d, slot_d)], _) =
        target_with_old_ops();
    let now = 5 * TIMEOUT;
    target.handle_message(now, from(2, NEW, probe_ack(a, Some(OLD))));
    for slot in [slot_a, slot_b, slot_c] {
        assert!(target.slot_is_free(PoolId(0), slot as u32), "slot {slot}");
    }
    assert!(!target.slot_is_free(PoolId(0), slot_d as u32), "NEW's op");
    assert_eq!(target.peer_busy().0, 1);
    assert_eq!(
        target.take_notices(),
        vec![
            crate::PeerNotice::Quiesced { op: a },
            crate::PeerNotice::Quiesced { op: b }
        ],
        "c was never quarantined"
    );
    let counters = target.peer_counters();
    assert_eq!((counters.dead_freed, counters.dead_ignored), (3, 0));
    target.check_invariants().unwrap();
    let _ = (c, d);
}

/// A death report is believed only from the op's own endpoint, naming the
/// op's incarnation, from another process than that one, about an op that
/// was probed: otherwise nothing is freed, and it is counted.
#[test]
fn a_death_report_from_elsewhere_or_about_another_incarnation_frees_nothing() {
    let (mut target, [(a, slot_a), (b, _), (c, _), (d, slot_d)], _) = target_with_old_ops();
    let now = 5 * TIMEOUT;
    let ignored = [
        from(9, NEW, probe_ack(a, Some(OLD))),  // another endpoint
        from(9, OLD, probe_ack(c, Some(OLD))),  // another endpoint
        from(2, NEW, probe_ack(a, Some(0x77))), // not the op's incarnation
        from(2, NEW, probe_ack(b, Some(NEW))),  // not the op's incarnation
        from(2, OLD, probe_ack(a, Some(OLD))),  // the process itself
        from(2, OLD, probe_ack(d, Some(NEW))),  // d was never probed
    ];
    let n = ignored.len() as u64;
    for message in ignored {
        target.handle_message(now, message);
    }
    // Terminal answers without a death report prove nothing from NEW.
    target.handle_message(now, from(2, NEW, probe_ack(a, None)));
    assert_eq!(target.peer_busy().0, 4, "nothing freed");
    assert!(!target.slot_is_free(PoolId(0), slot_a as u32));
    assert!(target.take_notices().is_empty());
    let counters = target.peer_counters();
    assert_eq!((counters.dead_freed, counters.dead_ignored), (0, n));
    // The op's own incarnation's terminal answer is proof (as always).
    target.handle_message(now, from(2, OLD, probe_ack(a, None)));
    assert!(target.slot_is_free(PoolId(0), slot_a as u32));
    assert!(!target.slot_is_free(PoolId(0), slot_d as u32));
    target.check_invariants().unwrap();
}

/// More quarantined ops than one ack probes again: each ack takes the next
/// ones, oldest first, so all get their turn.
#[test]
fn reprobes_are_capped_per_ack_and_take_turns() {
    let (mut target, ns) = new_core_with(TARGET_POOL, 1, 1, Tiers::with_g3(200, 8, false), |_| {});
    target.handle_tick(0);
    fetch_from_port_2(&mut target, ns, 0, 0);
    target.handle_message(0, from(2, OLD, ack()));
    let total = MAX_REPROBES_PER_ACK + 36;
    let mut ops: Vec<OpHandle> = starts(&sent(&mut target)).iter().map(|s| s.0).collect();
    for key in 1..total as u64 {
        ops.extend(
            fetch_from_port_2(&mut target, ns, 0, key)
                .iter()
                .map(|s| s.0),
        );
    }
    assert_eq!(ops.len(), total);
    for step in 1..=12 {
        turn(&mut target, step * TIMEOUT / 4);
    }
    let mut probed = Vec::new();
    for round in 0..3u128 {
        target.peer_connection_lost(&endpoint(2));
        target.handle_message(3 * TIMEOUT, from(2, NEW + round, ack()));
        let sent = probes(&sent(&mut target));
        assert_eq!(sent.len(), MAX_REPROBES_PER_ACK, "round {round}");
        probed.extend(sent.into_iter().map(|p| p.0));
    }
    let expected: Vec<OpHandle> = ops.iter().chain(&ops).take(probed.len()).copied().collect();
    assert_eq!(probed, expected, "oldest first, in turn, wrapping");
}

/// A source that the guard told of its address's dead incarnations answers
/// a probe naming one with a death report; without the list, or for an
/// incarnation not on it, it answers as before (non-terminal for another
/// incarnation); its own incarnation is never reported dead.
#[test]
fn a_source_reports_only_the_incarnations_its_guard_confirmed_dead() {
    let (mut sim, own) = stocked_source(|_| {});
    let source = &mut sim.sources[0].core;
    source.handle_message(0, from(1, 11, metadata(1)));
    sent(source);
    let probe = |op: u64, incarnation: u128| {
        from(
            1,
            11,
            Body::WriteProbe {
                op_handle: OpHandle(op),
                source_incarnation: Some(Incarnation::from_raw(incarnation).unwrap()),
            },
        )
    };
    let answers = |source: &mut Core| -> Vec<(bool, Option<Incarnation>)> {
        sent(source)
            .into_iter()
            .filter_map(|(_, body)| match body {
                Body::WriteProbeAck {
                    terminal,
                    dead_incarnation,
                    ..
                } => Some((terminal, dead_incarnation)),
                _ => None,
            })
            .collect()
    };
    let old = Incarnation::from_raw(OLD).unwrap();
    source.handle_message(0, probe(1, OLD));
    assert_eq!(answers(source), vec![(false, None)], "not known dead");
    source.set_dead_incarnations(vec![old, own]);
    assert_eq!(source.dead_incarnations(), &[old], "never itself");
    source.handle_message(0, probe(2, OLD));
    source.handle_message(0, probe(3, 0x77));
    source.handle_message(0, probe(4, own.raw()));
    assert_eq!(
        answers(source),
        vec![(true, Some(old)), (false, None), (true, None)],
        "dead; unknown; its own, with nothing in flight"
    );
    assert_eq!(source.peer_counters().dead_reported, 1);
    // Bounded: the latest ones are kept.
    let many: Vec<Incarnation> = (1..=100u128)
        .map(|i| Incarnation::from_raw(0x1000 + i).unwrap())
        .collect();
    source.set_dead_incarnations(many.clone());
    assert_eq!(
        source.dead_incarnations(),
        &many[100 - MAX_DEAD_INCARNATIONS..]
    );
}

/// Delivers every message on `sim`'s network (and those they cause) at
/// `now`, in order, without landing puts; returns the probe answers the
/// target got.
fn pump(sim: &mut Sim, now: u64) -> Vec<Body> {
    let mut answers = Vec::new();
    for _ in 0..100 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if to == endpoint(TARGET_PORTS[0]) && matches!(message.body, Body::WriteProbeAck { .. }) {
            answers.push(message.body.clone());
        }
        sim.handle(&to, now, message);
        sim.flush();
    }
    assert!(sim.network.is_empty());
    answers
}

/// Target 0 fetches key 0 from source 0, whose put into the granted slot is
/// in flight when the source stops answering: the op is quarantined. Then
/// the source crashes (`guarded`: the guard confirms it) and restarts, and
/// the target fetches from the address again. Returns the quarantined op,
/// its slot and the probe answers the target got from the new process.
fn quarantined_then_restart(seed: u64, guarded: bool) -> (Sim, OpHandle, u64, Vec<Body>) {
    let mut sim = Sim::new(seed);
    sim.quiet();
    hinted_request(&mut sim, 0, 0, 0..1, false);
    sim.flush();
    pump(&mut sim, 0);
    assert!(!sim.puts.is_empty(), "the put is under way");
    let [(&op, grants)] = sim.targets[0].grants.iter().collect::<Vec<_>>()[..] else {
        panic!("one op")
    };
    let slot = grants[0].1;
    // The source answers nothing any more: probes #1 and #2 go unanswered.
    for now in [TIMEOUT, 3 * TIMEOUT] {
        sim.targets[0].core.handle_tick(now);
        sim.targets[0].core.handle_timeout(now);
        sim.flush();
        sim.network.clear();
    }
    assert_eq!(sim.targets[0].core.peer_counters().quarantined, 1);
    sim.now = 3 * TIMEOUT;
    if guarded {
        sim.restart_source_guarded(0);
    } else {
        sim.restart_source(0);
    }
    sim.targets[0]
        .core
        .peer_connection_lost(&sim.sources[0].endpoint);
    sim.targets[0].core.take_notices();
    hinted_request(&mut sim, 0, 0, 1..2, false);
    sim.flush();
    let now = sim.now;
    let answers = pump(&mut sim, now);
    sim.check().unwrap();
    (sim, op, slot, answers)
}

/// A source restarted without the guard's confirmation answers the
/// re-probe non-terminal: the slot stays held, and the old process's late
/// put lands in it harmlessly.
#[test]
fn a_restart_the_guard_did_not_confirm_keeps_the_slots() {
    for seed in [21, 22, 23] {
        let (mut sim, _, slot, answers) = quarantined_then_restart(seed, false);
        assert!(
            answers.iter().all(|a| matches!(
                a,
                Body::WriteProbeAck {
                    terminal: false,
                    dead_incarnation: None,
                    ..
                }
            )) && !answers.is_empty(),
            "{answers:?}"
        );
        assert!(!sim.targets[0].core.slot_is_free(PoolId(0), slot as u32));
        assert!(sim.targets[0].core.take_notices().is_empty());
        let old = source_incarnation(seed, 0, 0);
        assert!(
            sim.puts
                .iter()
                .any(|p| p.incarnation == old && p.target == 0 && p.slot == slot),
            "the old process's put may still land"
        );
        sim.advance_to(10 * TIMEOUT);
        sim.check().unwrap();
        assert!(!sim.targets[0].core.slot_is_free(PoolId(0), slot as u32));
        assert_eq!(sim.targets[0].core.peer_counters().dead_freed, 0);
    }
}

/// After a guard-confirmed crash the restarted source reports the old
/// incarnation dead when the target probes its quarantined op again (on
/// the new process's ack), and the slot is freed with a quiesced notice.
#[test]
fn a_guard_confirmed_death_frees_the_quarantined_slots() {
    for seed in [21, 22, 23] {
        let (mut sim, op, slot, answers) = quarantined_then_restart(seed, true);
        let old = source_incarnation(seed, 0, 0);
        assert!(
            sim.puts.iter().all(|p| p.incarnation != old),
            "resolved at the crash"
        );
        assert!(
            answers.iter().any(|a| matches!(
                a,
                Body::WriteProbeAck {
                    terminal: true,
                    dead_incarnation: Some(i),
                    ..
                } if i.raw() == old
            )),
            "{answers:?}"
        );
        assert!(sim.targets[0].core.slot_is_free(PoolId(0), slot as u32));
        // The simulator took the notice: one quarantined op quiesced.
        assert_eq!(sim.seen.dead_freed_quarantined, 1, "op {op:?}");
        assert_eq!(sim.targets[0].core.peer_counters().dead_freed, 1);
        sim.settle().unwrap();
    }
}
