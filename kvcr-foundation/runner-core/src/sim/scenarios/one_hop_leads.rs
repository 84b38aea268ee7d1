//! The one-hop route's lead reports: a write's source says its pages'
//! first layer landed, and the target reports a deliver ready to start on
//! it. Only the write's own source may say so, once; a deliver is reported
//! once, when the last of its writes' leads lands.

use super::one_hop::{deliver_now, quiet_world};
use super::*;
use crate::sim::device::{DeviceWorld, SOURCE_PORT};

/// A one-hop write's lead report moves its deliver only when it is the
/// write's own: from its source's endpoint and incarnation, for the count
/// the target asked (here 1: a page of one element, the configured 2
/// clamped to it), once, while the write is awaited. Forged, foreign,
/// miscounted, repeated or unknown reports are refused and counted, and
/// report nothing.
#[test]
fn only_the_writes_own_source_reports_its_lead() {
    let mut world = quiet_world();
    world.request(vec![7]);
    world.settle().unwrap();
    let _ = world.target.drain_leads_landed();
    let now = world.now;
    let op = deliver_now(&mut world, "led", &[5], 4001);
    let start = sent(&mut world.target);
    let Some((write, lead)) = start.iter().find_map(|(_, body)| match body {
        Body::StartWrite {
            op_handle,
            lead_elements,
            ..
        } => Some((*op_handle, *lead_elements)),
        _ => None,
    }) else {
        panic!("no one-hop grant: {start:?}")
    };
    assert_eq!(lead, 1, "asked for the page's one element");
    let source = world.source_incarnation();
    let report = |op_handle, elements| Body::WriteLeadLanded {
        op_handle,
        elements,
    };
    let forged = [
        (
            "another member",
            from(SOURCE_PORT + 50, source, report(write, 1)),
        ),
        (
            "another incarnation",
            from(SOURCE_PORT, source + 1, report(write, 1)),
        ),
        (
            "the wrong count",
            from(SOURCE_PORT, source, report(write, 2)),
        ),
        (
            "an unknown write",
            from(SOURCE_PORT, source, report(OpHandle(9999), 1)),
        ),
    ];
    for (what, message) in forged {
        let refused = world.target.peer_counters().refused;
        world.target.handle_message(now, message);
        assert_eq!(world.target.peer_counters().refused, refused + 1, "{what}");
        assert!(world.target.drain_leads_landed().is_empty(), "{what}");
    }
    world
        .target
        .handle_message(now, from(SOURCE_PORT, source, report(write, 1)));
    assert_eq!(world.target.drain_leads_landed(), [(op, 1)]);
    let refused = world.target.peer_counters().refused;
    world
        .target
        .handle_message(now, from(SOURCE_PORT, source, report(write, 1)));
    assert_eq!(
        world.target.peer_counters().refused,
        refused + 1,
        "repeated"
    );
    assert!(world.target.drain_leads_landed().is_empty());
    let mut done = Vec::new();
    world.target.drain_completed(&mut done);
    assert!(done.is_empty(), "a lead report ends nothing: {done:?}");
}

/// A deliver over three one-key writes is reported ready on its first
/// layer once, when the last of its writes' leads lands, in whatever order
/// they land (each report re-reads only the entries not yet found in
/// place), and a report ends nothing.
#[rstest::rstest]
#[case::in_order([0, 1, 2])]
#[case::last_first([2, 1, 0])]
#[case::first_last([1, 2, 0])]
fn a_delivers_first_layer_is_reported_once_its_last_lead_lands(#[case] order: [usize; 3]) {
    let mut world = DeviceWorld::new_with(7, |c| c.write_batch_bytes = BLOCK);
    world.quiet();
    world.request(vec![7]);
    world.settle().unwrap();
    let _ = world.target.drain_leads_landed();
    let now = world.now;
    let op = deliver_now(&mut world, "three", &[4, 5, 6], 4001);
    // The writes in key order: one key each.
    let writes: Vec<OpHandle> = sent(&mut world.target)
        .into_iter()
        .filter_map(|(_, body)| match body {
            Body::StartWrite {
                op_handle,
                keys: written,
                lead_elements: 1,
                ..
            } if written.len() == 1 => Some(op_handle),
            _ => None,
        })
        .collect();
    assert_eq!(writes.len(), 3, "one write per key");
    let source = world.source_incarnation();
    for (n, at) in order.into_iter().enumerate() {
        let report = Body::WriteLeadLanded {
            op_handle: writes[at],
            elements: 1,
        };
        world
            .target
            .handle_message(now, from(SOURCE_PORT, source, report));
        let reported = world.target.drain_leads_landed();
        if n < 2 {
            assert!(reported.is_empty(), "after {} of 3: {reported:?}", n + 1);
        } else {
            assert_eq!(reported, [(op, 3)], "all three pages, once");
        }
    }
    let mut done = Vec::new();
    world.target.drain_completed(&mut done);
    assert!(done.is_empty(), "a lead report ends nothing: {done:?}");
}
