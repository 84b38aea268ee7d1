//! The data stream, a kvcr-owned TCP connection that
//! carries a source's writes into a target that reaches it through UCX
//! over tcp, from the source's pool into the target's granted slots.
//!
//! Why: over tcp a UCX write message lands in UCX's receive buffer first
//! and is copied from there into the slots (and a put lands in place only
//! past its first receive segment, then needs its acknowledgement and a
//! `write_done`); a plain socket's `read` puts the bytes where they go.
//! Here the target reads each frame's payload straight into the write's
//! granted elements: one copy out of the socket, the same one a plain
//! socket pays, and the frame's arrival is the write's completion.
//!
//! The target dials it, to the source's control listener, once the source
//! acknowledged its metadata with a route that is not one-copy, and only
//! when [`crate::DataStream`] says so. The dialer proves it holds the key
//! of the control session it belongs to (the per-session record key the
//! target sent inside that encrypted session, see [`crate::wire::record`])
//! and says whether the source is to seal its records
//! ([`crate::StreamSealing`]):
//!
//! ```text
//! dialer   → PREAMBLE  claim_len:u16be  claim:utf-8 (the target's control endpoint)
//! acceptor → challenge:[u8; 32] (fresh random)
//! dialer   → proof:[u8; 32]  terms:[u8; 33] (see wire::sealing)
//! proof    := HMAC-SHA256(key, "kvcr-data-stream/2" | challenge | claim | terms)
//! then, source → target only, frames:
//! frame    := sealed:  prefix tag:[u8; 16]  record*   (each record sealed, wire::sealing)
//!           | plain:   prefix payload:[u8; len]
//! prefix   := len:u64le  record:u32le  zero:u32  header:[u8; 64]
//! record   := the next min(record, rest) bytes of the payload  tag:[u8; 16]
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
//! On a sealed stream (the default with a cluster secret) every prefix and
//! every payload record is AES-256-GCM under a key of the stream's own,
//! numbered from 0: an observer of the connection learns the frames'
//! sizes, not their bytes, and a record altered, replayed, moved, dropped
//! or cut short does not open, which ends the stream (counted in
//! `stream_records_refused`; a write it was landing fails its keys at
//! once, never Success). The source seals each record from its pool into a
//! send buffer (a copy and a pass it did not pay before); the target reads
//! its ciphertext straight into the slots it belongs in and opens it there
//! (a record that runs across two elements is opened in a bounce buffer;
//! sources cut records to fit elements where they can). A plain stream is
//! the old format: sent from the pool with `writev`, read into the slots,
//! its payloads carried in the clear and checked only by the page digests.
//!
//! A target takes a frame only as it takes a write message: the header
//! verifies under the key of the session its operation went out on, while
//! it waits on that operation, and `len` is exactly that part's share of
//! the operation's granted bytes; the payload is then read into those
//! elements (the operation is checked to still wait before every read),
//! and the last part is that session's `write_done`. A frame that does not
//! land is read past and discarded (counted), whatever length it claims,
//! its records unopened, so a stream never loses its framing (a late frame
//! of a write that timed out costs nothing after it); a stream ends when
//! its socket does, a record does not open, or the control session it
//! proved goes.

use std::task::{Context, Poll};

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_sys::MemoryRegistry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::session;
use crate::wire::frame::{FrameReader, MAX_CLAIM, Slots, Want, hello};
pub(crate) use crate::wire::frame::{Lander, Landing, PREAMBLE};
use crate::wire::record::RecordKey;
use crate::wire::sealing::{KeyInput, Opener, StreamTerms, TERMS_BYTES};

mod outgoing;

pub(crate) use outgoing::OutStream;

/// Most bytes one turn moves on one stream (so a large write never keeps
/// the peer thread from its other work for long).
const TURN_BYTES: usize = 8 << 20;
/// Most buffers handed to one vectored read or write.
const MAX_IOV: usize = 256;

/// Dials a data stream to `source` as `claim` (our control endpoint),
/// proving the session key `key` and asking for sealed records when
/// `sealed`: the socket, and the opener of its records when sealed.
/// `None`: unreachable, or the source hung up (it refuses a proof it cannot
/// check).
pub(crate) async fn dial(
    source: &ControlEndpoint,
    claim: &ControlEndpoint,
    key: &[u8; 32],
    sealed: bool,
) -> Option<(TcpStream, Option<Opener>)> {
    let hello = hello(claim)?;
    let terms = StreamTerms::fresh(sealed)?;
    let mut socket = session::dial(source).await?;
    let _ = socket.set_nodelay(true);
    socket.write_all(&hello).await.ok()?;
    let mut challenge = [0u8; 32];
    socket.read_exact(&mut challenge).await.ok()?;
    let proof = RecordKey::new(key).stream_proof(&challenge, claim, &terms);
    let mut answer = proof.to_vec();
    answer.extend_from_slice(&terms.to_bytes());
    socket.write_all(&answer).await.ok()?;
    let opener = if sealed {
        Some(Opener::new(&KeyInput {
            session_key: key,
            challenge: &challenge,
            nonce: &terms.nonce,
            claim,
        })?)
    } else {
        None
    };
    Some((socket, opener))
}

/// What a data stream's dialer said before any frame: the endpoint it
/// claims, the challenge we sent it, the proof it answered and the terms
/// it asked for (the peer thread checks it, as it holds the keys).
pub(crate) struct StreamHello {
    pub(crate) claim: ControlEndpoint,
    pub(crate) challenge: [u8; 32],
    pub(crate) proof: [u8; 32],
    pub(crate) terms: StreamTerms,
}

/// Holds an accepted data stream's place under the channel's caps (and its
/// socket count) while the stream lives: waiting until its proof is
/// checked, a session's after.
pub(crate) use super::admission::StreamPlace as StreamHold;

/// A data stream a target dialed to us: what it said before any frame
/// (the peer thread checks its proof against that target's session key).
pub(crate) struct AcceptedStream {
    pub(crate) hello: StreamHello,
    pub(crate) socket: TcpStream,
    /// Its place under the channel's caps, held while the stream lives.
    pub(crate) hold: StreamHold,
}

impl AcceptedStream {
    /// The stream whose `hello` the listener read on `socket`, holding
    /// its place by `hold`.
    pub(crate) fn new(hello: StreamHello, socket: TcpStream, hold: StreamHold) -> Self {
        Self {
            hello,
            socket,
            hold,
        }
    }

    /// The endpoint its dialer claims.
    pub(crate) fn claim(&self) -> &ControlEndpoint {
        &self.hello.claim
    }

    /// Whether its proof verifies under the session key `key`.
    pub(crate) fn proves(&self, key: &RecordKey) -> bool {
        let hello = &self.hello;
        key.verify_stream_proof(&hello.challenge, &hello.claim, &hello.terms, &hello.proof)
    }
}

impl std::fmt::Debug for AcceptedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceptedStream")
            .field("claim", &self.hello.claim)
            .field("sealed", &self.hello.terms.sealed)
            .finish_non_exhaustive()
    }
}

/// The acceptor's side after [`PREAMBLE`] (the listener hands the socket
/// here): reads the claim, challenges, reads the proof and the terms. The
/// peer thread checks them (it holds the keys).
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
    let mut terms = [0u8; TERMS_BYTES];
    socket.read_exact(&mut terms).await.ok()?;
    Some(StreamHello {
        claim,
        challenge,
        proof,
        terms: StreamTerms::from_bytes(&terms)?,
    })
}

/// What a turn on a stream did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pumped {
    /// Bytes moved.
    pub(crate) moved: bool,
    /// The connection failed or closed: drop it.
    pub(crate) broken: bool,
}

/// A target's granted slots, reached through the registry: a record inside
/// one slot is opened in place, one across slots in `bounce` and copied
/// back.
struct RegistrySlots<'a> {
    memory: &'a MemoryRegistry,
    bounce: &'a mut Vec<u8>,
}

impl Slots for RegistrySlots<'_> {
    fn open_in(&mut self, pieces: &[(u64, u64)], open: &mut dyn FnMut(&mut [u8]) -> bool) -> bool {
        if let [(addr, len)] = pieces {
            return self
                .memory
                .with_writable(*addr, *len, open)
                .unwrap_or(false);
        }
        let total: u64 = pieces.iter().map(|(_, len)| len).sum();
        self.bounce.clear();
        self.bounce
            .resize(usize::try_from(total).unwrap_or(usize::MAX), 0);
        let mut at = 0usize;
        for &(addr, len) in pieces {
            let end = at + len as usize;
            let read = self
                .bounce
                .get_mut(at..end)
                .is_some_and(|into| self.memory.read_into(addr, into).is_ok());
            if !read {
                return false;
            }
            at = end;
        }
        if !open(self.bounce) {
            return false;
        }
        let mut at = 0usize;
        pieces.iter().all(|&(addr, len)| {
            let end = at + len as usize;
            let written = self
                .bounce
                .get(at..end)
                .is_some_and(|bytes| self.memory.write(addr, bytes).is_ok());
            at = end;
            written
        })
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
    /// Records that run across slots are opened here.
    bounce: Vec<u8>,
}

impl<T> InStream<T> {
    /// The stream on `socket`, proven for `session`, its records opened by
    /// `opener` (`None`: a plain stream).
    pub(crate) fn new(session: u64, socket: TcpStream, opener: Option<Opener>) -> Self {
        Self {
            session,
            socket,
            reader: FrameReader::new(opener),
            pieces: Vec::with_capacity(MAX_IOV),
            scratch: Vec::new(),
            bounce: Vec::new(),
        }
    }

    /// Registers for a wake-up when bytes arrive.
    pub(crate) fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.socket.poll_read_ready(cx).map(|_| ())
    }

    /// Reads what has arrived (at most [`TURN_BYTES`]): prefixes are opened
    /// by `lander`, payloads read through `memory` into the spans it grants
    /// (each read after it confirmed they still are), their records opened
    /// there, or discarded. A record that does not open breaks the stream
    /// (the lander is told first).
    ///
    /// Spans `lander` returns must be registered in `memory`, and nothing
    /// else may read or write them from the moment it returns them until
    /// its next [`Lander::still_granted`] answers `false` or
    /// [`Lander::landed`] or [`Lander::torn`] is called (the granted
    /// elements of an operation that waits for its reply, on the peer thread
    /// that alone hands it its reply): a span outside the registry breaks
    /// the stream.
    pub(crate) fn pump<L: Lander<Opened = T>>(
        &mut self,
        memory: &MemoryRegistry,
        lander: &mut L,
    ) -> Pumped {
        let mut pumped = Pumped::default();
        let mut budget = TURN_BYTES;
        while budget > 0 {
            let read = match self.reader.want(lander, &mut self.pieces, MAX_IOV) {
                Want::Bytes(rest) => self.socket.try_read(rest),
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
                Want::Nothing => Ok(0),
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
            let mut slots = RegistrySlots {
                memory,
                bounce: &mut self.bounce,
            };
            // A record is opened only right after `want` confirmed its
            // operation still waits, on this thread (see above).
            let going = self.reader.advance(n, lander, &mut slots);
            if going == crate::wire::frame::Read::Torn {
                pumped.broken = true;
                return pumped;
            }
        }
        pumped
    }
}

#[cfg(test)]
mod tests;
