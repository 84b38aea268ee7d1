//! The doorbell region's layout, as both ends address it: [`SLOTS`] slots
//! of [`SLOT_BYTES`] (one per operation, modulo the count), then
//! [`MAILBOXES`] mailboxes of [`MAILBOX_BYTES`] (one per session key), each
//! ending in its session's owner record ([`OWNER_BYTES`]: a sequence word
//! and the tag a same-host source checks before it maps our pools as the
//! advertiser's, see `crate::wire::record`).

use kvcr_contracts::protocol::{OpHandle, RegionId};

pub(crate) use super::record::SLOT_BYTES;

/// Slots per doorbell: operations `SLOTS` apart share a slot (the later one
/// then overwrites the earlier's record, which falls back to `write_done`).
pub(crate) const SLOTS: u64 = 1024;

/// The byte offset of `op`'s slot in the doorbell region.
pub(crate) fn slot_offset(op: OpHandle) -> usize {
    // `SLOTS` is small, so the slot index always fits.
    (op.0 % SLOTS) as usize * SLOT_BYTES
}

/// Bytes of a doorbell's slots.
pub(crate) const SLOTS_BYTES: usize = SLOTS as usize * SLOT_BYTES;

/// Mailboxes after the slots (sessions beyond it go without one).
pub(crate) const MAILBOXES: usize = 128;
/// Bytes per mailbox: the sequence word, the record, the frame.
pub(crate) const MAILBOX_BYTES: usize = 4096;
/// The sequence word and the record before a mailbox's frame.
pub(super) const MAILBOX_HEAD: usize = 8 + RECORD_BYTES;
/// A mailbox record's bytes (after the sequence word).
pub(super) const RECORD_BYTES: usize = 56;
/// The owner record at the end of a mailbox: a sequence word, the 32-byte
/// tag, padding to keep the next mailbox's word aligned.
pub(crate) const OWNER_BYTES: usize = 64;
/// The largest frame a mailbox carries; a larger request goes by the
/// session alone.
pub(crate) const MAILBOX_FRAME_MAX: usize = MAILBOX_BYTES - MAILBOX_HEAD - OWNER_BYTES;

/// The byte offset of `mailbox`'s owner record (its sequence word).
pub(crate) fn owner_offset(mailbox: usize) -> usize {
    mailbox_offset(mailbox) + MAILBOX_BYTES - OWNER_BYTES
}

/// Bytes of a doorbell region (and file): slots, then mailboxes.
pub(crate) const REGION_BYTES: usize = SLOTS_BYTES + MAILBOXES * MAILBOX_BYTES;
const _: () = assert!(REGION_BYTES.is_multiple_of(SLOT_BYTES) && SLOTS_BYTES.is_multiple_of(8));

/// The mailbox a session key picks.
pub(crate) fn mailbox_of(key: &[u8; 32]) -> usize {
    usize::from(u16::from_le_bytes([key[0], key[1]])) % MAILBOXES
}

/// The byte offset of `mailbox` (its sequence word) in the doorbell region.
pub(crate) fn mailbox_offset(mailbox: usize) -> usize {
    SLOTS_BYTES + (mailbox % MAILBOXES) * MAILBOX_BYTES
}

/// The region id a target's doorbell is advertised under (pools and engine
/// regions take small ids from the region table).
pub(crate) const REGION: RegionId = RegionId(u32::MAX);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_records_stay_inside_their_mailbox_aligned() {
        for mailbox in [0, 1, MAILBOXES - 1] {
            let at = owner_offset(mailbox);
            assert!(at >= mailbox_offset(mailbox) + MAILBOX_HEAD + MAILBOX_FRAME_MAX);
            assert!(at + OWNER_BYTES <= mailbox_offset(mailbox) + MAILBOX_BYTES);
            assert!(at.is_multiple_of(8) && at + OWNER_BYTES <= REGION_BYTES);
        }
    }

    #[test]
    fn slots_stay_inside_the_region() {
        for op in [0, 1, SLOTS - 1, SLOTS, u64::MAX] {
            assert!(slot_offset(OpHandle(op)) + SLOT_BYTES <= REGION_BYTES);
        }
    }
}
