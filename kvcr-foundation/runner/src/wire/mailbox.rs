//! Requests in a mailbox: the record format, and how a source reads its
//! mailbox (a seqlock protocol over whatever maps it). Sans-I/O: the
//! memory is read through [`MailboxView`], which the driver implements over
//! its mapping of the target's doorbell file.
//!
//! The file runs the other way too. After the slots it holds [`MAILBOXES`]
//! mailboxes of [`MAILBOX_BYTES`], each a target's to write and one source's
//! to read: the session key picks it (its first two bytes, modulo the count;
//! the target draws keys until no other live session holds that mailbox).
//! Once a source has said it maps the file (a one-copy acknowledgement), the
//! target writes each `start_write` it sends that source into the mailbox as
//! well, as the session's message number `index` (the control channel counts
//! every message of a session on both ends). The source's peer thread, while
//! it is awake, looks at the mailbox's sequence word each turn; a record that
//! changed, verifies under the session's key, decodes as a `start_write`,
//! and is exactly the next message the session would bring is handled at
//! once, as from that session's identity, and its copy is dropped when the
//! session brings it. Anything else (another session's record, a replay, a
//! torn or forged write, a message before it still unread) is left to the
//! session, which carries every request as before: a mailbox only ever makes
//! a request arrive sooner, never a request the session would not deliver.
//!
//! ```text
//! mailbox := seq:u64 (seqlock word, unsigned)  record  frame:u8[len]
//! record  := index:u64le  len:u32le  version:u8=1  zero:u8[3]  tag:u8[32]  zero:u8[8]
//! tag     := HMAC-SHA256(key, "kvcr-request/1" | index | len | version | zero | frame)
//! ```

use std::cell::Cell;

use ring::hmac;

use super::record::{RecordKey, SIGNED, VERSION};
use super::region::{MAILBOX_FRAME_MAX, MAILBOX_HEAD, RECORD_BYTES};

/// Domain separation of a mailbox record's tag.
const REQUEST_LABEL: &[u8] = b"kvcr-request/1";
/// Where a mailbox record's tag lies (after index, len, version, zero).
const REQUEST_TAG: std::ops::Range<usize> = 16..48;

/// The frame length a mailbox record's head claims (unverified).
fn request_len(head: &[u8; RECORD_BYTES]) -> usize {
    usize::try_from(u32::from_le_bytes([head[8], head[9], head[10], head[11]]))
        .unwrap_or(usize::MAX)
}

impl RecordKey {
    /// A mailbox record: `frame` is the session's message `index`. `None`
    /// when the frame does not fit a mailbox.
    pub(crate) fn seal_request(&self, index: u64, frame: &[u8]) -> Option<Vec<u8>> {
        if frame.len() > MAILBOX_FRAME_MAX {
            return None;
        }
        let mut head = [0u8; RECORD_BYTES];
        head[..8].copy_from_slice(&index.to_le_bytes());
        head[8..12].copy_from_slice(&u32::try_from(frame.len()).ok()?.to_le_bytes());
        head[12] = VERSION;
        let tag = self.request_tag(&head[..SIGNED], frame);
        head[REQUEST_TAG].copy_from_slice(tag.as_ref());
        let mut record = Vec::with_capacity(RECORD_BYTES + frame.len());
        record.extend_from_slice(&head);
        record.extend_from_slice(frame);
        Some(record)
    }

    /// The index of a mailbox record (its `head`, and `frame`, the bytes
    /// after it) sealed with this key for exactly that frame (checked in
    /// constant time).
    pub(crate) fn open_request(&self, head: &[u8; RECORD_BYTES], frame: &[u8]) -> Option<u64> {
        if request_len(head) != frame.len()
            || head[12] != VERSION
            || head[13..SIGNED] != [0; 3]
            || head[REQUEST_TAG.end..] != [0; 8]
        {
            return None;
        }
        let mut signed = Vec::with_capacity(REQUEST_LABEL.len() + SIGNED + frame.len());
        signed.extend_from_slice(REQUEST_LABEL);
        signed.extend_from_slice(&head[..SIGNED]);
        signed.extend_from_slice(frame);
        hmac::verify(&self.0, &signed, &head[REQUEST_TAG]).ok()?;
        Some(u64::from_le_bytes(head[..8].try_into().ok()?))
    }

    fn request_tag(&self, head: &[u8], frame: &[u8]) -> hmac::Tag {
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(REQUEST_LABEL);
        ctx.update(head);
        ctx.update(frame);
        ctx.sign()
    }
}

/// Reads a mapping of a target's doorbell file, by the target's addresses.
pub(crate) trait MailboxView {
    /// The sequence word at `remote`, if it lies in the mapping.
    fn sequence(&self, remote: u64) -> Option<u64>;
    /// Copies the bytes at `remote` into `out`; `false` when they do not
    /// lie in the mapping.
    fn read_record(&self, remote: u64, out: &mut [u8]) -> bool;
}

/// A source's mailbox in a target's doorbell file (on a one-copy route),
/// read through `V`.
pub(crate) struct RouteMailbox<V> {
    key: RecordKey,
    slots: V,
    /// The target's address of the mailbox's sequence word.
    remote: u64,
    /// The sequence word when the mailbox was last read whole.
    seen: Cell<u64>,
}

/// What a look at a mailbox found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Polled {
    /// Nothing new, or a record being written (looked at again next turn).
    Quiet,
    /// A record that verifies under the session's key: message `index` of
    /// the session, as its codec frame (not yet decoded).
    Request { index: u64, frame: Vec<u8> },
    /// A new record that does not verify (forged, replayed from another
    /// session, garbage).
    Refused,
}

impl<V: MailboxView> RouteMailbox<V> {
    /// The mailbox at `remote` in `slots`, read under `key`, with what it
    /// holds now taken as already seen.
    pub(crate) fn new(key: RecordKey, slots: V, remote: u64) -> Option<Self> {
        let seen = slots.sequence(remote)?;
        Some(Self {
            key,
            slots,
            remote,
            seen: Cell::new(seen),
        })
    }

    /// Looks at the mailbox: one load when nothing changed.
    pub(crate) fn poll(&self) -> Polled {
        let Some(seq) = self.slots.sequence(self.remote) else {
            return Polled::Quiet;
        };
        if seq == self.seen.get() || seq % 2 == 1 {
            return Polled::Quiet;
        }
        let mut head = [0u8; RECORD_BYTES];
        if !self.slots.read_record(self.remote + 8, &mut head) {
            return Polled::Quiet;
        }
        // A length past the mailbox reads what fits, and fails to open.
        let mut frame = vec![0u8; request_len(&head).min(MAILBOX_FRAME_MAX)];
        if !self
            .slots
            .read_record(self.remote + MAILBOX_HEAD as u64, &mut frame)
        {
            return Polled::Quiet;
        }
        // Written meanwhile: whatever was copied may be torn; next turn.
        if self.slots.sequence(self.remote) != Some(seq) {
            return Polled::Quiet;
        }
        self.seen.set(seq);
        match self.key.open_request(&head, &frame) {
            Some(index) => Polled::Request { index, frame },
            None => Polled::Refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::record::tests::key;
    use crate::wire::region::{MAILBOX_BYTES, SLOT_BYTES};
    use kvcr_contracts::protocol::OpHandle;
    use std::cell::RefCell;

    #[test]
    fn a_request_record_opens_under_its_key_only_and_any_changed_bit_is_refused() {
        let frame = b"a start_write's frame".to_vec();
        let record = key(1).seal_request(7, &frame).unwrap();
        // A record as the mailbox holds it: its head, then its frame.
        let open = |key: RecordKey, record: &[u8]| {
            let head: &[u8; RECORD_BYTES] = record.get(..RECORD_BYTES)?.try_into().ok()?;
            key.open_request(head, record.get(RECORD_BYTES..)?)
        };
        assert_eq!(
            &record[RECORD_BYTES..],
            &frame[..],
            "the frame follows its head"
        );
        assert_eq!(open(key(1), &record), Some(7));
        assert_eq!(open(key(2), &record), None, "another session's key");
        // Slot records and message headers never pass for requests.
        assert_eq!(open(key(1), &key(1).seal(OpHandle(7), 1)), None);
        for at in 0..record.len() {
            for bit in 0..8 {
                let mut forged = record.clone();
                forged[at] ^= 1 << bit;
                assert_eq!(open(key(1), &forged), None, "byte {at} bit {bit}");
            }
        }
        assert_eq!(open(key(1), &record[..record.len() - 1]), None, "short");
        assert_eq!(open(key(1), &[0; RECORD_BYTES]), None, "blank");
        assert!(key(1).seal_request(0, &[0; MAILBOX_FRAME_MAX]).is_some());
        assert!(
            key(1)
                .seal_request(0, &[0; MAILBOX_FRAME_MAX + 1])
                .is_none()
        );
    }

    /// A mailbox in plain memory at address 0 (its sequence word, then its
    /// record and frame), written as a target's post writes it.
    struct Memory(RefCell<Vec<u8>>);

    impl MailboxView for Memory {
        fn sequence(&self, remote: u64) -> Option<u64> {
            let at = usize::try_from(remote).ok()?;
            let word = self.0.borrow().get(at..at + 8)?.try_into().ok()?;
            Some(u64::from_le_bytes(word))
        }

        fn read_record(&self, remote: u64, out: &mut [u8]) -> bool {
            let Ok(at) = usize::try_from(remote) else {
                return false;
            };
            match self.0.borrow().get(at..at + out.len()) {
                Some(bytes) => {
                    out.copy_from_slice(bytes);
                    true
                }
                None => false,
            }
        }
    }

    impl Memory {
        fn post(&self, seq: u64, record: &[u8]) {
            let mut bytes = self.0.borrow_mut();
            bytes[8..8 + record.len()].copy_from_slice(record);
            bytes[..8].copy_from_slice(&seq.to_le_bytes());
        }
    }

    /// The seqlock protocol alone, over plain memory: a record is read once
    /// the word is even and new, and only under its session's key; an odd
    /// word (a post under way) reads nothing yet.
    #[test]
    fn a_mailbox_reads_each_new_even_word_once() {
        let memory = Memory(RefCell::new(vec![0; MAILBOX_BYTES]));
        let mailbox = RouteMailbox::new(key(1), memory, 0).unwrap();
        assert_eq!(mailbox.poll(), Polled::Quiet, "nothing new");
        mailbox
            .slots
            .post(1, &key(1).seal_request(3, b"mid-write").unwrap());
        assert_eq!(mailbox.poll(), Polled::Quiet, "an odd word");
        mailbox
            .slots
            .post(2, &key(1).seal_request(3, b"whole").unwrap());
        let request = Polled::Request {
            index: 3,
            frame: b"whole".to_vec(),
        };
        assert_eq!(mailbox.poll(), request);
        assert_eq!(mailbox.poll(), Polled::Quiet, "read once");
        mailbox
            .slots
            .post(4, &key(2).seal_request(4, b"other").unwrap());
        assert_eq!(mailbox.poll(), Polled::Refused, "another session's key");
        assert_eq!(mailbox.poll(), Polled::Quiet);
        let outside = Memory(RefCell::new(vec![0; SLOT_BYTES]));
        assert!(RouteMailbox::new(key(1), outside, SLOT_BYTES as u64).is_none());
    }
}
