//! The framing's tests, without a socket: pieces resume where they stopped,
//! and a reader fed a byte stream lands, skips and discards as its lander
//! says.

use super::test_lander::{GrantedAmongOthers, Recorder, frame};
use super::*;

/// What is left of spans at 100 (10 bytes) and 200 (20 bytes), after
/// a prefix of `before` bytes, once `done` bytes moved, at most `max`
/// pieces: a piece started is resumed where it stopped.
#[rstest::rstest]
#[case::nothing_moved(0, 0, 8, vec![(100, 10), (200, 20)])]
#[case::into_the_first(0, 4, 8, vec![(104, 6), (200, 20)])]
#[case::first_whole(0, 10, 8, vec![(200, 20)])]
#[case::into_the_second(0, 15, 8, vec![(205, 15)])]
#[case::all_moved(0, 30, 8, vec![])]
#[case::prefix_not_yet_whole(72, 50, 8, vec![(100, 10), (200, 20)])]
#[case::after_a_prefix(72, 75, 8, vec![(103, 7), (200, 20)])]
#[case::at_most_max(0, 0, 1, vec![(100, 10)])]
fn unsent_pieces_resume_where_they_stopped(
    #[case] before: u64,
    #[case] done: u64,
    #[case] max: usize,
    #[case] left: Vec<(u64, u64)>,
) {
    let spans = [(100, 10), (200, 20)];
    assert_eq!(
        unsent_pieces(&spans, before, done, max).collect::<Vec<_>>(),
        left
    );
}

/// Feeds `wire` to `reader` at most `chunk` bytes a read, landing payload
/// bytes into `memory` (its spans are offsets into it); returns the bytes
/// fed.
fn feed(
    reader: &mut FrameReader<u8>,
    lander: &mut Recorder,
    memory: &mut [u8],
    wire: &[u8],
    chunk: usize,
) -> usize {
    let mut at = 0;
    let mut pieces = Vec::new();
    while at < wire.len() {
        let available = &wire[at..(at + chunk).min(wire.len())];
        let n = match reader.want(lander, &mut pieces, 256) {
            Want::Prefix(into) => {
                let n = into.len().min(available.len());
                into[..n].copy_from_slice(&available[..n]);
                n
            }
            Want::Payload => {
                let mut n = 0;
                for (addr, len) in &pieces {
                    let take = (*len as usize).min(available.len() - n);
                    let at = *addr as usize;
                    memory[at..at + take].copy_from_slice(&available[n..n + take]);
                    n += take;
                    if n == available.len() {
                        break;
                    }
                }
                n
            }
            Want::Discard(most) => most.min(available.len()),
        };
        reader.advance(n, lander);
        at += n;
    }
    at
}

/// A granted frame's payload lands in its spans in order, across their
/// boundary, however the bytes are cut; frames around it that do not open
/// are read past, so the framing holds.
#[rstest::rstest]
fn granted_frames_land_and_others_are_read_past(#[values(1, 7, 100, 1 << 20)] chunk: usize) {
    let mut lander = Recorder::granting(vec![(0, 3000), (5000, 5000)]);
    let GrantedAmongOthers {
        payload,
        wire,
        events,
    } = GrantedAmongOthers::new(7000);
    let mut memory = vec![0u8; 10_000];
    let mut reader = FrameReader::default();
    assert_eq!(
        feed(&mut reader, &mut lander, &mut memory, &wire, chunk),
        wire.len()
    );
    assert_eq!(lander.events, events);
    assert_eq!(memory[..3000], payload[..3000]);
    assert!(memory[3000..5000].iter().all(|b| *b == 0));
    assert_eq!(memory[5000..], payload[3000..]);
}

/// A payload whose operation stops waiting is read past from there: the
/// lander is told once, and nothing more of it lands.
#[test]
fn a_payload_stops_landing_once_its_operation_stops_waiting() {
    let mut lander = Recorder::granting(vec![(0, 4096)]);
    let whole = frame(1, 1, &[0xaa; 4096]);
    let cut = PREFIX_BYTES + 1000;
    let mut memory = vec![0u8; 4096];
    let mut reader = FrameReader::default();
    feed(
        &mut reader,
        &mut lander,
        &mut memory,
        &whole[..cut],
        1 << 20,
    );
    lander.granted = false;
    feed(
        &mut reader,
        &mut lander,
        &mut memory,
        &whole[cut..],
        1 << 20,
    );
    assert_eq!(lander.events, ["open 1 4096", "discarded"]);
    assert!(memory[..1000].iter().all(|b| *b == 0xaa));
    assert!(memory[1000..].iter().all(|b| *b == 0));
}
