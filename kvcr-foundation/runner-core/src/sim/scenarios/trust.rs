//! Trust rules: allowlists, private namespaces, oversized metadata, doorbells
//! and write messages, landing spans, and routes that go with their
//! sessions.

use super::*;

pub(super) fn from(port: u16, incarnation: u128, body: Body) -> Message {
    Message {
        header: Header {
            sender: Incarnation::from_raw(incarnation).unwrap(),
            route_generation: RouteGeneration(0),
            sender_endpoint: endpoint(port),
        },
        body,
    }
}

/// The messages a core sent, in order (other actions are dropped).
pub(super) fn sent(core: &mut Core) -> Vec<(ControlEndpoint, Body)> {
    let mut out = Vec::new();
    while let Some(action) = core.poll_action() {
        if let Action::Send { to, message } = action {
            out.push((to, message.body));
        }
    }
    out
}

pub(super) fn metadata(regions: usize) -> Body {
    Body::TargetMetadata {
        worker_address: vec![1; 4],
        regions: (0..regions)
            .map(|i| RegionAdvert {
                id: RegionId(i as u32),
                label: format!("r{i}"),
                base: TARGET_POOL,
                element_size: BLOCK,
                stride: BLOCK,
                count: u64::from(SLOTS),
                rkey: vec![1, 2, 3],
            })
            .collect(),
        shared_memory: None,
        doorbell: None,
        device_regions: Vec::new(),
    }
}

/// A source with keys 0..8, and the incarnation it answers as.
pub(super) fn stocked_source(adjust: impl FnOnce(&mut PeerConfig)) -> (Sim, Incarnation) {
    let mut sim = Sim::new(3);
    sim.reconfigure_source(0, adjust);
    let incarnation = sim.sources[0].incarnation;
    (sim, Incarnation::from_raw(incarnation).unwrap())
}

pub(super) fn start_write(op: u64, source: Incarnation, ns: NamespaceId, key: u64) -> Body {
    Body::StartWrite {
        op_handle: OpHandle(op),
        remaining_timeout_ms: 1,
        source_incarnation: Some(source),
        namespace: ns,
        keys: vec![BlockKey::from_u64(key)],
        destinations: vec![
            vec![ElementRef {
                region: RegionId(0),
                index: 0,
            }]
            .into(),
        ],
        lead_elements: 0,
    }
}

/// With an allowlist, a router hint naming another source makes the rank
/// send nothing (no metadata, no memory description) and fetch nothing, and
/// messages from outside the list are refused before any handler.
#[test]
fn an_allowlist_keeps_hints_and_messages_to_its_peers() {
    let (mut target, ns) = new_core_with(TARGET_POOL, 1, 1, Tiers::DRAM_ONLY, |c| {
        c.allowed_peers = vec![endpoint(2)];
    });
    let hint = FetchHint {
        source: endpoint(7),
        block_hashes: vec![BlockKey::from_u64(1)],
        mode: FetchMode::Copy,
        action_id: None,
    };
    let request = RequestId("r".into());
    target.submit_hint(0, request.clone(), &hint);
    assert!(sent(&mut target).is_empty(), "nothing told to a stranger");
    let key = ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(1),
    };
    assert_eq!(
        target.query_request(&key, Some(&request)),
        QueryStatus::Miss
    );
    target.handle_message(0, from(7, 7, metadata(1)));
    assert!(sent(&mut target).is_empty());
    assert_eq!(target.peer_counters().refused_peers, 2);
    assert_eq!(target.peer_state_sizes().routes, 0);
    // The allowed source is served as usual.
    let hint = FetchHint {
        source: endpoint(2),
        ..hint
    };
    target.submit_hint(0, request, &hint);
    assert!(matches!(
        sent(&mut target).as_slice(),
        [(to, Body::TargetMetadata { .. })] if *to == endpoint(2)
    ));
}

/// A private namespace is served only to its members; others get a terminal
/// failure and nothing is written or claimed.
#[test]
fn a_private_namespace_is_refused_to_other_targets() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    sim.reconfigure_source(0, |c| {
        c.private_namespaces = vec![(ns, vec![endpoint(5)])];
    });
    for (port, op) in [(1u16, 1u64), (5, 2)] {
        sim.sources[0]
            .core
            .handle_message(0, from(port, 11, metadata(1)));
        sim.sources[0].core.handle_message(
            0,
            from(port, 11, start_write(op, source_incarnation, ns, 0)),
        );
    }
    let replies = sent(&mut sim.sources[0].core);
    let refused = replies.iter().any(|(to, body)| {
        *to == endpoint(1)
            && matches!(
                body,
                Body::WriteDone {
                    op_handle: OpHandle(1),
                    outcome: WriteOutcome::Failed { terminal: true }
                }
            )
    });
    assert!(refused, "{replies:?}");
    assert_eq!(sim.sources[0].core.peer_counters().refused_private, 1);
    assert_eq!(
        sim.sources[0].core.peer_busy().1,
        1,
        "the member's write is under way"
    );
}

/// The driver's wake time: nothing pending wakes it a quarter of the
/// operation timeout after its last tick (a stall is still told from an idle
/// sleep); a pending request wakes it at its deadline.
#[test]
fn an_idle_driver_wakes_for_stall_checks_and_deadlines_only() {
    let (mut target, ns) = new_core(TARGET_POOL, 1, 1);
    assert_eq!(target.peer_wake_at(), None, "never ticked: no guard yet");
    target.handle_tick(1_000);
    assert_eq!(target.peer_wake_at(), Some(1_000 + TIMEOUT / 4));
    let request = RequestId("wake".into());
    let key = ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(1),
    };
    target.submit_hint(
        1_000,
        request.clone(),
        &FetchHint {
            source: endpoint(2),
            block_hashes: vec![key.key],
            mode: FetchMode::Copy,
            action_id: None,
        },
    );
    target
        .fetch(1_000, &[key], &[PoolId(0)], Some(&request))
        .unwrap();
    let wake = target.peer_wake_at().unwrap();
    assert!(wake <= 1_000 + TIMEOUT, "the request's deadline: {wake}");
    assert_eq!(target.peer_transport_waits(), 1, "no one-copy ack yet");
    assert!(target.peer_awaits_transport());
}

/// Metadata past the stated bounds is neither kept nor acknowledged nor
/// handed to UCX; within them it is.
#[test]
fn oversized_metadata_is_refused_whole() {
    let (mut sim, _) = stocked_source(|_| {});
    let too_many = metadata(MAX_ADVERTISED_REGIONS + 1);
    let Body::TargetMetadata { regions, .. } = metadata(1) else {
        unreachable!()
    };
    let huge_address = Body::TargetMetadata {
        worker_address: vec![0; MAX_WORKER_ADDRESS_LEN + 1],
        regions: regions.clone(),
        shared_memory: None,
        doorbell: None,
        device_regions: Vec::new(),
    };
    let mut big_rkey = regions;
    big_rkey[0].rkey = vec![0; MAX_RKEY_LEN + 1];
    let huge_rkey = Body::TargetMetadata {
        worker_address: vec![1; 4],
        regions: big_rkey,
        shared_memory: None,
        doorbell: None,
        device_regions: Vec::new(),
    };
    for body in [too_many, huge_address, huge_rkey] {
        sim.sources[0].core.handle_message(0, from(1, 11, body));
        assert!(
            sent(&mut sim.sources[0].core).is_empty(),
            "not acknowledged"
        );
    }
    assert_eq!(sim.sources[0].core.peer_counters().refused, 3);
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 0);
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, metadata(MAX_ADVERTISED_REGIONS)));
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 1);
}

/// The doorbell rides with the route: the same key is the same route (no
/// new connect), a new key is a new route generation handed to the driver;
/// a write's completion is offered for ringing only while it is being
/// written and covers every key asked for.
#[test]
fn a_doorbell_is_part_of_the_route_and_offers_only_whole_writes() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    let with_key = |key: u8| {
        let Body::TargetMetadata {
            worker_address,
            regions,
            shared_memory,
            ..
        } = metadata(1)
        else {
            unreachable!()
        };
        Body::TargetMetadata {
            worker_address,
            regions,
            shared_memory,
            doorbell: Some(DoorbellAdvert {
                region: RegionId(0),
                key: [key; 32],
            }),
            device_regions: Vec::new(),
        }
    };
    let connects = |sim: &mut Sim| -> Vec<(u64, Option<DoorbellAdvert>)> {
        std::iter::from_fn(|| sim.sources[0].core.poll_action())
            .filter_map(|a| match a {
                Action::Connect {
                    generation,
                    doorbell,
                    ..
                } => Some((generation, doorbell)),
                _ => None,
            })
            .collect()
    };
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, with_key(1)));
    let first = connects(&mut sim);
    assert!(
        matches!(first.as_slice(), [(_, Some(d))] if d.key == [1; 32]),
        "{first:?}"
    );
    sim.sources[0]
        .core
        .handle_connected(&endpoint(1), first[0].0, true);
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, with_key(1)));
    assert!(
        connects(&mut sim).is_empty(),
        "the same key: the same route"
    );
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, with_key(2)));
    let second = connects(&mut sim);
    assert!(
        matches!(second.as_slice(), [(g, Some(d))] if *g > first[0].0 && d.key == [2; 32]),
        "{second:?}"
    );
    sim.sources[0]
        .core
        .handle_connected(&endpoint(1), second[0].0, true);
    sent(&mut sim.sources[0].core);
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, start_write(7, source_incarnation, ns, 0)));
    let write = std::iter::from_fn(|| sim.sources[0].core.poll_action())
        .find_map(|a| match a {
            Action::Put { write, .. } => Some(write),
            _ => None,
        })
        .expect("the write is put");
    assert_eq!(
        sim.sources[0].core.peer_write_completion(write),
        Some((OpHandle(7), 1))
    );
    assert_eq!(sim.sources[0].core.peer_write_completion(write + 1), None);
    sim.sources[0].core.handle_put_done(0, write, true);
    assert_eq!(
        sim.sources[0].core.peer_write_completion(write),
        None,
        "an ended write offers nothing"
    );
}

/// A write whose bytes leave as one message carrying its completion ends
/// without a `write_done` (the message is it); one that failed to leave, or
/// whose target gave up meanwhile, ends with a terminal failure as a put
/// would. Either way its keys are released.
#[test]
fn a_write_sent_as_a_message_sends_no_second_completion() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    let core = &mut sim.sources[0].core;
    core.handle_message(0, from(1, 11, metadata(1)));
    let generation = std::iter::from_fn(|| core.poll_action())
        .find_map(|a| match a {
            Action::Connect { generation, .. } => Some(generation),
            _ => None,
        })
        .expect("a connect");
    core.handle_connected(&endpoint(1), generation, false);
    sent(core);
    let put = |core: &mut Core, op: u64, key: u64| {
        core.handle_message(0, from(1, 11, start_write(op, source_incarnation, ns, key)));
        std::iter::from_fn(|| core.poll_action())
            .find_map(|a| match a {
                Action::Put { write, .. } => Some(write),
                _ => None,
            })
            .expect("the write is put")
    };
    let first = put(core, 7, 0);
    assert_eq!(core.peer_write_completion(first), Some((OpHandle(7), 1)));
    core.handle_message_sent(0, first, true);
    assert!(sent(core).is_empty(), "the message was the write_done");
    assert_eq!(core.peer_busy().1, 0, "the write ended");
    assert_eq!(core.peer_counters().keys_sent, 1);
    let second = put(core, 8, 1);
    core.handle_message_sent(0, second, false);
    assert!(
        matches!(
            sent(core).as_slice(),
            [(
                _,
                Body::WriteDone {
                    op_handle: OpHandle(8),
                    outcome: WriteOutcome::Failed { terminal: true }
                }
            )]
        ),
        "a message that did not leave ends as a failed put"
    );
    assert_eq!(core.peer_busy().1, 0);
    // Both keys were released: probes answer that nothing is in flight.
    for op in [7, 8] {
        core.handle_message(
            0,
            from(
                1,
                11,
                Body::WriteProbe {
                    op_handle: OpHandle(op),
                    source_incarnation: Some(source_incarnation),
                },
            ),
        );
        assert!(matches!(
            sent(core).as_slice(),
            [(_, Body::WriteProbeAck { terminal: true, .. })]
        ));
    }
}

/// Where a write's bytes may be copied when they arrive as a message: the
/// elements the target granted, in request order, only for the operation's
/// whole key count and only while it waits for its reply.
#[test]
fn landing_spans_are_the_granted_elements_while_the_reply_is_awaited() {
    let mut sim = Sim::new(17);
    sim.quiet();
    let keys = vec![sim.key(0), sim.key(1)];
    start_hinted_fetch(&mut sim, &keys, 0, "landing");
    // Deliver everything but the start_write (the source never sees it).
    let mut start = None;
    for _ in 0..16 {
        let Some((&k, _)) = sim.network.iter().next() else {
            break;
        };
        let (to, message) = sim.network.remove(&k).unwrap();
        if let Body::StartWrite {
            op_handle,
            destinations,
            ..
        } = &message.body
        {
            start = Some((*op_handle, destinations.clone()));
            continue;
        }
        sim.handle(&to, 0, message);
        sim.flush();
    }
    let (op, destinations) = start.expect("a start_write went out");
    let target = &mut sim.targets[0].core;
    let granted: Vec<(u64, u64)> = destinations
        .iter()
        .flatten()
        .map(|e| target.resolve(e).unwrap())
        .collect();
    assert_eq!(granted.len(), 2);
    assert_eq!(target.peer_landing_spans(op, 2), Some(granted));
    let first_key: Vec<(u64, u64)> = destinations[0]
        .iter()
        .map(|e| target.resolve(e).unwrap())
        .collect();
    assert_eq!(
        target.peer_landing_spans(op, 1),
        Some(first_key),
        "the first key's (a source that holds only it)"
    );
    assert_eq!(target.peer_landing_spans(op, 3), None);
    assert_eq!(target.peer_landing_spans(op, 0), None);
    assert_eq!(target.peer_landing_spans(OpHandle(op.0 + 1), 2), None);
    let source = Incarnation::from_raw(sim.sources[0].incarnation).unwrap();
    let done = Message {
        header: Header {
            sender: source,
            route_generation: RouteGeneration(0),
            sender_endpoint: endpoint(2),
        },
        body: Body::WriteDone {
            op_handle: op,
            outcome: WriteOutcome::Completed(CompletedIndices::new(vec![0, 1])),
        },
    };
    sim.handle(&endpoint(1), 0, done);
    assert_eq!(
        sim.targets[0].core.peer_landing_spans(op, 2),
        None,
        "the operation ended"
    );
}

/// A route lives as long as its session and its UCX connect: when either
/// ends, nothing of it is kept and writes through it are refused.
#[test]
fn a_route_goes_with_its_session_or_a_failed_connect() {
    let (mut sim, source_incarnation) = stocked_source(|_| {});
    let ns = sim.ns;
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, metadata(1)));
    let generation = std::iter::from_fn(|| sim.sources[0].core.poll_action())
        .find_map(|a| match a {
            Action::Connect { generation, .. } => Some(generation),
            _ => None,
        })
        .unwrap();
    assert!(
        sent(&mut sim.sources[0].core).is_empty(),
        "the ack waits for the connect"
    );
    sim.sources[0]
        .core
        .handle_connect_failed(&endpoint(1), generation, ConnectFailure::Unusable);
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 0);
    assert!(matches!(
        sent(&mut sim.sources[0].core).as_slice(),
        [(
            _,
            Body::TargetMetadataAck {
                one_copy: false,
                ..
            }
        )]
    ));
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, start_write(1, source_incarnation, ns, 0)));
    assert!(matches!(
        sent(&mut sim.sources[0].core).as_slice(),
        [(_, Body::WriteRefused { .. })]
    ));
    sim.sources[0]
        .core
        .handle_message(0, from(1, 11, metadata(1)));
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 1);
    sim.sources[0].core.peer_target_gone(&endpoint(1));
    assert_eq!(sim.sources[0].core.peer_state_sizes().routes, 0);
}
