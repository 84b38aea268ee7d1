//! The data stream, a kvcr-owned TCP connection that
//! carries a source's writes into a target that reaches it through UCX
//! over tcp, straight from the source's pool into the target's granted
//! slots.
//!
//! Why: over tcp a UCX write message lands in UCX's receive buffer first
//! and is copied from there into the slots (and a put lands in place only
//! past its first receive segment, then needs its acknowledgement and a
//! `write_done`); a plain socket's `read` puts the bytes where they go.
//! Here the source `writev`s a frame from its claimed pool spans and the
//! target `readv`s its payload into the write's granted elements: one copy
//! out of the socket, the same one a plain socket pays, and the frame's
//! arrival is the write's completion.
//!
//! The target dials it, to the source's control listener, once the source
//! acknowledged its metadata with a route that is not one-copy, and only
//! when [`crate::DataStream`] says so. The dialer proves it holds the key
//! of the control session it belongs to (the per-session record key the
//! target sent inside that encrypted session, see [`crate::wire::record`]):
//!
//! ```text
//! dialer   → PREAMBLE  claim_len:u16be  claim:utf-8 (the target's control endpoint)
//! acceptor → challenge:[u8; 32] (fresh random)
//! dialer   → proof:[u8; 32] = HMAC-SHA256(key, "kvcr-data-stream/1" | challenge | claim)
//! then, source → target only, frames:
//! frame    := len:u64le  header:[u8; 64]  payload:[u8; len]
//! header   := a write message's header (the doorbell record under "kvcr-write-message/1")
//! ```
//!
//! The acceptor hands the connection to the peer thread, which checks the
//! proof under the key of the route it built from that endpoint's session
//! (so a stream binds to one control session; nobody without that key can
//! make a source send on it, and a recorded proof does not answer a fresh
//! challenge). Until its proof is checked it waits in a place of its own
//! like a handshake, then takes a session's (see [`super::admission`]),
//! one per target, the newest replacing an older.
//!
//! A target takes a frame only as it takes a write message: the header
//! verifies under the key of the session its operation went out on, while
//! it waits on that operation, and `len` is exactly that part's share of
//! the operation's granted bytes; the payload is then read into those
//! elements (the operation is checked to still wait before every read),
//! and the last part is that session's `write_done`. A frame that does not
//! open or fit is read and discarded (counted), whatever length it claims,
//! so a stream never loses its framing (a late frame of a write that timed
//! out costs nothing after it); a stream ends when its socket does or the
//! control session it proved goes. Payloads are not
//! authenticated, as a UCX put's bytes over tcp are not: the connection
//! is plain TCP, and what it carries is bound by the sealed headers.

use std::collections::VecDeque;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_sys::MemoryRegistry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::session;
use crate::wire::frame::{
    FrameReader, MAX_CLAIM, PREFIX_BYTES, Want, frame_prefix, hello, unsent_pieces,
};
pub(crate) use crate::wire::frame::{Lander, Landing, PREAMBLE};
use crate::wire::record::{RecordKey, SLOT_BYTES};

/// Most bytes one turn moves on one stream (so a large write never keeps
/// the peer thread from its other work for long).
const TURN_BYTES: usize = 8 << 20;
/// Most buffers handed to one vectored read or write.
const MAX_IOV: usize = 256;

/// Dials a data stream to `source` as `claim` (our control endpoint),
/// proving the session key `key`. `None`: unreachable, or the source hung
/// up (it refuses a proof it cannot check).
pub(crate) async fn dial(
    source: &ControlEndpoint,
    claim: &ControlEndpoint,
    key: &[u8; 32],
) -> Option<TcpStream> {
    let hello = hello(claim)?;
    let mut socket = session::dial(source).await?;
    let _ = socket.set_nodelay(true);
    socket.write_all(&hello).await.ok()?;
    let mut challenge = [0u8; 32];
    socket.read_exact(&mut challenge).await.ok()?;
    let proof = RecordKey::new(key).stream_proof(&challenge, claim);
    socket.write_all(&proof).await.ok()?;
    Some(socket)
}

/// What a data stream's dialer said before any frame: the endpoint it
/// claims, the challenge we sent it and the proof it answered (the peer
/// thread checks it, as it holds the keys).
pub(crate) struct StreamHello {
    pub(crate) claim: ControlEndpoint,
    pub(crate) challenge: [u8; 32],
    pub(crate) proof: [u8; 32],
}

/// Holds an accepted data stream's place under the channel's caps (and its
/// socket count) while the stream lives: waiting until its proof is
/// checked, a session's after.
pub(crate) use super::admission::StreamPlace as StreamHold;

/// A data stream a target dialed to us: who it claims to be, the
/// challenge we sent and the proof it answered; the peer thread checks the
/// proof against that target's session key.
pub(crate) struct AcceptedStream {
    pub(crate) claim: ControlEndpoint,
    pub(crate) challenge: [u8; 32],
    pub(crate) proof: [u8; 32],
    pub(crate) socket: TcpStream,
    /// Its place under the channel's caps, held while the stream lives.
    pub(crate) hold: StreamHold,
}

impl AcceptedStream {
    /// The stream whose `hello` the listener read on `socket`, holding
    /// its place by `hold`.
    pub(crate) fn new(hello: StreamHello, socket: TcpStream, hold: StreamHold) -> Self {
        let StreamHello {
            claim,
            challenge,
            proof,
        } = hello;
        Self {
            claim,
            challenge,
            proof,
            socket,
            hold,
        }
    }
}

impl std::fmt::Debug for AcceptedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceptedStream")
            .field("claim", &self.claim)
            .finish_non_exhaustive()
    }
}

/// The acceptor's side after [`PREAMBLE`] (the listener hands the socket
/// here): reads the claim, challenges, reads the proof. The peer thread
/// checks it (it holds the keys).
pub(crate) async fn accept(socket: &mut TcpStream) -> Option<StreamHello> {
    let mut len = [0u8; 2];
    socket.read_exact(&mut len).await.ok()?;
    let len = usize::from(u16::from_be_bytes(len));
    if len > MAX_CLAIM {
        return None;
    }
    let mut claim = vec![0u8; len];
    socket.read_exact(&mut claim).await.ok()?;
    let claim = ControlEndpoint::parse(std::str::from_utf8(&claim).ok()?).ok()?;
    let mut challenge = [0u8; 32];
    getrandom::fill(&mut challenge).ok()?;
    socket.write_all(&challenge).await.ok()?;
    let mut proof = [0u8; 32];
    socket.read_exact(&mut proof).await.ok()?;
    Some(StreamHello {
        claim,
        challenge,
        proof,
    })
}

/// One write on its way out: its prefix, then its spans of our pool.
struct OutFrame {
    write: u64,
    prefix: [u8; PREFIX_BYTES],
    /// Address and length of each span, in the order the target lands them.
    spans: Vec<(u64, u64)>,
    /// Bytes of prefix and payload the socket has taken.
    sent: u64,
    total: u64,
}

/// A source's data stream to one target.
pub(crate) struct OutStream {
    /// The session key the dialer proved (the route it serves must carry it).
    key: [u8; 32],
    socket: TcpStream,
    frames: VecDeque<OutFrame>,
    /// The pieces of the next vectored write (kept to reuse its buffer).
    pieces: Vec<(u64, u64)>,
    /// Since when frames have waited without the socket taking a byte.
    stalled_since: Option<Instant>,
    /// Holds the connection's place under the control channel's caps
    /// (`None` only in unit tests).
    _hold: Option<StreamHold>,
}

/// What a turn on a stream did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pumped {
    /// Bytes moved.
    pub(crate) moved: bool,
    /// The connection failed or closed: drop it.
    pub(crate) broken: bool,
}

impl OutStream {
    pub(crate) fn new(key: [u8; 32], socket: TcpStream, hold: Option<StreamHold>) -> Self {
        Self {
            key,
            socket,
            frames: VecDeque::new(),
            pieces: Vec::with_capacity(MAX_IOV),
            stalled_since: None,
            _hold: hold,
        }
    }

    /// The session key this stream was proven with.
    pub(crate) fn key(&self) -> &[u8; 32] {
        &self.key
    }

    /// Queues write `write`: `header` (its message header), then the bytes
    /// of `spans` (address, length) laid end to end.
    pub(crate) fn push(&mut self, write: u64, header: &[u8; SLOT_BYTES], spans: Vec<(u64, u64)>) {
        let len: u64 = spans.iter().map(|(_, l)| l).sum();
        self.frames.push_back(OutFrame {
            write,
            prefix: frame_prefix(len, header),
            spans,
            sent: 0,
            total: PREFIX_BYTES as u64 + len,
        });
    }

    /// Whether frames wait for the socket.
    pub(crate) fn wants_write(&self) -> bool {
        !self.frames.is_empty()
    }

    /// The writes queued and not yet sent whole, removed (the stream goes).
    pub(crate) fn take_unsent(&mut self) -> Vec<u64> {
        self.frames.drain(..).map(|f| f.write).collect()
    }

    /// Registers for a wake-up when the socket can take more.
    pub(crate) fn poll_writable(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.wants_write() {
            self.socket.poll_write_ready(cx).map(|_| ())
        } else {
            Poll::Pending
        }
    }

    /// Writes queued frames while the socket takes them (at most
    /// [`TURN_BYTES`]), their spans read through `memory` (each span must
    /// be registered there: the claimed pages of a write, unchanged until
    /// its write is reported sent or failed); each write sent whole is
    /// pushed to `sent`. A stream whose socket has taken nothing for
    /// `deadline` while frames wait (a target that stopped reading) is
    /// broken, as is one whose frame names unregistered memory.
    pub(crate) fn pump(
        &mut self,
        memory: &MemoryRegistry,
        sent: &mut Vec<u64>,
        now: Instant,
        deadline: Duration,
    ) -> Pumped {
        let pumped = self.write_frames(memory, sent);
        if pumped.moved || self.frames.is_empty() {
            self.stalled_since = None;
        } else if now.saturating_duration_since(*self.stalled_since.get_or_insert(now)) >= deadline
        {
            return Pumped {
                moved: false,
                broken: true,
            };
        }
        pumped
    }

    /// The writes of [`OutStream::pump`].
    fn write_frames(&mut self, memory: &MemoryRegistry, sent: &mut Vec<u64>) -> Pumped {
        let mut pumped = Pumped::default();
        let mut budget = TURN_BYTES;
        while budget > 0 {
            let Some(frame) = self.frames.front_mut() else {
                break;
            };
            let head = usize::try_from(frame.sent)
                .ok()
                .and_then(|sent| frame.prefix.get(sent..))
                .filter(|rest| !rest.is_empty());
            let room = MAX_IOV - usize::from(head.is_some());
            self.pieces.clear();
            self.pieces.extend(unsent_pieces(
                &frame.spans,
                PREFIX_BYTES as u64,
                frame.sent,
                room,
            ));
            // Every piece lies in one of the frame's spans, in our pool,
            // unchanged until this write is reported (claimed by it).
            let written = memory.try_write_vectored(&self.socket, head, &self.pieces);
            match written {
                Ok(0) => {
                    pumped.broken = true;
                    return pumped;
                }
                Ok(n) => {
                    pumped.moved = true;
                    budget = budget.saturating_sub(n);
                    frame.sent += n as u64;
                    if frame.sent >= frame.total {
                        sent.push(frame.write);
                        self.frames.pop_front();
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    pumped.broken = true;
                    return pumped;
                }
            }
        }
        pumped
    }
}

/// A target's data stream from one source.
pub(crate) struct InStream<T> {
    /// The control session (ours, to the source) whose key it proved.
    pub(crate) session: u64,
    socket: TcpStream,
    reader: FrameReader<T>,
    /// The granted pieces of the next vectored read (kept to reuse it).
    pieces: Vec<(u64, u64)>,
    scratch: Vec<u8>,
}

impl<T> InStream<T> {
    pub(crate) fn new(session: u64, socket: TcpStream) -> Self {
        Self {
            session,
            socket,
            reader: FrameReader::default(),
            pieces: Vec::with_capacity(MAX_IOV),
            scratch: Vec::new(),
        }
    }

    /// Registers for a wake-up when bytes arrive.
    pub(crate) fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.socket.poll_read_ready(cx).map(|_| ())
    }

    /// Reads what has arrived (at most [`TURN_BYTES`]): prefixes are opened
    /// by `lander`, payloads read through `memory` into the spans it grants
    /// (each read after it confirmed they still are) or discarded.
    ///
    /// Spans `lander` returns must be registered in `memory`, and nothing
    /// else may read or write them from the moment it returns them until
    /// its next [`Lander::still_granted`] answers `false` or
    /// [`Lander::landed`] is called (the granted elements of an operation
    /// that waits for its reply, on the peer thread that alone hands it its
    /// reply): a span outside the registry breaks the stream.
    pub(crate) fn pump<L: Lander<Opened = T>>(
        &mut self,
        memory: &MemoryRegistry,
        lander: &mut L,
    ) -> Pumped {
        let mut pumped = Pumped::default();
        let mut budget = TURN_BYTES;
        while budget > 0 {
            let read = match self.reader.want(lander, &mut self.pieces, MAX_IOV) {
                Want::Prefix(rest) => self.socket.try_read(rest),
                // The pieces are unsent parts of distinct granted elements,
                // whose operation still waits (checked by `want`).
                Want::Payload => memory.try_read_vectored(&self.socket, &self.pieces),
                Want::Discard(want) => {
                    if self.scratch.len() < want {
                        self.scratch.resize(want, 0);
                    }
                    match self.scratch.get_mut(..want) {
                        Some(into) => self.socket.try_read(into),
                        None => Ok(0),
                    }
                }
            };
            let n = match read {
                Ok(0) => {
                    pumped.broken = true;
                    return pumped;
                }
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    pumped.broken = true;
                    return pumped;
                }
            };
            pumped.moved = true;
            budget = budget.saturating_sub(n);
            self.reader.advance(n, lander);
        }
        pumped
    }
}

#[cfg(test)]
mod tests;
