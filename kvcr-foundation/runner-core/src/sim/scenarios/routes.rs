//! Bounded state: route budgets (a burst, then one change per refill),
//! remembered budgets, fences under a probe flood, and per-peer memory over
//! many peers.

use super::*;

/// The route budget's cell rate: a fresh target may change now; up to
/// `burst` changes queue ahead of `now`; 0 counts as 1; extremes saturate.
#[rstest::rstest]
#[case::fresh(4, 10, None, 100, Some(110))]
#[case::long_ago(4, 10, Some(50), 100, Some(110))]
#[case::within_burst(4, 10, Some(130), 100, Some(140))]
#[case::over_burst(4, 10, Some(131), 100, None)]
#[case::one_at_a_time(1, 10, Some(110), 105, None)]
#[case::zero_burst_is_one(0, 10, Some(101), 100, None)]
#[case::zero_burst_fresh(0, 10, None, 100, Some(110))]
#[case::saturates(u32::MAX, u64::MAX, Some(u64::MAX), 0, Some(u64::MAX))]
fn route_budget_admits_a_burst_then_one_per_refill(
    #[case] burst: u32,
    #[case] refill_ns: u64,
    #[case] due: Option<u64>,
    #[case] now: u64,
    #[case] expected: Option<u64>,
) {
    let budget = RouteBudget { burst, refill_ns };
    assert_eq!(budget.admit(now, due), expected);
}

/// Metadata that says `label` for its one region: each new label is a
/// route change.
fn labelled_metadata(label: &str) -> Body {
    let Body::TargetMetadata {
        worker_address,
        mut regions,
        shared_memory,
        doorbell,
        device_regions,
    } = metadata(1)
    else {
        unreachable!("metadata() builds TargetMetadata")
    };
    regions[0].label = label.to_owned();
    Body::TargetMetadata {
        worker_address,
        regions,
        shared_memory,
        doorbell,
        device_regions,
    }
}

/// The route builds a core asks of its driver, and the messages it sends
/// (other actions are dropped).
fn connects_and_sends(core: &mut Core) -> (Vec<(ControlEndpoint, u64)>, Vec<Body>) {
    let (mut connects, mut sends) = (Vec::new(), Vec::new());
    while let Some(action) = core.poll_action() {
        match action {
            Action::Connect {
                peer, generation, ..
            } => connects.push((peer, generation)),
            Action::Send { message, .. } => sends.push(message.body),
            _ => {}
        }
    }
    (connects, sends)
}

fn connects(core: &mut Core) -> Vec<(ControlEndpoint, u64)> {
    connects_and_sends(core).0
}

/// A target that changes its route in a loop gets its burst at once, then
/// one per refill: the rest are refused unacknowledged (counted), its old
/// route stays, and a refused target re-sending after the refill is served.
#[test]
fn route_changes_beyond_the_budget_are_refused_until_it_refills() {
    let (mut sim, _) = stocked_source(|c| {
        c.route_budget = RouteBudget {
            burst: 3,
            refill_ns: 1_000,
        };
    });
    let core = &mut sim.sources[0].core;
    let mut built = Vec::new();
    for round in 0..10 {
        core.handle_message(0, from(1, 11, labelled_metadata(&format!("r{round}"))));
        let (connects, replies) = connects_and_sends(core);
        assert!(replies.is_empty(), "refused or waiting for its connect");
        built.extend(connects);
    }
    assert_eq!(built.len(), 3, "the burst, at once");
    assert_eq!(core.peer_counters().routes_refused, 7);
    for (peer, generation) in &built {
        core.handle_connected(peer, *generation, false);
    }
    let acks = sent(core);
    assert_eq!(
        acks.len(),
        1,
        "only the newest generation is acknowledged: {acks:?}"
    );
    // Refused metadata left the last built route in place: the same advert
    // again is no change, and is acknowledged at once.
    core.handle_message(10, from(1, 11, labelled_metadata("r2")));
    let (built, replies) = connects_and_sends(core);
    assert!(built.is_empty());
    assert!(
        matches!(replies.as_slice(), [Body::TargetMetadataAck { .. }]),
        "{replies:?}"
    );
    // Not yet refilled, then refilled: one more change.
    core.handle_message(999, from(1, 11, labelled_metadata("r9")));
    assert!(connects(core).is_empty());
    core.handle_message(1_000, from(1, 11, labelled_metadata("r9")));
    assert_eq!(connects(core).len(), 1);
    core.handle_message(1_000, from(1, 11, labelled_metadata("r10")));
    assert!(connects(core).is_empty(), "one per refill");
    // Another target has its own budget.
    core.handle_message(1_000, from(5, 12, labelled_metadata("x")));
    assert_eq!(connects(core).len(), 1);
    assert_eq!(core.peer_counters().routes_refused, 7 + 2);
    core.check_invariants().unwrap();
}

/// Names rotated by members (each fresh name within its own budget) share
/// one total budget: its burst at once, then one per refill, whichever name
/// asks; the rest are refused unacknowledged (counted).
#[test]
fn rotating_names_share_the_total_route_budget() {
    let (mut sim, _) = stocked_source(|c| {
        c.route_budget = RouteBudget {
            burst: 3,
            refill_ns: 1_000,
        };
        c.route_budget_total = RouteBudget {
            burst: 5,
            refill_ns: 1_000,
        };
    });
    let core = &mut sim.sources[0].core;
    let mut built = 0;
    for name in 0..10u16 {
        core.handle_message(0, from(100 + name, 11, labelled_metadata("r")));
        built += connects(core).len();
    }
    assert_eq!(built, 5, "the total burst, over every name");
    assert_eq!(core.peer_counters().routes_refused, 5);
    // Refilled: one more, for whichever name comes first; not two.
    core.handle_message(1_000, from(200, 11, labelled_metadata("r")));
    core.handle_message(1_000, from(201, 11, labelled_metadata("r")));
    assert_eq!(connects(core).len(), 1);
    assert_eq!(core.peer_counters().routes_refused, 6);
    core.check_invariants().unwrap();
}

/// The budgets a source remembers are bounded: with every one of
/// [`MAX_ROUTE_BUDGETS`] in use a new target is refused; once they have
/// refilled (as good as forgotten) they make room.
#[test]
fn remembered_route_budgets_are_bounded() {
    let refill_ns = 1_000;
    let (mut sim, _) = stocked_source(|c| {
        c.route_budget = RouteBudget {
            burst: 1,
            refill_ns,
        };
    });
    let core = &mut sim.sources[0].core;
    let port = |i: usize| 10_000 + i as u16;
    for i in 0..MAX_ROUTE_BUDGETS {
        core.handle_message(0, from(port(i), 100 + i as u128, metadata(1)));
        assert_eq!(connects(core).len(), 1, "target {i}");
    }
    let newcomer = port(MAX_ROUTE_BUDGETS);
    core.handle_message(1, from(newcomer, 99, metadata(1)));
    assert!(
        connects(core).is_empty(),
        "no room while every budget is spent"
    );
    assert_eq!(core.peer_counters().routes_refused, 1);
    core.handle_message(refill_ns, from(newcomer, 99, metadata(1)));
    assert_eq!(connects(core).len(), 1, "refilled budgets were forgotten");
    core.check_invariants().unwrap();
}

/// A probe flood from one target keeps at most `MAX_FENCES_PER_TARGET`
/// fences; folded fences still refuse every op at or below the highest
/// probed, and accepted ops prune the fences below them.
#[test]
fn fences_stay_bounded_under_a_probe_flood() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, metadata(1)));
    let flood = 10 * MAX_FENCES_PER_TARGET as u64;
    for op in 1..=flood {
        sim.sources[0].core.handle_message(
            0,
            from(
                1,
                11,
                Body::WriteProbe {
                    op_handle: OpHandle(op),
                    source_incarnation: None,
                },
            ),
        );
        assert!(sim.sources[0].core.peer_state_sizes().fences <= MAX_FENCES_PER_TARGET);
    }
    sent(&mut sim.sources[0].core);
    for op in [1, flood / 2, flood] {
        sim.sources[0]
            .core
            .handle_message(0, from(1, 11, start_write(op, source_incarnation, ns, 0)));
        assert!(
            matches!(
                sent(&mut sim.sources[0].core).as_slice(),
                [(
                    _,
                    Body::WriteDone {
                        outcome: WriteOutcome::Failed { terminal: true },
                        ..
                    }
                )]
            ),
            "op {op} was probed: it never writes"
        );
    }
    assert_eq!(sim.sources[0].core.peer_busy().1, 0);
    sim.sources[0].core.handle_message(
        0,
        from(1, 11, start_write(flood + 1, source_incarnation, ns, 0)),
    );
    assert_eq!(sim.sources[0].core.peer_busy().1, 1, "a fresh op is served");
    assert_eq!(
        sim.sources[0].core.peer_state_sizes().fences,
        0,
        "pruned below it"
    );
}

/// Targets that come and go with fresh incarnations, and router hints naming
/// ever new sources, leave a bounded memory behind.
#[test]
fn per_peer_memory_is_bounded_over_many_peers() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    let peers = 3 * MAX_REMEMBERED_PEERS as u128;
    for incarnation in 100..100 + peers {
        sim.sources[0]
            .core
            .handle_message(0, from(1, incarnation, metadata(1)));
        sim.sources[0].core.handle_message(
            0,
            from(1, incarnation, start_write(1, source_incarnation, ns, 99)),
        );
        sim.sources[0].core.peer_target_gone(&endpoint(1));
        sent(&mut sim.sources[0].core);
    }
    let sizes = sim.sources[0].core.peer_state_sizes();
    assert!(sizes.high_water <= MAX_REMEMBERED_PEERS + 1, "{sizes:?}");
    assert_eq!(sizes.routes, 0);

    let (mut target, _) = new_core(TARGET_POOL, 1, 1);
    for port in 0..3 * MAX_REMEMBERED_PEERS {
        let request = RequestId(format!("r{port}"));
        let hint = FetchHint {
            source: ControlEndpoint::parse(&format!(
                "tcp://127.0.{}.{}:9",
                port / 250,
                port % 250 + 1
            ))
            .unwrap(),
            block_hashes: vec![BlockKey::from_u64(1)],
            mode: FetchMode::Copy,
            action_id: None,
        };
        target.submit_hint(0, request.clone(), &hint);
        target.discard_hint(&request);
        sent(&mut target);
    }
    let sizes = target.peer_state_sizes();
    assert!(sizes.sources <= MAX_REMEMBERED_PEERS, "{sizes:?}");
    assert_eq!(sizes.hinted_requests, 0);
}
