//! The target's landing of frames, one after another ([`FrameReader`]):
//! what to read next from the stream, and what the bytes read mean. On a
//! sealed stream each record's ciphertext is read straight into the granted
//! slots it belongs in and opened there once its tag is in; a record that
//! does not open ends the stream.

use super::super::sealing::{Opener, RecordKind, TAG_BYTES};
use super::{
    Lander, Landing, PREFIX_BYTES, Slots, parse_prefix, records_of, sealed_payload_bytes,
    unsent_pieces,
};
use crate::wire::part::spans_in_range;

/// Bytes of a prefix and its tag.
const SEALED_PREFIX: usize = PREFIX_BYTES + TAG_BYTES;

/// Where the reader is in the frame it reads.
enum Recv<T> {
    Prefix {
        buf: [u8; SEALED_PREFIX],
        have: usize,
    },
    Payload(Payload<T>),
    Discard {
        left: u64,
    },
    /// A record did not open: nothing more is read.
    Torn,
}

/// A payload landing in granted spans.
struct Payload<T> {
    opened: T,
    spans: Vec<(u64, u64)>,
    len: u64,
    /// Bytes per record (a plain stream's payload is one record, untagged).
    record: u64,
    /// Payload bytes of the records landed whole (opened, when sealed).
    landed: u64,
    /// Bytes of the current record read into its spans.
    body: u64,
    /// Bytes of the current record's tag read.
    tag_have: usize,
}

impl<T> Payload<T> {
    /// Bytes of the current record.
    fn current(&self) -> u64 {
        (self.len - self.landed).min(self.record)
    }
}

impl<T> Recv<T> {
    /// Discards `left` bytes, then reads the next prefix (at once when 0).
    fn discarding(left: u64) -> Self {
        if left == 0 {
            Recv::Prefix {
                buf: [0; SEALED_PREFIX],
                have: 0,
            }
        } else {
            Recv::Discard { left }
        }
    }
}

/// What to read next from the stream (see [`FrameReader::want`]).
pub(crate) enum Want<'a> {
    /// Into this buffer (a prefix, a tag).
    Bytes(&'a mut [u8]),
    /// Into the pieces [`FrameReader::want`] listed: granted spans.
    Payload,
    /// At most this many bytes, to be thrown away.
    Discard(usize),
    /// Nothing: a record did not open, the stream is over.
    Nothing,
}

/// Whether the stream goes on after the bytes read (see
/// [`FrameReader::advance`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read {
    /// It does.
    Going,
    /// A record did not open: the stream must end.
    Torn,
}

/// The wire bytes of `payload`'s frame still to come, its records' numbers
/// passed over by `opener` (it is read past from here).
fn rest_of<T>(opener: &mut Option<Opener>, payload: &Payload<T>) -> u64 {
    let unlanded = payload.len - payload.landed;
    match opener {
        None => unlanded - payload.body,
        Some(opener) => {
            opener.skip(records_of(unlanded, payload.record));
            sealed_payload_bytes(unlanded, payload.record) - payload.body - payload.tag_have as u64
        }
    }
}

/// The target's landing of frames, one after another: asks the [`Lander`]
/// where each goes, says what to read next, and takes the count of bytes
/// read ([`FrameReader::advance`]), opening sealed records in place.
pub(crate) struct FrameReader<T> {
    state: Recv<T>,
    /// The stream's records' opener (`None`: a plain stream).
    opener: Option<Opener>,
    tag: [u8; TAG_BYTES],
}

impl<T> FrameReader<T> {
    /// A reader of a stream sealed by `opener`'s key (`None`: plain).
    pub(crate) fn new(opener: Option<Opener>) -> Self {
        Self {
            state: Recv::discarding(0),
            opener,
            tag: [0; TAG_BYTES],
        }
    }

    fn sealed(&self) -> bool {
        self.opener.is_some()
    }

    /// What to read next. In a payload, the unsent pieces of its current
    /// record's spans (at most `max` of them) are put in `pieces`, once
    /// `lander` confirmed they still are granted; a payload whose operation
    /// stopped waiting is discarded from here (the lander is told).
    pub(crate) fn want<L: Lander<Opened = T>>(
        &mut self,
        lander: &mut L,
        pieces: &mut Vec<(u64, u64)>,
        max: usize,
    ) -> Want<'_> {
        if let Recv::Payload(payload) = &self.state
            && !lander.still_granted(&payload.opened)
        {
            let left = rest_of(&mut self.opener, payload);
            lander.discarded();
            self.state = Recv::Discard { left };
        }
        let prefix_bytes = if self.sealed() {
            SEALED_PREFIX
        } else {
            PREFIX_BYTES
        };
        match &mut self.state {
            Recv::Prefix { buf, have } => {
                Want::Bytes(buf.get_mut(*have..prefix_bytes).unwrap_or_default())
            }
            Recv::Payload(payload) if payload.body < payload.current() => {
                let (from, to) = (
                    payload.landed + payload.body,
                    payload.landed + payload.current(),
                );
                pieces.clear();
                let mut room = to - from;
                for (start, len) in unsent_pieces(&payload.spans, 0, from, max) {
                    if room == 0 {
                        break;
                    }
                    let take = len.min(room);
                    pieces.push((start, take));
                    room -= take;
                }
                Want::Payload
            }
            Recv::Payload(payload) => {
                Want::Bytes(self.tag.get_mut(payload.tag_have..).unwrap_or_default())
            }
            Recv::Discard { left } => {
                Want::Discard(usize::try_from(*left).unwrap_or(usize::MAX).min(256 << 10))
            }
            Recv::Torn => Want::Nothing,
        }
    }

    /// `n` bytes were read as [`FrameReader::want`] said: moves on, opening
    /// a record in `slots` once its tag is in.
    pub(crate) fn advance<L: Lander<Opened = T>>(
        &mut self,
        n: usize,
        lander: &mut L,
        slots: &mut impl Slots,
    ) -> Read {
        match &mut self.state {
            Recv::Prefix { buf, have } => {
                *have += n;
                let buf = *buf;
                self.prefix_read(buf, lander)
            }
            Recv::Payload(payload) if payload.body < payload.current() => {
                payload.body += n as u64;
                if self.opener.is_none() && payload.body == payload.current() {
                    return self.record_landed(lander);
                }
                Read::Going
            }
            Recv::Payload(payload) => {
                payload.tag_have += n;
                if payload.tag_have < TAG_BYTES {
                    return Read::Going;
                }
                let pieces = spans_in_range(
                    &payload.spans,
                    payload.landed..payload.landed + payload.current(),
                );
                let tag = self.tag;
                let opened = self.opener.as_mut().is_some_and(|opener| {
                    slots.open_in(&pieces, &mut |bytes| {
                        opener.open(RecordKind::Payload, bytes, &tag)
                    })
                });
                if !opened {
                    return self.tear(lander);
                }
                self.record_landed(lander)
            }
            Recv::Discard { left } => {
                *left = left.saturating_sub(n as u64);
                if *left == 0 {
                    self.state = Recv::discarding(0);
                }
                Read::Going
            }
            Recv::Torn => Read::Torn,
        }
    }

    /// The current record of a payload landed whole: on to the next, or
    /// the frame landed.
    fn record_landed<L: Lander<Opened = T>>(&mut self, lander: &mut L) -> Read {
        if let Recv::Payload(payload) = &mut self.state {
            payload.landed += payload.current();
            payload.body = 0;
            payload.tag_have = 0;
            if payload.landed < payload.len {
                return Read::Going;
            }
        }
        if let Recv::Payload(payload) = std::mem::replace(&mut self.state, Recv::discarding(0)) {
            lander.landed(payload.opened);
        }
        Read::Going
    }

    /// A record did not open: the stream ends.
    fn tear<L: Lander<Opened = T>>(&mut self, lander: &mut L) -> Read {
        match std::mem::replace(&mut self.state, Recv::Torn) {
            Recv::Payload(payload) => lander.torn(Some(payload.opened)),
            _ => lander.torn(None),
        }
        Read::Torn
    }

    /// `buf` holds the prefix read so far: once whole, opened (sealed) and
    /// handed to `lander`.
    fn prefix_read<L: Lander<Opened = T>>(
        &mut self,
        mut buf: [u8; SEALED_PREFIX],
        lander: &mut L,
    ) -> Read {
        let Recv::Prefix { have, .. } = self.state else {
            return Read::Going;
        };
        let sealed = self.sealed();
        if have < if sealed { SEALED_PREFIX } else { PREFIX_BYTES } {
            return Read::Going;
        }
        let (plain, tag) = buf.split_at_mut(PREFIX_BYTES);
        if let Some(opener) = &mut self.opener {
            let tag: &[u8; TAG_BYTES] = match (&*tag).try_into() {
                Ok(tag) => tag,
                Err(_) => return self.tear(lander),
            };
            if !opener.open(RecordKind::Prefix, plain, tag) {
                return self.tear(lander);
            }
        }
        let prefix = <&[u8; PREFIX_BYTES]>::try_from(&*plain)
            .ok()
            .and_then(|plain| parse_prefix(plain, sealed));
        // Sealed by the stream's key, yet not a prefix: a source that does
        // not speak the format.
        let Some(prefix) = prefix else {
            return self.tear(lander);
        };
        let record = if sealed { prefix.record } else { prefix.len };
        self.state = match lander.open(prefix.len, &prefix.header) {
            // The lander's spans are exactly the payload (checked again
            // here: a payload read past them would desync).
            Landing::Into(opened, spans)
                if spans.iter().map(|(_, l)| *l).sum::<u64>() == prefix.len && prefix.len > 0 =>
            {
                Recv::Payload(Payload {
                    opened,
                    spans,
                    len: prefix.len,
                    record,
                    landed: 0,
                    body: 0,
                    tag_have: 0,
                })
            }
            Landing::Into(..) | Landing::Discard => {
                lander.discarded();
                let left = match &mut self.opener {
                    None => prefix.len,
                    Some(opener) => {
                        opener.skip(records_of(prefix.len, record));
                        sealed_payload_bytes(prefix.len, record)
                    }
                };
                Recv::discarding(left)
            }
        };
        Read::Going
    }
}
