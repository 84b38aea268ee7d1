//! Where a journal's bytes are: its sizes and caps, the header's fields,
//! the two halves and the frames in them, and the checks that read them back.

use super::crc::{frame_crc, slot_crc};
use super::error::{DisabledReason, JournalError, corrupt};

/// The header's magic.
pub const MAGIC: [u8; 8] = *b"KVCRJNL1";
/// The format version this module writes and reads.
pub const VERSION: u32 = 1;
/// Bytes of the header.
pub const HEADER_LEN: usize = 64;
/// Bytes of a record frame's header (len, crc32, seq).
pub const FRAME_HEADER_LEN: usize = 16;
/// The smallest half a journal is formatted with.
pub const MIN_HALF_LEN: usize = 256;
/// The smallest region [`JournalWriter::format`](super::JournalWriter::format) accepts.
pub const MIN_REGION_LEN: usize = HEADER_LEN + 2 * MIN_HALF_LEN;
/// Most slots in one record (a page's slots, or one Held / Freed record).
pub const MAX_SLOTS: usize = 4096;
/// Most token ids of one page.
pub const MAX_TOKEN_IDS: usize = 65_536;
/// Most bytes of a LoRA name or cache salt.
pub const MAX_STRING: usize = 4096;
/// Most bytes of one record's payload (a Ready at both caps; a Namespace at
/// both string caps is smaller).
pub const MAX_PAYLOAD: usize = 1 + 8 + 8 + 2 + 1 + 8 + 4 + 4 * MAX_SLOTS + 4 + 4 * MAX_TOKEN_IDS;

pub(super) const OFF_VERSION: usize = 8;
pub(super) const OFF_STATE: usize = 12;
pub(super) const OFF_LENGTH: usize = 16;
pub(super) const OFF_HALF: usize = 24;
pub(super) const OFF_SLOTS: [usize; 2] = [32, 48];
pub(super) const SLOT_LEN: usize = 16;

pub(super) const STATE_OK: u32 = 0;
pub(super) const CODE_OVERFLOW: u32 = 1;
pub(super) const CODE_REQUESTED: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Half {
    Zero,
    One,
}

impl Half {
    pub(super) fn other(self) -> Self {
        match self {
            Self::Zero => Self::One,
            Self::One => Self::Zero,
        }
    }

    pub(super) fn byte(self) -> u8 {
        match self {
            Self::Zero => 0,
            Self::One => 1,
        }
    }

    pub(super) fn slot_offset(self) -> usize {
        match self {
            Self::Zero => OFF_SLOTS[0],
            Self::One => OFF_SLOTS[1],
        }
    }
}

/// Bytes of one half of a region of `len` bytes.
pub(super) fn half_len(len: usize) -> usize {
    (len.saturating_sub(HEADER_LEN) / 2) & !7
}

pub(super) fn half_start(half: Half, half_len: usize) -> usize {
    match half {
        Half::Zero => HEADER_LEN,
        Half::One => HEADER_LEN + half_len,
    }
}

const fn align8(n: usize) -> usize {
    (n + 7) & !7
}

/// Bytes a record of `payload` bytes takes in a half.
pub(super) const fn frame_len(payload: usize) -> usize {
    FRAME_HEADER_LEN + align8(payload)
}

pub(super) fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_le_bytes(b))
}

pub(super) fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let b: [u8; 8] = bytes.get(at..at.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

pub(super) fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// What a valid header says.
#[derive(Debug, Clone, Copy)]
pub(super) struct Header {
    pub(super) half_len: usize,
    pub(super) active: Half,
    pub(super) epoch: u64,
}

/// A commit slot's epoch, when the slot is valid.
fn slot_epoch(bytes: &[u8], half: Half) -> Option<u64> {
    let at = half.slot_offset();
    let epoch = read_u64(bytes, at)?;
    let crc = read_u32(bytes, at + 8)?;
    let reserved = read_u32(bytes, at + 12)?;
    (epoch >= 1 && reserved == 0 && crc == slot_crc(half, epoch)).then_some(epoch)
}

pub(super) fn read_header(bytes: &[u8]) -> Result<Header, JournalError> {
    if bytes.len() < MIN_REGION_LEN {
        return Err(corrupt(0, "the region is smaller than a journal"));
    }
    if bytes.get(..MAGIC.len()) != Some(MAGIC.as_slice()) {
        return Err(corrupt(0, "bad magic"));
    }
    if read_u32(bytes, OFF_VERSION) != Some(VERSION) {
        return Err(corrupt(OFF_VERSION, "unsupported version"));
    }
    let length = read_u64(bytes, OFF_LENGTH).and_then(|l| usize::try_from(l).ok());
    if length != Some(bytes.len()) {
        return Err(corrupt(OFF_LENGTH, "the length differs from the region's"));
    }
    let half_len = half_len(bytes.len());
    let stored_half = read_u64(bytes, OFF_HALF).and_then(|l| usize::try_from(l).ok());
    if stored_half != Some(half_len) {
        return Err(corrupt(
            OFF_HALF,
            "the half length does not match the region",
        ));
    }
    match read_u32(bytes, OFF_STATE) {
        Some(STATE_OK) => {}
        Some(code) => return Err(JournalError::Disabled(DisabledReason::from_code(code))),
        None => return Err(corrupt(OFF_STATE, "no state word")),
    }
    let (active, epoch) = match (slot_epoch(bytes, Half::Zero), slot_epoch(bytes, Half::One)) {
        (None, None) => return Err(corrupt(OFF_SLOTS[0], "no valid commit slot")),
        (Some(e), None) => (Half::Zero, e),
        (None, Some(e)) => (Half::One, e),
        (Some(a), Some(b)) if a > b => (Half::Zero, a),
        (Some(a), Some(b)) if b > a => (Half::One, b),
        (Some(_), Some(_)) => return Err(corrupt(OFF_SLOTS[0], "both halves claim one epoch")),
    };
    Ok(Header {
        half_len,
        active,
        epoch,
    })
}

/// A complete frame at `at` in `half`.
pub(super) struct Frame<'a> {
    pub(super) seq: u64,
    pub(super) payload: &'a [u8],
    /// Where the next frame starts.
    pub(super) next: usize,
}

pub(super) fn frame_at(half: &[u8], at: usize, epoch: u64) -> Option<Frame<'_>> {
    let len = read_u32(half, at)?;
    let crc = read_u32(half, at + 4)?;
    let seq = read_u64(half, at + 8)?;
    let n = usize::try_from(len).ok()?;
    if n == 0 || n > MAX_PAYLOAD {
        return None;
    }
    let start = at.checked_add(FRAME_HEADER_LEN)?;
    let payload = half.get(start..start.checked_add(n)?)?;
    if frame_crc(epoch, len, seq, payload) != crc {
        return None;
    }
    Some(Frame {
        seq,
        payload,
        next: at.checked_add(frame_len(n))?,
    })
}
