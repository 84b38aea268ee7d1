//! The peer control channel: length-prefixed frames (the foundation codec) over
//! tokio TCP.
//!
//! * One listener; every accepted connection is read by its own task, which
//!   decodes frames and forwards messages to one bounded inbound queue.
//! * One outgoing connection per peer endpoint, created on first send, cached,
//!   fed by a bounded queue; a failed connect or write closes the socket and
//!   forgets the peer (the next send dials again); [`ControlChannel::remove_peer`]
//!   closes it at once. [`ControlChannel::open_sockets`] counts live sockets.
//!   The writer also watches its socket for the peer closing it (the peer
//!   never sends on this connection, so any read that returns means closed):
//!   the peer is then reported through [`ControlChannel::take_lost`], so the
//!   core re-handshakes before naming that peer's incarnation again (a process
//!   restarted at the same address is asked as itself, not as the dead one).
//! * Optional shared-secret handshake (HMAC-SHA256 challenge and response in
//!   both directions) before any frame: a process without the cluster token
//!   cannot talk to a runner.
//! * Nothing here blocks the runner: full queues drop (and count) messages;
//!   the protocol's deadlines and probes recover.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use kvcr_contracts::endpoint::{ControlEndpoint, Host};
use kvcr_contracts::protocol::Message;
use kvcr_contracts::protocol::codec::FrameCodec;

/// Bound of each outgoing queue and of the inbound queue.
pub(crate) const QUEUE_DEPTH: usize = 4096;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
const PREAMBLE: &[u8; 6] = b"KVCRC1";
const NONCE: usize = 16;
const TAG: usize = 32;

/// Counters shared by the channel's tasks.
#[derive(Debug, Default)]
pub(crate) struct ControlStats {
    /// Sockets currently open (accepted and dialed).
    pub(crate) open_sockets: AtomicUsize,
    /// Messages dropped because a queue was full.
    pub(crate) dropped: AtomicU64,
    /// Frames that did not decode (the connection is closed).
    pub(crate) bad_frames: AtomicU64,
    /// Handshakes refused (wrong or missing token).
    pub(crate) refused_handshakes: AtomicU64,
}

/// Decrements the open-socket count when a connection task ends.
struct SocketGuard(Arc<ControlStats>);

impl SocketGuard {
    fn new(stats: &Arc<ControlStats>) -> Self {
        stats.open_sockets.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(stats))
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.0.open_sockets.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The channel's handle (used on the peer thread, inside its runtime).
pub(crate) struct ControlChannel {
    peers: HashMap<ControlEndpoint, mpsc::Sender<Message>>,
    lost_tx: mpsc::UnboundedSender<ControlEndpoint>,
    lost_rx: mpsc::UnboundedReceiver<ControlEndpoint>,
    secret: Option<Arc<[u8]>>,
    codec: FrameCodec,
    pub(crate) stats: Arc<ControlStats>,
}

impl ControlChannel {
    /// Binds `addr` and starts accepting. Returns the channel, the bound
    /// address, and the receiver of inbound messages.
    pub(crate) async fn bind(
        addr: SocketAddr,
        secret: Option<Arc<[u8]>>,
    ) -> std::io::Result<(Self, SocketAddr, mpsc::Receiver<Message>)> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let (inbound, inbound_rx) = mpsc::channel(QUEUE_DEPTH);
        let stats = Arc::new(ControlStats::default());
        let codec = FrameCodec::default();
        tokio::spawn(accept_loop(
            listener,
            inbound.clone(),
            secret.clone(),
            codec,
            Arc::clone(&stats),
        ));
        let (lost_tx, lost_rx) = mpsc::unbounded_channel();
        Ok((
            Self {
                peers: HashMap::new(),
                lost_tx,
                lost_rx,
                secret,
                codec,
                stats,
            },
            local,
            inbound_rx,
        ))
    }

    /// Queues `message` for `to`, dialing on first use. Never blocks; a full
    /// queue drops the message (counted).
    pub(crate) fn send(&mut self, to: &ControlEndpoint, message: Message) {
        let closed = self.peers.get(to).is_none_or(mpsc::Sender::is_closed);
        if closed {
            let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
            tokio::spawn(outgoing(
                to.clone(),
                rx,
                self.secret.clone(),
                self.codec,
                Arc::clone(&self.stats),
                self.lost_tx.clone(),
            ));
            self.peers.insert(to.clone(), tx);
        }
        let Some(tx) = self.peers.get(to) else { return };
        if tx.try_send(message).is_err() {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Peers whose outgoing connection was closed by the other side (or
    /// failed a write) since the last call.
    pub(crate) fn take_lost(&mut self) -> Vec<ControlEndpoint> {
        let mut lost = Vec::new();
        while let Ok(peer) = self.lost_rx.try_recv() {
            lost.push(peer);
        }
        lost
    }

    /// Forgets a peer and closes its outgoing socket.
    pub(crate) fn remove_peer(&mut self, peer: &ControlEndpoint) {
        // Dropping the sender ends the writer task, which closes the socket.
        self.peers.remove(peer);
    }

    /// Sockets currently open.
    #[cfg(test)]
    pub(crate) fn open_sockets(&self) -> usize {
        self.stats.open_sockets.load(Ordering::Relaxed)
    }
}

async fn accept_loop(
    listener: TcpListener,
    inbound: mpsc::Sender<Message>,
    secret: Option<Arc<[u8]>>,
    codec: FrameCodec,
    stats: Arc<ControlStats>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(incoming(
            stream,
            inbound.clone(),
            secret.clone(),
            codec,
            Arc::clone(&stats),
        ));
        if inbound.is_closed() {
            return;
        }
    }
}

async fn incoming(
    mut stream: TcpStream,
    inbound: mpsc::Sender<Message>,
    secret: Option<Arc<[u8]>>,
    codec: FrameCodec,
    stats: Arc<ControlStats>,
) {
    let _guard = SocketGuard::new(&stats);
    let shaken = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        accept_handshake(&mut stream, secret.as_deref()),
    )
    .await;
    if !matches!(shaken, Ok(Ok(true))) {
        stats.refused_handshakes.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let mut buf = BytesMut::with_capacity(64 << 10);
    loop {
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(message)) => {
                    if inbound.try_send(message).is_err() {
                        stats.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    // A peer that sends garbage loses its connection; the
                    // runner keeps serving everyone else.
                    stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
        match stream.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

async fn outgoing(
    to: ControlEndpoint,
    mut rx: mpsc::Receiver<Message>,
    secret: Option<Arc<[u8]>>,
    codec: FrameCodec,
    stats: Arc<ControlStats>,
    lost: mpsc::UnboundedSender<ControlEndpoint>,
) {
    let Some(mut stream) = dial(&to).await else {
        return; // dropping `rx` marks this peer closed; the next send re-dials
    };
    let _guard = SocketGuard::new(&stats);
    let _ = stream.set_nodelay(true);
    let shaken = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        dial_handshake(&mut stream, secret.as_deref()),
    )
    .await;
    if !matches!(shaken, Ok(Ok(true))) {
        stats.refused_handshakes.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let mut buf = BytesMut::with_capacity(64 << 10);
    let (mut reader, mut writer) = stream.split();
    let mut probe = [0u8; 64];
    loop {
        let message = tokio::select! {
            message = rx.recv() => match message {
                Some(message) => message,
                None => return, // forgotten or the channel is gone
            },
            // The peer never writes here: a returning read is EOF or an error
            // (or a peer speaking out of turn), i.e. this connection is over.
            _ = reader.read(&mut probe) => {
                let _ = lost.send(to.clone());
                return;
            }
        };
        buf.clear();
        if codec.encode(&message, &mut buf).is_err() {
            stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        // Batch whatever else is queued into the same write.
        while let Ok(more) = rx.try_recv() {
            if codec.encode(&more, &mut buf).is_err() {
                stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
        if writer.write_all(&buf).await.is_err() {
            let _ = lost.send(to.clone());
            return;
        }
    }
}

async fn dial(to: &ControlEndpoint) -> Option<TcpStream> {
    let target = match to.host() {
        Host::Ip(ip) => format!("{}", SocketAddr::new(*ip, to.port())),
        Host::Name(name) => format!("{name}:{}", to.port()),
    };
    tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
        .await
        .ok()?
        .ok()
}

type HmacSha256 = Hmac<Sha256>;

fn tag(secret: &[u8], label: &[u8], first: &[u8], second: &[u8]) -> Option<[u8; TAG]> {
    let mut mac = HmacSha256::new_from_slice(secret).ok()?;
    mac.update(label);
    mac.update(first);
    mac.update(second);
    Some(mac.finalize().into_bytes().into())
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    // A nonce only has to be fresh; if the OS source fails, the incarnation
    // generator's fallback is good enough for uniqueness.
    if getrandom::fill(&mut n).is_err() {
        n = kvcr_contracts::incarnation::Incarnation::generate()
            .raw()
            .to_be_bytes();
    }
    n
}

/// Dialer side: `PREAMBLE, flag, nonce_d` → `nonce_a, tag_a` → `tag_d`.
async fn dial_handshake(stream: &mut TcpStream, secret: Option<&[u8]>) -> std::io::Result<bool> {
    let ours = nonce();
    let mut hello = Vec::with_capacity(PREAMBLE.len() + 1 + NONCE);
    hello.extend_from_slice(PREAMBLE);
    hello.push(u8::from(secret.is_some()));
    hello.extend_from_slice(&ours);
    stream.write_all(&hello).await?;
    let Some(secret) = secret else {
        let mut ok = [0u8; 1];
        stream.read_exact(&mut ok).await?;
        return Ok(ok == [1]);
    };
    let mut reply = [0u8; NONCE + TAG];
    stream.read_exact(&mut reply).await?;
    let (theirs, their_tag) = reply.split_at(NONCE);
    let expected = tag(secret, b"acceptor", &ours, theirs);
    if expected.as_ref().map(<[u8; TAG]>::as_slice) != Some(their_tag) {
        return Ok(false);
    }
    let Some(mine) = tag(secret, b"dialer", theirs, &ours) else {
        return Ok(false);
    };
    stream.write_all(&mine).await?;
    Ok(true)
}

/// Acceptor side of [`dial_handshake`]. Without a secret, accepts only dialers
/// without one (and says so with a single byte).
async fn accept_handshake(stream: &mut TcpStream, secret: Option<&[u8]>) -> std::io::Result<bool> {
    let mut hello = [0u8; PREAMBLE.len() + 1 + NONCE];
    stream.read_exact(&mut hello).await?;
    let (preamble, rest) = hello.split_at(PREAMBLE.len());
    let (flag, theirs) = rest.split_at(1);
    if preamble != PREAMBLE {
        return Ok(false);
    }
    let Some(secret) = secret else {
        let ok = flag == [0];
        stream.write_all(&[u8::from(ok)]).await?;
        return Ok(ok);
    };
    if flag != [1] {
        return Ok(false);
    }
    let ours = nonce();
    let Some(mine) = tag(secret, b"acceptor", theirs, &ours) else {
        return Ok(false);
    };
    let mut reply = Vec::with_capacity(NONCE + TAG);
    reply.extend_from_slice(&ours);
    reply.extend_from_slice(&mine);
    stream.write_all(&reply).await?;
    let mut their_tag = [0u8; TAG];
    stream.read_exact(&mut their_tag).await?;
    Ok(tag(secret, b"dialer", &ours, theirs) == Some(their_tag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcr_contracts::incarnation::Incarnation;
    use kvcr_contracts::protocol::{Body, Header, OpHandle, RouteGeneration};

    fn message(op: u64) -> Message {
        Message {
            header: Header {
                sender: Incarnation::generate(),
                route_generation: RouteGeneration(0),
                sender_endpoint: ControlEndpoint::parse("tcp://127.0.0.1:9").unwrap(),
            },
            body: Body::WriteRefused {
                op_handle: OpHandle(op),
            },
        }
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn endpoint(addr: SocketAddr) -> ControlEndpoint {
        ControlEndpoint::parse(&format!("tcp://{addr}")).unwrap()
    }

    async fn recv(rx: &mut mpsc::Receiver<Message>) -> Option<Message> {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .ok()
            .flatten()
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

    /// A peer that closes the connection (a process that died) is reported
    /// lost, and the next send dials a fresh connection.
    #[test]
    fn a_closed_connection_is_reported_lost() {
        runtime().block_on(async {
            let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
            let (mut a, _, _) = ControlChannel::bind(local, None).await.unwrap();
            let listener = TcpListener::bind(local).await.unwrap();
            let to = endpoint(listener.local_addr().unwrap());
            a.send(&to, message(1));
            let (mut peer, _) = listener.accept().await.unwrap();
            assert!(accept_handshake(&mut peer, None).await.unwrap());
            assert!(a.take_lost().is_empty(), "nothing lost while it is open");
            drop(peer);
            let mut lost = Vec::new();
            for _ in 0..500 {
                lost = a.take_lost();
                if !lost.is_empty() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            assert_eq!(lost, vec![to.clone()]);
            assert_eq!(settle(&a, 0).await, 0, "the dead socket is closed");
            a.send(&to, message(2));
            let (_again, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
                .await
                .unwrap()
                .unwrap();
        });
    }

    #[test]
    fn messages_arrive_in_order_and_sockets_close_on_removal() {
        runtime().block_on(async {
            let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
            let (mut a, _, _) = ControlChannel::bind(local, None).await.unwrap();
            let (b, b_addr, mut b_rx) = ControlChannel::bind(local, None).await.unwrap();
            let to = endpoint(b_addr);
            for op in 0..100 {
                a.send(&to, message(op));
            }
            for op in 0..100 {
                assert_eq!(recv(&mut b_rx).await.unwrap().body, message(op).body);
            }
            assert_eq!(settle(&a, 1).await, 1, "one dialed socket at a");
            assert_eq!(settle(&b, 1).await, 1, "one accepted socket at b");
            a.remove_peer(&to);
            assert_eq!(
                settle(&a, 0).await,
                0,
                "removing the peer closes its socket"
            );
            assert_eq!(settle(&b, 0).await, 0, "and the far end sees it close");
            // Sending again re-dials.
            a.send(&to, message(7));
            assert_eq!(recv(&mut b_rx).await.unwrap().body, message(7).body);
        });
    }

    #[test]
    fn a_process_without_the_token_cannot_talk() {
        runtime().block_on(async {
            let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
            let secret: Arc<[u8]> = Arc::from(&b"cluster-token"[..]);
            let wrong: Arc<[u8]> = Arc::from(&b"other-token"[..]);
            let (b, b_addr, mut b_rx) = ControlChannel::bind(local, Some(Arc::clone(&secret)))
                .await
                .unwrap();
            let to = endpoint(b_addr);
            for (name, token) in [("no token", None), ("wrong token", Some(wrong))] {
                let (mut intruder, _, _) = ControlChannel::bind(local, token).await.unwrap();
                intruder.send(&to, message(1));
                let got = tokio::time::timeout(Duration::from_millis(300), b_rx.recv()).await;
                assert!(got.is_err(), "{name}: a message got through");
            }
            assert!(b.stats.refused_handshakes.load(Ordering::Relaxed) >= 2);
            let (mut friend, _, _) = ControlChannel::bind(local, Some(secret)).await.unwrap();
            friend.send(&to, message(2));
            assert_eq!(recv(&mut b_rx).await.unwrap().body, message(2).body);
        });
    }

    #[test]
    fn garbage_closes_only_that_connection() {
        runtime().block_on(async {
            let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
            let (b, b_addr, mut b_rx) = ControlChannel::bind(local, None).await.unwrap();
            let mut raw = TcpStream::connect(b_addr).await.unwrap();
            let mut hello = PREAMBLE.to_vec();
            hello.push(0);
            hello.extend_from_slice(&[0u8; NONCE]);
            raw.write_all(&hello).await.unwrap();
            raw.write_all(&[0, 0, 0, 8, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5])
                .await
                .unwrap();
            let mut sink = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut sink)).await;
            assert_eq!(b.stats.bad_frames.load(Ordering::Relaxed), 1);
            let (mut a, _, _) = ControlChannel::bind(local, None).await.unwrap();
            a.send(&endpoint(b_addr), message(3));
            assert_eq!(
                recv(&mut b_rx).await.unwrap().body,
                message(3).body,
                "still serving"
            );
        });
    }
}
