//! A data stream's framing, sans-I/O: a dialer's hello, a frame's prefix,
//! which pieces of a frame's spans are still to move, and the target's
//! landing of frames ([`FrameReader`]): what to read next, and what the
//! bytes read mean. The socket and the memory are the driver's
//! ([`crate::net::stream`]); the format is described there.

use kvcr_contracts::endpoint::ControlEndpoint;

use super::record::SLOT_BYTES;

/// What a data stream's dialer writes first (as long as the control
/// channel's, which the listener tells it from).
pub(crate) const PREAMBLE: &[u8; 8] = b"KVCR-D1\0";
/// The longest endpoint claim a dialer may send.
pub(crate) const MAX_CLAIM: usize = 300;
/// Bytes before a frame's payload: its length and its header.
pub(crate) const PREFIX_BYTES: usize = 8 + SLOT_BYTES;

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
pub(crate) fn unsent_pieces(
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
pub(crate) fn hello(claim: &ControlEndpoint) -> Option<Vec<u8>> {
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

/// What the target makes of a frame's prefix (see [`FrameReader`]).
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

/// Where the reader is in the frame it reads.
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

/// What to read next from the stream (see [`FrameReader::want`]).
pub(crate) enum Want<'a> {
    /// Into the rest of the frame's prefix.
    Prefix(&'a mut [u8]),
    /// Into the pieces [`FrameReader::want`] listed: granted spans.
    Payload,
    /// At most this many bytes, to be thrown away.
    Discard(usize),
}

/// The target's landing of frames, one after another: asks the [`Lander`]
/// where each goes, says what to read next, and takes the count of bytes
/// read ([`FrameReader::advance`]).
pub(crate) struct FrameReader<T> {
    state: Recv<T>,
}

impl<T> Default for FrameReader<T> {
    fn default() -> Self {
        Self {
            state: Recv::discarding(0),
        }
    }
}

impl<T> FrameReader<T> {
    /// What to read next. In a payload, the unsent pieces of its granted
    /// spans (at most `max` of them) are put in `pieces`, once `lander`
    /// confirmed they still are granted; a payload whose operation stopped
    /// waiting is discarded from here (the lander is told).
    pub(crate) fn want<L: Lander<Opened = T>>(
        &mut self,
        lander: &mut L,
        pieces: &mut Vec<(u64, u64)>,
        max: usize,
    ) -> Want<'_> {
        if let Recv::Payload {
            opened,
            landed,
            len,
            ..
        } = &self.state
            && !lander.still_granted(opened)
        {
            let left = *len - *landed;
            lander.discarded();
            self.state = Recv::Discard { left };
        }
        match &mut self.state {
            Recv::Prefix { buf, have } => Want::Prefix(buf.get_mut(*have..).unwrap_or_default()),
            Recv::Payload { spans, landed, .. } => {
                pieces.clear();
                pieces.extend(unsent_pieces(spans, 0, *landed, max));
                Want::Payload
            }
            Recv::Discard { left } => {
                Want::Discard(usize::try_from(*left).unwrap_or(usize::MAX).min(256 << 10))
            }
        }
    }

    /// `n` bytes were read as [`FrameReader::want`] said: moves on.
    pub(crate) fn advance<L: Lander<Opened = T>>(&mut self, n: usize, lander: &mut L) {
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

#[cfg(test)]
pub(crate) mod test_lander;
#[cfg(test)]
mod tests;
