//! Reading a journal back after a crash: the active half's complete records,
//! a torn tail told apart from damage in the middle.

use super::codec::decode;
use super::error::{JournalError, corrupt};
use super::layout::{FRAME_HEADER_LEN, frame_at, half_start, read_header, read_u64};
use super::live::Live;
use super::record::Recovered;

/// Whether a complete frame in sequence at or after `expected` starts at an
/// 8-byte boundary after `from`.
fn later_frame(half: &[u8], from: usize, expected: u64, epoch: u64) -> bool {
    let most = u64::try_from(half.len() / FRAME_HEADER_LEN).unwrap_or(u64::MAX);
    let last = expected.saturating_add(most);
    (from + 8..half.len())
        .step_by(8)
        .filter(|&at| read_u64(half, at + 8).is_some_and(|s| s >= expected && s <= last))
        .any(|at| frame_at(half, at, epoch).is_some())
}

/// Reads a journal: the state its complete records describe.
///
/// `bytes` is the whole region the writer formatted (its length is checked
/// against the header's).
///
/// `Err(Disabled)` when the writer turned the journal off (a cold restart);
/// `Err(Corrupt)` when the bytes are not a journal this version can trust
/// (never for a journal whose writer was merely killed mid-append). Never
/// panics, and allocates no more than the input's size, whatever the bytes.
pub fn recover(bytes: &[u8]) -> Result<Recovered, JournalError> {
    let head = read_header(bytes)?;
    let base = half_start(head.active, head.half_len);
    let half = bytes
        .get(base..base + head.half_len)
        .ok_or_else(|| corrupt(base, "the active half is outside the region"))?;
    let mut live = Live::default();
    let mut at = 0usize;
    let mut expected = 1u64;
    let mut torn_tail = false;
    loop {
        match frame_at(half, at, head.epoch) {
            Some(frame) if frame.seq == expected => {
                let record = decode(frame.payload).map_err(|why| corrupt(base + at, why))?;
                live.push(record)
                    .map_err(|refusal| corrupt(base + at, refusal.why()))?;
                expected += 1;
                at = frame.next;
            }
            Some(_) => return Err(corrupt(base + at, "a record is out of sequence")),
            None => {
                let rest = half.get(at..).unwrap_or_default();
                if rest.iter().any(|&b| b != 0) {
                    if later_frame(half, at, expected, head.epoch) {
                        return Err(corrupt(
                            base + at,
                            "a damaged record is followed by complete ones",
                        ));
                    }
                    torn_tail = true;
                }
                break;
            }
        }
    }
    Ok(live.into_recovered(torn_tail, expected - 1))
}
