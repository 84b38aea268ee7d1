//! The Noise session: where a control connection's keys, identities and
//! records live.
//!
//! Every control connection starts with a Noise `XXpsk0` handshake
//! ([`initiate`] on the dialer, [`respond`] on the acceptor after the
//! listener read the preamble) under a pre-shared key derived from the
//! cluster secret ([`psk`]), in which each side proves its static member key
//! ([`StaticKey`]). The acceptor's [`PeerIdentity`] travels in the
//! handshake's second message, the dialer's in the third; each is bound to
//! the static key its sender proved (a dialer's claimed endpoint carries
//! that key, see [`respond`]; a dialer checks the acceptor's key against the
//! one the dialed endpoint names, see [`initiate`]). After it, every byte is
//! a Noise transport record ([`seal`], [`open_records`]), and
//! [`run_session`] moves frames both ways until either side ends the
//! session, the peer misbehaves or a deadline passes. [`dial_session`] is
//! the task of a session we dial. See the module documentation of
//! [`crate::net`] for what the session guarantees.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use kvcr_contracts::MemberKey;
use kvcr_contracts::endpoint::{ControlEndpoint, Host};
use kvcr_contracts::incarnation::Incarnation;

use super::channel::{Inbound, Link, SessionOut, Shared, Side};
use super::limits::{BUDGET_UNIT, SocketGuard};
use super::member::StaticKey;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Sent by the dialer before the handshake: names the protocol and version
/// (N2: static member keys).
pub(super) const PREAMBLE: &[u8; 8] = b"KVCR-N2\0";
/// `psk0`: the secret is mixed in before the first message, so a process
/// without it is refused at that message and learns nothing, not even the
/// acceptor's static key.
const NOISE_PARAMS: &str = "Noise_XXpsk0_25519_ChaChaPoly_BLAKE2s";
const PROLOGUE: &[u8] = b"kvcr control channel v2";
/// Largest Noise message (record ciphertext).
pub(crate) const RECORD_MAX: usize = 65_535;
/// Bytes of the tag on each sealed record.
pub(super) const TAG_LEN: usize = 16;
/// Largest plaintext per record.
pub(super) const RECORD_PLAIN_MAX: usize = RECORD_MAX - TAG_LEN;
/// Handshake messages and the identity record are small; anything larger is
/// refused before it is buffered.
const HANDSHAKE_MESSAGE_MAX: usize = 1024;

/// Who is at the other end of a session, as the session proved it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerIdentity {
    /// The peer's control endpoint.
    pub(crate) endpoint: ControlEndpoint,
    /// The peer's incarnation.
    pub(crate) incarnation: Incarnation,
}

impl PeerIdentity {
    fn encode(&self) -> Vec<u8> {
        let endpoint = self.endpoint.to_string();
        let mut out = Vec::with_capacity(16 + endpoint.len());
        out.extend_from_slice(&self.incarnation.raw().to_be_bytes());
        out.extend_from_slice(endpoint.as_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let (raw, endpoint) = bytes.split_at_checked(16)?;
        let incarnation = Incarnation::from_raw(u128::from_be_bytes(raw.try_into().ok()?))?;
        let endpoint = ControlEndpoint::parse(std::str::from_utf8(endpoint).ok()?).ok()?;
        Some(Self {
            endpoint,
            incarnation,
        })
    }
}

/// The Noise pre-shared key for a cluster secret. Without a secret the key is
/// public (loopback-only mode).
pub(crate) fn psk(secret: Option<&[u8]>) -> [u8; 32] {
    let mut hash = Sha256::new();
    match secret {
        Some(secret) => {
            hash.update(b"kvcr cluster secret v1\0");
            hash.update(secret);
        }
        None => hash.update(b"kvcr: no cluster secret (loopback only)\0"),
    }
    hash.finalize().into()
}

fn builder<'a>(psk: &'a [u8; 32], key: &'a StaticKey) -> Option<snow::Builder<'a>> {
    let params = NOISE_PARAMS.parse().ok()?;
    snow::Builder::new(params)
        .prologue(PROLOGUE)
        .ok()?
        .psk(0, psk)
        .ok()?
        .local_private_key(key.private())
        .ok()
}

/// Why a handshake did not give a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No or another secret, garbage, a replay, too large, or the peer left.
    Handshake,
    /// The acceptor proved another static key than the dialed endpoint
    /// names.
    WrongKey,
    /// The dialer claimed an endpoint naming another key than it proved.
    ForeignClaim,
}

/// What a runner's end of a handshake proves and says: its static key and
/// its identity (whose endpoint names that key).
pub(crate) struct LocalMember<'a> {
    pub(crate) key: &'a StaticKey,
    pub(crate) identity: &'a PeerIdentity,
}

/// The remote static key a finished handshake state proved.
fn remote_key(handshake: &snow::HandshakeState) -> Option<MemberKey> {
    let bytes: [u8; 32] = handshake.get_remote_static()?.try_into().ok()?;
    MemberKey::from_bytes(bytes)
}

pub(super) async fn dial_session(
    to: ControlEndpoint,
    id: u64,
    out: Arc<SessionOut>,
    shared: Arc<Shared>,
) {
    let mut peer = PeerIdentity {
        endpoint: to.clone(),
        incarnation: shared.identity.incarnation,
    };
    let keyless_allowed = shared.keyless_sources.allowed(shared.secret_set);
    if to.key().is_none() && !keyless_allowed {
        // Nobody was named to answer there: we do not ask whoever does.
        shared
            .stats
            .sources_keyless_refused
            .fetch_add(1, Ordering::Relaxed);
    } else if let Some(mut stream) = dial(&to).await {
        let _socket = SocketGuard::new(&shared.stats);
        let _ = stream.set_nodelay(true);
        let me = LocalMember {
            key: &shared.static_key,
            identity: &shared.identity,
        };
        let handshake = tokio::time::timeout(
            shared.limits.handshake_timeout,
            initiate(&mut stream, &shared.psk, &me, to.key()),
        )
        .await;
        if let Ok(Ok((transport, answered))) = handshake {
            // The endpoint is the one we dialed (the name the core uses); the
            // incarnation is whoever answered there.
            peer.incarnation = answered.incarnation;
            let stream = Arc::new(stream);
            {
                // Established: what was sent meanwhile leaves first, in order.
                let mut state = out.lock();
                state.link = Some(Link {
                    stream: Arc::clone(&stream),
                    transport,
                });
                state.seal_queued();
                state.write_now();
            }
            let opened = Inbound::Opened {
                session: id,
                side: Side::Dialed,
                peer: peer.clone(),
                out: None,
            };
            if shared.inbound.send(opened).is_ok() {
                run_session(&stream, (id, Side::Dialed), &peer, &out, &shared).await;
            }
        } else {
            if let Ok(Err(Refusal::WrongKey)) = handshake {
                shared
                    .stats
                    .sources_wrong_key
                    .fetch_add(1, Ordering::Relaxed);
            }
            shared
                .stats
                .refused_handshakes
                .fetch_add(1, Ordering::Relaxed);
        }
    }
    out.close();
    let _ = shared.inbound.send(Inbound::Closed {
        session: id,
        side: Side::Dialed,
        peer,
    });
}

/// Connects to a peer's control endpoint within `CONNECT_TIMEOUT`.
pub(crate) async fn dial(to: &ControlEndpoint) -> Option<TcpStream> {
    let target = match to.host() {
        Host::Ip(ip) => format!("{}", SocketAddr::new(*ip, to.port())),
        Host::Name(name) => format!("{name}:{}", to.port()),
    };
    tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
        .await
        .ok()?
        .ok()
}

async fn write_record(stream: &mut TcpStream, record: &[u8]) -> Option<()> {
    let len = u16::try_from(record.len()).ok()?;
    let mut out = Vec::with_capacity(2 + record.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(record);
    stream.write_all(&out).await.ok()
}

/// Reads one length-prefixed record of at most `max` bytes.
async fn read_small_record(stream: &mut TcpStream, max: usize) -> Option<Vec<u8>> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await.ok()?;
    let len = usize::from(u16::from_be_bytes(len));
    if len > max {
        return None;
    }
    let mut record = vec![0u8; len];
    stream.read_exact(&mut record).await.ok()?;
    Some(record)
}

/// Dialer: `PREAMBLE`, handshake message 1 → message 2 (the acceptor's
/// static key and identity) → message 3 (ours). When `expected` names a key,
/// an acceptor that proves another is refused before we say who we are.
pub(crate) async fn initiate(
    stream: &mut TcpStream,
    psk: &[u8; 32],
    me: &LocalMember<'_>,
    expected: Option<&MemberKey>,
) -> Result<(snow::TransportState, PeerIdentity), Refusal> {
    let fail = Refusal::Handshake;
    let mut handshake = builder(psk, me.key)
        .and_then(|b| b.build_initiator().ok())
        .ok_or(fail)?;
    let mut buf = vec![0u8; HANDSHAKE_MESSAGE_MAX];
    let len = handshake.write_message(&[], &mut buf).map_err(|_| fail)?;
    stream.write_all(PREAMBLE).await.map_err(|_| fail)?;
    write_record(stream, buf.get(..len).ok_or(fail)?)
        .await
        .ok_or(fail)?;
    let reply = read_small_record(stream, HANDSHAKE_MESSAGE_MAX)
        .await
        .ok_or(fail)?;
    let mut payload = vec![0u8; HANDSHAKE_MESSAGE_MAX];
    let n = handshake
        .read_message(&reply, &mut payload)
        .map_err(|_| fail)?;
    let proved = remote_key(&handshake).ok_or(fail)?;
    if expected.is_some_and(|key| *key != proved) {
        return Err(Refusal::WrongKey);
    }
    let acceptor = PeerIdentity::decode(payload.get(..n).ok_or(fail)?).ok_or(fail)?;
    let n = handshake
        .write_message(&me.identity.encode(), &mut buf)
        .map_err(|_| fail)?;
    write_record(stream, buf.get(..n).ok_or(fail)?)
        .await
        .ok_or(fail)?;
    let transport = handshake.into_transport_mode().map_err(|_| fail)?;
    Ok((transport, acceptor))
}

/// Acceptor side of [`initiate`] (after its `PREAMBLE`). The dialer's
/// identity is bound to the static key it proved: its claimed endpoint
/// carries that key (added when the claim names none; a claim naming
/// another key is refused), so a member can speak only as itself.
pub(super) async fn respond(
    stream: &mut TcpStream,
    psk: &[u8; 32],
    me: &LocalMember<'_>,
) -> Result<(snow::TransportState, PeerIdentity), Refusal> {
    let fail = Refusal::Handshake;
    let mut handshake = builder(psk, me.key)
        .and_then(|b| b.build_responder().ok())
        .ok_or(fail)?;
    let first = read_small_record(stream, HANDSHAKE_MESSAGE_MAX)
        .await
        .ok_or(fail)?;
    let mut payload = vec![0u8; HANDSHAKE_MESSAGE_MAX];
    // Fails unless the dialer knows the secret (the message is sealed under it).
    handshake
        .read_message(&first, &mut payload)
        .map_err(|_| fail)?;
    let mut buf = vec![0u8; HANDSHAKE_MESSAGE_MAX];
    let len = handshake
        .write_message(&me.identity.encode(), &mut buf)
        .map_err(|_| fail)?;
    write_record(stream, buf.get(..len).ok_or(fail)?)
        .await
        .ok_or(fail)?;
    // Only the dialer holding this handshake's ephemeral key can produce
    // the third message: a replayed first message stops here.
    let third = read_small_record(stream, HANDSHAKE_MESSAGE_MAX)
        .await
        .ok_or(fail)?;
    let n = handshake
        .read_message(&third, &mut payload)
        .map_err(|_| fail)?;
    let proved = remote_key(&handshake).ok_or(fail)?;
    let mut dialer = PeerIdentity::decode(payload.get(..n).ok_or(fail)?).ok_or(fail)?;
    match dialer.endpoint.key() {
        Some(claimed) if *claimed != proved => return Err(Refusal::ForeignClaim),
        Some(_) => {}
        None => dialer.endpoint = dialer.endpoint.with_key(Some(proved)),
    }
    let transport = handshake.into_transport_mode().map_err(|_| fail)?;
    Ok((transport, dialer))
}

/// Why a session ended (for counters).
enum End {
    Closed,
    Bad,
    TimedOut,
}

/// Moves frames both ways on an established session until either side ends
/// it, the peer misbehaves, or a deadline passes: reads, decrypts and hands
/// on what arrives, and writes what the sender's turn left unwritten.
pub(super) async fn run_session(
    stream: &TcpStream,
    (session, side): (u64, Side),
    peer: &PeerIdentity,
    out: &SessionOut,
    shared: &Shared,
) {
    let limits = shared.limits;
    let budget = Arc::new(Semaphore::new(
        limits.inbound_bytes_per_session / BUDGET_UNIT,
    ));
    let mut raw = BytesMut::with_capacity(RECORD_MAX + 2);
    let mut plain = BytesMut::new();
    let mut scratch = vec![0u8; RECORD_MAX];
    let mut last_active = Instant::now();
    let mut partial_since: Option<Instant> = None;
    let end = loop {
        let (closed, unwritten_since) = {
            let mut state = out.lock();
            state.write_now();
            (state.closed, state.pending_since)
        };
        if closed {
            break End::Closed;
        }
        let read_deadline = match (partial_since, side) {
            (Some(since), _) => since + limits.frame_deadline,
            (None, Side::Accepted) => last_active + limits.idle_timeout,
            // Our own dialed sessions live as long as we keep them.
            (None, Side::Dialed) => last_active + Duration::from_secs(86_400),
        };
        let deadline = match unwritten_since {
            Some(since) => read_deadline.min(since + limits.frame_deadline),
            None => read_deadline,
        };
        tokio::select! {
            // More to write, or the session was dropped: go round.
            () = out.wake.notified() => {}
            writable = stream.writable(), if unwritten_since.is_some() => {
                if writable.is_err() {
                    break End::Closed;
                }
            }
            readable = stream.readable() => {
                if readable.is_err() {
                    break End::Closed;
                }
                match stream.try_read_buf(&mut raw) {
                    Ok(0) => break End::Closed,
                    Ok(n) => crate::timeline::mark("session_read", n as u64),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => break End::Closed,
                }
                last_active = Instant::now();
                let opened = {
                    let mut state = out.lock();
                    match state.link.as_mut() {
                        Some(link) => {
                            open_records(&mut link.transport, &mut raw, &mut scratch, &mut plain)
                        }
                        None => None,
                    }
                };
                if opened.is_none() {
                    break End::Bad;
                }
                match deliver(&mut plain, (session, side), peer, &budget, shared).await {
                    Some(()) => crate::timeline::mark("session_delivered", 0),
                    None => break End::Bad,
                }
                partial_since = if raw.is_empty() && plain.is_empty() {
                    None
                } else {
                    partial_since.or(Some(last_active))
                };
            }
            () = tokio::time::sleep_until(deadline) => {
                if unwritten_since.is_some_and(|since| Instant::now() >= since + limits.frame_deadline) {
                    break End::TimedOut;
                }
                if Instant::now() >= read_deadline {
                    break End::TimedOut;
                }
            }
        }
    };
    out.close();
    match end {
        End::Closed => {}
        End::Bad => {
            shared.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
        }
        End::TimedOut => {
            shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Encrypts `plain` into length-prefixed records appended to `wire`.
pub(crate) fn seal(
    transport: &mut snow::TransportState,
    plain: &[u8],
    sealed: &mut [u8],
    wire: &mut BytesMut,
) -> Option<()> {
    for chunk in plain.chunks(RECORD_PLAIN_MAX) {
        let n = transport.write_message(chunk, sealed).ok()?;
        wire.put_u16(u16::try_from(n).ok()?);
        wire.extend_from_slice(sealed.get(..n)?);
    }
    Some(())
}

/// Decrypts every complete record at the front of `raw` onto `plain`.
/// `None`: a record failed to decrypt (forged, replayed or corrupted).
pub(crate) fn open_records(
    transport: &mut snow::TransportState,
    raw: &mut BytesMut,
    scratch: &mut [u8],
    plain: &mut BytesMut,
) -> Option<()> {
    loop {
        let Some(&[high, low]) = raw.get(..2) else {
            return Some(());
        };
        let len = usize::from(u16::from_be_bytes([high, low]));
        if raw.len() < 2 + len {
            return Some(());
        }
        raw.advance(2);
        let record = raw.split_to(len);
        let n = transport.read_message(&record, scratch).ok()?;
        plain.extend_from_slice(scratch.get(..n)?);
    }
}

/// Decodes every complete frame in `plain` and hands it to the peer thread
/// with the session's identity; waits for inbound budget when the runner is
/// behind. `None`: a frame did not decode or came in the wrong direction.
async fn deliver(
    plain: &mut BytesMut,
    (session, side): (u64, Side),
    peer: &PeerIdentity,
    budget: &Arc<Semaphore>,
    shared: &Shared,
) -> Option<()> {
    loop {
        let len = plain.len();
        let Some(mut message) = shared.codec.decode(plain).ok()? else {
            return Some(());
        };
        if !side.admits(&message.body) {
            return None;
        }
        message.header.sender_endpoint = peer.endpoint.clone();
        message.header.sender = peer.incarnation;
        let consumed = len - plain.len();
        let units = u32::try_from(consumed.div_ceil(BUDGET_UNIT).max(1)).ok()?;
        let permit = Arc::clone(budget).acquire_many_owned(units).await.ok()?;
        shared
            .inbound
            .send(Inbound::Message {
                message,
                session,
                _budget: permit,
            })
            .ok()?;
    }
}
