//! The data stream over loopback sockets: frames land through the
//! registry where their lander says, leave whole and in order, and a
//! stream that stalls or ends is broken.

use std::sync::Arc;

use super::*;
use crate::copy::test_memory::TestBuffer;
use crate::wire::frame::test_lander::{GrantedAmongOthers, Recorder, frame};

/// A connected pair on loopback: our end, and the peer's (std, blocking).
async fn pair() -> (TcpStream, std::net::TcpStream) {
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

/// A granted frame's payload lands in its spans in order, across their
/// boundary; frames around it that do not open are read past, so the
/// framing holds and nothing of theirs is written anywhere.
#[test]
fn granted_frames_land_in_their_spans_and_others_are_read_past() {
    run(async {
        let (ours, mut peer) = pair().await;
        let memory = Arc::new(MemoryRegistry::new());
        let first = TestBuffer::new(&memory, 3000);
        let second = TestBuffer::new(&memory, 5000);
        let mut lander = Recorder::granting(vec![(first.addr(), 3000), (second.addr(), 5000)]);
        let frames = GrantedAmongOthers::new(70_000);
        std::io::Write::write_all(&mut peer, &frames.wire).unwrap();
        let mut stream = InStream::new(7, ours);
        let pumped = pump_until(&mut stream, &memory, &mut lander, |l| l.events.len() == 8).await;
        assert!(!pumped.broken);
        assert_eq!(lander.events, frames.events);
        assert_eq!(first.read(3000), frames.payload[..3000]);
        assert_eq!(second.read(5000), frames.payload[3000..]);
    });
}

/// An operation that stops waiting mid-payload gets no more of it: the
/// rest is read past, the next frame lands.
#[test]
fn a_payload_stops_landing_once_its_operation_stops_waiting() {
    run(async {
        let (ours, mut peer) = pair().await;
        let memory = Arc::new(MemoryRegistry::new());
        let into = TestBuffer::new(&memory, 4096);
        let mut lander = Recorder::granting(vec![(into.addr(), 4096)]);
        let mut stream = InStream::new(1, ours);
        let whole = frame(1, 1, &[0xaa; 4096]);
        let cut = PREFIX_BYTES + 1000;
        std::io::Write::write_all(&mut peer, &whole[..cut]).unwrap();
        for _ in 0..10_000 {
            if into.read(1000)[999] == 0xaa {
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
        rest.extend(frame(1, 2, &[0xbb; 4096]));
        std::io::Write::write_all(&mut peer, &rest).unwrap();
        pump_until(&mut stream, &memory, &mut lander, |l| l.events.len() == 4).await;
        assert_eq!(
            lander.events,
            ["open 1 4096", "discarded", "open 1 4096", "landed 2"]
        );
        let into = into.read(4096);
        assert!(into[..1000].iter().all(|b| *b == 0xaa));
        assert!(
            into[1000..].iter().all(|b| *b == 0),
            "nothing after it ended"
        );
        assert!(other.read(4096).iter().all(|b| *b == 0xbb));
    });
}

/// The stream's wire (a dialer's hello, its proof for a challenge, a
/// frame's prefix) is a format between two processes: pinned.
#[test]
fn the_wire_layout_is_pinned() {
    let claim: ControlEndpoint = "tcp://10.0.0.1:5000".parse().unwrap();
    let key = RecordKey::new(&[1; 32]);
    let header = key.seal_message(
        kvcr_contracts::protocol::OpHandle(7),
        2,
        crate::wire::part::Part::new(0, 1).unwrap(),
    );
    let hex = |bytes: &[u8]| -> String {
        bytes
            .chunks(16)
            .map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n")
    };
    insta::assert_snapshot!(format!(
        "hello\n{}\nproof\n{}\nprefix\n{}",
        hex(&hello(&claim).unwrap()),
        hex(&key.stream_proof(&[2; 32], &claim)),
        hex(&frame_prefix(65_536, &header)),
    ));
}

/// Queued writes leave whole and in order, each its prefix then its
/// spans' bytes laid end to end, and are reported sent once the socket
/// took their last byte.
#[test]
fn queued_frames_leave_whole_and_in_order() {
    run(async {
        let (ours, mut peer) = pair().await;
        let a: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let b = vec![7u8; 3000];
        let memory = Arc::new(MemoryRegistry::new());
        let (at_a, at_b) = (
            TestBuffer::with(&memory, 5000, &a),
            TestBuffer::with(&memory, 3000, &b),
        );
        let mut out = OutStream::new([0; 32], ours, None);
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
        let mut wire = vec![0u8; 2 * PREFIX_BYTES + 8010];
        std::io::Read::read_exact(&mut peer, &mut wire).unwrap();
        let mut expected = frame_prefix(8000, &header).to_vec();
        expected.extend(&a);
        expected.extend(&b);
        expected.extend(frame_prefix(10, &header));
        expected.extend(&b[..10]);
        assert_eq!(wire, expected);
    });
}

/// A target that stops reading cannot hold a source's writes: once the
/// socket has taken nothing for the deadline the stream is broken, and
/// its writes come back unsent.
#[test]
fn a_stream_nobody_reads_is_broken_at_its_deadline() {
    run(async {
        let (ours, _peer) = pair().await;
        let memory = Arc::new(MemoryRegistry::new());
        let big = TestBuffer::with(&memory, 64 << 20, &vec![1u8; 64 << 20]);
        let mut out = OutStream::new([0; 32], ours, None);
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
#[test]
fn a_stream_that_ends_is_broken() {
    run(async {
        let (ours, mut peer) = pair().await;
        std::io::Write::write_all(&mut peer, &frame(0, 0, &[1; 100])[..20]).unwrap();
        drop(peer);
        let mut lander = Recorder::granting(Vec::new());
        let mut stream = InStream::new(1, ours);
        let memory = MemoryRegistry::new();
        let pumped = pump_until(&mut stream, &memory, &mut lander, |_| false).await;
        assert!(pumped.broken);
        assert!(lander.events.is_empty());
    });
}
