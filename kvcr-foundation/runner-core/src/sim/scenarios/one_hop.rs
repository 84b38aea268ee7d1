//! The one-hop route: scripted checks of what a source writes into a
//! target's device regions (and refuses to), a deliver held past its
//! deadline until proof, and the seeded device runs (`sim::device`) over
//! many seeds with their invariants and coverage.

use super::*;
use crate::machine::MAX_ADVERTISED_DEVICE_REGIONS;
use crate::sim::device::{
    DEVICE, DeviceCoverage, DeviceWorld, SOURCE_PORT, TARGET_PORT, source_hint,
};
use kvcr_contracts::protocol::DeviceRegionAdvert;

const DEVICE_REGION: RegionId = RegionId(5);

/// Metadata with one pool region, shared memory or not, and a device
/// region of `count` elements of `element_size` bytes.
fn device_metadata(shared: bool, element_size: u64, count: u64) -> Body {
    let Body::TargetMetadata {
        worker_address,
        regions,
        ..
    } = metadata(1)
    else {
        unreachable!("metadata() builds TargetMetadata")
    };
    Body::TargetMetadata {
        worker_address,
        regions,
        shared_memory: shared.then(|| SharedMemoryAdvert {
            boot_id: [1; 16],
            pid_namespace: 1,
            pid: 1,
            segments: Vec::new(),
        }),
        doorbell: None,
        device_regions: vec![DeviceRegionAdvert {
            id: DEVICE_REGION,
            base: DEVICE,
            element_size,
            stride: element_size,
            count,
            export: vec![0xe5; 16],
        }],
    }
}

/// A stocked source (keys 0..8) with a route from target 1 built from
/// `metadata`, its driver answering `device` for the device regions.
/// Returns the sim, the source's incarnation, how many device regions the
/// connect asked the driver to open, and what the source acked.
fn routed_source(metadata: Body, device: bool) -> (Sim, Incarnation, usize, Vec<Body>) {
    let (mut sim, source) = stocked_source(|_| {});
    let core = &mut sim.sources[0].core;
    core.handle_message(0, from(1, 11, metadata));
    let mut asked = 0;
    let mut acks = Vec::new();
    while let Some(action) = core.poll_action() {
        match action {
            Action::Connect {
                peer,
                generation,
                device_regions,
                ..
            } => {
                asked = device_regions.len();
                core.handle_connected_one_hop(&peer, generation, true, device);
            }
            Action::Send { message, .. } => acks.push(message.body),
            _ => {}
        }
    }
    (sim, source, asked, acks)
}

fn device_write(op: u64, source: Incarnation, ns: NamespaceId, keys: &[(u64, &[u64])]) -> Body {
    Body::StartWrite {
        op_handle: OpHandle(op),
        remaining_timeout_ms: 1,
        source_incarnation: Some(source),
        namespace: ns,
        keys: keys.iter().map(|(k, _)| BlockKey::from_u64(*k)).collect(),
        destinations: keys
            .iter()
            .map(|(_, elements)| {
                elements
                    .iter()
                    .map(|index| ElementRef {
                        region: DEVICE_REGION,
                        index: *index,
                    })
                    .collect()
            })
            .collect(),
        lead_elements: 0,
    }
}

/// A source's put: whether it is a device write, its spans, and how many
/// of them each page is.
type Put = (bool, Vec<PutSpan>, Vec<u32>);

/// What a source did with one `start_write`: its put (if any) and the
/// indices its immediate `write_done` reported (if one came).
fn served(core: &mut Core) -> (Option<Put>, Option<Vec<u32>>) {
    let (mut put, mut done) = (None, None);
    while let Some(action) = core.poll_action() {
        match action {
            Action::Put {
                spans,
                page_spans,
                device,
                ..
            } => put = Some((device, spans, page_spans)),
            Action::Send { message, .. } => {
                if let Body::WriteDone {
                    outcome: WriteOutcome::Completed(c),
                    ..
                } = message.body
                {
                    done = Some(c.as_slice().to_vec());
                }
            }
            _ => {}
        }
    }
    (put, done)
}

/// A page fills the granted device elements in order, wherever its slots
/// and the elements are cut differently; a key whose elements lie outside
/// the advertised region, do not add up to the page, or were named before
/// in the write is not written and is counted, like any bad element.
#[test]
fn a_source_writes_device_grants_exactly_and_refuses_the_rest() {
    let half = BLOCK / 2;
    let (mut sim, source, asked, acks) = routed_source(device_metadata(true, half, 8), true);
    assert_eq!(asked, 1, "the driver is asked to open the device region");
    assert!(matches!(
        acks.as_slice(),
        [Body::TargetMetadataAck { device: true, .. }]
    ));
    let ns = sim.ns;
    let core = &mut sim.sources[0].core;
    let refused = core.peer_counters().refused;
    // Key 1 into elements 6 and 7 (two halves); key 2 too small (one
    // half); key 3 outside the region; key 4 too big (three halves); key 5
    // names element 6 again; key 6 into elements 5 and 4.
    let body = device_write(
        1,
        source,
        ns,
        &[
            (1, &[6, 7]),
            (2, &[0]),
            (3, &[8, 1]),
            (4, &[0, 1, 2]),
            (5, &[6, 3]),
            (6, &[5, 4]),
        ],
    );
    core.handle_message(0, from(1, 11, body));
    let (put, done) = served(core);
    assert_eq!(done, None, "the written key is reported when its copy ends");
    let (device, spans, page_spans) = put.expect("the good keys are written");
    assert!(device, "as a device write");
    let remote: Vec<(u64, u64)> = spans.iter().map(|s| (s.remote, s.len)).collect();
    assert_eq!(
        remote,
        vec![
            (DEVICE + 6 * half, half),
            (DEVICE + 7 * half, half),
            (DEVICE + 5 * half, half),
            (DEVICE + 4 * half, half),
        ]
    );
    assert_eq!(page_spans, [2, 2], "each written key's page, two halves");
    let local: u64 = spans.iter().map(|s| s.len).sum();
    assert_eq!(local, 2 * BLOCK, "the whole pages, once each");
    assert_eq!(core.peer_counters().refused - refused, 4);
}

/// A device advert beside no shared memory (not a same-host offer) is
/// dropped unread: the driver is never asked to open it, the ack offers no
/// one-hop route, and a write naming its elements writes nothing.
#[test]
fn a_device_advert_without_shared_memory_is_ignored() {
    let (mut sim, source, asked, acks) = routed_source(device_metadata(false, BLOCK, 8), true);
    assert_eq!(asked, 0);
    let ns = sim.ns;
    let core = &mut sim.sources[0].core;
    assert!(matches!(
        acks.as_slice(),
        [Body::TargetMetadataAck { device: false, .. }]
    ));
    core.handle_message(0, from(1, 11, device_write(1, source, ns, &[(1, &[0])])));
    let (put, done) = served(core);
    assert!(put.is_none());
    assert_eq!(done, Some(Vec::new()), "answered: nothing written");
}

/// A route whose device regions the driver could not open is counted,
/// acknowledged without the one-hop route, and writes nothing there.
#[test]
fn device_regions_the_driver_cannot_open_are_never_written() {
    let (mut sim, source, asked, acks) = routed_source(device_metadata(true, BLOCK, 8), false);
    assert_eq!(asked, 1);
    let ns = sim.ns;
    let core = &mut sim.sources[0].core;
    assert_eq!(core.peer_counters().one_hop_refused, 1);
    assert!(matches!(
        acks.as_slice(),
        [Body::TargetMetadataAck { device: false, .. }]
    ));
    core.handle_message(0, from(1, 11, device_write(1, source, ns, &[(1, &[0])])));
    let (put, done) = served(core);
    assert!(put.is_none());
    assert_eq!(done, Some(Vec::new()));
}

/// Metadata as [`device_metadata`] (shared memory offered) with `regions`
/// device regions of 8 pages each, as an engine's per-layer K and V pools.
fn per_layer_metadata(regions: usize) -> Body {
    let Body::TargetMetadata {
        worker_address,
        regions: pools,
        shared_memory,
        device_regions,
        ..
    } = device_metadata(true, BLOCK, 8)
    else {
        unreachable!("device_metadata() builds TargetMetadata")
    };
    let template = device_regions[0].clone();
    let device_regions = (0..regions as u64)
        .map(|i| DeviceRegionAdvert {
            id: RegionId(100 + i as u32),
            base: DEVICE + i * (8 * BLOCK),
            ..template.clone()
        })
        .collect();
    Body::TargetMetadata {
        worker_address,
        regions: pools,
        shared_memory,
        doorbell: None,
        device_regions,
    }
}

/// A target whose engine keeps each layer's K and V apart (a 64-layer
/// model: 128 device regions, past the bound on pool regions) gets the
/// one-hop route: every region is opened and the ack offers it. More than
/// a source opens for one target is not a refusal of the route: it is
/// acknowledged, in two hops (counted), so its writes are served.
#[rstest::rstest]
#[case::per_layer_pools(128, true)]
#[case::the_most_opened(MAX_ADVERTISED_DEVICE_REGIONS, true)]
#[case::more_than_opened(MAX_ADVERTISED_DEVICE_REGIONS + 1, false)]
fn many_device_regions_are_opened_or_acked_in_two_hops(
    #[case] regions: usize,
    #[case] one_hop: bool,
) {
    let (sim, _, asked, acks) = routed_source(per_layer_metadata(regions), true);
    let counters = sim.sources[0].core.peer_counters();
    assert_eq!(counters.refused, 0, "the metadata is not refused");
    assert_eq!(asked, if one_hop { regions } else { 0 });
    assert_eq!(counters.one_hop_refused, u64::from(!one_hop));
    assert!(
        matches!(
            acks.as_slice(),
            [Body::TargetMetadataAck { device, .. }] if *device == one_hop
        ),
        "{acks:?}"
    );
}

/// A target with `regions` exported device regions that has just asked
/// the source its deliver names for a route, and the metadata it sent.
fn asking_target(regions: u64) -> (Core, Body) {
    let (mut target, ns) =
        crate::sim::node::new_core_with(0x1000_0000, TARGET_PORT, 0x7, Tiers::DRAM_ONLY, |c| {
            c.shared_memory = Some(SharedMemoryAdvert {
                boot_id: [1; 16],
                pid_namespace: 1,
                pid: 1,
                segments: Vec::new(),
            });
        });
    // Registered in reverse address order: the advert is in id order anyway.
    let ids: Vec<RegionId> = (0..regions)
        .rev()
        .map(|i| {
            let desc = RegionDesc {
                label: format!("kv:gpu{i}"),
                base: DEVICE + i * 8 * BLOCK,
                size: BLOCK,
                stride: 0,
                count: 8,
            };
            let id = target
                .register_region_in(desc, RegionMemory::Device)
                .unwrap();
            target.set_device_export(id, vec![0xe5; 16]).unwrap();
            id
        })
        .collect();
    let request = RequestId("r".into());
    let hint = source_hint(&[1]);
    target.submit_hint(0, request.clone(), &hint);
    let entry = DeliverEntry {
        key: scoped(ns, 1),
        destinations: vec![ElementRef {
            region: ids[0],
            index: 0,
        }],
    };
    target.deliver(0, vec![entry], Some(&request)).unwrap();
    let metadata = sent_metadata(&mut target).expect("the deliver asks the source's route");
    (target, metadata)
}

/// The metadata among what `core` sends now, if any.
fn sent_metadata(core: &mut Core) -> Option<Body> {
    std::iter::from_fn(|| core.poll_action()).find_map(|action| match action {
        Action::Send { message, .. } if matches!(message.body, Body::TargetMetadata { .. }) => {
            Some(message.body)
        }
        _ => None,
    })
}

/// A source that stays silent is asked again every `metadata_retry_ns`,
/// and each time is counted (`metadata_resent`: what shows a route that
/// never forms); once it acknowledges, the asking stops.
#[test]
fn metadata_a_source_leaves_unacknowledged_is_resent_and_counted() {
    let (mut target, _) = asking_target(1);
    // The sim's nodes retry every tenth of an operation timeout.
    let retry = TIMEOUT / 10;
    target.handle_tick(retry / 2);
    assert!(sent_metadata(&mut target).is_none(), "not before the retry");
    for round in 1..=3 {
        target.handle_tick(round * retry);
        assert!(sent_metadata(&mut target).is_some(), "round {round}");
        assert_eq!(target.peer_counters().metadata_resent, round);
    }
    let ack = Body::TargetMetadataAck {
        op_handle: None,
        one_copy: true,
        device: true,
    };
    target.handle_message(3 * retry, from(SOURCE_PORT, 21, ack));
    target.handle_tick(10 * retry);
    assert!(sent_metadata(&mut target).is_none(), "acknowledged");
    assert_eq!(target.peer_counters().metadata_resent, 3);
}

/// Whether the driver must progress UCX for a target's operations follows
/// the source's ack: writes from a source that maps our segments (the
/// one-hop route's, here) need nothing from our worker; a source that does
/// not may be putting into us.
#[rstest::rstest]
#[case::maps_our_segments(true, false)]
#[case::writes_through_ucx(false, true)]
fn an_operation_awaits_ucx_only_from_a_source_that_does_not_map_us(
    #[case] one_copy: bool,
    #[case] awaits: bool,
) {
    let (mut target, _) = asking_target(1);
    let ack = Body::TargetMetadataAck {
        op_handle: None,
        one_copy,
        device: one_copy,
    };
    target.handle_message(1_000, from(SOURCE_PORT, 21, ack));
    while target.poll_action().is_some() {}
    assert_eq!(
        target.peer_busy().0,
        1,
        "the deliver's write is outstanding"
    );
    assert_eq!(target.peer_awaits_transport(), awaits);
    assert_eq!(target.peer_transport_waits(), usize::from(awaits));
}

/// A target advertises each exported device region once, in id order, up
/// to what a source opens for one target; with more it advertises none, so
/// every deliver takes two hops rather than some.
#[rstest::rstest]
#[case::per_layer_pools(128, 128)]
#[case::more_than_opened(MAX_ADVERTISED_DEVICE_REGIONS as u64 + 1, 0)]
fn a_target_advertises_its_device_regions_in_order_or_none(
    #[case] regions: u64,
    #[case] advertised: usize,
) {
    let (_, metadata) = asking_target(regions);
    let Body::TargetMetadata { device_regions, .. } = metadata else {
        unreachable!("found as TargetMetadata")
    };
    assert_eq!(device_regions.len(), advertised);
    assert!(device_regions.windows(2).all(|w| w[0].id < w[1].id));
}

/// Without faults, a device deliver goes in one hop: the source writes the
/// engine's own elements (nothing lands in the target's pool), each page is
/// checked there, and it succeeds.
#[test]
fn a_device_deliver_lands_in_one_hop_without_faults() {
    let mut world = quiet_world();
    world.request(vec![0, 1, 2]);
    for _ in 0..100 {
        world.step().unwrap();
    }
    // The first deliver waits for the route's ack, then goes in one hop
    // like the next ones.
    world.request(vec![3, 4, 5]);
    world.settle().unwrap();
    let counters = world.target.peer_counters();
    assert!(counters.one_hop_pages >= 3, "{counters:?}");
    assert!(world.seen.one_hop_successes >= 3, "{:?}", world.seen);
    assert_eq!(counters.digest_mismatches, 0);
}

/// A one-hop deliver whose source never answers stays pending past its
/// deadline (nothing reported, the elements held), is probed, and ends
/// only on proof: here the source's terminal answer.
#[test]
fn a_one_hop_deliver_past_its_deadline_waits_for_proof() {
    let mut world = quiet_world();
    world.request(vec![7]);
    world.settle().unwrap();
    // The route is up and acked with the one-hop route: deliver by hand.
    let now = world.now;
    let op = deliver_now(&mut world, "held", &[6], 4000);
    let start = sent(&mut world.target);
    let Some(write) = start.iter().find_map(|(_, body)| match body {
        Body::StartWrite {
            op_handle,
            destinations,
            ..
        } if destinations[0].first().unwrap().region == world.device_region => Some(*op_handle),
        _ => None,
    }) else {
        panic!("no one-hop grant: {start:?}")
    };
    // The source never hears of it. Far past the deadline and the
    // abandonment budget: probed, quarantined, nothing reported.
    for at in [now + TIMEOUT, now + 5 * TIMEOUT, now + 50 * TIMEOUT] {
        world.target.handle_timeout(at);
        let probes: Vec<Body> = sent(&mut world.target)
            .into_iter()
            .map(|(_, b)| b)
            .collect();
        assert!(
            probes.iter().all(|b| matches!(b, Body::WriteProbe { .. })),
            "{probes:?}"
        );
        let mut done = Vec::new();
        world.target.drain_completed(&mut done);
        assert!(done.is_empty(), "reported without proof: {done:?}");
    }
    assert_eq!(world.target.peer_counters().quarantined, 1);
    // The source's terminal answer (it never started the write) ends it.
    let source = world.source_incarnation();
    let ack = Body::WriteProbeAck {
        op_handle: write,
        terminal: true,
        dead_incarnation: None,
    };
    world
        .target
        .handle_message(now + 51 * TIMEOUT, from(SOURCE_PORT, source, ack));
    let mut done = Vec::new();
    world.target.drain_completed(&mut done);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].op, op);
    assert_eq!(
        done[0].entries[0].1.status,
        EntryStatus::Failed(FailReason::Timeout)
    );
    let _ = TARGET_PORT;
}

/// A device deliver issued the moment its hint arrives, before the
/// source's route is set up: the target sends the metadata and grants
/// nothing yet; the source's ack decides. With `device` the keys go in one
/// hop (the engine's own elements granted, nothing counted as a fallback);
/// without, through KVCR DRAM (counted). If the deliver's deadline comes
/// first, its keys fail and a later ack grants nothing.
#[rstest::rstest]
#[case::acked_with_one_hop(Some(true))]
#[case::acked_without(Some(false))]
#[case::deadline_first(None)]
fn a_deliver_before_the_routes_ack_waits_for_it(#[case] ack: Option<bool>) {
    let mut world = quiet_world();
    let ns = world.ns;
    let request = RequestId("early".into());
    let hint = source_hint(&[2, 3]);
    let now = world.now;
    world.target.submit_hint(now, request.clone(), &hint);
    let entries = [2, 3]
        .iter()
        .map(|k| DeliverEntry {
            key: scoped(ns, *k),
            destinations: vec![ElementRef {
                region: world.device_region,
                index: 100 + k,
            }],
        })
        .collect();
    let op = world.target.deliver(now, entries, Some(&request)).unwrap();
    let before_ack = sent(&mut world.target);
    assert!(
        before_ack
            .iter()
            .all(|(_, b)| matches!(b, Body::TargetMetadata { .. })),
        "granted before the route's ack: {before_ack:?}"
    );
    assert_eq!(world.target.peer_counters().one_hop_fallbacks, 0);
    let source = world.source_incarnation();
    let at = match ack {
        Some(_) => now + 1,
        None => {
            world.target.handle_timeout(now + TIMEOUT);
            let mut done = Vec::new();
            world.target.drain_completed(&mut done);
            assert_eq!(done.len(), 1, "the deliver ends at its deadline");
            assert_eq!(done[0].op, op);
            assert!(
                done[0]
                    .entries
                    .iter()
                    .all(|(_, e)| e.status == EntryStatus::Failed(FailReason::Timeout))
            );
            now + TIMEOUT + 1
        }
    };
    let body = Body::TargetMetadataAck {
        op_handle: None,
        one_copy: true,
        device: ack.unwrap_or(true),
    };
    world
        .target
        .handle_message(at, from(SOURCE_PORT, source, body));
    let grants: Vec<Vec<kvcr_contracts::protocol::ElementRuns>> = sent(&mut world.target)
        .into_iter()
        .filter_map(|(_, b)| match b {
            Body::StartWrite { destinations, .. } => Some(destinations),
            _ => None,
        })
        .collect();
    let counters = world.target.peer_counters();
    match ack {
        Some(true) => {
            assert_eq!(grants.len(), 1, "{grants:?}");
            let elements: Vec<u64> = grants[0].iter().flatten().map(|e| e.index).collect();
            assert_eq!(elements, vec![102, 103], "the engine's own elements");
            assert!(
                grants[0]
                    .iter()
                    .flatten()
                    .all(|e| e.region == world.device_region)
            );
            assert_eq!(counters.one_hop_writes, 1);
            assert_eq!(counters.one_hop_fallbacks, 0);
        }
        Some(false) => {
            assert!(!grants.is_empty(), "the two-hop path wrote nothing");
            assert!(
                grants
                    .iter()
                    .flatten()
                    .flatten()
                    .all(|e| e.region != world.device_region),
                "{grants:?}"
            );
            assert_eq!(counters.one_hop_writes, 0);
            assert_eq!(counters.one_hop_fallbacks, 2);
        }
        None => assert!(grants.is_empty(), "a failed deliver granted: {grants:?}"),
    }
    world.target.check_invariants().unwrap();
}

/// A world with its faults off.
pub(super) fn quiet_world() -> DeviceWorld {
    let mut world = DeviceWorld::new(7);
    world.quiet();
    world
}

/// Delivers `keys` into the device elements from `first` on, now, under a
/// hint of its own named `request` (a scripted test's deliver, by hand);
/// the deliver's handle. Its `start_write`s wait in the target's actions.
pub(super) fn deliver_now(
    world: &mut DeviceWorld,
    request: &str,
    keys: &[u64],
    first: u64,
) -> OpHandle {
    let request = RequestId(request.into());
    let now = world.now;
    world
        .target
        .submit_hint(now, request.clone(), &source_hint(keys));
    let entries = keys
        .iter()
        .zip(first..)
        .map(|(key, index)| DeliverEntry {
            key: scoped(world.ns, *key),
            destinations: vec![ElementRef {
                region: world.device_region,
                index,
            }],
        })
        .collect();
    world.target.deliver(now, entries, Some(&request)).unwrap()
}

/// Many seeded device runs: every invariant after every step, and each
/// thing the route must survive happened somewhere.
#[test]
fn the_one_hop_route_survives_faults_over_many_seeds() {
    let seeds: u64 = std::env::var("KVCR_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let first: u64 = std::env::var("KVCR_SIM_FIRST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let mut seen = DeviceCoverage::default();
    for seed in first..first + seeds {
        let mut world = DeviceWorld::new(seed);
        let run = (0..300)
            .try_for_each(|_| world.step())
            .and_then(|()| world.settle());
        if let Err(e) = run {
            panic!("device seed {seed}: {e}");
        }
        seen.add(&world.seen);
    }
    eprintln!("sim (one hop): {seen:#?}");
    if seeds >= 100 {
        assert!(seen.one_hop_successes > 0, "{seen:?}");
        assert!(seen.two_hop_successes > 0, "{seen:?}");
        assert!(seen.fallbacks > 0, "{seen:?}");
        assert!(seen.refused_routes > 0, "{seen:?}");
        assert!(seen.caught_corruptions > 0, "{seen:?}");
        assert!(seen.held_past_deadline > 0, "{seen:?}");
        assert!(seen.dead_freed > 0, "{seen:?}");
        assert!(seen.kills_mid_copy > 0, "{seen:?}");
        assert!(seen.leads_reported > 0, "{seen:?}");
        assert!(seen.copy_leads > 0, "{seen:?}");
    }
}
