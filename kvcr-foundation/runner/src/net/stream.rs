//! Unsafe, named: the data stream, a kvcr-owned TCP connection that
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
//! challenge). It is held under the control channel's admission caps (per
//! address and in total), one per target, the newest replacing an older.
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
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::session;
use crate::wire::record::{RecordKey, SLOT_BYTES};

/// What a data stream's dialer writes first (as long as the control
/// channel's, which the listener tells it from).
pub(crate) const PREAMBLE: &[u8; 8] = b"KVCR-D1\0";
/// The longest endpoint claim a dialer may send.
pub(crate) const MAX_CLAIM: usize = 300;
/// Bytes before a frame's payload: its length and its header.
pub(crate) const PREFIX_BYTES: usize = 8 + SLOT_BYTES;
/// Most bytes one turn moves on one stream (so a large write never keeps
/// the peer thread from its other work for long).
const TURN_BYTES: usize = 8 << 20;
/// Most buffers handed to one vectored read or write.
const MAX_IOV: usize = 256;

/// A frame's prefix: its payload's length and its header.
pub(crate) fn frame_prefix(len: u64, header: &[u8; SLOT_BYTES]) -> [u8; PREFIX_BYTES] {
    let mut prefix = [0u8; PREFIX_BYTES];
    prefix[..8].copy_from_slice(&len.to_le_bytes());
    prefix[8..].copy_from_slice(header);
    prefix
}

/// The length and header of a frame's prefix.
fn parse_prefix(prefix: &[u8; PREFIX_BYTES]) -> (u64, [u8; SLOT_BYTES]) {
    let mut len = [0u8; 8];
    len.copy_from_slice(&prefix[..8]);
    let mut header = [0u8; SLOT_BYTES];
    header.copy_from_slice(&prefix[8..]);
    (u64::from_le_bytes(len), header)
}

/// What is left of `spans` (address, length), laid end to end after
/// `before` bytes of something else, once the first `done` bytes of the
/// whole have moved: each remaining piece's address and length, in order,
/// at most `max` of them.
fn unsent_pieces(
    spans: &[(u64, u64)],
    before: u64,
    done: u64,
    max: usize,
) -> impl Iterator<Item = (u64, u64)> + '_ {
    let mut at = before;
    spans
        .iter()
        .filter_map(move |&(start, len)| {
            let (from, end) = (at, at + len);
            at = end;
            // A piece started is resumed past what moved (`skip < len`).
            (end > done).then(|| {
                let skip = done.saturating_sub(from);
                (start + skip, len - skip)
            })
        })
        .take(max)
}

/// What a dialer claiming `claim` writes first (`None`: a claim too long).
fn hello(claim: &ControlEndpoint) -> Option<Vec<u8>> {
    let claim = claim.to_string();
    let claim_len = u16::try_from(claim.len())
        .ok()
        .filter(|n| usize::from(*n) <= MAX_CLAIM)?;
    let mut hello = Vec::with_capacity(PREAMBLE.len() + 2 + claim.len());
    hello.extend_from_slice(PREAMBLE);
    hello.extend_from_slice(&claim_len.to_be_bytes());
    hello.extend_from_slice(claim.as_bytes());
    Some(hello)
}

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

/// Holds an accepted data stream's place under the channel's caps (the
/// listener's admission and socket count) while the stream lives.
pub(crate) struct StreamHold {
    _guards: Box<dyn Send>,
}

impl StreamHold {
    /// Holds `guards` until the stream goes.
    pub(crate) fn new(guards: impl Send + 'static) -> Self {
        Self {
            _guards: Box::new(guards),
        }
    }
}

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
    /// [`TURN_BYTES`]); each write sent whole is pushed to `sent`. A
    /// stream whose socket has taken nothing for `deadline` while frames
    /// wait (a target that stopped reading) is broken.
    ///
    /// # Safety
    ///
    /// Every span of every queued frame must stay readable, and its bytes
    /// unchanged, until its write is reported sent or failed (the claimed
    /// pages of a write, in pools that outlive this stream).
    pub(crate) unsafe fn pump(
        &mut self,
        sent: &mut Vec<u64>,
        now: Instant,
        deadline: Duration,
    ) -> Pumped {
        // SAFETY: the caller's contract is this function's.
        let pumped = unsafe { self.write_frames(sent) };
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

    /// # Safety
    ///
    /// As [`OutStream::pump`].
    unsafe fn write_frames(&mut self, sent: &mut Vec<u64>) -> Pumped {
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
            let pieces = unsent_pieces(&frame.spans, PREFIX_BYTES as u64, frame.sent, room);
            let capacity = MAX_IOV.min(frame.spans.len() + 1);
            // SAFETY: every piece lies in one of the frame's spans, in our
            // pool, readable and unchanged until this write is reported (the
            // caller's contract).
            let written = unsafe {
                kvcr_sys::vectored::try_write_spans(&self.socket, head, pieces, capacity)
            };
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

/// What the target makes of a frame's prefix (see [`InStream::pump`]).
pub(crate) enum Landing<T> {
    /// Read the payload into these spans (address, length; their lengths
    /// sum to the frame's), then hand `T` back.
    Into(T, Vec<(u64, u64)>),
    /// Read and discard the payload (counted as refused by the caller).
    Discard,
}

/// The target's side of landing frames: what the peer thread decides.
pub(crate) trait Lander {
    /// What a frame that may land carries to its end.
    type Opened;
    /// A frame's prefix arrived: where its payload of `len` bytes goes.
    fn open(&mut self, len: u64, header: &[u8; SLOT_BYTES]) -> Landing<Self::Opened>;
    /// Whether `opened`'s spans may still be written (its operation waits).
    fn still_granted(&mut self, opened: &Self::Opened) -> bool;
    /// `opened`'s payload landed whole.
    fn landed(&mut self, opened: Self::Opened);
    /// A frame was discarded (it did not open or fit, or its operation
    /// stopped waiting mid-payload).
    fn discarded(&mut self);
}

enum Recv<T> {
    Prefix {
        buf: [u8; PREFIX_BYTES],
        have: usize,
    },
    Payload {
        opened: T,
        spans: Vec<(u64, u64)>,
        landed: u64,
        len: u64,
    },
    Discard {
        left: u64,
    },
}

/// A target's data stream from one source.
pub(crate) struct InStream<T> {
    /// The control session (ours, to the source) whose key it proved.
    pub(crate) session: u64,
    socket: TcpStream,
    state: Recv<T>,
    scratch: Vec<u8>,
}

impl<T> InStream<T> {
    pub(crate) fn new(session: u64, socket: TcpStream) -> Self {
        Self {
            session,
            socket,
            state: Recv::Prefix {
                buf: [0; PREFIX_BYTES],
                have: 0,
            },
            scratch: Vec::new(),
        }
    }

    /// Registers for a wake-up when bytes arrive.
    pub(crate) fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.socket.poll_read_ready(cx).map(|_| ())
    }

    /// Reads what has arrived (at most [`TURN_BYTES`]): prefixes are opened
    /// by `lander`, payloads read into the spans it grants (each read after
    /// it confirmed they still are) or discarded.
    ///
    /// # Safety
    ///
    /// Spans `lander` returns must be ours to write, and nothing else may
    /// read or write them, from the moment it returns them until its next
    /// [`Lander::still_granted`] answers `false` or [`Lander::landed`] is
    /// called (the granted elements of an operation that waits for its
    /// reply, on the peer thread that alone hands it its reply).
    pub(crate) unsafe fn pump<L: Lander<Opened = T>>(&mut self, lander: &mut L) -> Pumped {
        let mut pumped = Pumped::default();
        let mut budget = TURN_BYTES;
        while budget > 0 {
            let read = match &mut self.state {
                Recv::Prefix { buf, have } => match buf.get_mut(*have..) {
                    Some(rest) => self.socket.try_read(rest),
                    None => Ok(0),
                },
                Recv::Payload {
                    opened,
                    spans,
                    landed,
                    len,
                } => {
                    if !lander.still_granted(opened) {
                        let left = *len - *landed;
                        lander.discarded();
                        self.state = Recv::Discard { left };
                        continue;
                    }
                    let pieces = unsent_pieces(spans, 0, *landed, MAX_IOV);
                    // SAFETY: every piece lies in a span granted to this
                    // frame's operation, which still waits (checked just
                    // above), so nothing else touches it (the caller's
                    // contract); the pieces are unsent parts of distinct
                    // granted elements, so they do not overlap.
                    unsafe { kvcr_sys::vectored::try_read_spans(&self.socket, pieces) }
                }
                Recv::Discard { left } => {
                    let want = usize::try_from(*left).unwrap_or(usize::MAX).min(256 << 10);
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
            self.advance(n, lander);
        }
        pumped
    }

    /// `n` bytes were read in the current state: moves to the next.
    fn advance<L: Lander<Opened = T>>(&mut self, n: usize, lander: &mut L) {
        match &mut self.state {
            Recv::Prefix { buf, have } => {
                *have += n;
                if *have < PREFIX_BYTES {
                    return;
                }
                let (len, header) = parse_prefix(buf);
                self.state = match lander.open(len, &header) {
                    // The lander's spans are exactly the payload (checked
                    // again here: a payload read past them would desync).
                    Landing::Into(opened, spans)
                        if spans.iter().map(|(_, l)| *l).sum::<u64>() == len && len > 0 =>
                    {
                        Recv::Payload {
                            opened,
                            spans,
                            landed: 0,
                            len,
                        }
                    }
                    Landing::Into(..) | Landing::Discard => {
                        lander.discarded();
                        Recv::discarding(len)
                    }
                };
            }
            Recv::Payload { landed, len, .. } => {
                *landed += n as u64;
                if *landed < *len {
                    return;
                }
                if let Recv::Payload { opened, .. } =
                    std::mem::replace(&mut self.state, Recv::discarding(0))
                {
                    lander.landed(opened);
                }
            }
            Recv::Discard { left } => {
                *left = left.saturating_sub(n as u64);
                if *left == 0 {
                    self.state = Recv::discarding(0);
                }
            }
        }
    }
}

impl<T> Recv<T> {
    /// Discards `left` bytes, then reads the next prefix (at once when 0).
    fn discarding(left: u64) -> Self {
        if left == 0 {
            Recv::Prefix {
                buf: [0; PREFIX_BYTES],
                have: 0,
            }
        } else {
            Recv::Discard { left }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is left of spans at 100 (10 bytes) and 200 (20 bytes), after
    /// a prefix of `before` bytes, once `done` bytes moved, at most `max`
    /// pieces: a piece started is resumed where it stopped.
    #[rstest::rstest]
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

    /// A lander that grants each frame whose header's first byte is 1 the
    /// spans it was given, discards the rest, and records what happened.
    struct Recorder {
        spans: Vec<(u64, u64)>,
        granted: bool,
        events: Vec<String>,
    }

    impl Lander for Recorder {
        type Opened = u8;

        fn open(&mut self, len: u64, header: &[u8; SLOT_BYTES]) -> Landing<u8> {
            self.events.push(format!("open {} {len}", header[0]));
            if header[0] == 1 {
                Landing::Into(header[1], self.spans.clone())
            } else {
                Landing::Discard
            }
        }

        fn still_granted(&mut self, _: &u8) -> bool {
            self.granted
        }

        fn landed(&mut self, tag: u8) {
            self.events.push(format!("landed {tag}"));
        }

        fn discarded(&mut self) {
            self.events.push("discarded".to_owned());
        }
    }

    fn frame(kind: u8, tag: u8, payload: &[u8]) -> Vec<u8> {
        let mut header = [0u8; SLOT_BYTES];
        header[0] = kind;
        header[1] = tag;
        let mut bytes = frame_prefix(payload.len() as u64, &header).to_vec();
        bytes.extend_from_slice(payload);
        bytes
    }

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
        lander: &mut Recorder,
        mut done: impl FnMut(&Recorder) -> bool,
    ) -> Pumped {
        for _ in 0..10_000 {
            // SAFETY: (test) the spans are live `Vec`s nothing else touches.
            let pumped = unsafe { stream.pump(lander) };
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
            let mut first = vec![0u8; 3000];
            let mut second = vec![0u8; 5000];
            let mut lander = Recorder {
                spans: vec![
                    (first.as_mut_ptr() as u64, 3000),
                    (second.as_mut_ptr() as u64, 5000),
                ],
                granted: true,
                events: Vec::new(),
            };
            let payload: Vec<u8> = (0..8000u32).map(|i| (i * 7 % 251) as u8).collect();
            let mut wire = frame(0, 0, &[0xee; 70_000]);
            wire.extend(frame(1, 9, &payload));
            wire.extend(frame(0, 0, &[]));
            wire.extend(frame(0, 0, &[0xdd; 10]));
            std::io::Write::write_all(&mut peer, &wire).unwrap();
            let mut stream = InStream::new(7, ours);
            let pumped = pump_until(&mut stream, &mut lander, |l| l.events.len() == 8).await;
            assert!(!pumped.broken);
            assert_eq!(
                lander.events,
                [
                    "open 0 70000",
                    "discarded",
                    "open 1 8000",
                    "landed 9",
                    "open 0 0",
                    "discarded",
                    "open 0 10",
                    "discarded",
                ]
            );
            assert_eq!(first, payload[..3000]);
            assert_eq!(second, payload[3000..]);
        });
    }

    /// An operation that stops waiting mid-payload gets no more of it: the
    /// rest is read past, the next frame lands.
    #[test]
    fn a_payload_stops_landing_once_its_operation_stops_waiting() {
        run(async {
            let (ours, mut peer) = pair().await;
            let mut into = vec![0u8; 4096];
            let mut lander = Recorder {
                spans: vec![(into.as_mut_ptr() as u64, 4096)],
                granted: true,
                events: Vec::new(),
            };
            let mut stream = InStream::new(1, ours);
            let whole = frame(1, 1, &[0xaa; 4096]);
            let cut = PREFIX_BYTES + 1000;
            std::io::Write::write_all(&mut peer, &whole[..cut]).unwrap();
            for _ in 0..10_000 {
                if into[999] == 0xaa {
                    break;
                }
                // SAFETY: (test) the spans are live `Vec`s nothing else
                // touches while this runs.
                assert!(!unsafe { stream.pump(&mut lander) }.broken);
                tokio::task::yield_now().await;
            }
            assert_eq!(into[999], 0xaa, "the first 1000 bytes landed");
            // The operation ends; the next frame goes elsewhere.
            lander.granted = false;
            pump_until(&mut stream, &mut lander, |l| {
                l.events.last().is_some_and(|e| e == "discarded")
            })
            .await;
            let mut other = vec![0u8; 4096];
            lander.spans = vec![(other.as_mut_ptr() as u64, 4096)];
            lander.granted = true;
            let mut rest = whole[cut..].to_vec();
            rest.extend(frame(1, 2, &[0xbb; 4096]));
            std::io::Write::write_all(&mut peer, &rest).unwrap();
            pump_until(&mut stream, &mut lander, |l| l.events.len() == 4).await;
            assert_eq!(
                lander.events,
                ["open 1 4096", "discarded", "open 1 4096", "landed 2"]
            );
            assert!(into[..1000].iter().all(|b| *b == 0xaa));
            assert!(
                into[1000..].iter().all(|b| *b == 0),
                "nothing after it ended"
            );
            assert!(other.iter().all(|b| *b == 0xbb));
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
            let mut out = OutStream::new([0; 32], ours, None);
            let header = [3u8; SLOT_BYTES];
            out.push(
                11,
                &header,
                vec![(a.as_ptr() as u64, 5000), (b.as_ptr() as u64, 3000)],
            );
            out.push(12, &header, vec![(b.as_ptr() as u64, 10)]);
            let mut sent = Vec::new();
            #[allow(clippy::disallowed_methods)]
            let now = Instant::now();
            // SAFETY: (test) the spans are live `Vec`s, unchanged until sent.
            let pumped = unsafe { out.pump(&mut sent, now, Duration::from_secs(1)) };
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
            let big = vec![1u8; 64 << 20];
            let mut out = OutStream::new([0; 32], ours, None);
            out.push(
                5,
                &[0; SLOT_BYTES],
                vec![(big.as_ptr() as u64, big.len() as u64)],
            );
            let mut sent = Vec::new();
            #[allow(clippy::disallowed_methods)]
            let start = Instant::now();
            let deadline = Duration::from_secs(3600);
            let mut broken = false;
            for turn in 0..1000u64 {
                // Each turn an hour later: the socket fills, then takes nothing.
                let now = start + Duration::from_secs(3600 * turn);
                // SAFETY: (test) `big` is live and unchanged.
                let pumped = unsafe { out.pump(&mut sent, now, deadline) };
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
            let mut lander = Recorder {
                spans: Vec::new(),
                granted: true,
                events: Vec::new(),
            };
            let mut stream = InStream::new(1, ours);
            let pumped = pump_until(&mut stream, &mut lander, |_| false).await;
            assert!(pumped.broken);
            assert!(lander.events.is_empty());
        });
    }
}
