//! A source preparing a write from G3 (`SourcePrepare`): a probe meanwhile
//! ends the write, and a preparation past its deadline refuses it.

use super::*;

/// A source with G3 (a pool of 4 slots for 8 keys, spilling ahead or not)
/// that accepted target port 1's `start_write` op 1 for a key only G3
/// holds: the write is being prepared. Returns the source, its
/// incarnation, and the G3 jobs the preparation started (room made by a
/// spill, or the fill).
fn preparing_source(spill_ahead: bool) -> (Sim, Incarnation, Vec<(JobId, usize)>) {
    let mut sim = Sim::new(5);
    let ns = sim.ns;
    let tiers = Tiers::with_g3(4, 8, spill_ahead);
    sim.sources[0] = Source::new(0, 5, 1, 1, 0, ns, tiers, HashMap::new());
    let source = &mut sim.sources[0].core;
    let incarnation = Incarnation::from_raw(source_incarnation(5, 0, 1)).unwrap();
    let g3_only = (0..SOURCE_KEYS)
        .find(|k| {
            let key = scoped(ns, *k);
            source.query(&key) != QueryStatus::Hit && source.g3_ready(&key)
        })
        .expect("a pool of 4 slots leaves some of 8 keys in G3 only");
    source.handle_message(0, from(1, 11, metadata(1)));
    let generation = std::iter::from_fn(|| source.poll_action())
        .find_map(|a| match a {
            Action::Connect { generation, .. } => Some(generation),
            _ => None,
        })
        .unwrap();
    source.handle_connected(&endpoint(1), generation, false);
    sent(source);
    source.handle_message(0, from(1, 11, start_write(1, incarnation, ns, g3_only)));
    let g3: Vec<(JobId, usize)> = std::iter::from_fn(|| source.poll_action())
        .filter_map(|a| match a {
            Action::G3 { job, transfers, .. } => Some((job, transfers.len())),
            _ => None,
        })
        .collect();
    assert!(!g3.is_empty(), "the key is filled from G3 first");
    (sim, incarnation, g3)
}

/// Runs `core`'s G3 jobs (and those they lead to) at `now`, all copied:
/// whether a put was issued, and whether a write ended in a terminal
/// failure.
fn finish_g3_jobs(core: &mut Core, now: u64, mut g3: Vec<(JobId, usize)>) -> (bool, bool) {
    let mut put = false;
    let mut failed = false;
    while let Some((job, n)) = g3.pop() {
        core.handle_copy_done(now, job, &vec![CopyOutcome::Copied; n]);
        while let Some(action) = core.poll_action() {
            match action {
                Action::Put { .. } => put = true,
                Action::G3 { job, transfers, .. } => g3.push((job, transfers.len())),
                Action::Send { message, .. } => {
                    failed |= matches!(
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
    }
    (put, failed)
}

/// A probe for a write whose keys a source is still filling from G3
/// (`SourcePrepare`) ends it: nothing was put yet, so the answer is
/// terminal, and when the fill ends the write is refused, never put into
/// slots the target has freed meanwhile. (The probe's fence alone did not:
/// the write was already past the high-water mark, where fences fold.)
#[test]
fn a_probe_during_a_g3_preparation_ends_the_write() {
    let (mut sim, incarnation, g3) = preparing_source(false);
    let source = &mut sim.sources[0].core;
    // Past its deadline the target probes the op, then frees its grants
    // when the answer is terminal.
    source.handle_message(
        10,
        from(
            1,
            11,
            Body::WriteProbe {
                op_handle: OpHandle(1),
                source_incarnation: Some(incarnation),
            },
        ),
    );
    let terminal = sent(source)
        .iter()
        .any(|(_, body)| matches!(body, Body::WriteProbeAck { terminal: true, .. }));
    let (put, failed) = finish_g3_jobs(source, 20, g3);
    assert!(
        terminal,
        "nothing was put yet: the probe's answer is terminal"
    );
    assert!(!put, "a probed write is never put");
    assert!(failed, "the write ends with a terminal failure");
    source.check_invariants().unwrap();
}

/// A write whose preparation outlives its deadline (its fill reports after
/// it) is refused, not put, when the fill ends: the target gave up at that
/// deadline, and a put then would be born expired.
#[test]
fn a_g3_preparation_past_its_deadline_refuses_the_write() {
    // Spilling ahead, the pool's next victim is in G3 already: dropping it
    // makes room at once, and the fill is the preparation's own job.
    let (mut sim, _, g3) = preparing_source(true);
    let source = &mut sim.sources[0].core;
    assert_eq!(g3.len(), 1, "one job: the fill");
    for now in [TIMEOUT / 2, TIMEOUT] {
        source.handle_tick(now);
        source.handle_timeout(now);
    }
    let (put, failed) = finish_g3_jobs(source, TIMEOUT + 10, g3);
    assert!(!put, "an expired write is never put");
    assert!(failed, "the write ends with a terminal failure");
    source.check_invariants().unwrap();
}
