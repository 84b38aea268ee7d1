//! A blocking client of a runner's control channel, for tools and tests that
//! speak the peer protocol by hand (the hostile-peer tests use it to act as
//! a cluster member that misbehaves).
//!
//! It runs the same authenticated handshake as a runner's dialer (so it needs
//! the cluster secret, or none for a runner without one), proves a static
//! member key of its own (fresh, or one it is given), presents the identity
//! it is given (naming its key when the endpoint names none; a claim naming
//! another member's key is refused by the runner), and then sends and
//! receives frames on that one session, as a target does. [`ControlClient::accept`] plays the other
//! side: a member a router hinted as a source, taking the session a target
//! dials and the [`DataStreamPeer`] it dials beside it, on whose frames
//! ([`seal_write_header`]) a misbehaving source can be tried. Nothing here
//! bypasses the runner's checks.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::listener::{self, Accepted};
use super::member::StaticKey;
use super::session::{self, LocalMember, PeerIdentity, RECORD_MAX};
use super::stream::StreamHello;
use crate::error::{Error, Result, RunnerReason};
use crate::wire::frame::{MAX_RECORD, seal_frame};
use crate::wire::part::Part;
use crate::wire::record::{RecordKey, SLOT_BYTES};
use crate::wire::sealing::{KeyInput, Sealer};
use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::codec::FrameCodec;
use kvcr_contracts::protocol::{Message, OpHandle};

/// One authenticated session to a runner, driven synchronously.
pub struct ControlClient {
    runtime: tokio::runtime::Runtime,
    stream: TcpStream,
    transport: snow::TransportState,
    codec: FrameCodec,
    raw: BytesMut,
    plain: BytesMut,
    scratch: Vec<u8>,
    peer: (ControlEndpoint, Incarnation),
    /// The endpoint we claimed (naming our key unless it named another).
    claimed: ControlEndpoint,
}

/// What a runner's connection to a hand-driven listener turned out to be.
pub enum Dialed {
    /// A control session (the handshake done, as the acceptor).
    Session(Box<ControlClient>),
    /// A data stream (its hello read and a challenge answered).
    DataStream(DataStreamPeer),
}

/// The acceptor's end of a data stream a target dialed: what it claimed,
/// the challenge it was sent, the proof it gave and the terms it asked for,
/// then a blocking socket on which frames go out as a data stream lays
/// them out (sealed once [keyed](DataStreamPeer::keyed), when the target
/// asked for sealed records).
pub struct DataStreamPeer {
    socket: std::net::TcpStream,
    hello: StreamHello,
    /// Boxed: a key schedule is large beside the rest.
    sealer: Option<Box<Sealer>>,
}

impl DataStreamPeer {
    /// The control endpoint the dialer claimed.
    pub fn claim(&self) -> &ControlEndpoint {
        &self.hello.claim
    }

    /// Whether the dialer asked for sealed records.
    pub fn asks_sealed(&self) -> bool {
        self.hello.terms.sealed
    }

    /// Whether the dialer's proof answers our challenge under `key` (a
    /// session's record key, as its target advertised it).
    pub fn proves(&self, key: &[u8; 32]) -> bool {
        let hello = &self.hello;
        RecordKey::new(key).verify_stream_proof(
            &hello.challenge,
            &hello.claim,
            &hello.terms,
            &hello.proof,
        )
    }

    /// Seals the frames sent from now on with the stream's key, derived
    /// from the session's record `key` (as an honest source does), when the
    /// dialer asked for sealed records; numbered from the stream's first.
    pub fn keyed(&mut self, key: &[u8; 32]) -> Result<()> {
        if !self.hello.terms.sealed {
            return Ok(());
        }
        let hello = &self.hello;
        let sealer = Sealer::new(&KeyInput {
            session_key: key,
            challenge: &hello.challenge,
            nonce: &hello.terms.nonce,
            claim: &hello.claim,
        })
        .ok_or(refused("could not derive the stream key"))?;
        self.sealer = Some(Box::new(sealer));
        Ok(())
    }

    /// A frame's bytes as they would go out next: its prefix claiming
    /// `len` payload bytes under `header`, then `payload` (which may be
    /// shorter or longer than `len`: how a source lies about a frame),
    /// sealed in records (each taking the next number) when keyed. Sending
    /// them later, twice or out of order is how a replay is tried.
    pub fn frame_bytes(
        &mut self,
        len: u64,
        header: &[u8; SLOT_BYTES],
        payload: &[u8],
    ) -> Result<Vec<u8>> {
        if self.hello.terms.sealed && self.sealer.is_none() {
            return Err(refused("a sealed stream sends nothing before it is keyed"));
        }
        let record = u32::try_from(MAX_RECORD).unwrap_or(u32::MAX);
        seal_frame(self.sealer.as_deref_mut(), len, record, header, payload)
            .ok_or(refused("the stream's record numbers ran out"))
    }

    /// Sends [`DataStreamPeer::frame_bytes`] of a frame.
    pub fn send_frame(
        &mut self,
        len: u64,
        header: &[u8; SLOT_BYTES],
        payload: &[u8],
    ) -> Result<()> {
        let bytes = self.frame_bytes(len, header, payload)?;
        self.send_raw(&bytes)
    }

    /// Sends `bytes` as they are.
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        use std::io::Write;
        self.socket
            .write_all(bytes)
            .map_err(|_| refused("write failed"))
    }

    /// Whether the target ends the stream within `wait` (reading and
    /// discarding whatever it sends, which an honest target never does).
    pub fn closed_by_peer(&mut self, wait: Duration) -> bool {
        use std::io::Read;
        let _ = self.socket.set_read_timeout(Some(wait));
        let mut sink = [0u8; 64];
        loop {
            match self.socket.read(&mut sink) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => {
                    return !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    );
                }
            }
        }
    }
}

/// A write message's header as a source seals it under a session's record
/// `key`: operation `op`, `keys` keys landed, part `index` of `count`.
/// `None` for a part that cannot be (`index >= count`, or more parts than a
/// write may have).
pub fn seal_write_header(
    key: &[u8; 32],
    op: OpHandle,
    keys: u32,
    index: u16,
    count: u16,
) -> Option<[u8; SLOT_BYTES]> {
    seal_write_header_digested(key, op, keys, index, count, None)
}

/// As [`seal_write_header`], carrying the write's `digest` (the digest of
/// its pages' digests, `kvcr_sys::combine_digests`).
pub fn seal_write_header_digested(
    key: &[u8; 32],
    op: OpHandle,
    keys: u32,
    index: u16,
    count: u16,
    digest: Option<u64>,
) -> Option<[u8; SLOT_BYTES]> {
    let part = Part::new(index, count)?;
    Some(RecordKey::new(key).seal_message_digested(op, keys, part, digest))
}

/// The UCX active message id a source sends its route-proof nonce with
/// (a member's own UCX worker accepts it to prove the worker is its own).
pub const ROUTE_PROOF_MESSAGE: u16 = crate::wire::route_proof::ROUTE_PROOF;

/// The nonce a route-proof message's `header` carries, to be handed back
/// as `Body::RouteProof` on the session the advert went on; `None` when
/// the header is not one.
pub fn route_proof_nonce(header: &[u8]) -> Option<[u8; 32]> {
    crate::wire::route_proof::NonceMessage::decode(header).map(|asked| asked.nonce)
}

fn refused(why: &'static str) -> Error {
    Error::runner(RunnerReason::Config {
        field: "control client",
        why,
    })
}

impl ControlClient {
    /// A runtime for one session, our identity (its endpoint naming `key`
    /// unless it names a key already) and the handshake's key.
    fn prepare(
        secret: Option<&[u8]>,
        endpoint: ControlEndpoint,
        incarnation: Incarnation,
        key: &StaticKey,
    ) -> Result<(tokio::runtime::Runtime, PeerIdentity, [u8; 32])> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|_| refused("could not start a runtime"))?;
        let endpoint = match endpoint.key() {
            Some(_) => endpoint,
            None => endpoint.with_key(Some(key.public())),
        };
        let identity = PeerIdentity {
            endpoint,
            incarnation,
        };
        Ok((runtime, identity, session::psk(secret)))
    }

    /// A session whose handshake is done, with `peer` on the other side.
    fn established(
        runtime: tokio::runtime::Runtime,
        (stream, transport): (TcpStream, snow::TransportState),
        peer: PeerIdentity,
        claimed: ControlEndpoint,
    ) -> Self {
        Self {
            runtime,
            stream,
            transport,
            codec: FrameCodec::default(),
            raw: BytesMut::new(),
            plain: BytesMut::new(),
            scratch: vec![0u8; RECORD_MAX],
            peer: (peer.endpoint, peer.incarnation),
            claimed,
        }
    }

    /// Dials `to` and completes the handshake as `endpoint`/`incarnation`,
    /// proving a fresh static key (a new member each time).
    pub fn connect(
        to: &ControlEndpoint,
        secret: Option<&[u8]>,
        endpoint: ControlEndpoint,
        incarnation: Incarnation,
    ) -> Result<Self> {
        Self::connect_as(to, secret, endpoint, incarnation, &StaticKey::generate()?)
    }

    /// [`Self::connect`] proving `key`. When `to` names a key, a runner
    /// that proves another is refused.
    pub fn connect_as(
        to: &ControlEndpoint,
        secret: Option<&[u8]>,
        endpoint: ControlEndpoint,
        incarnation: Incarnation,
        key: &StaticKey,
    ) -> Result<Self> {
        let (runtime, identity, psk) = Self::prepare(secret, endpoint, incarnation, key)?;
        let (stream, transport, peer) = runtime.block_on(async {
            // The runner's own dialer: same name resolution and timeout.
            let mut stream = session::dial(to)
                .await
                .ok_or(refused("connect failed or timed out"))?;
            let _ = stream.set_nodelay(true);
            let me = LocalMember {
                key,
                identity: &identity,
            };
            let (transport, peer) = tokio::time::timeout(
                Duration::from_secs(5),
                session::initiate(&mut stream, &psk, &me, to.key()),
            )
            .await
            .ok()
            .and_then(std::result::Result::ok)
            .ok_or(refused("handshake refused"))?;
            Ok::<_, Error>((stream, transport, peer))
        })?;
        Ok(Self::established(
            runtime,
            (stream, transport),
            peer,
            identity.endpoint,
        ))
    }

    /// Takes the next connection a runner makes to `listener` within
    /// `wait` (the listener is left non-blocking): a control session, whose
    /// handshake is answered as `endpoint`/`incarnation` under `secret`, or
    /// a data stream, whose hello is read and challenged. `Err` for anything
    /// else (a wrong preamble, a handshake that fails, nothing in time).
    /// The session proves `key` (a hint must name it for a runner to dial
    /// us when a cluster secret is set).
    pub fn accept(
        listener: &std::net::TcpListener,
        secret: Option<&[u8]>,
        (endpoint, incarnation): (ControlEndpoint, Incarnation),
        key: &StaticKey,
        wait: Duration,
    ) -> Result<Dialed> {
        let (runtime, identity, psk) = Self::prepare(secret, endpoint, incarnation, key)?;
        let listener = listener
            .try_clone()
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|_| refused("could not use the listener"))?;
        let accepted = runtime.block_on(async {
            let me = LocalMember {
                key,
                identity: &identity,
            };
            tokio::time::timeout(wait, Self::take_dialed(listener, &psk, &me)).await
        });
        match accepted.ok().flatten() {
            Some((stream, Accepted::Session(transport, peer))) => Ok(Dialed::Session(Box::new(
                Self::established(runtime, (stream, transport), peer, identity.endpoint),
            ))),
            Some((stream, Accepted::Stream(hello))) => {
                let socket = stream
                    .into_std()
                    .and_then(|s| s.set_nonblocking(false).map(|()| s))
                    .map_err(|_| refused("could not keep the stream"))?;
                Ok(Dialed::DataStream(DataStreamPeer {
                    socket,
                    hello,
                    sealer: None,
                }))
            }
            None => Err(refused("no session or data stream in time")),
        }
    }

    /// The first connection on `listener`, answered as a runner's
    /// listener answers it.
    async fn take_dialed(
        listener: std::net::TcpListener,
        psk: &[u8; 32],
        me: &LocalMember<'_>,
    ) -> Option<(TcpStream, Accepted)> {
        let listener = tokio::net::TcpListener::from_std(listener).ok()?;
        let (mut stream, _) = listener.accept().await.ok()?;
        let _ = stream.set_nodelay(true);
        let accepted = listener::answer(&mut stream, psk, me).await.ok()?;
        Some((stream, accepted))
    }

    /// The endpoint this client claimed: the one it was given, naming its
    /// own key when that named none.
    pub fn claimed(&self) -> &ControlEndpoint {
        &self.claimed
    }

    /// The runner's identity as its handshake proved it: the endpoint it
    /// advertises and its incarnation.
    pub fn peer(&self) -> (&ControlEndpoint, Incarnation) {
        (&self.peer.0, self.peer.1)
    }

    /// Encodes and sends one message.
    pub fn send(&mut self, message: &Message) -> Result<()> {
        let mut frame = BytesMut::new();
        self.codec.encode(message, &mut frame)?;
        self.send_plain(&frame)
    }

    /// Sends arbitrary bytes as the session's plaintext (sealed like any
    /// frame): how a member sends a malformed frame.
    pub fn send_plain(&mut self, bytes: &[u8]) -> Result<()> {
        let mut wire = BytesMut::new();
        session::seal(&mut self.transport, bytes, &mut self.scratch, &mut wire)
            .ok_or(refused("could not seal"))?;
        let stream = &mut self.stream;
        self.runtime
            .block_on(stream.write_all(&wire))
            .map_err(|_| refused("write failed"))
    }

    /// The next message, if one arrives within `wait`. `Err` when the runner
    /// closed the session or sent something that does not open or decode.
    pub fn recv(&mut self, wait: Duration) -> Result<Option<Message>> {
        let Self {
            runtime,
            stream,
            transport,
            codec,
            raw,
            plain,
            scratch,
            ..
        } = self;
        runtime.block_on(async {
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                if let Some(message) = codec.decode(plain)? {
                    return Ok(Some(message));
                }
                match tokio::time::timeout_at(deadline, stream.read_buf(raw)).await {
                    Err(_) => return Ok(None),
                    Ok(Ok(0) | Err(_)) => return Err(refused("the runner closed the session")),
                    Ok(Ok(_)) => {}
                }
                session::open_records(transport, raw, scratch, plain)
                    .ok_or(refused("a record did not open"))?;
            }
        })
    }

    /// Whether the runner closes the session within `wait` (reading and
    /// discarding whatever it sends first).
    pub fn closed_by_peer(&mut self, wait: Duration) -> bool {
        let stream = &mut self.stream;
        self.runtime.block_on(async {
            let mut sink = [0u8; 4096];
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                match tokio::time::timeout_at(deadline, stream.read(&mut sink)).await {
                    Err(_) => return false,
                    Ok(Ok(0) | Err(_)) => return true,
                    Ok(Ok(_)) => {}
                }
            }
        })
    }
}
