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
use kvcr_runner::client::{ControlClient, Dialed};
use rstest::rstest;

use crate::nodes::{
    BLOCK, Node, assert_restored, fetch_hinted, fetch_on_hint, hint, hint_to, stock,
};
use crate::peer_trust::{SECRET, member, metadata_from};

/// The metadata `destination` sends a source (as a member learns it by
/// being hinted as one): its worker address, regions, segments, doorbell.
fn advert_of(destination: &Node) -> Body {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let member =
        ControlEndpoint::parse(&format!("tcp://{}", listener.local_addr().unwrap())).unwrap();
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
            member.clone(),
            Incarnation::generate(),
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
            op_handle: OpHandle(op),
            remaining_timeout_ms: 10_000,
            source_incarnation: Some(source.runner.incarnation()),
            namespace: source.ns,
            keys: keys.iter().map(|k| BlockKey::from_u64(*k)).collect(),
            destinations: (first..)
                .take(keys.len())
                .map(|index| vec![ElementRef { region, index }])
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
