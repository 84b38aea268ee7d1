//! Test support for the framing: a lander that records what it was told,
//! slots in a plain buffer, and frames built by hand (plain or sealed). The
//! framing's own tests and the data stream's socket tests both read frames
//! through it.

use super::{Lander, Landing, MAX_RECORD, Slots, seal_frame};
use crate::wire::record::SLOT_BYTES;
use crate::wire::sealing::Sealer;

/// A lander that grants each frame whose header's first byte is 1 the
/// spans it was given, discards the rest, and records what happened.
pub(crate) struct Recorder {
    pub(crate) spans: Vec<(u64, u64)>,
    pub(crate) granted: bool,
    pub(crate) events: Vec<String>,
}

impl Recorder {
    /// A recorder that grants frames `spans` and has recorded nothing yet.
    pub(crate) fn granting(spans: Vec<(u64, u64)>) -> Self {
        Self {
            spans,
            granted: true,
            events: Vec::new(),
        }
    }
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

    fn torn(&mut self, opened: Option<u8>) {
        self.events.push(match opened {
            Some(tag) => format!("torn {tag}"),
            None => "torn".to_owned(),
        });
    }
}

/// Slots that are offsets into a buffer of the test's.
pub(crate) struct BufferSlots<'a>(pub(crate) &'a mut [u8]);

impl Slots for BufferSlots<'_> {
    fn open_in(&mut self, pieces: &[(u64, u64)], open: &mut dyn FnMut(&mut [u8]) -> bool) -> bool {
        let range = |(at, len): (u64, u64)| at as usize..(at + len) as usize;
        if let [piece] = pieces {
            return open(&mut self.0[range(*piece)]);
        }
        let mut bounce: Vec<u8> = pieces
            .iter()
            .flat_map(|p| self.0[range(*p)].to_vec())
            .collect();
        if !open(&mut bounce) {
            return false;
        }
        let mut from = 0;
        for piece in pieces {
            let len = piece.1 as usize;
            self.0[range(*piece)].copy_from_slice(&bounce[from..from + len]);
            from += len;
        }
        true
    }
}

/// A frame's header whose first two bytes are `kind` and `tag`.
pub(crate) fn header(kind: u8, tag: u8) -> [u8; SLOT_BYTES] {
    let mut header = [0u8; SLOT_BYTES];
    header[0] = kind;
    header[1] = tag;
    header
}

/// One frame on the wire: a header of `kind` and `tag`, then `payload`;
/// sealed by `sealer` in records of `record` bytes, or plain.
pub(crate) fn frame(sealer: Option<&mut Sealer>, kind: u8, tag: u8, payload: &[u8]) -> Vec<u8> {
    frame_in(sealer, kind, tag, payload, MAX_RECORD as u32)
}

/// As [`frame`], in records of `record` bytes.
pub(crate) fn frame_in(
    sealer: Option<&mut Sealer>,
    kind: u8,
    tag: u8,
    payload: &[u8],
    record: u32,
) -> Vec<u8> {
    let header = header(kind, tag);
    seal_frame(sealer, payload.len() as u64, record, &header, payload).unwrap()
}

/// One granted frame among frames that do not open, and what a
/// [`Recorder`] reading them all records.
pub(crate) struct GrantedAmongOthers {
    /// The granted frame's 8000 payload bytes (tag 9).
    pub(crate) payload: Vec<u8>,
    /// A `skipped`-byte frame, the granted one, an empty one, a 10-byte one.
    pub(crate) wire: Vec<u8>,
    /// The lander's events for `wire`, in order.
    pub(crate) events: Vec<String>,
}

impl GrantedAmongOthers {
    /// The frames, with a first (discarded) frame of `skipped` bytes, sealed
    /// by `sealer` in records of `record` bytes (or plain).
    pub(crate) fn new(skipped: usize, mut sealer: Option<&mut Sealer>, record: u32) -> Self {
        let payload: Vec<u8> = (0..8000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut frame =
            |kind, tag, payload: &[u8]| frame_in(sealer.as_deref_mut(), kind, tag, payload, record);
        let mut wire = frame(0, 0, &vec![0xee; skipped]);
        wire.extend(frame(1, 9, &payload));
        wire.extend(frame(0, 0, &[]));
        wire.extend(frame(0, 0, &[0xdd; 10]));
        let events = [
            &format!("open 0 {skipped}"),
            "discarded",
            "open 1 8000",
            "landed 9",
            "open 0 0",
            "discarded",
            "open 0 10",
            "discarded",
        ]
        .map(str::to_owned)
        .to_vec();
        Self {
            payload,
            wire,
            events,
        }
    }
}
