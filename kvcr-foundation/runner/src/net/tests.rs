//! The control channel against honest peers and against an attacker who can
//! reach the port: with and without the secret, replaying what it captured,
//! speaking out of turn, stalling, and opening too many connections.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::codec::FrameCodec;
use kvcr_contracts::protocol::{Body, Message};

use super::channel::{ChannelEvent, ControlChannel, Inbound, Shared};
use super::limits::{ControlLimits, ControlStats};
use super::member::{KeylessSources, StaticKey};
use super::session::{PREAMBLE, PeerIdentity, RECORD_MAX, Refusal, initiate, seal};
use crate::wire::numbering::MAX_TAKEN_EARLY;
use kvcr_contracts::protocol::{Header, OpHandle, RouteGeneration, WriteOutcome};
use rstest::rstest;
use tokio::sync::mpsc::UnboundedReceiver;

const SECRET: &[u8] = b"a-cluster-secret-of-32-bytes-ok!";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn quick_limits() -> ControlLimits {
    ControlLimits {
        handshake_timeout: Duration::from_millis(300),
        frame_deadline: Duration::from_millis(300),
        ..ControlLimits::default()
    }
}

/// A header that lies about who sent it.
fn forged_header() -> Header {
    Header {
        sender: Incarnation::generate(),
        route_generation: RouteGeneration(0),
        sender_endpoint: ControlEndpoint::parse("tcp://10.9.9.9:9").unwrap(),
    }
}

fn probe(op: u64) -> Message {
    Message {
        header: forged_header(),
        body: Body::WriteProbe {
            op_handle: OpHandle(op),
            source_incarnation: None,
        },
    }
}

fn done(op: u64) -> Message {
    Message {
        header: forged_header(),
        body: Body::WriteDone {
            op_handle: OpHandle(op),
            outcome: WriteOutcome::Failed { terminal: true },
        },
    }
}

struct Node {
    channel: ControlChannel,
    inbound: UnboundedReceiver<Inbound>,
    identity: PeerIdentity,
    addr: SocketAddr,
}

impl Node {
    async fn start(secret: Option<&[u8]>, limits: ControlLimits) -> Self {
        Self::start_with(secret, limits, KeylessSources::default()).await
    }

    /// A node whose endpoint names its fresh static key.
    async fn start_with(
        secret: Option<&[u8]>,
        limits: ControlLimits,
        keyless: KeylessSources,
    ) -> Self {
        let (listener, addr) = ControlChannel::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let key = StaticKey::generate().unwrap();
        let identity = PeerIdentity {
            endpoint: ControlEndpoint::parse(&format!("tcp://{addr}"))
                .unwrap()
                .with_key(Some(key.public())),
            incarnation: Incarnation::generate(),
        };
        let (channel, inbound) =
            ControlChannel::start(listener, identity.clone(), secret, limits, (key, keyless));
        Self {
            channel,
            inbound,
            identity,
            addr,
        }
    }

    /// The next event the peer thread would act on, if one comes in `wait`.
    async fn event(&mut self, wait: Duration) -> Option<ChannelEvent> {
        let deadline = Instant::now() + wait;
        loop {
            let item = tokio::time::timeout_at(deadline, self.inbound.recv())
                .await
                .ok()??;
            if let Some(event) = self.channel.on_inbound(item) {
                return Some(event);
            }
        }
    }

    async fn message(&mut self) -> Option<Message> {
        match self.event(Duration::from_secs(5)).await? {
            ChannelEvent::Message(m, _) => Some(m),
            other => panic!("expected a message, got {other:?}"),
        }
    }

    fn stat(&self, counter: fn(&ControlStats) -> &AtomicU64) -> u64 {
        counter(&self.channel.stats).load(Ordering::Relaxed)
    }
}

async fn settle(channel: &ControlChannel, want: usize) -> usize {
    for _ in 0..500 {
        if channel.open_sockets() == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    channel.open_sockets()
}

/// A member of the cluster that speaks the protocol by hand.
async fn member_session(
    to: SocketAddr,
    secret: Option<&[u8]>,
) -> (TcpStream, snow::TransportState, PeerIdentity) {
    let (stub, _) = Node::start(secret, quick_limits()).await.channel_parts();
    let mut stream = TcpStream::connect(to).await.unwrap();
    let (transport, acceptor) = initiate(&mut stream, &stub.psk, &stub.local_member(), None)
        .await
        .unwrap();
    (stream, transport, acceptor)
}

impl Node {
    fn channel_parts(self) -> (Arc<Shared>, UnboundedReceiver<Inbound>) {
        (Arc::clone(&self.channel.shared), self.inbound)
    }
}

async fn send_sealed(
    stream: &mut TcpStream,
    transport: &mut snow::TransportState,
    message: &Message,
) {
    let mut frames = BytesMut::new();
    FrameCodec::default().encode(message, &mut frames).unwrap();
    let mut wire = BytesMut::new();
    let mut sealed = vec![0u8; RECORD_MAX];
    seal(transport, &frames, &mut sealed, &mut wire).unwrap();
    stream.write_all(&wire).await.unwrap();
}

/// Reads until the peer closes the connection (or 5 s pass).
async fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut sink = Vec::new();
    matches!(
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut sink)).await,
        Ok(Ok(_) | Err(_))
    )
}

/// A request travels on the session the target dialed, arrives stamped with
/// the identity that session proved (not the frame's claim), and the reply
/// comes back on the same session: one socket each side.
#[test]
fn identity_comes_from_the_session_and_replies_share_it() {
    runtime().block_on(async {
        let mut target = Node::start(Some(SECRET), quick_limits()).await;
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        let to_source = source.identity.endpoint.clone();
        for op in 0..50 {
            target.channel.send(&to_source, &probe(op));
        }
        for op in 0..50 {
            let got = source.message().await.unwrap();
            assert_eq!(got.body, probe(op).body, "in order");
            assert_eq!(got.header.sender_endpoint, target.identity.endpoint);
            assert_eq!(got.header.sender, target.identity.incarnation);
        }
        source.channel.send(&target.identity.endpoint, &done(7));
        let reply = target.message().await.unwrap();
        assert_eq!(reply.body, done(7).body);
        assert_eq!(
            reply.header.sender_endpoint, to_source,
            "the name we dialed"
        );
        assert_eq!(reply.header.sender, source.identity.incarnation);
        assert_eq!(settle(&target.channel, 1).await, 1, "one dialed socket");
        assert_eq!(settle(&source.channel, 1).await, 1, "no second socket back");
        // Forgetting the source closes the session; the source sees it go.
        target.channel.remove_peer(&to_source);
        assert!(matches!(
            source.event(Duration::from_secs(5)).await,
            Some(ChannelEvent::TargetGone(t)) if t == target.identity.endpoint
        ));
        assert!(matches!(
            target.event(Duration::from_secs(5)).await,
            Some(ChannelEvent::SourceLost(s)) if s == to_source
        ));
        // A reply with no session to carry it is dropped, never dialed.
        let dropped = source.stat(|s| &s.dropped);
        source.channel.send(&target.identity.endpoint, &done(8));
        assert_eq!(source.stat(|s| &s.dropped), dropped + 1);
        assert_eq!(settle(&source.channel, 0).await, 0);
    });
}

#[rstest]
#[case::no_secret(None)]
#[case::wrong_secret(Some(&b"another-secret-of-32-bytes-long!"[..]))]
#[case::one_bit_off(Some(&b"a-cluster-secret-of-32-bytes-ok\""[..]))]
fn without_the_secret_nothing_gets_through(#[case] intruder_secret: Option<&'static [u8]>) {
    runtime().block_on(async {
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        let mut intruder = Node::start(intruder_secret, quick_limits()).await;
        intruder.channel.send(&source.identity.endpoint, &probe(1));
        assert!(
            source.event(Duration::from_millis(600)).await.is_none(),
            "nothing reached the runner"
        );
        assert!(source.stat(|s| &s.refused_handshakes) >= 1);
        assert!(matches!(
            intruder.event(Duration::from_secs(5)).await,
            Some(ChannelEvent::SourceLost(_))
        ));
        let mut friend = Node::start(Some(SECRET), quick_limits()).await;
        friend.channel.send(&source.identity.endpoint, &probe(2));
        assert_eq!(source.message().await.unwrap().body, probe(2).body);
    });
}

/// Garbage, a wrong preamble, or a handshake message too large: refused
/// before anything is buffered, and the runner keeps serving.
#[rstest]
#[case::garbage(b"\xde\xad\xbe\xef\x01\x02\x03\x04\x05\x06".to_vec())]
#[case::old_preamble(b"KVCRC1\x00".iter().copied().chain([0u8; 16]).collect())]
#[case::huge_first_message(PREAMBLE.iter().copied().chain([0xff, 0xff]).collect())]
fn malformed_handshakes_are_refused(#[case] bytes: Vec<u8>) {
    runtime().block_on(async {
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        let mut raw = TcpStream::connect(source.addr).await.unwrap();
        raw.write_all(&bytes).await.unwrap();
        assert!(closed_by_peer(&mut raw).await);
        assert_eq!(source.stat(|s| &s.refused_handshakes), 1);
        let mut friend = Node::start(Some(SECRET), quick_limits()).await;
        friend.channel.send(&source.identity.endpoint, &probe(3));
        assert_eq!(source.message().await.unwrap().body, probe(3).body);
    });
}

/// Everything an eavesdropper captured from a real session, replayed on a
/// new connection, opens nothing: the ephemeral keys differ.
#[test]
fn a_replayed_handshake_opens_no_session() {
    runtime().block_on(async {
        let source = Node::start(Some(SECRET), quick_limits()).await;
        let (stub, _inbound) = Node::start(Some(SECRET), quick_limits())
            .await
            .channel_parts();
        // Capture the honest dialer's bytes by relaying them.
        let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay_addr = relay.local_addr().unwrap();
        let dialer = tokio::spawn(async move {
            let mut stream = TcpStream::connect(relay_addr).await.unwrap();
            let result = initiate(&mut stream, &stub.psk, &stub.local_member(), None).await;
            (stream, result.is_ok())
        });
        let (mut from_dialer, _) = relay.accept().await.unwrap();
        let mut to_source = TcpStream::connect(source.addr).await.unwrap();
        let mut captured = Vec::new();
        let mut buf = vec![0u8; 4096];
        // Dialer → source: preamble + message 1; source → dialer: message 2;
        // dialer → source: message 3 (its static key and identity).
        let n = from_dialer.read(&mut buf).await.unwrap();
        captured.extend_from_slice(&buf[..n]);
        to_source.write_all(&buf[..n]).await.unwrap();
        let n = to_source.read(&mut buf).await.unwrap();
        from_dialer.write_all(&buf[..n]).await.unwrap();
        let n = from_dialer.read(&mut buf).await.unwrap();
        captured.extend_from_slice(&buf[..n]);
        to_source.write_all(&buf[..n]).await.unwrap();
        let (_dialer_stream, ok) = dialer.await.unwrap();
        assert!(ok, "the relayed handshake itself succeeds");
        let refused = source.stat(|s| &s.refused_handshakes);
        let mut replay = TcpStream::connect(source.addr).await.unwrap();
        replay.write_all(&captured).await.unwrap();
        assert!(closed_by_peer(&mut replay).await);
        assert_eq!(source.stat(|s| &s.refused_handshakes), refused + 1);
    });
}

/// Inside a session: a record replayed, a record altered, and a source's
/// reply sent by a target all close that session without reaching the
/// runner.
#[rstest]
#[case::replayed_record("replay")]
#[case::altered_record("alter")]
#[case::reply_out_of_turn("turn")]
fn a_member_breaking_the_session_rules_is_cut_off(#[case] attack: &str) {
    runtime().block_on(async {
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        let (mut stream, mut transport, _) = member_session(source.addr, Some(SECRET)).await;
        let mut frames = BytesMut::new();
        FrameCodec::default()
            .encode(&probe(1), &mut frames)
            .unwrap();
        let mut record = BytesMut::new();
        let mut sealed = vec![0u8; RECORD_MAX];
        seal(&mut transport, &frames, &mut sealed, &mut record).unwrap();
        stream.write_all(&record).await.unwrap();
        assert_eq!(source.message().await.unwrap().body, probe(1).body);
        match attack {
            "replay" => stream.write_all(&record).await.unwrap(),
            "alter" => {
                let mut frames = BytesMut::new();
                FrameCodec::default()
                    .encode(&probe(2), &mut frames)
                    .unwrap();
                let mut next = BytesMut::new();
                seal(&mut transport, &frames, &mut sealed, &mut next).unwrap();
                let last = next.len() - 1;
                next[last] ^= 1;
                stream.write_all(&next).await.unwrap();
            }
            _ => send_sealed(&mut stream, &mut transport, &done(1)).await,
        }
        assert!(closed_by_peer(&mut stream).await);
        assert_eq!(source.stat(|s| &s.bad_frames), 1);
        assert!(
            matches!(
                source.event(Duration::from_secs(5)).await,
                Some(ChannelEvent::TargetGone(_))
            ),
            "the session's end is reported, and nothing else arrived"
        );
    });
}

/// A member that starts a record and stalls loses the session at the frame
/// deadline.
#[test]
fn a_stalled_frame_is_cut_off_at_its_deadline() {
    runtime().block_on(async {
        let source = Node::start(Some(SECRET), quick_limits()).await;
        let (mut stream, _transport, _) = member_session(source.addr, Some(SECRET)).await;
        stream.write_all(&[0x01, 0x00, 0xaa]).await.unwrap();
        assert!(closed_by_peer(&mut stream).await);
        assert_eq!(source.stat(|s| &s.timeouts), 1);
    });
}

/// Connections from `from` that never start a handshake.
async fn silent_connections(from: &str, to: SocketAddr, count: usize) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for _ in 0..count {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
        held.push(socket.connect(to).await.unwrap());
    }
    held
}

/// Waits (bounded) until the source's `counter` reads `want`.
async fn until_stat(source: &Node, counter: fn(&ControlStats) -> &AtomicU64, want: u64) {
    for _ in 0..2500 {
        if source.stat(counter) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(source.stat(counter), want);
}

fn waiting(source: &Node) -> usize {
    source
        .channel
        .stats
        .handshakes_waiting
        .load(Ordering::Relaxed)
}

/// Connections that never start a handshake wait in places of their own:
/// past the per-address cap a new one displaces its address's oldest; with
/// every place taken, a new one from another address displaces the oldest
/// of the address holding the most; and a member still gets its session.
#[test]
fn silent_connections_wait_apart_and_the_oldest_makes_room() {
    runtime().block_on(async {
        let limits = ControlLimits {
            max_handshakes_per_address: 3,
            max_handshakes: 5,
            handshake_timeout: Duration::from_secs(30),
            ..quick_limits()
        };
        let mut source = Node::start(Some(SECRET), limits).await;
        let mut first = silent_connections("127.0.0.2", source.addr, 8).await;
        until_stat(&source, |s| &s.evicted_handshakes, 5).await;
        for displaced in &mut first[..5] {
            assert!(closed_by_peer(displaced).await);
        }
        assert_eq!(waiting(&source), 3);
        let _second = silent_connections("127.0.0.3", source.addr, 2).await;
        let _third = silent_connections("127.0.0.4", source.addr, 1).await;
        // Full: the newcomer from .4 displaces the oldest of .2 (three held).
        until_stat(&source, |s| &s.evicted_handshakes, 6).await;
        assert!(closed_by_peer(&mut first[5]).await);
        assert_eq!(waiting(&source), 5);
        // A member dials (from 127.0.0.1): it displaces a stranger, and its
        // session works.
        let mut friend = Node::start(Some(SECRET), quick_limits()).await;
        friend.channel.send(&source.identity.endpoint, &probe(4));
        assert_eq!(source.message().await.unwrap().body, probe(4).body);
        assert_eq!(source.stat(|s| &s.evicted_handshakes), 7);
        assert_eq!(source.stat(|s| &s.refused_connections), 0);
        assert_eq!(waiting(&source), 4);
    });
}

/// Sessions whose handshake is done are capped per address: one past the
/// cap is refused (after its handshake) while the others carry on.
#[test]
fn sessions_are_capped_per_address() {
    runtime().block_on(async {
        let limits = ControlLimits {
            max_sessions_per_address: 2,
            ..quick_limits()
        };
        let mut source = Node::start(Some(SECRET), limits).await;
        let (mut one, mut transport, _) = member_session(source.addr, Some(SECRET)).await;
        let (_two, _, _) = member_session(source.addr, Some(SECRET)).await;
        let (mut three, _, _) = member_session(source.addr, Some(SECRET)).await;
        assert!(closed_by_peer(&mut three).await);
        assert_eq!(source.stat(|s| &s.refused_connections), 1);
        send_sealed(&mut one, &mut transport, &probe(9)).await;
        assert_eq!(source.message().await.unwrap().body, probe(9).body);
    });
}

#[test]
fn limits_are_checked() {
    assert!(ControlLimits::default().check().is_ok());
    let bad = [
        ControlLimits {
            max_sessions: 0,
            ..ControlLimits::default()
        },
        ControlLimits {
            max_frame_len: 100,
            ..ControlLimits::default()
        },
        ControlLimits {
            inbound_bytes_per_session: 1 << 20,
            ..ControlLimits::default()
        },
        ControlLimits {
            idle_timeout: Duration::ZERO,
            ..ControlLimits::default()
        },
        ControlLimits {
            outbound_bytes_per_session: 1 << 20,
            ..ControlLimits::default()
        },
        ControlLimits {
            max_handshakes_per_address: 0,
            ..ControlLimits::default()
        },
    ];
    for limits in bad {
        assert!(limits.check().is_err(), "{limits:?}");
    }
    // The stated bound: 16 sessions × (2 MiB frame + a record + 4 MiB in
    // + 4 MiB out), and 16 waiting connections × 4 KiB.
    assert_eq!(
        ControlLimits::default().per_address_bound_bytes(),
        16 * ((2 << 20) + RECORD_MAX + 2 + (4 << 20) + (4 << 20)) + 16 * (4 << 10)
    );
}

/// Messages sent before the session is established, after it, with and
/// without flushes in between, arrive in the order sent.
#[test]
fn messages_keep_their_order_across_the_opening_and_flushes() {
    runtime().block_on(async {
        let mut target = Node::start(Some(SECRET), quick_limits()).await;
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        let to_source = source.identity.endpoint.clone();
        // Queued while the dial and the handshake run.
        for op in 0..50 {
            target.channel.send(&to_source, &probe(op));
        }
        for op in 0..10 {
            assert_eq!(source.message().await.unwrap().body, probe(op).body);
        }
        // Established now: sealed at once, written by the flush or the
        // session task, whichever runs first.
        for op in 50..200 {
            target.channel.send(&to_source, &probe(op));
            if op.is_multiple_of(3) {
                target.channel.flush();
            }
        }
        for op in 10..200 {
            assert_eq!(
                source.message().await.unwrap().body,
                probe(op).body,
                "in the order sent"
            );
        }
        assert_eq!(target.stat(|s| &s.dropped), 0);
    });
}

/// A member that stops reading makes the source hold at most
/// `outbound_bytes_per_session` for it (later replies are dropped and
/// counted), and loses the session at the frame deadline.
#[test]
fn a_member_that_stops_reading_is_bounded_then_cut_off() {
    runtime().block_on(async {
        let limits = ControlLimits {
            frame_deadline: Duration::from_secs(2),
            max_frame_len: 4096,
            inbound_bytes_per_session: 8192,
            outbound_bytes_per_session: 4096 + RECORD_MAX,
            ..quick_limits()
        };
        let mut source = Node::start(Some(SECRET), limits).await;
        let (mut stream, mut transport, _) = member_session(source.addr, Some(SECRET)).await;
        send_sealed(&mut stream, &mut transport, &probe(1)).await;
        let member = source.message().await.unwrap().header.sender_endpoint;
        // The member never reads: its socket fills, then the bytes waiting
        // for it reach the bound and replies are dropped.
        let dropped = source.stat(|s| &s.dropped);
        let mut sent = 0u64;
        while source.stat(|s| &s.dropped) == dropped {
            source.channel.send(&member, &done(sent));
            source.channel.flush();
            sent += 1;
            assert!(sent < 10_000_000, "replies never backed up");
            if sent.is_multiple_of(1024) {
                // Let the session task run (it must not be what drains).
                tokio::task::yield_now().await;
            }
        }
        let waiting = source.channel.accepted[&member].out.lock().wire.len();
        assert!(
            waiting <= limits.outbound_bytes_per_session,
            "{waiting} bytes wait for a member that does not read"
        );
        let timeouts = source.stat(|s| &s.timeouts);
        assert!(matches!(
            source.event(Duration::from_secs(10)).await,
            Some(ChannelEvent::TargetGone(t)) if t == member
        ));
        assert_eq!(source.stat(|s| &s.timeouts), timeouts + 1);
        drop(stream);
    });
}

/// A session's messages are numbered alike on both ends; a message taken
/// early (from the sender's mailbox) must be the session's next one, is
/// taken once, and its copy is dropped when the session brings it.
#[test]
fn a_message_taken_early_is_the_sessions_next_and_its_copy_is_dropped() {
    runtime().block_on(async {
        let mut target = Node::start(Some(SECRET), quick_limits()).await;
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        let to_source = source.identity.endpoint.clone();
        let from_target = target.identity.endpoint.clone();
        // Numbered from 0, those queued before the session opens included.
        let sent: Vec<(u64, u64)> = (0..8)
            .map(|op| {
                let sent = target.channel.send(&to_source, &probe(op)).unwrap();
                (sent.session, sent.index)
            })
            .collect();
        let session = sent[0].0;
        assert!(sent.iter().all(|(s, _)| *s == session));
        assert_eq!(
            sent.iter().map(|(_, i)| *i).collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>()
        );
        target.channel.flush();
        assert_eq!(source.message().await.unwrap().body, probe(0).body);
        assert_eq!(source.message().await.unwrap().body, probe(1).body);
        let accepted = source.channel.accepted[&from_target].id;
        let proven = Some(target.identity.incarnation);
        // Not the next message (2 is unread), another session: refused.
        assert_eq!(source.channel.take_early(&from_target, accepted, 3), None);
        assert_eq!(
            source.channel.take_early(&from_target, accepted + 1, 2),
            None
        );
        assert_eq!(source.channel.take_early(&to_source, accepted, 2), None);
        // The next one, as the session's proven identity; then only once.
        assert_eq!(source.channel.take_early(&from_target, accepted, 2), proven);
        assert_eq!(source.channel.take_early(&from_target, accepted, 2), None);
        assert_eq!(source.channel.take_early(&from_target, accepted, 3), proven);
        // Their copies are dropped; what follows comes as before.
        for op in 4..8 {
            assert_eq!(source.message().await.unwrap().body, probe(op).body);
        }
        assert_eq!(source.stat(|s| &s.early_copies_dropped), 2);
        // Once a copy came first, its early take is refused.
        let index = target.channel.send(&to_source, &probe(8)).unwrap().index;
        target.channel.flush();
        assert_eq!(source.message().await.unwrap().body, probe(8).body);
        assert_eq!(
            source.channel.take_early(&from_target, accepted, index),
            None
        );
        // At most `MAX_TAKEN_EARLY` wait for their copies.
        let next = index + 1;
        for i in 0..MAX_TAKEN_EARLY as u64 {
            assert_eq!(
                source.channel.take_early(&from_target, accepted, next + i),
                proven
            );
        }
        let past = next + MAX_TAKEN_EARLY as u64;
        assert_eq!(
            source.channel.take_early(&from_target, accepted, past),
            None
        );
        assert_eq!(target.stat(|s| &s.dropped), 0);
    });
}

/// A target dialing an endpoint that names a key talks only to the member
/// holding it: the right key opens a session; another member answering at
/// that address (its key not the one named) is refused before the target
/// says who it is, and counted.
#[test]
fn a_dialer_checks_the_named_key() {
    runtime().block_on(async {
        let mut target = Node::start(Some(SECRET), quick_limits()).await;
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        target.channel.send(&source.identity.endpoint, &probe(1));
        assert_eq!(source.message().await.unwrap().body, probe(1).body);
        // The same address, naming another member's key.
        let other = StaticKey::generate().unwrap();
        let wrong = source.identity.endpoint.with_key(Some(other.public()));
        target.channel.send(&wrong, &probe(2));
        assert!(matches!(
            target.event(Duration::from_secs(5)).await,
            Some(ChannelEvent::SourceLost(lost)) if lost == wrong
        ));
        assert_eq!(target.stat(|s| &s.sources_wrong_key), 1);
        assert!(
            source.event(Duration::from_millis(300)).await.is_none(),
            "nothing reached the source on the refused session"
        );
        // And by hand: `initiate` refuses the wrong key itself.
        let (stub, _inbound) = Node::start(Some(SECRET), quick_limits())
            .await
            .channel_parts();
        let mut stream = TcpStream::connect(source.addr).await.unwrap();
        let refused = initiate(
            &mut stream,
            &stub.psk,
            &stub.local_member(),
            Some(&other.public()),
        )
        .await;
        assert!(matches!(refused, Err(Refusal::WrongKey)));
    });
}

/// With a cluster secret, an endpoint naming no key is not dialed by
/// default (counted; the source never hears of it); a runner that allows
/// keyless sources dials it as before.
#[rstest]
#[case::refused_by_default(KeylessSources::RefusedWithSecret, false)]
#[case::refused(KeylessSources::Refused, false)]
#[case::allowed(KeylessSources::Allowed, true)]
fn a_keyless_source_follows_the_policy(#[case] policy: KeylessSources, #[case] dialed: bool) {
    runtime().block_on(async {
        let mut target = Node::start_with(Some(SECRET), quick_limits(), policy).await;
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        let keyless = source.identity.endpoint.with_key(None);
        target.channel.send(&keyless, &probe(1));
        if dialed {
            let got = source.message().await.unwrap();
            assert_eq!(got.body, probe(1).body);
            assert_eq!(target.stat(|s| &s.sources_keyless_refused), 0);
        } else {
            assert!(matches!(
                target.event(Duration::from_secs(5)).await,
                Some(ChannelEvent::SourceLost(lost)) if lost == keyless
            ));
            assert_eq!(target.stat(|s| &s.sources_keyless_refused), 1);
            assert!(source.event(Duration::from_millis(300)).await.is_none());
            assert_eq!(source.stat(|s| &s.refused_handshakes), 0, "never dialed");
        }
    });
}

/// Without a secret (loopback only) the default dials keyless endpoints.
#[test]
fn without_a_secret_keyless_sources_are_dialed_by_default() {
    runtime().block_on(async {
        let mut target = Node::start(None, quick_limits()).await;
        let mut source = Node::start(None, quick_limits()).await;
        target
            .channel
            .send(&source.identity.endpoint.with_key(None), &probe(1));
        assert_eq!(source.message().await.unwrap().body, probe(1).body);
    });
}

/// A member claiming another member's keyed endpoint is refused (counted)
/// and nothing it sends arrives; claiming the same address without a key
/// makes it another identity (its own key), which leaves the honest
/// member's session in place: replies still reach it.
#[test]
fn a_member_cannot_claim_another_members_identity() {
    runtime().block_on(async {
        let mut target = Node::start(Some(SECRET), quick_limits()).await;
        let mut source = Node::start(Some(SECRET), quick_limits()).await;
        let honest = target.identity.endpoint.clone();
        target.channel.send(&source.identity.endpoint, &probe(1));
        assert_eq!(source.message().await.unwrap().body, probe(1).body);
        let (impostor, _inbound) = Node::start(Some(SECRET), quick_limits())
            .await
            .channel_parts();
        // Claims the honest target's endpoint, key and all.
        let claim = PeerIdentity {
            endpoint: honest.clone(),
            incarnation: Incarnation::generate(),
        };
        let me = super::session::LocalMember {
            key: &impostor.static_key,
            identity: &claim,
        };
        let mut stream = TcpStream::connect(source.addr).await.unwrap();
        let (mut transport, _) = initiate(&mut stream, &impostor.psk, &me, None)
            .await
            .unwrap();
        send_sealed(&mut stream, &mut transport, &probe(66)).await;
        assert!(closed_by_peer(&mut stream).await);
        assert_eq!(source.stat(|s| &s.claims_refused), 1);
        // Claims the address alone: accepted as itself.
        let claim = PeerIdentity {
            endpoint: honest.with_key(None),
            incarnation: Incarnation::generate(),
        };
        let me = super::session::LocalMember {
            key: &impostor.static_key,
            identity: &claim,
        };
        let mut stream = TcpStream::connect(source.addr).await.unwrap();
        let (mut transport, _) = initiate(&mut stream, &impostor.psk, &me, None)
            .await
            .unwrap();
        send_sealed(&mut stream, &mut transport, &probe(67)).await;
        let got = source.message().await.unwrap();
        assert_eq!(got.body, probe(67).body);
        assert_eq!(
            got.header.sender_endpoint,
            honest.with_key(Some(impostor.static_key.public())),
            "stamped with the key it proved"
        );
        assert_ne!(got.header.sender_endpoint, honest);
        // The honest target's session was not replaced: a reply reaches it.
        let dropped = source.stat(|s| &s.dropped);
        source.channel.send(&honest, &done(9));
        assert_eq!(source.stat(|s| &s.dropped), dropped);
        assert_eq!(target.message().await.unwrap().body, done(9).body);
    });
}
