//! The data stream over loopback sockets: frames land through the
//! registry where their lander says (sealed records opened in the slots
//! they were read into), leave whole and in order, and a stream that
//! stalls or ends is broken.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rstest::rstest;

use super::*;
use crate::copy::test_memory::TestBuffer;
use crate::wire::frame::test_lander::{GrantedAmongOthers, Recorder, frame, frame_in, header};
use crate::wire::frame::{MAX_RECORD, PREFIX_BYTES, frame_prefix, seal_frame};
use crate::wire::record::SLOT_BYTES;
use crate::wire::sealing::Sealer;
use crate::wire::sealing::tests::pair;

/// A connected pair on loopback: our end, and the peer's (std, blocking).
async fn pair_of_sockets() -> (TcpStream, std::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = listener.local_addr().unwrap();
    let peer = std::net::TcpStream::connect(at).unwrap();
    let (ours, _) = listener.accept().await.unwrap();
    (ours, peer)
}

fn run(test: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(test);
}

/// Pumps until `done` says so (bytes on loopback arrive at once, but a
/// read may see them in pieces).
async fn pump_until(
    stream: &mut InStream<u8>,
    memory: &MemoryRegistry,
    lander: &mut Recorder,
    mut done: impl FnMut(&Recorder) -> bool,
) -> Pumped {
    for _ in 0..10_000 {
        let pumped = stream.pump(memory, lander);
        if pumped.broken || done(lander) {
            return pumped;
        }
        tokio::task::yield_now().await;
    }
    panic!("the frames never landed: {:?}", lander.events);
}

/// A sealer and the opener of its records, or neither (a plain stream).
fn keys(sealed: bool) -> (Option<Sealer>, Option<Opener>) {
    match sealed {
        true => {
            let (sealer, opener) = pair(1);
            (Some(sealer), Some(opener))
        }
        false => (None, None),
    }
}

/// A granted frame's payload lands in its spans in order, across their
/// boundary (a sealed record inside one span opened in place, one across
/// both in a bounce buffer); frames around it that do not open are read
/// past, so the framing holds and nothing of theirs is written anywhere.
#[rstest]
fn granted_frames_land_in_their_spans_and_others_are_read_past(
    #[values(None, Some(1000), Some(2500))] sealed: Option<u32>,
) {
    run(async {
        let (ours, mut peer) = pair_of_sockets().await;
        let memory = Arc::new(MemoryRegistry::new());
        let first = TestBuffer::new(&memory, 3000);
        let second = TestBuffer::new(&memory, 5000);
        let mut lander = Recorder::granting(vec![(first.addr(), 3000), (second.addr(), 5000)]);
        let (mut sealer, opener) = keys(sealed.is_some());
        let record = sealed.unwrap_or(MAX_RECORD as u32);
        let frames = GrantedAmongOthers::new(70_000, sealer.as_mut(), record);
        std::io::Write::write_all(&mut peer, &frames.wire).unwrap();
        let mut stream = InStream::new(7, ours, opener);
        let pumped = pump_until(&mut stream, &memory, &mut lander, |l| l.events.len() == 8).await;
        assert!(!pumped.broken);
        assert_eq!(lander.events, frames.events);
        assert_eq!(first.read(3000), frames.payload[..3000]);
        assert_eq!(second.read(5000), frames.payload[3000..]);
    });
}

/// An operation that stops waiting mid-payload gets no more of it: the
/// rest is read past, the next frame lands.
#[rstest]
fn a_payload_stops_landing_once_its_operation_stops_waiting(#[values(false, true)] sealed: bool) {
    run(async {
        let (ours, mut peer) = pair_of_sockets().await;
        let memory = Arc::new(MemoryRegistry::new());
        let into = TestBuffer::new(&memory, 4096);
        let mut lander = Recorder::granting(vec![(into.addr(), 4096)]);
        let (mut sealer, opener) = keys(sealed);
        let mut stream = InStream::new(1, ours, opener);
        let whole = frame_in(sealer.as_mut(), 1, 1, &[0xaa; 4096], 1000);
        // The first record (of a sealed stream) whole, and some more.
        let cut = PREFIX_BYTES + 16 + 1016 + 500;
        std::io::Write::write_all(&mut peer, &whole[..cut]).unwrap();
        for _ in 0..10_000 {
            if into.read(1000).iter().all(|b| *b == 0xaa) {
                break;
            }
            assert!(!stream.pump(&memory, &mut lander).broken);
            tokio::task::yield_now().await;
        }
        assert_eq!(into.read(1000)[999], 0xaa, "the first 1000 bytes landed");
        // The operation ends; the next frame goes elsewhere.
        lander.granted = false;
        pump_until(&mut stream, &memory, &mut lander, |l| {
            l.events.last().is_some_and(|e| e == "discarded")
        })
        .await;
        let other = TestBuffer::new(&memory, 4096);
        lander.spans = vec![(other.addr(), 4096)];
        lander.granted = true;
        let mut rest = whole[cut..].to_vec();
        rest.extend(frame(sealer.as_mut(), 1, 2, &[0xbb; 4096]));
        std::io::Write::write_all(&mut peer, &rest).unwrap();
        pump_until(&mut stream, &memory, &mut lander, |l| l.events.len() == 4).await;
        assert_eq!(
            lander.events,
            ["open 1 4096", "discarded", "open 1 4096", "landed 2"]
        );
        let into = into.read(4096);
        assert!(into[..1000].iter().all(|b| *b == 0xaa));
        let read = if sealed { 1000 + 500 } else { 1016 + 516 };
        assert!(
            into[read..].iter().all(|b| *b == 0),
            "nothing after it ended"
        );
        assert!(other.read(4096).iter().all(|b| *b == 0xbb));
    });
}

/// A record altered on the way tears the stream: the lander is told with
/// the frame it was landing, the stream is broken, and the bytes in the
/// slots are not the payload's.
#[test]
fn an_altered_record_breaks_the_stream() {
    run(async {
        let (ours, mut peer) = pair_of_sockets().await;
        let memory = Arc::new(MemoryRegistry::new());
        let into = TestBuffer::new(&memory, 4096);
        let mut lander = Recorder::granting(vec![(into.addr(), 4096)]);
        let (mut sealer, opener) = keys(true);
        let mut wire = frame(sealer.as_mut(), 1, 1, &[0xaa; 4096]);
        wire[PREFIX_BYTES + 16 + 2000] ^= 0x20;
        std::io::Write::write_all(&mut peer, &wire).unwrap();
        let mut stream = InStream::new(1, ours, opener);
        let pumped = pump_until(&mut stream, &memory, &mut lander, |_| false).await;
        assert!(pumped.broken);
        assert_eq!(lander.events, ["open 1 4096", "torn 1"]);
        assert!(into.read(4096) != [0xaa; 4096]);
    });
}

/// The stream's wire (a dialer's hello, its terms and its proof for a
/// challenge, a frame's prefix, a sealed frame) is a format between two
/// processes: pinned.
#[test]
fn the_wire_layout_is_pinned() {
    let claim: ControlEndpoint = "tcp://10.0.0.1:5000".parse().unwrap();
    let key = RecordKey::new(&[1; 32]);
    let header = key.seal_message(
        kvcr_contracts::protocol::OpHandle(7),
        2,
        crate::wire::part::Part::new(0, 1).unwrap(),
    );
    let terms = StreamTerms {
        sealed: true,
        nonce: [3; 32],
    };
    let hex = |bytes: &[u8]| -> String {
        bytes
            .chunks(16)
            .map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let (mut sealer, _) = pair(1);
    let sealed = seal_frame(Some(&mut sealer), 20, 16, &header, &[0x5a; 20]).unwrap();
    insta::assert_snapshot!(format!(
        "hello\n{}\nterms\n{}\nproof\n{}\nprefix\n{}\nsealed frame\n{}",
        hex(&hello(&claim).unwrap()),
        hex(&terms.to_bytes()),
        hex(&key.stream_proof(&[2; 32], &claim, &terms)),
        hex(&frame_prefix(65_536, 16, &header)),
        hex(&sealed),
    ));
}

/// Queued writes leave whole and in order, each its prefix then its
/// spans' bytes laid end to end (sealed: in records, numbered on from the
/// frame before), and are reported sent once the socket took their last
/// byte.
#[rstest]
fn queued_frames_leave_whole_and_in_order(#[values(false, true)] sealed: bool) {
    run(async {
        let (ours, mut peer) = pair_of_sockets().await;
        let a: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let b = vec![7u8; 3000];
        let memory = Arc::new(MemoryRegistry::new());
        let (at_a, at_b) = (
            TestBuffer::with(&memory, 5000, &a),
            TestBuffer::with(&memory, 3000, &b),
        );
        let (sealer, _) = keys(sealed);
        let mut out = OutStream::new([0; 32], ours, sealer, None);
        let header = [3u8; SLOT_BYTES];
        out.push(11, &header, vec![(at_a.addr(), 5000), (at_b.addr(), 3000)]);
        out.push(12, &header, vec![(at_b.addr(), 10)]);
        let mut sent = Vec::new();
        #[allow(clippy::disallowed_methods)]
        let now = Instant::now();
        let pumped = out.pump(&memory, &mut sent, now, Duration::from_secs(1));
        assert!(pumped.moved && !pumped.broken);
        assert_eq!(sent, [11, 12]);
        assert!(!out.wants_write());
        // What an independent sealer of the same stream makes of them.
        let (mut expected_sealer, _) = keys(sealed);
        let ab = [a.as_slice(), b.as_slice()].concat();
        let mut expected = Vec::new();
        for payload in [&ab[..], &b[..10]] {
            let len = payload.len() as u64;
            let record = MAX_RECORD as u32;
            expected.extend(
                seal_frame(expected_sealer.as_mut(), len, record, &header, payload).unwrap(),
            );
        }
        let mut wire = vec![0u8; expected.len()];
        std::io::Read::read_exact(&mut peer, &mut wire).unwrap();
        assert_eq!(wire, expected);
    });
}

/// A sealed write of many records from spans of one size lands
/// byte-exact through a real socket, every record in place (its records
/// cut to the spans' size, none across two).
#[test]
fn a_large_sealed_write_lands_byte_exact() {
    run(async {
        let (ours, theirs) = pair_of_sockets().await;
        let theirs = TcpStream::from_std({
            theirs.set_nonblocking(true).unwrap();
            theirs
        })
        .unwrap();
        let memory = Arc::new(MemoryRegistry::new());
        let page = 96 << 10;
        let bytes: Vec<u8> = (0..4 * page).map(|i| (i * 31 % 253) as u8).collect();
        let pool: Vec<TestBuffer> = bytes
            .chunks(page)
            .map(|c| TestBuffer::with(&memory, page, c))
            .collect();
        let slots: Vec<TestBuffer> = (0..4).map(|_| TestBuffer::new(&memory, page)).collect();
        let (sealer, opener) = pair(4);
        let mut out = OutStream::new([0; 32], ours, Some(sealer), None);
        let spans = |buffers: &[TestBuffer]| -> Vec<(u64, u64)> {
            buffers.iter().map(|b| (b.addr(), page as u64)).collect()
        };
        out.push(1, &header(1, 5), spans(&pool));
        let mut stream = InStream::new(1, theirs, Some(opener));
        let mut lander = Recorder::granting(spans(&slots));
        let mut sent = Vec::new();
        for _ in 0..100_000 {
            #[allow(clippy::disallowed_methods)]
            let now = Instant::now();
            assert!(
                !out.pump(&memory, &mut sent, now, Duration::from_secs(60))
                    .broken
            );
            assert!(!stream.pump(&memory, &mut lander).broken);
            if lander.events.len() == 2 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(
            lander.events,
            [format!("open 1 {}", 4 * page), "landed 5".into()]
        );
        let landed: Vec<u8> = slots.iter().flat_map(|s| s.read(page)).collect();
        assert!(landed == bytes);
        assert_eq!(sent, [1]);
        assert!(stream.bounce.is_empty(), "no record ran across two slots");
    });
}

/// A target that stops reading cannot hold a source's writes: once the
/// socket has taken nothing for the deadline the stream is broken, and
/// its writes come back unsent.
#[rstest]
fn a_stream_nobody_reads_is_broken_at_its_deadline(#[values(false, true)] sealed: bool) {
    run(async {
        let (ours, _peer) = pair_of_sockets().await;
        let memory = Arc::new(MemoryRegistry::new());
        let big = TestBuffer::with(&memory, 64 << 20, &vec![1u8; 64 << 20]);
        let (sealer, _) = keys(sealed);
        let mut out = OutStream::new([0; 32], ours, sealer, None);
        out.push(5, &[0; SLOT_BYTES], vec![(big.addr(), 64 << 20)]);
        let mut sent = Vec::new();
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        let deadline = Duration::from_secs(3600);
        let mut broken = false;
        for turn in 0..1000u64 {
            // Each turn an hour later: the socket fills, then takes nothing.
            let now = start + Duration::from_secs(3600 * turn);
            let pumped = out.pump(&memory, &mut sent, now, deadline);
            if pumped.broken {
                broken = true;
                break;
            }
        }
        assert!(broken, "64 MiB never fit an unread socket");
        assert!(sent.is_empty());
        assert_eq!(out.take_unsent(), [5]);
    });
}

/// Bytes that end mid-frame (the peer hung up) break the stream.
#[rstest]
fn a_stream_that_ends_is_broken(#[values(false, true)] sealed: bool) {
    run(async {
        let (ours, mut peer) = pair_of_sockets().await;
        let (mut sealer, opener) = keys(sealed);
        let wire = frame(sealer.as_mut(), 0, 0, &[1; 100]);
        std::io::Write::write_all(&mut peer, &wire[..20]).unwrap();
        drop(peer);
        let mut lander = Recorder::granting(Vec::new());
        let mut stream = InStream::new(1, ours, opener);
        let memory = MemoryRegistry::new();
        let pumped = pump_until(&mut stream, &memory, &mut lander, |_| false).await;
        assert!(pumped.broken);
        assert!(lander.events.is_empty());
    });
}

/// A source sees that its target closed the stream (a target never sends
/// on it): its writes then go elsewhere.
#[test]
fn a_source_sees_its_target_close_the_stream() {
    run(async {
        let (ours, peer) = pair_of_sockets().await;
        let out = OutStream::new([0; 32], ours, None, None);
        assert!(!out.closed());
        drop(peer);
        for _ in 0..10_000 {
            if out.closed() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the close was never seen");
    });
}
