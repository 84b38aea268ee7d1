//! Doorbell records: a source's early word that a write's bytes landed.
//!
//! A target advertises a doorbell (a region of [`SLOTS`] slots of
//! [`SLOT_BYTES`]) and, per session, a fresh key sent only inside that
//! session's encrypted frames. When a write's bytes are in place — after
//! its copies on one host, or fenced behind its puts over UCX — the source
//! writes a record into slot `op % SLOTS` naming the target's operation and
//! how many keys landed (always every key asked for: partial outcomes go by
//! `write_done` alone). The target, polling the slots of operations it is
//! waiting on, takes a record that verifies as that session's `write_done`;
//! the source still sends the `write_done` itself, which then arrives as a
//! duplicate and is ignored.
//!
//! What a record is trusted for: it verifies only under the key of the
//! session the operation was sent on, names that operation, and is taken
//! only while the target waits on it; anything else (another session's
//! record, a replay, a torn or forged write, a stale record of an earlier
//! operation in the same slot) fails to verify or to match and is ignored
//! — the target then waits for the control reply as before. A doorbell
//! never makes a completion believable that the control channel would not.
//!
//! ```text
//! record := op:u64le  keys:u32le  version:u8=1  zero:u8[3]  tag:u8[32]  zero:u8[16]
//! tag    := HMAC-SHA256(key, "kvcr-doorbell/1" | op | keys | version | zero)
//! ```

use kvcr_contracts::protocol::OpHandle;
use ring::hmac;

/// Bytes per slot (one record).
pub(crate) const SLOT_BYTES: usize = 64;
/// Slots per doorbell: operations `SLOTS` apart share a slot (the later one
/// then overwrites the earlier's record, which falls back to `write_done`).
pub(crate) const SLOTS: u64 = 1024;
/// The record layout's version.
const VERSION: u8 = 1;
/// Bytes the tag covers (after the domain label).
const SIGNED: usize = 16;
/// Where the tag starts and ends.
const TAG: std::ops::Range<usize> = SIGNED..SIGNED + 32;
/// Domain separation: this key signs nothing else.
const LABEL: &[u8] = b"kvcr-doorbell/1";

/// A session's record key.
pub(crate) struct RecordKey(hmac::Key);

impl RecordKey {
    pub(crate) fn new(bytes: &[u8; 32]) -> Self {
        Self(hmac::Key::new(hmac::HMAC_SHA256, bytes))
    }

    /// A fresh random key and its bytes (for the advert).
    pub(crate) fn generate() -> Option<(Self, [u8; 32])> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).ok()?;
        Some((Self::new(&bytes), bytes))
    }

    fn tag(&self, signed: &[u8]) -> hmac::Tag {
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(LABEL);
        ctx.update(signed);
        ctx.sign()
    }

    /// The record saying `keys` keys of `op` landed.
    pub(crate) fn seal(&self, op: OpHandle, keys: u32) -> [u8; SLOT_BYTES] {
        let mut record = [0u8; SLOT_BYTES];
        record[..8].copy_from_slice(&op.0.to_le_bytes());
        record[8..12].copy_from_slice(&keys.to_le_bytes());
        record[12] = VERSION;
        let tag = self.tag(&record[..SIGNED]);
        record[TAG].copy_from_slice(tag.as_ref());
        record
    }

    /// The number of keys `record` says landed for `op`, if it is a record
    /// of `op` sealed with this key (checked in constant time).
    pub(crate) fn open(&self, op: OpHandle, record: &[u8; SLOT_BYTES]) -> Option<u32> {
        if record_op(record) != op || record[12] != VERSION || record[13..SIGNED] != [0; 3] {
            return None;
        }
        let mut signed = [0u8; LABEL.len() + SIGNED];
        signed[..LABEL.len()].copy_from_slice(LABEL);
        signed[LABEL.len()..].copy_from_slice(&record[..SIGNED]);
        hmac::verify(&self.0, &signed, &record[TAG]).ok()?;
        let keys = u32::from_le_bytes(record[8..12].try_into().ok()?);
        Some(keys)
    }
}

/// The operation a record names (unverified: a cheap first look).
pub(crate) fn record_op(record: &[u8; SLOT_BYTES]) -> OpHandle {
    let mut op = [0u8; 8];
    op.copy_from_slice(&record[..8]);
    OpHandle(u64::from_le_bytes(op))
}

/// The byte offset of `op`'s slot in the doorbell region.
pub(crate) fn slot_offset(op: OpHandle) -> usize {
    // `SLOTS` is small, so the slot index always fits.
    (op.0 % SLOTS) as usize * SLOT_BYTES
}

/// Bytes of a doorbell region.
pub(crate) const REGION_BYTES: usize = SLOTS as usize * SLOT_BYTES;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rstest::rstest;

    fn key(byte: u8) -> RecordKey {
        RecordKey::new(&[byte; 32])
    }

    #[test]
    fn a_sealed_record_opens_under_its_key_for_its_op() {
        let record = key(1).seal(OpHandle(42), 3);
        assert_eq!(record_op(&record), OpHandle(42));
        assert_eq!(key(1).open(OpHandle(42), &record), Some(3));
    }

    /// The layout is a wire format between two processes: pinned.
    #[test]
    fn the_record_layout_is_pinned() {
        let record = key(7).seal(OpHandle(0x0102_0304_0506_0708), 9);
        let hex: Vec<String> = record
            .chunks(16)
            .map(|c| c.iter().map(|b| format!("{b:02x}")).collect())
            .collect();
        insta::assert_snapshot!(hex.join("\n"));
    }

    /// Another session's key, or another operation (a stale record in a
    /// shared slot, a replay): refused.
    #[rstest]
    #[case::another_key(2, 42)]
    #[case::another_op(1, 43)]
    #[case::the_slot_mate(1, 42 + SLOTS)]
    fn a_record_opens_for_nothing_else(#[case] key_byte: u8, #[case] op: u64) {
        let record = key(1).seal(OpHandle(42), 3);
        assert_eq!(key(key_byte).open(OpHandle(op), &record), None);
    }

    #[test]
    fn any_changed_bit_of_a_record_is_refused() {
        let record = key(1).seal(OpHandle(42), 3);
        for at in 0..SIGNED + 32 {
            for bit in 0..8 {
                let mut forged = record;
                forged[at] ^= 1 << bit;
                // A changed op byte names another op; the caller asks for 42.
                assert_eq!(
                    key(1).open(OpHandle(42), &forged),
                    None,
                    "byte {at} bit {bit}"
                );
            }
        }
    }

    #[test]
    fn a_blank_slot_is_nothing() {
        assert_eq!(key(1).open(OpHandle(0), &[0; SLOT_BYTES]), None);
    }

    #[test]
    fn slots_stay_inside_the_region() {
        for op in [0, 1, SLOTS - 1, SLOTS, u64::MAX] {
            assert!(slot_offset(OpHandle(op)) + SLOT_BYTES <= REGION_BYTES);
        }
    }

    proptest! {
        /// Arbitrary bytes never open (a hostile writer of the slot).
        #[test]
        fn garbage_never_opens(bytes in proptest::collection::vec(any::<u8>(), SLOT_BYTES)) {
            let mut record = [0u8; SLOT_BYTES];
            record.copy_from_slice(&bytes);
            let op = record_op(&record);
            prop_assert_eq!(key(1).open(op, &record), None);
        }
    }
}
