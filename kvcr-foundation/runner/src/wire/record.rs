//! Record keys and the records they seal: a doorbell slot's record, a write
//! message's header and a data stream's proof, each under its own label so
//! none passes for another. Sans-I/O: bytes in, bytes out (a fresh key
//! draws from the OS's random source, nothing else).
//!
//! A target sends each source session a fresh key, only inside that
//! session's encrypted frames; a record verifies only under the key of the
//! session it belongs to (see [`super::doorbell`] for what each kind is
//! trusted for):
//!
//! ```text
//! record := op:u64le  keys:u32le  version:u8=2  tail:u8[3]  tag:u8[32]
//!           digest:u64le  has_digest:u8  zero:u8[7]
//! has_digest := 0 (none) | 1 (the write's) | 2 (the write's, each page hashed
//!               in the source's copy pass and found as deposited; a slot only)
//! tag    := HMAC-SHA256(key, label | op | keys | version | tail | digest | has_digest)
//! label  := "kvcr-doorbell/1" (a slot: tail zero)
//!         | "kvcr-write-message/1" (a message header: tail is its part)
//! proof  := HMAC-SHA256(key, "kvcr-data-stream/2" | challenge | claim | terms)
//! owner  := HMAC-SHA256(key, "kvcr-route-owner/1" | source address, no ?key=)
//! ```
//!
//! The owner tag is what a target writes into its own doorbell file, in the
//! mailbox of the session it advertises `key` on to `source`: a same-host
//! source maps the advertised pools as the advertiser's only when the tag
//! for itself is there (a member replaying the advert it was sent names a
//! key whose tag names that member, and cannot write the file).
//!
//! A mailbox's request records are sealed with the same key (see
//! [`super::mailbox`]).

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::protocol::OpHandle;
use ring::hmac;

use super::part::Part;
use super::sealing::StreamTerms;

/// What a data stream's proof signs: its label, the acceptor's challenge,
/// the endpoint the dialer claims and the terms it asks for (see
/// [`super::sealing::StreamTerms`]).
fn stream_signed(challenge: &[u8; 32], claim: &ControlEndpoint, terms: &[u8]) -> Vec<u8> {
    let claim = claim.to_string();
    let mut signed =
        Vec::with_capacity(STREAM_LABEL.len() + challenge.len() + claim.len() + terms.len());
    signed.extend_from_slice(STREAM_LABEL);
    signed.extend_from_slice(challenge);
    signed.extend_from_slice(claim.as_bytes());
    signed.extend_from_slice(terms);
    signed
}

/// What an owner tag signs: its label and the source it names.
fn owner_signed(source: &ControlEndpoint) -> Vec<u8> {
    [OWNER_LABEL, source.to_string().as_bytes()].concat()
}

/// Bytes per slot (one record).
pub(crate) const SLOT_BYTES: usize = 64;
/// The record layout's version (2: the write's digest is signed).
pub(super) const VERSION: u8 = 2;
/// Bytes the tag covers (after the domain label).
pub(super) const SIGNED: usize = 16;
/// Where the tag starts and ends.
const TAG: std::ops::Range<usize> = SIGNED..SIGNED + 32;
/// The write's digest ([`kvcr_sys::combine_digests`] of its pages') and
/// whether there is one, signed too.
const DIGEST: std::ops::Range<usize> = TAG.end..TAG.end + 9;
/// Domain separation: a doorbell slot's record...
const LABEL: &[u8] = b"kvcr-doorbell/1";
/// ...and a write message's header; the key signs nothing else.
const MESSAGE_LABEL: &[u8] = b"kvcr-write-message/1";
/// ...and a data stream's proof of the key (see [`crate::net::stream`]).
const STREAM_LABEL: &[u8] = b"kvcr-data-stream/2";
/// ...and a target's owner tag for one source (see the module docs).
const OWNER_LABEL: &[u8] = b"kvcr-route-owner/1";
/// Both record labels are this long (the signed buffer's size).
const LABEL_LEN: usize = 20;
const _: () = assert!(LABEL.len() <= LABEL_LEN && MESSAGE_LABEL.len() <= LABEL_LEN);

/// The UCX active message id of a write message.
pub const WRITE_MESSAGE: u16 = 0x6b76;

/// A session's record key.
#[derive(Clone)]
pub(crate) struct RecordKey(pub(super) hmac::Key);

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

    /// The record saying `keys` keys of `op` landed (a doorbell slot's).
    #[cfg(test)]
    pub(crate) fn seal(&self, op: OpHandle, keys: u32) -> [u8; SLOT_BYTES] {
        self.seal_labelled(LABEL, op, keys, [0; 3], None, false)
    }

    /// As [`RecordKey::seal`], carrying the write's digest, and whether the
    /// source hashed each page in the pass that copied it and found it as
    /// deposited (`checked_in_copy`, only with a digest).
    pub(crate) fn seal_digested(
        &self,
        op: OpHandle,
        keys: u32,
        digest: Option<u64>,
        checked_in_copy: bool,
    ) -> [u8; SLOT_BYTES] {
        self.seal_labelled(LABEL, op, keys, [0; 3], digest, checked_in_copy)
    }

    /// The number of keys `record` says landed for `op`, if it is a slot
    /// record of `op` sealed with this key (checked in constant time).
    #[cfg(test)]
    pub(crate) fn open(&self, op: OpHandle, record: &[u8; SLOT_BYTES]) -> Option<u32> {
        self.open_digested(op, record).map(|(keys, _, _)| keys)
    }

    /// As [`RecordKey::open`], with the write's digest it carries and
    /// whether the source checked each page in its copy.
    pub(crate) fn open_digested(
        &self,
        op: OpHandle,
        record: &[u8; SLOT_BYTES],
    ) -> Option<(u32, Option<u64>, bool)> {
        self.open_labelled(LABEL, op, record)
            .and_then(|(keys, tail, digest, checked)| {
                (tail == [0; 3]).then_some((keys, digest, checked))
            })
    }

    /// A write message's header: `part` of the bytes of the first `keys`
    /// keys of `op` is its data.
    #[cfg(test)]
    pub(crate) fn seal_message(&self, op: OpHandle, keys: u32, part: Part) -> [u8; SLOT_BYTES] {
        self.seal_message_digested(op, keys, part, None)
    }

    /// As [`RecordKey::seal_message`], carrying the write's digest.
    pub(crate) fn seal_message_digested(
        &self,
        op: OpHandle,
        keys: u32,
        part: Part,
        digest: Option<u64>,
    ) -> [u8; SLOT_BYTES] {
        self.seal_labelled(MESSAGE_LABEL, op, keys, part.to_bytes(), digest, false)
    }

    /// The number of keys a write message's `header` is a part of for
    /// `op`, and which part, if it was sealed with this key as a message
    /// header.
    #[cfg(test)]
    pub(crate) fn open_message(
        &self,
        op: OpHandle,
        header: &[u8; SLOT_BYTES],
    ) -> Option<(u32, Part)> {
        self.open_message_digested(op, header)
            .map(|(keys, part, _)| (keys, part))
    }

    /// As [`RecordKey::open_message`], with the write's digest it carries.
    pub(crate) fn open_message_digested(
        &self,
        op: OpHandle,
        header: &[u8; SLOT_BYTES],
    ) -> Option<(u32, Part, Option<u64>)> {
        // A message's bytes crossed UCX, not a copy the source hashed: it
        // never claims a check in the copy.
        let (keys, tail, digest, false) = self.open_labelled(MESSAGE_LABEL, op, header)? else {
            return None;
        };
        Some((keys, Part::from_bytes(tail)?, digest))
    }

    /// The proof a data stream's dialer gives for `challenge` (the
    /// acceptor's) as `claim` (the dialer's control endpoint), asking for
    /// `terms`.
    pub(crate) fn stream_proof(
        &self,
        challenge: &[u8; 32],
        claim: &ControlEndpoint,
        terms: &StreamTerms,
    ) -> [u8; 32] {
        let signed = stream_signed(challenge, claim, &terms.to_bytes());
        let mut proof = [0u8; 32];
        proof.copy_from_slice(hmac::sign(&self.0, &signed).as_ref());
        proof
    }

    /// Whether `proof` is [`RecordKey::stream_proof`] of `challenge`,
    /// `claim` and `terms` under this key (checked in constant time).
    pub(crate) fn verify_stream_proof(
        &self,
        challenge: &[u8; 32],
        claim: &ControlEndpoint,
        terms: &StreamTerms,
        proof: &[u8; 32],
    ) -> bool {
        let signed = stream_signed(challenge, claim, &terms.to_bytes());
        hmac::verify(&self.0, &signed, proof).is_ok()
    }

    /// The tag saying this key's session is the doorbell file owner's
    /// session to `source`. It names the source by its address alone: the
    /// owner may have dialed it without its member key (keyless sources
    /// allowed), and the key the tag is under is that session's already.
    pub(crate) fn owner_tag(&self, source: &ControlEndpoint) -> [u8; 32] {
        let mut tag = [0u8; 32];
        let signed = owner_signed(&source.with_key(None));
        tag.copy_from_slice(hmac::sign(&self.0, &signed).as_ref());
        tag
    }

    /// Whether `tag` is [`RecordKey::owner_tag`] for `source` under this
    /// key (checked in constant time).
    pub(crate) fn verify_owner_tag(&self, source: &ControlEndpoint, tag: &[u8]) -> bool {
        hmac::verify(&self.0, &owner_signed(&source.with_key(None)), tag).is_ok()
    }

    fn seal_labelled(
        &self,
        label: &[u8],
        op: OpHandle,
        keys: u32,
        tail: [u8; 3],
        digest: Option<u64>,
        checked_in_copy: bool,
    ) -> [u8; SLOT_BYTES] {
        let mut record = [0u8; SLOT_BYTES];
        record[..8].copy_from_slice(&op.0.to_le_bytes());
        record[8..12].copy_from_slice(&keys.to_le_bytes());
        record[12] = VERSION;
        record[13..SIGNED].copy_from_slice(&tail);
        if let Some(digest) = digest {
            record[DIGEST.start..DIGEST.end - 1].copy_from_slice(&digest.to_le_bytes());
            record[DIGEST.end - 1] = if checked_in_copy { 2 } else { 1 };
        }
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(label);
        ctx.update(&record[..SIGNED]);
        ctx.update(&record[DIGEST]);
        record[TAG].copy_from_slice(ctx.sign().as_ref());
        record
    }

    /// The key count, the three bytes after the version, the digest and
    /// whether it was checked in the copy, of a record of `op` that
    /// verifies under `label`.
    fn open_labelled(
        &self,
        label: &[u8],
        op: OpHandle,
        record: &[u8; SLOT_BYTES],
    ) -> Option<(u32, [u8; 3], Option<u64>, bool)> {
        let has_digest = record[DIGEST.end - 1];
        if record_op(record) != op
            || record[12] != VERSION
            || record[DIGEST.end..] != [0; 7]
            || has_digest > 2
        {
            return None;
        }
        let mut signed = Vec::with_capacity(LABEL_LEN + SIGNED + DIGEST.len());
        signed.extend_from_slice(label);
        signed.extend_from_slice(&record[..SIGNED]);
        signed.extend_from_slice(&record[DIGEST]);
        hmac::verify(&self.0, &signed, &record[TAG]).ok()?;
        let keys = u32::from_le_bytes(record[8..12].try_into().ok()?);
        let tail = record[13..SIGNED].try_into().ok()?;
        let digest = u64::from_le_bytes(record[DIGEST.start..DIGEST.end - 1].try_into().ok()?);
        Some((
            keys,
            tail,
            (has_digest != 0).then_some(digest),
            has_digest == 2,
        ))
    }
}

/// The operation a record names (unverified: a cheap first look).
pub(crate) fn record_op(record: &[u8; SLOT_BYTES]) -> OpHandle {
    let mut op = [0u8; 8];
    op.copy_from_slice(&record[..8]);
    OpHandle(u64::from_le_bytes(op))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::wire::region::SLOTS;
    use proptest::prelude::*;
    use rstest::rstest;

    /// A key of 32 `byte`s (the other wire modules' tests use it too).
    pub(in crate::wire) fn key(byte: u8) -> RecordKey {
        RecordKey::new(&[byte; 32])
    }

    /// A data stream's proof verifies only under its key, for the
    /// challenge it answered, the endpoint it claimed and the terms it asked
    /// for: a recorded proof answers no fresh challenge, vouches for no
    /// other endpoint, and a stream asking for sealed records cannot be
    /// turned into a plain one (nor given another nonce) on the way.
    #[test]
    fn a_stream_proof_verifies_only_for_its_key_challenge_claim_and_terms() {
        let claim: ControlEndpoint = "tcp://10.0.0.1:5000".parse().unwrap();
        let other: ControlEndpoint = "tcp://10.0.0.2:5000".parse().unwrap();
        let terms = StreamTerms {
            sealed: true,
            nonce: [5; 32],
        };
        let plain = StreamTerms {
            sealed: false,
            ..terms
        };
        let renonced = StreamTerms {
            nonce: [6; 32],
            ..terms
        };
        let proof = key(1).stream_proof(&[9; 32], &claim, &terms);
        assert!(key(1).verify_stream_proof(&[9; 32], &claim, &terms, &proof));
        assert!(!key(2).verify_stream_proof(&[9; 32], &claim, &terms, &proof));
        assert!(!key(1).verify_stream_proof(&[8; 32], &claim, &terms, &proof));
        assert!(!key(1).verify_stream_proof(&[9; 32], &other, &terms, &proof));
        assert!(!key(1).verify_stream_proof(&[9; 32], &claim, &plain, &proof));
        assert!(!key(1).verify_stream_proof(&[9; 32], &claim, &renonced, &proof));
        // Nor does a record of the same key pass for a proof.
        let record = key(1).seal(OpHandle(9), 9);
        let mut as_proof = [0u8; 32];
        as_proof.copy_from_slice(&record[TAG]);
        assert!(!key(1).verify_stream_proof(&[9; 32], &claim, &terms, &as_proof));
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

    /// A record's digest is signed: it opens as sealed, and any changed
    /// bit of it (or of its flag) refuses the record.
    #[rstest::rstest]
    fn a_records_digest_is_signed(#[values(false, true)] checked_in_copy: bool) {
        let digest = 0x1234_5678_9abc_def0;
        let record = key(1).seal_digested(OpHandle(42), 3, Some(digest), checked_in_copy);
        let expect = Some((3, Some(digest), checked_in_copy));
        assert_eq!(key(1).open_digested(OpHandle(42), &record), expect);
        let header = key(1).seal_message_digested(OpHandle(42), 3, Part::WHOLE, Some(7));
        let opened = key(1).open_message_digested(OpHandle(42), &header);
        assert_eq!(opened, Some((3, Part::WHOLE, Some(7))));
        for at in DIGEST.start..SLOT_BYTES {
            for bit in 0..8 {
                let mut forged = record;
                forged[at] ^= 1 << bit;
                let opened = key(1).open_digested(OpHandle(42), &forged);
                assert_eq!(opened, None, "byte {at} bit {bit}");
            }
        }
        let none = key(1).seal_digested(OpHandle(42), 3, None, false);
        assert_eq!(
            key(1).open_digested(OpHandle(42), &none),
            Some((3, None, false))
        );
    }

    /// Only a slot's record says its pages were checked in the copy: a
    /// write message header that says so (its bytes crossed UCX) is refused,
    /// though signed.
    #[test]
    fn a_message_header_never_claims_a_check_in_the_copy() {
        let header = key(1).seal_labelled(
            MESSAGE_LABEL,
            OpHandle(42),
            3,
            Part::WHOLE.to_bytes(),
            Some(7),
            true,
        );
        assert_eq!(key(1).open_message_digested(OpHandle(42), &header), None);
    }

    #[test]
    fn a_blank_slot_is_nothing() {
        assert_eq!(key(1).open(OpHandle(0), &[0; SLOT_BYTES]), None);
    }

    /// A message header is a record under its own label: a slot record
    /// never opens as one, nor the reverse.
    #[test]
    fn message_headers_and_slot_records_never_pass_for_each_other() {
        let header = key(1).seal_message(OpHandle(42), 3, Part::WHOLE);
        assert_eq!(
            key(1).open_message(OpHandle(42), &header),
            Some((3, Part::WHOLE))
        );
        assert_eq!(key(1).open(OpHandle(42), &header), None);
        let record = key(1).seal(OpHandle(42), 3);
        assert_eq!(key(1).open_message(OpHandle(42), &record), None);
        assert_eq!(key(2).open_message(OpHandle(42), &header), None);
        for at in 0..SLOT_BYTES {
            let mut forged = header;
            forged[at] ^= 1;
            assert_eq!(
                key(1).open_message(OpHandle(42), &forged),
                None,
                "byte {at}"
            );
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
