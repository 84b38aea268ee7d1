//! The framing's tests, without a socket: pieces resume where they stopped,
//! records are cut to fit the spans, and a reader fed a byte stream lands,
//! skips and discards as its lander says, plain or sealed; a sealed record
//! that was altered, replayed, moved or cut short ends the stream.

use super::test_lander::{BufferSlots, GrantedAmongOthers, Recorder, frame, frame_in, header};
use super::*;
use crate::wire::sealing::tests::pair;
use rstest::rstest;

/// What is left of spans at 100 (10 bytes) and 200 (20 bytes), after
/// a prefix of `before` bytes, once `done` bytes moved, at most `max`
/// pieces: a piece started is resumed where it stopped.
#[rstest]
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

/// A source cuts records that no element boundary runs through where it
/// can: the largest size dividing every span's length, within bounds.
#[rstest]
#[case::one_large_page(vec![16 << 20], MAX_RECORD)]
#[case::pages_of_a_record(vec![256 << 10; 4], MAX_RECORD)]
#[case::pages_of_96_kib(vec![96 << 10; 3], 96 << 10)]
#[case::pages_of_384_kib(vec![384 << 10, 384 << 10], 192 << 10)]
#[case::mixed_pages(vec![64 << 10, 16 << 20], 64 << 10)]
#[case::small_elements(vec![4096; 64], MAX_RECORD)]
#[case::a_prime_length(vec![1_000_003], MAX_RECORD)]
#[case::nothing(vec![], MAX_RECORD)]
fn records_are_cut_to_fit_the_spans(#[case] lens: Vec<u64>, #[case] record: u64) {
    assert_eq!(u64::from(fitted_record(lens)), record);
}

/// A prefix reads back as written; reserved bytes that are not zero, or a
/// sealed stream's record size out of bounds, are refused.
#[rstest]
#[case::as_written(None, 4096, true, true)]
#[case::reserved_bytes(Some(13), 4096, true, false)]
#[case::no_record_size(None, 0, true, false)]
#[case::records_too_large(None, MAX_RECORD as u32 + 1, true, false)]
#[case::plain_ignores_record_size(None, 0, false, true)]
fn prefixes_read_back_or_are_refused(
    #[case] set: Option<usize>,
    #[case] record: u32,
    #[case] sealed: bool,
    #[case] read: bool,
) {
    let mut prefix = frame_prefix(70_000, record, &header(1, 2));
    if let Some(at) = set {
        prefix[at] = 1;
    }
    let parsed = parse_prefix(&prefix, sealed);
    assert_eq!(parsed.is_some(), read, "{parsed:?}");
    if let Some(parsed) = parsed {
        assert_eq!((parsed.len, parsed.header), (70_000, header(1, 2)));
    }
}

/// Feeds `wire` to `reader` at most `chunk` bytes a read, landing payload
/// bytes into `memory` (its spans are offsets into it); returns the bytes
/// fed (fewer when a record did not open).
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
            Want::Bytes(into) => {
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
            Want::Nothing => return at,
        };
        let read = reader.advance(n, lander, &mut BufferSlots(memory));
        at += n;
        if read == reader::Read::Torn {
            return at;
        }
    }
    at
}

/// A reader of a plain stream, or of one sealed by [`pair`]'s key.
fn reader_for(sealed: bool) -> FrameReader<u8> {
    FrameReader::new(sealed.then(|| pair(1).1))
}

/// A granted frame's payload lands in its spans in order, across their
/// boundary, however the bytes are cut and whatever the record size
/// (records inside one span open in place, one across two in a bounce
/// buffer); frames around it that do not open are read past, so the
/// framing (and the records' numbering) holds.
#[rstest]
fn granted_frames_land_and_others_are_read_past(
    #[values(1, 7, 100, 1 << 20)] chunk: usize,
    #[values(None, Some(1000), Some(2500), Some(MAX_RECORD as u32))] sealed: Option<u32>,
) {
    let mut lander = Recorder::granting(vec![(0, 3000), (5000, 5000)]);
    let mut sealer = sealed.map(|_| pair(1).0);
    let record = sealed.unwrap_or(MAX_RECORD as u32);
    let GrantedAmongOthers {
        payload,
        wire,
        events,
    } = GrantedAmongOthers::new(7000, sealer.as_mut(), record);
    let mut memory = vec![0u8; 10_000];
    let mut reader = reader_for(sealed.is_some());
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
/// lander is told once, nothing more of it lands, and the next frame does.
#[rstest]
fn a_payload_stops_landing_once_its_operation_stops_waiting(#[values(false, true)] sealed: bool) {
    let mut lander = Recorder::granting(vec![(0, 4096)]);
    let mut sealer = sealed.then(|| pair(1).0);
    let whole = frame_in(sealer.as_mut(), 1, 1, &[0xaa; 4096], 1024);
    let next = frame(sealer.as_mut(), 1, 2, &[0xbb; 4096]);
    let cut = PREFIX_BYTES + 1500;
    let mut memory = vec![0u8; 4096];
    let mut reader = reader_for(sealed);
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
    let landed = if sealed { 1024 } else { 1500 };
    assert!(memory[..landed].iter().all(|b| *b == 0xaa));
    assert!(memory[1500..].iter().all(|b| *b == 0));
    lander.granted = true;
    feed(&mut reader, &mut lander, &mut memory, &next, 1 << 20);
    assert_eq!(lander.events[2..], ["open 1 4096", "landed 2"]);
    assert!(memory.iter().all(|b| *b == 0xbb));
}

/// Two sealed frames of 3 records each (tags 1 and 2, 3000 bytes in
/// records of 1000), as the wire carries them, and where each record
/// starts: prefix, payload, payload, payload, prefix, ...
fn two_sealed_frames() -> (Vec<u8>, Vec<usize>) {
    let mut sealer = pair(1).0;
    let mut wire = Vec::new();
    let mut starts = Vec::new();
    for tag in [1, 2] {
        let frame = frame_in(Some(&mut sealer), 1, tag, &[tag; 3000], 1000);
        let at = wire.len();
        starts.push(at);
        for record in 0..3 {
            starts.push(at + PREFIX_BYTES + TAG_BYTES + record * (1000 + TAG_BYTES));
        }
        wire.extend(frame);
    }
    (wire, starts)
}

/// On a sealed stream, bytes that are not the source's records in the
/// source's order never land as a frame: a flipped bit anywhere (prefix,
/// payload, tag), a frame replayed, two records swapped, a record dropped,
/// a frame cut short with the next one after it. The record that does not
/// open tears the stream (the lander is told, with the frame it was
/// landing) and nothing after it is read.
#[rstest]
#[case::a_flipped_prefix_bit(Tamper::Flip(30), &["torn"])]
#[case::a_flipped_payload_bit(Tamper::Flip(PREFIX_BYTES + TAG_BYTES + 1500), &["open 1 3000", "torn 1"])]
#[case::a_flipped_tag_bit(Tamper::Flip(PREFIX_BYTES + TAG_BYTES + 1005), &["open 1 3000", "torn 1"])]
#[case::the_first_frame_replayed(Tamper::Replay, &["open 1 3000", "landed 1", "torn"])]
#[case::two_records_swapped(Tamper::Swap(1, 2), &["open 1 3000", "torn 1"])]
#[case::a_record_dropped(Tamper::Drop(2), &["open 1 3000", "torn 1"])]
#[case::a_frame_cut_short(Tamper::Cut(3), &["open 1 3000", "torn 1"])]
fn altered_records_tear_the_stream(#[case] tamper: Tamper, #[case] events: &[&str]) {
    let (honest, starts) = two_sealed_frames();
    let first = starts[4];
    let record = |i: usize| honest[starts[i]..starts[i + 1]].to_vec();
    let wire = match tamper {
        Tamper::Flip(at) => {
            let mut wire = honest.clone();
            wire[at] ^= 0x20;
            wire
        }
        Tamper::Replay => [&honest[..first], &honest[..first], &honest[first..]].concat(),
        Tamper::Swap(a, b) => {
            let mut wire = honest[..starts[a]].to_vec();
            wire.extend(record(b));
            wire.extend(record(a));
            wire.extend(&honest[starts[b + 1]..]);
            wire
        }
        Tamper::Drop(i) => [&honest[..starts[i]], &honest[starts[i + 1]..]].concat(),
        Tamper::Cut(i) => [&honest[..starts[i]], &honest[first..]].concat(),
    };
    let mut lander = Recorder::granting(vec![(0, 3000)]);
    let mut memory = vec![0u8; 3000];
    let mut reader = reader_for(true);
    let fed = feed(&mut reader, &mut lander, &mut memory, &wire, 1 << 20);
    assert!(fed < wire.len(), "the stream ended");
    assert_eq!(lander.events, events);
    let mut pieces = Vec::new();
    assert!(matches!(
        reader.want(&mut lander, &mut pieces, 8),
        Want::Nothing
    ));
    // The untouched stream lands both frames.
    let mut lander = Recorder::granting(vec![(0, 3000)]);
    let mut reader = reader_for(true);
    feed(&mut reader, &mut lander, &mut memory, &honest, 1 << 20);
    assert_eq!(lander.events.last().unwrap(), "landed 2");
}

/// How [`altered_records_tear_the_stream`] alters two sealed frames
/// (indices into their records, see [`two_sealed_frames`]).
#[derive(Debug, Clone, Copy)]
enum Tamper {
    Flip(usize),
    Replay,
    Swap(usize, usize),
    Drop(usize),
    Cut(usize),
}

/// A plain stream's frames land as the bytes come: no record is opened.
#[test]
fn a_plain_stream_lands_what_comes() {
    let mut lander = Recorder::granting(vec![(0, 3000)]);
    let mut wire = frame(None, 1, 1, &[1; 3000]);
    wire[PREFIX_BYTES + 10] = 9;
    let mut memory = vec![0u8; 3000];
    let mut reader = reader_for(false);
    feed(&mut reader, &mut lander, &mut memory, &wire, 1 << 20);
    assert_eq!(lander.events, ["open 1 3000", "landed 1"]);
    assert_eq!(memory[10], 9);
}
