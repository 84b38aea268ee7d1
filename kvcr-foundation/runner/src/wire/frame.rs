//! A data stream's framing, sans-I/O: a dialer's hello, a frame's prefix,
//! how a payload is cut into records, which pieces of a frame's spans are
//! still to move, and the target's landing of frames ([`FrameReader`]):
//! what to read next, and what the bytes read mean. The socket and the
//! memory are the driver's ([`crate::net::stream`]); the format is
//! described there, the records' sealing in [`super::sealing`].

use kvcr_contracts::endpoint::ControlEndpoint;

use super::record::SLOT_BYTES;
use super::sealing::{RecordKind, Sealer, TAG_BYTES};

mod reader;

pub(crate) use reader::{FrameReader, Read, Want};

/// What a data stream's dialer writes first (as long as the control
/// channel's, which the listener tells it from).
pub(crate) const PREAMBLE: &[u8; 8] = b"KVCR-D2\0";
/// The longest endpoint claim a dialer may send.
pub(crate) const MAX_CLAIM: usize = 300;
/// Bytes of a frame's prefix: its length, its record size and its header.
pub(crate) const PREFIX_BYTES: usize = 16 + SLOT_BYTES;
/// Most payload bytes in one sealed record: large enough that a record's
/// tag, nonce and reads cost little against its bytes, small enough that a
/// record is sealed and sent, or read and opened, while it is cached.
pub(crate) const MAX_RECORD: u64 = 256 << 10;
/// Records a source cuts to fit its spans are no shorter than this (with
/// smaller elements they run across them, and the target opens each of
/// those in a bounce buffer).
const MIN_FITTED_RECORD: u64 = 16 << 10;

/// A frame's prefix: its payload's length, the size of the payload's
/// records (sealed streams) and its header.
pub(crate) fn frame_prefix(len: u64, record: u32, header: &[u8; SLOT_BYTES]) -> [u8; PREFIX_BYTES] {
    let mut prefix = [0u8; PREFIX_BYTES];
    prefix[..8].copy_from_slice(&len.to_le_bytes());
    prefix[8..12].copy_from_slice(&record.to_le_bytes());
    prefix[16..].copy_from_slice(header);
    prefix
}

/// What a frame's prefix says: its payload's length, the size of its
/// records and its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Prefix {
    pub(crate) len: u64,
    pub(crate) record: u64,
    pub(crate) header: [u8; SLOT_BYTES],
}

/// What `prefix` says, if its reserved bytes are zero and its record size
/// is 1 to [`MAX_RECORD`] (as every record size of a sealed stream is; a
/// plain stream's is not read).
pub(crate) fn parse_prefix(prefix: &[u8; PREFIX_BYTES], sealed: bool) -> Option<Prefix> {
    let len = u64::from_le_bytes(prefix[..8].try_into().ok()?);
    let record = u64::from(u32::from_le_bytes(prefix[8..12].try_into().ok()?));
    if prefix[12..16] != [0; 4] || (sealed && !(1..=MAX_RECORD).contains(&record)) {
        return None;
    }
    let mut header = [0u8; SLOT_BYTES];
    header.copy_from_slice(&prefix[16..]);
    Some(Prefix {
        len,
        record,
        header,
    })
}

/// The record size a source cuts a payload laid over spans of `lens` into:
/// the largest that divides every span's length, at most [`MAX_RECORD`]
/// and at least [`MIN_FITTED_RECORD`], so no record runs across two of the
/// target's elements (whose lengths are the source's spans'); without one,
/// [`MAX_RECORD`].
pub(crate) fn fitted_record(lens: impl IntoIterator<Item = u64>) -> u32 {
    let gcd = lens.into_iter().fold(0u64, |a, b| {
        let (mut a, mut b) = (a, b);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    });
    let fitted = if gcd <= MAX_RECORD {
        Some(gcd)
    } else {
        // The largest divisor of `gcd` not over the maximum (a bounded
        // search: fitting is a saving, not a rule).
        let fewest = gcd.div_ceil(MAX_RECORD);
        (fewest..fewest.saturating_add(4096))
            .find(|parts| gcd % parts == 0)
            .map(|parts| gcd / parts)
    };
    let record = fitted
        .filter(|r| *r >= MIN_FITTED_RECORD)
        .unwrap_or(MAX_RECORD);
    u32::try_from(record).unwrap_or(u32::MAX)
}

/// How many records a payload of `len` bytes is cut into, `record` bytes
/// each (the last one shorter).
pub(crate) fn records_of(len: u64, record: u64) -> u64 {
    len.div_ceil(record.max(1))
}

/// Bytes of a sealed payload of `len` bytes on the wire (its records and
/// their tags), at most `u64::MAX`.
pub(crate) fn sealed_payload_bytes(len: u64, record: u64) -> u64 {
    len.saturating_add(records_of(len, record).saturating_mul(TAG_BYTES as u64))
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

/// A whole frame as a source writes it: its prefix claiming `len` payload
/// bytes in records of `record` bytes under `header`, then `payload` (which
/// a lying source may make shorter or longer), cut into records and sealed
/// by `sealer`, or plain. `None` once the sealer's numbers ran out.
pub(crate) fn seal_frame(
    sealer: Option<&mut Sealer>,
    len: u64,
    record: u32,
    header: &[u8; SLOT_BYTES],
    payload: &[u8],
) -> Option<Vec<u8>> {
    let mut wire = frame_prefix(len, record, header).to_vec();
    let Some(sealer) = sealer else {
        wire.extend_from_slice(payload);
        return Some(wire);
    };
    let tag = sealer.seal(RecordKind::Prefix, &mut wire)?;
    wire.extend_from_slice(&tag);
    for chunk in payload.chunks(usize::try_from(record.max(1)).ok()?) {
        let at = wire.len();
        wire.extend_from_slice(chunk);
        let tag = sealer.seal(RecordKind::Payload, wire.get_mut(at..)?)?;
        wire.extend_from_slice(&tag);
    }
    Some(wire)
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
    /// A record did not open (altered, replayed, moved, cut short, or not
    /// sealed under the stream's key): the stream ends. `opened` is the
    /// frame whose payload it was part of, if one was landing; its spans
    /// hold bytes that are not its source's.
    fn torn(&mut self, opened: Option<Self::Opened>);
}

/// The granted slots a target opens sealed records in.
pub(crate) trait Slots {
    /// Calls `open` with the bytes of `pieces` laid end to end as one slice
    /// (in place when they are one piece) and keeps what it leaves when it
    /// returns `true`. `false` when it returns `false`, or the pieces
    /// cannot be reached.
    fn open_in(&mut self, pieces: &[(u64, u64)], open: &mut dyn FnMut(&mut [u8]) -> bool) -> bool;
}

#[cfg(test)]
pub(crate) mod test_lander;
#[cfg(test)]
mod tests;
