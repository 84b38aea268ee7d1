//! A source's data stream to one target ([`OutStream`]): writes queue as
//! frames and leave in order, plain (each frame `writev`n from the pool
//! spans it names) or sealed (each record copied from the pool into a send
//! buffer and sealed there, see [`crate::wire::sealing`]).

use std::collections::VecDeque;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvcr_sys::MemoryRegistry;
use tokio::net::TcpStream;

use super::{MAX_IOV, Pumped, StreamHold, TURN_BYTES};
use crate::wire::frame::{MAX_RECORD, PREFIX_BYTES, fitted_record, frame_prefix, unsent_pieces};
use crate::wire::part::spans_in_range;
use crate::wire::record::SLOT_BYTES;
use crate::wire::sealing::{RecordKind, Sealer};

/// A sealed stream's send buffer is filled with records up to about this
/// many bytes (one record past it at most) before the socket takes them.
const FILL_BYTES: usize = 256 << 10;
/// The send buffer's size: [`FILL_BYTES`], then a prefix and a record past
/// it, each with its tag.
const BUFFER_BYTES: usize =
    FILL_BYTES + PREFIX_BYTES + MAX_RECORD as usize + 2 * crate::wire::sealing::TAG_BYTES;

/// One write on its way out: its prefix, then its spans of our pool.
struct OutFrame {
    write: u64,
    prefix: [u8; PREFIX_BYTES],
    /// Address and length of each span, in the order the target lands them.
    spans: Vec<(u64, u64)>,
    /// Payload bytes.
    len: u64,
    /// Bytes per sealed record.
    record: u64,
    /// Plain: bytes of prefix and payload the socket has taken. Sealed:
    /// payload bytes sealed into the send buffer.
    done: u64,
    /// Sealed: its prefix is in the send buffer.
    prefix_sealed: bool,
}

/// A sealed stream's records on their way out.
struct Sealing {
    sealer: Sealer,
    /// Sealed records (its first `filled` bytes) not yet all taken by the
    /// socket (allocated once: records are copied and sealed in place).
    buf: Vec<u8>,
    filled: usize,
    /// Bytes of `buf` the socket took.
    sent: usize,
    /// The writes whose last record is in `buf`, with where it ends.
    ends: VecDeque<(usize, u64)>,
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
    /// How its records are sealed (`None`: a plain stream).
    sealing: Option<Sealing>,
    /// Holds the connection's place under the control channel's caps
    /// (`None` only in unit tests).
    _hold: Option<StreamHold>,
}

impl OutStream {
    /// The stream on `socket`, proven with session key `key`, its records
    /// sealed by `sealer` (`None`: plain).
    pub(crate) fn new(
        key: [u8; 32],
        socket: TcpStream,
        sealer: Option<Sealer>,
        hold: Option<StreamHold>,
    ) -> Self {
        Self {
            key,
            socket,
            frames: VecDeque::new(),
            pieces: Vec::with_capacity(MAX_IOV),
            stalled_since: None,
            sealing: sealer.map(|sealer| Sealing {
                sealer,
                buf: vec![0; BUFFER_BYTES],
                filled: 0,
                sent: 0,
                ends: VecDeque::new(),
            }),
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
        let record = fitted_record(spans.iter().map(|(_, l)| *l));
        self.frames.push_back(OutFrame {
            write,
            prefix: frame_prefix(len, record, header),
            spans,
            len,
            record: u64::from(record),
            done: 0,
            prefix_sealed: false,
        });
    }

    /// Whether its target closed it (or sent it a byte, which a target
    /// never does): nothing queued on it would land.
    pub(crate) fn closed(&self) -> bool {
        let mut byte = [0u8; 1];
        !matches!(
            self.socket.try_read(&mut byte),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
        )
    }

    /// Registers for a wake-up when its target closes it (the socket turns
    /// readable: a target sends nothing on it).
    pub(crate) fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.socket.poll_read_ready(cx).map(|_| ())
    }

    /// Whether frames wait for the socket.
    pub(crate) fn wants_write(&self) -> bool {
        !self.frames.is_empty() || self.sealing.as_ref().is_some_and(|s| s.sent < s.filled)
    }

    /// The writes queued and not yet sent whole, removed (the stream goes).
    pub(crate) fn take_unsent(&mut self) -> Vec<u64> {
        let mut unsent = Vec::new();
        if let Some(sealing) = &mut self.sealing {
            unsent.extend(sealing.ends.drain(..).map(|(_, write)| write));
            sealing.filled = 0;
            sealing.sent = 0;
        }
        unsent.extend(self.frames.drain(..).map(|f| f.write));
        unsent
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
        let pumped = if self.sealing.is_some() {
            self.write_sealed(memory, sent)
        } else {
            self.write_plain(memory, sent)
        };
        if pumped.moved || !self.wants_write() {
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

    /// The writes of [`OutStream::pump`] on a plain stream: straight from
    /// the pool.
    fn write_plain(&mut self, memory: &MemoryRegistry, sent: &mut Vec<u64>) -> Pumped {
        let mut pumped = Pumped::default();
        let mut budget = TURN_BYTES;
        while budget > 0 {
            let Some(frame) = self.frames.front_mut() else {
                break;
            };
            let head = usize::try_from(frame.done)
                .ok()
                .and_then(|done| frame.prefix.get(done..))
                .filter(|rest| !rest.is_empty());
            let room = MAX_IOV - usize::from(head.is_some());
            self.pieces.clear();
            self.pieces.extend(unsent_pieces(
                &frame.spans,
                PREFIX_BYTES as u64,
                frame.done,
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
                    frame.done += n as u64;
                    if frame.done >= PREFIX_BYTES as u64 + frame.len {
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

    /// The writes of [`OutStream::pump`] on a sealed stream: records are
    /// sealed into the send buffer whenever the socket took all of it.
    fn write_sealed(&mut self, memory: &MemoryRegistry, sent: &mut Vec<u64>) -> Pumped {
        let mut pumped = Pumped::default();
        let Some(sealing) = &mut self.sealing else {
            return pumped;
        };
        let mut budget = TURN_BYTES;
        while budget > 0 {
            if sealing.sent == sealing.filled {
                sealing.filled = 0;
                sealing.sent = 0;
                if !fill(sealing, &mut self.frames, memory) {
                    pumped.broken = true;
                    return pumped;
                }
                if sealing.filled == 0 {
                    break;
                }
            }
            let rest = sealing
                .buf
                .get(sealing.sent..sealing.filled)
                .unwrap_or_default();
            match self.socket.try_write(rest) {
                Ok(0) => {
                    pumped.broken = true;
                    return pumped;
                }
                Ok(n) => {
                    pumped.moved = true;
                    budget = budget.saturating_sub(n);
                    sealing.sent += n;
                    while let Some(&(end, write)) = sealing.ends.front()
                        && end <= sealing.sent
                    {
                        sent.push(write);
                        sealing.ends.pop_front();
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

/// Seals the queued frames' next records into `sealing`'s (empty) buffer,
/// up to about [`FILL_BYTES`]; a frame whose last record is in goes from
/// `frames` to the buffer's ends. `false`: a span is not registered, or the
/// sealer's numbers ran out (the stream must end).
fn fill(sealing: &mut Sealing, frames: &mut VecDeque<OutFrame>, memory: &MemoryRegistry) -> bool {
    let Sealing {
        sealer,
        buf,
        filled,
        ends,
        ..
    } = sealing;
    while *filled < FILL_BYTES {
        let Some(frame) = frames.front_mut() else {
            break;
        };
        if !frame.prefix_sealed {
            let Some(into) = buf.get_mut(*filled..*filled + PREFIX_BYTES) else {
                return false;
            };
            into.copy_from_slice(&frame.prefix);
            let Some(sealed) = seal_at(sealer, RecordKind::Prefix, buf, *filled, PREFIX_BYTES)
            else {
                return false;
            };
            *filled += sealed;
            frame.prefix_sealed = true;
        }
        while frame.done < frame.len && *filled < FILL_BYTES {
            let record = (frame.len - frame.done).min(frame.record);
            let mut into = *filled;
            for (addr, len) in spans_in_range(&frame.spans, frame.done..frame.done + record) {
                let end = into + len as usize;
                // The span is a claimed page of ours (see `pump`).
                let read = buf
                    .get_mut(into..end)
                    .is_some_and(|into| memory.read_into(addr, into).is_ok());
                if !read {
                    return false;
                }
                into = end;
            }
            let Some(sealed) = seal_at(sealer, RecordKind::Payload, buf, *filled, record as usize)
            else {
                return false;
            };
            *filled += sealed;
            frame.done += record;
        }
        if frame.done < frame.len {
            break;
        }
        ends.push_back((*filled, frame.write));
        frames.pop_front();
    }
    true
}

/// Seals the `len` bytes of `buf` at `at` in place as the next `kind`
/// record and writes its tag after them: the bytes they take (`None`: past
/// the buffer, or the sealer's numbers ran out).
fn seal_at(
    sealer: &mut Sealer,
    kind: RecordKind,
    buf: &mut [u8],
    at: usize,
    len: usize,
) -> Option<usize> {
    let tag = sealer.seal(kind, buf.get_mut(at..at + len)?)?;
    buf.get_mut(at + len..at + len + tag.len())?
        .copy_from_slice(&tag);
    Some(len + tag.len())
}
