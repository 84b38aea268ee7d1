//! A completion whose pages the source checked in its copy: a doorbell
//! record completes the operation with only the write's digest, and the
//! pages take their own digests from the `write_done` behind it, only when
//! it comes from the operation's source, names exactly the keys that
//! landed, and its digests combine to the record's (the driver combines
//! them; here the combination is given).

use super::*;

/// Runs the network until target 0 receives a `write_done` (taken off the
/// network, not handled; the other messages due with it are handled) and
/// returns it.
fn next_write_done(sim: &mut Sim) -> Message {
    for _ in 0..1_000 {
        sim.now += TIMEOUT / 100;
        let now = sim.now;
        let mut found = None;
        for (to, message) in sim.take_due() {
            let ours =
                to == sim.targets[0].endpoint && matches!(message.body, Body::WriteDone { .. });
            if ours && found.is_none() {
                found = Some(message);
            } else {
                sim.handle(&to, now, message);
            }
        }
        if let Some(message) = found {
            return message;
        }
        sim.complete_due_puts();
        sim.flush();
    }
    panic!("no write_done reached target 0");
}

/// `message` (a completed `write_done`) with `digests`, one per index, or
/// none.
fn with_digests(message: &Message, digests: Option<&[u64]>) -> Message {
    let Body::WriteDone {
        op_handle,
        outcome: WriteOutcome::Completed(completed),
    } = &message.body
    else {
        panic!("not a completed write_done: {message:?}");
    };
    let indices = completed.as_slice().to_vec();
    let completed = match digests {
        Some(digests) => CompletedIndices::with_digests(
            indices
                .iter()
                .copied()
                .zip(digests.iter().copied())
                .collect(),
        ),
        None => CompletedIndices::new(indices),
    };
    Message {
        header: message.header.clone(),
        body: Body::WriteDone {
            op_handle: *op_handle,
            outcome: WriteOutcome::Completed(completed),
        },
    }
}

/// Restores `keys` on target 0 from source 0, completing the operation by
/// a record whose write digest is `combined`; returns the `write_done`
/// behind it (with the pages' digests `digests`).
fn restore_by_record(sim: &mut Sim, keys: std::ops::Range<u64>, digests: &[u64]) -> Message {
    hinted_request(sim, 0, 0, keys.clone(), false);
    sim.flush();
    let done = next_write_done(sim);
    let now = sim.now;
    let record = with_digests(&done, None);
    sim.targets[0]
        .core
        .handle_write_done_checked_in_copy(now, record, COMBINED);
    for k in keys {
        let key = sim.key(k);
        assert_eq!(sim.targets[0].core.query(&key), QueryStatus::Hit, "{k}");
        assert_eq!(sim.targets[0].core.page_digest(&key), None, "{k}");
    }
    with_digests(&done, Some(digests))
}

const COMBINED: u64 = 0x5eed;

#[test]
fn pages_completed_by_a_record_take_their_digests_from_the_write_done() {
    let mut sim = Sim::new(3);
    sim.quiet();
    let done = restore_by_record(&mut sim, 0..3, &[10, 11, 12]);
    let refused = sim.targets[0].core.peer_counters().refused;
    let now = sim.now;
    sim.targets[0].core.handle_late_digests(now, done, COMBINED);
    for k in 0..3 {
        let key = sim.key(k);
        assert_eq!(sim.targets[0].core.page_digest(&key), Some(10 + k));
    }
    assert_eq!(sim.targets[0].core.peer_counters().refused, refused);
    sim.check().unwrap();
}

/// Digests that do not combine to the record's, from another incarnation
/// than the operation's source, or for other keys than landed: refused, and
/// the pages keep no digest (they are served on without one, never with a
/// wrong one).
#[rstest::rstest]
#[case::other_combination(|m: Message| (m, COMBINED + 1))]
#[case::other_sender(|mut m: Message| {
    m.header.sender = Incarnation::from_raw(0xdead).unwrap();
    (m, COMBINED)
})]
#[case::other_keys(|m: Message| {
    let Body::WriteDone { op_handle, .. } = m.body else { unreachable!() };
    let completed = CompletedIndices::with_digests(vec![(0, 10), (1, 11)]);
    let body = Body::WriteDone { op_handle, outcome: WriteOutcome::Completed(completed) };
    (Message { header: m.header, body }, COMBINED)
})]
fn late_digests_that_do_not_match_the_record_are_refused(
    #[case] alter: fn(Message) -> (Message, u64),
) {
    let mut sim = Sim::new(4);
    sim.quiet();
    let done = restore_by_record(&mut sim, 0..3, &[10, 11, 12]);
    let refused = sim.targets[0].core.peer_counters().refused;
    let (done, combined) = alter(done);
    let now = sim.now;
    sim.targets[0]
        .core
        .handle_late_digests(now, done.clone(), combined);
    for k in 0..3 {
        let key = sim.key(k);
        assert_eq!(sim.targets[0].core.page_digest(&key), None, "{k}");
    }
    assert_eq!(sim.targets[0].core.peer_counters().refused, refused + 1);
    // Asked once: the same digests again find nothing waiting.
    sim.targets[0].core.handle_late_digests(now, done, combined);
    assert_eq!(sim.targets[0].core.peer_counters().refused, refused + 2);
    sim.check().unwrap();
}
