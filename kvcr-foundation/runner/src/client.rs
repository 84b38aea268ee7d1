//! A blocking client of a runner's control channel, for tools and tests that
//! speak the peer protocol by hand (the hostile-peer tests use it to act as
//! a cluster member that misbehaves).
//!
//! It runs the same authenticated handshake as a runner's dialer (so it needs
//! the cluster secret, or none for a runner without one), presents the
//! identity it is given, and then sends and receives frames on that one
//! session, as a target does. Nothing here bypasses the runner's checks.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::control::{self, PeerIdentity, RECORD_MAX};
use crate::error::{Error, Result, RunnerReason};
use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::Message;
use kvcr_contracts::protocol::codec::FrameCodec;

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
}

fn refused(why: &'static str) -> Error {
    Error::runner(RunnerReason::Config {
        field: "control client",
        why,
    })
}

impl ControlClient {
    /// Dials `to` and completes the handshake as `endpoint`/`incarnation`.
    pub fn connect(
        to: &ControlEndpoint,
        secret: Option<&[u8]>,
        endpoint: ControlEndpoint,
        incarnation: Incarnation,
    ) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|_| refused("could not start a runtime"))?;
        let identity = PeerIdentity {
            endpoint,
            incarnation,
        };
        let psk = control::psk(secret);
        let (stream, transport, peer) = runtime.block_on(async {
            // The runner's own dialer: same name resolution and timeout.
            let mut stream = control::dial(to)
                .await
                .ok_or(refused("connect failed or timed out"))?;
            let _ = stream.set_nodelay(true);
            let (transport, peer) = tokio::time::timeout(
                Duration::from_secs(5),
                control::initiate(&mut stream, &psk, &identity),
            )
            .await
            .ok()
            .flatten()
            .ok_or(refused("handshake refused"))?;
            Ok::<_, Error>((stream, transport, peer))
        })?;
        Ok(Self {
            runtime,
            stream,
            transport,
            codec: FrameCodec::default(),
            raw: BytesMut::new(),
            plain: BytesMut::new(),
            scratch: vec![0u8; RECORD_MAX],
            peer: (peer.endpoint, peer.incarnation),
        })
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
        control::seal(&mut self.transport, bytes, &mut self.scratch, &mut wire)
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
                control::open_records(transport, raw, scratch, plain)
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
