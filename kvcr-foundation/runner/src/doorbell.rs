//! The doorbell: a same-host source's early word that a write's bytes
//! landed, written into the target's memory instead of waiting for the
//! `write_done` to cross the control socket.
//!
//! Every target advertises [`SLOTS`] slots of [`SLOT_BYTES`] (a sealed
//! file beside its pools when they are shared segments, plain registered
//! memory otherwise, which no source can ring and which is never polled),
//! and, per session, a fresh key sent only inside that session's encrypted
//! frames. A source that maps the
//! target (a one-copy route) writes, the moment a write's copies end, a
//! record into slot `op % SLOTS` naming the target's operation and how many
//! keys landed (the first `n` asked for: other outcomes go by `write_done`
//! alone). The target, polling the slots of the operations it waits on while
//! it spins for their replies, takes a record that verifies as that
//! session's `write_done`; the source still sends the `write_done`, which
//! arrives as a duplicate and is ignored. Sources across hosts, or through
//! UCX, never ring: a record put behind a write's puts saved nothing over
//! tcp (UCX orders it behind the puts' acknowledgement, the same wait the
//! flush has), so it was not kept.
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
//! tag    := HMAC-SHA256(key, label | op | keys | version | zero)
//! label  := "kvcr-doorbell/1" (a slot) | "kvcr-write-message/1" (a message)
//! ```
//!
//! # Writes as messages
//!
//! The same key serves a source that writes through UCX (across hosts, or
//! over tcp): a small whole write leaves as one UCX active message whose
//! header is a record (under its own label, so neither kind passes for the
//! other) and whose data is the write's bytes, key by key. The target
//! verifies the record as above, asks its core where that operation's
//! granted elements are (only while it waits on it, under the core lock),
//! copies the bytes there only if their length is exactly theirs, and takes
//! the record as the `write_done`. The source sends no other: a put needs an
//! acknowledgement round trip before its `write_done` may leave (the flush),
//! a message carries its bytes and its completion together (64 KiB over
//! tcp: see README). A message that does not verify, or arrives after its
//! operation ended, is dropped unread; its operation then ends by deadline
//! and probe, never with bytes it did not get.
//!
//! # Requests in a mailbox
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

use std::collections::HashMap;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{
    Body, CompletedIndices, DoorbellAdvert, Header, Message, OpHandle, RegionAdvert, RegionId,
    RouteGeneration, SegmentAdvert, WriteOutcome,
};
use kvcr_runner_core::MAX_ADVERTISED_REGIONS;
use std::sync::Arc;

use crate::shared_memory::PeerSegment;
use kvcr_ucx::Registration;
use ring::hmac;

/// What a data stream's proof signs: its label, the acceptor's challenge
/// and the endpoint the dialer claims.
fn stream_signed(challenge: &[u8; 32], claim: &ControlEndpoint) -> Vec<u8> {
    let claim = claim.to_string();
    let mut signed = Vec::with_capacity(STREAM_LABEL.len() + challenge.len() + claim.len());
    signed.extend_from_slice(STREAM_LABEL);
    signed.extend_from_slice(challenge);
    signed.extend_from_slice(claim.as_bytes());
    signed
}

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
/// Domain separation: a doorbell slot's record...
const LABEL: &[u8] = b"kvcr-doorbell/1";
/// ...and a write message's header; the key signs nothing else.
const MESSAGE_LABEL: &[u8] = b"kvcr-write-message/1";
/// ...and a data stream's proof of the key (see `crate::stream`).
const STREAM_LABEL: &[u8] = b"kvcr-data-stream/1";
/// Both record labels are this long (the signed buffer's size).
const LABEL_LEN: usize = 20;
const _: () = assert!(LABEL.len() <= LABEL_LEN && MESSAGE_LABEL.len() <= LABEL_LEN);

/// The UCX active message id of a write message.
pub const WRITE_MESSAGE: u16 = 0x6b76;

/// A session's record key.
#[derive(Clone)]
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

    /// The record saying `keys` keys of `op` landed (a doorbell slot's).
    pub(crate) fn seal(&self, op: OpHandle, keys: u32) -> [u8; SLOT_BYTES] {
        self.seal_labelled(LABEL, op, keys, [0; 3])
    }

    /// The number of keys `record` says landed for `op`, if it is a slot
    /// record of `op` sealed with this key (checked in constant time).
    pub(crate) fn open(&self, op: OpHandle, record: &[u8; SLOT_BYTES]) -> Option<u32> {
        self.open_labelled(LABEL, op, record)
            .and_then(|(keys, tail)| (tail == [0; 3]).then_some(keys))
    }

    /// A write message's header: `part` of the bytes of the first `keys`
    /// keys of `op` is its data.
    pub(crate) fn seal_message(&self, op: OpHandle, keys: u32, part: Part) -> [u8; SLOT_BYTES] {
        self.seal_labelled(MESSAGE_LABEL, op, keys, part.to_bytes())
    }

    /// The number of keys a write message's `header` is a part of for
    /// `op`, and which part, if it was sealed with this key as a message
    /// header.
    pub(crate) fn open_message(
        &self,
        op: OpHandle,
        header: &[u8; SLOT_BYTES],
    ) -> Option<(u32, Part)> {
        let (keys, tail) = self.open_labelled(MESSAGE_LABEL, op, header)?;
        Some((keys, Part::from_bytes(tail)?))
    }

    /// The proof a data stream's dialer gives for `challenge` (the
    /// acceptor's) as `claim` (the dialer's control endpoint).
    pub(crate) fn stream_proof(&self, challenge: &[u8; 32], claim: &ControlEndpoint) -> [u8; 32] {
        let mut proof = [0u8; 32];
        proof.copy_from_slice(hmac::sign(&self.0, &stream_signed(challenge, claim)).as_ref());
        proof
    }

    /// Whether `proof` is [`RecordKey::stream_proof`] of `challenge` and
    /// `claim` under this key (checked in constant time).
    pub(crate) fn verify_stream_proof(
        &self,
        challenge: &[u8; 32],
        claim: &ControlEndpoint,
        proof: &[u8; 32],
    ) -> bool {
        hmac::verify(&self.0, &stream_signed(challenge, claim), proof).is_ok()
    }

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

    fn seal_labelled(
        &self,
        label: &[u8],
        op: OpHandle,
        keys: u32,
        tail: [u8; 3],
    ) -> [u8; SLOT_BYTES] {
        let mut record = [0u8; SLOT_BYTES];
        record[..8].copy_from_slice(&op.0.to_le_bytes());
        record[8..12].copy_from_slice(&keys.to_le_bytes());
        record[12] = VERSION;
        record[13..SIGNED].copy_from_slice(&tail);
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(label);
        ctx.update(&record[..SIGNED]);
        record[TAG].copy_from_slice(ctx.sign().as_ref());
        record
    }

    /// The key count and the three bytes after the version of a record of
    /// `op` that verifies under `label`.
    fn open_labelled(
        &self,
        label: &[u8],
        op: OpHandle,
        record: &[u8; SLOT_BYTES],
    ) -> Option<(u32, [u8; 3])> {
        if record_op(record) != op || record[12] != VERSION || record[TAG.end..] != [0; 16] {
            return None;
        }
        let mut signed = Vec::with_capacity(LABEL_LEN + SIGNED);
        signed.extend_from_slice(label);
        signed.extend_from_slice(&record[..SIGNED]);
        hmac::verify(&self.0, &signed, &record[TAG]).ok()?;
        let keys = u32::from_le_bytes(record[8..12].try_into().ok()?);
        let tail = record[13..SIGNED].try_into().ok()?;
        Some((keys, tail))
    }
}

/// Which part of a write's bytes a write message carries: the bytes of
/// the keys it completes, cut into `count` pieces of equal length (the last
/// shorter), in order; `index` is the piece. A write of one part is a
/// whole-write message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    index: u8,
    /// 1..=[`Part::MAX_COUNT`].
    count: u16,
}

impl Part {
    /// Most parts one write is cut into (the count travels in a byte).
    pub(crate) const MAX_COUNT: u16 = 256;
    /// A whole write.
    #[cfg(test)]
    pub(crate) const WHOLE: Part = Part { index: 0, count: 1 };

    /// Part `index` of `count`, if `index < count <= MAX_COUNT`.
    pub(crate) fn new(index: u16, count: u16) -> Option<Self> {
        (index < count && count <= Self::MAX_COUNT).then_some(Self {
            index: u8::try_from(index).ok()?,
            count,
        })
    }

    pub(crate) fn index(self) -> u16 {
        u16::from(self.index)
    }

    pub(crate) fn count(self) -> u16 {
        self.count
    }

    /// The parts `total` bytes are cut into, at most `part_bytes` each, if
    /// that is at most [`Part::MAX_COUNT`] (one part when `total` is 0).
    pub(crate) fn cut(total: u64, part_bytes: u64) -> Option<u16> {
        let count = total.div_ceil(part_bytes.max(1)).max(1);
        u16::try_from(count).ok().filter(|c| *c <= Self::MAX_COUNT)
    }

    /// This part's byte range of a write of `total` bytes; `None` when the
    /// cut leaves it empty (a part that cannot exist).
    pub(crate) fn range(self, total: u64) -> Option<std::ops::Range<u64>> {
        let piece = total.div_ceil(u64::from(self.count));
        let start = piece.checked_mul(u64::from(self.index))?;
        let end = start.saturating_add(piece).min(total);
        match self.count {
            1 => Some(0..total),
            _ => (start < end).then_some(start..end),
        }
    }

    /// The wire form: index, then count − 1 (zeros are a whole write, as
    /// before writes were cut), then a zero byte.
    fn to_bytes(self) -> [u8; 3] {
        // `count` is 1..=256, so count − 1 fits a byte.
        [self.index, (self.count - 1) as u8, 0]
    }

    fn from_bytes(bytes: [u8; 3]) -> Option<Self> {
        if bytes[2] != 0 {
            return None;
        }
        Self::new(u16::from(bytes[0]), u16::from(bytes[1]) + 1)
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

/// Bytes of a doorbell's slots.
pub(crate) const SLOTS_BYTES: usize = SLOTS as usize * SLOT_BYTES;

/// Mailboxes after the slots (sessions beyond it go without one).
pub(crate) const MAILBOXES: usize = 128;
/// Bytes per mailbox: the sequence word, the record, the frame.
pub(crate) const MAILBOX_BYTES: usize = 4096;
/// The sequence word and the record before a mailbox's frame.
const MAILBOX_HEAD: usize = 8 + RECORD_BYTES;
/// A mailbox record's bytes (after the sequence word).
const RECORD_BYTES: usize = 56;
/// The largest frame a mailbox carries; a larger request goes by the
/// session alone.
pub(crate) const MAILBOX_FRAME_MAX: usize = MAILBOX_BYTES - MAILBOX_HEAD;
/// Domain separation of a mailbox record's tag.
const REQUEST_LABEL: &[u8] = b"kvcr-request/1";
/// Where a mailbox record's tag lies (after index, len, version, zero).
const REQUEST_TAG: std::ops::Range<usize> = 16..48;

/// Bytes of a doorbell region (and file): slots, then mailboxes.
pub(crate) const REGION_BYTES: usize = SLOTS_BYTES + MAILBOXES * MAILBOX_BYTES;
const _: () = assert!(REGION_BYTES.is_multiple_of(SLOT_BYTES) && SLOTS_BYTES.is_multiple_of(8));

/// The frame length a mailbox record's head claims (unverified).
fn request_len(head: &[u8; RECORD_BYTES]) -> usize {
    usize::try_from(u32::from_le_bytes([head[8], head[9], head[10], head[11]]))
        .unwrap_or(usize::MAX)
}

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

/// Keys drawn at most for a session before it goes without a mailbox.
const MAILBOX_DRAWS: usize = 16;

/// Most operations a target watches slots for at once; past it, new ones
/// are left to their `write_done` (the set is also pruned every tick).
const MAX_AWAITED: usize = 4096;

/// A session's key as the target holds it.
struct SessionKey {
    /// The control session (we dialed) the key was sent on.
    session: u64,
    key: RecordKey,
    bytes: [u8; 32],
    /// The mailbox the key picks, when no other live session holds it.
    mailbox: Option<usize>,
    /// The source said it maps our file (so it may read the mailbox).
    maps_us: bool,
}

/// The target's side: the slots, the key per source session, and the
/// operations whose slots it watches.
pub(crate) struct TargetDoorbell {
    slots: Registration<'static>,
    advert: RegionAdvert,
    /// The slots' file, advertised beside the pools' (a same-host source
    /// maps it with them); `None` when the pools are not shared segments
    /// (the slots are then plain registered memory: the region is
    /// advertised for its key's sake, and no source rings it).
    segment: Option<SegmentAdvert>,
    keys: HashMap<ControlEndpoint, SessionKey>,
    awaited: HashMap<OpHandle, Awaited>,
}

/// An operation whose reply may come as a doorbell record or a write
/// message.
struct Awaited {
    /// The source it was sent to.
    source: ControlEndpoint,
    /// The parts of a write message that have landed, once one has.
    parts: Option<LandedParts>,
}

/// Which parts of an operation's write message have landed: the first one
/// fixes the key count and the cut, every later one must match them.
struct LandedParts {
    keys: u32,
    count: u16,
    landed: [u64; 4],
}

const _: () = assert!(Part::MAX_COUNT as usize <= 4 * 64);

impl LandedParts {
    /// The word and bit of `part` in `landed` (the index is below 256).
    fn position(part: Part) -> (usize, u64) {
        let index = usize::from(part.index());
        (index / 64, 1 << (index % 64))
    }

    fn has(&self, part: Part) -> bool {
        let (word, bit) = Self::position(part);
        self.landed.get(word).is_some_and(|w| w & bit != 0)
    }

    fn mark(&mut self, part: Part) {
        let (word, bit) = Self::position(part);
        if let Some(w) = self.landed.get_mut(word) {
            *w |= bit;
        }
    }
}

/// How a verified write message's part fits what has landed of its
/// operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartFit {
    /// Its bytes may be copied; the operation then has every part.
    Last,
    /// Its bytes may be copied; more parts are to come.
    More,
    /// Already landed, or cut differently from the operation's first part
    /// (a replay, or a source that lies): its bytes are never copied.
    Refused,
}

impl TargetDoorbell {
    /// `slots`: [`REGION_BYTES`] registered bytes, zeroed; `rkey` packed
    /// for them (every advertised region has one, and a source on another
    /// host unpacks it like the rest); `segment`: the advert of the shared
    /// file they are, when our pools are shared too.
    pub(crate) fn new(
        slots: Registration<'static>,
        rkey: Vec<u8>,
        segment: Option<SegmentAdvert>,
    ) -> Self {
        let advert = RegionAdvert {
            id: REGION,
            label: "kvcr-doorbell".to_owned(),
            base: slots.as_ptr() as usize as u64,
            element_size: SLOT_BYTES as u64,
            stride: SLOT_BYTES as u64,
            count: (REGION_BYTES / SLOT_BYTES) as u64,
            rkey,
        };
        Self {
            slots,
            advert,
            segment,
            keys: HashMap::new(),
            awaited: HashMap::new(),
        }
    }

    /// Adds the doorbell to `body` (metadata going to `to` on our session
    /// `session`), with that session's key (made on its first metadata):
    /// its region always (the key names it), its file when our pools are
    /// shared segments. Metadata that already names as many regions as a
    /// source accepts, or our region id, goes without one.
    pub(crate) fn advertise(&mut self, to: &ControlEndpoint, session: u64, body: &mut Body) {
        let Body::TargetMetadata {
            regions,
            shared_memory,
            doorbell,
            ..
        } = body
        else {
            return;
        };
        if regions.len() >= MAX_ADVERTISED_REGIONS || regions.iter().any(|r| r.id == REGION) {
            return;
        }
        if self.keys.get(to).is_none_or(|k| k.session != session) {
            // A new session: operations awaited on the old one are left to
            // their replies, and its mailbox is free.
            self.awaited.retain(|_, a| a.source != *to);
            self.keys.remove(to);
            let Some(key) = self.fresh_key(session) else {
                return;
            };
            self.keys.insert(to.clone(), key);
        }
        let Some(key) = self.keys.get(to) else {
            return;
        };
        // Shared segments are all-or-nothing for a source (it writes with
        // one copy only when it maps every region), so the doorbell's file
        // joins them.
        match (shared_memory.as_mut(), self.segment) {
            (Some(shared), Some(segment)) => shared.segments.push(segment),
            // Shared pools beside private slots cannot happen (both come
            // from the same setting); never advertise half a mapping.
            (Some(_), None) => return,
            (None, _) => {}
        }
        regions.push(self.advert.clone());
        *doorbell = Some(DoorbellAdvert {
            region: REGION,
            key: key.bytes,
        });
    }

    /// A fresh key for `session`, drawn until the mailbox it picks is held
    /// by no other live session (a few draws at most while few are; after
    /// [`MAILBOX_DRAWS`], the last key goes without a mailbox).
    fn fresh_key(&self, session: u64) -> Option<SessionKey> {
        let mut last = None;
        for _ in 0..MAILBOX_DRAWS {
            let (key, bytes) = RecordKey::generate()?;
            let mailbox = mailbox_of(&bytes);
            let free = self.keys.values().all(|k| k.mailbox != Some(mailbox));
            last = Some(SessionKey {
                session,
                key,
                bytes,
                mailbox: free.then_some(mailbox),
                maps_us: false,
            });
            if free {
                break;
            }
        }
        last
    }

    /// `source` said whether it maps our file (its metadata
    /// acknowledgement): only then are its requests posted to its mailbox.
    pub(crate) fn note_mapped(&mut self, source: &ControlEndpoint, maps_us: bool) {
        if let Some(key) = self.keys.get_mut(source) {
            key.maps_us = maps_us;
        }
    }

    /// Whether `source`'s acknowledgement on our current session to it said
    /// it maps our pools and file (then it writes with one copy, and no
    /// byte of it comes on a data stream).
    pub(crate) fn maps_us(&self, source: &ControlEndpoint) -> bool {
        self.keys.get(source).is_some_and(|k| k.maps_us)
    }

    /// Posts `frame` (the encoded `start_write` just sent to `to` as message
    /// `index` of our session `session`) to `to`'s mailbox, when `to` maps
    /// our file, the key it holds was sent on that session, and the frame
    /// fits. `true`: posted.
    pub(crate) fn post_request(
        &self,
        to: &ControlEndpoint,
        (session, index): (u64, u64),
        frame: &[u8],
    ) -> bool {
        let Some(key) = self.keys.get(to) else {
            return false;
        };
        let Some(mailbox) = key
            .mailbox
            .filter(|_| key.maps_us && key.session == session && self.segment.is_some())
        else {
            return false;
        };
        let Some(record) = key.key.seal_request(index, frame) else {
            return false;
        };
        crate::shared_memory::publish_shared(&self.slots, mailbox_offset(mailbox), &record)
    }

    /// The key we sent `source` on our current session to it, and that
    /// session's id (a data stream to `source` proves it).
    pub(crate) fn session_key(&self, source: &ControlEndpoint) -> Option<(u64, [u8; 32])> {
        self.keys.get(source).map(|k| (k.session, k.bytes))
    }

    /// A `start_write` for `op` went to `to`: watch its slot, if `to` has
    /// our doorbell.
    pub(crate) fn await_op(&mut self, to: &ControlEndpoint, op: OpHandle) {
        if self.keys.contains_key(to) && self.awaited.len() < MAX_AWAITED {
            self.awaited.insert(
                op,
                Awaited {
                    source: to.clone(),
                    parts: None,
                },
            );
        }
    }

    /// Whether any watched slot could hold a record: only a source that
    /// maps our slots' file rings, so without one (pools that are not
    /// shared) the slots are never read; the operations stay watched for
    /// their write messages.
    pub(crate) fn awaiting(&self) -> bool {
        self.segment.is_some() && !self.awaited.is_empty()
    }

    /// `op` ended (its reply came, or the core no longer waits on it).
    pub(crate) fn forget_op(&mut self, op: OpHandle) {
        self.awaited.remove(&op);
    }

    /// Our session to `source` ended: its key and watched slots go.
    pub(crate) fn forget_source(&mut self, source: &ControlEndpoint) {
        self.keys.remove(source);
        self.awaited.retain(|_, a| a.source != *source);
    }

    /// Keeps only the watched operations `waiting` says are still waited on.
    pub(crate) fn retain(&mut self, mut waiting: impl FnMut(OpHandle) -> bool) {
        self.awaited.retain(|op, _| waiting(*op));
    }

    /// The `write_done`s the watched slots hold now, each with the
    /// identity of the session its key was sent on (`dialed`: our session
    /// to an endpoint, its id and who answered it), and how many records
    /// naming a watched operation did not verify.
    pub(crate) fn take(
        &mut self,
        dialed: impl Fn(&ControlEndpoint) -> Option<(u64, Incarnation)>,
    ) -> (Vec<Message>, u64) {
        let mut taken = Vec::new();
        let mut refused = 0;
        for (op, Awaited { source, .. }) in &self.awaited {
            let mut record = [0u8; SLOT_BYTES];
            if !crate::shared_memory::read_shared(&self.slots, slot_offset(*op), &mut record) {
                continue;
            }
            if record_op(&record) != *op {
                continue;
            }
            let Some(key) = self.keys.get(source) else {
                continue;
            };
            let Some(keys) = key.key.open(*op, &record) else {
                refused += 1;
                continue;
            };
            if let Some(done) = write_done(source, key.session, *op, keys, &dialed) {
                taken.push((*op, done));
            }
        }
        for (op, _) in &taken {
            self.awaited.remove(op);
        }
        (taken.into_iter().map(|(_, m)| m).collect(), refused)
    }

    /// What a write message's `header` is, if it is a record of an
    /// operation we wait on, sealed as a message with the key of the
    /// session that operation was sent on (which must still be the session
    /// we hold to its source): the operation, how many keys its write
    /// completes, which part of their bytes the data is, and the
    /// `write_done` the whole write stands for. Nothing is marked: the
    /// caller asks [`TargetDoorbell::fit_part`], copies the bytes, then
    /// [`TargetDoorbell::land_part`]s them; the operation stays watched
    /// until [`TargetDoorbell::forget_op`].
    pub(crate) fn open_message(
        &self,
        header: &[u8],
        dialed: impl Fn(&ControlEndpoint) -> Option<(u64, Incarnation)>,
    ) -> Option<OpenedMessage> {
        let header: &[u8; SLOT_BYTES] = header.try_into().ok()?;
        let op = record_op(header);
        let source = &self.awaited.get(&op)?.source;
        let key = self.keys.get(source)?;
        let (keys, part) = key.key.open_message(op, header)?;
        let done = write_done(source, key.session, op, keys, &dialed)?;
        Some(OpenedMessage {
            op,
            keys,
            part,
            done,
        })
    }

    /// Whether an opened message's part may land (see [`PartFit`]).
    pub(crate) fn fit_part(&self, message: &OpenedMessage) -> PartFit {
        let Some(awaited) = self.awaited.get(&message.op) else {
            return PartFit::Refused;
        };
        let landed = match &awaited.parts {
            None => 0,
            Some(p) if p.keys != message.keys || p.count != message.part.count() => {
                return PartFit::Refused;
            }
            Some(p) if p.has(message.part) => return PartFit::Refused,
            Some(p) => p.landed.iter().map(|w| w.count_ones()).sum(),
        };
        if landed + 1 == u32::from(message.part.count()) {
            PartFit::Last
        } else {
            PartFit::More
        }
    }

    /// An opened message's part landed (its fit was not refused).
    pub(crate) fn land_part(&mut self, message: &OpenedMessage) {
        let Some(awaited) = self.awaited.get_mut(&message.op) else {
            return;
        };
        let parts = awaited.parts.get_or_insert(LandedParts {
            keys: message.keys,
            count: message.part.count(),
            landed: [0; 4],
        });
        parts.mark(message.part);
    }
}

/// The pieces of `spans` (start, length; laid end to end) that bytes
/// `range` of them cover, in order: how a write message's part maps onto
/// the write's spans, on both sides. Bytes past the spans' end are left
/// out.
pub(crate) fn spans_in_range(spans: &[(u64, u64)], range: std::ops::Range<u64>) -> Vec<(u64, u64)> {
    let mut pieces = Vec::new();
    let mut at = 0u64;
    for &(start, len) in spans {
        let (from, to) = (range.start.max(at), range.end.min(at.saturating_add(len)));
        if from < to {
            pieces.push((start + (from - at), to - from));
        }
        at = at.saturating_add(len);
        if at >= range.end {
            break;
        }
    }
    pieces
}

/// A write message whose header verified (see
/// [`TargetDoorbell::open_message`]).
pub(crate) struct OpenedMessage {
    pub(crate) op: OpHandle,
    pub(crate) keys: u32,
    pub(crate) part: Part,
    /// The whole write's `write_done`.
    pub(crate) done: Message,
}

impl OpenedMessage {
    /// The pieces of its operation's granted elements (`granted`: start,
    /// length, in the order the write fills them) that this part covers,
    /// if it carries exactly their `len` bytes.
    pub(crate) fn part_pieces(&self, granted: &[(u64, u64)], len: u64) -> Option<Vec<(u64, u64)>> {
        let total = granted
            .iter()
            .try_fold(0u64, |sum, (_, len)| sum.checked_add(*len))?;
        let range = self.part.range(total)?;
        (range.end - range.start == len).then(|| spans_in_range(granted, range))
    }
}

/// The `write_done` (the first `keys` keys of `op` landed) a verified record
/// from `source` stands for, believed only from the session its key went
/// out on (`key_session`), as that session's reply would be (`dialed`: our
/// session to an endpoint, its id and who answered it).
fn write_done(
    source: &ControlEndpoint,
    key_session: u64,
    op: OpHandle,
    keys: u32,
    dialed: &impl Fn(&ControlEndpoint) -> Option<(u64, Incarnation)>,
) -> Option<Message> {
    let (session, incarnation) = dialed(source)?;
    if session != key_session {
        return None;
    }
    Some(Message {
        header: Header {
            sender: incarnation,
            route_generation: RouteGeneration(0),
            sender_endpoint: source.clone(),
        },
        body: Body::WriteDone {
            op_handle: op,
            outcome: WriteOutcome::Completed(CompletedIndices::new((0..keys).collect())),
        },
    })
}

/// A source's doorbell on one route: where the target's slots are and the
/// session's key.
pub(crate) struct RouteDoorbell {
    key: RecordKey,
    pub(crate) region: RegionId,
    base: u64,
    /// The mailbox the session's key picks.
    mailbox: usize,
}

impl RouteDoorbell {
    /// The doorbell `advert` names, if its region was advertised with room
    /// for every slot (`regions`: id and base; `extents`: id and bytes).
    pub(crate) fn new(
        advert: &DoorbellAdvert,
        regions: &[(RegionId, u64, Vec<u8>)],
        extents: &[(RegionId, u64)],
    ) -> Option<Self> {
        let (_, base, _) = regions.iter().find(|(r, _, _)| *r == advert.region)?;
        let (_, extent) = extents.iter().find(|(r, _)| *r == advert.region)?;
        (*extent >= REGION_BYTES as u64).then(|| Self {
            key: RecordKey::new(&advert.key),
            region: advert.region,
            base: *base,
            mailbox: mailbox_of(&advert.key),
        })
    }

    /// This session's mailbox in `slots` (the mapping of the doorbell's
    /// file), with what it holds now taken as already seen.
    pub(crate) fn mailbox(&self, slots: Arc<PeerSegment>) -> Option<RouteMailbox> {
        let remote = self.base.checked_add(mailbox_offset(self.mailbox) as u64)?;
        let seen = slots.sequence(remote)?;
        Some(RouteMailbox {
            key: self.key.clone(),
            slots,
            remote,
            seen: std::cell::Cell::new(seen),
        })
    }

    /// The record for `op` (`keys` landed) and the target address of its slot.
    pub(crate) fn ring(&self, op: OpHandle, keys: u32) -> ([u8; SLOT_BYTES], u64) {
        (self.key.seal(op, keys), self.base + slot_offset(op) as u64)
    }
}

/// A source's mailbox in a target's doorbell file (on a one-copy route).
pub(crate) struct RouteMailbox {
    key: RecordKey,
    slots: Arc<PeerSegment>,
    /// The target's address of the mailbox's sequence word.
    remote: u64,
    /// The sequence word when the mailbox was last read whole.
    seen: std::cell::Cell<u64>,
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

impl RouteMailbox {
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
    use proptest::prelude::*;
    use rstest::rstest;

    fn key(byte: u8) -> RecordKey {
        RecordKey::new(&[byte; 32])
    }

    /// A data stream's proof verifies only under its key, for the
    /// challenge it answered and the endpoint it claimed: a recorded proof
    /// answers no fresh challenge and vouches for no other endpoint.
    #[test]
    fn a_stream_proof_verifies_only_for_its_key_challenge_and_claim() {
        let claim: ControlEndpoint = "tcp://10.0.0.1:5000".parse().unwrap();
        let other: ControlEndpoint = "tcp://10.0.0.2:5000".parse().unwrap();
        let proof = key(1).stream_proof(&[9; 32], &claim);
        assert!(key(1).verify_stream_proof(&[9; 32], &claim, &proof));
        assert!(!key(2).verify_stream_proof(&[9; 32], &claim, &proof));
        assert!(!key(1).verify_stream_proof(&[8; 32], &claim, &proof));
        assert!(!key(1).verify_stream_proof(&[9; 32], &other, &proof));
        // Nor does a record of the same key pass for a proof.
        let record = key(1).seal(OpHandle(9), 9);
        let mut as_proof = [0u8; 32];
        as_proof.copy_from_slice(&record[TAG]);
        assert!(!key(1).verify_stream_proof(&[9; 32], &claim, &as_proof));
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

    /// A target's doorbell in a shared file, and a source's mapping of that
    /// file (as a one-copy route maps it), with the target's base address.
    fn shared_doorbell() -> (TargetDoorbell, Arc<PeerSegment>, u64) {
        let context = kvcr_ucx::Context::new().unwrap();
        let file = crate::shared_memory::SharedPool::create(REGION_BYTES as u64, true).unwrap();
        let segment = file.advert(REGION);
        let scope = crate::shared_memory::HostScope::current().unwrap();
        let advert = kvcr_contracts::protocol::SharedMemoryAdvert {
            boot_id: scope.boot_id,
            pid_namespace: scope.pid_namespace,
            pid: std::process::id(),
            segments: vec![segment],
        };
        let slots = context.register_owned(Box::new(file)).unwrap();
        let base = slots.as_ptr() as usize as u64;
        let rkey = slots.pack_rkey().unwrap().as_bytes().to_vec();
        let view = PeerSegment::open(&advert, &segment, base, REGION_BYTES as u64).unwrap();
        (
            TargetDoorbell::new(slots, rkey, Some(segment)),
            Arc::new(view),
            base,
        )
    }

    /// The doorbell advert `db` sent `to` on `session`.
    fn advert_to(db: &mut TargetDoorbell, to: &ControlEndpoint, session: u64) -> DoorbellAdvert {
        let mut body = metadata(1, true);
        db.advertise(to, session, &mut body);
        let Body::TargetMetadata {
            doorbell: Some(advert),
            ..
        } = body
        else {
            panic!("no doorbell advertised: {body:?}");
        };
        advert
    }

    /// The source's mailbox on a route built from `advert`.
    fn route_mailbox(advert: &DoorbellAdvert, view: &Arc<PeerSegment>, base: u64) -> RouteMailbox {
        RouteDoorbell::new(
            advert,
            &[(REGION, base, Vec::new())],
            &[(REGION, REGION_BYTES as u64)],
        )
        .unwrap()
        .mailbox(Arc::clone(view))
        .unwrap()
    }

    #[test]
    fn a_request_is_posted_only_to_a_source_that_maps_us_and_read_there_once() {
        let (mut db, view, base) = shared_doorbell();
        let a = endpoint(1);
        let advert = advert_to(&mut db, &a, 10);
        let mailbox = route_mailbox(&advert, &view, base);
        assert_eq!(mailbox.poll(), Polled::Quiet);
        assert!(
            !db.post_request(&a, (10, 0), b"first"),
            "not known to map us"
        );
        db.note_mapped(&a, true);
        assert!(
            !db.post_request(&a, (11, 0), b"first"),
            "the key went on session 10"
        );
        assert!(!db.post_request(&endpoint(2), (10, 0), b"first"), "no key");
        assert!(db.post_request(&a, (10, 0), b"first"));
        let want = |index, frame: &[u8]| Polled::Request {
            index,
            frame: frame.to_vec(),
        };
        assert_eq!(mailbox.poll(), want(0, b"first"));
        assert_eq!(mailbox.poll(), Polled::Quiet, "read once");
        assert!(db.post_request(&a, (10, 1), b"second"));
        assert!(db.post_request(&a, (10, 2), b"third"));
        assert_eq!(mailbox.poll(), want(2, b"third"), "the latest record");
        assert!(!db.post_request(&a, (10, 3), &[0; MAILBOX_FRAME_MAX + 1]));
        db.note_mapped(&a, false);
        assert!(!db.post_request(&a, (10, 3), b"fourth"));
        assert_eq!(mailbox.poll(), Polled::Quiet);
        // Without a shared file, nothing is ever posted.
        let mut private = target_doorbell();
        private.segment = None;
        private.advertise(&a, 10, &mut metadata(1, false));
        assert!(private.session_key(&a).is_some());
        private.note_mapped(&a, true);
        assert!(!private.post_request(&a, (10, 0), b"first"));
    }

    #[test]
    fn live_sessions_never_share_a_mailbox() {
        let (mut db, _, _) = shared_doorbell();
        let mailboxes: Vec<usize> = (1..=64u16)
            .map(|port| mailbox_of(&advert_to(&mut db, &endpoint(port), u64::from(port)).key))
            .collect();
        let held: Vec<usize> = db.keys.values().filter_map(|k| k.mailbox).collect();
        let unique: std::collections::HashSet<_> = held.iter().collect();
        assert_eq!(unique.len(), held.len(), "no mailbox held twice");
        // Nearly all of 64 sessions find one of 128 within 16 draws.
        assert!(held.len() >= 60, "{} of 64 have a mailbox", held.len());
        assert!(mailboxes.iter().all(|m| *m < MAILBOXES));
        // A session that ends frees its mailbox for the next one.
        let freed = db.keys[&endpoint(1)].mailbox;
        db.forget_source(&endpoint(1));
        assert!(
            db.keys
                .values()
                .all(|k| k.mailbox != freed || freed.is_none())
        );
    }

    /// What any process that maps the file (another source) can do to a
    /// source's mailbox: write anything, replay, leave it half written. The
    /// mailbox reads nothing that its session's key did not seal; a replay
    /// of its own session's record verifies here, and is refused by the
    /// session's message count (`control`: only the next message is taken).
    #[test]
    fn a_mailbox_refuses_what_its_session_did_not_seal() {
        let (mut db, view, base) = shared_doorbell();
        let (a, b) = (endpoint(1), endpoint(2));
        let advert_a = advert_to(&mut db, &a, 10);
        let advert_b = advert_to(&mut db, &b, 20);
        db.note_mapped(&a, true);
        db.note_mapped(&b, true);
        let mailbox = route_mailbox(&advert_a, &view, base);
        let at = base + mailbox_offset(mailbox_of(&advert_a.key)) as u64;
        assert_ne!(mailbox_of(&advert_a.key), mailbox_of(&advert_b.key));
        let write = |seq: u64, record: &[u8]| {
            assert!(view.write_record(at + 8, record));
            assert!(view.write_record(at, &seq.to_le_bytes()));
        };
        let mut seq = view.sequence(at).unwrap();
        let mut next_seq = || {
            seq += 2;
            seq
        };
        // B's valid record, written into A's mailbox.
        let of_b = RecordKey::new(&advert_b.key)
            .seal_request(0, b"b's")
            .unwrap();
        write(next_seq(), &of_b);
        assert_eq!(mailbox.poll(), Polled::Refused);
        // Garbage, and a length past the mailbox.
        write(next_seq(), &[0xa5; 200]);
        assert_eq!(mailbox.poll(), Polled::Refused);
        let mut long = RecordKey::new(&advert_a.key).seal_request(1, b"x").unwrap();
        long[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        write(next_seq(), &long);
        assert_eq!(mailbox.poll(), Polled::Refused);
        // A record being written (odd word) is not read yet.
        assert!(db.post_request(&a, (10, 5), b"honest"));
        let honest = view.sequence(at).unwrap();
        assert!(view.write_record(at, &(honest + 1).to_le_bytes()));
        assert_eq!(mailbox.poll(), Polled::Quiet);
        assert!(view.write_record(at, &(honest + 2).to_le_bytes()));
        assert_eq!(
            mailbox.poll(),
            Polled::Request {
                index: 5,
                frame: b"honest".to_vec()
            }
        );
        // The same record again under a new word: it verifies (its own
        // session sealed it) with its old index, which the session refuses.
        assert!(view.write_record(at, &(honest + 4).to_le_bytes()));
        assert!(matches!(mailbox.poll(), Polled::Request { index: 5, .. }));
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

    fn endpoint(port: u16) -> ControlEndpoint {
        ControlEndpoint::parse(&format!("tcp://127.0.0.1:{port}")).unwrap()
    }

    fn incarnation(raw: u128) -> Incarnation {
        Incarnation::from_raw(raw).unwrap()
    }

    fn target_doorbell() -> TargetDoorbell {
        let context = kvcr_ucx::Context::new().unwrap();
        let slots = context.register_vec(vec![0; REGION_BYTES]).unwrap();
        let rkey = slots.pack_rkey().unwrap().as_bytes().to_vec();
        let segment = SegmentAdvert {
            region: REGION,
            fd: 3,
            token: [9; 16],
        };
        TargetDoorbell::new(slots, rkey, Some(segment))
    }

    fn metadata(regions: usize, shared: bool) -> Body {
        let region = |i: u32| RegionAdvert {
            id: RegionId(i),
            label: "kv".into(),
            base: 4096,
            element_size: 4096,
            stride: 4096,
            count: 1,
            rkey: vec![1],
        };
        Body::TargetMetadata {
            worker_address: vec![1],
            regions: (0..regions as u32).map(region).collect(),
            shared_memory: shared.then(|| kvcr_contracts::protocol::SharedMemoryAdvert {
                boot_id: [0; 16],
                pid_namespace: 1,
                pid: 1,
                segments: Vec::new(),
            }),
            doorbell: None,
        }
    }

    /// The key `advertise` put into metadata for `to` on `session`.
    fn advertised_key(db: &mut TargetDoorbell, to: &ControlEndpoint, session: u64) -> RecordKey {
        RecordKey::new(&advert_to(db, to, session).key)
    }

    /// A doorbell that advertised session 10 to `endpoint(1)` (returned)
    /// and session 20 to `endpoint(2)`, with the keys of both, in order.
    fn two_sessions() -> (TargetDoorbell, ControlEndpoint, RecordKey, RecordKey) {
        let mut db = target_doorbell();
        let (a, b) = (endpoint(1), endpoint(2));
        let key_a = advertised_key(&mut db, &a, 10);
        let key_b = advertised_key(&mut db, &b, 20);
        (db, a, key_a, key_b)
    }

    /// The identity every test session proves.
    const PROVEN: u128 = 77;

    /// A session lookup that finds `session` open, proven as [`PROVEN`].
    fn dialed(session: u64) -> impl Fn(&ControlEndpoint) -> Option<(u64, Incarnation)> {
        move |_| Some((session, incarnation(PROVEN)))
    }

    /// `message` is the `write_done` of operation 5 with keys 0 and 1 from
    /// `from`'s session: its proven identity, never anything a record says.
    fn assert_is_write_done_of_op_5(message: &Message, from: &ControlEndpoint) {
        assert_eq!(message.header.sender, incarnation(PROVEN));
        assert_eq!(&message.header.sender_endpoint, from);
        assert_eq!(
            message.body,
            Body::WriteDone {
                op_handle: OpHandle(5),
                outcome: WriteOutcome::Completed(CompletedIndices::new(vec![0, 1])),
            }
        );
    }

    fn ring(db: &TargetDoorbell, op: u64, record: &[u8; SLOT_BYTES]) {
        db.slots.write(slot_offset(OpHandle(op)), record).unwrap();
    }

    #[test]
    fn advertising_adds_the_region_its_segment_and_a_key_per_session() {
        let mut db = target_doorbell();
        let to = endpoint(1);
        let mut body = metadata(2, true);
        db.advertise(&to, 7, &mut body);
        let Body::TargetMetadata {
            regions,
            shared_memory: Some(shared),
            doorbell: Some(advert),
            ..
        } = &body
        else {
            panic!("{body:?}");
        };
        assert_eq!(regions.len(), 3);
        assert!(
            regions
                .iter()
                .any(|r| r.id == REGION && r.count * SLOT_BYTES as u64 == REGION_BYTES as u64)
        );
        assert_eq!(
            shared.segments.len(),
            1,
            "the slots' file joins the segments"
        );
        let first = advert.key;
        // The same session keeps its key; a new session gets a fresh one.
        let mut again = metadata(2, true);
        db.advertise(&to, 7, &mut again);
        assert!(matches!(&again, Body::TargetMetadata { doorbell: Some(a), .. } if a.key == first));
        let mut fresh = metadata(2, true);
        db.advertise(&to, 8, &mut fresh);
        assert!(matches!(&fresh, Body::TargetMetadata { doorbell: Some(a), .. } if a.key != first));
        // A source refuses metadata past the region cap: none is added then.
        let mut full = metadata(MAX_ADVERTISED_REGIONS, true);
        db.advertise(&to, 8, &mut full);
        assert!(
            matches!(&full, Body::TargetMetadata { doorbell: None, regions, .. } if regions.len() == MAX_ADVERTISED_REGIONS)
        );
        // Pools that are not shared segments: the key and its region (for
        // write messages), no file (no source maps anything).
        let mut body = metadata(1, false);
        db.advertise(&to, 9, &mut body);
        assert!(
            matches!(&body, Body::TargetMetadata { doorbell: Some(_), regions, shared_memory: None, .. } if regions.len() == 2)
        );
    }

    /// A record is believed only as its session's reply: sealed with the
    /// key sent on that session, in the slot of an operation sent to that
    /// source, while that same session is open; the sender is the
    /// session's proven identity, never anything the record says.
    #[test]
    fn a_record_is_taken_only_as_its_sessions_reply() {
        let (mut db, a, key_a, key_b) = two_sessions();
        db.await_op(&a, OpHandle(5));
        // Another member's key (b's session) for a's operation: refused.
        ring(&db, 5, &key_b.seal(OpHandle(5), 2));
        assert_eq!(db.take(dialed(10)).0.len(), 0);
        assert_eq!(db.take(dialed(10)).1, 1);
        // The right key, but the session it went out on was replaced.
        ring(&db, 5, &key_a.seal(OpHandle(5), 2));
        assert!(db.take(dialed(11)).0.is_empty());
        assert!(db.take(|_| None).0.is_empty(), "no open session: nothing");
        // Its own session: taken once, as that session's `write_done`.
        let (taken, refused) = db.take(dialed(10));
        assert_eq!(refused, 0);
        let [message] = taken.as_slice() else {
            panic!("{taken:?}");
        };
        assert_is_write_done_of_op_5(message, &a);
        assert!(!db.awaiting());
        // Replayed: the record still sits there, but nothing waits on it;
        // the slot's next operation does not match it.
        assert!(db.take(dialed(10)).0.is_empty());
        db.await_op(&a, OpHandle(5 + SLOTS));
        assert_eq!(db.take(dialed(10)), (Vec::new(), 0));
        // An operation never sent to a source with our doorbell is not watched.
        db.await_op(&endpoint(3), OpHandle(6));
        ring(&db, 6, &key_a.seal(OpHandle(6), 1));
        assert!(db.take(dialed(10)).0.is_empty());
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

    /// A message is believed only as its session's reply, for an operation
    /// we wait on, and stays watched until the caller took it (once its
    /// bytes are in place).
    #[test]
    fn a_message_opens_only_as_its_sessions_reply() {
        let (mut db, a, key_a, key_b) = two_sessions();
        let header = key_a.seal_message(OpHandle(5), 2, Part::WHOLE);
        assert!(
            db.open_message(&header, dialed(10)).is_none(),
            "not awaited"
        );
        db.await_op(&a, OpHandle(5));
        for refused in [
            db.open_message(&key_b.seal_message(OpHandle(5), 2, Part::WHOLE), dialed(10)),
            db.open_message(&key_a.seal(OpHandle(5), 2), dialed(10)),
            db.open_message(&header, dialed(11)),
            db.open_message(&header, |_| None),
            db.open_message(&header[..SLOT_BYTES - 1], dialed(10)),
            db.open_message(&[header.as_slice(), &[0]].concat(), dialed(10)),
        ] {
            assert!(refused.is_none());
        }
        let opened = db
            .open_message(&header, dialed(10))
            .expect("its own session");
        assert_eq!(
            (opened.op, opened.keys, opened.part),
            (OpHandle(5), 2, Part::WHOLE)
        );
        assert_is_write_done_of_op_5(&opened.done, &a);
        assert_eq!(db.fit_part(&opened), PartFit::Last);
        assert!(db.awaiting(), "still watched until taken");
        db.forget_op(opened.op);
        assert!(db.open_message(&header, dialed(10)).is_none(), "a replay");
    }

    /// The parts of one write each land once, cut alike: the last one
    /// completes it; a replayed part, or one cut differently or naming
    /// another key count than the first (a source that lies), is refused
    /// and never marks anything.
    #[test]
    fn each_part_of_a_message_lands_once_and_the_last_completes() {
        let (mut db, a, key_a, _) = two_sessions();
        db.await_op(&a, OpHandle(5));
        let opened = |db: &TargetDoorbell, keys: u32, index: u16, count: u16| {
            let part = Part::new(index, count).unwrap();
            db.open_message(&key_a.seal_message(OpHandle(5), keys, part), dialed(10))
                .expect("verifies")
        };
        let first = opened(&db, 2, 1, 3);
        assert_eq!(db.fit_part(&first), PartFit::More);
        db.land_part(&first);
        assert_eq!(db.fit_part(&first), PartFit::Refused, "a replay");
        assert_eq!(
            db.fit_part(&opened(&db, 2, 0, 4)),
            PartFit::Refused,
            "another cut"
        );
        assert_eq!(
            db.fit_part(&opened(&db, 3, 0, 3)),
            PartFit::Refused,
            "another key count"
        );
        let second = opened(&db, 2, 2, 3);
        assert_eq!(db.fit_part(&second), PartFit::More);
        db.land_part(&second);
        let last = opened(&db, 2, 0, 3);
        assert_eq!(db.fit_part(&last), PartFit::Last);
        assert_is_write_done_of_op_5(&last.done, &a);
        db.land_part(&last);
        db.forget_op(OpHandle(5));
        assert!(
            db.open_message(&key_a.seal_message(OpHandle(5), 2, Part::WHOLE), dialed(10))
                .is_none(),
            "nothing waits on it any more"
        );
    }

    /// A part's wire bytes (after the version): its index, its count − 1, a
    /// zero; all zeros are a whole write, as headers were before writes
    /// were cut. Anything else does not open.
    #[rstest]
    #[case::whole([0, 0, 0], Some((0, 1)))]
    #[case::second_of_three([1, 2, 0], Some((1, 3)))]
    #[case::last_of_most([255, 255, 0], Some((255, 256)))]
    #[case::index_past_count([2, 1, 0], None)]
    #[case::nonzero_pad([0, 0, 1], None)]
    fn a_part_travels_as_index_count_and_a_zero(
        #[case] bytes: [u8; 3],
        #[case] part: Option<(u16, u16)>,
    ) {
        let decoded = Part::from_bytes(bytes);
        assert_eq!(decoded.map(|p| (p.index(), p.count())), part);
        if let Some(p) = decoded {
            assert_eq!(p.to_bytes(), bytes);
        }
    }

    /// Bytes `range` of spans laid end to end, as pieces of those spans.
    #[rstest]
    #[case::inside_one(0..10, vec![(1000, 10)])]
    #[case::across_a_seam(90..110, vec![(1090, 10), (5000, 10)])]
    #[case::a_whole_span(100..150, vec![(5000, 50)])]
    #[case::all(0..160, vec![(1000, 100), (5000, 50), (9000, 10)])]
    #[case::past_the_end(155..400, vec![(9005, 5)])]
    #[case::empty(20..20, vec![])]
    fn a_byte_range_maps_onto_the_spans_it_covers(
        #[case] range: std::ops::Range<u64>,
        #[case] pieces: Vec<(u64, u64)>,
    ) {
        let spans = [(1000, 100), (5000, 50), (9000, 10)];
        assert_eq!(spans_in_range(&spans, range), pieces);
    }

    #[test]
    fn a_lost_session_forgets_its_key_and_watched_slots() {
        let mut db = target_doorbell();
        let a = endpoint(1);
        let key = advertised_key(&mut db, &a, 10);
        db.await_op(&a, OpHandle(9));
        db.forget_source(&a);
        assert!(!db.awaiting());
        ring(&db, 9, &key.seal(OpHandle(9), 1));
        db.await_op(&a, OpHandle(9));
        assert!(!db.awaiting(), "no key for it any more: not watched");
    }

    proptest! {
        /// A write cut into parts of at most `part_bytes`: the parts tile
        /// its bytes in order, none empty (a write of no bytes is one empty
        /// part), none longer than asked; a write needing more than
        /// `Part::MAX_COUNT` parts is not cut at all.
        #[test]
        fn parts_tile_their_write(total in 0u64..1 << 32, part_bytes in 1u64..1 << 22) {
            let Some(count) = Part::cut(total, part_bytes) else {
                prop_assert!(total.div_ceil(part_bytes) > u64::from(Part::MAX_COUNT));
                return Ok(());
            };
            let mut at = 0;
            for index in 0..count {
                let range = Part::new(index, count).unwrap().range(total).unwrap();
                prop_assert_eq!(range.start, at);
                prop_assert!(range.end > range.start || total == 0);
                prop_assert!(range.end - range.start <= part_bytes);
                at = range.end;
            }
            prop_assert_eq!(at, total);
            prop_assert_eq!(Part::new(count, count), None);
        }

        /// Whatever parts arrive, in any order, with replays and parts cut
        /// or counted differently mixed in: a part is let in only if its
        /// index has not landed and it matches the first landed part's key
        /// count and cut, and `Last` comes exactly once, when the first
        /// cut's parts have all landed.
        #[test]
        fn parts_land_once_each_and_complete_once(
            arrivals in proptest::collection::vec((1u32..3, 1u16..6, 0u16..6), 0..40),
        ) {
            let (mut db, a, key_a, _) = two_sessions();
            db.await_op(&a, OpHandle(5));
            let mut first: Option<(u32, u16)> = None;
            let mut landed = std::collections::BTreeSet::new();
            let mut completed = 0;
            for (keys, count, index) in arrivals {
                let Some(part) = Part::new(index, count) else {
                    continue;
                };
                let header = key_a.seal_message(OpHandle(5), keys, part);
                if completed > 0 {
                    // Nothing awaits the operation any more.
                    prop_assert!(db.open_message(&header, dialed(10)).is_none());
                    continue;
                }
                let opened = db.open_message(&header, dialed(10)).unwrap();
                let fits_first = first.is_none_or(|f| f == (keys, count));
                let expected = if !fits_first || landed.contains(&index) {
                    PartFit::Refused
                } else if landed.len() + 1 == usize::from(count) {
                    PartFit::Last
                } else {
                    PartFit::More
                };
                let fit = db.fit_part(&opened);
                prop_assert_eq!(fit, expected);
                if fit != PartFit::Refused {
                    db.land_part(&opened);
                    first.get_or_insert((keys, count));
                    landed.insert(index);
                }
                if fit == PartFit::Last {
                    completed += 1;
                    db.forget_op(OpHandle(5));
                }
            }
            prop_assert!(completed <= 1);
        }

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
