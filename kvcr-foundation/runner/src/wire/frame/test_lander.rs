//! Test support for the framing: a lander that records what it was told,
//! and frames built by hand. The framing's own tests and the data stream's
//! socket tests both read frames through it.

use super::{Lander, Landing, frame_prefix};
use crate::wire::record::SLOT_BYTES;

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
}

/// One frame on the wire: a header whose first two bytes are `kind` and
/// `tag`, then `payload`.
pub(crate) fn frame(kind: u8, tag: u8, payload: &[u8]) -> Vec<u8> {
    let mut header = [0u8; SLOT_BYTES];
    header[0] = kind;
    header[1] = tag;
    let mut bytes = frame_prefix(payload.len() as u64, &header).to_vec();
    bytes.extend_from_slice(payload);
    bytes
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
    /// The frames, with a first (discarded) frame of `skipped` bytes.
    pub(crate) fn new(skipped: usize) -> Self {
        let payload: Vec<u8> = (0..8000u32).map(|i| (i * 7 % 251) as u8).collect();
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
