//! What a member's advert may make an honest source write, between real
//! runners: a worker address replayed from another process with bases of
//! the member's choosing, and route churn until the source is short of
//! mappings (then the member leaves). See `docs/trust.md`, "What a peer's
//! bytes may reach" and "Route churn".

use std::net::TcpListener;
use std::time::Duration;

use kvcr_contracts::protocol::{
    Body, ElementRef, Header, Message, OpHandle, RegionAdvert, RegionId, RouteGeneration,
    WriteOutcome,
};
use kvcr_contracts::{BlockKey, ControlEndpoint, Incarnation, RequestId};
use kvcr_runner::StaticKey;
use kvcr_runner::client::{ControlClient, Dialed};
use rstest::rstest;

use crate::nodes::{
    BLOCK, Node, assert_restored, fetch_hinted, fetch_on_hint, hint, hint_to, node_with, stock,
};
use crate::peer_trust::{
    SECRET, a_member_restores_from, churn_routes, member, metadata_from, options, through_tcp,
};

/// The metadata `destination` sends a source (as a member learns it by
/// being hinted as one): its worker address, regions, segments, doorbell.
fn advert_of(destination: &Node) -> Body {
    let key = StaticKey::generate().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let member = ControlEndpoint::parse(&format!("tcp://{}", listener.local_addr().unwrap()))
        .unwrap()
        .with_key(Some(key.public()));
    let request = RequestId("learn-advert".into());
    destination
        .runner
        .hints()
        .submit(request.clone(), &hint_to(&member, &[9]));
    let _op = fetch_hinted(&destination.runner, destination.ns, &request, &[9]);
    loop {
        let Dialed::Session(mut session) = ControlClient::accept(
            &listener,
            Some(SECRET),
            (member.clone(), Incarnation::generate()),
            &key,
            Duration::from_secs(10),
        )
        .unwrap() else {
            continue;
        };
        let advert = await_reply(&mut session, |b| matches!(b, Body::TargetMetadata { .. }));
        return advert.expect("the destination advertises itself");
    }
}

/// `rkey` (a travelling one) re-sealed to name `len` bytes at `base`: the
/// envelope's extent is the sender's word, like the advert's base.
fn rkey_at(rkey: &[u8], base: u64, len: u64) -> Vec<u8> {
    let real = kvcr_ucx::RkeyBuffer::from_bytes(rkey).unwrap();
    kvcr_ucx::RkeyBuffer::from_packed(real.context_id(), base, len, real.packed())
        .unwrap()
        .as_bytes()
        .to_vec()
}

/// A member's session to `source`, claiming `name`.
fn member_session(source: &Node, name: &str) -> ControlClient {
    ControlClient::connect(
        source.runner.peers().endpoint().unwrap(),
        Some(SECRET),
        ControlEndpoint::parse(name).unwrap(),
        Incarnation::generate(),
    )
    .unwrap()
}

/// Reads `session` until a message `wanted` picks, for at most 20 s.
fn await_reply(session: &mut ControlClient, wanted: impl Fn(&Body) -> bool) -> Option<Body> {
    for _ in 0..200 {
        if let Some(message) = session.recv(Duration::from_millis(100)).unwrap()
            && wanted(&message.body)
        {
            return Some(message.body);
        }
    }
    None
}

/// Asks `source`, on `session`, to write its `keys` into elements
/// `first..` of region `region` (one element per key); the write's reply.
fn ask_write(
    session: &mut ControlClient,
    source: &Node,
    op: u64,
    region: RegionId,
    keys: &[u64],
    first: u64,
) -> Option<Body> {
    let start = Message {
        header: Header {
            sender: Incarnation::generate(),
            route_generation: RouteGeneration(0),
            sender_endpoint: source.runner.peers().endpoint().unwrap().clone(),
        },
        body: Body::StartWrite {
            lead_elements: 0,
            op_handle: OpHandle(op),
            remaining_timeout_ms: 10_000,
            source_incarnation: Some(source.runner.incarnation()),
            namespace: source.ns,
            keys: keys.iter().map(|k| BlockKey::from_u64(*k)).collect(),
            destinations: (first..)
                .take(keys.len())
                .map(|index| vec![ElementRef { region, index }].into())
                .collect(),
        },
    };
    session.send(&start).unwrap();
    await_reply(session, |body| {
        matches!(body, Body::WriteDone { .. } | Body::WriteRefused { .. })
    })
}

/// A member advertises, as its own, the worker address of another runner
/// (the destination, which lives in this very process) with a region
/// (and an rkey envelope) whose base it chose: a canary buffer of this process, registered
/// nowhere. The honest source must write nothing there: the nonce it sends
/// that worker never comes back on the member's session (the destination,
/// which restored from the source before and so has a session to it,
/// answers on its own session, which proves nothing for the member's
/// route). The route fails unproven, the member's write is refused, the
/// canary keeps every byte, and the destination restores byte-exact. The
/// old source acknowledged the advert at once and put a KV page into the
/// canary.
#[rstest]
#[case::tcp("tcp,self")]
#[case::shm("posix,cma,self")]
fn a_replayed_worker_address_with_a_chosen_base_writes_nothing(#[case] tls: &str) {
    let _serial = crate::serial();
    let mut source = member(tls, 8);
    stock(&mut source, &[0, 1, 2, 3]);
    let mut destination = member(tls, 8);
    let result = fetch_on_hint(&mut destination, "before", &hint(&source, &[0, 1]), &[0, 1]);
    assert_restored(&destination, &source, &result, &[0, 1]);

    let canary: Vec<u8> = (0..4 * BLOCK).map(|i| (i % 239) as u8).collect();
    let pristine = canary.clone();
    let Body::TargetMetadata {
        worker_address: replayed,
        regions,
        ..
    } = advert_of(&destination)
    else {
        unreachable!()
    };
    let region = RegionAdvert {
        id: RegionId(0),
        label: "canary".into(),
        base: canary.as_ptr() as u64,
        element_size: BLOCK as u64,
        stride: BLOCK as u64,
        count: 4,
        rkey: rkey_at(
            &regions[0].rkey,
            canary.as_ptr() as u64,
            canary.len() as u64,
        ),
    };
    let mut session = member_session(&source, "tcp://127.0.0.9:1");
    session
        .send(&metadata_from(&source, replayed, region))
        .unwrap();
    let ack = await_reply(&mut session, |b| {
        matches!(b, Body::TargetMetadataAck { .. })
    });
    assert!(ack.is_some(), "the advert is answered (as no route)");
    let reply = ask_write(&mut session, &source, 1, RegionId(0), &[0, 1, 2, 3], 0);
    // Whatever the source might still have had in flight has landed by
    // the time it answered; the canary is this process's own memory.
    assert!(
        canary == pristine,
        "the source wrote into memory nobody registered"
    );
    assert!(
        !matches!(
            reply,
            Some(Body::WriteDone {
                outcome: WriteOutcome::Completed(_),
                ..
            })
        ),
        "{reply:?}"
    );
    let counters = source.runner.peers().stats().counters;
    assert!(counters.routes_unproven >= 1, "{counters:?}");
    assert_eq!(
        counters.ucx_routes + counters.one_copy_routes,
        1,
        "{counters:?}"
    );
    let result = fetch_on_hint(&mut destination, "after", &hint(&source, &[2, 3]), &[2, 3]);
    assert_restored(&destination, &source, &result, &[2, 3]);
    source.runner.check_invariants().unwrap();
    destination.runner.check_invariants().unwrap();
}

/// A source whose UCX has attached as much shared memory as it may (here
/// at once: its mapping limit is 1; the probe took 275 s of forged posix
/// fifo ids to get there) refuses every route that would attach more: a
/// member's adverts of a worker on this host's shared memory, under
/// several names, are refused and counted. The member leaves; an honest
/// destination whose worker is on tcp alone (as one on another host is)
/// attaches nothing and restores all 16 keys byte-exact. The old source
/// refused every UCX route while short of mappings, so honest cross-host
/// restores stayed at 0/16 after the attacker left.
#[test]
fn routes_that_attach_nothing_survive_exhausted_mappings() {
    let _serial = crate::serial();
    let tls = "posix,tcp,self";
    let mut starved = options(tls, Some(SECRET));
    starved.ucx_route_mapping_limit = 1;
    let mut source = node_with(&starved, 16, Duration::from_secs(10));
    let keys: Vec<u64> = (0..16).collect();
    stock(&mut source, &keys);
    {
        let names: Vec<String> = (1..=4).map(|i| format!("tcp://127.0.0.11:{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        churn_routes(&source, tls, &names, 2);
        // The member leaves with its sessions.
    }
    crate::wait_until(
        "the attaching routes to be refused",
        Duration::from_secs(10),
        || source.runner.peers().stats().counters.routes_refused >= 4,
    );
    let mut destination = node_with(&through_tcp(), 16, Duration::from_secs(10));
    let result = fetch_on_hint(
        &mut destination,
        "after-churn",
        &hint(&source, &keys),
        &keys,
    );
    assert_restored(&destination, &source, &result, &keys);
    let counters = source.runner.peers().stats().counters;
    assert_eq!(counters.ucx_routes, 1, "{counters:?}");
    source.runner.check_invariants().unwrap();
    destination.runner.check_invariants().unwrap();
}

/// Members rotating names, each name within its own budget, meet the
/// budget of all names together: at most its burst and one per refill
/// are built, the rest refused and counted (the old source built every
/// name's burst: 40 routes here). An honest member is then served once the
/// total budget allows.
#[test]
fn rotating_names_meet_the_total_route_budget() {
    let _serial = crate::serial();
    let tls = "tcp,self";
    let mut capped = options(tls, Some(SECRET));
    capped.route_budget_total = kvcr_runner_core::RouteBudget {
        burst: 8,
        refill_ns: 1_000_000_000,
    };
    let mut source = node_with(&capped, 8, Duration::from_secs(10));
    stock(&mut source, &[0, 1, 2, 3]);
    let per_name = capped.route_budget.burst as usize;
    let names: Vec<String> = (1..=10).map(|i| format!("tcp://127.0.0.12:{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let adverts = (names.len() * per_name) as u64;
    // Not a threshold: the budget's bound grows with the time it had.
    #[allow(clippy::disallowed_methods)]
    let started = std::time::Instant::now();
    churn_routes(&source, tls, &names, per_name);
    let refused_enough = || {
        let elapsed_ns = u64::try_from(started.elapsed().as_nanos()).unwrap();
        let admitted_at_most = 8 + elapsed_ns / 1_000_000_000 + 1;
        source.runner.peers().stats().counters.routes_refused + admitted_at_most >= adverts
    };
    crate::wait_until(
        "the route changes past the total budget to be refused",
        Duration::from_secs(30),
        refused_enough,
    );
    a_member_restores_from(&source, tls, "after-rotation");
    source.runner.check_invariants().unwrap();
}

/// The pages `node` holds for `keys`, read back through a local fetch.
fn resident_pages(node: &mut Node, keys: &[u64]) -> Vec<Vec<u8>> {
    let scoped: Vec<_> = keys
        .iter()
        .map(|k| crate::nodes::key(node.ns, *k))
        .collect();
    let pool = node.runner.pool("kv").unwrap();
    let op = node.runner.fetch(&scoped, &[pool]).unwrap();
    let result = crate::nodes::wait(&mut node.runner, op);
    let pages = result
        .entries
        .iter()
        .map(|(_, entry)| {
            assert!(entry.is_success(), "{entry:?}");
            node.runner.read_claimed(entry.release.unwrap(), 0).unwrap()
        })
        .collect();
    let handles: Vec<_> = result
        .entries
        .iter()
        .filter_map(|(_, e)| e.release)
        .collect();
    node.runner.release(&handles);
    pages
}

/// A member replays, to an honest source on the same host, the whole
/// advert the destination sent it as its source (worker address, pools,
/// their memfds, doorbell and key), then asks the source to write into
/// every element of the destination's pool. The source maps the pools, but
/// the destination's doorbell file holds the owner tag for that key naming
/// the member, not the source: no one-copy route; through UCX the nonce
/// never comes back on the member's session. Nothing is written: the
/// destination's resident pages keep their bytes. The old source mapped the
/// pools and overwrote them (the write came back Success).
#[rstest]
#[case::shm("posix,cma,self")]
#[case::tcp("tcp,self")]
fn a_replayed_advert_writes_nothing_into_its_owner(#[case] tls: &str) {
    let _serial = crate::serial();
    let mut source = member(tls, 8);
    stock(&mut source, &[0, 1, 2, 3]);
    let mut destination = member(tls, 8);
    // The destination's own pages (the nodes' host pages differ by index).
    stock(&mut destination, &[4, 5, 6, 7]);
    let before = resident_pages(&mut destination, &[4, 5, 6, 7]);
    let Body::TargetMetadata {
        worker_address,
        regions,
        shared_memory,
        doorbell,
        ..
    } = advert_of(&destination)
    else {
        unreachable!()
    };
    assert!(
        shared_memory.is_some() && doorbell.is_some(),
        "the destination offers its pools"
    );
    let pool = regions.iter().find(|r| r.count == 8).unwrap().id;
    let mut session = member_session(&source, "tcp://127.0.0.13:1");
    let mut replayed = metadata_from(&source, worker_address, regions[0].clone());
    replayed.body = Body::TargetMetadata {
        worker_address: match &replayed.body {
            Body::TargetMetadata { worker_address, .. } => worker_address.clone(),
            _ => unreachable!(),
        },
        regions,
        shared_memory,
        doorbell,
        device_regions: Vec::new(),
    };
    session.send(&replayed).unwrap();
    let ack = await_reply(&mut session, |b| {
        matches!(b, Body::TargetMetadataAck { .. })
    });
    assert!(ack.is_some(), "the advert is answered (as no route)");
    let first = ask_write(&mut session, &source, 1, pool, &[0, 1, 2, 3], 0);
    let second = ask_write(&mut session, &source, 2, pool, &[0, 1, 2, 3], 4);
    let after = resident_pages(&mut destination, &[4, 5, 6, 7]);
    assert!(after == before, "the destination's resident pages changed");
    for reply in [first, second] {
        assert!(
            !matches!(
                reply,
                Some(Body::WriteDone {
                    outcome: WriteOutcome::Completed(_),
                    ..
                })
            ),
            "{reply:?}"
        );
    }
    let counters = source.runner.peers().stats().counters;
    assert_eq!(counters.one_copy_routes, 0, "{counters:?}");
    source.runner.check_invariants().unwrap();
    destination.runner.check_invariants().unwrap();
}

/// Unconfigured transports (UCX's choice, less cma, knem and xpmem) still
/// restore byte-exact through UCX between two runners on one host that do
/// not map each other's pools.
#[test]
fn unconfigured_transports_restore_through_ucx() {
    let _serial = crate::serial();
    let mut unconfigured = kvcr_runner::PeerOptions::loopback();
    unconfigured.secret = Some(SECRET.to_vec());
    unconfigured.same_host_mapping = false;
    let mut source = node_with(&unconfigured, 8, Duration::from_secs(10));
    stock(&mut source, &[0, 1, 2, 3]);
    let mut target = node_with(&unconfigured, 8, Duration::from_secs(10));
    let keys = [0, 1, 2, 3];
    let result = fetch_on_hint(&mut target, "unconfigured", &hint(&source, &keys), &keys);
    assert_restored(&target, &source, &result, &keys);
    let counters = source.runner.peers().stats().counters;
    assert_eq!(
        (counters.ucx_routes, counters.routes_unproven),
        (1, 0),
        "{counters:?}"
    );
}

/// A member's advert naming device regions (the one-hop route) but no
/// shared memory, so no same-host route: the source never opens them (its
/// copier is not even asked) and acknowledges without the one-hop route,
/// whatever the export names (here a real one, of this process's memory).
#[test]
fn a_device_advert_without_a_same_host_route_is_never_opened() {
    let _serial = crate::serial();
    let tls = "posix,cma,self";
    let source = member(tls, 8);
    let copier = std::sync::Arc::new(crate::device::memfd::MemfdCopier::default());
    source
        .runner
        .pools()
        .set_device_copier(copier.clone() as std::sync::Arc<dyn kvcr_runner::DeviceCopier>)
        .unwrap();
    let victim = crate::device::memfd::MemfdCopier::default();
    let base = victim.alloc(4 * BLOCK);
    let export = kvcr_runner::DeviceCopier::export_device(&victim, base, 4 * BLOCK as u64)
        .unwrap()
        .unwrap();
    let destination = member(tls, 8);
    let Body::TargetMetadata {
        worker_address,
        regions,
        doorbell,
        ..
    } = advert_of(&destination)
    else {
        unreachable!()
    };
    let mut session = member_session(&source, "tcp://127.0.0.14:1");
    let mut forged = metadata_from(&source, worker_address, regions[0].clone());
    forged.body = Body::TargetMetadata {
        worker_address: match &forged.body {
            Body::TargetMetadata { worker_address, .. } => worker_address.clone(),
            _ => unreachable!(),
        },
        regions,
        shared_memory: None,
        doorbell,
        device_regions: vec![kvcr_contracts::protocol::DeviceRegionAdvert {
            id: RegionId(40),
            base,
            element_size: BLOCK as u64,
            stride: BLOCK as u64,
            count: 4,
            export,
        }],
    };
    session.send(&forged).unwrap();
    let ack = await_reply(&mut session, |b| {
        matches!(b, Body::TargetMetadataAck { .. })
    });
    assert!(
        matches!(ack, Some(Body::TargetMetadataAck { device: false, .. })),
        "{ack:?}"
    );
    assert_eq!(
        copier.imports.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the copier was never asked to open it"
    );
    source.runner.check_invariants().unwrap();
}
